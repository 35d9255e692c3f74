"""When ``fit`` validates: after epochs (``validation_freq``, :class:`ValidationSchedule`) or
inside them (``validation_interval``), and the record of every validation.

``validation_interval=N`` (an int) validates after every ``N``-th optimizer step, counted by
``global_step`` across epochs (Transformers' ``eval_steps``; Lightning's ``val_check_interval``
with ``check_val_every_n_epoch=None``). A float ``f`` in ``(0, 1]`` validates every
``max(1, int(f * S))`` optimizer steps of each epoch of ``S`` steps, counted from the epoch's
start (Lightning's float ``val_check_interval``: ``0.25`` is four validations per epoch).
``RunFraction(f)`` (:class:`fitkit.training.budget.RunFraction`) validates after the first
optimizer step at or past each fraction ``f`` of the run's planned steps (``params["total_steps"]``,
counted in ``global_step``) and after the last one (Composer's ``eval_interval="0.25dur"``).
A ``datetime.timedelta`` validates once that much training time has passed since the fit began
or since the last validation (checked after each optimizer step on one process; under torchrun
the ranks agree where they already agree on signals, after at most 8 steps and about every
2 s, and validate after the next step, all at the same one; the time restarts with each
``fit`` call). Validations then run only there: an epoch's logs hold the ``val_`` values of its last
validation, if it had one (as ``validation_freq`` leaves epochs out), and ``validation_freq``
cannot be combined with it.

A validation inside an epoch runs in eval mode under ``no_grad`` with totals of its own, and
puts every RNG state back afterwards: the training epoch's totals, its data order and its
dropout masks are those of a fit without it. Each validation of a fit (step-level or at the
epoch end) is recorded in ``history.validations`` as ``{"epoch", "step", "val_...": ...}``
(``step``: ``global_step`` when it was taken), and then fires ``on_validation_end(logs)`` with
that record. ``EarlyStopping``, ``ModelCheckpoint`` and ``ReduceLROnPlateau`` with a ``val_``
monitor, and a compiled ``ReduceLROnPlateau`` scheduler, act on each validation then (and not
again at the epoch end); ``patience`` counts validations. A timm plateau scheduler is not
stepped then (other timm schedulers still get ``step(epoch + 1)`` at epoch ends).
"""

from __future__ import annotations

import datetime
import math
import time
from typing import TYPE_CHECKING, Any, cast

from fitkit.callbacks.logkeys import per_validation
from fitkit.checks import check_int, check_number
from fitkit.training import checkpoint as _checkpoint
from fitkit.training.budget import RunFraction
from fitkit.training.eval_loop import signal_held
from fitkit.training.validation_sets import run_validation

if TYPE_CHECKING:
    from fitkit.callbacks.base import Callback, CallbackList, History
    from fitkit.data import DeviceLoader
    from fitkit.model import Model
    from fitkit.training.validation_sets import ValidationSets

__all__ = ["ValidationSchedule", "ValidationInterval", "StepValidation", "record_validation", "per_validation"]


class ValidationSchedule:
    """After which (0-based) epochs ``fit`` validates: ``validation_freq`` (Keras' argument).

    Args:
        validation_freq: validate every n epochs (an int), or after the listed 1-based epochs.

    Raises:
        TypeError, ValueError: not an int >= 1, or a list of them.

    Example:
        >>> every2, listed = ValidationSchedule(2), ValidationSchedule([1, 5])
        >>> [e for e in range(6) if every2(e)], listed.epochs(0, 6)
        ([1, 3, 5], [0, 4])
    """

    def __init__(self, validation_freq: int | list[int] | tuple[int, ...] | set[int]):
        self.every: int | None = None
        self.listed: set[int] = set()
        if isinstance(validation_freq, (list, tuple, set)):
            for v in validation_freq:
                check_int("validation_freq", v, 1)
                self.listed.add(int(v))
        else:
            check_int("validation_freq", validation_freq, 1)
            self.every = int(validation_freq)

    def __call__(self, epoch: int) -> bool:
        """Whether validation is scheduled after (0-based) ``epoch``."""
        return (epoch + 1) % self.every == 0 if self.every is not None else epoch + 1 in self.listed

    def epochs(self, start: int, stop: int) -> list[int]:
        """The scheduled (0-based) epochs of ``range(start, stop)``."""
        return [e for e in range(start, stop) if self(e)]


