"""Keras' loss and metric names, read as fitkit's: aliases where they mean the same, errors where not.

A Keras user writes ``loss="binary_crossentropy", metrics=["acc"]``. Where the Keras name
computes what a fitkit name computes, with Keras' documented defaults, it is an alias
(:data:`LOSS_ALIASES`, :data:`METRIC_ALIASES`). Where it does not, mostly because Keras'
cross-entropies take probabilities by default (``from_logits=False``) while fitkit's
``"cross_entropy"`` takes logits, the name is refused with what to write instead
(:data:`LOSS_ADVICE`, :data:`METRIC_ADVICE`): fitkit never guesses what the module outputs.

Keras' defaults, from its documentation:

- ``binary_crossentropy(y_true, y_pred, from_logits=False)``: probabilities in ``[0, 1]``, the
  same as fitkit's ``"bce"`` (``F.binary_cross_entropy``).
- ``sparse_categorical_crossentropy(..., from_logits=False)``: integer labels and a softmax
  *probability* per class. fitkit's ``"cross_entropy"`` takes logits (a softmax inside).
- ``categorical_crossentropy(..., from_logits=False)``: one-hot (or soft) targets and
  probabilities; fitkit's ``"cross_entropy"`` takes soft targets too, but with logits.
- ``huber(y_true, y_pred, delta=1.0)``: fitkit's ``"huber"`` (``F.huber_loss``, delta 1.0).
- ``kl_divergence(y_true, y_pred) = sum(y_true * log(y_true / y_pred))`` over probabilities:
  no fitkit name (PyTorch's ``F.kl_div`` takes log-probabilities).
- ``"accuracy"`` / ``"acc"``: Keras picks binary, categorical or sparse accuracy from the loss;
  fitkit's ``"accuracy"`` infers the task from the batch and thresholds by what the loss says
  the module outputs (logit 0 or probability 0.5), so ``"binary_accuracy"``,
  ``"categorical_accuracy"`` and ``"sparse_categorical_accuracy"`` are ``"accuracy"`` too.
- ``"AUC"`` (ROC curve by default): fitkit's ``"auroc"`` (exact, where Keras interpolates 200
  thresholds).

Example:
    >>> canonical_loss("binary_crossentropy"), canonical_metric("acc"), canonical_metric("AUC")
    ('bce', 'accuracy', 'auroc')
    >>> print(loss_advice("sparse_categorical_crossentropy").split(", fitkit")[0])
    Keras' 'sparse_categorical_crossentropy' takes probabilities by default (from_logits=False)
"""

from __future__ import annotations

from fitkit.checks import close_matches

__all__ = [
    "LOSS_ALIASES",
    "METRIC_ALIASES",
    "LOSS_ADVICE",
    "METRIC_ADVICE",
    "canonical_loss",
    "canonical_metric",
    "loss_advice",
    "metric_advice",
    "close_matches",
]

#: Keras loss names that mean exactly a fitkit loss name (with Keras' default arguments).
LOSS_ALIASES: dict[str, str] = {
    "binary_crossentropy": "bce",
    "mean_squared_error": "mse",
    "mean_absolute_error": "mae",
    "huber_loss": "huber",
}

_CE_FIX = (
    "Fix: if the module's last layer gives logits (no softmax), use loss='cross_entropy' (Keras' "
    "from_logits=True); if it ends with a softmax, drop the softmax and use 'cross_entropy', or end "
    "with log_softmax and use loss='nll'."
)

#: Keras loss names with no exact fitkit equivalent, each with what to write instead.
LOSS_ADVICE: dict[str, str] = {
    "sparse_categorical_crossentropy": (
        "Keras' 'sparse_categorical_crossentropy' takes probabilities by default (from_logits=False), "
        "fitkit's 'cross_entropy' takes logits (it applies the softmax itself), with integer labels "
        "as Keras' sparse loss does. " + _CE_FIX
    ),
    "categorical_crossentropy": (
        "Keras' 'categorical_crossentropy' takes one-hot targets and probabilities by default "
        "(from_logits=False); fitkit's 'cross_entropy' takes logits, with integer labels or with "
        "one-hot / soft targets shaped like the prediction. " + _CE_FIX
    ),
    "kl_divergence": (
        "Keras' 'kl_divergence' is sum(y_true * log(y_true / y_pred)) over probabilities; fitkit has "
        "no loss of that name. Fix: loss=lambda y_pred, y: torch.nn.functional.kl_div("
        "y_pred.log(), y, reduction='batchmean') for probabilities (or y_pred itself for "
        "log-probabilities)."
    ),
    "binary_focal_crossentropy": (
        "fitkit has no focal loss. Fix: pass torchvision.ops.sigmoid_focal_loss (on logits) in a "
        "callable loss(y_pred, y)."
    ),
    "hinge": (
        "fitkit has no hinge loss. Fix: pass a callable loss(y_pred, y), e.g. (1 - y_pred * y).clamp(min=0).mean()."
    ),
    "poisson": (
        "fitkit has no 'poisson' name. Fix: loss=torch.nn.PoissonNLLLoss(log_input=False) for a rate "
        "(Keras' y_pred - y_true * log(y_pred))."
    ),
    "cosine_similarity": (
        "fitkit has no 'cosine_similarity' loss. Fix: loss=torch.nn.CosineEmbeddingLoss() or a callable."
    ),
}
LOSS_ADVICE["kld"] = LOSS_ADVICE["kullback_leibler_divergence"] = LOSS_ADVICE["kl_divergence"]

#: Keras metric names that mean a fitkit metric name.
METRIC_ALIASES: dict[str, str] = {
    "acc": "accuracy",
    "binary_accuracy": "accuracy",
    "categorical_accuracy": "accuracy",
    "sparse_categorical_accuracy": "accuracy",
    "auc": "auroc",
    "AUC": "auroc",
    "mean_squared_error": "mse",
    "mean_absolute_error": "mae",
    "root_mean_squared_error": "rmse",
    "mean_absolute_percentage_error": "mape",
    "r2_score": "r2",
    "f1_score": "f1",
    "Precision": "precision",
    "Recall": "recall",
}

#: Keras metric names with no exact fitkit name, each with what to write instead.
METRIC_ADVICE: dict[str, str] = {
    "top_k_categorical_accuracy": (
        "fitkit has no top-k name. Fix: pass torchmetrics.classification.MulticlassAccuracy("
        "num_classes, top_k=5, average='micro') (one-hot targets: argmax them first)."
    ),
    "sparse_top_k_categorical_accuracy": (
        "fitkit has no top-k name. Fix: pass torchmetrics.classification.MulticlassAccuracy("
        "num_classes, top_k=5, average='micro')."
    ),
    "sparse_categorical_crossentropy": (
        "the loss is logged as 'loss' already; as a metric, pass a callable, e.g. "
        "{'ce': lambda y_pred, y: torch.nn.functional.cross_entropy(y_pred, y)} on logits."
    ),
}


def canonical_loss(name: str) -> str:
    """fitkit's name for a loss name: the alias's target, else the name itself."""
    return LOSS_ALIASES.get(name, name)


def canonical_metric(name: str) -> str:
    """fitkit's name for a metric name: the alias's target, else the name itself."""
    return METRIC_ALIASES.get(name, name)


def loss_advice(name: str) -> str | None:
    """What to write instead of a Keras loss name fitkit refuses, or ``None``."""
    return LOSS_ADVICE.get(name)


def metric_advice(name: str) -> str | None:
    """What to write instead of a Keras metric name fitkit refuses, or ``None``."""
    return METRIC_ADVICE.get(name)
