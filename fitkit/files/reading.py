"""Safe loads that name the damage: empty, truncated, corrupted, not a checkpoint, too new."""

from __future__ import annotations

import errno
import os
import re
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from fitkit.files.payload import CHECKSUM_KEY, payload_checksum, pop_weights_checksum

__all__ = ["CheckpointError", "safe_load"]

_FIX_DAMAGED = (
    "Fix: use an earlier checkpoint (BackupAndRestore keeps the previous backup as "
    "backup.prev.pt) or a copy of this file from elsewhere."
)
# The first bytes of torch's legacy (pre-zip) format: pickle protocol 2, then its magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


class CheckpointError(ValueError):
    """A file that is damaged or is not a checkpoint: empty, truncated, corrupted (checksum
    mismatch), not a torch file, or written by a newer fitkit. The message names the file,
    what is wrong with it and the fix.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "c.pt"); open(p, "wb").close()
        >>> safe_load(p, "cpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        fitkit.files.CheckpointError: '...c.pt' is empty (0 bytes): ...
    """


CheckpointError.__module__ = "fitkit.files"


class RefusedCheckpointError(CheckpointError, RuntimeError):
    """A file that holds pickled code or objects: refused before anything in it ran. A
    :class:`CheckpointError` (so a backup falls back past it) and a ``RuntimeError``."""


RefusedCheckpointError.__module__ = "fitkit.files"

# torch's zip format: one top folder holding these records, data/<n> and .data/<record>.
_TORCH_RECORDS = {"data.pkl", ".format_version", ".storage_alignment", "byteorder", "version"}
_TORCH_RECORD = re.compile(r"(data/\d+|\.data/[A-Za-z0-9_.]+)")


def safe_load(path: str | os.PathLike, map_location: Any) -> Any:
    """``torch.load(..., weights_only=True)`` that names what is wrong with a bad file.

    Before unpickling, the zip archive's CRC-32s are verified (torch's reader does not check
    them); after it, a fitkit checkpoint's version and ``"fitkit_checksum"`` are checked and
    the checksum key is removed from what is returned. A file without a checksum (an older
    fitkit, a plain ``torch.save`` of a state dict) still loads.

    Args:
        path: the file.
        map_location: as in ``torch.load`` (e.g. ``model.device``).

    Raises:
        FileNotFoundError: no file at ``path``; IsADirectoryError: ``path`` is a folder.
        CheckpointError: the file is empty, truncated, corrupted (checksum mismatch), not a
            torch file, or written by a newer fitkit.
        RuntimeError: the file holds pickled code or objects (refused; nothing ran).
    """
    where = repr(str(path))
    p = Path(path)
    _check_head(p, where)
    try:
        state = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as e:
        if "weights_only" in str(e) or "Unsupported global" in str(e) or "Weights only load failed" in str(e):
            raise RefusedCheckpointError(
                f"Refused to load {where}: it holds pickled objects that could run code, and "
                "fitkit loads with weights_only=True. Fix: save with model.save_weights / "
                "save_checkpoint, or re-save a plain state dict from code you trust."
            ) from None
        raise CheckpointError(
            f"{where} is damaged: torch.load failed with {type(e).__name__}: {str(e).rstrip('.')}. {_FIX_DAMAGED}"
        ) from e
    _check_checksums(state, where)
    return state


def _check_head(p: Path, where: str) -> None:
    """The file exists, is not empty, and is a torch zip (its CRCs verified) or legacy file."""
    if p.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"{where} is a folder, not a checkpoint. Fix: pass the file in it.")
    if not p.is_file():
        raise FileNotFoundError(f"No checkpoint file at {where}.")
    with open(p, "rb") as f:
        head = f.read(64)
    if not head:
        raise CheckpointError(f"{where} is empty (0 bytes): the write that made it was cut short. {_FIX_DAMAGED}")
    if head.startswith(b"PK\x03\x04"):
        _verify_archive(p, where)
    elif not head.startswith(_LEGACY_MAGIC):  # the legacy format has no checksums to verify
        hint = " It looks like a safetensors file: load it with load_weights." if head[8:9] == b"{" else ""
        raise CheckpointError(
            f"{where} is not a fitkit or torch checkpoint (it starts with {head[:8]!r}).{hint} Fix: pass a "
            "file written by save_weights, save_checkpoint or torch.save."
        )


