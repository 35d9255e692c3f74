"""``Timer``: stop training once a time budget is spent (Lightning's ``Timer`` / ``max_time``).

The budget counts training time: from ``on_train_begin`` of each ``fit``, plus what a resumed
run's checkpoint says was spent before (the elapsed time is the callback's state), so a job
resumed after a preemption stops when the whole run has used its budget, not the last piece.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable
from typing import Any

from fitkit.callbacks.monitor import StatefulCallback
from fitkit.checks import check_number, read_clock
from fitkit.checks.declared import Option, declare, declared

__all__ = ["Timer", "parse_duration"]


def parse_duration(duration: Any) -> float:
    """Seconds of a duration: a number of seconds, a ``datetime.timedelta``, a dict of
    ``timedelta``'s keywords, or Lightning's ``"DD:HH:MM:SS"`` string.

    Raises:
        TypeError, ValueError: anything else, or a duration that is not > 0.

    Example:
        >>> parse_duration("00:01:30:00"), parse_duration({"minutes": 2}), parse_duration(45)
        (5400.0, 120.0, 45.0)
    """
    if isinstance(duration, datetime.timedelta):
        seconds = duration.total_seconds()
    elif isinstance(duration, dict):
        try:
            seconds = datetime.timedelta(**duration).total_seconds()
        except TypeError as e:
            raise TypeError(
                f"Expected `duration` as timedelta keywords, e.g. {{'hours': 1}}. Received {duration!r}: {e}."
            ) from None
    elif isinstance(duration, str):
        parts = duration.split(":")
        if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(
                f"Expected `duration` as 'DD:HH:MM:SS' (Lightning's form). Received: {duration!r}. "
                "Fix: e.g. '00:12:00:00' for 12 hours."
            )
        d, h, m, s = (int(p) for p in parts)
        seconds = float(((d * 24 + h) * 60 + m) * 60 + s)
    else:
        check_number(
            "duration", duration, positive=True, fix="pass seconds, a timedelta, {'hours': 1} or 'DD:HH:MM:SS'."
        )
        seconds = float(duration)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"Expected `duration` > 0. Received: {duration!r}. Fix: pass a positive duration.")
    return float(seconds)


_TIMER_OPTIONS = declare(
    "Timer",
    Option("duration", "custom", check=parse_duration, bad=(-1, 0, "soon", None, float("nan"))),
    Option("interval", "choice", choices=("step", "epoch")),
    Option("clock", "callable", bad=(lambda: "now",)),
)


class Timer(StatefulCallback):
    """Stop ``fit`` once ``duration`` of training time is spent (Lightning's ``Timer``).

    Checked after each training batch (``interval="step"``) or at each epoch end
    (``"epoch"``); training then stops as ``EarlyStopping`` stops it (``model.stop_training``),
    the epoch ending with its logs and validation. Under torchrun the first rank past the budget
    stops every rank at the same step (fitkit's stop agreement). The elapsed time is the
    callback's state, in checkpoints: a resumed run counts the time already spent.

    Args:
        duration: seconds, a ``datetime.timedelta``, a dict of its keywords or ``"DD:HH:MM:SS"``.
        interval: ``"step"`` or ``"epoch"``.
        clock: seconds as a float (``time.monotonic``; a fake clock in tests).

    Attributes:
        stopped: whether the budget stopped training (``elapsed``: the seconds spent).

    Example:
        >>> import torch, fitkit
        >>> ticks = iter(range(100))
        >>> timer = Timer(duration=3, clock=lambda: float(next(ticks)))  # 1 s per tick
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu"); model.compile(optimizer="sgd", loss="mse")
        >>> model.fit(torch.zeros(8, 1), torch.zeros(8, 1), batch_size=1, epochs=5, verbose=0,
        ...           callbacks=[timer]).epoch, model.global_step, timer.stopped
        ([0], 3, True)
    """

    @declared(_TIMER_OPTIONS)
    def __init__(self, duration: Any, interval: str = "step", clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.duration = parse_duration(duration)
        if interval not in ("step", "epoch"):
            raise ValueError(f"Expected `interval` 'step' or 'epoch'. Received: interval={interval!r}.")
        if not callable(clock):
            raise TypeError(f"Expected `clock` to be a callable returning seconds. Received: {clock!r}.")
        self.interval, self.clock = interval, clock
        self._reset()

    def _reset(self) -> None:
        self._before = 0.0  # seconds spent before this fit (a checkpoint's, or earlier fits')
        self._start: float | None = None
        self.stopped = False

    @property
    def elapsed(self) -> float:
        """Training seconds spent so far."""
        return self._before + (0.0 if self._start is None else read_clock(self.clock) - self._start)

    def _get_state(self) -> dict[str, Any]:
        return {"elapsed": self.elapsed}

    def _state_problems(self, state: Any) -> list[str]:
        """A saved state's ``elapsed``: finite seconds >= 0 (checked before any part loads)."""
        from fitkit.files.content import is_number, typed_problems

        seconds = (lambda v: is_number(v) and math.isfinite(v) and v >= 0, "seconds: a finite number >= 0")
        return typed_problems(state, {"elapsed": seconds}, "its state")

    def _set_state(self, state: dict[str, Any]) -> None:
        # Restored inside a running fit (BackupAndRestore loads at its on_train_begin, which may
        # come after this callback's): the clock of this fit restarts from the restore.
        self._before = float(state["elapsed"])
        self._start = None if self._start is None else read_clock(self.clock)

    def on_train_begin(self, logs=None):
        before = self._before if self._restored else 0.0
        super().on_train_begin(logs)
        self._before, self.stopped = before, False
        self._start = read_clock(self.clock)

    def _check(self) -> None:
        if self.elapsed >= self.duration:
            self.stopped = True
            self.model.stop_training = True

    def on_train_batch_end(self, batch, logs=None):
        if self.interval == "step":
            self._check()

    def on_epoch_end(self, epoch, logs=None):
        self._check()

    def on_train_end(self, logs=None):
        self._before, self._start = self.elapsed, None
