"""safetensors weights files (``pip install ".[safetensors]"`` from a checkout), tied weights included."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fitkit.files.payload import CHECKSUM_KEY, payload_checksum
from fitkit.files.reading import _FIX_DAMAGED, CheckpointError
from fitkit.files.writing import _atomic_write

__all__ = ["save_safetensors", "load_safetensors"]


def _safetensors(who: str):
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError(
            f"{who} needs safetensors. Install the `safetensors` extra: "
            "`pip install '.[safetensors]'` from a checkout (`pip install 'torch-fitkit[safetensors]'` "
            "once released)."
        ) from None
    return safetensors


def save_safetensors(state: Mapping[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write a state dict as a safetensors file, atomically (readable by Hugging Face tools).

    safetensors stores each storage once: a tensor that is another key's tensor (tied weights,
    e.g. :class:`fitkit.layers.GPT`'s embedding and head) is written once and listed in the
    metadata ``"fitkit_aliases"`` (:func:`load_safetensors` restores the key, and
    ``safetensors.torch.load_model`` re-ties it as for its own ``save_model``); other views
    of a shared storage are copied. The metadata also holds ``"fitkit_checksum"``.

    Raises:
        ImportError: safetensors is missing (``pip install ".[safetensors]"`` from a checkout).
        TypeError: a value that is not a tensor.
        OSError: the file cannot be written (``errno.ENOSPC`` on a full disk); the old file
            is left as it was.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> w = torch.ones(2, 2)
        >>> save_safetensors({"a": w, "b": w}, p)
        >>> sorted(load_safetensors(p, "cpu"))
        ['a', 'b']
    """
    st = _safetensors("save_safetensors")
    tensors: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    first: dict[Any, str] = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"safetensors stores tensors only; state[{name!r}] is a {type(t).__name__}.")
        t = t.detach()
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in first:
            aliases[name] = first[key]
            continue
        first.setdefault(key, name)
        tensors[name] = t
    # Views of one storage that are not the same tensor (slices of a fused weight): copies.
    users = Counter(_storage(t) for t in tensors.values() if t.numel())
    for name, t in tensors.items():
        shared = t.numel() and users[_storage(t)] > 1
        tensors[name] = t.clone(memory_format=torch.contiguous_format) if shared else t.contiguous()

    metadata = {"format": "pt", CHECKSUM_KEY: payload_checksum(dict(sorted(tensors.items())))}
    if aliases:
        metadata["fitkit_aliases"] = json.dumps(aliases, sort_keys=True)
    _atomic_write(path, lambda tmp: _save_st(st, tensors, tmp, metadata))


def _storage(t: torch.Tensor) -> tuple[Any, int]:
    return t.device, t.untyped_storage().data_ptr()


def _save_st(st: Any, tensors: dict, tmp: str, metadata: dict) -> None:
    st.torch.save_file(tensors, tmp, metadata=metadata)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_safetensors(path: str | os.PathLike, device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file into a state dict on ``device``, restoring tied keys.

    Raises:
        ImportError: safetensors is missing.
        FileNotFoundError: no file at ``path``.
        CheckpointError: the file is empty, truncated, not a safetensors file, or its
            ``fitkit_checksum`` does not match its tensors.
    """
    st = _safetensors("load_safetensors")
    where = repr(str(path))
    if not Path(path).is_file():
        raise FileNotFoundError(f"No weights file at {where}.")
    if Path(path).stat().st_size == 0:
        raise CheckpointError(f"{where} is empty (0 bytes): the write that made it was cut short. {_FIX_DAMAGED}")
    _check_header(Path(path), where)
    try:
        with st.safe_open(os.fspath(path), framework="pt", device=str(device)) as f:
            metadata = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors' own error type: header too large, incomplete buffer
        raise CheckpointError(
            f"{where} is truncated, damaged or not a safetensors file ({type(e).__name__}: {e}). {_FIX_DAMAGED}"
        ) from e
    expected = metadata.get(CHECKSUM_KEY)
    if expected is not None and payload_checksum(dict(sorted(state.items()))) != expected:
        raise CheckpointError(f"{where} is corrupted: its checksum does not match its tensors. {_FIX_DAMAGED}")
    if "fitkit_aliases" in metadata:
        try:
            aliases = json.loads(metadata["fitkit_aliases"])
            pairs = [(a, n) for a, n in aliases.items() if isinstance(a, str) and n in state]
            if len(pairs) != len(aliases):
                raise ValueError("an alias names no tensor of the file")
        except (ValueError, AttributeError, TypeError) as e:  # JSONDecodeError is a ValueError
            raise CheckpointError(
                f"{where} is damaged: its metadata 'fitkit_aliases' is not the JSON of {{alias: tensor name}} "
                f"fitkit writes ({type(e).__name__}: {e}). {_FIX_DAMAGED}"
            ) from None
        for alias, name in pairs:
            state[alias] = state[name]
    return state


# safetensors' own bound on the JSON header (its Rust reader refuses larger ones).
MAX_HEADER_BYTES = 100_000_000


def _check_header(path: Path, where: str) -> None:
    """Refuse a header larger than safetensors allows, or than the file, before it is parsed."""
    with open(path, "rb") as f:
        head = f.read(8)
    size = path.stat().st_size
    if len(head) < 8:
        raise CheckpointError(
            f"{where} is truncated, damaged or not a safetensors file: {size} bytes, too short for a header. "
            f"{_FIX_DAMAGED}"
        )
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER_BYTES or n > size - 8:
        raise CheckpointError(
            f"{where} is truncated, damaged or not a safetensors file: its header declares {n} bytes (the "
            f"file has {size}; safetensors allows at most {MAX_HEADER_BYTES}), so it is not parsed. {_FIX_DAMAGED}"
        )
