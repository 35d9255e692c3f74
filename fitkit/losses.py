"""Losses: names, ``nn.Module`` losses and callables, all in PyTorch's order ``loss(y_pred, y)``.

Every loss is wrapped in a :class:`Loss` that makes targets fit the prediction the way a user
means them (``int32`` labels become ``int64``; ``(B, 1)`` predictions meet ``(B,)`` targets
without PyTorch's silent ``(B, B)`` broadcast; language-model logits ``(B, T, V)`` meet
``(B, T)`` targets) and returns either the batch mean or one value per sample, so that sample
weights give ``sum(w * l) / sum(w)``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Loss", "MultiLoss", "resolve_loss", "class_layout", "LOSSES"]

#: The loss names that ``compile(loss=...)`` accepts, each mapped to ``(functional, kind)``;
#: ``kind`` (``"regression"``, ``"class_index"`` or ``"binary"``) says how targets meet
#: predictions.
LOSSES: dict[str, tuple[Callable[..., torch.Tensor], str]] = {
    "mse": (F.mse_loss, "regression"),
    "mean_squared_error": (F.mse_loss, "regression"),
    "mae": (F.l1_loss, "regression"),
    "mean_absolute_error": (F.l1_loss, "regression"),
    "l1": (F.l1_loss, "regression"),
    "huber": (F.huber_loss, "regression"),
    "smooth_l1": (F.smooth_l1_loss, "regression"),
    "cross_entropy": (F.cross_entropy, "class_index"),
    "nll": (F.nll_loss, "class_index"),
    "bce_with_logits": (F.binary_cross_entropy_with_logits, "binary"),
    "bce": (F.binary_cross_entropy, "binary"),
}

_MODULE_KINDS: dict[type, str] = {
    nn.MSELoss: "regression",
    nn.L1Loss: "regression",
    nn.HuberLoss: "regression",
    nn.SmoothL1Loss: "regression",
    nn.CrossEntropyLoss: "class_index",
    nn.NLLLoss: "class_index",
    nn.BCEWithLogitsLoss: "binary",
    nn.BCELoss: "binary",
}


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def class_layout(y_pred: torch.Tensor, y: torch.Tensor, previous: str | None = None) -> str | None:
    """Where the classes are in ``y_pred`` for integer targets ``y``: ``"dim1"``, ``"last"``, or None.

    ``"dim1"`` is PyTorch's layout (``(B, C, d1, ...)`` with ``y`` ``(B, d1, ...)``), ``"last"``
    the language-model layout (``(B, T, V)`` with ``y`` ``(B, T)``). When both fit (``T == V``),
    the layout seen before is kept; with none seen before, ``"last"`` is chosen, with a
    warning once, since that ambiguity mostly comes from a GPT whose context equals its
    vocabulary.

    Example:
        >>> class_layout(torch.zeros(2, 5), torch.zeros(2)), class_layout(torch.zeros(2, 7, 5), torch.zeros(2, 7))
        ('dim1', 'last')
    """
    dim1 = y_pred.dim() >= 2 and y.shape == y_pred.shape[:1] + y_pred.shape[2:]
    last = y_pred.dim() >= 3 and y.shape == y_pred.shape[:-1]
    if dim1 and last:
        if previous is None:
            warnings.warn(
                f"Logits {_shape(y_pred)} with class indices {_shape(y)} fit two layouts; fitkit "
                "treats the last dimension as the classes (B, T, V). If your classes are on dim 1 "
                "(B, C, L), use an L that differs from C, or pass a callable loss.",
                stacklevel=4,
            )
            return "last"
        return previous
    return "last" if last else "dim1" if dim1 else None


class Loss:
    """A loss in PyTorch's order with fitkit's target handling.

    Args:
        fn: ``fn(y_pred, y, reduction=...)`` for named / module losses, or any callable
            ``fn(y_pred, y) -> Tensor`` (a scalar batch mean, or values per sample / element).
        kind: ``"regression"``, ``"class_index"``, ``"binary"`` or ``"custom"``.
        name: for messages.

    Example:
        >>> loss = resolve_loss("mse")
        >>> loss(torch.zeros(4, 1), torch.tensor([1.0, 1.0, 1.0, 4.0]))
        tensor(4.7500)
        >>> loss(torch.zeros(4, 1), torch.tensor([1.0, 1.0, 1.0, 4.0]), per_sample=True)
        tensor([ 1.,  1.,  1., 16.])
    """

    def __init__(self, fn: Callable[..., torch.Tensor], kind: str, name: str):
        self.fn, self.kind, self.name = fn, kind, name
        self.class_last = False  # set per call for class_index losses
        self._layout: str | None = None  # the class layout seen first, kept when ambiguous

    def prepare(self, y_pred: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Match ``y`` to ``y_pred`` (dtype and shape); raise ``ValueError`` when they cannot."""
        if self.kind == "custom" or not isinstance(y_pred, torch.Tensor):
            return y_pred, y
        if not isinstance(y, torch.Tensor):
            raise TypeError(
                f"Loss '{self.name}' needs tensor targets. Received y of type {type(y).__name__}."
            )
        if self.kind == "class_index":
            return self._prepare_class_index(y_pred, y)
        if y.dtype != y_pred.dtype:
            y = y.to(y_pred.dtype)
        if y.shape != y_pred.shape:
            if y_pred.numel() == y.numel() and (
                y_pred.shape[:-1] == y.shape and y_pred.shape[-1] == 1
                or y.shape[:-1] == y_pred.shape and y.shape[-1] == 1
            ):
                y = y.reshape(y_pred.shape)
            else:
                raise ValueError(
                    f"Loss '{self.name}' needs `y` shaped like the prediction. Received "
                    f"y_pred {_shape(y_pred)} and y {_shape(y)}. Fix: make the module output "
                    "match the targets (PyTorch would broadcast these silently)."
                )
        return y_pred, y

    def _prepare_class_index(self, y_pred: torch.Tensor, y: torch.Tensor):
        if y.shape == y_pred.shape and y.is_floating_point():
            return y_pred, y.to(y_pred.dtype)  # class probabilities
        if y.is_floating_point() or y.dtype == torch.bool:
            raise ValueError(
                f"Loss '{self.name}' expects integer class indices. Received y of dtype "
                f"{y.dtype} and shape {_shape(y)} with y_pred {_shape(y_pred)}. Fix: pass "
                "`y.long()`, or class probabilities shaped like y_pred."
            )
        if y.dtype != torch.long:
            y = y.long()
        layout = class_layout(y_pred, y, previous=self._layout)
        if layout is not None:
            self._layout = layout
            self.class_last = layout == "last"
            return y_pred, y
        raise ValueError(
            f"Loss '{self.name}' got logits {_shape(y_pred)} and class indices {_shape(y)}. "
            "Expected logits (B, C) with y (B,), (B, C, d1, ...) with y (B, d1, ...), or "
            "(B, T, V) with y (B, T)."
        )

    def __call__(
        self, y_pred: torch.Tensor, y: torch.Tensor, per_sample: bool = False
    ) -> torch.Tensor:
        """Batch-mean loss (0-dim), or ``(B,)`` per-sample losses when ``per_sample``."""
        y_pred, y = self.prepare(y_pred, y)
        if self.kind == "custom":
            out = self.fn(y_pred, y)
            if not isinstance(out, torch.Tensor):
                raise TypeError(
                    f"The loss callable must return a tensor. Received {type(out).__name__}."
                )
            if out.dim() == 0:
                if per_sample:
                    raise ValueError(
                        "Sample weights need a loss per sample, but the loss callable returned a "
                        "scalar. Fix: return per-sample values (e.g. reduction='none')."
                    )
                return out
            per = out.reshape(out.shape[0], -1).mean(1)
            return per if per_sample else per.mean()
        reduction = "none" if per_sample else "mean"
        try:
            if self.kind == "class_index" and self.class_last:
                v = y_pred.shape[-1]
                out = self.fn(y_pred.reshape(-1, v), y.reshape(-1), reduction=reduction)
                return out.reshape(y.shape[0], -1).mean(1) if per_sample else out
            out = self.fn(y_pred, y, reduction=reduction)
        except IndexError as e:
            # torch's CPU kernels raise IndexError for a class label out of range (no sync is
            # spent checking it here; in-memory data is range-checked before the first step).
            if self.kind != "class_index":
                raise
            n = y_pred.shape[-1] if self.class_last else y_pred.shape[1]
            raise ValueError(
                f"Loss '{self.name}' got a class label outside [0, {n - 1}] for logits "
                f"{_shape(y_pred)} ({e}). Fix: remap the labels, or give the module one output "
                "per class."
            ) from None
        return out.reshape(out.shape[0], -1).mean(1) if per_sample else out


