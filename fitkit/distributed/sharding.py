"""Each rank's share of the data, and ``predict``'s rows gathered back in input order."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from fitkit import nest
from fitkit.data import (
    DeviceLoader,
    TensorBatches,
    _index,
    _IterableBatches,
    _leaves,
    batch_size_of,
)
from fitkit.data.arrays import draw_order
from fitkit.data.order import set_epoch
from fitkit.data.resume_order import OrderShare, loader_order, rebuilt
from fitkit.distributed.group import (
    _broadcast_from_zero,
    all_gather_object,
    is_distributed,
    rank,
    world_size,
)


# -- data --------------------------------------------------------------------------------
class _AlreadySharded:
    def __init__(self, data: Any):
        self.data = data


def already_sharded(data: Any) -> Any:
    """Mark ``data`` as this rank's own share, so fitkit does not shard it again.

    Use it for inputs fitkit cannot shard (generators, ``IterableDataset``, a ``DataLoader``
    with a custom batch sampler), or for per-rank tensors. Every rank must then yield the
    same number of batches per epoch (or pass ``steps_per_epoch`` / ``steps``), since DDP
    steps all ranks together. Epoch logs are still exact means over all ranks' samples;
    ``predict`` returns rank 0's rows, then rank 1's, and so on.

    Example:
        >>> rank_batches = [(torch.zeros(2, 1), torch.zeros(2, 1))]
        >>> type(already_sharded(rank_batches)).__name__
        '_AlreadySharded'
    """
    return data if isinstance(data, _AlreadySharded) else _AlreadySharded(data)


def unwrap(data: Any) -> tuple[Any, bool]:
    """``(data, True)`` for :func:`already_sharded` data, else ``(data, False)``."""
    if isinstance(data, _AlreadySharded):
        return data.data, True
    return data, False


def _share(lo: int, m: int, r: int, w: int) -> tuple[int, int]:
    """Rank ``r``'s contiguous share ``[a, b)`` of the ``m`` samples that start at ``lo``.

    Shares differ by at most one sample; a global batch of full size gives each rank exactly
    ``batch_size`` samples.
    """
    base, extra = divmod(m, w)
    a = lo + r * base + min(r, extra)
    return a, a + base + (r < extra)


class ShardedTensorBatches(TensorBatches):
    """:class:`~fitkit.data.TensorBatches` split over ranks, sample-exact.

    Each epoch uses one permutation of all ``N`` samples, identical on every rank (rank 0
    draws ``torch.randperm(N)`` from the global generator, as one process would, and
    broadcasts it), cut into global batches of ``batch_size * world_size``; rank ``r`` takes
    the ``r``-th contiguous share of each global batch. Every rank runs
    ``ceil(N / (batch_size * world_size))`` batches; a share of a short last batch may be empty.
    ``shuffle="batch"`` shuffles the order of the global batches' chunks of rows instead.
    """

    def __init__(self, src: TensorBatches):
        super().__init__(src.x, src.y, src.w, src.batch_size, src.shuffle)
        self.rank, self.world = rank(), world_size()
        self._origin = 0  # where global batch 0 starts (a resume by samples moves it)
        self._rows_known: tuple[Any, bool] | None = None  # (the loss, rows are its denominators)

    @property
    def num_batches(self) -> int:
        return math.ceil(self.n / (self.batch_size * self.world))

    def _bounds(self, start: int = 0) -> Iterator[tuple[int, int]]:
        g = self.batch_size * self.world
        for lo in range(start, self.n, g):
            yield _share(lo, min(g, self.n - lo), self.rank, self.world)

    def iterate(self, epoch: int, skip: int = 0, skip_samples: int | None = None) -> Iterator[Any]:
        """This rank's shares of the epoch's global batches.

        ``skip``: global batches to leave out; ``skip_samples``: samples of the epoch's order
        to leave out instead (a resume at any world size and batch size: the rest of the
        order is cut into global batches of this fit).
        """
        x, y, w = self.x, self.y, self.w
        start = 0 if skip_samples is None else skip_samples
        g = self.batch_size * self.world
        # the global batch at index i starts at origin + i * g (indices count from the resume's)
        self._origin = 0 if skip_samples is None else start - (start // g) * g
        skip = skip if skip_samples is None else 0
        perm = None
        if self.shuffle:
            perm = draw_order(self.n, self.shuffle, g) if self.rank == 0 else torch.empty(self.n, dtype=torch.int64)
            perm = _broadcast_from_zero(perm)  # one broadcast of N indices per epoch
            leaves = _leaves(x)
            if leaves and leaves[0].device != perm.device:
                perm = perm.to(leaves[0].device)
        for s, (a, b) in enumerate(self._bounds(start)):
            if s < skip:
                continue
            idx = slice(a, b) if perm is None else perm[a:b]
            yield _index(x, idx), _index(y, idx), None if w is None else w[idx]

    def global_rows(self, step: int) -> int:
        """Rows of global batch ``step`` summed over all ranks (known on every rank's host)."""
        g = self.batch_size * self.world
        return max(0, min(g, self.n - (self._origin + step * g)))

    def positions(self) -> torch.Tensor:
        """Global positions (in epoch order) of the rows this rank yields, in yield order."""
        return torch.cat([torch.arange(a, b) for a, b in self._bounds()] or [torch.zeros(0, dtype=torch.int64)])


class ShardedLoaderBatches(_IterableBatches):
    """A plain ``DataLoader`` rebuilt on fitkit's :class:`~fitkit.data.resume_order.OrderShare`
    (or on the user's ``DistributedSampler``), without padded duplicates.

    Each epoch's order is the one a one-process iteration draws (rank 0's RNG states, the
    order broadcast once per epoch); local position ``j`` on rank ``r`` is position
    ``r + j * W`` of the order left to run, padding when it is ``>= m`` (those rows are cut off
    the last batch on the host; the batch may become empty, the step still runs). A global
    batch is thus a contiguous run of the order, and a resume continues with the order minus
    its done prefix at any world size and batch size (``skip_samples``).
    """

    def __init__(self, loader: DataLoader, shuffle: bool, generator: torch.Generator | None):
        super().__init__(loader)
        self.shuffle, self.generator = shuffle, generator
        self.rank, self.world = rank(), world_size()
        self.n = self.n_used = len(loader.dataset)  # type: ignore[arg-type]
        self._at(self.n, 0)

    def _at(self, m: int, first: int) -> None:
        """``m`` samples of the epoch left, the first of them in global batch ``first``."""
        self.m, self._first = m, first
        self.real = max(0, -(-(m - self.rank) // self.world))  # positions r + j*W < m

    @property
    def by_sample(self) -> bool:
        """Whether a resume can continue at a sample (fitkit's order; not a user's sampler)."""
        return isinstance(self.source.sampler, OrderShare)  # type: ignore[attr-defined]

    @property
    def num_batches(self) -> int:
        per_rank = -(-self.n // self.world)
        return -(-per_rank // self.source.batch_size)  # type: ignore[attr-defined]

    def iterate(self, epoch: int, skip: int = 0, skip_samples: int | None = None) -> Iterator[Any]:
        """This rank's batches of the epoch; ``skip_samples``: leave out that many samples of
        the epoch's order (the rest cut into this fit's global batches) instead of ``skip``."""
        sampler: Any = self.source.sampler  # type: ignore[attr-defined]
        if not isinstance(sampler, OrderShare):  # the user's DistributedSampler: their seed and order
            set_epoch(self.source, epoch)  # type: ignore[arg-type]  # and a batch sampler's, once each
            return self._truncate(iter(self.source), skip)
        order = torch.arange(self.n)
        if sampler.shuffle:
            order = loader_order(self.n, True, sampler.generator, self.generator) if self.rank == 0 else order
            order = _broadcast_from_zero(order)  # one broadcast of N indices per epoch
        start = skip_samples or 0
        sampler.run(order[start:])
        g = self.source.batch_size * self.world  # type: ignore[attr-defined]
        self._at(self.n - start, start // g if skip_samples is not None else 0)
        return self._truncate(iter(self.source), 0 if skip_samples is not None else skip)

    def iterate_samples(self, epoch: int, start: int) -> Iterator[Any]:
        return self.iterate(epoch, 0, start)

    def _truncate(self, it: Iterator[Any], skip: int) -> Iterator[Any]:
        seen = 0
        for s, batch in enumerate(it):
            m = batch_size_of(batch)
            keep = max(0, min(m, self.real - seen))
            seen += m
            if s < skip:
                continue
            yield batch if keep == m else _index(batch, slice(0, keep))

    def global_rows(self, step: int) -> int:
        """Rows of batch ``step`` summed over all ranks (known on the host)."""
        g = self.source.batch_size * self.world  # type: ignore[attr-defined]
        return max(0, min(g, self.m - (step - self._first) * g))

    def positions(self) -> torch.Tensor:
        return self.rank + self.world * torch.arange(self.real)


def _rows_are_denominators(loss: Any, y: Any, w: Any = None) -> bool:
    """Whether every batch's loss denominator is its row count, the same rule on every rank.

    ``y``/``w``: the targets and sample weights when known (in-memory data), ``None`` for a
    DataLoader's (its batches' weights, if any, are device tensors, seen per batch). Rows are
    the denominators unless the loss counts tokens (class indices of more than one per row, a
    class weight, or a target equal to ``ignore_index``: scanned once here, one host read) or
    sample weights weigh the rows. Probability targets of a class-index loss count rows.
    """
    from fitkit.losses import Loss

    if loss is None:
        return True
    if not isinstance(loss, Loss):  # several losses: their own denominators
        return False
    if isinstance(w, torch.Tensor):
        return False
    if loss.kind != "class_index":
        return True
    if not isinstance(y, torch.Tensor):
        return False
    if y.is_floating_point():  # probabilities over the classes: one term per row
        return True
    if y.dim() > 1 or loss.class_weights is not None:
        return False
    return loss.ignore_index is None or not bool((y == loss.ignore_index).any())


class HostRows:
    """``step -> rows of global batch step`` (a callable); ``exact``: those rows are the loss's
    denominators, whatever the batches' own denominators look like (tensors counting targets
    that are never ignored), so the ranks need no collective to agree on them."""

    __slots__ = ("rows", "exact")

    def __init__(self, rows: Callable[[int], int], exact: bool):
        self.rows, self.exact = rows, exact

    def __call__(self, step: int) -> int:
        return self.rows(step)


def host_rows(loader: DeviceLoader, loss: Any = None) -> HostRows | None:
    """``step -> rows of global batch step`` for fitkit's own shards, else ``None``.

    ``loss``: the compiled loss; a loss whose denominators are tokens or weights gets ``None``
    for in-memory data (whose targets and weights are known here, once per fit).

    Known on the host for in-memory data, and for a DataLoader whose batches are its samples
    (the default collate; rows cut off by fitkit are counted); not with ``steps_per_epoch``
    (an epoch's batch index is not the pass's) or a DataLoader that drops its last batch.
    """
    src = getattr(loader, "batches", None)
    if loader.steps is not None or loader.sharded is not True:
        return None
    if isinstance(src, ShardedTensorBatches):
        key = (id(loss), getattr(loss, "ignore_index", None), getattr(loss, "kind", None))
        if src._rows_known is None or src._rows_known[0] != key:  # one scan per data and loss
            src._rows_known = (key, _rows_are_denominators(loss, src.y, src.w))
        return HostRows(src.global_rows, exact=True) if src._rows_known[1] else None
    if isinstance(src, ShardedLoaderBatches) and _rows_are_denominators(loss, None):
        dl: Any = src.source
        if dl.collate_fn is default_collate and not dl.drop_last:
            return HostRows(src.global_rows, exact=False)  # a batch's weights: its sizes are tensors
    return None


def _shard_dataloader(dl: DataLoader) -> ShardedLoaderBatches:
    from torch.utils.data.distributed import DistributedSampler

    fix = (
        "Fix: pass tensors, a map-style Dataset or a plain DataLoader(dataset, batch_size=..., "
        "shuffle=...), or shard the data per rank yourself and pass "
        "fitkit.distributed.already_sharded(data)."
    )
    if isinstance(dl.dataset, IterableDataset):
        raise ValueError(
            f"Under torchrun fitkit shards the data per rank, but an IterableDataset "
            f"({type(dl.dataset).__name__}) cannot be split by index. Fix: split it by rank and worker "
            "and mark the loader: already_sharded(DataLoader(split_by_rank_and_worker(dataset), "
            "batch_size=..., num_workers=...)) (both in fitkit.distributed), or pass a map-style Dataset."
        )
    sampler = dl.sampler
    if isinstance(sampler, DistributedSampler):
        if sampler.num_replicas != world_size() or sampler.rank != rank():
            raise ValueError(
                f"The DataLoader's DistributedSampler has num_replicas={sampler.num_replicas}, "
                f"rank={sampler.rank}, but this process is rank {rank()} of {world_size()}. "
                "Fix: build it with the defaults, or let fitkit shard a plain DataLoader."
            )
        return ShardedLoaderBatches(dl, shuffle=False, generator=None)  # the user's seed and shuffle
    if type(dl) is not DataLoader or dl.batch_size is None or type(dl.batch_sampler) is not BatchSampler:
        raise ValueError(
            "Under torchrun fitkit replaces a DataLoader's sampler with its own rank shares, "
            f"which need a plain DataLoader with a batch_size; received a {type(dl).__name__} "
            f"with batch_sampler={type(dl.batch_sampler).__name__}. {fix}"
        )
    if type(sampler) is SequentialSampler:
        shuffle = False
    elif type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        shuffle = True
    else:
        raise ValueError(
            f"Under torchrun fitkit cannot shard a DataLoader whose sampler is a "
            f"{type(sampler).__name__}: its rank shares only reproduce sequential or "
            f"shuffled order. {fix}"
        )
    n = len(dl.dataset)  # type: ignore[arg-type]
    share = OrderShare(
        n,
        rank(),
        world_size(),
        shuffle,
        getattr(sampler, "generator", None) if shuffle else None,
        exhausts=n % (dl.batch_size * world_size()) != 0,
    )  # as one process with the global batch
    return ShardedLoaderBatches(rebuilt(dl, share), shuffle=shuffle, generator=dl.generator)


def sharded(make_loader: Any, data: Any, *args: Any, **kwargs: Any) -> DeviceLoader:
    """The one place that composes "to batches" and "shard": ``shard(make_loader(data, ...))``.

    ``make_loader`` is :func:`fitkit.data.as_loader` or :func:`fitkit.data.validation_loader`;
    data wrapped in :func:`already_sharded` is this rank's own share and is not split again.

    Example:
        >>> from fitkit.data import as_loader
        >>> sharded(as_loader, torch.zeros(5, 2), batch_size=2).num_batches
        3
    """
    data, already = unwrap(data)
    return shard(make_loader(data, *args, **kwargs), already)


def shard(loader: DeviceLoader, already: bool = False) -> DeviceLoader:
    """Split ``loader``'s batches over the ranks (a no-op on one process).

    Args:
        loader: what :func:`fitkit.data.as_loader` built.
        already: the data was marked with :func:`already_sharded`: keep it as it is.

    Raises:
        ValueError: an input that cannot be sharded (an iterable of batches, an
            ``IterableDataset``, a DataLoader with a custom sampler or batch sampler).
    """
    src = loader.batches
    if already or not is_distributed():
        loader.use_shards(src, "user" if already else False)
        return loader
    if isinstance(src, TensorBatches):
        shards: Any = ShardedTensorBatches(src)
    elif isinstance(src, _IterableBatches) and isinstance(src.source, DataLoader):
        shards = _shard_dataloader(src.source)
    else:
        raise ValueError(
            f"Under torchrun fitkit shards the data per rank, but an iterable of batches "
            f"({type(getattr(src, 'source', src)).__name__}) cannot be split without "
            "duplicates. Fix: pass tensors, a Dataset or a DataLoader, or shard the batches "
            "per rank yourself and pass fitkit.distributed.already_sharded(batches)."
        )
    loader.use_shards(shards, True)
    return loader


# -- predict -----------------------------------------------------------------------------
def gather_predictions(out: Any, loader: DeviceLoader) -> Any:
    """Every rank's predictions, every row once, in input order, on every rank (CPU).

    Fitkit-sharded inputs are put back by the global position of each row; inputs marked
    :func:`already_sharded` are concatenated in rank order.
    """
    sharded = getattr(loader, "sharded", False)
    if not sharded or not is_distributed():
        return out
    rows = nest.rows(out, unbatched=0)
    pos = loader.batches.positions()[:rows] if sharded is True else None  # type: ignore[union-attr]
    parts = all_gather_object((pos, out))
    if pos is None:
        return _merge([p for _, p in parts], None, 0)
    total = sum(len(p) for p, _ in parts)
    return _merge([o for _, o in parts], [p for p, _ in parts], total)


def _merge(parts: list[Any], positions: list[torch.Tensor] | None, total: int) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if positions is None:
            return torch.cat(parts)
        merged = first.new_empty((total, *first.shape[1:]))
        for pos, part in zip(positions, parts, strict=True):
            merged[pos] = part
        return merged
    if isinstance(first, (tuple, list)):
        return nest.rebuild(first, [_merge([p[i] for p in parts], positions, total) for i in range(len(first))])
    if isinstance(first, Mapping):
        return {k: _merge([p[k] for p in parts], positions, total) for k in first}
    return [o for p in parts for o in p]  # non-tensor outputs: a list of batch outputs per rank
