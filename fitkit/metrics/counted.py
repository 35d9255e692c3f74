"""The built-in multi-class label metrics, counted on the device with a hand loop's ops.

- ``"accuracy"``: torchmetrics' ``MulticlassAccuracy(average="micro")`` keeps four stat scores
  (tp, fp, tn, fn) and reads two of them: its value is ``tp / (tp + fn)``, the correct labels
  over the targets that count. :class:`CountedAccuracy` keeps those two counts alone, so a step
  adds to two states (each state a kernel launch on a GPU) and the count of targets can be the
  one the cross-entropy kernel made for the loss of the same batch.
- ``"precision"``, ``"recall"``, ``"f1"``: torchmetrics' ``MulticlassPrecision`` /
  ``MulticlassRecall`` / ``MulticlassF1Score`` count a confusion matrix with ``bincount`` (its
  size read on the host: a sync per step on CUDA) and drop ``ignore_index`` targets by boolean
  indexing (another). :class:`CountedStatScores` counts per class with two ``index_add_`` and
  reduces with torchmetrics' own functions.

Their values equal torchmetrics' to the bit (their tests compare the two), and a running state
saved in torchmetrics' layout by an earlier version of fitkit loads (``from_saved``).

This module imports torchmetrics at the top: it is imported when a model builds its metrics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torchmetrics import Metric
from torchmetrics.functional.classification.f_beta import _fbeta_reduce
from torchmetrics.functional.classification.precision_recall import _precision_recall_reduce
from torchmetrics.utilities.compute import _safe_divide

__all__ = ["CountedAccuracy", "CountedStatScores"]


class _Counted(Metric):
    """A metric whose update only adds integer counts into its states, in place."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    def _wrap_update(self, update: Callable[..., None]) -> Callable[..., None]:
        """torchmetrics' update wrapper (the next ``compute`` computes again, one more update
        counted), less its grad-mode context and its attribute sets through
        ``nn.Module.__setattr__``: integer counts record no graph, and on a fast GPU each Python
        call is step time."""

        @functools.wraps(update)
        def counted_update(*args: Any, **kwargs: Any) -> None:
            attrs = self.__dict__
            attrs["_computed"] = None
            attrs["_update_count"] += 1
            update(*args, **kwargs)

        return counted_update


class CountedAccuracy(_Counted):
    """Multi-class top-1 accuracy over targets that are not ``ignore_index``, without a host sync.

    The value of torchmetrics' ``MulticlassAccuracy(num_classes, average="micro",
    ignore_index=ignore_index)``: correct labels over the targets that count (0 before any).
    The states ``correct`` (integer) and ``total`` (``count_dtype``) are summed over ranks.

    Args:
        num_classes: ``C``.
        ignore_index: a target value that counts for nothing, or ``None``.
        count_dtype: of ``total`` (float64 adds the loss's float count exactly; MPS has only float32).

    Example:
        >>> acc = CountedAccuracy(3, ignore_index=-100)
        >>> acc.update(torch.tensor([0, 2, 1, 0]), torch.tensor([0, 1, 1, -100]))
        >>> acc.compute()
        tensor(0.6667)
    """

    correct: torch.Tensor
    total: torch.Tensor

    def __init__(
        self, num_classes: int, ignore_index: int | None = None, count_dtype: torch.dtype = torch.float64, **kwargs: Any
    ):
        super().__init__(**kwargs)
        self.num_classes, self.ignore_index = int(num_classes), ignore_index
        self.add_state("correct", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros((), dtype=count_dtype), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor, count: torch.Tensor | int | None = None) -> None:
        """Add a batch of predicted labels and target labels (equal shapes, any).

        ``count``: the number of ``target`` entries that are not ``ignore_index`` when the caller
        has it already (the cross-entropy kernel's count of the same targets); ``None``: counted here.
        """
        hit = preds == target  # a label in [0, C) never equals an ignore_index outside it: no mask then
        ignore = self.ignore_index
        if ignore is not None and (count is None or 0 <= ignore < self.num_classes):
            valid = target != ignore
            if 0 <= ignore < self.num_classes:
                hit = hit & valid
            if count is None:
                count = valid.sum()
        self.correct.add_(hit.sum())  # in place: no attribute set (an nn.Module's setattr is slow)
        self.total.add_(target.numel() if count is None else count)

    def compute(self) -> torch.Tensor:
        # torchmetrics' own division of its float32 counts: the same value to the last bit
        return _safe_divide(self.correct.float(), self.total.float())

    def from_saved(self, state: dict[str, Any]) -> dict[str, Any]:
        """A saved running state in this metric's layout: torchmetrics' micro stat scores
        (``tp``, ``fp``, ``tn``, ``fn``, saved before fitkit counted its accuracy itself) become
        ``correct = tp`` and ``total = tp + fn``; anything else is returned as given.

        Example:
            >>> old = {"tp": torch.tensor(5), "fp": torch.tensor(2), "tn": torch.tensor(12), "fn": torch.tensor(2),
            ...        "_update_count": 3}
            >>> CountedAccuracy(3).from_saved(old)
            {'correct': tensor(5), 'total': tensor(7., dtype=torch.float64), '_update_count': 3}
        """
        if not isinstance(state, dict) or set(state) - {"_update_count"} != {"tp", "fp", "tn", "fn"}:
            return state
        tp, fn = state["tp"], state["fn"]
        if not isinstance(tp, torch.Tensor) or not isinstance(fn, torch.Tensor) or tp.dim() or fn.dim():
            return state  # per-class counts: not a micro accuracy's (the load then names the mismatch)
        out: dict[str, Any] = {"correct": tp.long(), "total": (tp + fn).to(self.total.dtype)}
        if "_update_count" in state:
            out["_update_count"] = state["_update_count"]
        return out


