"""The collate of the DataLoaders fit builds from a Dataset: torch's, with samples that do not
stack named by their shapes (torch's own error is a bare "stack expects each tensor to be
equal size")."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from fitkit import nest
from fitkit.data.hf_datasets import padding_error

__all__ = ["NamingCollate", "check_not_empty", "collate_failure"]


def check_not_empty(dataset: Any) -> None:
    """A map-style Dataset of 0 samples: torch's sampler would say "num_samples should be a
    positive integer value" (with ``shuffle=True``) or yield nothing.

    Raises:
        ValueError: naming the Dataset and the fix.
    """
    if len(dataset) == 0:
        raise ValueError(
            f"The {type(dataset).__name__} has 0 samples: there are no batches to run. Fix: pass a Dataset "
            "with samples (check its __len__)."
        )


def _collate_none(batch: list[Any], *, collate_fn_map: Any = None) -> None:
    """A column that is ``None`` in every sample stays ``None`` in the batch (a ``y`` of a dict
    sample that holds its labels, a mask a Dataset leaves out), as ``y=None`` does for arrays."""
    kinds = sorted({type(v).__name__ for v in batch})
    if kinds != ["NoneType"]:
        raise TypeError(f"a column is None in some samples and not in others ({', '.join(kinds)})")


_COLLATE_MAP = {**default_collate_fn_map, type(None): _collate_none}


def default_collate(samples: list[Any]) -> Any:
    """torch's ``default_collate``, where a column of ``None`` stays ``None``.

    Example:
        >>> default_collate([(torch.zeros(2), None), (torch.ones(2), None)])
        [tensor([[0., 0.],
                [1., 1.]]), None]
    """
    return collate(samples, collate_fn_map=_COLLATE_MAP)


def _kinds(value: Any) -> str:
    """Every leaf of a sample: tensors by shape, anything else by its type (``None``, ``list of 5 str``)."""
    if isinstance(value, torch.Tensor):
        return str(tuple(value.shape))
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_kinds(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_kinds(v) for v in value) + ")"
    if isinstance(value, list):
        inner = sorted({type(v).__name__ for v in value})
        return f"list of {len(value)} {'/'.join(inner) or 'items'}"
    return "None" if value is None else type(value).__name__


def _shapes(sample: Any) -> str:
    leaves = nest.leaves(sample)
    return (
        "(" + ", ".join(str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__ for t in leaves) + ")"
    )


class NamingCollate:
    """``default_collate``, counting the batches of each pass, with a clear error for samples
    that do not stack.

    Example:
        >>> collate = NamingCollate()
        >>> collate([torch.zeros(2), torch.zeros(3)])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: A batch of the Dataset (number 1 since the loader was built) cannot be made: ...
    """

    def __init__(self) -> None:
        self.batches = 0

    def __call__(self, samples: list[Any]) -> Any:
        self.batches += 1
        try:
            return default_collate(samples)
        except (RuntimeError, TypeError) as e:
            padding = padding_error(samples)  # token rows of several lengths: name the collators
            if padding is not None:
                raise padding from e
            kinds = [_kinds(s) for s in samples]
            if len(set(kinds)) == 1:  # alike in every sample: a value that is not a tensor, number or str
                raise ValueError(
                    f"A batch of the Dataset (number {self.batches} since the loader was built) cannot be made: "
                    f"its samples' tensors have equal shapes, but a value torch cannot stack is among them "
                    f"({type(e).__name__}: {e}). The first sample holds {kinds[0]}. Fix: return "
                    "tensors, numbers or strings from __getitem__ (the same kind in every sample), or pass a "
                    "DataLoader with a collate_fn that builds the batch."
                ) from e
            shapes = [_shapes(s) for s in samples]
            # the same number of tensors of other shapes; else a None or other value differs: show every value
            same_count = len({len(nest.leaves(s)) for s in samples}) == 1
            shown = shapes if same_count and len(set(shapes)) > 1 else kinds
            more = f", ... ({len(samples)} samples)" if len(samples) > 8 else ""
            shapes = shown[:8]
            raise ValueError(
                f"A batch of the Dataset (number {self.batches} since the loader was built) cannot be made: "
                f"its samples have different {'shapes' if shown is not kinds else 'kinds of values'} "
                f"(each sample's tensors: {', '.join(shapes)}{more}), and torch stacks equal shapes only "
                f"({type(e).__name__}: {e}). Fix: make every sample the same shape (pad or crop in "
                "__getitem__), or pass a DataLoader with a collate_fn that pads."
            ) from e


def collate_failure(error: BaseException, done_steps: int) -> ValueError | None:
    """A ``ValueError`` naming the fix when ``error`` came from torch's ``default_collate``
    stacking samples of different shapes in a user's own DataLoader (``None``: another error).

    Looked for in the traceback (or, from a worker process, in the text torch passes on), only
    once the error has ended the epoch: nothing runs per step.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader([torch.zeros(2), torch.zeros(3)], batch_size=2)
        >>> try:
        ...     next(iter(loader))
        ... except RuntimeError as e:
        ...     print(str(collate_failure(e, 0))[:60])
        A batch of the training DataLoader could not be made after 0
    """
    if not isinstance(error, RuntimeError):
        return None
    tb, from_collate = error.__traceback__, False
    while tb is not None and not from_collate:
        code = tb.tb_frame.f_code
        from_collate = code.co_name == "collate_tensor_fn" and code.co_filename.endswith("collate.py")
        tb = tb.tb_next
    if not from_collate and "collate_tensor_fn" not in str(error):  # a worker's error arrives as text
        return None
    return ValueError(
        f"A batch of the training DataLoader could not be made after {done_steps} optimizer step(s) of this "
        "fit: its collate_fn (torch's default_collate) stacks each field of the samples into one tensor, "
        f"which needs equal shapes, and some samples differ ({type(error).__name__}: {str(error).strip()}). "
        "Fix: pass DataLoader(..., collate_fn=...) that pads the samples to a common shape (e.g. "
        "torch.nn.utils.rnn.pad_sequence, or transformers' DataCollatorWithPadding for tokens), or make every "
        "sample the same shape in the Dataset's __getitem__."
    )
