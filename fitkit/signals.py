"""SIGTERM and Ctrl-C during ``fit``: finish the step, save, close, then exit or re-raise.

Schedulers, preemptible clouds and SLURM send SIGTERM before they kill a job; people press
Ctrl-C. While ``fit`` runs in the main thread, :func:`deferred` holds the first such signal until
the current optimizer step is done; the loop then writes a backup (when a ``BackupAndRestore``
is in the callbacks), runs ``on_train_end``, restores the modes, and ends the way the signal
asks: ``SystemExit(128 + 15)`` for SIGTERM (status 143, as a killed process), and
``KeyboardInterrupt`` for SIGINT. A second signal while the first is handled acts at once.
The previous handlers come back when ``fit`` returns.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Interrupt", "deferred"]


class Interrupt:
    """The signal received during ``fit`` (``signum``), or ``None``."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def raise_now(self) -> None:
        """End the way the received signal asks (call after cleaning up)."""
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + int(self.signum or signal.SIGTERM))


@contextlib.contextmanager
def deferred(enabled: bool = True) -> Iterator[Interrupt]:
    """Hold SIGTERM / SIGINT in an :class:`Interrupt` while the body runs (main thread only).

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

    def handler(signum: int, frame: Any) -> None:
        if state.signum is not None:  # a second signal: act at once, as without fitkit
            old = previous.get(signum)
            if callable(old):
                old(signum, frame)
                return
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        state.signum = signum

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
