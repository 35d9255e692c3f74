"""``class_weight``: per-class weights folded into the per-sample weights of the loss."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["ClassWeights", "class_weights", "combine"]

#: The target value PyTorch's class-index losses ignore by default: such positions weigh 0.
IGNORED = -100


def class_weights(class_weight: Any) -> ClassWeights | None:
    """The :class:`ClassWeights` of a ``class_weight`` argument; ``None`` for ``None`` or ``{}``.

    An empty dict weighs every class 1, as in Keras: no weights at all.

    Example:
        >>> class_weights({}) is None, class_weights({"0": 1, 1.0: 2}).keys
        (True, [0, 1])
    """
    if class_weight is None or isinstance(class_weight, Mapping) and not class_weight:
        return None
    return ClassWeights(class_weight)


def combine(class_w: torch.Tensor, sample_w: Any) -> torch.Tensor:
    """Class weights (per sample, or per position) times the per-sample weights, if any.

    A ``(B,)`` sample weight multiplies every position of its row.

    Example:
        >>> combine(torch.tensor([[1.0, 3.0], [3.0, 0.0]]), torch.tensor([2.0, 1.0]))
        tensor([[2., 6.],
                [3., 0.]])
    """
    if sample_w is None:
        return class_w
    w = torch.as_tensor(sample_w, dtype=class_w.dtype, device=class_w.device)
    if w.dim() < class_w.dim():
        w = w.reshape(w.shape + (1,) * (class_w.dim() - w.dim()))
    return class_w * w


def single_target(y: Any) -> torch.Tensor:
    """``y`` itself when it is one tensor of labels; a ``ValueError`` for several targets.

    ``class_weight`` weighs each sample by its class in one target, as Keras' (which a model
    with several outputs does not take): with a tuple, list or dict of targets (one per loss) it
    cannot tell whose classes count.

    Example:
        >>> single_target(torch.tensor([0, 1])).tolist()
        [0, 1]
    """
    if isinstance(y, torch.Tensor):
        return y
    kind = f"a {type(y).__name__} of {len(y)} targets" if isinstance(y, (tuple, list, dict)) else type(y).__name__
    raise ValueError(
        "Expected one target tensor `y` with `class_weight`, which weighs each sample by its class in "
        f"that target. Received: y, {kind} (one per loss?). Fix: weigh by the target you mean: "
        "sample_weight=fitkit.data.ClassWeights(class_weight)(y[0]) for (N,) labels, and no class_weight."
    )


def _class_index(k: Any) -> int | None:
    """A ``class_weight`` key as a class index: ints, integral floats (``1.0``), digit strings."""
    if isinstance(k, (bool, np.bool_)):
        return None
    if isinstance(k, (int, np.integer)):
        return int(k)
    if isinstance(k, (float, np.floating)) and math.isfinite(k) and float(k).is_integer():
        return int(k)
    if isinstance(k, str) and k.strip().lstrip("+").isdigit():
        return int(k)
    return None


class ClassWeights:
    """Turn class labels into per-sample (or per-position) weights with a lookup table.

    Integer targets with positions, ``(B, T)`` (a class per token or per pixel), get one
    weight per position, so that ``cross_entropy`` weighs each token by its class as
    ``nn.CrossEntropyLoss(weight=...)`` does; positions holding -100 (PyTorch's
    ``ignore_index``) weigh 0. Other targets get one weight per sample: the label itself, the
    argmax of a one-hot / probability row, or a rounded 0 / 1.

    Args:
        class_weight: ``{class_index: weight}``; keys are non-negative ints, or the same as
            integral floats (``1.0``) or digit strings (``"1"``), as Keras accepts them.

    Raises:
        TypeError: ``class_weight`` is not a dict of class index -> number.
        ValueError: a key that is no class index (negative, ``0.5``, ``"a"``), a key given
            twice (``1`` and ``"1"``), a weight that is negative or not finite, or (in
            :meth:`check`) the targets are not class labels or a label has no key.

    Example:
        >>> cw = ClassWeights({0: 1.0, 1: 3.0})
        >>> cw(torch.tensor([0, 1, 1]))
        tensor([1., 3., 3.])
        >>> cw(torch.tensor([[0, 1, -100], [1, 1, 0]]))  # one class per position
        tensor([[1., 3., 0.],
                [3., 3., 1.]])
    """

    def __init__(self, class_weight: Mapping[Any, float]):
        if not isinstance(class_weight, Mapping) or not class_weight:
            raise TypeError(
                "Expected `class_weight` to be a non-empty dict {class_index: weight}. "
                f"Received: class_weight={class_weight!r}."
            )
        keys: dict[int, float] = {}
        for k, v in class_weight.items():
            index = _class_index(k)
            if index is None or index < 0:
                raise ValueError(
                    "Expected `class_weight` keys to be class indices (non-negative ints, or the same as "
                    f"1.0 or '1'). Received key {k!r}. Fix: key each weight by its class index."
                )
            if not isinstance(v, (int, float, np.number)) or isinstance(v, bool):
                raise TypeError(f"Expected `class_weight[{k!r}]` to be a number. Received: {v!r}.")
            if not math.isfinite(float(v)) or v < 0:
                raise ValueError(
                    f"Expected `class_weight[{k!r}]` to be a finite number >= 0. Received: {v!r}. "
                    "Fix: weights scale each class's loss; use 0 to ignore a class."
                )
            if index in keys:
                raise ValueError(f"`class_weight` gives class {index} twice (key {k!r}). Fix: one key per class.")
            keys[index] = float(v)
        self.keys = sorted(keys)
        self.table = torch.full((max(keys) + 1,), float("nan"))
        for index, v in keys.items():
            self.table[index] = v

    @staticmethod
    def per_position(y: torch.Tensor) -> bool:
        """Whether ``y`` holds a class per position: integer ``(B, T, ...)`` with more than one."""
        return not y.is_floating_point() and y.dim() > 1 and y[0].numel() > 1

    def labels(self, y: torch.Tensor) -> torch.Tensor:
        """Class index per sample (``y`` itself, the argmax of one-hot rows, or rounded 0/1), or
        per position for integer ``(B, T, ...)`` targets."""
        if y.is_floating_point():
            if y.dim() >= 2 and y.shape[-1] > 1:
                return y.argmax(-1)
            return y.reshape(y.shape[0], -1)[:, 0].round().long()
        if self.per_position(y):
            return y.long()
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
        ignored = IGNORED if self.per_position(y) else None
        missing = [c for c in present if c != ignored and (c < 0 or c >= len(self.table) or math.isnan(self.table[c]))]
        if missing:
            raise ValueError(
                f"`class_weight` has no entry for class {missing[0]} found in the targets. "
                f"Received keys: {self.keys}. Fix: add a weight for every class."
            )

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        labels = self.labels(y)
        table = self.table if self.table.device == labels.device else self.table.to(labels.device)
        self.table = table
        if not self.per_position(y):
            return table[labels]
        ignored = labels == IGNORED
        return table[labels.masked_fill(ignored, 0)].masked_fill(ignored, 0.0)
