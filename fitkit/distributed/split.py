"""Iterables split by rank and DataLoader worker, and one epoch end agreed by every rank.

Data fitkit cannot split by index (an ``IterableDataset``, a generator, a stream) is split by
the user and marked :func:`~fitkit.distributed.already_sharded`. Two things go wrong there
without care:

- **Workers.** A ``DataLoader(num_workers=k)`` runs the dataset's ``__iter__`` in each of its
  ``k`` worker processes: a dataset split by rank only yields every sample ``k`` times.
  :func:`split_by_rank_and_worker` splits by both (``torch.utils.data.get_worker_info``, the
  rule of webdataset's ``split_by_node`` + ``split_by_worker``).
- **Uneven lengths.** DDP and FSDP pair every rank's collectives step by step; a rank with one
  more batch would pair its step's all-reduces with another rank's epoch-end ones. fitkit
  ends every rank's training epoch at the shortest rank's length (:func:`agree_on_epoch_end`),
  with a ``FitkitWarning`` that names the counts. A source with ``len()`` (a list, a sized
  dataset's DataLoader, ``steps_per_epoch``) costs one small gather per epoch, before it; a
  source without one costs one tiny all-reduce and a host read per step (each rank says
  whether it has the step's batch), so give such a source a ``__len__`` or pass
  ``steps_per_epoch`` when the per-step cost matters.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from fitkit import nest
from fitkit.checks import FitkitWarning
from fitkit.distributed.group import _comm_device, all_gather_object, is_distributed

__all__ = ["split_by_rank_and_worker", "RankWorkerSplit", "agree_on_epoch_end", "check_worker_copies"]


def _rank_and_world() -> tuple[int, int]:
    # In a DataLoader worker the process group is not usable; torchrun's variables are inherited.
    if dist.is_available() and dist.is_initialized() and get_worker_info() is None:
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class RankWorkerSplit(IterableDataset):
    """This rank's, this worker's share of ``source``: in epoch ``e``, item ``k`` goes to shard
    ``(k + e) mod (W * n)``.

    Shard ``rank * n + worker`` of ``W`` ranks times ``n`` workers per rank; every process reads
    the whole stream and keeps its own items (so the source's own order and randomness are
    the same everywhere, and re-seeding is up to it). Over one pass every item is yielded
    exactly once by exactly one (rank, worker). The deal turns by one shard each epoch
    (``fit`` calls :meth:`set_epoch`): when the stream's length is not a multiple of the
    shards, the ranks that get the extra items, and so the last batches that a shorter rank
    makes the others leave out, change from epoch to epoch instead of always being the stream's
    last items.

    Args:
        source: an iterable of samples (an ``IterableDataset``, a list, a re-iterable).

    Example:
        >>> split = RankWorkerSplit(range(6))
        >>> list(split), split.set_epoch(1), list(split)  # one process: every item, in order
        ([0, 1, 2, 3, 4, 5], None, [0, 1, 2, 3, 4, 5])
    """

    #: ``fit`` tells the dataset of a DataLoader that has it which epoch starts (:meth:`set_epoch`).
    follows_epoch = True

    def __init__(self, source: Iterable):
        if not isinstance(source, Iterable):
            raise TypeError(
                f"Expected `source` to be an iterable of samples. Received: a {type(source).__name__}. "
                "Fix: pass an IterableDataset, a list or another re-iterable."
            )
        self.source = source
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch that starts: the deal of items to shards turns by ``epoch`` shards."""
        self.epoch = int(epoch)

    def shard(self) -> tuple[int, int]:
        """``(index, count)`` of this process's shard."""
        r, w = _rank_and_world()
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return r * workers + worker, w * workers

    def __iter__(self) -> Iterator[Any]:
        index, count = self.shard()
        return itertools.islice(iter(self.source), (index - self.epoch) % count, None, count)


def split_by_rank_and_worker(source: Iterable) -> RankWorkerSplit:
    """Split an iterable of samples over ranks and DataLoader workers: each item once per pass.

    Wrap the dataset, put it in a ``DataLoader`` (any ``num_workers``), and mark the loader
    :func:`~fitkit.distributed.already_sharded`. Ranks may end with different numbers of
    batches; fitkit then ends every rank's epoch at the shortest (see this module's notes).

    Example:
        >>> list(split_by_rank_and_worker(range(5)))  # one process, no workers: everything
        [0, 1, 2, 3, 4]
    """
    return source if isinstance(source, RankWorkerSplit) else RankWorkerSplit(source)


