"""Losses: names, ``nn.Module`` losses and callables, all in PyTorch's order ``loss(y_pred, y)``.

Every loss is wrapped in a :class:`Loss` that makes targets fit the prediction the way a user
means them (``int32`` labels become ``int64``; ``(B, 1)`` predictions meet ``(B,)`` targets
without PyTorch's silent ``(B, B)`` broadcast; language-model logits ``(B, T, V)`` meet
``(B, T)`` targets) and returns either the batch mean or one value per sample, so that sample
weights give ``sum(w * l) / sum(w)``.

A :class:`Loss` also says what it knows about the predictions, for the metrics
(:meth:`fitkit.metrics.MetricSet.configure`): ``output`` (``"logits"``, ``"probs"``,
``"log_probs"`` or ``None`` when unknown) and ``ignore_index`` (the target value that counts
for nothing, or ``None``).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from fitkit.checks import FitkitWarning, class_not_instance
from fitkit.losses import keras_names
from fitkit.losses.terms import split_terms

__all__ = ["Loss", "MultiLoss", "resolve_loss", "class_layout", "LOSSES", "OUTPUTS"]

#: What a loss may say about the predictions it is given.
OUTPUTS = ("logits", "probs", "log_probs")

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
    "kl_div": (F.kl_div, "regression"),
}

#: The functionals that stand for the named losses: ``compile(loss=F.cross_entropy)`` is
#: ``compile(loss="cross_entropy")``.
_FUNCTIONAL_NAMES: dict[int, str] = {
    id(F.mse_loss): "mse",
    id(F.l1_loss): "l1",
    id(F.huber_loss): "huber",
    id(F.smooth_l1_loss): "smooth_l1",
    id(F.cross_entropy): "cross_entropy",
    id(F.nll_loss): "nll",
    id(F.kl_div): "kl_div",
    id(F.binary_cross_entropy_with_logits): "bce_with_logits",
    id(F.binary_cross_entropy): "bce",
}

#: The loss modules fitkit knows: their name in :data:`LOSSES`, and the attributes (torch's
#: constructor arguments) passed on to the functional when they differ from its default.
_MODULES: dict[type, tuple[str, dict[str, Any]]] = {
    nn.MSELoss: ("mse", {}),
    nn.L1Loss: ("l1", {}),
    nn.HuberLoss: ("huber", {"delta": 1.0}),
    nn.SmoothL1Loss: ("smooth_l1", {"beta": 1.0}),
    nn.CrossEntropyLoss: ("cross_entropy", {"weight": None, "ignore_index": -100, "label_smoothing": 0.0}),
    nn.NLLLoss: ("nll", {"weight": None, "ignore_index": -100}),
    nn.BCEWithLogitsLoss: ("bce_with_logits", {"weight": None, "pos_weight": None}),
    nn.BCELoss: ("bce", {"weight": None}),
    nn.KLDivLoss: ("kl_div", {"log_target": False}),
}

# What the classification losses expect of the prediction: PyTorch's documented inputs.
_NAME_OUTPUTS = {"cross_entropy": "logits", "nll": "log_probs", "bce_with_logits": "logits", "bce": "probs"}


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
                category=FitkitWarning,
                stacklevel=4,
            )
            return "last"
        return previous
    return "last" if last else "dim1" if dim1 else None


class Loss:
    """A loss in PyTorch's order with fitkit's target handling, and what it knows of ``y_pred``.

    Args:
        fn: ``fn(y_pred, y, reduction=...)`` for named / module losses, or any callable
            ``fn(y_pred, y) -> Tensor`` (a scalar batch mean, or values per sample / element),
            or one that returns a dict / tuple of 0-dim terms: their total is the loss and
            each term is logged (:mod:`fitkit.losses.terms`).
        kind: ``"regression"``, ``"class_index"``, ``"binary"`` or ``"custom"`` (``fn`` is called
            as given).
        name: for messages (default: ``fn.__name__``).
        output: what ``y_pred`` holds: ``"logits"``, ``"probs"``, ``"log_probs"``, or ``None``
            (unknown). Metrics that threshold or need probabilities follow it.
        ignore_index: a target value that counts for nothing (PyTorch's ``ignore_index``), or
            ``None``. Classification metrics skip these targets too.
        weight: a factor on the loss (``compile(loss_weights=...)`` for a single output).

    Attributes:
        output: as above; set by :func:`resolve_loss` for the losses it knows.
        options: keyword arguments ``fn`` takes beyond ``reduction`` (a module's
            ``label_smoothing``, ``pos_weight``, ...; set by :func:`resolve_loss`), empty by default.
        ignore_index: as above.
        weight: as above.

    Raises:
        ValueError: an ``output`` outside :data:`OUTPUTS`.

    Example:
        >>> loss = resolve_loss("mse")
        >>> loss(torch.zeros(4, 1), torch.tensor([1.0, 1.0, 1.0, 4.0]))
        tensor(4.7500)
        >>> loss(torch.zeros(4, 1), torch.tensor([1.0, 1.0, 1.0, 4.0]), per_sample=True)
        tensor([ 1.,  1.,  1., 16.])

        A callable that tells the metrics its predictions are logits:

        >>> def my_bce(y_pred, y):
        ...     return F.binary_cross_entropy_with_logits(y_pred.squeeze(-1), y.float())
        >>> loss = Loss(my_bce, output="logits")
        >>> loss.name, loss.output, loss.ignore_index
        ('my_bce', 'logits', None)
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        kind: str = "custom",
        name: str | None = None,
        *,
        output: str | None = None,
        ignore_index: int | None = None,
        weight: float = 1.0,
    ):
        if output is not None and output not in OUTPUTS:
            raise ValueError(
                f"Expected `output` to be one of {', '.join(OUTPUTS)} or None. Received: output={output!r}."
            )
        if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
            raise TypeError(f"Expected `ignore_index` to be an int or None. Received: ignore_index={ignore_index!r}.")
        self.fn, self.kind = fn, kind
        self.name = name if name is not None else getattr(fn, "__name__", type(fn).__name__)
        self.output, self.ignore_index, self.weight = output, ignore_index, float(weight)
        self.class_last = False  # set per call for class_index losses
        self.class_weights: torch.Tensor | None = None  # nn.CrossEntropyLoss(weight=...)'s
        self._layout: str | None = None  # the class layout seen first, kept when ambiguous
        self.classes: int | None = None  # the number of classes seen first (an int compare per step)
        #: ``"sum"`` for a module loss built with ``reduction="sum"``: the objective is then the
        #: batch's sum (and a window's, and the ranks'), not a mean (:mod:`fitkit.losses.denominators`)
        self.reduction = "mean"
        # keyword arguments of fn beyond reduction (a module's label_smoothing, pos_weight, ...)
        self.options: dict[str, Any] = {}
        #: the named terms of the last call of a callable that returned a dict or a tuple
        #: (:mod:`fitkit.losses.terms`), until ``update_metrics`` takes them into the running totals
        self.terms: dict[str, torch.Tensor] | None = None

    def take_terms(self) -> dict[str, torch.Tensor] | None:
        """The terms of the last call (a dict or tuple returned by the callable), then none.

        Example:
            >>> loss = Loss(lambda y_pred, y: {"a": y_pred.mean(), "b": y.mean()})
            >>> loss(torch.ones(2), torch.zeros(2))
            tensor(1.)
            >>> loss.take_terms(), loss.take_terms()
            ({'a': tensor(1.), 'b': tensor(0.)}, None)
        """
        terms, self.terms = self.terms, None
        return terms

    def prepare(self, y_pred: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Match ``y`` to ``y_pred`` (dtype and shape); raise ``ValueError`` when they cannot.

        A float16 / bfloat16 prediction (mixed precision) is taken to float32 first: the loss is
        computed in float32 and targets are never cast down to half precision.
        """
        if self.kind == "custom" or not isinstance(y_pred, torch.Tensor):
            return y_pred, y
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"Loss '{self.name}' needs tensor targets. Received y of type {type(y).__name__}.")
        if y_pred.dtype in (torch.float16, torch.bfloat16):
            # Mixed precision: the loss in float32 from the module's output, as autocast computes
            # its losses, so targets are never rounded to the output's half precision.
            y_pred = y_pred.float()
        if self.kind == "class_index":
            return self._prepare_class_index(y_pred, y)
        if y.dtype != y_pred.dtype:
            y = y.to(y_pred.dtype)
        if y.shape != y_pred.shape:
            if y_pred.numel() == y.numel() and (
                y_pred.shape[:-1] == y.shape
                and y_pred.shape[-1] == 1
                or y.shape[:-1] == y_pred.shape
                and y.shape[-1] == 1
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
        if y.shape == y_pred.shape and y.is_floating_point():  # class probabilities (soft / smoothed / mixed)
            # The classes are where fitkit puts them for logits: the last dimension of a (B, T, V)
            # output (a layout seen before with class indices wins), dim 1 of a (B, C) one.
            if y_pred.dim() >= 3:
                self._layout = self._layout or "last"
                self.class_last = self._layout == "last"
            else:
                self.class_last = False
            return y_pred, y.to(y_pred.dtype)
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
            classes = y_pred.shape[-1] if self.class_last else y_pred.shape[1]
            if classes != self.classes:  # a host int already known: no sync, no op
                if self.classes is not None:
                    raise ValueError(
                        f"Loss '{self.name}' got logits for {classes} classes {_shape(y_pred)}, but earlier batches "
                        f"had {self.classes}: the module's output changed width during training, so the class "
                        "indices no longer mean what they did. Fix: make the module's output size fixed (one output "
                        "per class); after replacing the head on purpose, call model.compile(...) again."
                    )
                self.classes = classes
            return y_pred, y
        raise ValueError(
            f"Loss '{self.name}' got logits {_shape(y_pred)} and class indices {_shape(y)}. "
            "Expected logits (B, C) with y (B,), (B, C, d1, ...) with y (B, d1, ...), or "
            "(B, T, V) with y (B, T)."
        )

    def __call__(self, y_pred: torch.Tensor, y: torch.Tensor, per_sample: bool = False) -> torch.Tensor:
        """Batch-mean loss (0-dim), or ``(B,)`` per-sample losses when ``per_sample``, times ``weight``."""
        out = self._unweighted(y_pred, y, per_sample)
        return out if self.weight == 1.0 else out * self.weight

    def _unweighted(self, y_pred: torch.Tensor, y: torch.Tensor, per_sample: bool) -> torch.Tensor:
        matched = (  # targets that already match the prediction: nothing for prepare to do
            self.kind not in ("class_index", "custom")
            and type(y_pred) is torch.Tensor
            and type(y) is torch.Tensor
            and y.dtype == y_pred.dtype
            and y.shape == y_pred.shape
        )
        if not matched:
            y_pred, y = self.prepare(y_pred, y)
        if self.kind == "custom":
            out = self.fn(y_pred, y)
            if not isinstance(out, torch.Tensor):  # a dict or tuple of terms: their total
                out, self.terms = split_terms(out, self.name)
                if per_sample:
                    raise ValueError(
                        f"Sample weights (or class_weight) need a loss per sample, but the loss '{self.name}' "
                        "returned terms, one 0-dim value each per batch. Fix: drop sample_weight / class_weight, "
                        "or return one tensor of per-sample values (e.g. reduction='none')."
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
        reduction = "none" if per_sample else self.reduction  # a module's reduction="sum" stays a sum
        try:
            if self.kind == "class_index" and self.class_last:
                v = y_pred.shape[-1]
                flat_y = y.reshape(-1, v) if y.shape == y_pred.shape else y.reshape(-1)  # probabilities keep V
                out = self.fn(y_pred.reshape(-1, v), flat_y, reduction=reduction, **self.options)
                return self._per_sample(out, y) if per_sample else out
            out = self.fn(y_pred, y, reduction=reduction, **self.options)
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
        return self._per_sample(out, y) if per_sample else out

    def _per_sample(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``(B,)`` per-sample losses: the mean over each sample's positions that count.

        Positions whose target is ``ignore_index`` add 0 to ``out`` and are left out of the
        count, so a sample's loss is the mean over its real tokens, as the unweighted loss is.
        """
        per = out.reshape(y.shape[0], -1) if y.dim() else out.reshape(out.shape[0], -1)
        if self.reduction == "batchmean":  # KL's: the sum over each sample's values
            return per.sum(1)
        if self.kind != "class_index" or self.ignore_index is None or y.is_floating_point():
            return per.mean(1)
        counts = (y.reshape(y.shape[0], -1) != self.ignore_index).sum(1)
        return per.sum(1) / counts.clamp(min=1).to(per.dtype)


def _check_reduction(loss: nn.Module) -> None:
    """A torch loss module's ``reduction`` is one torch knows (fitkit reads it: "sum" stays a sum)."""
    reduction = getattr(loss, "reduction", None)
    valid = ("mean", "sum", "none", "batchmean") if isinstance(loss, nn.KLDivLoss) else ("mean", "sum", "none")
    if isinstance(loss, nn.modules.loss._Loss) and reduction not in valid:
        raise ValueError(
            f"Expected the loss's `reduction` to be one of {', '.join(repr(v) for v in valid)}. Received: "
            f"{type(loss).__name__}(reduction={reduction!r}). Fix: pass reduction='mean' (fitkit's per-sample "
            "mean) or 'sum'."
        )


def resolve_loss(loss: Any, loss_weights: Any = None) -> Loss | MultiLoss | None:
    """Build a :class:`Loss` from a name, an ``nn.Module`` loss or a callable.

    A loss fitkit knows has one form however it is written: the name (``"cross_entropy"``),
    torch's functional (``F.cross_entropy``) and torch's module (``nn.CrossEntropyLoss()``)
    resolve to the functional of :data:`LOSSES`, with the module's own options in
    :attr:`Loss.options` (``weight``, ``ignore_index``, ``label_smoothing``, ``pos_weight``,
    ``delta``, ``beta``, ``log_target``, those that differ from the functional's defaults) and its
    ``reduction`` in :attr:`Loss.reduction` (``"sum"``, KL's ``"batchmean"``, else ``"mean"``),
    so every spelling takes the same path through the step. Exact module types only: a subclass
    may redefine ``forward`` and is called as a callable.

    The losses fitkit knows tell the metrics what the predictions are (``output``) and which
    targets to skip (``ignore_index``): ``"cross_entropy"`` / ``nn.CrossEntropyLoss`` take
    logits, ``"nll"`` / ``nn.NLLLoss`` log-probabilities (both with ``ignore_index`` -100 or
    the module's own), ``"bce_with_logits"`` / ``nn.BCEWithLogitsLoss`` logits, ``"bce"`` /
    ``nn.BCELoss`` probabilities. Of a plain callable nothing is known (``None``); wrap it in a
    :class:`Loss` with ``output=`` / ``ignore_index=`` to say.

    Args:
        loss: a name of :data:`LOSSES`, an ``nn.Module`` such as ``nn.CrossEntropyLoss()``, a
            callable ``loss(y_pred, y)``, a :class:`Loss`, a list / dict of those for a module
            with several outputs (see :class:`MultiLoss`), or ``None`` (for a custom
            ``compute_loss``).
        loss_weights: ``None``; for a single loss, a number that multiplies it (Keras'
            ``loss_weights`` for a single output); for a list / dict of losses, one weight per
            loss in the same structure.

    Raises:
        ValueError: an unknown name (the message lists the valid ones; a Keras name with no exact
            equivalent says what to write instead, see :mod:`fitkit.losses.keras_names`), ``loss_weights`` without
            a loss, or weights that do not match the losses.
        TypeError: a class where an instance is meant (``nn.CrossEntropyLoss`` for
            ``nn.CrossEntropyLoss()``), or anything else, such as a list of weights for a single loss.

    Example:
        >>> resolve_loss("cross_entropy").kind, resolve_loss(nn.NLLLoss(ignore_index=0)).ignore_index
        ('class_index', 0)
        >>> resolve_loss(nn.BCELoss()).output, resolve_loss(lambda y_pred, y: y_pred.sum()).output
        ('probs', None)
        >>> resolve_loss("mse", loss_weights=0.5)(torch.zeros(2), torch.tensor([1.0, 3.0]))
        tensor(2.5000)
        >>> smoothed = resolve_loss(nn.CrossEntropyLoss(label_smoothing=0.1))
        >>> smoothed.fn is F.cross_entropy, smoothed.options, resolve_loss(F.mse_loss).name
        (True, {'label_smoothing': 0.1}, 'mse')
    """
    if loss_weights is not None:
        return _weighted(loss, loss_weights)
    if loss is None or isinstance(loss, (Loss, MultiLoss)):
        return loss
    if isinstance(loss, (list, tuple, Mapping)):
        return MultiLoss(loss)
    if isinstance(loss, str):
        return _named(loss)
    if isinstance(loss, type):
        raise TypeError(class_not_instance("loss", loss))
    if isinstance(loss, nn.Module):
        _check_reduction(loss)
        known = _MODULES.get(type(loss))  # exact types only: a subclass may redefine forward
        return _from_module(loss, *known) if known is not None else Loss(loss, "custom", type(loss).__name__)
    if callable(loss):
        name = _FUNCTIONAL_NAMES.get(id(loss))  # the functional itself, alive as long as torch is
        if name is not None:
            return _named(name)
        return Loss(loss, "custom", getattr(loss, "__name__", type(loss).__name__))
    raise TypeError(
        "Expected `loss` to be a name, an nn.Module or a callable loss(y_pred, y). "
        f"Received: loss={loss!r} of type {type(loss).__name__}."
    )


def _named(loss: str, name: str | None = None, options: dict[str, Any] | None = None) -> Loss:
    """The one form of every spelling of a known loss: its functional, kind, and the options
    (``label_smoothing``, ``pos_weight``, ...) that differ from the functional's defaults."""
    loss = loss if loss in LOSSES else keras_names.canonical_loss(loss)
    if loss not in LOSSES:
        advice = keras_names.loss_advice(loss)
        if advice is not None:
            raise ValueError(f"Unknown loss '{loss}': {advice}")
        raise ValueError(
            f"Unknown loss '{loss}'.{keras_names.close_matches(loss, LOSSES)} Valid names: "
            f"{', '.join(LOSSES)}. Or pass an nn.Module or a callable loss(y_pred, y)."
        )
    fn, kind = LOSSES[loss]
    options = options or {}
    ignore = options.get("ignore_index", -100) if kind == "class_index" else None  # F.cross_entropy's default
    out = Loss(fn, kind, name or loss, output=_NAME_OUTPUTS.get(loss), ignore_index=ignore)
    out.options = options
    weight = options.get("weight") if kind == "class_index" else None
    out.class_weights = weight if isinstance(weight, torch.Tensor) else None
    return out


def _from_module(module: nn.Module, name: str, defaults: dict[str, Any]) -> Loss:
    """A loss module of torch's as its functional: its own ``weight``, ``ignore_index``,
    ``label_smoothing``, ``pos_weight``, ``delta``, ``beta``, ``log_target`` and ``reduction``."""
    options = {}
    for key, default in defaults.items():
        value = getattr(module, key, default)
        if isinstance(value, torch.Tensor) or value != default:
            options[key] = value
    out = _named(name, type(module).__name__, options)
    reduction = getattr(module, "reduction", "mean")
    out.reduction = reduction if reduction in ("sum", "batchmean") else "mean"  # "none": fitkit's mean
    return out


def _weighted(loss: Any, loss_weights: Any) -> Loss | MultiLoss:
    if isinstance(loss, (list, tuple, Mapping)):
        return MultiLoss(loss, loss_weights)
    if loss is None or isinstance(loss, MultiLoss):
        raise ValueError(
            "`loss_weights` needs a compiled loss to weight. Received: loss=None. Fix: pass `loss`, "
            "or apply the weight in your compute_loss."
            if loss is None
            else "`loss_weights` cannot re-weight a MultiLoss. Fix: pass the weights to MultiLoss itself."
        )
    if isinstance(loss_weights, bool) or not isinstance(loss_weights, (int, float)):
        raise TypeError(
            "Expected `loss_weights` to be a number for a single loss (a list or dict needs one loss "
            f"per output). Received: loss_weights={loss_weights!r}."
        )
    if not math.isfinite(loss_weights):
        raise ValueError(f"Expected `loss_weights` to be a finite number. Received: loss_weights={loss_weights!r}.")
    single = cast(Loss, resolve_loss(loss))  # lists, MultiLoss and None are handled above
    weighted = copy.copy(single)  # a copy: a Loss passed in is left as it is
    weighted.weight = weighted.weight * float(loss_weights)
    return weighted


class MultiLoss:
    """One loss per output of a module with several outputs, summed with weights (Keras).

    ``y_pred`` and ``y`` are tuples / lists (matched by position) or dicts (matched by key) with
    one entry per loss; the objective is ``sum(weight_i * loss_i(y_pred_i, y_i))``. A ``None`` loss
    (Keras' ``loss=["mse", None]``) is an output that trains no loss: its prediction is left out,
    and ``y`` needs entries only for the outputs that have a loss (a list of those, in order, or
    one tensor for one; a full list or dict works too, its ``None`` outputs' entries unused).

    Args:
        losses: a list / tuple or dict of losses (names, modules, callables, or ``None``).
        loss_weights: one weight per loss (same structure); default 1 each.

    Raises:
        ValueError: weights that do not match the losses, or predictions / targets of another
            structure.

    Example:
        >>> loss = MultiLoss(["mse", "mae"], loss_weights=[1.0, 0.5])
        >>> loss((torch.zeros(2), torch.zeros(2)), (torch.ones(2), torch.full((2,), 4.0)))
        tensor(3.)
        >>> MultiLoss(["mse", None])((torch.zeros(2), torch.zeros(2)), torch.full((2,), 2.0))  # labels for output 0
        tensor(4.)
    """

    kind = "multi"
    name = "multi"
    output: str | None = None  # several outputs: nothing that one set of metrics could follow
    ignore_index: int | None = None
    terms: dict[str, torch.Tensor] | None = None  # several losses log no terms (a term is refused)

    def __init__(self, losses: Any, loss_weights: Any = None):
        self.keys = list(losses) if isinstance(losses, Mapping) else list(range(len(losses)))
        if not self.keys:
            raise ValueError("Expected at least one loss. Received an empty list or dict.")
        items = losses if isinstance(losses, Mapping) else dict(enumerate(losses))
        self.losses: dict[Any, Any] = {k: resolve_loss(items[k]) for k in self.keys}
        self.active = [k for k in self.keys if self.losses[k] is not None]  # the outputs with a loss
        if not self.active:
            raise ValueError(
                f"Expected at least one loss among the outputs. Received only None: loss={list(items.values())!r}. "
                "Fix: give an output a loss, or pass loss=None for a module that returns its own."
            )
        if loss_weights is None:
            self.weights = {k: 1.0 for k in self.keys}
        else:
            if not isinstance(loss_weights, (list, tuple, Mapping)):
                raise ValueError(
                    f"Expected `loss_weights` to match the losses ({self.keys}). Received: "
                    f"{loss_weights!r}. Fix: one weight per loss, as a list or a dict."
                )
            w = loss_weights if isinstance(loss_weights, Mapping) else dict(enumerate(loss_weights))
            if sorted(map(str, w)) != sorted(map(str, self.keys)):
                raise ValueError(
                    f"Expected `loss_weights` to match the losses ({self.keys}). Received: "
                    f"{loss_weights!r}. Fix: one weight per loss, as a list or a dict."
                )
            self.weights = {k: float(w[k]) for k in self.keys}

    def _targets(self, y: Any) -> dict:
        """``y`` by output: for outputs with a loss only (Keras), or for every output."""
        if len(self.active) == len(self.keys) or isinstance(y, Mapping):
            return self._parts(y, "y")
        if isinstance(y, torch.Tensor) and len(self.active) == 1:
            return {self.active[0]: y}
        if isinstance(y, (list, tuple)) and len(y) == len(self.active):
            return dict(zip(self.active, y, strict=True))
        return self._parts(y, "y")

    def _parts(self, out: Any, what: str) -> dict:
        if isinstance(out, Mapping):
            parts = dict(out)
        elif isinstance(out, (list, tuple)):
            parts = dict(enumerate(out))
        else:
            raise ValueError(
                f"Several losses need `{what}` with one entry per loss ({self.keys}). Received a {type(out).__name__}."
            )
        missing = [k for k in self.active if k not in parts]
        if missing:
            raise ValueError(f"`{what}` has no entry for losses {missing}. Received keys: {list(parts)}.")
        return parts

    def __call__(self, y_pred: Any, y: Any, per_sample: bool = False) -> torch.Tensor:
        preds, targets = self._parts(y_pred, "y_pred"), self._targets(y)
        terms = [self.losses[k](preds[k], targets[k], per_sample=per_sample) * self.weights[k] for k in self.active]
        for k in self.active:
            if self.losses[k].terms is not None:
                self.losses[k].terms = None
                raise ValueError(
                    f"The loss of output {k!r} returned terms (a dict or a tuple), which several losses do not "
                    "log. Fix: return one tensor from each output's loss, or compile one loss callable that "
                    "reads every output and returns the terms (loss=fn, fn(y_pred, y) -> dict)."
                )
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return total
