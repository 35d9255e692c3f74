"""The manifest of a sharded checkpoint: every file's size and SHA-256, checked before a load.

A sharded checkpoint folder (:mod:`fitkit.files.sharded`) ends with :data:`MANIFEST_NAME`, written
last by rank 0 once every rank's shard files, DCP's ``.metadata`` and fitkit's state file are on
disk: a JSON object ``{"format": 1, "files": {name: {"size": bytes, "sha256": hex}}}`` listing
every other file of the folder. :func:`verify_manifest` reads every file once (streaming,
1 MiB at a time) and names the first file that is missing, extra, of another size or of other
bytes (a flipped byte, a truncation, a shard of another run), before anything is loaded.

A digest guards integrity, not origin: whoever can write the folder can rewrite the manifest
too. A folder written before manifests existed has none and loads as before (its index files
and shard sizes are still checked).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from fitkit.files.reading import _FIX_DAMAGED, CheckpointError

__all__ = ["MANIFEST_NAME", "write_manifest", "verify_manifest", "file_digest"]

#: The manifest of a sharded checkpoint, inside its folder.
MANIFEST_NAME = "fitkit_manifest.json"
_FORMAT = 1
_MAX_MANIFEST = 64 * 2**20  # far past any real one (about 100 bytes a file)
_CHUNK = 2**20


def file_digest(path: str | os.PathLike) -> str:
    """The SHA-256 (hex) of a file's bytes, read once in 1 MiB pieces.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "f")
        >>> _ = open(p, "wb").write(b"abc")
        >>> file_digest(p)[:16]
        'ba7816bf8f01cfea'
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _listing(folder: Path) -> list[str]:
    """Every entry of ``folder`` but the manifest (sorted names; folders included, as extras)."""
    return sorted(p.name for p in folder.iterdir() if p.name != MANIFEST_NAME)


def write_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """Record every file of ``folder`` (size and SHA-256) in its :data:`MANIFEST_NAME`, atomically.

    Call it when every other file of the folder is written: the manifest is the folder's last file.

    Returns:
        The manifest written.

    Raises:
        OSError: a file cannot be read or the manifest written (the folder is left without one).

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "a"), "wb").write(b"abc")
        >>> write_manifest(d)["files"]["a"]["size"]
        3
        >>> verify_manifest(d)
        True
    """
    from fitkit.files.writing import _atomic_write

    p = Path(folder)
    files = {}
    for name in _listing(p):
        f = p / name
        files[name] = {"size": f.stat().st_size, "sha256": file_digest(f)}
    manifest = {"format": _FORMAT, "files": files}
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()

    def write(tmp: str) -> None:
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())

    _atomic_write(p / MANIFEST_NAME, write)
    return manifest


def _read(p: Path, where: str) -> dict[str, dict[str, Any]]:
    """The ``files`` of a manifest, its structure checked (a damaged one is named)."""
    bad = f"{where} is damaged: its {MANIFEST_NAME} "
    if p.stat().st_size > _MAX_MANIFEST:
        raise CheckpointError(f"{bad}has {p.stat().st_size} bytes, past {_MAX_MANIFEST}. {_FIX_DAMAGED}")
    try:
        manifest = json.loads(p.read_bytes())
    except ValueError as e:
        raise CheckpointError(f"{bad}is not JSON ({e}). {_FIX_DAMAGED}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != _FORMAT
        or not isinstance(files, dict)
        or not all(
            isinstance(v, dict) and type(v.get("size")) is int and isinstance(v.get("sha256"), str)
            for v in files.values()
        )
    ):
        raise CheckpointError(
            f"{bad}does not list files as {{name: {{'size': int, 'sha256': str}}}} (format {_FORMAT}). {_FIX_DAMAGED}"
        )
    return files


def verify_manifest(folder: str | os.PathLike) -> bool:
    """Check every file of a sharded checkpoint folder against its manifest, before any load.

    Reads every file once. Nothing is changed.

    Args:
        folder: the checkpoint folder.

    Returns:
        ``True`` when the folder has a manifest and every file matches it; ``False`` when it has
        none (a folder written before manifests existed: nothing to check against).

    Raises:
        CheckpointError: naming the first file that is missing, extra (not in the manifest),
            of another size than recorded (truncated or grown) or of other bytes (a flipped
            byte, a file of another checkpoint), or a damaged manifest.

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "a"), "wb").write(b"abc")
        >>> _ = write_manifest(d)
        >>> _ = open(os.path.join(d, "a"), "wb").write(b"abd")
        >>> verify_manifest(d)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        fitkit.files.CheckpointError: '...' is damaged: its file 'a' does not match its manifest ...
    """
    p = Path(folder)
    where = repr(os.fspath(folder))
    m = p / MANIFEST_NAME
    if not m.is_file():
        return False
    files = _read(m, where)
    present = _listing(p)
    extra = [n for n in present if n not in files]
    if extra:
        raise CheckpointError(
            f"{where} is damaged: it holds {extra[0]!r}, a file its manifest does not list (added after the "
            f"save, or left from another checkpoint). {_FIX_DAMAGED}"
        )
    for name, record in sorted(files.items()):
        f = p / name
        if name not in present or not f.is_file():
            raise CheckpointError(f"{where} is damaged: its file {name!r} is missing. {_FIX_DAMAGED}")
        size = f.stat().st_size
        if size != record["size"]:
            raise CheckpointError(
                f"{where} is damaged: its file {name!r} has {size} bytes, its manifest records {record['size']} "
                f"({'truncated' if size < record['size'] else 'grown'}). {_FIX_DAMAGED}"
            )
        if file_digest(f) != record["sha256"]:
            raise CheckpointError(
                f"{where} is damaged: its file {name!r} does not match its manifest (SHA-256 differs: changed "
                f"bytes, or the file of another checkpoint). {_FIX_DAMAGED}"
            )
    return True
