"""The loops: one object per ``fit``, ``evaluate`` and ``predict`` call (the last two, which
run in eval mode, are in :mod:`fitkit.eval_loop`).

A loop owns everything that lives for one call: the epoch and the position in the data, the
resume point, the phase's running totals, whether this epoch validated, and the callbacks of
the call. The model keeps none of it; it only points at the running loops, so that
``train_step`` overrides and callbacks reach the right totals through the public API
(``model.update_metrics``, ``model.global_step``, ``model.epoch``).

``fit`` -> :meth:`FitLoop.run` -> :meth:`FitLoop.run_epoch` -> ``model.train_step(batch)``
-> :meth:`EvalLoop.run` (validation) -> ``CallbackList.on_epoch_end`` -> ``History``.
"""

from __future__ import annotations

import signal
import warnings
from typing import Any

import torch

from fitkit import distributed as _distributed
from fitkit import nest
from fitkit.callbacks.base import BatchLogs, CallbackList
from fitkit.checkpoint import ResumePoint, set_rng_state
from fitkit.checks import FitkitWarning, check_int
from fitkit.eval_loop import EvalLoop, PredictLoop, _name
from fitkit.modes import modes, warn_if_all_eval
from fitkit.preflight import first_batch_check, has_training_batchnorm
from fitkit.signals import deferred
from fitkit.tracking import RunningTotals

__all__ = ["FitLoop", "EvalLoop", "PredictLoop", "validation_epochs"]

def validation_epochs(validation_freq: Any):
    """``epoch -> bool``: whether validation is scheduled after that (0-based) epoch.

    Example:
        >>> every2 = validation_epochs(2)
        >>> [e for e in range(6) if every2(e)], [e for e in range(6) if validation_epochs([1, 5])(e)]
        ([1, 3, 5], [0, 4])
    """
    if isinstance(validation_freq, (list, tuple, set)):
        epochs = set()
        for v in validation_freq:
            check_int("validation_freq", v, 1)
            epochs.add(int(v))
        return lambda epoch: epoch + 1 in epochs
    check_int("validation_freq", validation_freq, 1)
    return lambda epoch: (epoch + 1) % validation_freq == 0


def _lr_logs(groups: list[Any], per_group: bool) -> dict[str, float]:
    lrs = [float(g["lr"] if isinstance(g, dict) else g) for g in groups]
    logs = {"learning_rate": lrs[0]}
    if per_group:
        logs.update({f"learning_rate/pg{i}": lr for i, lr in enumerate(lrs) if i})
    return logs


def groups_differ(optimizer: torch.optim.Optimizer, scheduler: Any) -> bool:
    """Whether the parameter groups' learning rates differ, now or by their schedule.

    Then every group's rate is logged (``learning_rate/pg1``, ...), decided once per fit so the
    keys stay the same every epoch: groups that differ now, that start from different rates
    (``initial_lr``, a warmup from 0 included), or that follow different ``lr_lambdas``.

    Example:
        >>> p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        >>> opt = torch.optim.SGD([{"params": [p]}, {"params": [q], "lr": 0.01}], lr=0.1)
        >>> groups_differ(opt, None), groups_differ(torch.optim.SGD([p, q], lr=0.1), None)
        (True, False)
    """
    groups = optimizer.param_groups
    if len(groups) < 2:
        return False
    now = {float(g["lr"]) for g in groups}
    start = {float(g.get("initial_lr", g["lr"])) for g in groups}
    lambdas = getattr(scheduler, "lr_lambdas", None) or []
    return len(now) > 1 or len(start) > 1 or len({id(f) for f in lambdas}) > 1


