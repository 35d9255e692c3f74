"""The ``torchmetrics.Metric`` classes that :class:`fitkit.metrics.MetricSet` builds itself.

- :class:`CallableMean`: the exact per-sample mean of a plain callable ``fn(y_pred, y)``.
- Multi-class label metrics that skip ``ignore_index`` targets on the device. torchmetrics'
  own ``ignore_index`` drops those targets by boolean-mask indexing, whose output size the
  host must read: a host sync on every step on CUDA. Here the counts are masked sums and
  ``index_add_`` into fixed-size tensors instead, fed to torchmetrics' own states, so
  ``compute``, the distributed sync, ``reset`` and the state dict stay torchmetrics'
  (:func:`masked_multiclass`; the metric names themselves build the leaner counts of
  :mod:`fitkit.metrics.counted`), and a user's torchmetrics object is updated the same way
  (:func:`sync_free_update`).

This module imports torchmetrics at the top: :mod:`fitkit.metrics` imports this module only when a model
builds its metrics, which keeps ``import fitkit`` fast.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torchmetrics import Metric
from torchmetrics import classification as _tmc
from torchmetrics.functional.classification.stat_scores import _multiclass_stat_scores_format

__all__ = ["CallableMean", "masked_multiclass", "multiclass_stat_scores", "sync_free_update"]


class CallableMean(Metric):
    """The mean over samples of ``fn(y_pred, y)``, exact however the batches are cut.

    ``update(values, batch_size)`` takes ``values`` of shape ``(B,)`` (one per sample, summed
    and counted), ``(B, ...)`` (averaged over the trailing dimensions first, as losses are), or a
    0-dim tensor (taken as the batch's mean and weighted by ``batch_size``). The sum and the
    count are states reduced with ``"sum"``, so under torchrun the mean is over every rank's
    samples. Nothing here reads a value on the host.

    Args:
        dtype: of the running sum (float64 keeps long epochs exact; MPS has only float32).

    Raises:
        ValueError: ``values`` that are neither 0-dim nor one per sample.

    Example:
        >>> m = CallableMean()
        >>> m.update(torch.tensor([1.0, 1.0]), 2)
        >>> m.update(torch.tensor(4.0), 1)
        >>> m.compute()
        tensor(2., dtype=torch.float64)
    """

    full_state_update = False
    is_differentiable = False
    total: torch.Tensor
    count: torch.Tensor

    def __init__(self, dtype: torch.dtype = torch.float64, **kwargs: Any):
        super().__init__(**kwargs)
        self.add_state("total", torch.zeros((), dtype=dtype), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=dtype), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor, batch_size: int) -> None:
        values = values.detach()
        if values.dim() == 0:
            self.total += values.to(self.total.dtype) * batch_size
        elif values.shape[0] == batch_size:
            per_sample = values.reshape(batch_size, -1).to(self.total.dtype).mean(1)  # (B,)
            self.total += per_sample.sum()
        else:
            raise ValueError(
                f"A metric callable must return a 0-dim batch mean or one value per sample, (B,) "
                f"with B={batch_size}. Received shape {tuple(values.shape)}."
            )
        self.count += batch_size

    def compute(self) -> torch.Tensor:
        return self.total / self.count


def multiclass_stat_scores(
    preds: torch.Tensor, target: torch.Tensor, num_classes: int, average: str | None, ignore_index: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tp, fp, tn, fn)`` of integer labels, skipping targets equal to ``ignore_index``.

    The same counts as torchmetrics' multiclass stat scores (top-1, ``multidim_average=
    "global"``): one total each for ``average="micro"``, one per class otherwise; computed with
    masks and ``index_add_``, so their size never depends on the data (no host sync).

    Args:
        preds: predicted labels, any shape.
        target: labels of the same shape; entries equal to ``ignore_index`` count for nothing.
        num_classes: ``C``.
        average: torchmetrics' ``average`` of the metric the counts are for.
        ignore_index: the target value to skip (``None``: none).

    Example:
        >>> multiclass_stat_scores(torch.tensor([0, 1, 1]), torch.tensor([0, 1, -100]), 2, "micro", -100)
        (tensor(2), tensor(0), tensor(2), tensor(0))
    """
    preds, target = preds.reshape(-1), target.reshape(-1)
    if average == "micro":  # torchmetrics' micro rule: every miss is one fp and one fn
        # The fewest ops (each a kernel launch on a GPU): a label outside [0, C) as ignore_index
        # never equals a prediction, so a hit needs no mask then; tn = C*n - (2*miss + tp).
        hit = preds == target
        n: Any = target.numel()
        if ignore_index is not None:
            valid = target != ignore_index
            n = valid.sum()
            if 0 <= ignore_index < num_classes:
                hit = hit & valid
        tp = hit.sum()
        miss = n - tp
        return tp, miss, tp + (num_classes - 2) * n, miss
    valid = target != ignore_index if ignore_index is not None else torch.ones_like(target, dtype=torch.bool)  # (N,)
    hit = (preds == target) & valid
    # Ignored targets (possibly outside [0, C)) are sent to class 0 with a weight of 0.
    safe_target = torch.where(valid, target, torch.zeros_like(target))
    safe_preds = torch.where(valid, preds, torch.zeros_like(preds)).clamp(0, num_classes - 1)
    counts = torch.zeros(3, num_classes, dtype=torch.long, device=preds.device)
    counts[0].index_add_(0, safe_target, hit.long())  # tp per class
    counts[1].index_add_(0, safe_preds, valid.long())  # predicted per class
    counts[2].index_add_(0, safe_target, valid.long())  # actual per class
    tp, fp, fn = counts[0], counts[1] - counts[0], counts[2] - counts[0]
    return tp, fp, valid.sum() - (tp + fp + fn), fn


class _SyncFreeIgnore:
    """Mixin for a torchmetrics multi-class stat-scores metric: ``update`` without a host sync."""

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        metric: Any = self  # a torchmetrics MulticlassStatScores, the other base class
        tp, fp, tn, fn = multiclass_stat_scores(preds, target, metric.num_classes, metric.average, metric.ignore_index)
        metric._update_state(tp, fp, tn, fn)  # torchmetrics' own accumulation of the four counts


class MaskedMulticlassAccuracy(_SyncFreeIgnore, _tmc.MulticlassAccuracy):
    """torchmetrics' ``MulticlassAccuracy``, skipping ``ignore_index`` targets without a host sync."""


class MaskedMulticlassPrecision(_SyncFreeIgnore, _tmc.MulticlassPrecision):
    """torchmetrics' ``MulticlassPrecision``, skipping ``ignore_index`` targets without a host sync."""


class MaskedMulticlassRecall(_SyncFreeIgnore, _tmc.MulticlassRecall):
    """torchmetrics' ``MulticlassRecall``, skipping ``ignore_index`` targets without a host sync."""


class MaskedMulticlassF1Score(_SyncFreeIgnore, _tmc.MulticlassF1Score):
    """torchmetrics' ``MulticlassF1Score``, skipping ``ignore_index`` targets without a host sync."""


def masked_multiclass(name: str, num_classes: int, ignore_index: int, **kwargs: Any) -> Metric:
    """A torchmetrics multi-class label metric (``"MulticlassAccuracy"``, ...) whose ``update``
    skips ``ignore_index`` targets without a host sync; everything else is torchmetrics'.

    Example:
        >>> acc = masked_multiclass("MulticlassAccuracy", 3, -100, average="micro")
        >>> acc.update(torch.tensor([0, 0, 0, 0]), torch.tensor([0, 1, -100, 0]))
        >>> acc.compute()
        tensor(0.6667)
    """
    cls = globals()["Masked" + name]
    return cls(num_classes, ignore_index=ignore_index, validate_args=False, **kwargs)


_UPDATES: weakref.WeakKeyDictionary[Metric, Callable[..., None]] = weakref.WeakKeyDictionary()


def sync_free_update(metric: Metric) -> Callable[..., None] | None:
    """An ``update`` for a user's torchmetrics multi-class stat-scores metric with no host sync.

    torchmetrics' ``MulticlassAccuracy``, ``MulticlassPrecision``, ``MulticlassRecall``,
    ``MulticlassF1Score``, ``MulticlassFBetaScore``, ``MulticlassSpecificity`` and
    ``MulticlassStatScores`` count with ``bincount`` (an output size the host must read: a
    sync on every step on CUDA) and check their arguments on the host (``validate_args``).
    For top-1, ``multidim_average="global"`` and an ``update`` that is torchmetrics' own, this
    returns an update that adds the same four counts (:func:`multiclass_stat_scores`) into the
    metric's own states through torchmetrics' update wrapper (update count, cache), so
    ``compute``, ``reset``, the distributed sync and the state dict stay torchmetrics'. The
    argument checks are left out (fitkit checks the first batch's class range). ``None`` for
    any other metric, which is then updated as given.

    Example:
        >>> from torchmetrics.classification import MulticlassF1Score
        >>> f1 = MulticlassF1Score(3)
        >>> sync_free_update(f1)(torch.tensor([[2.0, 0, 0], [0, 1, 0], [0, 0, 1]]), torch.tensor([0, 1, 1]))
        >>> round(f1.compute().item(), 4), f1.update_count
        (0.5556, 1)
    """
    update = _UPDATES.get(metric)
    if update is not None:
        return update
    eligible = (
        isinstance(metric, _tmc.MulticlassStatScores)
        and type(metric).update is _tmc.MulticlassStatScores.update
        and metric.top_k == 1
        and metric.multidim_average == "global"
        and metric.num_classes is not None
    )
    if not eligible:
        return None
    m: Any = metric

    def counts(preds: torch.Tensor, target: torch.Tensor) -> None:
        preds, target = _multiclass_stat_scores_format(preds, target, 1)  # logits -> labels, as torchmetrics
        m._update_state(*multiclass_stat_scores(preds, target, m.num_classes, m.average, m.ignore_index))

    update = metric._wrap_update(counts)
    _UPDATES[metric] = update
    return update
