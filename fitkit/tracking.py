"""The epoch's running loss and metrics: accumulated on the device, read once per epoch.

``update_metrics`` adds a batch with no host sync: the loss sum and the sample count (or the
sum of sample weights) stay device tensors, and the torchmetrics states update in place.
``_running_logs`` (batch logs, read only when a callback reads them) and ``_epoch_logs`` (one
transfer for all values at the end of an epoch) turn them into means.
"""

from __future__ import annotations

from typing import Any

import torch

from fitkit import data as _data
from fitkit import distributed as _distributed

__all__ = ["TrackerMixin"]


class TrackerMixin:
    """Loss and metric trackers of :class:`fitkit.Model` (a mixin; see the Model)."""

    def _reset_trackers(self) -> None:
        dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self._loss_total = torch.zeros((), dtype=dtype, device=self.device)
        self._loss_count: float = 0
        self._loss_wsum: torch.Tensor | None = None
        self.metrics.reset()
        self._stop_agreed = False

    def update_metrics(self, loss: torch.Tensor | None, y_pred: Any, y: Any, sample_weight: torch.Tensor | None = None) -> None:
        """Add a batch to the epoch's running loss and metrics (on the device, no sync).

        Call it from a custom ``train_step`` / ``test_step`` so the logs see the batch.
        """
        if loss is not None:
            if sample_weight is None:
                n = _data.batch_size_of(y if y is not None else y_pred)
                if n:  # an empty batch (a rank's share of a short last batch) adds nothing, not 0/0
                    self._loss_total.add_(loss.detach(), alpha=n)
                    self._loss_count += n
            else:
                ws = sample_weight.detach().sum()
                self._loss_total.add_(loss.detach() * ws)
                self._loss_wsum = ws if self._loss_wsum is None else self._loss_wsum + ws
        if self.metrics.entries != [] and y is not None:
            self.metrics.update(y_pred, y)

    def _running_logs(self) -> dict[str, torch.Tensor]:
        logs: dict[str, torch.Tensor] = {}
        denom = self._loss_count if self._loss_wsum is None else self._loss_wsum + self._loss_count
        if self._loss_count or self._loss_wsum is not None:
            logs["loss"] = (self._loss_total / denom).float()
        for e in self.metrics.entries or []:
            if e.metric.update_count:
                # Batch logs are rank-local: a distributed sync here could deadlock when only
                # rank 0 reads them (the progress bar).
                with e.metric.sync_context(should_sync=False, should_unsync=False):
                    logs[e.key] = e.metric.compute()
        return logs

    def _epoch_logs(self) -> dict[str, float]:
        logs = self._reduced_logs()
        if not logs:
            return {}
        # One transfer for all values (one host sync). float64 keeps the loss, summed in float64,
        # exact (5/3 stays 1.6666666666666667); MPS has no float64.
        dtype = torch.float32 if self.device.type == "mps" else torch.float64
        values = torch.stack([v.detach().to(dtype).reshape(()) for v in logs.values()]).tolist()
        return dict(zip(logs.keys(), values))

    def _reduced_logs(self) -> dict[str, torch.Tensor]:
        logs: dict[str, torch.Tensor] = {}
        total, count, wsum = self._loss_total, self._loss_count, self._loss_wsum
        if self._parallel is not None:  # sums over ranks before the division (metrics sync in compute)
            total, count, wsum = _distributed.reduce_loss_totals(total, count, wsum)
        denom = count if wsum is None else wsum + count
        if count or wsum is not None:
            logs["loss"] = total / denom
        logs.update(self.metrics.compute())
        return logs
