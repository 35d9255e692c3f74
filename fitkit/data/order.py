"""The data order's state outside the global RNGs, for checkpoints: loaders' own generators.

fitkit replays an epoch's order from the global torch RNG state it started with (in-memory
data, a ``DataLoader`` shuffling from the global RNG). A ``DataLoader`` or sampler with its own
``generator`` (``DataLoader(shuffle=True, generator=torch.Generator().manual_seed(123))``),
a sampler with ``state_dict`` / ``load_state_dict``, and torchdata's ``StatefulDataLoader``
keep their state elsewhere, and so does a dataset with ``state_dict`` / ``load_state_dict`` (an
``IterableDataset`` that streams from a position of its own): :func:`capture` saves it and
:func:`restore` puts it back, so a resumed epoch draws the order the interrupted one drew (inside
an epoch: the state of the epoch's start, then fitkit skips the batches done). A dataset's own
``on_epoch_begin()`` / ``on_epoch_end()`` (Keras' ``PyDataset``) run at each training epoch's
begin and end (:func:`dataset_epoch_hook`); the state kept for an epoch is the one after its
``on_epoch_begin``, so a resume inside it runs the hook, then puts that state back.

A ``StatefulDataLoader`` resumes from its own ``state_dict`` (its workers included): fitkit
then skips no batch itself. Where fitkit cannot vouch for the order (an ``IterableDataset``,
a custom sampler without ``state_dict``), a resume inside an epoch warns before its first
step (:func:`order_is_restorable`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils import data as tud

from fitkit.checks import FitkitWarning
from fitkit.data.resume_order import OrderShare

__all__ = [
    "capture",
    "restore",
    "order_is_restorable",
    "is_stateful_loader",
    "at_checkpoint",
    "resume_inside_epoch",
    "set_epoch",
    "dataset_epoch_hook",
]

# Samplers whose order is a function of the generators fitkit saves (or of the epoch).
_KNOWN_SAMPLERS = (
    tud.SequentialSampler,
    tud.RandomSampler,
    tud.SubsetRandomSampler,
    tud.WeightedRandomSampler,
    tud.DistributedSampler,
    tud.BatchSampler,
    OrderShare,
)


def is_stateful_loader(source: Any) -> bool:
    """Whether ``source`` is a loader that saves its own position (torchdata's ``StatefulDataLoader``)."""
    return (
        isinstance(source, tud.DataLoader)
        and callable(getattr(source, "state_dict", None))
        and callable(getattr(source, "load_state_dict", None))
    )


def _source(loader: Any) -> Any:
    return getattr(getattr(loader, "batches", None), "source", None)


def _samplers(source: tud.DataLoader) -> list[Any]:
    out: list[Any] = []
    for s in (source.sampler, source.batch_sampler, getattr(source.batch_sampler, "sampler", None)):
        if s is not None and all(s is not t for t in out):
            out.append(s)
    return out


def set_epoch(source: tud.DataLoader, epoch: int) -> None:
    """Tell ``source``'s samplers which epoch starts, as Lightning and Accelerate do: each of its
    sampler, its batch sampler and the batch sampler's own sampler that has ``set_epoch`` (a
    ``DistributedSampler``, a bucketing batch sampler that seeds its order by epoch), once.

    A default ``BatchSampler`` wraps the loader's sampler itself: it is told once, not twice.
    A dataset that asks for it (``follows_epoch``: fitkit's ``split_by_rank_and_worker``) is told too.

    Example:
        >>> class Told(tud.SequentialSampler):
        ...     epochs = []
        ...     def set_epoch(self, epoch):
        ...         self.epochs.append(epoch)
        >>> told = Told(range(4))
        >>> set_epoch(tud.DataLoader(range(4), sampler=told, batch_size=2), 3); told.epochs
        [3]
    """
    for s in _samplers(source):
        tell = getattr(s, "set_epoch", None)
        if callable(tell):
            tell(epoch)
    dataset: Any = source.dataset
    if getattr(dataset, "follows_epoch", False):  # fitkit's split_by_rank_and_worker
        dataset.set_epoch(epoch)


def _generators(source: tud.DataLoader) -> list[torch.Generator]:
    out: list[torch.Generator] = []
    for holder in (source, *_samplers(source)):
        g = getattr(holder, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not h for h in out):
            out.append(g)
    return out


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _stateful_dataset(source: tud.DataLoader) -> Any:
    """The loader's dataset when it keeps a state of its own (``state_dict`` / ``load_state_dict``)."""
    return source.dataset if _has_state(source.dataset) else None


def _datasets(loader: Any) -> list[Any]:
    """The user's data objects behind a fit loader: a DataLoader's dataset and the datasets it
    wraps (``Subset``, fitkit's sample-weight wrapper; ``.dataset`` links), or the iterable given."""
    source = _source(loader)
    out: list[Any] = []
    obj = source.dataset if isinstance(source, tud.DataLoader) else source
    while obj is not None and all(obj is not o for o in out):
        out.append(obj)
        obj = getattr(obj, "dataset", None)
    return out


def dataset_epoch_hook(loader: Any, name: str) -> None:
    """Call the data's own ``on_epoch_begin()`` / ``on_epoch_end()`` (``name``), as Keras calls a
    ``PyDataset``'s: the first object behind ``loader`` (see :func:`_datasets`) that has it.

    Example:
        >>> from fitkit.data import as_loader
        >>> class Rows(tud.Dataset):
        ...     calls = []
        ...     def __len__(self): return 2
        ...     def __getitem__(self, i): return torch.zeros(1)
        ...     def on_epoch_end(self): self.calls.append("end")
        >>> dataset_epoch_hook(as_loader(Rows()), "on_epoch_end"); Rows.calls
        ['end']
    """
    for obj in _datasets(loader):
        hook = getattr(obj, name, None)
        if callable(hook):
            hook()
            return


def _stateful_samplers(source: tud.DataLoader) -> list[Any]:
    return [
        s
        for s in _samplers(source)
        if callable(getattr(s, "state_dict", None)) and callable(getattr(s, "load_state_dict", None))
    ]


def capture(loader: Any) -> dict[str, Any] | None:
    """The state of a fit loader's source outside the global RNGs, or ``None`` if it has none.

    Example:
        >>> from fitkit.data import as_loader
        >>> g = torch.Generator().manual_seed(123)
        >>> dl = tud.DataLoader(tud.TensorDataset(torch.arange(4.0)), batch_size=2, shuffle=True, generator=g)
        >>> state = capture(as_loader(dl))
        >>> first = [b[0].tolist() for b in dl]
        >>> restore(as_loader(dl), state)  # False: fitkit skips the done batches itself
        False
        >>> [b[0].tolist() for b in dl] == first  # the same order again
        True
    """
    source = _source(loader)
    if not isinstance(source, tud.DataLoader):
        return None
    if is_stateful_loader(source):
        rng = torch.get_rng_state()  # without a running iterator, state_dict starts one: it draws a seed
        try:
            return {"stateful": source.state_dict()}  # type: ignore[attr-defined]
        finally:
            torch.set_rng_state(rng)
    gens, samplers, dataset = _generators(source), _stateful_samplers(source), _stateful_dataset(source)
    if not gens and not samplers and dataset is None:
        return None
    state = {"generators": [g.get_state() for g in gens], "samplers": [s.state_dict() for s in samplers]}
    if dataset is not None:  # a dataset with a state of its own (Lightning saves it too)
        state["dataset"] = dataset.state_dict()
    return state


def restore(loader: Any, state: dict[str, Any] | None) -> bool:
    """Put :func:`capture`'s state back; returns whether the source resumes its position itself.

    Raises:
        ValueError: a state that does not fit the source (another kind of loader, another
            number of generators or stateful samplers).
    """
    source = _source(loader)
    if state is None or not isinstance(source, tud.DataLoader):
        return False
    if "stateful" in state:
        if not is_stateful_loader(source):
            raise ValueError(
                "The checkpoint holds the state of a StatefulDataLoader, but this fit's data is a "
                f"{type(source).__name__}. Fix: resume with the same kind of loader."
            )
        source.load_state_dict(state["stateful"])  # type: ignore[attr-defined]
        loader.batches.continue_own_position()  # it continues where it was: skip nothing
        return True
    gens, samplers, dataset = _generators(source), _stateful_samplers(source), _stateful_dataset(source)
    if ("dataset" in state) != (dataset is not None):
        raise ValueError(
            f"The checkpoint {'holds' if 'dataset' in state else 'holds no'} state of the training dataset, but "
            f"this fit's dataset ({type(source.dataset).__name__}) {'has no' if dataset is None else 'has a'} "
            "state_dict / load_state_dict. Fix: resume with the dataset built as before."
        )
    if len(gens) != len(state["generators"]) or len(samplers) != len(state["samplers"]):
        raise ValueError(
            f"The checkpoint holds the state of {len(state['generators'])} data generator(s) and "
            f"{len(state['samplers'])} stateful sampler(s), but this fit's DataLoader has {len(gens)} and "
            f"{len(samplers)}, so its order cannot be restored. Fix: resume with a DataLoader built as before."
        )
    for g, s in zip(gens, state["generators"], strict=True):
        g.set_state(s.cpu() if isinstance(s, torch.Tensor) else s)
    for sampler, s in zip(samplers, state["samplers"], strict=True):
        sampler.load_state_dict(s)
    if "dataset" in state:
        dataset.load_state_dict(state["dataset"])
    return False


def order_is_restorable(loader: Any) -> bool:
    """Whether a resume inside an epoch finds the interrupted epoch's order in ``loader``'s source.

    In-memory data, lists and generators of batches, DataLoaders over map-style datasets with
    torch's samplers (their generators are saved) or samplers with ``state_dict``, and
    ``StatefulDataLoader`` can; a DataLoader over an ``IterableDataset`` or with another
    sampler cannot be vouched for.
    """
    source = _source(loader)
    if not isinstance(source, tud.DataLoader) or is_stateful_loader(source):
        return True
    if isinstance(source.dataset, tud.IterableDataset):
        return _stateful_dataset(source) is not None  # its state at the epoch start replays the epoch
    stateful = _stateful_samplers(source)
    return all(isinstance(s, _KNOWN_SAMPLERS) or s in stateful for s in _samplers(source))


def at_checkpoint(loader: Any, epoch_start: dict[str, Any] | None, inside: bool) -> dict[str, Any] | None:
    """What a checkpoint keeps of the order: inside an epoch, the state the epoch started with
    (its order is replayed, then the done batches skipped), a ``StatefulDataLoader``'s state of
    now (it skips by itself); between epochs, the state of now."""
    source = _source(loader)
    if inside and not is_stateful_loader(source):
        return epoch_start
    return capture(loader)


def resume_inside_epoch(loader: Any, state: dict[str, Any] | None, epoch: int) -> None:
    """Before the first resumed step inside ``epoch``: restore the order, or warn it cannot be."""
    if restore(loader, state) or state is not None and order_is_restorable(loader):
        return
    if not order_is_restorable(loader):
        warnings.warn(
            f"Resuming inside epoch {epoch + 1}: fitkit skips the batches that epoch had done, but it "
            f"cannot restore the order of this {type(_source(loader)).__name__} (an IterableDataset, or a "
            "sampler without state_dict), so the skipped batches may not be the trained ones. Fix: use "
            "torchdata's StatefulDataLoader, a sampler with state_dict / load_state_dict, or checkpoint at "
            "epoch ends (save_freq='epoch').",
            category=FitkitWarning,
            stacklevel=5,
        )