class ValidationInterval:
    """When ``fit`` validates inside an epoch (see the module's docstring).

    Args:
        value: an int >= 1 (every that many optimizer steps, counted by ``global_step``), a
            float in ``(0, 1]`` (a fraction of each epoch's optimizer steps), a
            :class:`~fitkit.training.budget.RunFraction` (fractions of the run's planned steps) or a
            ``datetime.timedelta`` (that much training time; see the module).

    Raises:
        TypeError: not an int, a float or a timedelta.
        ValueError: an int < 1, a float outside ``(0, 1]``, a timedelta not > 0.

    Example:
        >>> every3, quarter = ValidationInterval(3), ValidationInterval(0.25)
        >>> [s for s in range(1, 10) if every3.due(s, s)], quarter.plan(10), quarter.steps_between
        ([3, 6, 9], None, 2)
        >>> ValidationInterval(datetime.timedelta(minutes=30)).seconds
        1800.0
    """

    #: Seconds (``time.monotonic``) for a timedelta interval; a test may set a fake clock.
    clock = staticmethod(time.monotonic)

    def __init__(self, value: object):
        fix = (
            "pass an int (every N optimizer steps), a float in (0, 1] (a fraction of the epoch), e.g. 0.25, "
            "or a datetime.timedelta (training time)."
        )
        self.seconds: float | None = None
        self.value: Any
        self.run_steps: frozenset[int] | None = None  # a RunFraction: the global steps it validates after
        if isinstance(value, RunFraction):
            self.value, self.fraction, self.steps_between = value, False, 0
            return
        if isinstance(value, datetime.timedelta):
            if value.total_seconds() <= 0:
                raise ValueError(f"Expected a timedelta `validation_interval` > 0. Received: {value!r}. Fix: {fix}")
            self.value, self.fraction, self.steps_between = value, False, 0
            self.seconds = value.total_seconds()
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"Expected `validation_interval` to be an int, a float or a timedelta. Received: "
                f"validation_interval={value!r} of type {type(value).__name__}. Fix: {fix}"
            )
        check_number("validation_interval", value, positive=True, fix=fix)
        if isinstance(value, float) and value > 1:
            raise ValueError(
                f"Expected a float `validation_interval` in (0, 1]. Received: validation_interval={value!r}. Fix: {fix}"
            )
        self.value = value
        self.fraction = isinstance(value, float)
        self.steps_between = int(value) if not self.fraction else 0

    def plan(self, windows: int | None) -> None:
        """Fix a fraction's spacing from the optimizer steps per epoch (``ValueError`` if unknown)."""
        if not self.fraction:
            return None
        if windows is None:
            raise ValueError(
                f"validation_interval={self.value!r} is a fraction of the epoch, but the training data has no "
                "length, so the epoch's steps are unknown. Fix: pass an int validation_interval (every N "
                "optimizer steps), or `steps_per_epoch=`."
            )
        self.steps_between = max(1, int(self.value * windows))
        return None

    def plan_run(self, total: int | None) -> None:
        """A :class:`~fitkit.training.budget.RunFraction`'s steps from the run's planned steps
        (``ValueError`` if unknown, before step 1)."""
        if not isinstance(self.value, RunFraction):
            return
        if total is None:
            raise ValueError(
                f"validation_interval={self.value!r} is a fraction of the run, but this fit's planned step count is "
                "unknown (training data without a length and no max_steps). Fix: pass `max_steps=` or "
                "`steps_per_epoch=`, or an int validation_interval."
            )
        self.run_steps = self.value.steps(total)

    def due(self, global_step: int, step_in_epoch: int) -> bool:
        """Whether the optimizer step just done (``global_step``, the epoch's ``step_in_epoch``-th,
        1-based) is followed by a validation (a timedelta interval: see :class:`StepValidation`)."""
        if self.run_steps is not None:
            return global_step in self.run_steps
        if self.seconds is not None or not self.steps_between:
            return False
        counted = step_in_epoch if self.fraction else global_step
        return counted > 0 and counted % self.steps_between == 0


