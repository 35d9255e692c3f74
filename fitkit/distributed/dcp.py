"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank its own shards.

Under ``strategy="fsdp"`` :meth:`fitkit.Model.save_checkpoint` (and so ``BackupAndRestore``)
writes a folder (see :mod:`fitkit.files.sharded`): every rank writes only its shards of the
module and optimizer state (``torch.distributed.checkpoint.state_dict.get_state_dict``), so
no rank ever holds the full state; a load reads into the ranks' own shards at any world size,
one process without a process group included, or into a DDP / plain module.

Guarantees, as for a one-file checkpoint:

- **Atomic.** The folder is written as ``.<name>.tmp`` next to ``path``; when every rank has
  written and DCP's index is there, rank 0 adds the non-tensor state (checksummed) and renames
  the folder into place. A folder without both index files is never taken for a checkpoint.
  An old checkpoint there is kept beside it until the new one is in place, and every load
  finds it there if a kill came between the two renames (:mod:`fitkit.files.swap`).
- **Damage named, all or nothing.** A load checks the index files, every shard file's
  size and every file's SHA-256 against the manifest rank 0 writes last (on rank 0 alone, the
  verdict sent to every rank), then compares the names and shapes of the tensors (and the optimizer class, parameter
  groups and scheduler) with the model before reading anything into it; the tensors are read
  into a fresh state dict and set only when all were read.
- **Async** (``async_save=True``): the state is copied off the tensors being trained (into
  pinned memory on a GPU) and written by a background thread over a gloo group of its own;
  training blocks only for that copy. At most one save is in flight: the next save, a
  SIGTERM's backup, the end of ``fit`` and interpreter exit wait for it.
"""

from __future__ import annotations

import atexit
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fitkit.distributed.group import is_distributed, is_rank_zero
from fitkit.files import CheckpointError, atomic_save, optimizer_differences
from fitkit.files.manifest import write_manifest
from fitkit.files.sharded import (
    STATE_NAME,
    check_sharded,
    quiet_single_process,
    read_metadata,
    read_state,
    remove_path,
    safe_reader,
    sharded_shapes,
    torch_errors,
)
from fitkit.files.swap import restore_interrupted, swap_into_place

if TYPE_CHECKING:
    from fitkit.model import Model

__all__ = ["save", "inspect", "load_tensors", "wait", "is_sharded_default"]

_group: Any = None  # the gloo group of checkpoint writes (created at the first sharded save)
_pending: _Pending | None = None
_atexit = False


def is_sharded_default(model: Model) -> bool:
    """Whether ``save_checkpoint`` writes a sharded folder by default: under FSDP."""
    return model._core.parallel is not None and model._core.parallel.fsdp


def _ckpt_group() -> Any:
    global _group
    if _group is None and is_distributed():
        _group = dist.new_group(backend="gloo")  # collective: every rank saves together
    return _group


def _optimizer(model: Model) -> torch.optim.Optimizer:
    """The compiled optimizer (a sharded checkpoint holds its shards)."""
    if model.optimizer is None:
        raise RuntimeError("A sharded checkpoint holds the optimizer's state. Fix: call model.compile() first.")
    return model.optimizer


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """Each other name of a tied tensor (GPT's head weight that is its embedding's) -> its first
    name in the module's state dict. A sharded checkpoint stores the tensor once, under that
    first name; the load ties the others to it again (they are the same tensor in the module).

    Example:
        >>> from fitkit.layers import GPT
        >>> tied_names(GPT(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=4))
        {'lm_head.weight': 'embed.wte.weight'}
    """
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in first:
            out[name] = first[id(t)]
        else:
            first[id(t)] = name
    return out


def _tensor_state(model: Model) -> dict[str, Any]:
    """The module's (each tied tensor once: :func:`tied_names`) and the optimizer's tensors."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model.module, _optimizer(model))
    tied = tied_names(model.module)
    return {"model": {k: v for k, v in msd.items() if k not in tied}, "optim": osd}


