"""Where an MLflow store lives on disk, and one process at a time creating it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["local_sqlite_dir", "store_lock"]


def local_sqlite_dir(uri: str) -> Path | None:
    """The folder of a local SQLite store's file (``sqlite:////abs/mlflow.db``, ``sqlite:///rel.db``),
    or ``None`` for any other tracking URI.

    Example:
        >>> local_sqlite_dir("sqlite:////runs/mlflow.db"), local_sqlite_dir("http://host:5000")
        (PosixPath('/runs'), None)
    """
    if not uri.startswith("sqlite:///") or uri.endswith(":memory:"):
        return None
    return Path(uri[len("sqlite:///") :]).resolve().parent


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """One process at a time opens a local SQLite store: MLflow creates and migrates a new
    database on first use, and two runs doing that at once crash one of them. An exclusive
    ``flock`` on the database's folder (no file of its own) serialises it; elsewhere, nothing."""
    folder = local_sqlite_dir(uri)
    try:
        import fcntl
    except ImportError:  # Windows: no flock
        fcntl = None  # type: ignore[assignment]
    if folder is None or fcntl is None or not folder.is_dir():
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and with it the lock
