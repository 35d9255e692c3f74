"""In-memory data: tensors and numpy arrays, or tuples / lists / dicts whose leaves all are.

The fast path of :func:`~fitkit.data.as_loader`: :class:`TensorBatches` slices batches out of
tensors with one ``randperm`` per epoch, and :func:`split_validation` cuts off the validation
part before any shuffling. Nested structures are walked with :mod:`fitkit.nest`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from fitkit import nest
from fitkit.devices import move_to_device

__all__ = ["is_in_memory", "batch_size_of", "TensorBatches", "split_validation", "draw_order"]

Batch = tuple[Any, Any, Any]


def is_in_memory(x: Any) -> bool:
    """Whether ``x`` is a tensor, a numpy array, or a tuple / list / dict whose leaves all are.

    A list of ``(x, y)`` tuples or of dicts is not in memory in this sense: it is an iterable
    of batches.

    Example:
        >>> is_in_memory((torch.zeros(3), np.zeros(3))), is_in_memory([1, 2, 3])
        (True, False)
        >>> is_in_memory([(torch.zeros(2, 3), torch.zeros(2))]), is_in_memory([{"input_ids": torch.zeros(2, 3)}])
        (False, False)
    """
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(x, (tuple, list)):
        # (x1, x2) of arrays is several inputs; a list of (x, y) tuples is a list of batches,
        # and so is a list of dicts (Hugging Face-style batches {"input_ids": ..., "labels": ...}).
        batch_types = (tuple, list, Mapping) if isinstance(x, list) else (tuple, list)
        return len(x) > 0 and all(is_in_memory(v) and not isinstance(v, batch_types) for v in x)
    if isinstance(x, Mapping):
        return len(x) > 0 and all(is_in_memory(v) for v in x.values())
    return False


def check_numeric_arrays(a: Any, name: str) -> None:
    """Refuse NumPy arrays torch cannot hold (object, str, datetime dtypes), named by their place in ``a``.

    Example:
        >>> check_numeric_arrays({"ids": np.zeros(2), "text": np.array(["a", "b"], dtype=object)}, "x")
        Traceback (most recent call last):
        ...
        TypeError: Expected `x['text']` to be a numeric array (bool, int, float or complex). Received an array of dtype object, shape (2,). Fix: convert it, e.g. np.asarray(..., dtype=np.float32), or tokenize text into ids first.
    """  # noqa: E501
    if isinstance(a, np.ndarray):
        if a.dtype.kind not in "biufc":
            raise TypeError(
                f"Expected `{name}` to be a numeric array (bool, int, float or complex). Received an array of "
                f"dtype {a.dtype}, shape {a.shape}. Fix: convert it, e.g. np.asarray(..., dtype=np.float32), "
                "or tokenize text into ids first."
            )
    elif isinstance(a, Mapping):
        for k, v in a.items():
            check_numeric_arrays(v, f"{name}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        for i, v in enumerate(a):
            check_numeric_arrays(v, f"{name}[{i}]")


def _numpy_to_torch(a: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(torch.get_default_dtype()) if t.dtype == torch.float64 else t


def _to_tensor(a: Any) -> Any:
    """numpy -> torch in a nested structure (float64 becomes the default float dtype, as Keras
    casts to floatx); tensors are kept."""
    return nest.map_structure(_numpy_to_torch, a, leaf=np.ndarray)


def _leaves(a: Any) -> list[torch.Tensor]:
    return nest.leaves(a)


def _index(a: Any, idx: Any) -> Any:
    return nest.map_structure(lambda t: t[idx], a)


def batch_size_of(x: Any) -> int:
    """Number of samples in a batch: the first dimension of its first tensor (1 if none).

    Example:
        >>> batch_size_of({"a": torch.zeros(5, 2)})
        5
    """
    leaves = _leaves(x)
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() > 0 else 1


def _check_lengths(named: dict[str, Any]) -> int:
    lengths: dict[str, int] = {}
    for name, value in named.items():
        if value is None:
            continue
        for leaf in _leaves(value):
            if leaf.dim() == 0:
                raise ValueError(
                    f"Expected `{name}` to have a batch dimension. Received a 0-dim tensor. "
                    f"Fix: pass `{name}` with shape (N, ...)."
                )
            lengths.setdefault(name, int(leaf.shape[0]))
            if int(leaf.shape[0]) != lengths[name]:
                raise ValueError(
                    f"All arrays inside `{name}` must have the same length. Received lengths "
                    f"{[int(t.shape[0]) for t in _leaves(value)]}."
                )
    if len(set(lengths.values())) > 1:
        got = ", ".join(f"{k}: {v}" for k, v in lengths.items())
        raise ValueError(
            f"`x`, `y` and `sample_weight` must have the same number of samples. Received {got}. "
            "Fix: make the first dimensions match."
        )
    return next(iter(lengths.values()), 0)


def draw_order(n: int, shuffle: Any, batch_size: int) -> torch.Tensor:
    """An epoch's order of ``n`` rows from the global generator: ``torch.randperm(n)``, or with
    ``shuffle="batch"`` (Keras) the chunks of ``batch_size`` consecutive rows in a random order,
    each chunk's rows in place, a short last chunk still last.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> draw_order(7, "batch", 2).tolist()  # chunks [0, 1], [2, 3], [4, 5] shuffled; [6] stays last
        [4, 5, 0, 1, 2, 3, 6]
    """
    if shuffle != "batch":
        return torch.randperm(n)
    full = n // batch_size
    chunks = torch.randperm(full)
    rows = (chunks[:, None] * batch_size + torch.arange(batch_size)).flatten()  # (full * batch_size,)
    return torch.cat([rows, torch.arange(full * batch_size, n)])


class TensorBatches:
    """Batches sliced from in-memory tensors: the fast path.

    Each epoch draws one ``torch.randperm(N)`` from the global generator (exactly what a
    hand-written loop does, so results match it) and yields index slices; no per-sample
    collate. Without shuffling, batches are contiguous views.

    Args:
        x: inputs, a tensor or a tuple / list / dict of tensors with ``N`` rows.
        y: targets with ``N`` rows, or ``None``.
        sample_weight: ``(N,)`` weights, or ``None``.
        batch_size: samples per batch; the last batch may be smaller.
        shuffle: reshuffle every epoch (``"batch"``: the order of batch-sized chunks, see
            :func:`draw_order`).

    Example:
        >>> tb = TensorBatches(torch.arange(5.0), None, None, batch_size=2, shuffle=False)
        >>> [b[0].tolist() for b in tb.iterate(0)]
        [[0.0, 1.0], [2.0, 3.0], [4.0]]
    """

    def __init__(self, x: Any, y: Any, sample_weight: Any, batch_size: int, shuffle: bool | str):
        self.x, self.y, self.w = x, y, sample_weight
        self.n = _check_lengths({"x": x, "y": y, "sample_weight": sample_weight})
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last_single = False  # leave out a one-row last batch (BatchNorm; see preflight)

    @property
    def n_used(self) -> int:
        """The samples an epoch trains on, ``N`` less a dropped one-row last batch."""
        return self.n - 1 if self.drop_last_single else self.n

    @property
    def num_batches(self) -> int:
        """Batches per epoch, ``ceil(N / batch_size)`` (the last one may be smaller).

        Example:
            >>> tb = TensorBatches(torch.zeros(5, 3), None, None, batch_size=2, shuffle=False)
            >>> tb.num_batches
            3
        """
        return math.ceil(self.n_used / self.batch_size)

    def cast_floats(self, dtype: torch.dtype) -> None:
        """Floating ``x`` and ``y`` in ``dtype`` (a copy of the data); other dtypes stay.

        Example:
            >>> tb = TensorBatches(torch.zeros(4, 2, dtype=torch.float64), torch.arange(4), None, 2, False)
            >>> tb.cast_floats(torch.float32); tb.x.dtype, tb.y.dtype
            (torch.float32, torch.int64)
        """

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

        self.x = nest.map_structure(cast, self.x)
        if self.y is not None:
            self.y = nest.map_structure(cast, self.y)

    def drop_single_tail(self) -> None:
        """Leave out a one-row last batch from every epoch (BatchNorm cannot train on it)."""
        self.drop_last_single = True

    def to(self, device: torch.device) -> TensorBatches:
        """Keep the data on ``device`` (done once, for small data sets on an accelerator)."""
        self.x, self.y, self.w = (move_to_device(a, device) for a in (self.x, self.y, self.w))
        return self

    def iterate(self, epoch: int, skip: int = 0, skip_samples: int | None = None) -> Iterator[Batch]:
        """Yield one epoch of ``(x, y, sample_weight)`` batches of up to ``batch_size`` rows.

        With shuffling, the permutation is drawn from the global generator on the first
        ``next``, before any batch is skipped, so a resumed epoch replays the same order.

        Args:
            epoch: the 0-based epoch index (unused here; the same signature as other sources).
            skip: batches to leave out at the start of the epoch (a mid-epoch resume).
            skip_samples: samples to leave out instead (a resume with another batch size).

        Yields:
            ``(x, y, sample_weight)``, each sliced to ``b <= batch_size`` rows (``(b, ...)``;
            ``sample_weight`` ``(b,)``); ``y`` and ``sample_weight`` are ``None`` if not given.

        Example:
            >>> tb = TensorBatches(torch.arange(6), None, None, batch_size=4, shuffle=True)
            >>> _ = torch.manual_seed(0); full = [b[0].tolist() for b in tb.iterate(0)]
            >>> _ = torch.manual_seed(0); rest = [b[0].tolist() for b in tb.iterate(0, skip=1)]
            >>> full, rest
            ([[2, 5, 3, 0], [1, 4]], [[1, 4]])
        """
        bs, n = self.batch_size, self.n_used
        x, y, w = self.x, self.y, self.w
        start = skip * bs if skip_samples is None else skip_samples
        if self.shuffle:
            perm = draw_order(self.n, self.shuffle, bs)
            leaves = _leaves(x)
            if leaves and leaves[0].device != perm.device:
                perm = perm.to(leaves[0].device)
            for i in range(start, n, bs):
                idx = perm[i : min(i + bs, n)]
                yield (
                    x[idx] if isinstance(x, torch.Tensor) else _index(x, idx),
                    None if y is None else (y[idx] if isinstance(y, torch.Tensor) else _index(y, idx)),
                    None if w is None else w[idx],
                )
        else:
            for i in range(start, n, bs):
                sl = slice(i, min(i + bs, n))
                yield _index(x, sl), _index(y, sl), None if w is None else w[sl]


def split_validation(x: Any, y: Any, sample_weight: Any, validation_split: float):
    """Split off the last ``validation_split`` fraction (before any shuffling; Keras' rule).

    Returns:
        ``((x, y, w) for training, (x, y, w) for validation)``; for a ``Dataset`` ``x`` the
        parts are ``Subset`` objects.

    Raises:
        ValueError: ``validation_split`` outside ``[0, 1)``, a split that leaves no training or
            no validation sample, or an input that cannot be split (a DataLoader or iterable).

    Example:
        >>> (xt, _, _), (xv, _, _) = split_validation(torch.arange(10), None, None, 0.2)
        >>> xt.tolist(), xv.tolist()
        ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9])
        >>> (xt, yt, _), (xv, yv, _) = split_validation(np.zeros((10, 2)), np.arange(10), None, 0.1)
        >>> tuple(xt.shape), yv.tolist()
        ((9, 2), [9])
    """
    if isinstance(x, DataLoader) or not (is_in_memory(x) or _is_map_dataset(x)):
        raise ValueError(
            "`validation_split` works with tensors, numpy arrays and map-style Datasets only. "
            f"Received x of type {type(x).__name__}. Fix: pass `validation_data=` instead."
        )
    check_sample_weight_kind(sample_weight)
    check_numeric_arrays(x, "x")
    check_numeric_arrays(y, "y")
    if not _is_map_dataset(x):  # numpy -> torch first: lengths and slices are the tensors'
        x, y, sample_weight = (_to_tensor(a) if is_in_memory(a) else a for a in (x, y, sample_weight))
    n = len(x) if _is_map_dataset(x) else _check_lengths({"x": x, "y": y, "sample_weight": sample_weight})
    split_at = int(math.floor(n * (1.0 - validation_split)))
    if split_at <= 0 or split_at >= n:
        raise ValueError(
            f"`validation_split={validation_split}` on {n} samples leaves "
            f"{split_at} for training and {n - split_at} for validation; both need at least one. "
            "Fix: use a split in (0, 1) that keeps samples on both sides."
        )

    def part(a, sl):
        return None if a is None else _index(a, sl)

    head, tail = slice(0, split_at), slice(split_at, n)
    if _is_map_dataset(x):
        if y is not None:
            raise ValueError(
                f"`y` must be None when `x` is a {type(x).__name__}: the targets come from its "
                "items. Fix: have it return `(x, y)` items and drop `y=`."
            )
        w = None if sample_weight is None else _sample_weight_tensor(sample_weight)
        if w is not None and len(w) != n:
            raise ValueError(
                f"`sample_weight` has {len(w)} entries but the Dataset has {n} samples. "
                "Fix: pass one weight per sample."
            )
        return (Subset(x, range(split_at)), None, part(w, head)), (Subset(x, range(split_at, n)), None, part(w, tail))
    return tuple(part(a, head) for a in (x, y, sample_weight)), tuple(part(a, tail) for a in (x, y, sample_weight))


def _is_map_dataset(x: Any) -> bool:
    return isinstance(x, Dataset) and not isinstance(x, IterableDataset) and hasattr(x, "__len__")


def check_sample_weight_kind(sample_weight: Any) -> None:
    """Refuse weights that are not real numbers (strings, objects, complex) by name.

    Example:
        >>> check_sample_weight_kind(np.array(["1", "2"]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: Expected `sample_weight` to hold real numbers. Received an array of dtype <U1...
    """
    if isinstance(sample_weight, (str, bytes)):
        raise TypeError(
            f"Expected `sample_weight` to be an array of real numbers, one per sample (N,). Received: "
            f"sample_weight={sample_weight!r} ({type(sample_weight).__name__}). Fix: pass e.g. torch.ones(N)."
        )
    dtype = getattr(sample_weight, "dtype", None)
    if dtype is None:
        return
    if isinstance(sample_weight, torch.Tensor):
        bad = sample_weight.is_complex()
    else:
        bad = isinstance(dtype, np.dtype) and dtype.kind not in "iufb"
    if bad:
        raise TypeError(
            f"Expected `sample_weight` to hold real numbers. Received an array of dtype {dtype}. Fix: pass "
            "float weights, e.g. np.asarray(w, dtype=np.float32) (a complex weight's imaginary part would be "
            "dropped, a string cannot scale a loss)."
        )


def _sample_weight_tensor(sample_weight: Any) -> torch.Tensor:
    check_sample_weight_kind(sample_weight)
    w = _to_tensor(sample_weight) if is_in_memory(sample_weight) else torch.as_tensor(sample_weight)
    if not isinstance(w, torch.Tensor) or w.dim() == 0:
        raise ValueError(
            "Expected `sample_weight` to be an array with one weight per sample, (N,), or one per target "
            f"position, shaped like y. Received shape {tuple(getattr(w, 'shape', ()))}. Fix: pass shape (N,)."
        )
    return w if w.is_floating_point() else w.to(torch.get_default_dtype())
