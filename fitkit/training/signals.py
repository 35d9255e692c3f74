"""SIGTERM and Ctrl-C during ``fit``: finish the step, save, close, then exit or re-raise.

Schedulers, preemptible clouds and SLURM send SIGTERM before they kill a job; people press
Ctrl-C. While ``fit`` runs in the main thread, :func:`deferred` holds the first such signal until
the current optimizer step is done; the loop then writes a backup (when a ``BackupAndRestore``
is in the callbacks), runs ``on_train_end``, restores the modes, and ends the way the signal
asks: ``SystemExit(128 + 15)`` for SIGTERM (status 143, as a killed process), and
``KeyboardInterrupt`` for SIGINT. A second signal while the first is handled acts at once,
except a SIGTERM repeated within :data:`REPEAT_GRACE` seconds of the first: SLURM signals every
process of a job, and torchrun forwards its own SIGTERM to its workers, so each worker gets the
same request twice within moments (Kubernetes signals only a container's main process, torchrun,
so there it comes once); the repeat is that request, not an "exit now", and the stop backup is
still written. The previous handlers come back when ``fit`` returns.

Under torchrun every rank must run the same steps, so a stop or a signal on one rank takes
effect where the ranks agree (:class:`RankAgreement`): after at most ``AGREE_EVERY`` optimizer
steps and about every 2 seconds
for a signal and a stop, also after ``on_backward_end`` when a callback uses that hook and
may veto on the host (the stepper agrees there; not for ``Callback.device_veto_only``
callbacks such as ``TerminateOnNaN``), and at every epoch end for both. A rank that cannot
get there (it waits in a collective for a peer in a long callback) is ended by :func:`watchdog`
``FITKIT_SIGNAL_GRACE`` seconds after the signal, with a line naming where every rank was.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from fitkit.distributed.agreement import METRICS, STOP, SignalAgreement, agree, flag_slots, signal_grace
from fitkit.distributed.group import rank
from fitkit.distributed.progress import peer_failed, where_ranks_were

__all__ = ["Interrupt", "deferred", "watchdog", "RankAgreement", "AGREE_EVERY", "REPEAT_GRACE"]

#: Seconds after a first SIGTERM within which another SIGTERM is the same request (the direct
#: signal and torchrun's forwarded copy), not an "exit now".
REPEAT_GRACE = 10.0

#: Under torchrun, the ranks agree on a SIGTERM / SIGINT every this many optimizer steps.
AGREE_EVERY = 8  # the default of FITKIT_SIGNAL_STEPS (fitkit.distributed.agreement)


class Interrupt:
    """The signal received during ``fit`` (``signum``), or ``None``."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None  # time.monotonic() of the signal

    def raise_now(self) -> None:
        """End the way the received signal asks (call after cleaning up)."""
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + int(self.signum or signal.SIGTERM))


