"""Sharded checkpoints on disk: a ``torch.distributed.checkpoint`` (DCP) folder and its checks.

A sharded checkpoint is a folder: DCP's ``.metadata`` and one ``__<rank>_<n>.distcp`` file
per writing rank (the module's and the optimizer's tensors, keys ``model.<name>`` and
``optim.state.<name>.<field>``), plus :data:`STATE_NAME`, a small fitkit file with everything
else (epoch, position, RNG states, scheduler, callbacks, history), checksummed like a
one-file checkpoint. The folder is written under a temp name and renamed when complete
(:mod:`fitkit.distributed.dcp`), so a folder without both ``.metadata`` and
:data:`STATE_NAME` is a write that did not finish, and is never taken for a checkpoint.

This module reads such folders without a process group (one process, offline).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fitkit.files.reading import _FIX_DAMAGED, CheckpointError, RefusedCheckpointError, safe_load

__all__ = ["STATE_NAME", "is_sharded", "check_sharded", "sharded_shapes", "consolidate_weights", "remove_path"]

#: The non-tensor part of a sharded checkpoint, inside its folder.
STATE_NAME = "fitkit_state.pt"


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Without DCP's warning that one process without a process group saves or loads alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder (a sharded checkpoint, or what is left of one)."""
    return Path(path).is_dir()


# What DCP's ``.metadata`` pickle may name: the index classes of torch.distributed.checkpoint,
# torch.Size, dtypes and layouts, and paths. Anything else (a function that runs code,
# ``os.system``, ``builtins.eval``) is refused before it is looked up, so nothing in the file runs.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint.storage")  # fmt: skip
_SAFE_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                 ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
                 ("pathlib", "PureWindowsPath"), ("pathlib", "Path"), ("builtins", "set"),
                 ("builtins", "frozenset")}  # fmt: skip


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index, and nothing that could run code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # the index's dataclasses and enums, never a function
                return obj
        raise pickle.UnpicklingError(f"the index names {module}.{name}, which a checkpoint index never holds")


def _metadata(path: Path) -> Any:
    """DCP's index of a sharded checkpoint, read with :class:`_IndexUnpickler` (DCP's own reader
    uses plain ``pickle.load``: a crafted ``.metadata`` would run code there)."""
    where = repr(str(path))
    data = (path / ".metadata").read_bytes()
    try:
        return _IndexUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        if "never holds" in str(e):
            raise RefusedCheckpointError(
                f"Refused to load {where}: its .metadata holds pickled objects that could run code ({e}); nothing "
                "in it ran. Fix: load only checkpoints written by fitkit (save_checkpoint, BackupAndRestore), "
                "or re-save it from code you trust."
            ) from None
        raise


def check_sharded(path: str | os.PathLike) -> Any:
    """Check that a sharded checkpoint is complete; return its DCP metadata.

    Cheap (no tensor is read): the two index files exist, and every shard file the index
    names is there and long enough.

    Raises:
        FileNotFoundError: no folder at ``path``.
        CheckpointError: ``.metadata`` or :data:`STATE_NAME` is missing (a write that did not
            finish), unreadable, or a shard file is missing or shorter than the index says.
        RuntimeError (a ``CheckpointError`` too): ``.metadata`` names anything but the index's
            own classes (pickled code): refused before anything in it runs.
    """
    p, where = Path(path), repr(str(path))
    if not p.is_dir():
        raise FileNotFoundError(f"No sharded checkpoint folder at {where}.")
    missing = [n for n in (".metadata", STATE_NAME) if not (p / n).is_file()]
    if missing:
        raise CheckpointError(
            f"{where} is not a complete sharded checkpoint: {' and '.join(missing)} missing (a write that "
            f"did not finish, or a folder of something else). {_FIX_DAMAGED}"
        )
    try:
        meta = _metadata(p)
    except RefusedCheckpointError:
        raise
    except Exception as e:  # whatever the unpickler met in a damaged file
        raise CheckpointError(f"{where}: its .metadata cannot be read ({type(e).__name__}: {e}). {_FIX_DAMAGED}") from e
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), int(info.offset) + int(info.length))
    for name, size in sorted(need.items()):
        f = p / name
        if not f.is_file():
            raise CheckpointError(f"{where} is damaged: its shard file {name!r} is missing. {_FIX_DAMAGED}")
        if f.stat().st_size < size:
            raise CheckpointError(
                f"{where} is damaged: its shard file {name!r} has {f.stat().st_size} bytes, the index "
                f"needs {size} (truncated). {_FIX_DAMAGED}"
            )
    return meta


def read_state(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """The non-tensor part (:data:`STATE_NAME`), checksum verified (see :func:`safe_load`)."""
    return safe_load(Path(path) / STATE_NAME, map_location)


def sharded_shapes(meta: Any, prefix: str = "model.") -> dict[str, torch.Size]:
    """``{name: global shape}`` of the tensors under ``prefix`` in a DCP index (prefix removed)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        k[len(prefix):]: v.size
        for k, v in meta.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }  # fmt: skip


def consolidate_weights(checkpoint: str | os.PathLike, path: str | os.PathLike) -> list[str]:
    """Turn a sharded checkpoint folder into one weights file, offline, on one process.

    The module's tensors are read from every shard at their full size (the optimizer state is
    not read) and written to ``path``: safetensors when it ends in ``.safetensors``
    (``pip install torch-fitkit[safetensors]``), else a ``torch.save`` state dict. Either loads
    with :meth:`fitkit.Model.load_weights` at any world size, or with plain torch.

    Args:
        checkpoint: a folder written by ``save_checkpoint`` (or ``BackupAndRestore``) under
            ``strategy="fsdp"``.
        path: the weights file to write (atomically).

    Returns:
        The names of the tensors written.

    Raises:
        FileNotFoundError / CheckpointError: see :func:`check_sharded`.

    Example:
        >>> import tempfile, os, fitkit
        >>> d = tempfile.mkdtemp()
        >>> model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> model.save_checkpoint(os.path.join(d, "ck"), sharded=True)
        >>> consolidate_weights(os.path.join(d, "ck"), os.path.join(d, "w.pt"))
        ['bias', 'weight']
    """
    import torch.distributed.checkpoint as dcp

    from fitkit.files.safe_tensors import save_safetensors
    from fitkit.files.writing import atomic_save

    meta = check_sharded(checkpoint)
    dtypes = {k: v.properties.dtype for k, v in meta.state_dict_metadata.items() if hasattr(v, "properties")}
    state = {
        f"model.{k}": torch.empty(shape, dtype=dtypes[f"model.{k}"]) for k, shape in sharded_shapes(meta).items()
    }
    with quiet_single_process():
        dcp.load(state, checkpoint_id=os.fspath(checkpoint), no_dist=True)
    weights = {k[len("model."):]: v for k, v in sorted(state.items())}
    if os.fspath(path).endswith(".safetensors"):
        save_safetensors(weights, path)
    else:
        atomic_save(weights, path)
    return list(weights)


def remove_path(path: str | os.PathLike) -> None:
    """Delete a file or a folder (a sharded checkpoint) if it exists."""
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)
