"""A ``DataLoader``'s epoch order as one global list of samples, for resumes by sample.

fitkit splits a plain ``DataLoader`` (``SequentialSampler`` or ``RandomSampler``, a batch size)
over ranks with :class:`OrderShare`: each epoch's order is the one a one-process iteration of
the loader draws (:func:`loader_order`, from the RNG states of the epoch start), whatever the
world size. A resume inside an epoch continues with that order minus the samples done (a prefix
of it: a global batch is a contiguous run of the order), cut into this fit's batches over this
fit's ranks (:func:`resumed_loader`), so it resumes by sample at any world size and batch size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

__all__ = ["OrderShare", "loader_order", "splittable", "rebuilt", "resumed_loader"]


def splittable(dl: Any) -> bool:
    """Whether ``dl`` is a DataLoader fitkit can re-split by sample: a plain ``DataLoader`` over a
    map-style dataset with a batch size and a ``SequentialSampler``, a ``RandomSampler`` without
    replacement, or fitkit's :class:`OrderShare`."""
    if type(dl) is not DataLoader or dl.batch_size is None or isinstance(dl.dataset, IterableDataset):
        return False
    s = dl.sampler
    plain = type(s) is SequentialSampler or type(s) is RandomSampler and not s.replacement and s._num_samples is None
    return type(dl.batch_sampler) is BatchSampler and (plain or isinstance(s, OrderShare))


def _advance(sampler: Any) -> None:
    """Draw what a ``RandomSampler``'s epoch draws from the RNGs: a seed from the global RNG,
    or a permutation from its own generator, and a second one when the epoch's last batch is
    short (the sampler then runs to its end, where it draws the permutation of its empty tail)."""
    if getattr(sampler, "shuffle", False):
        if sampler.generator is None:
            torch.empty((), dtype=torch.int64).random_()
        else:
            for _ in range(1 + sampler.exhausts):
                torch.randperm(sampler.n, generator=sampler.generator)


def loader_order(
    n: int, shuffle: bool, sampler_generator: torch.Generator | None, loader_generator: torch.Generator | None
) -> torch.Tensor:
    """The ``n`` sample indices one process's iteration of the loader draws now, in order.

    A ``DataLoader`` iterator draws its base seed (from ``loader_generator`` or the global
    RNG), then its ``RandomSampler`` a seed from the global RNG (or a permutation from
    ``sampler_generator``). The RNG states are left as they were.

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> dl = DataLoader(TensorDataset(torch.arange(6)), batch_size=6, shuffle=True)
        >>> order = loader_order(6, True, None, None)
        >>> next(iter(dl))[0].tolist() == order.tolist()
        True
    """
    if not shuffle:
        return torch.arange(n)
    gens = [g for g in (loader_generator, sampler_generator) if g is not None]
    gens = gens[:1] if len(gens) == 2 and gens[0] is gens[1] else gens
    state, states = torch.get_rng_state(), [g.get_state() for g in gens]
    try:
        torch.empty((), dtype=torch.int64).random_(generator=loader_generator)  # the iterator's base seed
        if sampler_generator is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            return torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        return torch.randperm(n, generator=sampler_generator)
    finally:
        torch.set_rng_state(state)
        for g, s in zip(gens, states, strict=True):
            g.set_state(s)


class OrderShare(Sampler[int]):
    """Rank ``rank``'s samples of the epoch's order left to run (:attr:`rest`): positions
    ``rank, rank + world, ...``, padded as ``DistributedSampler`` pads (the padded rows are cut
    off by fitkit). Its iteration draws from the RNGs what the replaced sampler's drew.

    ``exhausts``: whether a one-process epoch in global batches of this fit runs its sampler to
    the end (its last batch is short), which draws once more from a sampler's own generator.

    Example:
        >>> s = OrderShare(5, rank=1, world=2, shuffle=False, generator=None)
        >>> s.run(torch.tensor([4, 3, 2, 1, 0]))
        >>> list(s), len(s)  # positions 1, 3 and the padding (position 5: sample 4 again)
        ([3, 1, 4], 3)
    """

    def __init__(
        self, n: int, rank: int, world: int, shuffle: bool, generator: torch.Generator | None, exhausts: bool = True
    ):
        self.n, self.rank, self.world, self.shuffle, self.generator = n, rank, world, shuffle, generator
        self.rest = torch.arange(n)
        self.exhausts = exhausts

    def run(self, rest: torch.Tensor) -> None:
        """The next iteration runs ``rest``, the epoch's order left to run."""
        self.rest = rest

    def __len__(self) -> int:
        return -(-len(self.rest) // self.world)

    def __iter__(self) -> Iterator[int]:
        _advance(self)
        m, total = len(self.rest), len(self) * self.world
        idx = self.rest if total == m else self.rest.repeat(-(-total // m))[:total]
        return iter(idx[self.rank :: self.world].tolist())


def rebuilt(dl: DataLoader, sampler: Sampler) -> DataLoader:
    """``dl`` with ``sampler`` (everything else as it was)."""
    return DataLoader(
        dl.dataset,
        batch_size=dl.batch_size,
        sampler=sampler,
        num_workers=dl.num_workers,
        collate_fn=dl.collate_fn,
        pin_memory=dl.pin_memory,
        drop_last=dl.drop_last,
        timeout=dl.timeout,
        worker_init_fn=dl.worker_init_fn,
        multiprocessing_context=dl.multiprocessing_context,
        generator=dl.generator,
        prefetch_factor=dl.prefetch_factor,
        persistent_workers=dl.persistent_workers,
        pin_memory_device=dl.pin_memory_device,
    )


def resumed_loader(dl: DataLoader, start: int) -> DataLoader:
    """One process: ``dl``'s epoch from sample ``start`` of its order on (the RNG states are the
    epoch start's), in batches of ``dl.batch_size``; a loader for this one epoch."""
    s: Any = dl.sampler
    n = len(dl.dataset)  # type: ignore[arg-type]
    shuffle = isinstance(s, RandomSampler)
    share = OrderShare(n, 0, 1, shuffle, s.generator if shuffle else None, exhausts=n % (dl.batch_size or 1) != 0)
    share.run(loader_order(n, shuffle, share.generator, dl.generator)[start:])
    return rebuilt(dl, share)