def agree_on_epoch_end(loader: Any, it: Iterator[Any], start: int) -> Iterator[Any]:
    """``it`` cut so that every rank runs the same number of training batches this epoch.

    Only data marked ``already_sharded`` under torchrun is touched (fitkit's own shards are
    even by construction). ``start``: batches already done (a resume).
    """
    if getattr(loader, "sharded", False) != "user" or not is_distributed():
        return it
    counts = all_gather_object(loader.next_epoch_batches)  # one gather per epoch
    helper = isinstance(
        getattr(getattr(getattr(loader, "batches", None), "source", None), "dataset", None), RankWorkerSplit
    )
    if all(c is not None for c in counts):
        shortest = min(counts)
        if shortest != max(counts):
            _warn_uneven(f"the ranks have {', '.join(map(str, counts))} batches (rank order)", shortest, helper)
        return itertools.islice(it, max(shortest - start, 0))
    return _stop_together(it, start, helper)


def check_worker_copies(loader: Any, it: Iterator[Any]) -> Iterator[Any]:
    """``it`` unchanged, after a look at its first two batches when they come from an
    ``IterableDataset`` in a ``DataLoader`` with several workers: the first is worker 0's, the
    second worker 1's, and equal batches mean every worker yields the same samples (a dataset
    split by rank only, or not at all: each sample trained ``num_workers`` times). Then a
    ``FitkitWarning`` names the fix. Once per training loader (one host read of the comparison).
    """
    dl = getattr(getattr(loader, "batches", None), "source", None)
    if (
        not isinstance(dl, DataLoader)
        or not isinstance(dl.dataset, IterableDataset)
        or dl.num_workers < 2
        or isinstance(dl.dataset, RankWorkerSplit)
        or getattr(loader, "_workers_checked", False)
    ):
        return it
    loader._workers_checked = True
    head = list(itertools.islice(it, 2))
    if len(head) == 2 and _same(head[0], head[1]):
        warnings.warn(
            f"The DataLoader's first two batches are equal: its {dl.num_workers} workers (each runs "
            f"{type(dl.dataset).__name__}.__iter__) seem to yield the same samples, so every sample would be "
            f"trained {dl.num_workers} times per epoch. Fix: split by worker too, with "
            "fitkit.distributed.split_by_rank_and_worker(dataset) (ranks x workers; also on one process), or "
            "torch.utils.data.get_worker_info() in __iter__.",
            category=FitkitWarning,
            stacklevel=2,
        )
    return itertools.chain(head, it)


def _same(a: Any, b: Any) -> bool:
    la, lb = nest.leaves(a), nest.leaves(b)
    return len(la) == len(lb) and all(
        isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and u.shape == v.shape and torch.equal(u, v)
        for u, v in zip(la, lb, strict=True)
    )


def _stop_together(it: Iterator[Any], start: int, helper: bool = False) -> Iterator[Any]:
    """Per step: one all-reduce of "I have this batch" (MIN over ranks) and its host read."""
    step = start
    while True:
        batch = next(it, None)
        flag = torch.tensor([0 if batch is None else 1], dtype=torch.int32, device=_comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not int(flag.item()):  # a host read; only for sources without a length
            if batch is not None:
                _warn_uneven(f"another rank ran out of batches after {step}, this one had more", step, helper)
            return
        yield batch
        step += 1


def _warn_uneven(what: str, shortest: int, helper: bool = False) -> None:
    if helper:  # split_by_rank_and_worker is in use: its shards differ by one item at most
        fix = (
            "The split deals the items one by one, so the shards differ by an item at most, but each worker "
            "cuts its own last, short batch. Fix: DataLoader(..., drop_last=True) (every batch full; the "
            "left-over items are not trained that epoch), or steps_per_epoch=N for a count every rank has."
        )
    else:
        fix = (
            "Fix: give every rank the same number of batches (fitkit.distributed.split_by_rank_and_worker, "
            "or pass the data unsharded and let fitkit split it)."
        )
    warnings.warn(
        f"Uneven data over the ranks: {what}. Every rank ends the epoch after {shortest} batches, so "
        f"the others' extra batches are not trained this epoch (ranks must step together). {fix}",
        category=FitkitWarning,
        stacklevel=3,
    )