class FitLoop:
    """One ``fit`` call: epochs, batches, validation, the resume point and the stop decision.

    Args:
        model: the :class:`fitkit.Model` (compiled).
        train: the training :class:`~fitkit.data.DeviceLoader`.
        validation: ``(loader or None, epoch -> scheduled?, validation_steps)``.
        callbacks: the call's :class:`CallbackList`.
        initial_epoch: first epoch to run (0-based); a restored backup may move it.
        epochs: index of the last epoch (Keras).
    """

    def __init__(self, model: Any, train: Any, validation: tuple[Any, Any, Any], callbacks: CallbackList,
                 initial_epoch: int, epochs: int):  # fmt: skip
        self.model, self.train, self.callbacks = model, train, callbacks
        self.val, self.val_scheduled, self.val_steps = validation
        self.history: Any = next(cb for cb in callbacks.callbacks if type(cb).__name__ == "History")
        self.start_epoch, self.epochs = initial_epoch, epochs
        self.epoch = initial_epoch  # the running (or next) epoch
        self.epochs_done = initial_epoch
        self.in_epoch = False
        self.batches_done = 0  # batches of the running epoch done (a resume counts the skipped ones)
        self.resume: ResumePoint | None = None
        self.totals: RunningTotals | None = None
        self.epoch_rng: torch.Tensor | None = None
        self.validated = False  # this epoch: validation was scheduled and ran over > 0 batches
        self.per_group_lr = groups_differ(model.optimizer, model.scheduler)
        self.interrupt: Any = None
        self.running = False
        # on_backward_end, run by the stepper before each optimizer step (None: nobody listens).
        self.before_step = self._on_backward_end if callbacks.wants("on_backward_end") else None
        self.interrupted = False  # a signal stopped training at a step boundary; the backup is written
        self._agreement: Any = None  # when the ranks agree on a signal (torchrun), made at the first step
        self.batch_index = 0  # the running batch (0-based; on_backward_end's argument)
        self._warned_short = False
        self._warned_single = False
        self._skip_single = has_training_batchnorm(model.module)
        # In-memory data had its first batch checked before fit; other sources get the same check
        # on their first training batch, before its step (as preflight skips a custom train_step).
        from fitkit.data import TensorBatches

        self._check_first = not isinstance(getattr(train, "batches", None), TensorBatches) and (
            model.default_train_step or not model.default_test_step
        )

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> None:
        model, cbs = self.model, self.callbacks
        model.stop_training = False
        stepper = model._stepper
        stepper.validates = self.val is not None
        cbs.params["train_data"] = self.train  # the training batches (SWA's BatchNorm update)
        logs: dict[str, float] = {}
        pending = model._resume
        finished = False
        self.running = True
        try:
            with modes(model.module, training=None, grad=True), deferred() as self.interrupt:
                warn_if_all_eval(model.module)
                model.optimizer.zero_grad(set_to_none=True)  # gradients from user code never leak in
                cbs.on_train_begin({})
                self._take_resume(pending)
                for epoch in range(self.start_epoch, self.epochs):
                    epoch_logs = self.run_epoch(epoch)
                    if epoch_logs is None:  # no batch, or a signal: no partial epoch for callbacks
                        break
                    logs = epoch_logs
                    self._validate(epoch, logs)
                    stepper.step_epoch(epoch, logs, self.validated)
                    self.epochs_done = epoch + 1
                    cbs.on_epoch_end(epoch, logs)
                    if self._stop_now(epoch_end=True) or self.interrupt.signum is not None:
                        break
                if self.interrupt.signum is not None and not self.interrupted:
                    self.interrupted = True
                    cbs.save_on_interrupt()  # at an epoch boundary
                cbs.on_train_end(logs)
                finished = True
            if self.interrupt.signum is not None:
                self.interrupt.raise_now()
        finally:
            self.running = False
            _distributed.dcp.wait()  # an async checkpoint still being written ends with fit
            cbs.params.pop("train_data", None)  # History keeps params: not the data
            cbs.close(finished)
            model._resume = None  # a loaded resume point serves one fit only

    def _on_backward_end(self) -> None:
        self.callbacks.on_backward_end(self.batch_index)

    def _validate(self, epoch: int, logs: dict[str, float]) -> None:
        self.validated = False
        if self.val is None or not self.val_scheduled(epoch):
            return
        loop = EvalLoop(self.model, self.val, self.callbacks, self.val_steps, what="validation_data")
        val_logs = loop.run()
        self.validated = True
        logs.update({f"val_{k}": v for k, v in val_logs.items()})

    def run_epoch(self, epoch: int) -> dict[str, float] | None:
        """One epoch of training batches; ``None`` if the source yielded no batch."""
        model, cbs, loader, stepper = self.model, self.callbacks, self.train, self.model._stepper
        self.totals = model._new_totals()
        loader.epoch = self.epoch = epoch
        self.batches_done = 0
        # (batches, samples) a resume skipped: the position counts from there
        self._offset: tuple[int, int | None] = (0, 0)
        self._resume_epoch_begin(epoch)
        self.validated = False  # until this epoch's validation has run
        if loader.next_epoch_batches is not None:  # the batches this epoch will really run
            cbs.params["steps"] = loader.next_epoch_batches
        cbs.on_epoch_begin(epoch, {})
        stepper.lrs_used = None
        self.epoch_rng = torch.get_rng_state()  # replays this epoch's data order on resume
        want_begin, want_end = cbs.wants("on_train_batch_begin"), cbs.wants("on_train_batch_end")
        batches, start = self._batches()
        batches = _distributed.agree_on_epoch_end(loader, batches, start)  # already_sharded: even steps
        stepper.host_rows = _distributed.host_rows(loader)  # fitkit's shards: global batch sizes on the host
        self.in_epoch = True
        ran, skipped = False, 0
        with model._phase(self.totals):
            for step, batch in stepper.micro_batches(batches, start, self._stop_now):
                if self._skip_single and _rows(batch) == 1 and stepper.micro_last and stepper.micro_scale is None:
                    self._warn_single(step)
                    skipped += 1
                    continue
                if self._check_first:
                    self._check_first = False
                    first_batch_check(model, batch, label="first training batch")
                self.batch_index = step
                if want_begin:
                    cbs.on_train_batch_begin(step, {})
                model.train_step(batch)
                ran = True
                self.batches_done = step + 1
                if want_end:
                    cbs.on_train_batch_end(step, BatchLogs(self.totals.running))
                if model.stop_training if model._parallel is None else self._stop_now():
                    break
                if stepper.micro_last and self._interrupt_now():
                    self.interrupted = True
                    cbs.save_on_interrupt()  # at this step boundary, inside the epoch
                    break
        self.in_epoch = False
        if self.interrupted:
            return None
        if not ran and not start:
            self._no_batches(epoch, skipped)
            return None
        if getattr(loader, "ran_out", False) and not self._warned_short:
            self._warned_short = True
            warnings.warn(
                f"The training data ran out after {self.batches_done} of steps_per_epoch="
                f"{loader.steps} batches in epoch {epoch + 1}; that epoch ends early and the next "
                "starts a fresh pass (Keras' rule). Fix: lower `steps_per_epoch` to fit the data.",
                category=FitkitWarning, stacklevel=4,
            )
        if model._parallel is not None:
            model._parallel.sync_buffers(model.module)  # rank 0's BatchNorm statistics on every rank
        logs = self.totals.result()
        model._adopt_metrics(self.totals)
        # The LR the epoch's last step used (a per-step scheduler has moved it on since).
        logs.update(_lr_logs(stepper.lrs_used or model.optimizer.param_groups, self.per_group_lr))
        return logs

    def _no_batches(self, epoch: int, skipped: int = 0) -> None:
        if skipped and epoch == self.start_epoch:
            raise ValueError(
                f"Every training batch of epoch {epoch + 1} ({skipped}) had one row, and BatchNorm cannot "
                "train on one row, so nothing was trained. Fix: use batches of at least 2 rows, or put the "
                "BatchNorm layers in eval mode (`module.eval()` on them) before fit."
            )
        if epoch == self.start_epoch and not self.resume:
            raise ValueError(
                f"The training data ({_name(self.train)}) yielded no batch in epoch {epoch + 1}. Fix: "
                "pass data with at least one sample."
            )
        warnings.warn(
            f"The training data ({_name(self.train)}) yielded no batch in epoch {epoch + 1}, so training "
            "stops after epoch {epoch}. A generator is used up after one pass. Fix: pass a re-iterable "
            "such as a DataLoader or a list, or a `steps_per_epoch` that one pass can fill.".format(epoch=epoch),
            category=FitkitWarning, stacklevel=4,
        )

    def _warn_single(self, step: int) -> None:
        if self._warned_single:
            return
        self._warned_single = True  # one warning per fit
        warnings.warn(
            f"Batch {step} of epoch {self.epoch + 1} has one row, which BatchNorm cannot train on; it is "
            "skipped, as is every later one-row training batch of this fit. Fix: use `drop_last=True` in "
            "the DataLoader, or a batch size that leaves no single row.",
            category=FitkitWarning, stacklevel=5,
        )

    # -- stopping ----------------------------------------------------------------------------------
    def _stop_now(self, epoch_end: bool = False) -> bool:
        """Whether training stops here (``model.stop_training``).

        Under torchrun every rank must run the same steps, so a stop set on some ranks takes
        effect where the ranks agree: after ``on_backward_end`` when a callback uses that hook,
        and at the end of the epoch (one all-reduce: any rank's stop stops all).
        """
        model = self.model
        if model._parallel is None:
            return model.stop_training
        if epoch_end:  # one all-reduce: a stop, or a signal, on any rank holds for all
            agreed: Any = _distributed.any_rank(model.stop_training, self.interrupt.signum is not None)
            model.stop_training = agreed[0]
            if agreed[1] and self.interrupt.signum is None:
                self.interrupt.signum = signal.SIGTERM  # another rank was signalled: stop with it
            return model.stop_training
        return model._stepper.stop_agreed

    def _interrupt_now(self) -> bool:
        """Whether a SIGTERM / SIGINT stops training at this step boundary.

        Under torchrun every rank must stop at the same step: the ranks agree (one tiny
        all-reduce) after at most 8 optimizer steps and about every 2 seconds
        (:mod:`fitkit.distributed.agreement`), and at the latest at the end of the epoch.
        """
        local = self.interrupt.signum is not None
        if self.model._parallel is None:
            return local
        if self._agreement is None:
            self._agreement = _distributed.SignalAgreement()
        agreed = self._agreement.after_step(local)
        if agreed is None:  # between agreements: every rank goes on
            return False
        if agreed and not local:
            self.interrupt.signum = signal.SIGTERM  # another rank was signalled: stop with it
        return self.interrupt.signum is not None

    # -- resume ----------------------------------------------------------------------------------
    def _take_resume(self, pending: ResumePoint | None) -> None:
        """After ``on_train_begin``: the resume point loaded before fit or by a callback."""
        point = self.model._resume
        if point is None:
            return
        if point is not pending:  # loaded during on_train_begin (BackupAndRestore): start there
            self.start_epoch = self.epochs_done = point.epoch
        point.apply_callbacks(self.callbacks)
        if point.epoch != self.start_epoch:
            warnings.warn(
                f"The loaded checkpoint continues at epoch {point.epoch}, but fit starts at "
                f"initial_epoch={self.start_epoch}; its position and RNG state are not used. "
                f"Fix: fit(..., initial_epoch={point.epoch}).",
                category=FitkitWarning, stacklevel=4,
            )
            self.model._resume = None
            return
        self.resume = point
        self.model._resume = None

    def _resume_epoch_begin(self, epoch: int) -> None:
        point = self.resume
        if point is not None and point.epoch == epoch and not point.step_in_epoch:
            set_rng_state(point.rng)  # an epoch-boundary checkpoint
            self.train.resume_pass = point.pass_offset  # steps_per_epoch: the carried-over pass
            self.resume = None

    def _batches(self) -> tuple[Any, int]:
        """This epoch's batch iterator and the index of its first batch (a mid-epoch resume)."""
        point = self.resume
        if point is None or point.epoch != self.epoch or not point.step_in_epoch:
            return iter(self.train), 0
        self.resume = None
        # Replay the epoch's data order from the RNG state it started with, skip what was done,
        # then continue from the RNG state of the moment the checkpoint was taken.
        epoch_rng, trackers, totals = point.epoch_rng, point.trackers, self.totals
        if epoch_rng is None or trackers is None or totals is None:
            raise RuntimeError(
                f"The checkpoint's position inside epoch {point.epoch + 1} lacks its RNG state or totals."
            )
        self.epoch_rng = epoch_rng.cpu()
        torch.set_rng_state(self.epoch_rng)
        skip = point.skip_for(self.train)
        self.train.skip, self.train.skip_samples = skip
        self.train.resume_pass = point.pass_offset  # steps_per_epoch: where the carried-over pass was
        it = iter(self.train)
        first = next(it, None)
        set_rng_state(point.rng)
        totals.load_state_dict(trackers, owner=_distributed.is_rank_zero())
        # In-memory data resumes by samples: count the batches done in this fit's batch size.
        done = point.step_in_epoch if skip[1] is None else skip[1] // self.train.batch_size
        self.batches_done = done
        self._offset = (done, point.samples_in_epoch if skip[1] is not None else None)
        return (it if first is None else _chain(first, it)), done

    def position(self) -> dict[str, Any]:
        """Where a checkpoint taken now resumes: epoch, batches and samples done in it."""
        loader = self.train
        if self.in_epoch:
            return {"epoch": self.epoch, "step_in_epoch": self.batches_done, "samples_in_epoch": self._samples_done(),
                    "pass_offset": loader.pass_offset}  # fmt: skip
        carried = loader._pass_done if loader.steps is not None and loader._persistent is not None else 0
        return {"epoch": self.epochs_done, "step_in_epoch": 0, "samples_in_epoch": 0, "pass_offset": carried}


    def _samples_done(self) -> int:
        """Samples of the running epoch done: exact for in-memory data (fixed-size batches)."""
        size = getattr(self.train, "batch_size", None)
        if size is not None:  # under torchrun a batch index counts one global batch of every rank's share
            size *= getattr(self.train.batches, "world", 1)
        batches, samples = self._offset
        if size is None or samples is None:
            return 0
        n = getattr(self.train.batches, "n_used", None)
        done = (samples or batches * size) + (self.batches_done - batches) * size
        return done if n is None else min(done, n)


def _rows(batch: Any) -> int:
    x, y, _ = batch
    ts = nest.leaves(y if y is not None else x)
    return int(ts[0].shape[0]) if ts and ts[0].dim() > 0 else 1


def _chain(first: Any, it: Any):
    yield first
    yield from it
