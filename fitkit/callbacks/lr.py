"""Learning-rate callbacks: ``LearningRateScheduler``, ``ReduceLROnPlateau`` (Keras) and
``LearningRateFinder`` (Lightning).

Both change ``optimizer.param_groups[i]["lr"]`` through :func:`_set_lr`, which also handles
the tensor learning rates of capturable / fused optimizers.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from fitkit.callbacks.base import Callback
from fitkit.callbacks.monitor import (
    StatefulCallback,
    check_validation_monitor,
    is_improvement,
    monitor_value,
    per_validation,
    resolve_mode,
)
from fitkit.checks import check_int, check_mode, check_number
from fitkit.checks.declared import Option, declare, declared, mode_option, verbose_option
from fitkit.distributed import say
from fitkit.formatting import format_lr
from fitkit.tools.lr_finder import LRFinderResult, apply_lr, check_sweep, sweep

__all__ = ["LearningRateScheduler", "ReduceLROnPlateau", "LearningRateFinder"]


def _set_lr(group: dict[str, Any], lr: float) -> None:
    if isinstance(group["lr"], torch.Tensor):  # capturable / fused optimizers keep a tensor
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


_REDUCE_LR_ON_PLATEAU_OPTIONS = declare(
    "ReduceLROnPlateau",
    Option("monitor", "text"),
    # >= 0 declared; < 1 checked in ReduceLROnPlateau.__init__ (an open bound)
    Option("factor", "number", minimum=0.0, bad=(1, 1.5)),
    Option("patience", "int", minimum=0),
    mode_option(),
    Option("min_delta", "number"),
    Option("cooldown", "int", minimum=0),
    Option("min_lr", "number", minimum=0.0),
    verbose_option(),
)


class ReduceLROnPlateau(StatefulCallback):
    """Multiply the learning rate by ``factor`` when ``monitor`` stops improving (Keras).

    After ``patience`` epochs without an improvement larger than ``min_delta``, each parameter
    group's learning rate becomes ``max(lr * factor, min_lr)``. The learning rates live in the
    optimizer, so a checkpoint carries them; this callback's own counters are in its
    ``state_dict``.

    ``cooldown`` follows Keras 3's rule exactly: a reduction at epoch ``e`` sets a counter to
    ``cooldown``; each later epoch first lowers the counter by one (and clears the wait), then
    counts towards ``patience`` unless the counter is still above 0. So ``cooldown=c`` leaves
    out the ``c - 1`` epochs after a reduction: ``cooldown=1`` skips no epoch (it acts as
    ``cooldown=0``), and without improvement the next reduction comes at epoch
    ``e + max(c, 1) + patience - 1``. An improvement during the cooldown still becomes the best.

    A NaN value is never the best: it counts as an epoch without improvement (as in Keras).
    On epochs that ``validation_freq`` leaves out, a ``val_`` monitor has no value and the
    epoch is skipped (see :attr:`fitkit.Model.validated`). With
    ``fit(validation_interval=...)`` and a ``val_`` monitor it decides at each validation
    (``on_validation_end``) instead, and ``patience`` / ``cooldown`` count validations.

    Args:
        monitor: the epoch log key to watch.
        factor: the multiplier, in ``[0, 1)``.
        patience: epochs without improvement before a reduction.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (see :func:`resolve_mode`).
        min_delta: the smallest change that counts as an improvement.
        cooldown: epochs after a reduction that do not count, plus one (Keras 3; see above).
        min_lr: the lower bound of the learning rate.
        verbose: 1 prints a line at each reduction.

    Raises:
        ValueError: ``factor`` not in ``[0, 1)``, bad arguments; at ``on_train_begin``, an
            unknown direction or a monitor the epoch logs will not hold (e.g. a ``val_`` key
            without validation data, see :func:`~fitkit.callbacks.logkeys.check_log_key`); a
            missing key at an epoch end.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1, bias=False), device="cpu")
        >>> model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss="mse")
        >>> x = torch.zeros(4, 1)  # the loss stays 0: no improvement after epoch 0
        >>> reduce = ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1)
        >>> model.fit(x, x, epochs=4, callbacks=[reduce], verbose=0).history["learning_rate"]
        [1.0, 1.0, 0.5, 0.25]
    """

    @declared(_REDUCE_LR_ON_PLATEAU_OPTIONS)
    def __init__(
        self,
        monitor: str = "val_loss",
        factor: float = 0.1,
        patience: int = 10,
        mode: str = "auto",
        min_delta: float = 1e-4,
        cooldown: int = 0,
        min_lr: float = 0.0,
        verbose: int = 0,
    ):
        super().__init__()
        if not isinstance(monitor, str):
            raise TypeError(f"Expected `monitor` to be a log key (str). Received: monitor={monitor!r}.")
        check_number("factor", factor, minimum=0.0)
        if not factor < 1.0:
            raise ValueError(
                f"Expected `factor` in [0, 1): it multiplies the learning rate. Received: factor={factor!r}."
            )
        check_int("patience", patience, 0)
        check_mode(mode)
        check_number("min_delta", min_delta, minimum=-math.inf)
        check_int("cooldown", cooldown, 0)
        check_number("min_lr", min_lr, minimum=0.0)
        self.monitor, self.factor, self.patience, self.mode = monitor, float(factor), patience, mode
        self.min_delta, self.cooldown, self.min_lr = abs(min_delta), cooldown, float(min_lr)
        self.verbose = verbose
        self._mode = mode if mode != "auto" else None
        self._reset()

    def _reset(self) -> None:
        self.best: float | None = None
        self.wait = 0
        self.cooldown_counter = 0

    def _get_state(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "cooldown_counter": self.cooldown_counter}

    def _set_state(self, state: dict[str, Any]) -> None:
        self.best, self.wait, self.cooldown_counter = state["best"], state["wait"], state["cooldown_counter"]

    def _state_problems(self, state: Any) -> list[str]:
        from fitkit.files.content import is_count, is_score, typed_problems

        return typed_problems(
            state,
            {
                "best": (lambda v: v is None or is_score(v), "a number or None (not NaN)"),
                "wait": (is_count, "an int >= 0"),
                "cooldown_counter": (is_count, "an int >= 0"),
            },
            "its state",
        )

    def on_train_begin(self, logs=None):
        check_validation_monitor(self.monitor, self.params, "ReduceLROnPlateau", self.model)
        self._mode = resolve_mode(self.monitor, self.mode, self.model, "ReduceLROnPlateau")
        super().on_train_begin(logs)

    def on_epoch_end(self, epoch, logs=None):
        if not per_validation(self):  # else decided at each validation
            self._decide(epoch, logs)

    def on_validation_end(self, logs=None):
        if per_validation(self):
            self._decide(self.model.epoch, logs)

    def _decide(self, epoch: int, logs: Any) -> None:
        current = monitor_value(logs, self.monitor, "ReduceLROnPlateau", self.params, self.model)
        if current is None:
            return
        if self._mode is None:  # hooks called directly, without on_train_begin
            self._mode = resolve_mode(self.monitor, self.mode, self.model, "ReduceLROnPlateau")
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        # NaN is never the best (is_improvement says no to it, and so does the first value).
        if not math.isnan(current) and (
            self.best is None or is_improvement(current, self.best, self._mode, self.min_delta)
        ):
            self.best, self.wait = current, 0
            return
        if self.cooldown_counter > 0:
            return
        self.wait += 1
        if self.wait < self.patience:
            return
        reduced = False
        for group in self.model.optimizer.param_groups:
            old = float(group["lr"])
            if old > self.min_lr:
                _set_lr(group, max(old * self.factor, self.min_lr))
                reduced = True
        if reduced:
            lr = float(self.model.optimizer.param_groups[0]["lr"])
            say(self.verbose, f"Epoch {epoch + 1}: ReduceLROnPlateau reduced the learning rate to {format_lr(lr)}.")
            self.cooldown_counter, self.wait = self.cooldown, 0


_LEARNING_RATE_SCHEDULER_OPTIONS = declare(
    "LearningRateScheduler",
    Option("schedule", "callable"),
    verbose_option(),
)


class LearningRateScheduler(StatefulCallback):
    """Set the learning rate at the start of each epoch: ``lr = schedule(epoch, lr)`` (Keras).

    ``epoch`` is 0-based and ``lr`` the current learning rate; with several parameter groups
    the schedule is applied to each group's own rate. The new rate is the one
    ``history["learning_rate"]`` records for that epoch. The rates live in the optimizer,
    so a checkpoint carries them; a resume inside an epoch applies the schedule to the rates
    that epoch started from (kept in ``state_dict``), never twice.

    Args:
        schedule: ``(epoch: int, lr: float) -> float`` (a one-argument ``schedule(epoch)``
            works too).
        verbose: 1 prints the rate set at each epoch.

    Raises:
        TypeError: ``schedule`` is not callable, or returns something that is not a number.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss="mse")
        >>> halve = LearningRateScheduler(lambda epoch, lr: lr if epoch == 0 else lr / 2)
        >>> x = torch.zeros(4, 1)
        >>> model.fit(x, x, epochs=3, callbacks=[halve], verbose=0).history["learning_rate"]
        [1.0, 0.5, 0.25]
    """

    @declared(_LEARNING_RATE_SCHEDULER_OPTIONS)
    def __init__(self, schedule: Callable[..., float], verbose: int = 0):
        super().__init__()
        self._reset()
        if not callable(schedule):
            raise TypeError(f"Expected `schedule` to be a function (epoch, lr) -> lr. Received: {schedule!r}.")
        self.schedule, self.verbose = schedule, verbose
        try:
            params = inspect.signature(schedule).parameters.values()
            positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            self._two_args = len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)
        except (TypeError, ValueError):  # builtins without a signature
            self._two_args = True

    def _reset(self) -> None:
        self._epoch = -1  # the epoch begun last
        self._before: list[Any] = []  # and the rates it started from

    def _get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "lrs_before": list(self._before)}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._epoch, self._before = state["epoch"], list(state["lrs_before"])

    def _state_problems(self, state: Any) -> list[str]:
        from fitkit.files.content import is_count, is_number, typed_problems

        epoch = (lambda v: v == -1 or is_count(v), "an int >= -1")
        lrs = (
            lambda v: isinstance(v, list) and all(is_number(x) and 0 <= x < float("inf") for x in v),
            "a list of numbers (finite, >= 0)",
        )
        out = typed_problems(state, {"epoch": epoch, "lrs_before": lrs}, "its state")
        model = getattr(self, "model", None)
        groups = None if model is None or model.optimizer is None else len(model.optimizer.param_groups)
        if not out and state["epoch"] >= 0 and groups is not None and len(state["lrs_before"]) != groups:
            # a resume inside the epoch schedules from these rates: others would schedule it twice
            out.append(
                f"its state['lrs_before'] holds {len(state['lrs_before'])} rate(s), expected one per "
                f"parameter group ({groups})"
            )
        return out

    def on_epoch_begin(self, epoch, logs=None):
        groups = self.model.optimizer.param_groups
        if epoch != self._epoch or len(self._before) != len(groups):
            self._before = [float(g["lr"]) for g in groups]
        self._epoch = epoch  # a resume inside this epoch starts again from self._before
        for group, old in zip(groups, self._before, strict=True):
            lr = self.schedule(epoch, old) if self._two_args else self.schedule(epoch)
            if isinstance(lr, torch.Tensor) and lr.numel() == 1:
                lr = lr.item()
            if isinstance(lr, bool) or not isinstance(lr, (int, float)):
                raise TypeError(f"`schedule` must return a number. Received: {lr!r} at epoch {epoch}.")
            if not math.isfinite(lr) or lr < 0:
                raise ValueError(
                    f"`schedule` must return a finite learning rate >= 0. Received: {lr!r} at epoch {epoch}. "
                    "Fix: a negative rate would climb the loss; return a positive number."
                )
            _set_lr(group, float(lr))
        lr = float(groups[0]["lr"])
        say(self.verbose, f"Epoch {epoch + 1}: LearningRateScheduler set the learning rate to {format_lr(lr)}.")


_LEARNING_RATE_FINDER_OPTIONS = declare(
    "LearningRateFinder",
    Option("start_lr", "number", positive=True),
    Option("end_lr", "number", positive=True),
    Option("num_steps", "int", minimum=2),
    Option("smooth", "number", minimum=0.0, bad=(1.0,)),
    Option("diverge_threshold", "custom", checked_in="fitkit.tools.lr_finder.check_sweep", bad=(1, 0.5, "4")),
    Option("mode", "choice", choices=("exponential", "linear")),
    verbose_option(),
)


class LearningRateFinder(Callback):
    """Run the LR range test when ``fit`` starts and train with its suggestion (Lightning's).

    At ``on_train_begin`` it sweeps the learning rate over the training batches of this
    ``fit`` (:func:`fitkit.tools.lr_finder.sweep`, the sweep of :func:`fitkit.tools.lr_finder.find_lr`),
    puts everything back (weights, optimizer state, scheduler, step count, RNG states: the
    model is bit for bit as before), sets the suggestion as the learning rate
    (:func:`fitkit.tools.lr_finder.apply_lr`: every parameter group, their ratios kept, the
    scheduler's ``base_lrs`` too), then training starts. A resumed ``fit`` (``global_step >
    0``, a loaded checkpoint, or a ``BackupAndRestore`` with a backup to resume from: the
    checkpoint holds the rate found before) skips the sweep.

    Args:
        start_lr, end_lr, num_steps, smooth, diverge_threshold, mode: as for
            :func:`fitkit.tools.lr_finder.find_lr`.
        verbose: 1 prints the rate it sets.

    Attributes:
        result: the :class:`~fitkit.tools.lr_finder.LRFinderResult` of the last sweep (``None``
            before it).

    Raises:
        TypeError, ValueError: bad arguments, as :func:`fitkit.tools.lr_finder.find_lr` raises them.

    Example:
        >>> import torch, fitkit
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(64, 4); y = x @ torch.ones(4, 1)
        >>> model = fitkit.Model(torch.nn.Linear(4, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> finder = LearningRateFinder(start_lr=1e-4, end_lr=1.0, num_steps=20)
        >>> _ = model.fit(x, y, batch_size=16, epochs=1, callbacks=[finder], verbose=0)
        >>> model.optimizer.param_groups[0]["lr"] == finder.result.suggestion
        True
    """

    skip_in_fast_dev_run = True  # it tunes before training: fit(fast_dev_run=...) leaves it out

    @declared(_LEARNING_RATE_FINDER_OPTIONS)
    def __init__(
        self,
        start_lr: float = 1e-7,
        end_lr: float = 10.0,
        num_steps: int = 100,
        smooth: float = 0.98,
        diverge_threshold: float | None = 4.0,
        mode: str = "exponential",
        verbose: int = 0,
    ):
        super().__init__()
        check_sweep(None, start_lr, end_lr, num_steps, smooth, diverge_threshold, mode, False)
        self.start_lr, self.end_lr, self.num_steps, self.smooth = start_lr, end_lr, num_steps, smooth
        self.diverge_threshold, self.mode, self.verbose = diverge_threshold, mode, verbose
        self.result: LRFinderResult | None = None

    def on_train_begin(self, logs=None):
        model = self.model
        if _resuming(model):
            return  # resumed: the optimizer's learning rate is the one found before
        data = self.params.get("train_data")
        if data is None:
            raise ValueError("LearningRateFinder sweeps the training data of `fit`; it runs only inside `fit`.")
        self.result = sweep(
            model, data, self.start_lr, self.end_lr, self.num_steps, self.smooth, self.diverge_threshold, self.mode
        )
        if apply_lr(model, self.result.suggestion):
            say(self.verbose, f"LearningRateFinder: learning rate set to {format_lr(self.result.suggestion)}.")


def _resuming(model: Any) -> bool:
    """Whether this fit continues a run: steps taken, a checkpoint loaded, or a backup to load."""
    if model.global_step > 0:  # a loaded checkpoint restored its step count too
        return True
    backups = [cb for cb in model.callbacks if cb.is_backup]
    return any(cb.path.is_file() or cb.prev_path.is_file() for cb in backups)
