"""Metrics: names resolved to torchmetrics, with the task inferred from the first batch.

``"accuracy"`` is the fraction of correct predictions (micro average, as in Keras; torchmetrics'
multiclass default is macro). Classification metrics that only need labels are fed integer
labels (argmax or a threshold computed here), which keeps torchmetrics from checking the range
of the predictions, a host sync on every step. Metrics are unweighted per-sample means, as
Keras' ``metrics=`` are (sample weights apply to the loss).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from fitkit.losses import class_layout

if TYPE_CHECKING:
    import torchmetrics

__all__ = ["MetricSet", "infer_task", "METRIC_NAMES"]

# name -> {task: (torchmetrics class name, kwargs)}; "score" metrics want probabilities, the
# rest labels. Names, not classes: torchmetrics (and the scipy it pulls in) is imported only
# when a model compiles metrics, which keeps `import fitkit` fast.
_ACC, _MICRO = "Accuracy", {"average": "micro"}
_CLASSIFICATION: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    name: {
        task: (f"{task.capitalize()}{cls}", _MICRO if name == "accuracy" and task != "binary" else {})
        for task in ("binary", "multiclass", "multilabel")
    }
    for name, cls in (
        ("accuracy", _ACC),
        ("precision", "Precision"),
        ("recall", "Recall"),
        ("f1", "F1Score"),
        ("auroc", "AUROC"),
        ("average_precision", "AveragePrecision"),
    )
}
_SCORE_METRICS = {"auroc", "average_precision"}
_REGRESSION: dict[str, tuple[str, dict[str, Any]]] = {
    "mae": ("MeanAbsoluteError", {}),
    "mse": ("MeanSquaredError", {}),
    "rmse": ("MeanSquaredError", {"squared": False}),
    "r2": ("R2Score", {}),
    "mape": ("MeanAbsolutePercentageError", {}),
}


def _is_metric(obj: Any) -> bool:
    """``isinstance(obj, torchmetrics.Metric)`` without importing torchmetrics for it."""
    tm = sys.modules.get("torchmetrics")
    return tm is not None and isinstance(obj, tm.Metric)


def _make_classification(name: str, task: str, n: int) -> Any:
    from torchmetrics import classification

    cls_name, kwargs = _CLASSIFICATION[name][task]
    cls = getattr(classification, cls_name)
    if task == "binary":
        return cls(validate_args=False, **kwargs)
    return cls(n, validate_args=False, **kwargs)


def _make_regression(name: str) -> Any:
    from torchmetrics import regression

    cls_name, kwargs = _REGRESSION[name]
    return getattr(regression, cls_name)(**kwargs)


#: The metric names that ``compile(metrics=[...])`` accepts, classification names first (the
#: task, binary / multiclass / multilabel, is inferred from the first batch), then regression.
METRIC_NAMES = tuple(_CLASSIFICATION) + tuple(_REGRESSION)


def snake_case(name: str) -> str:
    """``MulticlassAccuracy`` -> ``multiclass_accuracy``.

    Example:
        >>> snake_case("MeanAbsoluteError")
        'mean_absolute_error'
    """
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def infer_task(y_pred: torch.Tensor, y: torch.Tensor, loss_kind: str | None = None) -> tuple[str, int, bool]:
    """Infer ``(task, num_classes, class_last)`` from one batch's shapes and dtypes.

    ``task`` is ``"binary"``, ``"multiclass"``, ``"multilabel"`` or ``"regression"``;
    ``class_last`` marks language-model logits ``(B, T, V)`` with targets ``(B, T)``.

    Example:
        >>> infer_task(torch.zeros(4, 10), torch.zeros(4, dtype=torch.long))
        ('multiclass', 10, False)
        >>> infer_task(torch.zeros(4, 1), torch.zeros(4))
        ('regression', 0, False)
        >>> infer_task(torch.zeros(4, 1), torch.zeros(4), "binary")
        ('binary', 2, False)
    """
    integer = not y.is_floating_point()
    binary_like = integer or loss_kind == "binary"
    if y_pred.dim() == y.dim() + 1 and integer:
        # The loss's rule (fitkit.losses.class_layout), so that loss and metrics agree.
        if class_layout(y_pred, y, previous="last") == "last":
            return "multiclass", int(y_pred.shape[-1]), True
        if y_pred.shape[1] == 1:
            return "binary", 2, False
        return "multiclass", int(y_pred.shape[1]), False
    same = y_pred.shape == y.shape or y_pred.numel() == y.numel() and y_pred.reshape(-1).shape[0] == y.shape[0]
    if same and binary_like:
        if y_pred.dim() >= 2 and y_pred.shape[-1] > 1 and y_pred.shape == y.shape:
            return "multilabel", int(y_pred.shape[-1]), False
        return "binary", 2, False
    if y_pred.shape == y.shape and loss_kind == "class_index" and y_pred.dim() == 2:
        return "multiclass", int(y_pred.shape[1]), False  # class-probability targets
    return "regression", 0, False


class _Entry:
    __slots__ = ("key", "metric", "kind")

    def __init__(self, key: str, metric: torchmetrics.Metric, kind: str):
        self.key, self.metric, self.kind = key, metric, kind  # kind: labels | scores | raw


class MetricSet:
    """The compiled metrics of a model: built on the first batch, updated every step.

    Args:
        metrics: names, ``torchmetrics.Metric`` objects, or a dict ``{log_name: metric}``.

    Raises:
        ValueError: an unknown name (listing valid names), or, on the first batch, a
            classification metric asked of regression targets.
        TypeError: an entry that is neither a name nor a ``torchmetrics.Metric``.

    Example:
        >>> ms = MetricSet(["accuracy"])
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
        >>> ms.update(logits, torch.tensor([0, 1, 1]))
        >>> {k: round(float(v), 4) for k, v in ms.compute().items()}
        {'accuracy': 0.6667}
    """

    def __init__(self, metrics: Any = None):
        if metrics is None:
            metrics = []
        if isinstance(metrics, str) or _is_metric(metrics):
            metrics = [metrics]
        if isinstance(metrics, Mapping):
            items = list(metrics.items())
        elif isinstance(metrics, (list, tuple)):
            items = [(None, m) for m in metrics]
        else:
            raise TypeError(
                "Expected `metrics` to be a list of names / torchmetrics.Metric objects or a dict "
                f"{{log_name: metric}}. Received: {type(metrics).__name__}."
            )
        self.specs: list[tuple[str, Any]] = []
        for key, m in items:
            if isinstance(m, str):
                if m not in METRIC_NAMES:
                    raise ValueError(f"Unknown metric '{m}'. Valid names: {', '.join(METRIC_NAMES)}.")
                self.specs.append((key or m, m))
            elif _is_metric(m):
                self.specs.append((key or snake_case(type(m).__name__), m))
            else:
                raise TypeError(
                    "Expected each metric to be a name or a torchmetrics.Metric. "
                    f"Received: {m!r} of type {type(m).__name__}."
                )
        keys = [k for k, _ in self.specs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"Metric log names must be unique. Received: {keys}. Fix: pass a dict.")
        self.entries: list[_Entry] | None = None if self.specs else []
        self.loss_kind: str | None = None
        self.device: torch.device | None = None
        self._logits: bool = True

    @property
    def keys(self) -> list[str]:
        """The log names of the metrics, in the order given (known before the first batch).

        A name logs as itself, a ``torchmetrics.Metric`` as its class name in snake case, a
        dict entry as its key.

        Example:
            >>> MetricSet(["accuracy", "mae"]).keys, MetricSet({"acc": "accuracy"}).keys
            (['accuracy', 'mae'], ['acc'])
        """
        return [k for k, _ in self.specs]

    def higher_is_better(self, key: str) -> bool | None:
        """The direction of the metric logged as ``key`` (``None`` when unknown)."""
        for entry in self.entries or []:
            if entry.key == key:
                return entry.metric.higher_is_better
        for k, m in self.specs:
            if k == key and _is_metric(m):
                return m.higher_is_better
            if k == key and m in _REGRESSION:
                return m == "r2"
            if k == key and m in _CLASSIFICATION:
                return True
        return None

    def build(self, y_pred: torch.Tensor, y: torch.Tensor) -> None:
        """Create the metrics for the task the first batch shows (a one-time host sync)."""
        if not isinstance(y_pred, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise ValueError(
                "Compiled metrics need a module with one tensor output and tensor targets. "
                f"Received y_pred of type {type(y_pred).__name__} and y of type {type(y).__name__}. "
                "Fix: for several outputs, compute metrics in a callback or a custom test_step."
            )
        task, n, self.class_last = infer_task(y_pred, y, self.loss_kind)
        self.task = task
        if task == "binary":
            if self.loss_kind == "binary":
                self._logits = getattr(self, "_loss_name", "") != "bce"
            else:
                self._logits = not bool(((y_pred >= 0) & (y_pred <= 1)).all())
        entries = []
        for key, m in self.specs:
            if _is_metric(m):
                entries.append(_Entry(key, m, "raw"))
            elif m in _REGRESSION:
                entries.append(_Entry(key, _make_regression(m), "regression"))
            elif task == "regression":
                raise ValueError(
                    f"Metric '{m}' needs class targets, but the first batch looks like regression: "
                    f"y_pred {tuple(y_pred.shape)} {y_pred.dtype}, y {tuple(y.shape)} {y.dtype}. "
                    "Fix: pass integer class labels, or use a regression metric such as 'mae'."
                )
            else:
                kind = "scores" if m in _SCORE_METRICS else "labels"
                entries.append(_Entry(key, _make_classification(m, task, n), kind))
        for e in entries:
            e.metric.to(self.device or y_pred.device)
        self.entries = entries

    @torch.no_grad()
    def update(self, y_pred: Any, y: Any) -> None:
        """Add one batch (``y_pred`` detached here) to every metric's state."""
        if self.entries is None:
            self.build(y_pred, y)
        if not self.entries:
            return
        y_pred = y_pred.detach()
        labels = scores = None
        task = self.task
        if self.class_last:
            y_pred = y_pred.reshape(-1, y_pred.shape[-1])  # (B*T, V)
            y = y.reshape(-1)
        if task != "regression" and not y.is_floating_point() and y.dtype != torch.long:
            y = y.long()
        for e in self.entries:
            if e.kind == "raw":
                # (B, 1) predictions meet (B,) targets as they do in the loss (no broadcast).
                same = y_pred.shape == y.shape or y_pred.numel() != y.numel()
                e.metric.update(y_pred if same else y_pred.reshape(y.shape), y)
            elif e.kind == "regression":
                p = y_pred.reshape(y.shape) if y_pred.shape != y.shape and y_pred.numel() == y.numel() else y_pred
                e.metric.update(p, y.to(p.dtype))
            elif e.kind == "labels":
                if labels is None:
                    labels, target = self._labels(y_pred, y)
                e.metric.update(labels, target)
            else:
                if scores is None:
                    scores, target = self._scores(y_pred, y)
                e.metric.update(scores, target)

    def _target(self, y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.task == "multiclass" and y.shape == y_pred.shape:
            return y.argmax(1)  # class-probability targets
        if self.task in ("binary", "multilabel"):
            y = y.reshape(y_pred.shape) if y.shape != y_pred.shape else y
            return y.long() if y.is_floating_point() else y
        return y

    def _labels(self, y_pred: torch.Tensor, y: torch.Tensor):
        target = self._target(y_pred, y)
        if self.task == "multiclass":
            return y_pred.argmax(1), target
        threshold = 0.0 if self._logits else 0.5
        return (y_pred > threshold).long().reshape(target.shape), target

    def _scores(self, y_pred: torch.Tensor, y: torch.Tensor):
        target = self._target(y_pred, y)
        if self.task == "multiclass":
            return y_pred.float().softmax(1), target
        p = y_pred.float().sigmoid() if self._logits else y_pred.float()
        return p.reshape(target.shape), target

    def compute(self) -> dict[str, torch.Tensor]:
        """Epoch values (0-dim tensors) of every metric updated since the last reset."""
        out = {}
        for e in self.entries or []:
            if e.metric.update_count:
                out[e.key] = e.metric.compute()
        return out

    def reset(self) -> None:
        """Clear every metric's state (at the start of each epoch and evaluation).

        Example:
            >>> ms = MetricSet(["accuracy"])
            >>> ms.update(torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0]))
            >>> ms.compute()
            {'accuracy': tensor(0.5000)}
            >>> ms.reset(); ms.compute()
            {}
        """
        for e in self.entries or []:
            e.metric.reset()

    def to(self, device: torch.device) -> None:
        """Move the metric states to ``device``, in place; metrics built later are created there.

        Args:
            device: the model's device.
        """
        self.device = device
        for e in self.entries or []:
            e.metric.to(device)
