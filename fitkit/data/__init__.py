"""Data: anything in, ``(x, y, sample_weight)`` batches on the device out.

:func:`as_loader` is the one entry point. In-memory tensors and numpy arrays take a fast path
(one ``randperm`` per epoch and index slicing, no per-sample collate); map-style ``Dataset``
objects get a ``DataLoader``; ``DataLoader`` objects and any other iterable of batches are
iterated as they are. :class:`DeviceLoader` is the only place where a batch changes device.

- :mod:`~fitkit.data.arrays`: in-memory data: ``is_in_memory``, ``batch_size_of``,
  ``TensorBatches`` (the fast path) and ``split_validation``.
- :mod:`~fitkit.data.loaders`: ``as_loader``, ``DeviceLoader``, ``device_batch``,
  ``unpack_batch`` and the wrappers for Datasets and iterables of batches.
- :mod:`~fitkit.data.weights`: ``ClassWeights``.
- :mod:`~fitkit.data.packing`: ``PackedDataset`` (documents packed into fixed-length sequences).
"""

from __future__ import annotations

# Some private names are re-exported too: fitkit.distributed's sharding reaches them here.
from fitkit.data.arrays import (  # noqa: F401
    Batch,
    TensorBatches,
    _check_lengths,
    _index,
    _is_map_dataset,
    _leaves,
    _sample_weight_tensor,
    _to_tensor,
    batch_size_of,
    is_in_memory,
    split_validation,
)
from fitkit.data.loaders import (  # noqa: F401
    ClassWeights,
    DeviceLoader,
    _IterableBatches,
    _WeightedDataset,
    as_loader,
    batches_itself,
    device_batch,
    unpack_batch,
    validation_loader,
)
from fitkit.data.packing import PackedDataset

__all__ = [
    "as_loader",
    "batches_itself",
    "validation_loader",
    "DeviceLoader",
    "device_batch",
    "TensorBatches",
    "is_in_memory",
    "split_validation",
    "unpack_batch",
    "batch_size_of",
    "CharTokenizer",
    "NextTokenDataset",
    "PackedDataset",
]


def __getattr__(name: str):
    # The text helpers live in fitkit.text; they are re-exported here lazily.
    if name in ("CharTokenizer", "NextTokenDataset"):
        from fitkit import text

        return getattr(text, name)
    raise AttributeError(f"module 'fitkit.data' has no attribute {name!r}")
