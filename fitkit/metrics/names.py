"""Metric names and specs: what ``compile(metrics=...)`` accepts, and the task of a batch.

The names resolve to torchmetrics classes only when a model builds its metrics: torchmetrics
(and the scipy it pulls in) is imported then, which keeps ``import fitkit`` fast.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

import torch

from fitkit.checks import class_not_instance
from fitkit.losses import OUTPUTS, class_layout, keras_names

__all__ = ["MetricSpec", "METRIC_NAMES", "infer_task", "snake_case"]

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
# multi-class label metrics that fitkit counts itself (fitkit.metrics.counted), torchmetrics' values
_COUNTED_STATS = {"precision", "recall", "f1"}
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


def _make_classification(
    name: str, task: str, n: int, ignore_index: int | None, device: torch.device | None = None
) -> Any:
    from torchmetrics import classification

    if name == "accuracy" and task == "multiclass":  # torchmetrics' micro accuracy from two counts
        from fitkit.metrics.counted import CountedAccuracy

        mps = device is not None and device.type == "mps"  # MPS has no float64
        return CountedAccuracy(n, ignore_index, count_dtype=torch.float32 if mps else torch.float64)
    if name in _COUNTED_STATS and task == "multiclass":  # torchmetrics' macro values from per-class counts
        from fitkit.metrics.counted import CountedStatScores

        return CountedStatScores(n, name, ignore_index)
    cls_name, kwargs = _CLASSIFICATION[name][task]
    if ignore_index is not None:
        kwargs = {**kwargs, "ignore_index": ignore_index}
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
    if y_pred.shape == y.shape and loss_kind == "class_index" and y_pred.dim() >= 3:
        return "multiclass", int(y_pred.shape[-1]), True  # (B, T, V) probabilities: the loss's layout
    return "regression", 0, False


class MetricSpec:
    """A metric with what fitkit cannot infer: what ``y_pred`` holds, or the metric's direction.

    Args:
        metric: a name of :data:`METRIC_NAMES` (or a Keras name of
            :data:`fitkit.losses.keras_names.METRIC_ALIASES`, logged under the name given), or a callable
            ``fn(y_pred, y_true) -> Tensor``.
        output: for a classification name: ``"logits"``, ``"probs"`` or ``"log_probs"``, which
            overrides what the loss says (needed where the loss cannot tell, e.g. a plain
            callable loss, for binary / multilabel metrics and for ``"auroc"`` /
            ``"average_precision"``).
        higher_is_better: the direction that ``mode="auto"`` of ``EarlyStopping`` and
            ``ModelCheckpoint`` follows (default: the name's own; ``None`` for a callable).

    Raises:
        ValueError: an unknown name or ``output``, or ``output`` for a metric that does not use it.
        TypeError: a ``metric`` that is neither a name nor a callable (a torchmetrics object is
            passed to ``metrics=`` directly and used as given), or a class where an instance is
            meant (``torchmetrics.classification.MulticlassAccuracy`` without ``(num_classes)``).

    Example:
        A loss that fitkit cannot read, and binary accuracy over the module's logits:

        >>> import fitkit
        >>> def hinge(y_pred, y):
        ...     return (1 - y_pred.squeeze(-1) * (2 * y - 1)).clamp(min=0).mean()
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> with torch.no_grad():
        ...     _ = model.module.weight.fill_(1.0), model.module.bias.zero_()
        >>> model.compile("sgd", hinge, metrics=[MetricSpec("accuracy", output="logits")])
        >>> model.evaluate(torch.tensor([[0.3], [-2.0], [0.2]]), torch.tensor([1, 0, 0]), verbose=0)["accuracy"]
        0.6666666865348816
    """

    def __init__(
        self,
        metric: str | Callable[..., torch.Tensor],
        *,
        output: str | None = None,
        higher_is_better: bool | None = None,
    ):
        given = metric
        if isinstance(metric, str):
            metric = metric if metric in METRIC_NAMES else keras_names.canonical_metric(metric)
            if metric not in METRIC_NAMES:
                advice = keras_names.metric_advice(metric)
                raise ValueError(
                    f"Unknown metric '{metric}': {advice}"
                    if advice is not None
                    else f"Unknown metric '{metric}'.{keras_names.close_matches(metric, METRIC_NAMES)} "
                    f"Valid names: {', '.join(METRIC_NAMES)}."
                )
        elif isinstance(metric, type):
            raise TypeError(class_not_instance("metrics", metric))
        elif _is_metric(metric) or not callable(metric):
            raise TypeError(
                "Expected `metric` to be a metric name or a callable fn(y_pred, y_true). Received: "
                f"{metric!r} of type {type(metric).__name__}. A torchmetrics object goes to `metrics=` as it is."
            )
        if output is not None and output not in OUTPUTS:
            raise ValueError(
                f"Expected `output` to be one of {', '.join(OUTPUTS)} or None. Received: output={output!r}."
            )
        if output is not None and metric not in _CLASSIFICATION:
            raise ValueError(
                f"`output` applies to the classification metric names ({', '.join(_CLASSIFICATION)}). "
                f"Received: output={output!r} for {metric!r}. A callable receives y_pred as the module returns it."
            )
        if higher_is_better is not None and not isinstance(higher_is_better, bool):
            raise TypeError(f"Expected `higher_is_better` to be a bool or None. Received: {higher_is_better!r}.")
        self.metric, self.output, self._higher = metric, output, higher_is_better
        self._key = given if isinstance(given, str) else None  # a Keras alias logs as written ("acc")

    @property
    def higher_is_better(self) -> bool | None:
        """The direction given, else the name's (``"r2"`` and classification up, errors down)."""
        if self._higher is not None or callable(self.metric):
            return self._higher
        return self.metric == "r2" or self.metric in _CLASSIFICATION

    def default_key(self) -> str | None:
        """The log name without a dict key: the metric name, ``fn.__name__``, or None for a lambda."""
        if isinstance(self.metric, str):
            return self._key or self.metric
        name = getattr(self.metric, "__name__", None)
        if name is None and not hasattr(self.metric, "func"):  # a callable object, not a partial
            name = snake_case(type(self.metric).__name__)
        return None if name is None or name.startswith("<") else name

    def __repr__(self) -> str:
        return f"MetricSpec({self.metric!r}, output={self.output!r})"


def check_reserved_keys(keys: list[str]) -> None:
    """Refuse metric log names that would take over a key fit writes itself.

    ``loss`` is the objective's key (EarlyStopping and friends monitor it), the ``val_``
    prefix marks validation values, and ``learning_rate`` / ``learning_rate/pg<i>`` are the
    learning rates: a metric under one of these names would log a training value in their place.

    Raises:
        ValueError: naming the metric and the fix.

    Example:
        >>> check_reserved_keys(["accuracy", "f1"])
        >>> check_reserved_keys(["val_acc"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: The metric name 'val_acc' is a key fit writes itself (the `val_` prefix ...
    """
    for key in keys:
        if key == "loss":
            what = "the loss's key"
        elif key.startswith("val_"):
            what = "the `val_` prefix of validation values: fit adds it to every metric it validates"
        elif key == "learning_rate" or key.startswith("learning_rate/"):
            what = "a learning rate's key"
        else:
            continue
        raise ValueError(
            f"The metric name {key!r} is a key fit writes itself ({what}), so the metric would take its "
            f"place in the logs. Fix: name the metric otherwise, e.g. {{'{key.removeprefix('val_')}_metric': ...}}."
        )


def check_regression_shapes(key: str, y_pred: torch.Tensor, y: torch.Tensor) -> None:
    """A regression metric compares predictions and targets element by element: they must
    have the same number of elements (``(B, 1)`` meets ``(B,)``).

    Raises:
        ValueError: e.g. ``"mae"`` on a 3-class classifier's ``(B, 3)`` scores and ``(B,)`` labels.

    Example:
        >>> check_regression_shapes("mae", torch.zeros(4, 3), torch.zeros(4))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: The metric 'mae' compares predictions and targets element by element, but they have ...
    """
    if y_pred.shape == y.shape or y_pred.numel() == y.numel():
        return
    raise ValueError(
        f"The metric {key!r} compares predictions and targets element by element, but they have shapes "
        f"{tuple(y_pred.shape)} and {tuple(y.shape)} (a classifier's scores and labels?). Fix: use a "
        "classification metric such as 'accuracy' here, or regression targets of the prediction's shape."
    )
