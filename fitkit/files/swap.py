"""Replacing a checkpoint (a file or a folder) with no instant where none is complete.

A folder cannot be renamed over another, so :func:`swap_into_place` takes two renames: the old
checkpoint to :func:`kept_copy` (``.<name>.old`` beside it), then the new one into place, then
the kept copy goes. A process killed between the two renames leaves the old checkpoint, complete,
at its kept name; :func:`readable_path` makes every loader find it there, and
:func:`restore_interrupted` (run by the next save, before it deletes anything) renames it back.
So at every instant the old or the new checkpoint is complete where a load looks.
"""

from __future__ import annotations

import os
from pathlib import Path

from fitkit.files.sharded import remove_path
from fitkit.files.writing import sync_folder

__all__ = ["kept_copy", "readable_path", "restore_interrupted", "swap_into_place"]


def kept_copy(path: str | os.PathLike) -> Path:
    """Where :func:`swap_into_place` keeps the old checkpoint between its two renames.

    Example:
        >>> kept_copy("runs/ck").as_posix()
        'runs/.ck.old'
    """
    p = Path(path)
    return p.parent / f".{p.name}.old"


def readable_path(path: str | os.PathLike) -> Path:
    """``path``, or its kept copy when a swap was cut between its renames (nothing at ``path``).

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); os.mkdir(os.path.join(d, ".ck.old"))
        >>> readable_path(os.path.join(d, "ck")).name
        '.ck.old'
    """
    p = Path(path)
    kept = kept_copy(p)
    if not os.path.lexists(p) and kept.exists():
        return kept
    return p


def restore_interrupted(path: str | os.PathLike) -> bool:
    """Rename the kept copy back to ``path`` if a swap was cut between its renames (rank 0).

    Returns:
        Whether a kept copy was restored.
    """
    p = Path(path)
    kept = kept_copy(p)
    if os.path.lexists(p) or not kept.exists():
        return False
    os.replace(kept, p)
    sync_folder(p.parent)
    return True


def swap_into_place(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename ``tmp`` (a complete file or folder) to ``final``, replacing what is there (rank 0).

    An old checkpoint at ``final`` is kept as :func:`kept_copy` until the new one is in place.
    """
    tmp, final = Path(tmp), Path(final)
    restore_interrupted(final)  # a swap cut short: its old checkpoint is the one to replace
    kept = kept_copy(final)
    remove_path(kept)  # a swap that got past its second rename: the kept copy is stale
    if os.path.lexists(final):
        os.replace(final, kept)
    os.replace(tmp, final)
    sync_folder(final.parent)  # make the renames durable before the old copy goes
    remove_path(kept)
