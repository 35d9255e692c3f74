"""The callbacks' side of :mod:`fitkit.files.locks` and :mod:`fitkit.files.owned`: the
warnings, in fitkit's category."""

from __future__ import annotations

import os
import warnings

from fitkit.checks import FitkitWarning
from fitkit.files.locks import FileLock
from fitkit.files.owned import Owned

__all__ = ["take_lock", "restore_name"]


def take_lock(path: str | os.PathLike, what: str, who: str) -> FileLock:
    """Acquire a :class:`FileLock`; warn when it was a dead run's.

    Raises:
        fitkit.files.LockError: a live run (or another callback of this fit) holds it.
    """
    lock = FileLock(path, what, who).acquire()
    if lock.took_over is not None:
        warnings.warn(lock.took_over, category=FitkitWarning, stacklevel=4)
    return lock


def restore_name(owned: Owned, saved: object, what: str) -> str | None:
    """:meth:`Owned.restore`, warning about a name it refuses."""
    path = owned.restore(saved)
    if path is None:
        warnings.warn(owned.refusal(saved, what), category=FitkitWarning, stacklevel=5)
    return path