def record_validation(
    history: History, callbacks: CallbackList, step: int, epoch: int, val_logs: dict[str, float]
) -> dict[str, Any]:
    """Record a validation at ``global_step`` ``step`` in ``history.validations`` and fire
    ``on_validation_end`` with the record; returns the ``val_`` logs."""
    logs = {f"val_{k}": v for k, v in val_logs.items()}
    record: dict[str, Any] = {"epoch": epoch, "step": step, **logs}
    history.record_validation(record)
    callbacks.on_validation_end(record)
    return logs


class StepValidation:
    """The validations of one fit with ``validation_interval`` (one per ``fit`` call).

    Args:
        model: the :class:`~fitkit.Model` (its stepper's ``global_step`` and window).
        validation: the validation :class:`~fitkit.data.DeviceLoader`.
        callbacks: the fit's :class:`~fitkit.callbacks.base.CallbackList`.
        history: the fit's :class:`~fitkit.History` (its ``validations``).
        steps: batches per validation (``None``: all).
        interval: the :class:`ValidationInterval`.
    """

    def __init__(
        self,
        model: Model,
        validation: DeviceLoader | ValidationSets,
        callbacks: CallbackList,
        history: Callback,
        steps: int | None,
        interval: ValidationInterval,
    ):
        self.model, self.val, self.callbacks, self.steps = model, validation, callbacks, steps
        self.history = cast("History", history)  # the fit's History, found in the callback list by the loop
        self.interval = interval
        self.last_step = -1  # the global_step of the last validation (a vetoed step does not move it)
        self._since = interval.clock()  # a timedelta interval counts from here, and from each validation
        self.agreed: bool | None = None  # under torchrun: whether the ranks agreed a timedelta is due
        self.cut = False  # a signal cut the last validation short: a backup now asks the resume to run it

    def time_due(self) -> bool:
        """This rank's clock says a timedelta interval has passed (``False`` for other intervals)."""
        seconds = self.interval.seconds
        return seconds is not None and self.interval.clock() - self._since >= seconds

    def agree_by_ranks(self) -> None:
        """Under torchrun: a timedelta interval validates where the ranks agree it is due."""
        self.agreed = False

    def time_agreed(self) -> None:
        """The ranks agreed that the interval has passed on some rank: validate after the next step."""
        self.agreed = True

    def begin_epoch(self, batches: int | None, accumulation: int) -> None:
        """A fraction's spacing for this epoch of ``batches`` at ``accumulation``."""
        if self.interval.fraction and batches:
            self.interval.plan(math.ceil(batches / accumulation))

    def after_step(self, batches_done: int, epoch: int) -> None:
        """After an optimizer step: validate if it is due (``batches_done``: of ``epoch``)."""
        stepper = self.model._core.stepper
        step = stepper.global_step
        if step == self.last_step:
            return
        if self.interval.seconds is not None:  # training time
            if self.agreed is None:  # one process: its own clock
                due = self.time_due()
            else:  # the ranks agreed at the last agreement point that some rank's time had come
                due, self.agreed = self.agreed, False
            if due:
                self.run(epoch)
            return
        if self.interval.due(step, math.ceil(batches_done / stepper.accumulation)):
            self.run(epoch)

    def run(self, epoch: int) -> None:
        stepper = self.model._core.stepper
        self.last_step = stepper.global_step
        if self.model._core.parallel is not None:  # every rank validates with rank 0's BatchNorm statistics
            self.model._core.parallel.sync_buffers(self.model.module)
        rng = _checkpoint.rng_state()  # the training stream goes on as if nothing ran
        try:
            val_logs = run_validation(self.model, self.val, self.callbacks, self.steps)
        finally:
            _checkpoint.set_rng_state(rng)
        self.cut = signal_held(self.model)
        if self.cut:  # a signal cut it short: its partial values count nowhere, the resume runs it again
            return
        stepper.scheduling.step_on_validation(epoch, val_logs)  # a compiled ReduceLROnPlateau
        record_validation(self.history, self.callbacks, self.last_step, epoch, val_logs)
        self._since = self.interval.clock()

    def epoch_logs(self, epoch: int) -> dict[str, float] | None:
        """The ``val_`` values of ``epoch``'s last validation (the epoch logs'), if it had one."""
        for record in reversed(self.history.validations):
            if record["epoch"] == epoch:
                return {k: v for k, v in record.items() if k.startswith("val_")}
            if record["epoch"] < epoch:
                return None
        return None