def _check_checksums(state: Any, where: str) -> None:
    """A weights file's and a fitkit checkpoint's checksums (removed from ``state``), and its version."""
    weights_sum = pop_weights_checksum(state)  # a weights file of save_weights
    if weights_sum is not None and weights_sum.startswith("sha256:") and payload_checksum(dict(state)) != weights_sum:
        raise CheckpointError(f"{where} is corrupted: its checksum does not match its tensors. {_FIX_DAMAGED}")
    if isinstance(state, dict) and isinstance(state.get("fitkit_version"), str):
        _check_version(state["fitkit_version"], where)
        expected = state.pop(CHECKSUM_KEY, None)
        if isinstance(expected, str) and expected.startswith("sha256:") and payload_checksum(state) != expected:
            raise CheckpointError(f"{where} is corrupted: its checksum does not match its contents. {_FIX_DAMAGED}")


def _verify_archive(p: Path, where: str) -> None:
    try:
        archive = zipfile.ZipFile(p)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        what = "truncated (its end is missing)" if "not a zip file" in str(e) else f"damaged ({e})"
        raise CheckpointError(f"{where} is {what}: a write was cut short or the file was cut. {_FIX_DAMAGED}") from None
    with archive:
        _check_records(archive, p.stat().st_size, where)
        for info in archive.infolist():
            if info.CRC == 0 and info.file_size:  # written with torch's compute_crc32 off
                continue
            try:
                with archive.open(info) as member:
                    while member.read(1 << 22):
                        pass
            except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, zlib.error, OSError) as e:
                what = "checksum mismatch" if "CRC" in str(e) else str(e)
                raise CheckpointError(
                    f"{where} is corrupted: {what} in its record {info.filename!r}. {_FIX_DAMAGED}"
                ) from None


def _check_records(archive: zipfile.ZipFile, size: int, where: str) -> None:
    """Refuse records torch does not write, compressed ones, and declared sizes past the file's:
    verifying a hostile archive then costs at most one read of the file."""
    infos = archive.infolist()
    tops = {info.filename.split("/", 1)[0] for info in infos}
    top = tops.pop() if len(tops) == 1 else None
    # The names are checked only in what looks like torch's archive; other zips fail in
    # torch.load, which names what it misses.
    torch_like = top is not None and any(info.filename == f"{top}/data.pkl" for info in infos)
    problem = None
    for info in infos:
        name = info.filename[len(top) + 1 :] if top is not None else info.filename
        if torch_like and name not in _TORCH_RECORDS and not _TORCH_RECORD.fullmatch(name):
            problem = f"its record {info.filename!r} is not part of torch's format"
        elif info.compress_type != zipfile.ZIP_STORED:
            problem = f"its record {info.filename!r} is compressed, which torch never does"
        elif info.file_size > size or info.compress_size > size:
            problem = f"its record {info.filename!r} declares {info.file_size} bytes, more than the file's {size}"
        if problem is not None:
            break
    if problem is not None:
        raise CheckpointError(f"{where} is damaged or is not a torch file: {problem}. {_FIX_DAMAGED}")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3])


def _check_version(saved: str, where: str) -> None:
    from fitkit import __version__

    if _version(saved) > _version(__version__):
        raise CheckpointError(
            f"{where} was written by fitkit {saved}, newer than this fitkit {__version__}, and may "
            "hold state this version cannot restore. Fix: upgrade fitkit (from a checkout: git pull, then "
            "pip install .; once released: pip install -U torch-fitkit)."
        )
