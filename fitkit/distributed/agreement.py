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

**One agreed sequence.** Every agreement, and the metric sync at an epoch's end, begins with
the same small all-reduce (:func:`agree`): a header of what this rank does next (the signal
agreement after a step, the epoch's metric sync, the epoch-end stop agreement), its epoch, the
batches it has done in it and a detail (the metrics it will sync), sent as the values and their negatives
so that one MAX gives every field's largest and smallest value over the ranks. Ranks that
reached different places pair their headers (same size, same op) instead of waiting in
different collectives for the process group's timeout: every rank sees the difference in the
same result, gathers the headers (on this path only) and raises a ``RuntimeError`` naming each
rank's place. The flags a header carries (a signal, a stop, the time triggers) ride along.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from fitkit.distributed.group import _comm_device

__all__ = [
    "SignalAgreement",
    "signal_steps",
    "signal_seconds",
    "signal_grace",
    "agree",
    "RankMismatch",
    "flag_slots",
    "describe",
    "mismatch",
    "STEP",
    "METRICS",
    "STOP",
]

#: What a rank does next where the ranks agree: a header's first field.
STEP, METRICS, STOP = 1, 2, 3
_HEAD = 4  # what comes next, the epoch, the epoch's batches done, a detail
FLAGS = 8  # the flag slots of a header, at least (the same on every rank: a fit's triggers decide)


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


def signal_grace() -> float:
    """Seconds a rank may take, after a SIGTERM / SIGINT, to reach the point where the ranks agree
    on it (``FITKIT_SIGNAL_GRACE``); see :func:`fitkit.training.signals.watchdog`. By default 10 s
    less than torchrun waits for its workers when ``PET_SHUTDOWN_TIMEOUT`` says so, else 20 s
    (torchrun, SLURM and Kubernetes wait 30 s before they kill); 20 s at least.

    Example:
        >>> signal_grace() >= 20 or "FITKIT_SIGNAL_GRACE" in os.environ
        True
    """
    default = 20.0
    with contextlib.suppress(ValueError):
        default = max(default, float(os.environ.get("PET_SHUTDOWN_TIMEOUT") or 0) - 10)
    return float(_env("FITKIT_SIGNAL_GRACE", default, float))


class SignalAgreement:
    """Decides, after each optimizer step, whether the ranks agree now, and agrees.

    Every rank calls :meth:`after_step` after every optimizer step; the agreement points
    depend only on agreed numbers, so they are the same steps on every rank.

    Example:
        >>> a = SignalAgreement(every=8, seconds=2.0)
        >>> a.interval  # the first agreement comes after the first step
        1
    """

    def __init__(
        self,
        every: int | None = None,
        seconds: float | None = None,
        where: Callable[[], tuple[int, int]] | None = None,
        slots: int = FLAGS,
    ):
        self.every = signal_steps() if every is None else every
        self.where = where  # (epoch, batches done in it) of this rank: the header's place
        self.slots = slots
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
        epoch, batches = self.where() if self.where is not None else (0, 0)
        flags = [int(signalled_here), int(stop_here), *(int(d) for d in dues_here), -proposal]
        # any signal, any stop, any due; the smallest proposal (one all-reduce, one host read)
        values = agree((STEP, epoch, batches, 0), flags, max(self.slots, len(flags)))
        signalled, stopped, neg = values[0], values[1], values[-1]
        self.since, self.t0, self.interval, self.stopped = 0, now, -int(neg), bool(stopped)
        self.dues = [bool(d) for d in values[2:-1]]
        return bool(signalled)


def flag_slots(triggers: int) -> int:
    """The flag slots of every header of a fit with ``triggers`` time triggers (the signal
    agreement's are a signal, a stop, each trigger and the next interval)."""
    return max(FLAGS, 3 + triggers)


class RankMismatch(RuntimeError):
    """Ranks at different collectives (:func:`agree`). Nothing that needs every rank can follow
    it, so ``fit`` writes no checkpoint on it (``save_on_exception``): the last one stays."""


def agree(place: Sequence[int], flags: Sequence[int] = (), slots: int = FLAGS) -> list[int]:
    """``flags``' largest values over the ranks, once every rank is at ``place``.

    One all-reduce (MAX) of ``slots`` flags and the header ``place``: ``(what, epoch, batches
    done in it, detail)``, ``what`` one of :data:`STEP`, :data:`METRICS`, :data:`STOP` (host
    counts only: reading ``global_step`` may sync after steps skipped on the device). Negate a
    flag to get its smallest value.

    Raises:
        RankMismatch: (a ``RuntimeError``) the ranks are at different places (every rank raises
            it, naming each rank's place; one gather of the headers first, on this path only).
    """
    head = [int(v) for v in place]
    values = [*head, *(-v for v in head), *(int(f) for f in flags)]
    values += [0] * (2 * _HEAD + slots - len(values))
    t = torch.tensor(values, dtype=torch.int64).to(_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out = t.tolist()  # one host read
    if out[:_HEAD] != [-v for v in out[_HEAD : 2 * _HEAD]]:  # the largest and smallest differ
        rows = [torch.zeros(_HEAD, dtype=torch.int64, device=t.device) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, torch.tensor(head, dtype=torch.int64, device=t.device))
        raise RankMismatch(mismatch([r.tolist() for r in rows]))
    return out[2 * _HEAD : 2 * _HEAD + len(flags)]


def describe(place: Sequence[int]) -> str:
    """A header's place in words.

    Example:
        >>> describe([METRICS, 1, 12, 2])
        "epoch 1, the metric sync at the epoch's end (2 metrics), after 12 batches"
    """
    what, epoch, batches, detail = place
    names = {
        STEP: "the signal agreement after an optimizer step",
        METRICS: f"the metric sync at the epoch's end ({detail} metric{'' if detail == 1 else 's'})",
        STOP: "the stop agreement at the epoch's end (after its callbacks)",
    }
    done = f"{batches} batch{'' if batches == 1 else 'es'}"
    return f"epoch {epoch}, {names.get(what, f'an unknown collective ({what})')}, after {done}"


def mismatch(places: Sequence[Sequence[int]]) -> str:
    """The error of ranks at different places (``places[r]``: rank ``r``'s header).

    Example:
        >>> text = mismatch([[METRICS, 0, 6, 1], [STOP, 0, 6, 0]])
        >>> "Rank(s) 1 differ from rank 0" in text, "; rank 1: epoch 0, the stop agreement at" in text
        (True, True)
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, p in enumerate(places):
        groups.setdefault(tuple(p), []).append(r)
    odd = [r for r, p in enumerate(places) if list(p) != list(places[0])]
    where = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {describe(p)}" for p, rs in groups.items()
    )
    return (
        "fitkit: the ranks reached different collectives, where each would wait for the others until the process "
        f"group's timeout. Expected every rank at the same one. Received: {where}. Rank(s) "
        f"{', '.join(map(str, odd))} differ from rank 0; every rank raises this error. Fix: run the same "
        "collectives on every rank in the same order: no collective (a metric's compute, evaluate(), a sync) "
        "inside `if rank() == 0:` or in a callback that acts on some ranks only, and a run's state restored on "
        "every rank alike."
    )
