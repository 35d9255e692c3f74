"""``class_weight``: per-class weights folded into the per-sample weights of the loss."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["ClassWeights"]


class ClassWeights:
    """Turn class labels into per-sample weights with a lookup table.

    Args:
        class_weight: ``{class_index: weight}`` with non-negative integer keys.

    Raises:
        TypeError: ``class_weight`` is not a dict of int -> number.
        ValueError: a key or a weight is negative, a weight is not finite, or (in
            :meth:`check`) the targets are not class labels or a label has no key.

    Example:
        >>> cw = ClassWeights({0: 1.0, 1: 3.0})
        >>> cw(torch.tensor([0, 1, 1]))
        tensor([1., 3., 3.])
    """

    def __init__(self, class_weight: Mapping[Any, float]):
        if not isinstance(class_weight, Mapping) or not class_weight:
            raise TypeError(
                "Expected `class_weight` to be a non-empty dict {class_index: weight}. "
                f"Received: class_weight={class_weight!r}."
            )
        keys = []
        for k, v in class_weight.items():
            if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 0:
                raise ValueError(
                    "Expected `class_weight` keys to be class indices (non-negative ints). "
                    f"Received key {k!r}."
                )
            if not isinstance(v, (int, float, np.number)) or isinstance(v, bool):
                raise TypeError(f"Expected `class_weight[{k}]` to be a number. Received: {v!r}.")
            if not math.isfinite(float(v)) or v < 0:
                raise ValueError(
                    f"Expected `class_weight[{k}]` to be a finite number >= 0. Received: {v!r}. "
                    "Fix: weights scale each class's loss; use 0 to ignore a class."
                )
            keys.append(int(k))
        self.keys = sorted(keys)
        self.table = torch.full((max(keys) + 1,), float("nan"))
        for k, v in class_weight.items():
            self.table[int(k)] = float(v)

    def labels(self, y: torch.Tensor) -> torch.Tensor:
        """Class index per sample: ``y`` itself, the argmax of one-hot rows, or rounded 0/1."""
        if y.is_floating_point():
            if y.dim() >= 2 and y.shape[-1] > 1:
                return y.argmax(-1)
            return y.reshape(y.shape[0], -1)[:, 0].round().long()
        return y.reshape(y.shape[0], -1)[:, 0].long() if y.dim() > 1 else y.long()

    def check(self, y: torch.Tensor) -> None:
        """Raise ``ValueError`` if ``y`` (on the CPU) is not class labels, or a label has no weight.

        Floating targets are labels when they are whole numbers, or, with several columns,
        one-hot or probability rows (values in [0, 1]).
        """
        if y.is_floating_point():
            rows = y.dim() >= 2 and y.shape[-1] > 1
            bad = (y < 0) | (y > 1) | y.isnan() if rows else y != y.round()
            if bool(bad.any()):
                raise ValueError(
                    "`class_weight` needs class labels (or one-hot / probability rows), but the targets "
                    f"are continuous (e.g. {float(y[bad][0])}). Fix: pass `sample_weight` for regression targets."
                )
        labels = self.labels(y)
        present = torch.unique(labels).tolist()
        missing = [c for c in present if c < 0 or c >= len(self.table) or math.isnan(self.table[c])]
        if missing:
            raise ValueError(
                f"`class_weight` has no entry for class {missing[0]} found in the targets. "
                f"Received keys: {self.keys}. Fix: add a weight for every class."
            )

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        labels = self.labels(y)
        table = self.table if self.table.device == labels.device else self.table.to(labels.device)
        self.table = table
        return table[labels]
