"""Where each rank is, kept in the process group's store: a failure then names the rank that hung.

When a collective times out (``Model(timeout=...)``), torch says only that this rank waited too
long. Under torchrun every rank's fit runs a small background thread that writes, when it
changed and at most twice a second, the rank's place to the store: the epoch, the batch it
began and how many it finished, and since when (a Python read of the loop's counters: no
device work, nothing on the training thread). A rank that fails with an uncaught exception
reads every rank's place and adds one line to its error (torchrun's failure summary shows it):
the ranks behind it by name, with their place and for how long they have been there.

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


def _store() -> Any:
    """The default process group's store, or ``None`` (no group, or none under torchrun)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a group without a store (a backend of its own)
        return None


@contextlib.contextmanager
def beating(place: Any) -> Iterator[None]:
    """Write ``place()`` (``(epoch, batch begun, batches done)``) to the store while the body
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
            now = place()
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


def _describe(place: list[int]) -> str:
    epoch, begun, finished = place
    if begun < 0:
        return f"epoch {epoch}, before its first batch"
    if finished > begun:
        return f"epoch {epoch}, after batch {begun + 1} (in its callbacks)"
    return f"epoch {epoch}, in batch {begun + 1}"


def where_ranks_were(me: int | None = None) -> str | None:
    """One line naming the ranks behind rank ``me`` (default: this rank) and where every rank
    was, from the store; ``None`` when nothing is known (one process, no fit running).

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
    behind = [r for r, p in places.items() if r != me and p["place"][:2] < mine[:2]]
    parts = [f"rank {r}: {_describe(p['place'])} for {now - p['since']:.1f} s" for r, p in sorted(places.items())]
    head = (f"rank(s) {', '.join(map(str, behind))} behind rank {me}, which was {_describe(mine)}: "
            "hung or slow there. " if behind else "")  # fmt: skip
    return f"fitkit: {head}Where each rank was: {'; '.join(parts)}."


def mark_failed(text: str) -> None:
    """Leave ``text`` in the store: this rank is failing (read by :func:`peer_failed`)."""
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(_FAILED, text)


def peer_failed() -> bool:
    """Whether a rank of this job has failed (:func:`mark_failed`); ``False`` on one process."""
    store = _store()
    if store is None:
        return False
    try:
        return bool(store.check([_FAILED]))
    except Exception:  # the store went with the failing process: a peer failed
        return True
