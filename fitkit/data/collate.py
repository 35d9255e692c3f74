"""The collate of the DataLoaders fit builds from a Dataset: torch's, with samples that do not
stack named by their shapes (torch's own error is a bare "stack expects each tensor to be
equal size")."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import default_collate

from fitkit import nest

__all__ = ["NamingCollate", "check_not_empty"]


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


def _shapes(sample: Any) -> str:
    leaves = nest.leaves(sample)
    return "(" + ", ".join(str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
                           for t in leaves) + ")"  # fmt: skip


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
            shapes = [_shapes(s) for s in samples[:8]]
            more = f", ... ({len(samples)} samples)" if len(samples) > 8 else ""
            raise ValueError(
                f"A batch of the Dataset (number {self.batches} since the loader was built) cannot be made: "
                "its samples have different shapes "
                f"(each sample's tensors: {', '.join(shapes)}{more}), and torch stacks equal shapes only "
                f"({type(e).__name__}: {e}). Fix: make every sample the same shape (pad or crop in "
                "__getitem__), or pass a DataLoader with a collate_fn that pads."
            ) from e