class _Pending:
    """One save in flight: its future, and the finishing step (rank 0's rename) run once."""

    def __init__(self, future: Any, finish: Any, stager: Any, path: Path):
        self.future, self._finish, self._stager, self.path = future, finish, stager, path
        self._lock = threading.Lock()
        self._done = False
        future.add_done_callback(lambda _: self.finish())

    def finish(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            try:
                if self.future.exception() is None:
                    self._finish()
            finally:
                if self._stager is not None:
                    self._stager.close()

    def wait(self) -> None:
        with torch_errors(self.path, saving=True):
            self.future.result()  # raises the background write's error here
        self.finish()


def wait() -> None:
    """Wait for the save in flight (if any) and its rename; re-raise its error."""
    global _pending
    pending, _pending = _pending, None
    if pending is not None:
        pending.wait()


def save(model: Model, state: dict[str, Any], path: str | os.PathLike, async_save: bool = False) -> None:
    """Write ``model``'s sharded checkpoint folder at ``path`` (every rank calls it).

    Args:
        model: the compiled :class:`fitkit.Model`.
        state: the non-tensor part (``checkpoint_state(model, tensors=False)``).
        path: the folder; an existing file or folder there is replaced when the new one is complete.
        async_save: return once the tensors are staged; the write finishes in the background.
    """
    import torch.distributed.checkpoint as dcp

    global _pending, _atexit
    wait()  # at most one save in flight
    final = Path(path)
    tmp = final.parent / f".{final.name}.tmp"
    group = _ckpt_group()
    if is_rank_zero():
        final.parent.mkdir(parents=True, exist_ok=True)
        restore_interrupted(final)  # a swap killed between its renames: its old checkpoint goes back first
        remove_path(tmp)  # what a killed write left
    if group is not None:
        dist.barrier(group=group)  # nobody writes into the folder before it is cleared
    tensors = _tensor_state(model)
    state = {
        **state,
        "format": "dcp",
        "world_size": dist.get_world_size() if is_distributed() else 1,
        "param_groups_names": _group_names(model),
        "tied": tied_names(model.module),
    }

    def finish() -> None:
        if is_rank_zero():
            atomic_save(state, tmp / STATE_NAME)
            write_manifest(tmp)  # every rank's files are written: each one's size and SHA-256, last
            swap_into_place(tmp, final)

    no_dist = group is None
    if not async_save:
        with quiet_single_process(), torch_errors(final, saving=True):
            dcp.save(tensors, checkpoint_id=os.fspath(tmp), process_group=group, no_dist=no_dist)
        finish()
        if group is not None:
            dist.barrier(group=group)  # every rank may read the checkpoint now
        return
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
        )
    )
    future = dcp.async_save(
        tensors, checkpoint_id=os.fspath(tmp), process_group=group, async_stager=stager, no_dist=no_dist
    )
    _pending = _Pending(future, finish, stager, final)
    if not _atexit:
        _atexit = True
        atexit.register(wait)


def _group_names(model: Model) -> list[list[str]]:
    """The parameter names of each optimizer group (what a sharded optimizer state is keyed by)."""
    fqn = {id(p): n for n, p in model.module.named_parameters()}
    return [[fqn.get(id(p), "?") for p in g["params"]] for g in _optimizer(model).param_groups]


def differences(model: Model, meta: Any, state: dict[str, Any]) -> list[str]:
    """What does not fit between a sharded checkpoint and ``model``, from its index alone."""
    from fitkit.files import state_dict_differences

    dtypes = {k: v.properties.dtype for k, v in meta.state_dict_metadata.items() if hasattr(v, "properties")}
    shapes = sharded_shapes(meta)
    tied = tied_names(model.module)  # stored once (an older folder may hold them twice: not compared)
    saved = {
        k: torch.empty(shape, dtype=dtypes[f"model.{k}"], device="meta") for k, shape in shapes.items() if k not in tied
    }
    mine = {k: v for k, v in model.module.state_dict().items() if k not in tied}
    out = state_dict_differences(mine, saved)  # DTensors: global shapes
    names = state.get("param_groups_names") or []
    as_saved = {"state": {}, "param_groups": [{"params": list(range(len(g)))} for g in names]}
    out += optimizer_differences(_optimizer(model), as_saved, state.get("optimizer_class"))
    if not out and names != _group_names(model):
        out.append("optimizer: its parameter groups hold other parameters than the model's")
    return out


def inspect(model: Model, path: str | os.PathLike) -> tuple[dict[str, Any], list[str], list[str]]:
    """A sharded checkpoint's non-tensor part, what in it contradicts its own shards, and what
    does not fit ``model`` (nothing read into the model). Every rank calls it (a save of this
    process still in flight is waited for).

    Raises:
        FileNotFoundError: no folder at ``path``.
        CheckpointError: an incomplete or damaged folder.
        ValueError: a folder that is not a fitkit sharded checkpoint.
    """
    wait()
    meta = check_sharded(path, digests=False)
    _verify_once(path)
    state = read_state(path, model.device)
    if not isinstance(state, dict) or state.get("format") != "dcp":
        raise ValueError(
            f"{str(path)!r} is not a fitkit sharded checkpoint. Fix: pass a folder written by save_checkpoint."
        )
    names = state.get("param_groups_names")
    if names is not None and not (
        isinstance(names, list) and all(isinstance(g, list) and all(isinstance(n, str) for n in g) for g in names)
    ):
        problem = f"checkpoint['param_groups_names'] is {names!r:.60}, expected a list of lists of parameter names"
        return state, [*_writer_problems(meta, state), problem], []  # nothing to compare the groups with
    return state, _writer_problems(meta, state), differences(model, meta, state)


