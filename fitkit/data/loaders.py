"""Loaders: :func:`as_loader`, the one entry point, and :class:`DeviceLoader`.

In-memory tensors and numpy arrays take the fast path of :mod:`~fitkit.data.arrays`; map-style
``Dataset`` objects get a ``DataLoader``; ``DataLoader`` objects and any other iterable of
batches are iterated as they are. :class:`DeviceLoader` is the only place where a batch changes
device; :class:`ClassWeights` folds ``class_weight`` into the per-sample weights.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from fitkit import nest
from fitkit.data.arrays import (
    Batch,
    TensorBatches,
    _is_map_dataset,
    _leaves,
    _sample_weight_tensor,
    _to_tensor,
    check_numeric_arrays,
    is_in_memory,
)
from fitkit.data.collate import NamingCollate, check_not_empty
from fitkit.data.hf_datasets import check_hf_dataset, is_hf_dataset
from fitkit.data.order import capture, is_stateful_loader, restore, set_epoch
from fitkit.data.resume_order import resumed_loader
from fitkit.data.weights import ClassWeights, class_weights, combine, single_target
from fitkit.devices import move_to_device

__all__ = [
    "as_loader",
    "validation_loader",
    "device_batch",
    "DeviceLoader",
    "ClassWeights",
    "unpack_batch",
    "known_targets",
]


def unpack_batch(batch: Any) -> Batch:
    """Split a batch into ``(x, y, sample_weight)``.

    A batch is ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``; a dict or a tensor is
    ``x`` alone. Missing parts are ``None``.

    Raises:
        ValueError: a tuple / list batch with more than 3 elements.

    Example:
        >>> x, y, w = unpack_batch((torch.zeros(2, 3), torch.ones(2)))
        >>> x.shape, y.shape, w
        (torch.Size([2, 3]), torch.Size([2]), None)
    """
    if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
        if len(batch) == 1:
            return batch[0], None, None
        if len(batch) == 2:
            return batch[0], batch[1], None
        if len(batch) == 3:
            return batch[0], batch[1], batch[2]
        raise ValueError(
            "Expected each batch to be `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`. "
            f"Received a {type(batch).__name__} of {len(batch)} elements. For a model with "
            "several inputs, yield `((x1, x2), y)`."
        )
    return batch, None, None


class _WeightedDataset(Dataset):
    """A map-style dataset with a per-sample weight appended to each item."""

    def __init__(self, dataset: Dataset, sample_weight: torch.Tensor):
        self.dataset, self.w = dataset, sample_weight

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int):
        x, y, _ = unpack_batch(self.dataset[i])
        return x, y, self.w[i]


class _IterableBatches:
    """Any re-iterable or one-shot iterable of batches (DataLoader, list, generator)."""

    def __init__(self, source: Iterable):
        self.source = source
        self.kind = type(source).__name__  # what the user passed (messages), even once wrapped
        self.resumed = False  # a StatefulDataLoader restored inside an epoch (fitkit.data.order)

    def continue_own_position(self) -> None:
        """The source restored its own position (a StatefulDataLoader): the next pass skips nothing."""
        self.resumed = True

    @property
    def num_batches(self) -> int | None:
        try:
            return len(self.source)  # type: ignore[arg-type]
        except TypeError:
            return None

    def iterate(self, epoch: int, skip: int = 0) -> Iterator[Any]:
        if isinstance(self.source, DataLoader):
            set_epoch(self.source, epoch)  # its sampler, batch sampler and the batch sampler's sampler
        it = iter(self.source)
        if self.resumed:  # it continues where its state_dict was taken: nothing to skip
            self.resumed, skip = False, 0
        for _ in range(skip):
            next(it, None)
        return it

    def iterate_samples(self, epoch: int, start: int) -> Iterator[Any]:
        """One process: the epoch from sample ``start`` of its order on (a resume by sample)."""
        return iter(resumed_loader(self.source, start))  # type: ignore[arg-type]

    @property
    def one_shot(self) -> bool:
        # Only an iterator is asked: iter() of a DataLoader builds one, which draws a seed from the
        # global RNG or the loader's own generator (a check would leave that trace).
        return isinstance(self.source, Iterator) and iter(self.source) is self.source

    def is_empty_iterator(self) -> bool:
        """Whether a one-shot source (a generator) yields nothing; a batch it yields is put back
        in front, so the first pass sees every batch (checked once, before step 1)."""
        if not self.one_shot:
            return False
        it = iter(self.source)
        first = next(it, _NOTHING)
        if first is _NOTHING:
            return True
        self.source = _PutBack([first], it)
        return False

    @contextlib.contextmanager
    def teed(self, n: int) -> Iterator[int]:
        """A one-shot source's first ``n`` batches for a check (the sanity validation): passes
        inside the body see only them; afterwards the source yields them again, then the rest,
        so the check consumes nothing. Yields how many there were (fewer at the source's end)."""
        rest = iter(self.source)
        head = list(itertools.islice(rest, n))
        self.source = iter(head)
        try:
            yield len(head)
        finally:
            self.source = _PutBack(head, rest)


_NOTHING = object()


class _PutBack:
    """A one-shot source whose first batches were looked at: those batches, then the rest.
    ``len()`` stays the source's (an iterator with ``__len__`` that cycles, Keras' ``Sequence``
    style, keeps its bound; a generator has none: ``TypeError``, as before)."""

    def __init__(self, head: list[Any], source: Iterator[Any]):
        self._it, self._source = itertools.chain(head, source), source

    def __iter__(self) -> Iterator[Any]:
        return self  # still one-shot

    def __next__(self) -> Any:
        return next(self._it)

    def __len__(self) -> int:
        return len(self._source)  # type: ignore[arg-type]


def source_name(loader: Any) -> str:
    """The type name of the data a loader reads (``generator``, ``DataLoader``, ``list``), for messages.

    Example:
        >>> source_name(DeviceLoader((x for x in []), torch.device("cpu")))
        'generator'
    """
    src = getattr(loader, "batches", loader)
    return getattr(src, "kind", None) or type(getattr(src, "source", src)).__name__


def known_targets(loader: Any) -> torch.Tensor | None:
    """The tensor every batch's targets are rows of, when the host knows it before the pass:
    in-memory ``y`` (also fitkit's per-rank shards of it), the second tensor of a
    ``DataLoader`` over a ``TensorDataset`` (or a ``Subset`` of one) collated by torch's default,
    or the ``targets`` tensor of any other map-style dataset there (torchvision's convention: the
    dataset yields ``targets[i]`` as sample ``i``'s target, and has no ``target_transform``);
    ``None`` for any other source, or a source whose batches carry ``class_weight``.

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> y = torch.tensor([0, 1, 1])
        >>> dl = DataLoader(TensorDataset(torch.zeros(3, 2), y), batch_size=2)
        >>> known_targets(DeviceLoader(dl, torch.device("cpu"))) is y
        True
    """
    from torch.utils.data import Subset, TensorDataset
    from torch.utils.data._utils.collate import default_collate as torch_collate

    if getattr(loader, "class_weight", None) is not None:
        return None
    src = getattr(loader, "batches", None)
    if isinstance(src, TensorBatches):  # fitkit's shards subclass it
        return src.y if isinstance(src.y, torch.Tensor) else None
    dl = getattr(src, "source", None)
    if not isinstance(dl, DataLoader) or not (dl.collate_fn is torch_collate or type(dl.collate_fn) is NamingCollate):
        return None
    data = dl.dataset
    while isinstance(data, Subset):
        data = data.dataset
    if type(data) is TensorDataset and len(data.tensors) in (2, 3):  # (x, y) or (x, y, sample_weight)
        return data.tensors[1]
    targets = getattr(data, "targets", None)  # torchvision's datasets, and datasets written like them
    if isinstance(targets, torch.Tensor) and getattr(data, "target_transform", None) is None:
        return targets
    return None


class DeviceLoader:
    """Iterate ``(x, y, sample_weight)`` batches on ``device``: the only place batches move.

    Args:
        source: a :class:`TensorBatches` or any iterable of batches.
        device: where the batches go.
        class_weight: optional :class:`ClassWeights`, folded into ``sample_weight``.
        steps: batches per epoch; the underlying iterator then persists across epochs and
            restarts when a re-iterable source runs out (Keras' ``steps_per_epoch``).

    Example:
        >>> dl = DeviceLoader([(torch.ones(2, 1), torch.zeros(2))], torch.device("cpu"))
        >>> [tuple(t.shape if t is not None else None for t in b) for b in dl]
        [(torch.Size([2, 1]), torch.Size([2]), None)]
    """

    def __init__(
        self,
        source: TensorBatches | Iterable,
        device: torch.device,
        class_weight: ClassWeights | None = None,
        steps: int | None = None,
    ):
        self.batches = source if isinstance(source, TensorBatches) else _IterableBatches(source)
        self.device = device
        self.class_weight = class_weight
        self.steps = steps
        self.epoch = 0  # the epoch last iterated (``epoch_batches``); plain iteration repeats it
        self.batch_size: int | None = getattr(source, "batch_size", None)
        self.ran_out = False  # the last epoch ended early: the data ran out before `steps`
        self.sharded: bool | str = False  # set by fitkit.distributed.shard
        self._persistent: Iterator | None = None
        self._pass_done = 0  # batches taken from the persistent iterator (with `steps`)
        self.pass_offset = 0  # batches of the current pass taken before the running epoch began
        self.pass_start: dict[str, Any] | None = None  # with `steps`: what drew the running pass
        # At most this many batches per epoch, the first ones of each epoch's pass (fit's
        # limit_train_batches / limit_val_batches / overfit_batches / fast_dev_run); None: all.
        self.limit: int | None = None

    def limit_to(self, n: int | None) -> None:
        """Run at most ``n`` batches per epoch from now on, the first ones of each epoch's pass
        (``None``: all); a resumed epoch counts the batches it skips against ``n``."""
        self.limit = n

    def _limited(self, n: int | None) -> int | None:
        if self.limit is None:
            return n
        return self.limit if n is None else min(self.limit, n)

    @property
    def num_batches(self) -> int | None:
        """Batches of a full epoch, ``None`` when unknown: ``min(steps, len)`` with ``steps``,
        and at most :attr:`limit` (the limit itself for a source without a length)."""
        n = self.batches.num_batches
        if self.steps is not None:
            return self._limited(self.steps if n is None else min(self.steps, n))
        return self._limited(n)

    @property
    def next_epoch_batches(self) -> int | None:
        """Batches the next epoch will run (``None`` when the source has no length).

        With ``steps`` the iterator carries over, so an epoch may get only what is left of the
        running pass: 10 batches with ``steps=9`` run 9, 1, 9, 1, ...

        Example:
            >>> dl = DeviceLoader([(torch.zeros(1, 1), torch.zeros(1))] * 10, torch.device("cpu"), steps=9)
            >>> runs = []
            >>> for _ in range(4):
            ...     planned = dl.next_epoch_batches
            ...     runs.append((planned, sum(1 for _ in dl)))
            >>> runs
            [(9, 9), (1, 1), (9, 9), (1, 1)]
        """
        n = self.batches.num_batches
        if self.steps is None or n is None:
            return self.num_batches
        left = n - self._pass_done if self._persistent is not None else n
        return self._limited(min(self.steps, left if left > 0 else n))

    def use_shards(self, batches: Any, sharded: bool | str) -> None:
        """Iterate ``batches``, one process's share (:func:`fitkit.distributed.shard` calls it).

        ``sharded``: ``True`` when fitkit split the data, ``"user"`` for data marked
        ``already_sharded``, ``False`` on one process.
        """
        self.batches, self.sharded = batches, sharded

    @property
    def carried_over(self) -> int:
        """With ``steps``: batches of the running pass that the next epoch continues after."""
        return self._pass_done if self.steps is not None and self._persistent is not None else 0

    def __iter__(self) -> Iterator[Batch]:
        return self.epoch_batches(self.epoch)

    def epoch_batches(
        self,
        epoch: int,
        skip: tuple[int, int | None] = (0, None),
        pass_offset: int = 0,
        pass_start: dict[str, Any] | None = None,
    ) -> Iterator[Batch]:
        """The batches of (0-based) ``epoch``, on the device.

        Args:
            epoch: the epoch (``set_epoch`` of a DataLoader's samplers and batch sampler, see
                :func:`fitkit.data.order.set_epoch`).
            skip: ``(batches, samples)`` a resume leaves out at the start of the epoch
                (``samples``, in-memory data only, wins when not ``None``; see
                :meth:`fitkit.training.position.Position.skip_for`).
            pass_offset: with ``steps``, a resume: batches of the pass to fast-forward past
                before the epoch (the pass carried over from the epochs before).
            pass_start: with ``steps``, a resume: the saved :attr:`pass_start` of that pass, so
                that it is drawn again as it was (``None``: a checkpoint of an older fitkit,
                whose rest of the pass is drawn anew).
        """
        self.epoch = epoch
        it = self._epoch_batches(skip[0], skip[1], pass_offset, pass_start)
        if self.limit is None:
            return it
        done = skip[0]  # a resume: the epoch's batches already run count against the limit
        if skip[1] is not None:
            done = -(-skip[1] // ((self.batch_size or 1) * getattr(self.batches, "world", 1)))
        return itertools.islice(it, max(self.limit - done, 0))

    def _pass_state(self) -> dict[str, Any] | None:
        """What the pass opened now draws its order from (:attr:`pass_start`): the epoch it opens
        in, the global torch RNG state and the source's own generators (:mod:`fitkit.data.order`);
        ``None`` for a ``StatefulDataLoader``, which saves its position itself. Once per pass."""
        if is_stateful_loader(getattr(self.batches, "source", None)):
            return None
        return {"epoch": self.epoch, "rng": torch.get_rng_state(), "order": capture(self)}

    def _redrawn(self, taken: int, start: dict[str, Any]) -> Iterator[Batch]:
        """A resume: the pass ``start`` (a saved :attr:`pass_start`) drew, without its first
        ``taken`` batches. Its order is drawn again from those states; the global RNG state is
        put back afterwards, the source's own generators stay where the pass left them (as in
        the run that saved it)."""
        now = torch.get_rng_state()
        torch.set_rng_state(start["rng"].cpu())
        restore(self, start.get("order"))
        try:
            it = self._prepare(self.batches.iterate(int(start["epoch"]), taken))
            head = next(it, None)  # the pass draws its order here
        finally:
            torch.set_rng_state(now)
        if head is not None:
            yield head
            yield from it

    def _epoch_batches(
        self, skip: int, skip_samples: int | None, offset: int, start: dict[str, Any] | None = None
    ) -> Iterator[Batch]:
        self.ran_out = False
        if self.steps is None:
            yield from self._epoch_pass(skip, skip_samples)
            return
        # Keras 3's steps_per_epoch: the iterator carries over across epochs; when it runs out
        # inside an epoch, that epoch ends early and the next one starts a fresh pass.
        skip = self._resumed_pass(skip, skip_samples, offset, start)
        self.pass_offset = self._pass_done - skip if self._persistent is not None else 0
        # The skipped batches count as done: a resumed epoch whose pass has run out ends early.
        remaining, fresh, done = self.steps - skip, False, skip
        while remaining > 0:
            if self._persistent is None:
                if fresh:
                    return  # a fresh pass yielded nothing: an empty (or used-up one-shot) source
                self.pass_start = self._pass_state()  # before the pass draws its order
                self._persistent, fresh = self._prepare(self.batches.iterate(self.epoch, 0)), True
                self._pass_done = self.pass_offset = 0  # it opens at the epoch's first batch
            for batch in self._persistent:
                self._pass_done += 1
                yield batch
                done += 1
                remaining -= 1
                if remaining == 0:
                    return
            self._persistent = None
            if done:
                self.ran_out = True
                return

    def _epoch_pass(self, skip: int, skip_samples: int | None) -> Iterator[Batch]:
        """The batches of one epoch without ``steps``: one pass of the source (its rest, on a resume)."""
        if skip_samples is not None:  # a resume by sample (Position.skip_for)
            src = self.batches
            it = (
                src.iterate(self.epoch, 0, skip_samples)
                if isinstance(src, TensorBatches)
                else src.iterate_samples(self.epoch, skip_samples)
            )
            return self._prepare(it)
        it = self._prepare(self.batches.iterate(self.epoch, skip))
        n = self.batches.num_batches
        # A source with len() gives len() batches per epoch (Keras), whatever it yields.
        return it if n is None else itertools.islice(it, max(n - skip, 0))

    def _resumed_pass(self, skip: int, skip_samples: int | None, offset: int, start: dict[str, Any] | None) -> int:
        """With ``steps``: on a resume, the pass as it was, fast-forwarded. Returns the batches skipped."""
        if skip_samples:  # in-memory data resumed by samples: whole batches of this size
            size = (self.batch_size or 1) * getattr(self.batches, "world", 1)
            skip = -(-skip_samples // size)  # the pass's short last batch counts as one
        if start is not None or offset or skip:  # a resume: the pass as it was, fast-forwarded
            self._persistent = (
                self._prepare(self.batches.iterate(self.epoch, offset + skip))
                if start is None
                else self._redrawn(offset + skip, start)
            )
            self._pass_done, self.pass_start = offset + skip, start
        return skip

    def _prepare(self, it: Iterator[Any]) -> Iterator[Batch]:
        src = self.batches
        if isinstance(src, TensorBatches) and all(t.device == self.device for t in nest.leaves((src.x, src.y, src.w))):
            return it  # in-memory data already on the device: its slices are the batches
        return self._moved(it)

    def _moved(self, it: Iterator[Any]) -> Iterator[Batch]:
        tensor_path = isinstance(self.batches, TensorBatches)
        device, cw = self.device, self.class_weight
        for batch in it:
            x, y, w = batch if tensor_path else unpack_batch(batch)
            if cw is not None and not tensor_path:
                if y is None:
                    raise ValueError(
                        "`class_weight` needs targets, but a batch had no `y`. Fix: yield `(x, y)` batches."
                    )
                y = single_target(_to_tensor(y) if isinstance(y, np.ndarray) else y)
                if y.device.type == "cpu":  # checked before it moves: no device sync
                    cw.check(y)
                w = combine(cw(y), w)
            if not tensor_path:
                x, y, w = (_to_tensor(a) if is_in_memory(a) else a for a in (x, y, w))
            yield move_to_device(x, device), move_to_device(y, device), move_to_device(w, device)


def device_batch(
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    device: torch.device,
    class_weight: Mapping | None = None,
) -> Batch:
    """One ``(x, y, sample_weight)`` batch on ``device``, through :class:`DeviceLoader`.

    The ``*_on_batch`` methods use it, so a single batch is converted (numpy -> torch), weighted
    (``class_weight``) and moved exactly as the batches of ``fit`` are.

    Example:
        >>> x, y, w = device_batch(np.zeros((2, 3)), np.array([0, 1]), device=torch.device("cpu"),
        ...                        class_weight={0: 1.0, 1: 2.0})
        >>> x.dtype, w.tolist()
        (torch.float32, [1.0, 2.0])
    """
    cw = class_weights(class_weight)
    return next(iter(DeviceLoader([(x, y, sample_weight)], device, cw)))


def _map_style(x: Any) -> bool:
    """A map-style torch ``Dataset``, or a Hugging Face ``datasets.Dataset`` (checked: torch format)."""
    if is_hf_dataset(x):  # indexable with a length, though not a torch Dataset
        check_hf_dataset(x)
        return True
    return _is_map_dataset(x)


def batches_itself(x: Any) -> bool:
    """Whether ``x`` makes its own batches (a ``DataLoader``, or any other iterable of batches),
    so that ``batch_size`` and ``shuffle`` cannot apply to it.

    Example:
        >>> batches_itself(DataLoader(torch.zeros(4, 2), batch_size=2)), batches_itself(torch.zeros(4, 2))
        (True, False)
        >>> batches_itself([(torch.zeros(2, 3), torch.zeros(2))]), batches_itself((np.zeros(3), np.zeros(3)))
        (True, False)
    """
    if x is None or isinstance(x, (str, bytes, IterableDataset)) or _is_frame(x) or is_in_memory(x):
        return False
    if is_hf_dataset(x) or _is_map_dataset(x):
        return False
    return isinstance(x, Iterable)


def _is_frame(x: Any) -> bool:
    """A pandas ``DataFrame`` or ``Series`` (pandas is not imported for the check)."""
    return type(x).__module__.partition(".")[0] == "pandas" and type(x).__name__ in ("DataFrame", "Series")


def _from_frame(a: Any, name: str) -> Any:
    """A pandas DataFrame / Series as a numpy array (as Keras accepts them); other values unchanged."""
    if not _is_frame(a):
        return a
    out = a.to_numpy(copy=True)  # writable: pandas' copy-on-write arrays are read-only
    if out.dtype.kind not in "biuf":
        raise TypeError(
            f"Expected `{name}` to hold numbers. Received a {type(a).__name__} whose values convert to numpy "
            f"dtype {out.dtype}. Fix: encode the non-numeric columns (e.g. `pd.get_dummies`) or select the "
            "numeric ones."
        )
    return out


def _refuse_separate_y(x: Any) -> None:
    """``y`` beside an ``x`` that is not arrays: the error with the fix for what ``x`` is."""
    if isinstance(x, list):
        raise TypeError(
            "Expected `x` to be a tensor or numpy array (or a tuple / list / dict of them) beside a separate `y`. "
            "Received: x a plain list (of numbers, or of batches). Fix: pass `np.asarray(x, dtype=np.float32)` "
            "for rows of numbers; a list of `(x, y)` batches carries its own targets, so drop `y=`."
        )
    raise ValueError(
        f"`y` must be None when `x` is a {type(x).__name__}: the targets come from its "
        "batches. Fix: have it yield `(x, y)` batches and drop `y=`."
    )


def as_loader(
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    batch_size: int = 32,
    shuffle: bool | str = False,
    class_weight: Mapping | None = None,
    steps: int | None = None,
    device: torch.device | None = None,
) -> DeviceLoader:
    """Turn any supported input into a :class:`DeviceLoader`. Checks everything it can first.

    One process's view: under torchrun, :func:`fitkit.distributed.sharded` composes this with
    each rank's share of the batches.

    Args:
        x: tensors / arrays (or tuples, lists, dicts of them), a ``Dataset`` (a Hugging Face
            ``datasets.Dataset`` in the ``"torch"`` format too, see :mod:`fitkit.data.hf_datasets`),
            a ``DataLoader`` or any iterable of batches.
        y: targets, for in-memory ``x`` only (other inputs carry their targets in batches).
        sample_weight: ``(N,)`` per-sample weights for in-memory ``x`` or a map-style Dataset.
        batch_size: samples per batch for in-memory ``x`` and Datasets.
        shuffle: reshuffle each epoch (in-memory ``x`` and Datasets; ``"batch"``: chunks of in-memory rows).
        class_weight: ``{class_index: weight}``, folded into the sample weights.
        steps: batches per epoch (needed for infinite iterables).
        device: where batches go (default: the CPU).

    Raises:
        TypeError: ``x`` is none of the supported kinds.
        ValueError: lengths differ, ``y`` or ``sample_weight`` given with a loader or
            iterable, a label has no class weight, a ``datasets.Dataset`` without the ``"torch"``
            format; rows of a Dataset of different lengths (at their first batch: pass a
            DataLoader with a padding collator).

    Example:
        >>> dl = as_loader(np.zeros((5, 2)), np.arange(5), batch_size=2)
        >>> [b[0].shape[0] for b in dl], dl.num_batches
        ([2, 2, 1], 3)
    """
    cw = class_weights(class_weight)
    device = torch.device("cpu") if device is None else device
    x, y = _from_frame(x, "x"), _from_frame(y, "y")
    if is_in_memory(x):
        return _in_memory_loader(x, y, sample_weight, cw, batch_size, shuffle, steps, device)
    if y is not None:
        _refuse_separate_y(x)
    x = _batches_of(x, sample_weight, batch_size, shuffle)
    loader = DeviceLoader(x, device, cw, steps)
    loader.batch_size = getattr(x, "batch_size", None)  # a DataLoader's (None for other iterables)
    return loader


def _in_memory_loader(
    x: Any,
    y: Any,
    sample_weight: Any,
    cw: ClassWeights | None,
    batch_size: int,
    shuffle: bool | str,
    steps: int | None,
    device: torch.device,
) -> DeviceLoader:
    """:func:`as_loader` for in-memory ``x``: tensors (on the device when they fit) sliced into batches."""
    if y is not None and not is_in_memory(y):
        raise TypeError(
            "Expected `y` to be a tensor or numpy array (or a tuple / list / dict of them) "
            f"with one row per sample. Received: y of type {type(y).__name__}. "
            "Fix: pass `torch.as_tensor(y)`."
        )
    check_numeric_arrays(x, "x")
    check_numeric_arrays(y, "y")
    x, y = _to_tensor(x), _to_tensor(y) if y is not None else None
    w = _in_memory_weights(y, sample_weight)
    source = TensorBatches(x, y, w, batch_size, shuffle)
    if cw is not None:
        source.w = _class_weighted(cw, y, w)
    if device.type == "cuda" and sum(t.numel() * t.element_size() for t in _leaves((x, y))) < 2**30:
        source.to(device)  # one copy up front beats one per batch for data that fits
    return DeviceLoader(source, device, None, steps)


def _in_memory_weights(y: Any, sample_weight: Any) -> torch.Tensor | None:
    """``sample_weight`` for in-memory data: one weight per sample, or one per target position."""
    w = None
    if sample_weight is not None:
        w = _sample_weight_tensor(sample_weight)
        if w.dim() > 1 and not (isinstance(y, torch.Tensor) and w.shape == y.shape):
            raise ValueError(
                "Expected `sample_weight` to be a 1-D array with one weight per sample, or shaped like y "
                f"({tuple(y.shape) if isinstance(y, torch.Tensor) else 'a tensor'}) for one weight per target "
                f"position. Received shape {tuple(w.shape)}. Fix: pass shape (N,)."
            )
    return w


def _class_weighted(cw: ClassWeights, y: Any, w: torch.Tensor | None) -> torch.Tensor:
    """``class_weight`` folded into the sample weights ``w`` (``y``: the class labels)."""
    if y is None:
        raise ValueError(
            "`class_weight` weighs each sample by the class in `y`, but y=None. A dict batch's 'labels' are "
            "not read for it, and with compile(loss=None) the loss is the module's: weights cannot reach "
            "a mean it takes itself. Fix: pass the class labels as `y=` with a compiled loss (e.g. "
            "loss='cross_entropy'), or have the module return one loss per sample (shape (B,)) and pass "
            "`y=` (or sample_weight=)."
        )
    y = single_target(y)
    cw.check(y.cpu())
    return combine(cw(y), w)


def _batches_of(x: Any, sample_weight: Any, batch_size: int, shuffle: bool | str) -> Any:
    """:func:`as_loader` for any other ``x``: a Dataset as a ``DataLoader``, a loader or iterable as it is."""
    map_style = _map_style(x)
    if isinstance(x, (str, bytes)) or not isinstance(x, Iterable) and not map_style:
        raise TypeError(
            "Expected `x` to be tensors, numpy arrays (or tuples / lists / dicts of them), a "
            f"Dataset, a DataLoader or an iterable of batches. Received: {type(x).__name__}."
        )
    if map_style:
        if sample_weight is not None:
            w = _sample_weight_tensor(sample_weight)
            if len(w) != len(x):
                raise ValueError(
                    f"`sample_weight` has {len(w)} entries but the Dataset has {len(x)} samples. "
                    "Fix: pass one weight per sample."
                )
            x = _WeightedDataset(x, w)
        check_not_empty(x)
        x = DataLoader(x, batch_size=batch_size, shuffle=bool(shuffle), collate_fn=NamingCollate())
    elif isinstance(x, IterableDataset):
        x = DataLoader(x, batch_size=batch_size)
    elif sample_weight is not None:
        raise ValueError(
            f"`sample_weight` cannot be combined with x of type {type(x).__name__}. "
            "Fix: yield `(x, y, sample_weight)` batches instead."
        )
    return x


def _same_rows(parts: Any) -> bool:
    rows = {int(t.shape[0]) for p in parts if p is not None for t in nest.leaves(_to_tensor(p)) if t.dim()}
    return len(rows) == 1


def validation_loader(validation_data: Any, *, batch_size: int, device: torch.device) -> DeviceLoader:
    """The :class:`DeviceLoader` for ``fit(validation_data=...)`` (Keras' forms).

    Args:
        validation_data: ``(x_val, y_val)`` or ``(x_val, y_val, sample_weight)`` of arrays or
            tensors, ``(x_val,)`` (for a custom ``compute_loss``), a Dataset, a DataLoader, or
            any iterable of batches (a list of ``(x, y)`` tuples included).
        batch_size: samples per batch for arrays and Datasets.
        device: where batches go.

    Raises:
        ValueError: a tuple / list of arrays that is none of the forms above.

    Example:
        >>> dl = validation_loader((torch.zeros(5, 2), torch.zeros(5)), batch_size=2,
        ...                        device=torch.device("cpu"))
        >>> dl.num_batches
        3
    """
    # A tuple / list whose every element is a tuple / list is a list of batches (as for `x`).
    arrays = isinstance(validation_data, (tuple, list)) and not all(
        isinstance(b, (tuple, list)) for b in validation_data
    )
    # A tuple (x_val, y_val) whose parts are themselves tuples of arrays (several inputs or
    # outputs) is still (x_val, y_val), as in Keras; a list of tuples is a list of batches.
    if (
        isinstance(validation_data, tuple)
        and len(validation_data) in (2, 3)
        and all(v is None or is_in_memory(v) for v in validation_data)
        and _same_rows(validation_data)
    ):
        arrays = True
    if (
        arrays
        and len(validation_data) in (2, 3)
        and all(
            v is None or is_in_memory(v) or i == 0 and _is_map_dataset(v)  # Dataset: validation_split
            for i, v in enumerate(validation_data)
        )
    ):
        vx, vy, vw = (*validation_data, None)[:3]
        return as_loader(vx, vy, vw, batch_size=batch_size, device=device)
    if arrays and (len(validation_data) > 3 or not is_in_memory(validation_data)):
        raise ValueError(
            "Expected `validation_data` to be `(x_val, y_val)`, `(x_val, y_val, sample_weight)`,"
            f" a Dataset, a DataLoader or an iterable. Received a {type(validation_data).__name__}"
            f" of {len(validation_data)} elements."
        )
    return as_loader(validation_data, batch_size=batch_size, device=device)
