"""The built-in multi-class ``"accuracy"``: a count of correct labels over a count of targets.

torchmetrics' ``MulticlassAccuracy(average="micro")`` keeps four stat scores (tp, fp, tn, fn)
and reads two of them: its value is ``tp / (tp + fn)``, the correct labels over the targets
that count. :class:`CountedAccuracy` keeps those two counts alone, so a step adds to two
states (each state a kernel launch on a GPU) and the count of targets can be the one the
cross-entropy kernel made for the loss of the same batch. Its value equals torchmetrics'
(its tests compare the two), and a running state saved in torchmetrics' layout by an earlier
version of fitkit loads (:meth:`CountedAccuracy.from_saved`).

This module imports torchmetrics at the top: it is imported when a model builds its metrics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torchmetrics import Metric
from torchmetrics.utilities.compute import _safe_divide

__all__ = ["CountedAccuracy"]


class CountedAccuracy(Metric):
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

    full_state_update = False
    is_differentiable = False
    higher_is_better = True
    correct: torch.Tensor
    total: torch.Tensor

    def __init__(self, num_classes: int, ignore_index: int | None = None,
                 count_dtype: torch.dtype = torch.float64, **kwargs: Any):  # fmt: skip
        super().__init__(**kwargs)
        self.num_classes, self.ignore_index = int(num_classes), ignore_index
        self.add_state("correct", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros((), dtype=count_dtype), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor, count: torch.Tensor | None = None) -> None:
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