def _verify_once(path: str | os.PathLike) -> None:
    """Check the folder against its manifest on rank 0 alone (each byte is read once), and
    raise the same error on every rank."""
    from fitkit.files.manifest import verify_manifest

    if not is_distributed():
        verify_manifest(path)
        return
    box: list[Any] = [None]
    error: Exception | None = None
    if is_rank_zero():
        try:
            verify_manifest(path)
        except Exception as e:  # every rank must leave the broadcast below
            error, box = e, [(isinstance(e, CheckpointError), str(e))]
    dist.broadcast_object_list(box, src=0, group=_ckpt_group())
    if error is not None:
        raise error
    if box[0] is not None:
        damaged, text = box[0]
        raise (CheckpointError if damaged else RuntimeError)(text)


def _writer_problems(meta: Any, state: dict[str, Any]) -> list[str]:
    """The ranks whose shard files the index names against the world size the state claims
    (``__<rank>_<n>.distcp``: a folder written by N processes has no file of a rank >= N)."""
    world = state.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        return []  # a wrong type or range is the registry's to report
    ranks = set()
    for info in (meta.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if name.startswith("__") and "_" in name[2:]:
            head = name[2:].split("_", 1)[0]
            if head.isdigit():
                ranks.add(int(head))
    if ranks and max(ranks) >= world:
        return [f"checkpoint['world_size'] is {world}, but its shards were written by {max(ranks) + 1} processes"]
    return []


def _state_from_index(model: Model, meta: Any) -> None:
    """Give an optimizer without state the tensors the checkpoint holds for it, empty (shaped
    and typed by the index; a parameter-shaped one sharded as its parameter): what the load
    then fills in place. (``get_state_dict`` would create the state by a step on zero
    gradients: a transient copy of every parameter.)"""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    optimizer = _optimizer(model)
    index = meta.state_dict_metadata
    # The optimizer's own numbering of its parameters (that of its state_dict)
    order = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    states: dict[int, dict[str, Any]] = {}
    for fqn, p in model.module.named_parameters():
        if id(p) not in order:
            continue
        prefix = f"optim.state.{fqn}."
        entries = {
            k[len(prefix) :]: v for k, v in index.items() if k.startswith(prefix) and "." not in k[len(prefix) :]
        }
        if not entries:
            continue
        state: dict[str, Any] = {}
        for name, md in entries.items():
            if not isinstance(md, TensorStorageMetadata):
                return  # a pickled state value: the state is left to torch's own way of creating it
            shape, dtype = tuple(md.size), md.properties.dtype
            state[name] = (
                torch.empty_like(p, dtype=dtype)
                if shape == tuple(p.shape) and shape
                else torch.zeros(shape, dtype=dtype)
            )
        states[order[id(p)]] = state
    # all or nothing, through the optimizer's own loader
    optimizer.load_state_dict({"state": states, "param_groups": optimizer.state_dict()["param_groups"]})


def load_tensors(model: Model, path: str | os.PathLike) -> None:
    """Read the module and optimizer shards into their own tensors, in place (every rank).

    Each rank reads only the pieces of its own shards; a plain module reads the full tensors.
    A first pass reads and checks every piece and keeps none (a damaged or refused piece then
    changes nothing); the second reads them into the model's and the optimizer's own tensors,
    so the load needs no second copy of the state (its peak is the state plus one piece).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    optimizer = _optimizer(model)
    unset = optimizer.state_dict() if not optimizer.state else None  # filled below; put back if the load fails
    if unset is not None:
        _state_from_index(model, read_metadata(Path(path) / ".metadata"))
    state = _tensor_state(model)  # the module's and the optimizer's own tensors
    try:
        for dry in (True, False):
            with quiet_single_process(), torch_errors(path):
                dcp.load(
                    state,
                    checkpoint_id=os.fspath(path),
                    storage_reader=safe_reader(path, dry=dry),
                    process_group=_ckpt_group(),
                    no_dist=not is_distributed(),
                )
    except BaseException:
        if unset is not None:  # a failed load leaves the optimizer as it was: no state
            optimizer.load_state_dict(unset)
        raise
    module_state = {**state["model"], **{a: state["model"][k] for a, k in tied_names(model.module).items()}}
    set_state_dict(model.module, optimizer, model_state_dict=module_state, optim_state_dict=state["optim"])
