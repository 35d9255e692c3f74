"""Atomic writes: a temp file in the same folder, fsync, the umask's mode, then a rename.

A full disk is reported as ``OSError(errno.ENOSPC)`` naming the path (torch's own error is an
opaque "unexpected pos"); the older file stays and no temp file is left behind.
"""

from __future__ import annotations

import errno
import glob
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from fitkit.files.locks import pid_alive, temp_owner, temp_prefix
from fitkit.files.payload import CHECKSUM_KEY, check_weights_only, payload_checksum, with_weights_checksum

__all__ = ["atomic_save", "remove_stale_temps", "cut_to_last_line", "check_target", "sync_folder"]


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temp file in the same folder, fsync, then rename over ``path``.

    A reader (or a crash) never sees a partial file: it sees the old file or the new one. The
    payload is checked first (:func:`check_weights_only`), so a file that would not load back
    is never written. A fitkit checkpoint (a dict holding ``"fitkit_version"``) also gets
    ``"fitkit_checksum"`` (:func:`payload_checksum`); a module's state dict (it has
    ``_metadata``) carries it in its metadata (:func:`fitkit.files.payload.with_weights_checksum`)
    and keeps exactly its own keys; other payloads are saved as given. The file gets the mode the process umask gives
    (``0o666 & ~umask``), as ``open()`` would.

    Args:
        obj: what to save: containers of tensors, numbers and strings.
        path: the file; missing parent folders are created, an existing file is replaced.

    Raises:
        TypeError: the payload holds a type that ``torch.load(weights_only=True)`` refuses.
        OSError: the file cannot be written (``errno.ENOSPC`` on a full disk). The old file,
            if any, is left as it was, and no temp file stays behind.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "w.pt")
        >>> atomic_save({"a": torch.ones(1)}, p)
        >>> torch.load(p, weights_only=True)
        {'a': tensor([1.])}
    """
    if isinstance(obj, Mapping):
        check_weights_only(obj, path)
        if "fitkit_version" in obj:
            obj = {k: v for k, v in obj.items() if k != CHECKSUM_KEY}
            obj[CHECKSUM_KEY] = payload_checksum(obj)
        elif hasattr(obj, "_metadata"):  # a module state dict: the checksum rides in its metadata
            obj = with_weights_checksum(obj)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            recorder = _Recorder(f)
            try:
                torch.save(obj, recorder)  # type: ignore[arg-type]
            except RuntimeError as e:  # torch swallows the OSError of a failed write
                if recorder.error is not None:
                    raise recorder.error from e
                raise
            f.flush()
            os.fsync(f.fileno())

    _atomic_write(path, write)


class _Recorder:
    """A file wrapper for ``torch.save`` that keeps the ``OSError`` of a failed write."""

    def __init__(self, f: Any):
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Run ``write(temp_path)``, then give the temp file the umask's mode and rename it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), suffix=".tmp", dir=path.parent)
    except PermissionError as e:  # name the file asked for, not the temp file
        raise PermissionError(
            e.errno,
            f"Cannot write {str(path)!r}: the folder {str(path.parent)!r} is not writable "
            f"({e.strerror}). Fix: choose a folder you can write to, or change its permissions.",
        ) from None
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        full = disk_full_errno(e)
        if full is not None:
            raise OSError(
                full,
                f"{os.strerror(full)} while writing {str(path)!r}; the older file, if any, "
                "is unchanged. Fix: free space or choose another folder.",
            ) from e
        raise
    sync_folder(path.parent)  # make the rename itself durable


def sync_folder(folder: str | os.PathLike) -> None:
    """fsync ``folder`` so that renames into it survive a power cut (best effort: file systems
    that cannot sync a folder are left as they are)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it
    os.umask(mask)
    return mask


def disk_full_errno(exc: BaseException) -> int | None:
    """``errno.ENOSPC`` / ``EDQUOT`` when ``exc`` (or its cause) says the disk is full, else ``None``.

    Example:
        >>> disk_full_errno(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
        28
        >>> disk_full_errno(ValueError("bad value")) is None
        True
    """
    e: BaseException | None = exc
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e.errno
        text = str(e)
        # torch: "[enforce fail at inline_container.cc:...] . unexpected pos 704 vs 598" (a
        # short write); safetensors: "IoError(Os { code: 28, kind: StorageFull ... })".
        if "unexpected pos" in text or "StorageFull" in text or "No space left" in text:
            return errno.ENOSPC
        e = e.__cause__ or e.__context__
    return None


