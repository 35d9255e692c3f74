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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fitkit import distributed as _distributed
from fitkit.callbacks.base import BatchLogs, CallbackList
from fitkit.checks import FitkitWarning
from fitkit.data import TensorBatches
from fitkit.data import order as _order
from fitkit.data.collate import collate_failure
from fitkit.data.loaders import known_targets
from fitkit.distributed import progress as _progress
from fitkit.distributed.agreement import RankMismatch
from fitkit.losses.denominators import targets_count
from fitkit.losses.outputs import note_row_weighted, takes_num_items
from fitkit.modes import modes, warn_if_all_eval
from fitkit.training import run_files
from fitkit.training.eval_loop import EvalLoop, PredictLoop, _name, signal_held
from fitkit.training.lr_logs import lr_keys, lr_logs
from fitkit.training.micro_batches import train_in_micro_batches
from fitkit.training.position import Position
from fitkit.training.preflight import BatchGuard
from fitkit.training.resume import Resume, data_identity
from fitkit.training.signals import deferred, watchdog
from fitkit.training.step_validation import StepValidation, ValidationSchedule, record_validation
from fitkit.training.stopping import StopDecision
from fitkit.training.tracking import RunningTotals
from fitkit.training.validation_sets import run_validation

if TYPE_CHECKING:
    from fitkit.training.planning import FitPlan

__all__ = ["FitLoop", "EvalLoop", "PredictLoop", "ValidationSchedule"]


@dataclass
class _Notes:
    """What one fit says once.

    Attributes:
        rows: a module's own loss without ``num_items_in_batch`` under accumulation or torchrun:
            its labels are still to be looked at for -100 (a note that its means weigh by rows).
        ran_out: the ``steps_per_epoch`` ran-out warning was given.
    """

    rows: bool = False
    ran_out: bool = False