def resolve_loss(loss: Any) -> Loss | MultiLoss | None:
    """Build a :class:`Loss` from a name, an ``nn.Module`` loss or a callable.

    Args:
        loss: a name of :data:`LOSSES`, an ``nn.Module`` such as ``nn.CrossEntropyLoss()``, a
            callable ``loss(y_pred, y)``, a list / dict of those for a module with several
            outputs (see :class:`MultiLoss`), or ``None`` (for a custom ``compute_loss``).

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
        TypeError: anything else.

    Example:
        >>> resolve_loss("cross_entropy").kind
        'class_index'
    """
    if loss is None or isinstance(loss, (Loss, MultiLoss)):
        return loss
    if isinstance(loss, (list, tuple, Mapping)):
        return MultiLoss(loss)
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ValueError(
                f"Unknown loss '{loss}'. Valid names: {', '.join(LOSSES)}. "
                "Or pass an nn.Module or a callable loss(y_pred, y)."
            )
        fn, kind = LOSSES[loss]
        return Loss(fn, kind, loss)
    if isinstance(loss, nn.Module):
        kind = next((k for cls, k in _MODULE_KINDS.items() if type(loss) is cls), None)
        if kind is not None:
            base = loss

            def call(y_pred, y, reduction="mean", _base=base):
                m = _base
                if m.reduction != reduction:
                    m = copy.copy(_base)
                    m.reduction = reduction
                return m(y_pred, y)

            return Loss(call, kind, type(loss).__name__)
        return Loss(loss, "custom", type(loss).__name__)
    if callable(loss):
        return Loss(loss, "custom", getattr(loss, "__name__", type(loss).__name__))
    raise TypeError(
        "Expected `loss` to be a name, an nn.Module or a callable loss(y_pred, y). "
        f"Received: loss={loss!r} of type {type(loss).__name__}."
    )