_STATS = ("precision", "recall", "f1")
_AVERAGES = ("micro", "macro", "weighted", "none", None)


class CountedStatScores(_Counted):
    """Multi-class top-1 precision, recall or F1 from per-class counts, without a host sync.

    The value of torchmetrics' ``MulticlassPrecision`` / ``MulticlassRecall`` /
    ``MulticlassF1Score`` ``(num_classes, average=average, ignore_index=ignore_index,
    zero_division=zero_division)``, computed by torchmetrics' own reductions
    (``_precision_recall_reduce``, ``_fbeta_reduce``) from the same tp, fp, tn and fn per class.
    The counts differ in how they are made: two ``index_add_`` into fixed-size states per step,
    where torchmetrics' ``bincount`` reads the size of its output on the host and its
    ``ignore_index`` drops targets by boolean indexing (each a sync per step on CUDA). A target
    equal to ``ignore_index`` goes, with its prediction, to an extra class ``C`` that ``compute``
    leaves out, as torchmetrics leaves the row out.

    States (long, summed over ranks):

    - ``by_target`` ``(2 * (C + 1),)``: for each target class ``c``, the rows it missed at
      ``2c`` and the rows it hit at ``2c + 1`` (fn and tp); the extra class last.
    - ``by_prediction`` ``(C + 1,)``: the rows predicted as each class (tp + fp); the extra last.

    Args:
        num_classes: ``C``.
        stat: ``"precision"``, ``"recall"`` or ``"f1"``.
        ignore_index: a target value that counts for nothing, or ``None``.
        average: torchmetrics' ``average``: ``"macro"`` (its default: the mean over the classes
            that occur in targets or predictions), ``"micro"``, ``"weighted"``, or ``"none"`` /
            ``None`` (one value per class, ``(C,)``).
        zero_division: the value of a class whose denominator is 0.

    Raises:
        ValueError: an unknown ``stat`` or ``average``, or fewer than 2 classes.

    Example:
        >>> f1 = CountedStatScores(3, "f1", ignore_index=-100)
        >>> f1.update(torch.tensor([0, 2, 1, 0]), torch.tensor([0, 1, 1, -100]))
        >>> f1.compute()  # class 0: 1, class 1: 2/3, class 2: 0 (predicted, never right)
        tensor(0.5556)
    """

    by_target: torch.Tensor
    by_prediction: torch.Tensor
    _one: torch.Tensor
    average: Any  # torchmetrics' Literal of averages

    def __init__(
        self,
        num_classes: int,
        stat: str = "f1",
        ignore_index: int | None = None,
        average: str | None = "macro",
        zero_division: float = 0.0,
        **kwargs: Any,
    ):
        if stat not in _STATS:
            raise ValueError(f"Expected `stat` to be one of {', '.join(_STATS)}. Received: stat={stat!r}.")
        if average not in _AVERAGES:
            raise ValueError(
                f"Expected `average` to be one of {', '.join(map(repr, _AVERAGES))}. Received: average={average!r}."
            )
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(
                f"Expected `num_classes` to be an int of at least 2. Received: num_classes={num_classes!r}."
            )
        super().__init__(**kwargs)
        self.num_classes, self.stat, self.ignore_index = num_classes, stat, ignore_index
        self.average, self.zero_division = average, zero_division
        self.add_state("by_target", torch.zeros(2 * (num_classes + 1), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("by_prediction", torch.zeros(num_classes + 1, dtype=torch.long), dist_reduce_fx="sum")
        # the 1 each row adds, broadcast to the batch (a view, no kernel); a buffer moves with the metric
        self.register_buffer("_one", torch.ones((), dtype=torch.long), persistent=False)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Add a batch of predicted labels and target labels (equal shapes, any; labels in ``[0, C)``)."""
        if preds.dim() != 1:
            preds, target = preds.reshape(-1), target.reshape(-1)
        if self.ignore_index is not None:  # the row, prediction included, to the extra class C
            skip = target == self.ignore_index
            target = target.masked_fill(skip, self.num_classes)
            preds = preds.masked_fill(skip, self.num_classes)
        one = self._one.expand(target.shape[0])
        # in place (an nn.Module's setattr is slow); index_add_ reads nothing on the host, where
        # bincount reads the size of its output
        slots = torch.add(preds == target, target, alpha=2)  # 2 * target + hit
        try:
            self.by_target.index_add_(0, slots, one)
        except IndexError as e:  # torch's CPU kernel: a target outside [0, C); on CUDA a device assert
            c = self.num_classes
            raise ValueError(
                f"Metric '{self.stat}' got a target label outside [0, {c - 1}] for {c} classes ({e}). Fix: remap "
                "the labels to 0..C-1 (mark the ones to leave out with the loss's ignore_index), or give the "
                "module one output per class."
            ) from None
        self.by_prediction.index_add_(0, preds, one)

    def stat_scores(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tp, fp, tn, fn)``, each ``(C,)`` long: torchmetrics' multi-class stat scores of the
        rows counted (``tn``: the rows that neither have nor predict the class)."""
        c = self.num_classes
        per_target = self.by_target.view(c + 1, 2)[:c]  # (C, 2): missed, hit
        fn, tp = per_target[:, 0], per_target[:, 1]
        fp = self.by_prediction[:c] - tp
        return tp, fp, per_target.sum() - (tp + fp + fn), fn

    def compute(self) -> torch.Tensor:
        tp, fp, tn, fn = self.stat_scores()
        if self.stat == "f1":
            return _fbeta_reduce(tp, fp, tn, fn, 1.0, average=self.average, zero_division=self.zero_division)
        stat: Any = self.stat  # "precision" or "recall": torchmetrics' Literal
        return _precision_recall_reduce(stat, tp, fp, tn, fn, average=self.average, zero_division=self.zero_division)

    def from_saved(self, state: dict[str, Any]) -> dict[str, Any]:
        """A saved running state in this metric's layout: torchmetrics' per-class stat scores
        (``tp``, ``fp``, ``tn``, ``fn``, each ``(C,)``, saved before fitkit counted these metrics
        itself) become ``by_target`` (fn and tp per class) and ``by_prediction`` (tp + fp); the
        extra class starts at 0 (it counts rows that no value reads). Anything else is returned
        as given.

        Example:
            >>> old = {"tp": torch.tensor([2, 0]), "fp": torch.tensor([1, 0]), "tn": torch.tensor([0, 2]),
            ...        "fn": torch.tensor([0, 1]), "_update_count": 1}
            >>> CountedStatScores(2, "recall").from_saved(old)
            {'by_target': tensor([0, 2, 1, 0, 0, 0]), 'by_prediction': tensor([3, 0, 0]), '_update_count': 1}
        """
        if not isinstance(state, dict) or set(state) - {"_update_count"} != {"tp", "fp", "tn", "fn"}:
            return state
        tp, fp, fn = state["tp"], state["fp"], state["fn"]
        shape = (self.num_classes,)
        if not all(isinstance(t, torch.Tensor) and tuple(t.shape) == shape for t in (tp, fp, fn)):
            return state  # micro or another class count: not these counts (the load then names the mismatch)
        extra = torch.zeros(1, dtype=torch.long, device=tp.device)
        by_target = torch.stack([torch.cat([fn.long(), extra]), torch.cat([tp.long(), extra])], 1)  # (C + 1, 2)
        by_prediction = torch.cat([(tp + fp).long(), extra])
        out: dict[str, Any] = {"by_target": by_target.reshape(-1), "by_prediction": by_prediction}
        if "_update_count" in state:
            out["_update_count"] = state["_update_count"]
        return out
