"""The fit loop: one :class:`FitLoop` per ``fit`` call (``evaluate`` and ``predict``, which
run in eval mode, have theirs in :mod:`fitkit.training.eval_loop`).

A loop owns what lives for one call: its :class:`~fitkit.training.position.Position` in the data, the
resume point it applies, the epoch's running totals, whether this epoch validated, and the
call's callbacks. The model points at the running fit only while it runs (``model.epoch``,
``model.callbacks`` read it), and keeps plain values of it afterwards: once ``fit`` returns or
raises, nothing of the call stays reachable from the model.

``fit`` -> :meth:`FitLoop.run` -> :meth:`FitLoop.run_epoch` -> ``DeviceLoader.epoch_batches``
-> ``Stepper.micro_batches`` -> ``model.train_step(batch)`` -> ``CallbackList.on_train_batch_end``;
at the epoch end :meth:`EvalLoop.run` (validation) -> ``CallbackList.on_epoch_end`` -> ``History``.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch

from fitkit import distributed as _distributed
from fitkit.callbacks.base import BatchLogs, CallbackList
from fitkit.checks import FitkitWarning
from fitkit.checks.preflight import BatchGuard
from fitkit.data import TensorBatches
from fitkit.data import order as _order
from fitkit.data.collate import collate_failure
from fitkit.data.loaders import known_targets
from fitkit.distributed import progress as _progress
from fitkit.losses.denominators import targets_count
from fitkit.losses.outputs import note_row_weighted, takes_num_items
from fitkit.training.eval_loop import EvalLoop, PredictLoop, _name
from fitkit.training.lr_logs import lr_keys, lr_logs
from fitkit.training.modes import modes, warn_if_all_eval
from fitkit.training.position import Position
from fitkit.training.resume import Resume, data_identity
from fitkit.training.signals import deferred
from fitkit.training.step_validation import StepValidation, ValidationInterval, ValidationSchedule, record_validation
from fitkit.training.stopping import StopDecision
from fitkit.training.tracking import RunningTotals
from fitkit.training.validation_sets import run_validation

__all__ = ["FitLoop", "EvalLoop", "PredictLoop", "ValidationSchedule"]


class FitLoop:
    """One ``fit`` call: epochs, batches, validation, the resume point and the stop decision.

    Args:
        model: the :class:`fitkit.Model` (compiled).
        train: the training :class:`~fitkit.data.DeviceLoader`.
        callbacks: the call's :class:`CallbackList` (with its ``History``).
        initial_epoch: first epoch to run (0-based); a restored backup may move it.
        epochs: index of the last epoch (Keras).
        validation: the validation :class:`~fitkit.data.DeviceLoader`, or ``None``.
        schedule: the epochs that validate (:class:`ValidationSchedule`).
        validation_steps: batches per validation (``None``: all).
        max_steps: stop once ``global_step`` reaches it (:mod:`fitkit.training.budget`), or ``None``.
        validation_interval: validate inside epochs (:mod:`fitkit.training.step_validation`), or ``None``.
        validate_at_end: with an interval, validate at the last step of the run too.
        min_epochs, min_steps: no stop request is heard before them (:class:`StopDecision`).
        accumulation: this fit's accumulation schedule (:mod:`fitkit.training.accumulation`), or ``None``.
        resume: ``fit(resume=...)`` (:mod:`fitkit.training.resume`).
    """

    def __init__(self, model: Any, train: Any, callbacks: CallbackList, *, initial_epoch: int, epochs: int | None,
                 validation: Any = None, schedule: ValidationSchedule | None = None,
                 validation_steps: int | None = None, max_steps: int | None = None,
                 validation_interval: ValidationInterval | None = None, accumulation: Any = None,
                 validate_at_end: bool = False, min_epochs: int | None = None,
                 min_steps: int | None = None, resume: str | None = None):  # fmt: skip
        self.model, self.train, self.callbacks = model, train, callbacks
        self.val, self.val_schedule, self.val_steps = validation, schedule, validation_steps
        self.history: Any = next(cb for cb in callbacks.callbacks if type(cb).__name__ == "History")
        self.start_epoch, self.epochs, self.max_steps = initial_epoch, epochs, max_steps
        self.validate_at_end = validate_at_end
        self.step_val = None if validation_interval is None else StepValidation(
            model, validation, callbacks, self.history, validation_steps, validation_interval)
        self.accumulation = accumulation
        batches = getattr(train, "batches", None)
        self.position = Position(initial_epoch, batch_size=getattr(train, "batch_size", None),
                                 world=getattr(batches, "world", 1),
                                 n_used=getattr(batches, "n_used", None))  # fmt: skip
        self.resume = Resume(train, self.position, resume)  # a loaded checkpoint's point, applied once
        self.stop = StopDecision(model, callbacks, max_steps, min_epochs, min_steps)
        self.epoch_order: dict[str, Any] | None = None  # the loader's own order state at the epoch start
        self.totals: RunningTotals | None = None
        self.validated = False  # this epoch: validation was scheduled and ran over > 0 batches
        self.lr_keys = lr_keys(model.optimizer, model.scheduler)
        self.guard = BatchGuard(model, train)
        self.example: Any = None  # the first training batch's x, if checked here (summary's input)
        self.interrupt: Any = None
        self.running = False
        self.batch_index = 0  # the running batch (0-based; on_backward_end's argument)
        self.rows_note = False  # a module's own loss without num_items_in_batch: note -100 labels once
        self.batch: Any = None  # the running batch (x, y, sample_weight), on the device
        self._warned_short = False

    @property
    def epoch(self) -> int:
        """The running (or last run) epoch."""
        return self.position.epoch

    # -- the run ---------------------------------------------------------------------------------
    def _named_epoch(self, epoch: int, first_step: int) -> Any:
        """:meth:`run_epoch`, with torch's stack error from a user's DataLoader named (no cost per step)."""
        try:
            return self.run_epoch(epoch)
        except RuntimeError as e:
            named = collate_failure(e, self.model.global_step - first_step)
            if named is None:
                raise
            raise named from e

    def run(self) -> None:
        model, cbs, stepper = self.model, self.callbacks, self.model.stepper
        model.stop_training = False
        # on_backward_end, run by the stepper before each of the fit's steps (None: nobody listens).
        before_step = self._on_backward_end if cbs.wants("on_backward_end") else None
        cbs.params["train_data"] = self.train  # the training batches (SWA's BatchNorm update)
        logs: dict[str, float] = {}
        pending = model.pop_resume()  # loaded before fit (BackupAndRestore loads in on_train_begin)
        finished, first_step = False, model.global_step
        self.running = True
        try:
            agree = before_step is not None and cbs.host_agreement_after_backward()  # else no per-step agreement
            wants_stop = (lambda: model.stop_training) if agree else None
            fitting = stepper.fitting(before_step, wants_stop, self.val is not None, self.accumulation,
                                      self._own_items())  # fmt: skip
            if self.rows_note and isinstance(getattr(self.train, "batches", None), TensorBatches):
                self._note_rows(None)  # in-memory data: all its labels now (a loader's: its first batch)
            place = self._place if model.parallel is not None else None
            with modes(model.module, training=None, grad=True), deferred() as self.interrupt, fitting, \
                    _progress.beating(place):
                # time triggers, under torchrun: agreed over ranks where signals are
                self.stop.begin(self.interrupt, self._time_triggers() if model.parallel is not None else [])
                warn_if_all_eval(model.module)
                model.optimizer.zero_grad(set_to_none=True)  # gradients from user code never leak in
                cbs.on_train_begin({})
                late = model.pop_resume()  # loaded during on_train_begin (BackupAndRestore): start there
                start = self.resume.take(pending, late, self.start_epoch, cbs)
                if late is not None:
                    self.start_epoch = start
                    self.position.starts_at(start)
                for epoch in itertools.count(self.start_epoch) if self.epochs is None else \
                        range(self.start_epoch, self.epochs):  # fmt: skip
                    if self.stop.budget_spent():
                        break
                    epoch_logs = self._named_epoch(epoch, first_step)
                    if epoch_logs is None:  # no batch, or a signal: no partial epoch for callbacks
                        break
                    logs = epoch_logs
                    self._validate(epoch, logs)
                    # inside-epoch validations stepped a plateau scheduler already
                    stepper.scheduling.step_epoch(epoch, logs, self.validated and self.step_val is None,
                                                  stepper.fit.validates)
                    self.position.end_epoch(epoch)
                    cbs.on_epoch_end(epoch, logs)
                    if self.stop.now(epoch_end=True) or self.interrupt.signum is not None or self.stop.budget_spent():
                        break
                self.stop.save_on_signal()  # at an epoch boundary
                cbs.on_train_end(logs)
                finished = True
            if self.interrupt.signum is not None:
                self.interrupt.raise_now()
        finally:
            self.running = False
            _distributed.dcp.wait()  # an async checkpoint still being written ends with fit
            cbs.params.pop("train_data", None)  # History keeps params: not the data
            cbs.close(finished)
            model.pop_resume()  # a loaded resume point serves one fit only

    def _own_items(self) -> bool | None:
        """A module that computes its own loss and takes ``num_items_in_batch``: whether its labels
        shift (:func:`fitkit.losses.outputs.takes_num_items`); ``None`` for any other (then
        :attr:`rows_note`: its own loss is a mean per micro-batch that fitkit weighs by rows)."""
        model = self.model
        if model.loss is not None or not model.default_compute_loss or not model.default_train_step:
            return None
        accepts, shifts = takes_num_items(model.module)
        self.rows_note = not accepts
        return shifts if accepts else None

    def _first_batch(self, guard: Any, batch: Any) -> None:
        """The first batch of the fit: checked (:class:`BatchGuard`), and its labels looked at."""
        self.example = guard.first(self.model, batch)
        if self.rows_note:
            self._note_rows(batch)

    def _note_rows(self, batch: Any) -> None:
        """Once per fit: a module's own loss, without ``num_items_in_batch``, on labels holding -100,
        under accumulation or torchrun: its micro-batch means are weighed by rows, not tokens.
        In-memory data: all its labels are looked at; else the first batch's."""
        self.rows_note = False
        if self.model.stepper.accumulation == 1 and self.model.parallel is None:
            return
        source: Any = getattr(self.train, "batches", None)
        x = source.x if batch is None else batch[0]
        note_row_weighted(self.model.module, x)

    def _time_triggers(self) -> list[Any]:
        """What acts on a clock (``time_due()`` / ``time_agreed()``): a timedelta validation
        interval, callbacks such as ``ModelCheckpoint(train_time_interval=...)``."""
        triggers: list[Any] = []
        if self.step_val is not None and self.step_val.interval.seconds is not None:
            self.step_val.agree_by_ranks()
            triggers.append(self.step_val)
        triggers += [cb for cb in self.callbacks.callbacks if callable(getattr(cb, "time_agreed", None))]
        return triggers

    def _place(self) -> tuple[int, int, int]:
        """(epoch, batch begun, batches done) for :mod:`fitkit.distributed.progress`."""
        position = self.position
        return position.epoch, self.batch_index, position.batches

    def _on_backward_end(self) -> None:
        self.callbacks.on_backward_end(self.batch_index)

    def _last_epoch(self, epoch: int) -> bool:
        """Whether training ends with ``epoch`` by plan: the last epoch, or the step budget spent."""
        return (self.epochs is not None and epoch == self.epochs - 1) or self.stop.budget_spent()

    def _validate(self, epoch: int, logs: dict[str, float]) -> None:
        self.validated = False
        if self.step_val is not None:  # validated inside the epoch: its last validation's values
            if self.validate_at_end and self._last_epoch(epoch) and self.step_val.last_step != self.model.global_step:
                self.step_val.run(epoch)  # the run's last step is scored too (the Trainer's end-of-training evaluation)
            val_logs = self.step_val.epoch_logs(epoch)
            self.validated = val_logs is not None
            logs.update(val_logs or {})
            return
        if self.val is None or self.val_schedule is None or not self.val_schedule(epoch):
            return
        val_logs = run_validation(self.model, self.val, self.callbacks, self.val_steps)
        self.validated = True
        logs.update(record_validation(self.history, self.callbacks, self.model.global_step, epoch, val_logs))

    def run_epoch(self, epoch: int) -> dict[str, float] | None:
        """One epoch of training batches; ``None`` if the source yielded no batch."""
        model, cbs, loader, position = self.model, self.callbacks, self.train, self.position
        stepper = model.stepper
        phases = model.phases
        self.totals = totals = phases.new_totals()
        position.begin_epoch(epoch)
        self.resume.epoch_begin(epoch)
        self.validated = False  # until this epoch's validation has run
        if loader.next_epoch_batches is not None:  # the batches this epoch will really run
            cbs.params["steps"] = loader.next_epoch_batches
        cbs.on_epoch_begin(epoch, {})
        stepper.begin_epoch(epoch, _distributed.host_rows(loader, model.loss))  # host rows: fitkit's shards
        if self.step_val is not None:
            self.step_val.begin_epoch(loader.next_epoch_batches or loader.num_batches, stepper.accumulation)
        position.set_rng(torch.get_rng_state())  # replays this epoch's data order on resume
        self.epoch_order = _order.capture(loader)  # and the loader's own generators / state
        want_begin, want_end = cbs.wants("on_train_batch_begin"), cbs.wants("on_train_batch_end")
        batches, start = self.resume.batches(epoch, totals)
        self.batch_index = start - 1  # none of this epoch begun yet (read by the progress thread)
        batches = _distributed.check_worker_copies(loader, batches)  # workers that yield the same samples
        batches = _distributed.agree_on_epoch_end(loader, batches, start)  # already_sharded: even steps
        guard, interrupt = self.guard, self.interrupt
        skip_single, check_first = guard.skip_single, guard.check_first
        local = model.parallel is None  # one process: stops and signals need no agreement
        budget, step_val = self.max_steps, self.step_val
        position.enter()
        ran, skipped, begins = False, 0, True
        # an overridden step or compute_loss may make targets of its own from y (-100 where masked)
        own = model.default_compute_loss and model.default_train_step
        with phases.running(totals), targets_count(model.loss, known_targets(loader) if own else None):
            for step, batch in stepper.micro_batches(batches, start, self.stop.now):
                if skip_single and guard.single(batch, stepper, step, epoch):
                    skipped += 1
                    continue
                if check_first:
                    check_first = False
                    self._first_batch(guard, batch)
                self.batch_index, self.batch = step, batch
                if want_begin:
                    cbs.on_train_batch_begin(step, {})
                if not local and begins:  # DDP follows a trainable set a callback changed, from this step
                    model.refresh_parallel()
                model.train_step(batch)
                ran, begins = True, stepper.window.micro_last  # the next micro-batch begins a window
                position.done(step + 1)
                if step_val is not None and stepper.window.micro_last:
                    step_val.after_step(step + 1, epoch)  # before the batch's hooks: a backup there holds it
                if want_end:
                    cbs.on_train_batch_end(step, BatchLogs(totals.running))
                if (model.stop_training or not local) and self.stop.now():  # min_epochs / min_steps may hold it
                    break
                if budget is not None and stepper.window.micro_last and stepper.global_step >= budget:
                    break  # the step budget (a host-side count): the epoch ends here
                if (stepper.window.micro_last and (not local or interrupt.signum is not None)
                        and self.stop.at_boundary()):
                    break
        position.leave()
        return self._end_epoch(epoch, ran or bool(start), skipped, totals)

    def _end_epoch(self, epoch: int, ran: bool, skipped: int, totals: Any) -> dict[str, float] | None:
        """The epoch's logs once its batches ran (``None``: interrupted, or no batch at all)."""
        model, phases, stepper = self.model, self.model.phases, self.model.stepper
        if self.stop.interrupted:
            return None
        if not ran:
            self._no_batches(epoch, skipped)
            return None
        self._warn_ran_out(epoch)
        if model.parallel is not None:
            model.parallel.sync_buffers(model.module)  # rank 0's BatchNorm statistics on every rank
        logs = totals.result()
        phases.adopt(totals)
        # The LR the epoch's last step used (a per-step scheduler has moved it on since).
        logs.update(lr_logs(stepper.scheduling.lrs_used or model.optimizer.param_groups, self.lr_keys))
        return logs

    def _warn_ran_out(self, epoch: int) -> None:
        loader = self.train
        if getattr(loader, "ran_out", False) and not self._warned_short:
            self._warned_short = True
            warnings.warn(
                f"The training data ran out after {self.position.batches} of steps_per_epoch="
                f"{loader.steps} batches in epoch {epoch + 1}; that epoch ends early and the next "
                "starts a fresh pass (Keras' rule). Fix: lower `steps_per_epoch` to fit the data.",
                category=FitkitWarning, stacklevel=5,
            )

    def _no_batches(self, epoch: int, skipped: int = 0) -> None:
        if epoch == self.start_epoch:
            BatchGuard.nothing_trained(epoch, skipped)
        if epoch == self.start_epoch and self.resume.pending is None:
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

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self, boundary: bool = False) -> dict[str, Any]:
        """The checkpoint's part of this fit: where it resumes (see :class:`Position`), the batch
        size, and inside an epoch its RNG state and running totals (a collective under torchrun).

        ``boundary``: as at an epoch boundary (after the last complete epoch), whatever the
        loop is doing: what the model keeps of a fit that returned or raised.
        """
        position, loader = self.position, self.train
        inside = position.in_epoch and not boundary
        if boundary:
            position.leave()
        state = position.state_dict(loader.pass_offset if inside else loader.carried_over, loader.pass_start)
        state["batch_size"] = getattr(loader, "batch_size", None)
        state.update(data_identity(loader))  # what the position means: the training set's length
        order = _order.at_checkpoint(loader, self.epoch_order, inside)
        if order is not None:  # a loader's own generators / state (fitkit.data.order)
            state["data_order"] = order
        if state["step_in_epoch"]:
            state["epoch_rng"] = position.epoch_rng
            state["trackers"] = self.totals.state_dict() if self.totals is not None else None
        return state

