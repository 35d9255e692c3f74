"""Sharded checkpoints on disk: a ``torch.distributed.checkpoint`` (DCP) folder and its checks.

A sharded checkpoint is a folder: DCP's ``.metadata`` and one ``__<rank>_<n>.distcp`` file
per writing rank (the module's and the optimizer's tensors, keys ``model.<name>`` and
``optim.state.<name>.<field>``), plus :data:`STATE_NAME`, a small fitkit file with everything
else (epoch, position, RNG states, scheduler, callbacks, history), checksummed like a
one-file checkpoint, and last the manifest of every file's size and SHA-256
(:mod:`fitkit.files.manifest`), checked before a load. The folder is written under a temp
name and renamed when complete (:mod:`fitkit.distributed.dcp`), so a folder without both ``.metadata`` and
:data:`STATE_NAME` is a write that did not finish, and is never taken for a checkpoint.

This module reads such folders without a process group (one process, offline).

No pickle of a checkpoint folder runs code: DCP's own reader unpickles ``.metadata`` with plain
``pickle`` and the non-tensor items of a shard with ``torch.load(weights_only=False)``;
fitkit reads every folder through :func:`safe_reader` instead, which unpickles ``.metadata``
with an unpickler that admits only DCP's metadata classes (:func:`read_metadata`) and loads a
shard's pickled items with ``weights_only=True`` first. A crafted folder is refused with
:class:`~fitkit.files.reading.RefusedCheckpointError` before anything in it runs.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch

from fitkit.files.reading import _FIX_DAMAGED, CheckpointError, RefusedCheckpointError, safe_load
from fitkit.files.writing import disk_full_errno

__all__ = [
    "STATE_NAME",
    "is_sharded",
    "check_sharded",
    "sharded_shapes",
    "consolidate_weights",
    "remove_path",
    "read_metadata",
    "safe_reader",
]

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


# What DCP's ``.metadata`` pickles: its metadata dataclasses and enum, the storage info of the
# file system writer, torch.Size, dtypes and layouts by name, and the checkpoint id as a path.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the classes DCP's metadata is made of (every one a plain dataclass, enum or
    value type: calling it runs no code of the file's choosing); anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        import importlib

        if (module, name) in _METADATA_GLOBALS or (module in _METADATA_MODULES and "." not in name):
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and obj.__module__ == module or (module, name) in _METADATA_GLOBALS:
                return obj
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")


class _Refused(pickle.UnpicklingError):
    """A global the metadata unpickler does not admit (named in the message)."""


def read_metadata(path: str | os.PathLike) -> Any:
    """Unpickle a sharded checkpoint's ``.metadata`` safely: only DCP's metadata classes load.

    Args:
        path: the ``.metadata`` file.

    Returns:
        The ``torch.distributed.checkpoint.metadata.Metadata`` it holds.

    Raises:
        RefusedCheckpointError: the file names any other class or function (pickled code;
            refused before it ran). A ``CheckpointError`` and a ``RuntimeError``.
        CheckpointError: the file is damaged or does not hold DCP metadata.

    Example:
        >>> import tempfile, os, fitkit
        >>> d = os.path.join(tempfile.mkdtemp(), "ck")
        >>> model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> model.save_checkpoint(d, sharded=True)
        >>> sorted(read_metadata(os.path.join(d, ".metadata")).state_dict_metadata)[:2]
        ['model.bias', 'model.weight']
        >>> with open(os.path.join(d, ".metadata"), "wb") as f:
        ...     _ = f.write(pickle.dumps(print))  # a pickle that names a function
        >>> read_metadata(os.path.join(d, ".metadata"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        fitkit.files.RefusedCheckpointError: Refused to load '...metadata': it names builtins.print, ...
    """
    from torch.distributed.checkpoint.metadata import Metadata

    where = repr(str(path))
    try:
        with open(path, "rb") as f:
            data = f.read()
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise RefusedCheckpointError(
            f"Refused to load {where}: it names {e}, which is not part of a sharded checkpoint's index "
            "(pickled code or objects; nothing in it ran). Fix: use a checkpoint written by "
            "save_checkpoint / BackupAndRestore, from a source you trust."
        ) from None
    except OSError:
        raise
    except Exception as e:  # whatever a damaged pickle makes the unpickler meet
        raise CheckpointError(f"{where} cannot be read ({type(e).__name__}: {e}). {_FIX_DAMAGED}") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise CheckpointError(
            f"{where} does not hold a sharded checkpoint's index (it holds a {type(meta).__name__}). {_FIX_DAMAGED}"
        )
    return meta


class _SafeBytes:
    """A load planner whose pickled (non-tensor) items are first loaded with ``weights_only=True``
    (DCP's planner loads them with ``weights_only=False``); every other call goes to ``planner``."""

    def __init__(self, planner: Any, folder: str):
        self._planner, self._folder = planner, folder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        where = repr(self._folder)
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            if "Unsupported global" in str(e):  # else damage: nothing the file holds ran either way
                raise RefusedCheckpointError(
                    f"Refused to load {where}: its item {read_item.dest_index.fqn!r} holds pickled objects that "
                    "could run code (nothing in it ran). Fix: use a checkpoint written by save_checkpoint / "
                    "BackupAndRestore, from a source you trust."
                ) from None
            raise CheckpointError(
                f"{where} is damaged: its item {read_item.dest_index.fqn!r} cannot be read "
                f"({_torch_error(e)}). {_FIX_DAMAGED}"
            ) from None
        value.seek(0)
        self._planner.load_bytes(read_item, value)  # the same bytes, proven free of code


class _Dry:
    """A load planner that reads everything and keeps nothing: each tensor piece lands in a
    scratch tensor of its own (freed at once) and each pickled item is dropped, so a load with it
    finds every damaged piece before one byte of the destination changes."""

    def __init__(self, planner: Any):
        self._planner = planner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        dest = self._planner.lookup_tensor(read_item.dest_index)
        return torch.empty(tuple(read_item.lengths), dtype=dest.dtype)

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        pass


def safe_reader(path: str | os.PathLike, dry: bool = False) -> Any:
    """DCP's file system reader for ``path`` without its plain unpickling: ``.metadata`` through
    :func:`read_metadata`, pickled items through ``weights_only=True`` (pass it as
    ``storage_reader`` to ``torch.distributed.checkpoint.load``).

    ``dry=True``: every piece is read and checked, none is kept (the destination is left as
    it was): run it first, then load in place, so a damaged piece changes nothing and the load
    needs no second copy of the state.
    """
    reader = _safe_reader_class()(path)
    reader.dry = dry
    return reader


@functools.cache
def _safe_reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader  # imported at first use: a slow import

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            rank = kwargs.get("rank")
            meta = read_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

        dry = False

        def read_data(self, plan: Any, planner: Any) -> Any:
            inner = _Dry(planner) if self.dry else planner
            return super().read_data(plan, cast(Any, _SafeBytes(inner, os.fspath(self.path))))

    return _SafeReader


@contextlib.contextmanager
def torch_errors(folder: str | os.PathLike, saving: bool = False) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` (a ``BaseException``, which ``except Exception`` misses)
    into fitkit's errors: the first rank's fitkit error as it is (a refused pickle, a damaged
    file), an ``OSError`` (a full disk, a read-only folder) with the folder and the file named,
    else a :class:`CheckpointError` (a load) or ``RuntimeError`` (a save) naming the folder."""
    from torch.distributed.checkpoint import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failures = [f[0] if isinstance(f, tuple) else f for _, f in sorted(e.failures.items())]
        where = repr(os.fspath(folder))
        for exc in failures:
            if isinstance(exc, CheckpointError):
                raise exc from None
        for exc in failures:
            if isinstance(exc, OSError):
                name = f" (file {exc.filename!r})" if exc.filename else ""
                what = "written" if saving else "read"
                raise type(exc)(
                    exc.errno,
                    f"The sharded checkpoint {where} could not be {what}{name}: {exc.strerror or exc}. "
                    + (
                        "Fix: free space or pick a writable folder; the previous checkpoint is kept."
                        if saving
                        else "Fix: check that the folder is readable."
                    ),
                    exc.filename,
                ) from None
        first = failures[0] if failures else e
        full = next((n for n in map(disk_full_errno, failures) if n is not None), None) if saving else None
        if full is not None:  # torch's short write on a full disk: "unexpected pos 704 vs 598"
            raise OSError(
                full,
                f"The sharded checkpoint {where} could not be written: {os.strerror(full)} ({first}). "
                "Fix: free space or pick another folder; the previous checkpoint is kept.",
                os.fspath(folder),
            ) from None
        if saving:
            raise RuntimeError(
                f"The sharded checkpoint {where} could not be written: {type(first).__name__}: {first}"
            ) from None
        raise CheckpointError(
            f"{where} is damaged: its shards cannot be read ({_torch_error(first)}). {_FIX_DAMAGED}"
        ) from None


def _torch_error(e: BaseException) -> str:
    """``Type: message``, without torch's advice to load with ``weights_only=False``."""
    text = str(e).splitlines()[0][:300] if str(e) else ""
    return type(e).__name__ if not text or "weights_only" in str(e) else f"{type(e).__name__}: {text}"


def _metadata(path: Path) -> Any:
    return read_metadata(path / ".metadata")


def check_sharded(path: str | os.PathLike, digests: bool = True) -> Any:
    """Check that a sharded checkpoint is complete and intact; return its DCP metadata.

    The two index files exist, every shard file the index names is there and long enough, and
    (``digests``) every file matches the folder's manifest, size and SHA-256
    (:func:`fitkit.files.manifest.verify_manifest`: each byte is read once; a folder written
    before manifests existed has none and is checked without).

    Raises:
        FileNotFoundError: no folder at ``path``.
        CheckpointError: ``.metadata`` or :data:`STATE_NAME` is missing (a write that did not
            finish), unreadable, or a shard file is missing or shorter than the index says.
        RefusedCheckpointError: ``.metadata`` holds pickled code (see :func:`read_metadata`).
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
    meta = _metadata(p)  # refuses pickled code
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
    if digests:
        from fitkit.files.manifest import verify_manifest

        verify_manifest(p)
    return meta


def read_state(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """The non-tensor part (:data:`STATE_NAME`), checksum verified (see :func:`safe_load`)."""
    return safe_load(Path(path) / STATE_NAME, map_location)


def sharded_shapes(meta: Any, prefix: str = "model.") -> dict[str, torch.Size]:
    """``{name: global shape}`` of the tensors under ``prefix`` in a DCP index (prefix removed)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        k[len(prefix) :]: v.size
        for k, v in meta.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }


def consolidate_weights(checkpoint: str | os.PathLike, path: str | os.PathLike) -> list[str]:
    """Turn a sharded checkpoint folder into one weights file, offline, on one process.

    The module's tensors are read from every shard at their full size (the optimizer state is
    not read; a tied tensor, stored once, is given each of its names again, one tensor) and
    written to ``path``: safetensors when it ends in ``.safetensors``
    (``pip install ".[safetensors]"`` from a checkout), else a ``torch.save`` state dict. Either loads
    with :meth:`fitkit.Model.load_weights` at any world size, or with plain torch.

    Args:
        checkpoint: a folder written by ``save_checkpoint`` (or ``BackupAndRestore``) under
            ``strategy="fsdp"``.
        path: the weights file to write (atomically).

    Returns:
        The names of the tensors written.

    Raises:
        FileNotFoundError, CheckpointError: see :func:`check_sharded`.

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
    state = {f"model.{k}": torch.empty(shape, dtype=dtypes[f"model.{k}"]) for k, shape in sharded_shapes(meta).items()}
    with quiet_single_process(), torch_errors(checkpoint):
        dcp.load(state, checkpoint_id=os.fspath(checkpoint), storage_reader=safe_reader(checkpoint), no_dist=True)
    weights = {k[len("model.") :]: v for k, v in sorted(state.items())}
    tied = read_state(checkpoint).get("tied") or {}  # stored once: the other names are the same tensor
    weights.update({a: weights[k] for a, k in sorted(tied.items()) if a not in weights and k in weights})
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
