"""Metrics: names resolved to torchmetrics, callables, and what the loss knows.

``"accuracy"`` is the fraction of correct predictions (micro average, as in Keras; torchmetrics'
multiclass default is macro). The task (binary, multiclass, multilabel, regression) and the
number of classes are inferred from the first batch's shapes and dtypes. Metrics are
unweighted per-sample means, as Keras' ``metrics=`` are (sample weights apply to the loss).

What the loss knows (:meth:`MetricSet.configure`, called by ``Model.compile``):

- **ignore_index.** Targets equal to the loss's ``ignore_index`` (-100 for ``"cross_entropy"``
  and ``"nll"``, or the module's own, as in ``nn.CrossEntropyLoss(ignore_index=0)``) count for
  nothing in every classification metric given by name, in the ``(B, C)``, ``(B, C, d1, ...)``
  and language-model ``(B, T, V)`` layouts. A torchmetrics object is used as given (set its own
  ``ignore_index``). With ``loss=None`` (the module's own loss, as Hugging Face models compute
  it), multiclass targets of -100, Hugging Face's ignore index, count for nothing.
- **Logits or probabilities.** Decided from the loss, never from the values: logits for
  ``"cross_entropy"``, ``"bce_with_logits"`` and their modules, probabilities for ``"bce"`` /
  ``nn.BCELoss``, log-probabilities for ``"nll"`` / ``nn.NLLLoss``. Binary and multilabel
  predictions are thresholded at logit 0 / probability 0.5 (``y_pred > threshold``, as Keras and
  torchmetrics do); ``"auroc"`` and ``"average_precision"`` get probabilities (sigmoid or softmax
  of logits, ``exp`` of log-probabilities). Multiclass labels are the argmax, whatever the kind.
  Where the loss cannot tell (a plain callable, ``loss=None``), a metric that must threshold or
  needs probabilities takes :class:`MetricSpec` ``(name, output=...)``, or else raises a
  ``ValueError`` at the first batch, before any weight changes.

Plain callables ``fn(y_pred, y_true) -> Tensor`` (PyTorch's order, as losses) are metrics too,
logged under ``fn.__name__`` (or their dict key) and averaged exactly per sample over the
epoch: a result of shape ``(B,)`` is one value per sample; a 0-dim result is taken as that
batch's mean and weighted by the batch size.

Classification metrics that only need labels are fed integer labels (argmax or a threshold
computed here), which keeps torchmetrics from checking the range of the predictions, a host
sync on every step; ``ignore_index`` is applied to them without a sync too
(:mod:`fitkit.metrics.states`). Multi-class ``"accuracy"`` keeps torchmetrics' micro value as two
counts, correct labels and targets, the second the one the cross-entropy kernel made for the
loss (:mod:`fitkit.metrics.counted`). ``"auroc"`` and ``"average_precision"`` keep every prediction
and check their range in torchmetrics: they cost a host sync per step.
"""

from fitkit.metrics.metric_set import MetricSet
from fitkit.metrics.names import METRIC_NAMES, MetricSpec, infer_task

__all__ = ["MetricSet", "MetricSpec", "infer_task", "METRIC_NAMES"]
