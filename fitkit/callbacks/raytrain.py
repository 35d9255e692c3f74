"""``RayReport``: fitkit inside Ray Train's ``TorchTrainer`` (the ``ray`` extra).

Ray Train starts the worker processes and their process group (gloo on CPU, nccl on GPUs);
``fitkit.Model`` finds the group running and trains data-parallel on it as under torchrun (the
same shards, the same exact reductions). What Ray adds is the run around the workers: restarts
after a worker failure (``RunConfig(failure_config=FailureConfig(max_failures=...))``), the
storage of checkpoints, and the metrics of each report. This callback connects the two.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

import torch

from fitkit.callbacks.base import Callback
from fitkit.callbacks.mixins import SavesEveryNBatches
from fitkit.checks import check_bool, check_every
from fitkit.checks.declared import Option, declare, declared, every_option
from fitkit.distributed.group import is_rank_zero

__all__ = ["RayReport"]


def _ray_train() -> Any:
    import ray.train

    return ray.train


_RAY_REPORT_OPTIONS = declare(
    "RayReport",
    every_option("save_freq"),
    Option("checkpoint", "bool"),
)


class RayReport(SavesEveryNBatches, Callback):
    """Report to Ray Train: the logs as metrics and fitkit's full checkpoint as Ray's checkpoint,
    and resume from Ray's checkpoint when ``fit`` starts.

    At each epoch end (or every ``save_freq`` batches, at the end of a gradient accumulation
    window) every worker calls ``ray.train.report(metrics, checkpoint=...)``: ``metrics`` are
    the epoch's (batch's) logs with ``epoch`` and ``global_step``; the checkpoint is a folder
    holding :attr:`checkpoint_name`, written by :meth:`fitkit.Model.save_checkpoint` after every
    other callback of the event (the model, optimizer, scheduler, RNG states, the position in
    the epoch, History and callback states), one file that rank 0 writes and reports. Under
    ``strategy="fsdp"`` the state is gathered to rank 0's CPU memory for it (each worker writes
    into a folder of its own, so shards would be split among the workers): a model whose
    training state does not fit one host's memory needs :class:`~fitkit.callbacks.BackupAndRestore`
    on storage every worker shares instead.

    When ``fit`` starts and ``ray.train.get_checkpoint()`` is not ``None`` (Ray restarted the
    workers after a failure, or the trainer got ``resume_from_checkpoint``), every rank loads
    it, and training continues where that checkpoint was taken, as a
    :class:`~fitkit.callbacks.BackupAndRestore` resume does (inside an epoch included). Only
    the first ``fit`` of the callback resumes. Use one or the other: both would load a state.

    ``Model(timeout=...)`` cannot apply (Ray starts the process group): set
    ``TorchTrainer(torch_config=ray.train.torch.TorchConfig(timeout_s=...))`` instead; fitkit
    refuses ``timeout=`` when the group is already running.

    Args:
        save_freq: ``"epoch"``, or an int: report every that many batches, and the run's last
            step at the end of ``fit`` when ``save_freq`` does not divide it (Ray's result is
            then the run's end, as Lightning's ``save_last``).
        checkpoint: ``False``: report the metrics only (no checkpoint written or loaded).

    Raises:
        ImportError: Ray is not installed (``pip install ".[ray]"`` from a checkout).
        TypeError, ValueError: a bad ``save_freq`` or ``checkpoint``.
        RuntimeError: (at ``on_train_begin``) ``fit`` runs outside a Ray Train worker.
        FileNotFoundError: (at ``on_train_begin``) Ray's checkpoint holds no fitkit checkpoint.

    Example:
        In the function each Ray worker runs (a complete script: the scaling-out tutorial)::

            def train_loop():
                model = fitkit.Model(net)  # Ray's process group: DDP over the workers
                model.compile(optimizer="adamw", loss="cross_entropy")
                model.fit(x, y, epochs=10, callbacks=[fitkit.callbacks.RayReport()])

            TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=2),
                         run_config=RunConfig(failure_config=FailureConfig(max_failures=2))).fit()

        >>> RayReport.checkpoint_name  # the file inside each reported folder
        'checkpoint.pt'
    """

    #: The name of fitkit's checkpoint inside the folder reported to Ray.
    checkpoint_name = "checkpoint.pt"

    skip_in_fast_dev_run = True  # it reports to Ray: fit(fast_dev_run=...) leaves it out

    @declared(_RAY_REPORT_OPTIONS)
    def __init__(self, save_freq: str | int = "epoch", checkpoint: bool = True):
        super().__init__()
        if importlib.util.find_spec("ray") is None:
            raise ImportError(
                "RayReport needs Ray Train. Install the `ray` extra: "
                "`pip install '.[ray]'` from a checkout (`pip install 'torch-fitkit[ray]'` once released)."
            )
        check_every("save_freq", save_freq, "epoch", "batches")
        check_bool("checkpoint", checkpoint)
        self.save_freq, self.checkpoint = save_freq, bool(checkpoint)
        self._batches_seen, self._due, self._resumed = 0, False, False
        self._reported = self._epoch_end = -1  # the global steps of the last report and the last epoch end

    def on_train_begin(self, logs=None):
        train = _ray_train()
        try:
            context = train.get_context()
            context.get_world_rank()
        except Exception as e:  # Ray raises its own error types outside a worker
            raise RuntimeError(
                "RayReport reports to Ray Train, but this fit does not run in a Ray Train worker "
                f"({type(e).__name__}: {e}). Fix: run the training function with "
                "ray.train.torch.TorchTrainer(train_loop, ...).fit(), or drop RayReport."
            ) from None
        self._batches_seen, self._due = 0, False
        self._reported = self._epoch_end = -1
        if self._resumed or not self.checkpoint:
            return
        self._resumed = True
        found = train.get_checkpoint()
        if found is None:
            return
        with found.as_directory() as folder:
            path = Path(folder) / self.checkpoint_name
            if not path.exists():
                raise FileNotFoundError(
                    f"Ray's checkpoint {folder!r} holds no {self.checkpoint_name!r}, so fitkit cannot resume "
                    "from it. Fix: resume from a checkpoint that RayReport reported, or start without one."
                )
            self.model.load_checkpoint(path)  # fit applies the position, RNG states and History

    def _save_due(self, logs: Any) -> None:  # every save_freq batches (SavesEveryNBatches)
        self._report(logs)

    def _save_on_epoch_end(self, epoch, logs=None):
        self._epoch_end = self.model.global_step
        if self.save_freq == "epoch":
            self._report(logs)

    def on_train_end(self, logs=None):
        # Every save_freq batches: a run whose last step no report holds (save_freq does not
        # divide it) reports it with the last epoch's logs, which are that step's. The same on
        # every worker: it depends on global_step alone. A fit stopped inside an epoch (a
        # signal) has no logs of its last step: its last report stays the last.
        step = self.model.global_step
        if self.save_freq != "epoch" and step != self._reported and step == self._epoch_end:
            self._report(logs)

    def _report(self, logs: Any) -> None:
        train = _ray_train()
        model = self.model
        metrics: dict[str, Any] = {}
        for key, value in dict(logs or {}).items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()  # a batch's logs: one host read per report
            if isinstance(value, (int, float)):
                metrics[key] = value
        metrics.update(epoch=model.epoch, global_step=model.global_step)
        self._reported = model.global_step
        if not self.checkpoint:
            train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="fitkit-ray-") as folder:
            # One file, written by rank 0 (under FSDP the state is gathered there: a collective).
            # Each worker's temp folder is its own, so a folder of shards would be split among them.
            model.save_checkpoint(Path(folder) / self.checkpoint_name, sharded=False)
            # Ray copies the folder to its storage before report returns: the temp folder may go.
            mine = train.Checkpoint.from_directory(folder) if is_rank_zero() else None
            train.report(metrics, checkpoint=mine)
