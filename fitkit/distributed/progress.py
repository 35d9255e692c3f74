"""Where each rank is, kept in the process group's store: a failure then names the rank that hung.

When a collective times out (``Model(timeout=...)``), torch says only that this rank waited too
long. Under torchrun every rank's fit runs a small background thread that writes, when it
changed and at most twice a second, the rank's place to the store: the epoch, the batch it
began and how many it finished, the phase (the batches, the epoch's end, its validation, its
epoch-end callbacks), whether it is writing a checkpoint (:func:`doing`), and since when (a
Python read of the loop's counters: no device work, nothing on the training thread). A rank
that fails with an uncaught exception reads every rank's place and adds one line to its error
(torchrun's failure summary shows it): the ranks behind it by name, with their place and for
how long they have been there; a rank that failed before it is named as failed, with its error.

The failing rank also leaves a mark in the store. torchrun then stops the other workers with
SIGTERM; a rank that holds a SIGTERM until its step ends (to write a stop backup) reads the mark
and exits at once instead: a hung rank would otherwise hold it until torchrun's kill, 30 s later.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["beating", "where_ranks_were", "mark_failed", "peer_failed"]

_KEY = "fitkit/progress/"
_FAILED = "fitkit/failed"
_PERIOD = 0.5  # seconds between two looks at the loop's counters
#: The phases of a place after the epoch's batches (``place[3]``), in the order a rank reaches them.
EPOCH_END, VALIDATION, EPOCH_CALLBACKS = 2, 3, 4
_PHASES = {
    EPOCH_END: "at its end (its metrics)",
    VALIDATION: "in its validation",
    EPOCH_CALLBACKS: "in its epoch-end callbacks",
}
_doing: list[str] = []  # what this rank does inside its phase (a checkpoint write), innermost last


def _store() -> Any:
    """The default process group's store, or ``None`` (no group, or none under torchrun)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a group without a store (a backend of its own)
        return None


@contextlib.contextmanager
def doing(what: str) -> Iterator[None]:
    """While the body runs, this rank's place says it is ``what`` (e.g. ``"writing a checkpoint"``).

    Example:
        >>> with doing("writing a checkpoint"):
        ...     _doing
        ['writing a checkpoint']
    """
    _doing.append(what)
    try:
        yield
    finally:
        _doing.pop()


def _now(place: Any) -> list[Any]:
    return [*place(), _doing[-1] if _doing else None]


@contextlib.contextmanager
def beating(place: Any) -> Iterator[None]:
    """Write ``place()`` (``(epoch, batch begun, batches done, phase)``; the phase 0 inside the
    batches, else :data:`EPOCH_END`, ...) and what :func:`doing` says to the store while the body
    runs, from a daemon thread, when it changed; nothing on one process or for ``place=None``."""
    store = None if place is None else _store()
    if store is None:
        yield
        return
    key, done = f"{_KEY}{dist.get_rank()}", threading.Event()

    def beat() -> None:
        last: Any = None
        since = time.time()
        while not done.wait(_PERIOD if last is not None else 0):
            now = _now(place)
            if now != last:
                last, since = now, time.time()
                with contextlib.suppress(Exception):  # a store gone at exit: nothing to tell
                    store.set(key, json.dumps({"place": list(now), "since": since}))

    thread = threading.Thread(target=beat, name="fitkit-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)  # it wakes at once; joined, it holds nothing of the fit (its loop) any more


def _describe(place: list[Any]) -> str:
    epoch, begun, finished = place[:3]
    phase = place[3] if len(place) > 3 else 0
    doing = f", {place[4]}" if len(place) > 4 and place[4] else ""
    if phase in _PHASES:
        return f"epoch {epoch}, {_PHASES[phase]}{doing}"
    if begun < 0:
        return f"epoch {epoch}, before its first batch{doing}"
    if finished > begun:
        return f"epoch {epoch}, after batch {begun + 1} (in its callbacks){doing}"
    return f"epoch {epoch}, in batch {begun + 1}{doing}"


def _order(place: list[Any]) -> tuple[int, int, int]:
    """Where a place is in the run: the epoch, the batch begun, then its phase (the batch, its
    callbacks, the epoch's end, its validation, its epoch-end callbacks)."""
    epoch, begun, finished = place[:3]
    phase = place[3] if len(place) > 3 and place[3] else (1 if finished > begun else 0)
    return epoch, begun, phase


def _failed(store: Any) -> dict[str, Any] | None:
    """The rank that failed first and its error (:func:`mark_failed`), if one did."""
    with contextlib.suppress(Exception):
        if store.check([_FAILED]):
            mark = json.loads(store.get(_FAILED))
            return mark if isinstance(mark, dict) and isinstance(mark.get("rank"), int) else None
    return None


def where_ranks_were(me: int | None = None) -> str | None:
    """One line naming the ranks behind rank ``me`` (default: this rank) and where every rank
    was, from the store; ``None`` when nothing is known (one process, no fit running). A rank
    that failed with an exception first is named as failed, not as behind.

    Example:
        >>> where_ranks_were() is None  # one process
        True
    """
    store = _store()
    if store is None:
        return None
    me = dist.get_rank() if me is None else me
    places: dict[int, dict[str, Any]] = {}
    for r in range(dist.get_world_size()):
        key = f"{_KEY}{r}"
        with contextlib.suppress(Exception):
            if store.check([key]):
                places[r] = json.loads(store.get(key))
    if me not in places:
        return None
    now, mine = time.time(), places[me]["place"]
    failed = _failed(store)
    gone = failed["rank"] if failed is not None and failed["rank"] != me else None
    behind = [r for r, p in places.items() if r not in (me, gone) and _order(p["place"]) < _order(mine)]
    parts = [f"rank {r}: {_describe(p['place'])} for {now - p['since']:.1f} s" for r, p in sorted(places.items())]
    head = ""
    if gone is not None:
        at = f" at {_describe(places[gone]['place'])}" if gone in places else ""
        head = f"rank {gone} failed ({failed['error']}){at}; rank {me} stopped because of it. "  # type: ignore[index]
    if behind:
        head += (
            f"rank(s) {', '.join(map(str, behind))} behind rank {me}, which was {_describe(mine)}: hung or slow there. "
        )
    return f"fitkit: {head}Where each rank was: {'; '.join(parts)}."


def mark_failed(error: str) -> None:
    """Leave this rank's number and ``error`` (its exception's type) in the store: this rank is
    failing (read by :func:`peer_failed`, and named by the others' :func:`where_ranks_were`).
    The first rank to fail keeps the mark."""
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            if not store.check([_FAILED]):
                store.set(_FAILED, json.dumps({"rank": dist.get_rank(), "error": error}))


def peer_failed() -> bool:
    """Whether a rank of this job has failed (:func:`mark_failed`); ``False`` on one process."""
    store = _store()
    if store is None:
        return False
    try:
        return bool(store.check([_FAILED]))
    except Exception:  # the store went with the failing process: a peer failed
        return True