class FitLoop:
    """One ``fit`` call: epochs, batches, validation, the resume point and the stop decision.

    Args:
        model: the :class:`fitkit.Model` (compiled).
        plan: the call's :class:`~fitkit.training.planning.FitPlan` (loaders, budgets, schedules).
        callbacks: the call's :class:`CallbackList` (with its ``History``).
    """

    def __init__(self, model: Any, plan: FitPlan, callbacks: CallbackList):
        self.model, self.plan, self.callbacks = model, plan, callbacks
        self.history: Any = next(cb for cb in callbacks.callbacks if type(cb).__name__ == "History")
        self.start_epoch = plan.initial_epoch  # a restored backup may move it
        self.step_val = (
            None
            if plan.interval is None
            else StepValidation(model, plan.val, callbacks, self.history, plan.validation_steps, plan.interval)
        )
        train = plan.train
        batches = getattr(train, "batches", None)
        self.position = Position(
            plan.initial_epoch,
            batch_size=getattr(train, "batch_size", None),
            world=getattr(batches, "world", 1),
            n_used=getattr(batches, "n_used", None),
        )
        # a loaded point, applied once
        self.resume = Resume(train, self.position, model._core.stepper.scheduling, plan.resume)
        self.stop = StopDecision(model, callbacks, plan.max_steps, plan.min_epochs, plan.min_steps)
        self.epoch_order: dict[str, Any] | None = None  # the loader's own order state at the epoch start
        self.totals: RunningTotals | None = None
        self.validated = False  # this epoch: validation was scheduled and ran over > 0 batches
        self.guard = BatchGuard(model, train)
        self.example: Any = None  # the first training batch's x, if checked here (summary's input)
        self.interrupt: Any = None
        self.running = False
        self.batch_index = 0  # the running batch (0-based; on_backward_end's argument)
        self.phase = 0  # 0 in the epoch's batches, else a phase of progress (read by the progress thread)
        self.notes = _Notes()  # what the fit says once
        self.batch: Any = None  # the running batch (x, y, sample_weight), on the device

    @property
    def train(self) -> Any:
        """The training :class:`~fitkit.data.DeviceLoader` (the plan's)."""
        return self.plan.train

    @property
    def val(self) -> Any:
        """The validation loader or sets (the plan's), or ``None``."""
        return self.plan.val

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
        model, cbs, stepper = self.model, self.callbacks, self.model._core.stepper
        model.stop_training = False
        # on_backward_end, run by the stepper before each of the fit's steps (None: nobody listens).
        before_step = self._on_backward_end if cbs.wants("on_backward_end") else None
        cbs.params["train_data"] = self.train  # the training batches (SWA's BatchNorm update)
        logs: dict[str, float] = {}
        pending = model._core.pop_resume()  # loaded before fit (BackupAndRestore loads in on_train_begin)
        finished, first_step = False, model.global_step
        self.running = True
        run_files.remember(model, cbs.callbacks)  # save_checkpoint() / load_checkpoint() without a path
        try:
            agree = before_step is not None and cbs.host_agreement_after_backward()  # else no per-step agreement
            wants_stop = (lambda: model.stop_training) if agree else None
            fitting = stepper.fitting(
                before_step, wants_stop, self.val is not None, self.plan.accumulation, self._own_items()
            )
            if self.notes.rows and isinstance(getattr(self.train, "batches", None), TensorBatches):
                self._note_rows(None)  # in-memory data: all its labels now (a loader's: its first batch)
            place = self._place if model._core.parallel is not None else None
            with (
                modes(model.module, training=None, grad=True),
                deferred() as self.interrupt,
                fitting,
                _progress.beating(place),
                watchdog(lambda: self.stop.interrupted, enabled=place is not None),  # a signal while a rank waits
            ):
                # time triggers, under torchrun: agreed over ranks where signals are
                triggers = self._time_triggers() if model._core.parallel is not None else []
                self.stop.begin(self.interrupt, triggers, lambda: (self.position.epoch, self.position.batches))
                warn_if_all_eval(model.module)
                model.optimizer.zero_grad(set_to_none=True)  # gradients from user code never leak in
                cbs.on_train_begin({})
                late = model._core.pop_resume()  # loaded during on_train_begin (BackupAndRestore): start there
                start = self.resume.take(pending, late, self.start_epoch, cbs)
                if late is not None:
                    self.start_epoch = start
                    self.position.starts_at(start)
                logs = self._epochs(first_step)
                self.stop.save_on_signal()  # at an epoch boundary
                cbs.on_train_end(logs)
                finished = True
            if self.interrupt.signum is not None:
                self.interrupt.raise_now()
        except Exception as e:
            if finished or model.global_step == first_step or isinstance(e, RankMismatch):
                # before step 1 nothing trained (and nothing may change); after the end, nothing to save;
                # ranks at different collectives: a checkpoint's collectives would not meet either
                raise
            cbs.save_on_exception()  # a crash, not a kill: the last completed batch, resumable
            raise
        finally:
            self.running = False
            _distributed.dcp.wait()  # an async checkpoint still being written ends with fit
            cbs.params.pop("train_data", None)  # History keeps params: not the data
            cbs.close(finished)
            model._core.pop_resume()  # a loaded resume point serves one fit only

    def _epochs(self, first_step: int) -> dict[str, float]:
        """The fit's epochs, each with its validation and end hooks, until one ends the fit; the last logs."""
        cbs, stepper = self.callbacks, self.model._core.stepper
        logs: dict[str, float] = {}
        for epoch in (
            itertools.count(self.start_epoch) if self.plan.epochs is None else range(self.start_epoch, self.plan.epochs)
        ):
            if self.stop.budget_spent():
                break
            epoch_logs = self._named_epoch(epoch, first_step)
            if epoch_logs is None:  # no batch, or a signal: no partial epoch for callbacks
                break
            _order.dataset_epoch_hook(self.train, "on_epoch_end")  # its training batches are done
            logs = epoch_logs
            self.phase = _progress.VALIDATION
            if self._validate(epoch, logs):  # a signal cut the validation short
                self.position.enter()  # the backup: after the epoch's last step, validating again on resume
                break
            # inside-epoch validations stepped a plateau scheduler already
            stepper.scheduling.step_epoch(epoch, logs, self.validated and self.step_val is None, stepper.fit.validates)
            self.position.end_epoch(epoch)
            self.phase = _progress.EPOCH_CALLBACKS  # and the stop agreement after them
            cbs.on_epoch_end(epoch, logs)
            if self.stop.now(epoch_end=True) or self.interrupt.signum is not None or self.stop.budget_spent():
                break
        return logs

    def _own_items(self) -> bool | None:
        """A module that computes its own loss and takes ``num_items_in_batch``: whether its labels
        shift (:func:`fitkit.losses.outputs.takes_num_items`); ``None`` for any other (then
        :attr:`_Notes.rows`: its own loss is a mean per micro-batch that fitkit weighs by rows)."""
        model = self.model
        if model.loss is not None or not model.default_compute_loss or not model.default_train_step:
            return None
        accepts, shifts = takes_num_items(model.module)
        self.notes.rows = not accepts
        return shifts if accepts else None

    def _first_batch(self, guard: Any, batch: Any) -> None:
        """The first batch of the fit: checked (:class:`BatchGuard`), and its labels looked at."""
        self.example = guard.first(self.model, batch)
        if self.notes.rows:
            self._note_rows(batch)

    def _note_rows(self, batch: Any) -> None:
        """Once per fit: a module's own loss, without ``num_items_in_batch``, on labels holding -100,
        under accumulation or torchrun: its micro-batch means are weighed by rows, not tokens.
        In-memory data: all its labels are looked at; else the first batch's."""
        self.notes.rows = False
        if self.model._core.stepper.accumulation == 1 and self.model._core.parallel is None:
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
        triggers += [cb for cb in self.callbacks.callbacks if cb.acts_on_time]
        return triggers

    def _place(self) -> tuple[int, int, int, int]:
        """(epoch, batch begun, batches done, phase) for :mod:`fitkit.distributed.progress`."""
        position = self.position
        return position.epoch, self.batch_index, position.batches, self.phase

    def _on_backward_end(self) -> None:
        self.callbacks.on_backward_end(self.batch_index)

    def _last_epoch(self, epoch: int) -> bool:
        """Whether training ends with ``epoch`` by plan: the last epoch, or the step budget spent."""
        return (self.plan.epochs is not None and epoch == self.plan.epochs - 1) or self.stop.budget_spent()

    def _validate(self, epoch: int, logs: dict[str, float]) -> bool:
        """The epoch's validation into ``logs``; ``True`` when a signal cut it short (its values
        are dropped: a resume from the backup then written runs it again)."""
        self.validated = False
        if self.step_val is not None:  # validated inside the epoch: its last validation's values
            at_end = self.plan.validate_at_end and self._last_epoch(epoch)
            if at_end and self.step_val.last_step != self.model.global_step:
                self.step_val.run(epoch)  # the run's last step is scored too (the Trainer's end-of-training evaluation)
            val_logs = self.step_val.epoch_logs(epoch)
            self.validated = val_logs is not None
            logs.update(val_logs or {})
            return signal_held(self.model)
        if self.val is None or self.plan.schedule is None or not self.plan.schedule(epoch):
            return False
        val_logs = run_validation(self.model, self.val, self.callbacks, self.plan.validation_steps)
        if signal_held(self.model):
            return True
        self.validated = True
        logs.update(record_validation(self.history, self.callbacks, self.model.global_step, epoch, val_logs))
        return False

    def _begin_epoch(self, epoch: int) -> None:
        """The epoch's begin: its hooks, the stepper's and validation's counts, the data order kept for a resume."""
        model, cbs, loader, position = self.model, self.callbacks, self.train, self.position
        stepper = model._core.stepper
        self.phase, self.batch_index = 0, -1  # the epoch's begin hooks: "before its first batch" (progress)
        position.begin_epoch(epoch)
        self.resume.epoch_begin(epoch)
        self.validated = False  # until this epoch's validation has run
        if loader.next_epoch_batches is not None:  # the batches this epoch will really run
            cbs.params["steps"] = loader.next_epoch_batches
        cbs.on_epoch_begin(epoch, {})
        if self.step_val is not None and self.resume.validation_due(epoch):
            self.step_val.run(epoch)  # the one a signal cut short, at the saved step (invariant 2); RNGs put back
        _order.dataset_epoch_hook(loader, "on_epoch_begin")  # Keras' PyDataset hook, before the order is kept
        stepper.begin_epoch(epoch, _distributed.host_rows(loader, model.loss))  # host rows: fitkit's shards
        if self.step_val is not None:
            self.step_val.begin_epoch(loader.next_epoch_batches or loader.num_batches, stepper.accumulation)
        position.set_rng(torch.get_rng_state())  # replays this epoch's data order on resume
        self.epoch_order = _order.capture(loader)  # and the loader's own generators / state

    def run_epoch(self, epoch: int) -> dict[str, float] | None:
        """One epoch of training batches; ``None`` if the source yielded no batch."""
        model, cbs, loader, position = self.model, self.callbacks, self.train, self.position
        stepper = model._core.stepper
        phases = model._core.phases
        self.totals = totals = phases.new_totals()
        self._begin_epoch(epoch)
        want_begin, want_end = cbs.wants("on_train_batch_begin"), cbs.wants("on_train_batch_end")
        batches, start = self.resume.batches(epoch, totals)
        self.batch_index = start - 1  # none of this epoch begun yet (read by the progress thread)
        batches = _distributed.check_worker_copies(loader, batches)  # workers that yield the same samples
        batches = _distributed.agree_on_epoch_end(loader, batches, start)  # already_sharded: even steps
        guard, interrupt = self.guard, self.interrupt
        skip_single, check_first = guard.skip_single, guard.check_first
        local = model._core.parallel is None  # one process: stops and signals need no agreement
        budget, step_val, micro = self.plan.max_steps, self.step_val, stepper.micro_batch_size
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
                    model._core.refresh_parallel()
                if micro is None:
                    model.train_step(batch)
                else:  # compile(micro_batch_size=...): the batch in chunks, one window place
                    train_in_micro_batches(model, batch, micro)
                ran, begins = True, stepper.window.micro_last  # the next micro-batch begins a window
                position.done(step + 1)
                if step_val is not None and stepper.window.micro_last:
                    step_val.after_step(step + 1, epoch)  # before the batch's hooks: a backup there holds it
                if want_end:
                    cbs.on_train_batch_end(step, BatchLogs(totals.running))
                # the loop's invariant 1: every stop waits for the open window's step
                if stepper.window.micro_last and (
                    (model.stop_training or not local)
                    and self.stop.now()  # min_epochs / min_steps may hold it
                    # the step budget (a host-side count): the epoch ends here
                    or budget is not None
                    and stepper.global_step >= budget
                    or (not local or interrupt.signum is not None)
                    and self.stop.at_boundary()
                ):
                    break
        position.leave()
        self.phase = _progress.EPOCH_END
        return self._end_epoch(epoch, ran or bool(start), skipped, totals)

    def _end_epoch(self, epoch: int, ran: bool, skipped: int, totals: Any) -> dict[str, float] | None:
        """The epoch's logs once its batches ran (``None``: interrupted, or no batch at all)."""
        model, phases, stepper = self.model, self.model._core.phases, self.model._core.stepper
        if self.stop.interrupted:
            return None
        if not ran:
            self._no_batches(epoch, skipped)
            return None
        self._warn_ran_out(epoch)
        if model._core.parallel is not None:
            self.stop.agreement.at_metric_sync(totals.synced())  # every rank enters the same syncs, or all raise
            model._core.parallel.sync_buffers(model.module)  # rank 0's BatchNorm statistics on every rank
        logs = totals.result()
        phases.adopt(totals)
        # The LR the epoch's last step used (a per-step scheduler has moved it on since).
        keys = lr_keys(model.optimizer, model.scheduler)
        logs.update(lr_logs(stepper.scheduling.lrs_used or model.optimizer.param_groups, keys))
        return logs

    def _warn_ran_out(self, epoch: int) -> None:
        loader = self.train
        if getattr(loader, "ran_out", False) and not self.notes.ran_out:
            self.notes.ran_out = True
            warnings.warn(
                f"The training data ran out after {self.position.batches} of steps_per_epoch="
                f"{loader.steps} batches in epoch {epoch + 1}; that epoch ends early and the next "
                "starts a fresh pass (Keras' rule). Fix: lower `steps_per_epoch` to fit the data.",
                category=FitkitWarning,
                stacklevel=5,
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
            category=FitkitWarning,
            stacklevel=4,
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
            used = self.model._core.stepper.scheduling.lrs_used  # the epoch's log reads them (invariant 5)
            if used is not None:
                state["lrs_used"] = [float(lr) for lr in used]
            if self.step_val is not None and self.step_val.cut:  # the resume runs it again (invariant 2)
                state["validation_due"] = True
        return state