def remove_stale_temps(folder: str | os.PathLike, name: str) -> list[Path]:
    """Delete the temp files ``.{name}.*.tmp`` that a write killed mid-way left in ``folder``.

    Called when a callback that owns the file starts, so a killed run leaves no orphan. Only
    a dead process's temps go: a temp name carries its writer's pid
    (:func:`fitkit.files.locks.temp_prefix`), and one whose writer is alive (another run
    writing the same folder) is left alone. A name without a pid (an older fitkit's) goes.

    Args:
        folder: the folder of the file.
        name: the file's name, or a glob pattern of names (``"ep*.pt"``); escape a literal name
            that holds ``*?[`` with ``glob.escape``.

    Returns:
        The paths removed.

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); open(os.path.join(d, ".w.pt.k2j4.tmp"), "w").close()
        >>> open(os.path.join(d, f".w.pt.{os.getpid()}-x1.tmp"), "w").close()  # this live process's
        >>> [p.name for p in remove_stale_temps(d, "w.pt")], len(os.listdir(d))
        (['.w.pt.k2j4.tmp'], 1)
    """
    removed = []
    for tmp in glob.glob(os.path.join(glob.escape(os.fspath(folder)), f".{name}.*.tmp")):
        owner = temp_owner(os.path.basename(tmp))
        if owner is not None and pid_alive(owner):
            continue  # a live writer's (another run, or this one): never ours to delete
        try:
            os.unlink(tmp)
            removed.append(Path(tmp))
        except OSError:
            pass
    return removed


def cut_to_last_line(path: str | os.PathLike) -> int:
    """Truncate a text file after its last newline (drop a partial last line); return its size.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "log.csv")
        >>> _ = open(p, "w").write("epoch,loss\\n0,1.5\\n1,0.")
        >>> cut_to_last_line(p), open(p).read()
        (17, 'epoch,loss\\n0,1.5\\n')
    """
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            newline = f.read(pos - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            pos = start
        else:
            keep = 0
        if keep != end:
            f.truncate(keep)
    return keep


def _file_above(text: str) -> str | None:
    """The nearest existing ancestor of ``text`` if it is a file (no folder can be made there)."""
    parent = os.path.dirname(os.path.abspath(text)) if text.strip() else ""
    while parent and not os.path.exists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            return None
        parent = up
    return parent if parent and os.path.isfile(parent) else None


def check_target(path: Any, argument: str, who: str, kind: str = "file") -> str:
    """Check, when a callback is built, a path it will write to; return it as a str.

    Args:
        path: the path argument.
        argument: its name, for the message.
        who: the callback, for the message.
        kind: ``"file"`` (it must not be an existing folder) or ``"folder"`` (it must not be
            an existing file).

    Raises:
        TypeError: not a str or a path.
        ValueError: empty, an existing folder where a file is written (or the reverse), or a
            path under an existing file.

    Example:
        >>> import tempfile
        >>> check_target(tempfile.mkdtemp(), "filename", "CSVLogger")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: CSVLogger writes a file at `filename`, but it is an existing folder. Received: ...
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Expected `{argument}` to be a str or a path. Received: {argument}={path!r}.")
    text = os.fspath(path)
    if kind == "file":
        wrong = "an existing folder" if os.path.isdir(text) or text.endswith(("/", os.sep)) else None
    else:
        wrong = "an existing file" if os.path.isfile(text) else None
    blocker = _file_above(text)
    if blocker is not None:
        raise ValueError(
            f"{who} writes a {kind} at `{argument}`, but {blocker!r} above it is an existing file, so no "
            f"folder can be made there. Received: {argument}={text!r}. Fix: choose a path under a folder."
        )
    if not text.strip() or wrong:  # "" or only blanks: a name nobody means
        example = os.path.join(text, "model.pt") if kind == "file" and text else "runs/backup"
        raise ValueError(
            f"{who} writes a {kind} at `{argument}`, but it is {wrong or 'empty'}. Received: "
            f"{argument}={text!r}. Fix: pass a {kind} path of its own, e.g. {example!r}."
        )
    return text