@contextlib.contextmanager
def deferred(enabled: bool = True, clock: Callable[[], float] = time.monotonic) -> Iterator[Interrupt]:
    """Hold SIGTERM / SIGINT in an :class:`Interrupt` while the body runs (main thread only).

    A second signal acts at once (the previous handler, or the exit it stands for), but for a
    SIGTERM that repeats a first SIGTERM within :data:`REPEAT_GRACE` seconds (of ``clock``).

    Example:
        >>> with deferred() as interrupt:
        ...     interrupt.signum is None
        True
    """
    state = Interrupt()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield state
        return
    previous: dict[Any, Any] = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        now = clock()
        if state.signum == signal.SIGTERM == signum and state.at is not None and now - state.at < REPEAT_GRACE:
            return  # the same request again (signalled directly and forwarded by torchrun)
        if state.signum is not None or (signum == signal.SIGTERM and peer_failed()):
            # A second signal acts at once, as without fitkit; so does torchrun's SIGTERM after
            # another rank failed (no step can finish: the collectives are broken).
            old = previous.get(signum)
            if callable(old):
                old(signum, frame)
                return
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        state.signum, state.at = signum, now

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):  # not allowed here (an embedded interpreter)
            pass
    try:
        yield state
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def watchdog(acted: Callable[[], bool], enabled: bool = True, grace: float | None = None) -> Iterator[None]:
    """End this process ``grace`` seconds after a SIGTERM / SIGINT that the fit has not acted on.

    Under torchrun a signal is acted on where the ranks next agree. A rank that waits in a
    collective (its peers are in a long callback, a slow step, or gone) cannot get there, and
    Python runs no signal handler while a collective waits in C++. So while the body runs (inside
    :func:`deferred`, in the main thread), a thread hears each signal at once through
    :func:`signal.set_wakeup_fd` (written by the interpreter's C-level handler whatever the main
    thread does). When ``acted()`` is still false ``grace`` seconds (``FITKIT_SIGNAL_GRACE``,
    default 20) after the first one, it writes one line to standard error (the signal, this rank,
    where every rank was) and ends the process with status ``128 + signum`` (143 for SIGTERM),
    without the stop backup: the last backup stays the resume point. Nothing when ``enabled`` is
    false, outside the main thread, or when the wakeup fd is taken (an event loop's).

    Args:
        acted: whether the fit has acted on the signal (its stop and backup under way): asked
            from the thread, once the grace has passed.
        enabled: whether to watch (a fit under torchrun).
        grace: seconds; ``None``: :func:`~fitkit.distributed.agreement.signal_grace`.

    Example:
        >>> with deferred(), watchdog(lambda: False, grace=30):
        ...     pass  # no signal: nothing happens
    """
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    grace = signal_grace() if grace is None else grace
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        old: int | None = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except (ValueError, OSError):
        old = None
    if old != -1:  # not set, or another owner's (an event loop's): theirs is put back
        if old is not None:
            signal.set_wakeup_fd(old)
        for fd in (read, write):
            os.close(fd)
        yield
        return
    done = threading.Event()
    thread = threading.Thread(target=_watch, args=(read, done, acted, grace), name="fitkit-signal-grace", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(-1)
        os.write(write, b"\0")  # wakes the thread: it sees `done`
        thread.join(timeout=5)
        for fd in (read, write):
            os.close(fd)


def _watch(fd: int, done: threading.Event, acted: Callable[[], bool], grace: float) -> None:
    """:func:`watchdog`'s thread: the first SIGTERM / SIGINT read from ``fd`` starts the clock."""
    first: tuple[int, float] | None = None
    while not done.is_set():
        wait = None if first is None else max(0.0, first[1] + grace - time.monotonic())
        if select.select([fd], [], [], wait)[0]:
            for byte in os.read(fd, 64):
                if first is None and byte in (signal.SIGTERM, signal.SIGINT):
                    first = (byte, time.monotonic())
            continue
        if done.is_set() or first is None or acted():
            return  # the fit ended, or acts on the signal: its stop backup and exit follow
        _exit_waiting(first[0], grace)


def _exit_waiting(signum: int, grace: float) -> None:
    """The watchdog's end: one line on standard error, then the process exits at once."""
    where = where_ranks_were()
    print(
        f"fitkit: {signal.Signals(signum).name} received {grace:g} s ago, but rank {rank()} could not reach a "
        "step where the ranks agree to stop: it waits for another rank (in a collective) or runs a long step "
        f"or callback. Exiting with status {128 + signum} without a stop backup (FITKIT_SIGNAL_GRACE={grace:g}); "
        "the last backup stays the resume point." + (f"\n{where}" if where else ""),
        file=sys.stderr,
        flush=True,
    )
    with contextlib.suppress(Exception):  # what the script printed stays (os._exit flushes nothing)
        sys.stdout.flush()
    os._exit(128 + signum)


class RankAgreement:
    """Where the ranks of a torchrun ``fit`` agree to stop (one process: at once, alone).

    Args:
        interrupt: the fit's :class:`Interrupt` (a signal to another rank is recorded in it
            as a SIGTERM, so this rank stops and saves the same way).
        distributed: whether the fit runs under torchrun (else every answer is local).
        triggers: objects with ``time_due()`` / ``time_agreed()`` (see :attr:`triggers`).
        where: ``() -> (epoch, batches done in it)`` of this rank, sent with every agreement: ranks
            at different places raise a ``RuntimeError`` naming them
            (:func:`fitkit.distributed.agreement.agree`).

    Example:
        >>> agree = RankAgreement(Interrupt(), distributed=False)
        >>> agree.at_step_boundary(), agree.at_epoch_end(stop_training=True)
        (False, True)
    """

    def __init__(
        self,
        interrupt: Interrupt,
        distributed: bool,
        triggers: list[Any] | None = None,
        where: Callable[[], tuple[int, int]] | None = None,
    ):
        self.interrupt, self.distributed = interrupt, distributed
        self.where = where or (lambda: (0, 0))
        self._schedule: SignalAgreement | None = None  # made at the first step (reads the settings)
        self.stop_agreed = False  # a rank's stop_training, agreed at the last step boundary
        #: The fit's time triggers (a timedelta validation_interval, ModelCheckpoint's
        #: train_time_interval): each one's ``time_due()`` (this rank's clock) is asked at each
        #: agreement point, and ``time_agreed()`` is called on those due on any rank.
        self.triggers: list[Any] = list(triggers or [])

    def at_step_boundary(self, stop_training: bool = False) -> bool:
        """Whether a SIGTERM / SIGINT stops training after this optimizer step.

        ``stop_training`` (this rank's) is agreed in the same all-reduce: :attr:`stop_agreed`
        tells whether any rank asked to stop (at an agreement point; else ``False``).

        Under torchrun the ranks agree (one tiny all-reduce) after at most ``AGREE_EVERY``
        optimizer steps and about every 2 seconds (:mod:`fitkit.distributed.agreement`:
        ``FITKIT_SIGNAL_STEPS``, ``FITKIT_SIGNAL_SECONDS``), and at the latest at the end of
        the epoch.
        """
        local = self.interrupt.signum is not None
        if not self.distributed:
            self.stop_agreed = bool(stop_training)
            return local
        if self._schedule is None:
            self._schedule = SignalAgreement(where=self.where, slots=flag_slots(len(self.triggers)))
        triggers = self.triggers
        agreed = self._schedule.after_step(local, bool(stop_training), [bool(t.time_due()) for t in triggers])
        self.stop_agreed = self._schedule.stopped
        for trigger, due in zip(triggers, self._schedule.dues, strict=True):
            if due:
                trigger.time_agreed()
        if agreed is None:  # between agreements: every rank goes on
            return False
        if agreed and not local:
            self.interrupt.signum = signal.SIGTERM  # another rank was signalled: stop with it
        return self.interrupt.signum is not None

    def at_epoch_end(self, stop_training: bool) -> bool:
        """Whether training stops after this epoch: any rank's stop (or signal) holds for all."""
        if not self.distributed:
            return stop_training
        flags = [int(stop_training), int(self.interrupt.signum is not None)]
        agreed = agree((STOP, *self.where(), 0), flags, flag_slots(len(self.triggers)))
        if agreed[1] and self.interrupt.signum is None:
            self.interrupt.signum = signal.SIGTERM  # another rank was signalled: stop with it
        return bool(agreed[0])

    def at_metric_sync(self, metrics: int) -> None:
        """Before the epoch's metric sync (its loss totals and ``metrics`` metrics): every rank is
        there, with as many metrics to sync, or every rank raises a ``RuntimeError`` naming
        where each one is. Nothing on one process."""
        if self.distributed:
            agree((METRICS, *self.where(), metrics), (), flag_slots(len(self.triggers)))
