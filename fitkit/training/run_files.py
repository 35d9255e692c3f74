"""The run's checkpoint folder: ``save_checkpoint()`` / ``load_checkpoint()`` without a path.

The folder is that of the ``ModelCheckpoint`` of the running fit, else of the model's last fit
(the last such callback in its list, when it has several). Without a path,

- ``save_checkpoint()`` writes the run's ``last.pt``: ``save_last``'s path when the callback
  has one, else ``last.pt`` in the folder of its ``filepath``;
- ``load_checkpoint()`` (or ``load_checkpoint("last")``) loads the newest full checkpoint the run
  has there: ``last.pt``, a file of ``filepath``'s pattern (unless ``save_weights_only``), the
  ``save_on_exception`` file, or a ``BackupAndRestore`` backup of the same fit, by modification
  time.

An explicit ``save_checkpoint(path)`` whose ``path`` is a file of a ``keep_last`` callback's
pattern, in its folder, joins that callback's rotation: the oldest files beyond ``keep_last``
are deleted after it is written, as if the callback had written it.
"""

from __future__ import annotations

import glob
import os
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fitkit.model import Model

from fitkit.callbacks.backup import BackupAndRestore
from fitkit.callbacks.checkpointing import ModelCheckpoint

__all__ = ["remember", "save_path", "load_path", "adopt"]

# model -> the checkpoint callbacks of its running (or last) fit; no reference keeps a model alive
_RUN: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def remember(model: Model, callbacks: list[Any]) -> None:
    """The fit's ``ModelCheckpoint`` and ``BackupAndRestore`` callbacks, kept for path-less calls."""
    writers = [cb for cb in callbacks if isinstance(cb, (ModelCheckpoint, BackupAndRestore))]
    if writers:
        _RUN[model] = writers


def _checkpoint_callback(model: Model, verb: str) -> Any:
    found = [cb for cb in _RUN.get(model, []) if isinstance(cb, ModelCheckpoint)]
    if not found:
        raise RuntimeError(
            f"`{verb}()` without a path uses the run's checkpoint folder, the folder of the ModelCheckpoint of "
            f"this model's running or last fit, but it has none. Fix: pass a path, e.g. model.{verb}('run/last.pt')."
        )
    return found[-1]


def save_path(model: Model) -> str:
    """Where ``save_checkpoint()`` writes: the run's ``last.pt``.

    Raises:
        RuntimeError: no fit of this model had a ``ModelCheckpoint``.
    """
    cb = _checkpoint_callback(model, "save_checkpoint")
    if cb.last_path is not None:
        return str(cb.last_path)
    return os.path.join(os.path.dirname(cb.filepath), "last.pt")


def load_path(model: Model) -> str:
    """The newest full checkpoint of the run's folder (see the module's docstring).

    Raises:
        RuntimeError: no fit of this model had a ``ModelCheckpoint``.
        FileNotFoundError: none of its files exists.
    """
    cb = _checkpoint_callback(model, "load_checkpoint")
    candidates = [save_path(model), cb.exception_path]
    if not cb.save_weights_only:
        candidates += glob.glob(cb.glob_pattern)
    candidates += [str(b.path) for b in _RUN.get(model, []) if isinstance(b, BackupAndRestore)]
    existing = [p for p in candidates if p is not None and os.path.isfile(p)]
    if not existing:
        raise FileNotFoundError(
            f"`load_checkpoint()` loads the newest checkpoint of the run's folder "
            f"({os.path.dirname(cb.filepath) or os.curdir!r}), and it holds none. Fix: pass a path."
        )
    return max(existing, key=lambda p: os.stat(p).st_mtime_ns)


def adopt(model: Model, path: str | os.PathLike[str]) -> None:
    """An explicit ``save_checkpoint(path)`` into a ``keep_last`` callback's pattern joins its rotation."""
    for cb in _RUN.get(model, []):
        if isinstance(cb, ModelCheckpoint) and cb.keep_last is not None and cb.owns(path):
            cb.rotate(os.fspath(path))
