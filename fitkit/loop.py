"""The epoch loop behind ``Model.fit``: epochs, validation, schedulers, callbacks, stopping.

``fit`` checks its arguments and builds the loaders; ``_fit_loop`` runs the epochs and
``_run_epoch`` the batches of one, handing each to ``train_step``. Nothing here touches a
device value per step: epoch logs are read once, at the end of each epoch.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from fitkit import data as _data
from fitkit import distributed as _distributed
from fitkit.callbacks.base import BatchLogs, CallbackList, History
from fitkit.callbacks.progress import ProgressBar
from fitkit.evaluation import _check_int, _modes
from fitkit.optim import current_lr

__all__ = ["FitLoopMixin", "validation_epochs"]


def validation_epochs(validation_freq: Any):
    if isinstance(validation_freq, (list, tuple, set)):
        epochs = set()
        for v in validation_freq:
            _check_int("validation_freq", v, 1)
            epochs.add(int(v))
        return lambda epoch: epoch + 1 in epochs
    _check_int("validation_freq", validation_freq, 1)
    return lambda epoch: (epoch + 1) % validation_freq == 0


class FitLoopMixin:
    """The epoch loop of :class:`fitkit.Model` (a mixin; see ``Model.fit``)."""

    def _fit_loop(self, train, validation, cbs: CallbackList, initial_epoch: int, epochs: int) -> None:
        val, val_epochs, val_steps = validation
        self._callbacks, self.stop_training = cbs, False
        self._initial_epoch = initial_epoch  # a callback (BackupAndRestore) may move it
        cbs.params["do_validation"] = val is not None  # a `val_` monitor is checked before step 1
        cbs.params["train_data"] = train
        logs: dict[str, float] = {}
        try:
            with _modes(self.module, training=None, grad=True):
                self._warn_if_all_eval()
                self.optimizer.zero_grad(set_to_none=True)  # gradients from user code never leak in
                cbs.on_train_begin({})
                self._apply_resume_at_train_begin()
                for epoch in range(self._initial_epoch, epochs):
                    logs = self._run_epoch(epoch, train, cbs)
                    if val is not None and val_epochs(epoch):
                        val_logs = self._run_eval(val, cbs, val_steps)
                        logs.update({f"val_{k}": v for k, v in val_logs.items()})
                    self._step_scheduler_epoch(logs)
                    self._epochs_done = epoch + 1
                    cbs.on_epoch_end(epoch, logs)
                    if self._stop_now(epoch_end=True):
                        break
                cbs.on_train_end(logs)
        finally:
            self._callbacks = CallbackList([], self, {})
            self._in_epoch = False
            self._resume = None  # a loaded resume point serves one fit only

    def _run_epoch(self, epoch: int, loader: _data.DeviceLoader, cbs: CallbackList) -> dict[str, float]:
        self._reset_trackers()
        loader.epoch = epoch
        self._epoch = epoch
        self._resume_epoch_begin(epoch)
        cbs.on_epoch_begin(epoch, {})
        self._lr_used = current_lr(self.optimizer)
        self._epoch_rng = torch.get_rng_state()  # replays this epoch's data order on resume
        self._in_epoch = True
        want_begin, want_end = cbs.wants("on_train_batch_begin"), cbs.wants("on_train_batch_end")
        steps = 0
        for step, batch in self._micro_batches(loader):
            if want_begin:
                cbs.on_train_batch_begin(step, {})
            self.train_step(batch)
            steps = step + 1
            if want_end:
                cbs.on_train_batch_end(step, BatchLogs(self._running_logs))
            if self._stop_now():
                break
        steps = max(steps, self._resumed_steps)  # a resume may have skipped the whole epoch
        if steps == 0 or (loader.steps is not None and steps < loader.steps and not self.stop_training):
            warnings.warn(
                "The training data ran out before the epoch ended; training stops here. Fix: "
                "pass data that can be iterated again, or lower `steps_per_epoch`.",
                stacklevel=3,
            )
            self.stop_training = True
        if self._parallel is not None:
            self._parallel.sync_buffers(self.module)  # rank 0's BatchNorm statistics on every rank
        self._in_epoch = False
        logs = self._epoch_logs()
        logs["learning_rate"] = float(self._lr_used)
        return logs

    def _make_callbacks(self, callbacks, verbose, epochs, steps, history: bool = True) -> CallbackList:
        verbose = verbose if _distributed.is_rank_zero() else 0  # torchrun: rank 0 prints
        cbs = list(callbacks)
        if history:
            self.history = History()
            cbs.append(self.history)
        if verbose and not any(isinstance(c, ProgressBar) for c in cbs):
            cbs.append(ProgressBar(verbose))
        params = {"verbose": verbose, "epochs": epochs, "steps": steps}
        if history:
            self.history.params = params
        return CallbackList(cbs, self, params)

    def _warn_if_all_eval(self) -> None:
        if not any(m.training for m in self.module.modules()):
            warnings.warn(
                "Every submodule is in eval mode, so fit trains with dropout off and BatchNorm "
                "statistics frozen. If that is not intended, call `model.module.train()` first.",
                stacklevel=4,
            )