class MultiLoss:
    """One loss per output of a module with several outputs, summed with weights (Keras).

    ``y_pred`` and ``y`` are tuples / lists (matched by position) or dicts (matched by key) with
    one entry per loss; the objective is ``sum(weight_i * loss_i(y_pred_i, y_i))``.

    Args:
        losses: a list / tuple or dict of losses (names, modules or callables).
        loss_weights: one weight per loss (same structure); default 1 each.

    Raises:
        ValueError: weights that do not match the losses, or predictions / targets of another
            structure.

    Example:
        >>> loss = MultiLoss(["mse", "mae"], loss_weights=[1.0, 0.5])
        >>> loss((torch.zeros(2), torch.zeros(2)), (torch.ones(2), torch.full((2,), 4.0)))
        tensor(3.)
    """

    kind = "multi"
    name = "multi"

    def __init__(self, losses: Any, loss_weights: Any = None):
        self.keys = list(losses) if isinstance(losses, Mapping) else list(range(len(losses)))
        if not self.keys:
            raise ValueError("Expected at least one loss. Received an empty list or dict.")
        items = losses if isinstance(losses, Mapping) else dict(enumerate(losses))
        self.losses = {k: resolve_loss(items[k]) for k in self.keys}
        if loss_weights is None:
            self.weights = {k: 1.0 for k in self.keys}
        else:
            w = loss_weights if isinstance(loss_weights, Mapping) else dict(enumerate(loss_weights))
            if sorted(map(str, w)) != sorted(map(str, self.keys)):
                raise ValueError(
                    f"Expected `loss_weights` to match the losses ({self.keys}). Received: "
                    f"{loss_weights!r}. Fix: one weight per loss, as a list or a dict."
                )
            self.weights = {k: float(w[k]) for k in self.keys}

    def _parts(self, out: Any, what: str) -> dict:
        if isinstance(out, Mapping):
            parts = dict(out)
        elif isinstance(out, (list, tuple)):
            parts = dict(enumerate(out))
        else:
            raise ValueError(
                f"Several losses need `{what}` with one entry per loss ({self.keys}). "
                f"Received a {type(out).__name__}."
            )
        missing = [k for k in self.keys if k not in parts]
        if missing:
            raise ValueError(f"`{what}` has no entry for losses {missing}. Received keys: {list(parts)}.")
        return parts

    def __call__(self, y_pred: Any, y: Any, per_sample: bool = False) -> torch.Tensor:
        preds, targets = self._parts(y_pred, "y_pred"), self._parts(y, "y")
        total = None
        for k in self.keys:
            term = self.losses[k](preds[k], targets[k], per_sample=per_sample) * self.weights[k]
            total = term if total is None else total + term
        return total
