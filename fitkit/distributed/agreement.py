"""When the ranks agree that a SIGTERM / SIGINT stops training: by step count and by time.

Every rank must stop at the same optimizer step, so a signal received by one rank (or by
torchrun's agent, which forwards it to all) is acted on where the ranks next agree: one tiny
all-reduce, read on the host. Agreeing every step would add that read to every step; agreeing
every 8 steps makes a job with 5 s steps wait up to 40 s, past SLURM's default 30 s between
SIGTERM and SIGKILL. So the ranks agree after at most ``FITKIT_SIGNAL_STEPS`` (default 8)
optimizer steps **and** after about ``FITKIT_SIGNAL_SECONDS`` (default 2) seconds of
training: at each agreement every rank proposes how many steps fit in that time at the pace
it measured (the host clock, no device read), and the smallest proposal, agreed in the same
all-reduce, is the next interval. The first agreement comes after the first step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fitkit.distributed.group import _comm_device

__all__ = ["SignalAgreement", "signal_steps", "signal_seconds"]


def _env(name: str, default: float, kind: type) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = 0
    if not value > 0:
        raise ValueError(
            f"Expected {name} to be a positive {kind.__name__}. Received: {name}={text!r}. "
            f"Fix: unset it (default {default}) or set e.g. {name}={default}."
        )
    return value


def signal_steps() -> int:
    """Optimizer steps between two agreements at most (``FITKIT_SIGNAL_STEPS``, default 8)."""
    return int(_env("FITKIT_SIGNAL_STEPS", 8, int))


def signal_seconds() -> float:
    """About the most seconds between two agreements (``FITKIT_SIGNAL_SECONDS``, default 2)."""
    return float(_env("FITKIT_SIGNAL_SECONDS", 2.0, float))


class SignalAgreement:
    """Decides, after each optimizer step, whether the ranks agree now, and agrees.

    Every rank calls :meth:`after_step` after every optimizer step; the agreement points
    depend only on agreed numbers, so they are the same steps on every rank.

    Example:
        >>> a = SignalAgreement(every=8, seconds=2.0)
        >>> a.interval  # the first agreement comes after the first step
        1
    """

    def __init__(self, every: int | None = None, seconds: float | None = None):
        self.every = signal_steps() if every is None else every
        self.seconds = signal_seconds() if seconds is None else seconds
        self.interval = 1
        self.since = 0
        self.t0 = time.monotonic()
        self.stopped = False  # whether any rank asked to stop, at the last agreement
        self.dues: list[bool] = []  # per time trigger: whether it was due on any rank, at the last agreement

    def after_step(self, signalled_here: bool, stop_here: bool = False, dues_here: Sequence[bool] = ()) -> bool | None:
        """At an agreement point: whether any rank was signalled; ``None`` between them.

        ``stop_here`` (this rank's ``stop_training``) and ``dues_here`` (per time trigger, such
        as a timedelta ``validation_interval``: this rank's clock says it is due) ride in the
        same all-reduce: :attr:`stopped` and :attr:`dues` say whether any rank asked, at this point.
        """
        self.since += 1
        self.stopped, self.dues = False, [False] * len(dues_here)
        if self.since < self.interval:
            return None
        now = time.monotonic()
        pace = (now - self.t0) / self.since  # seconds per step, on this rank's host clock
        proposal = self.every if pace <= 0 else max(1, min(self.every, int(self.seconds / pace)))
        flags = torch.tensor(
            [int(signalled_here), int(stop_here), *(int(d) for d in dues_here), -proposal], dtype=torch.int64
        ).to(_comm_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # any signal, any stop, any due; the smallest proposal
        values = flags.tolist()  # one host read per agreement
        signalled, stopped, neg = values[0], values[1], values[-1]
        self.since, self.t0, self.interval, self.stopped = 0, now, -int(neg), bool(stopped)
        self.dues = [bool(d) for d in values[2:-1]]
        return bool(signalled)
