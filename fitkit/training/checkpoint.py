"""Weights and full training checkpoints: file input and output over the run's registry.

A checkpoint is one file that ``torch.load(path, weights_only=True)`` reads: plain containers
of tensors, numbers and strings. fitkit itself only ever loads with ``weights_only=True``, so
a file carrying pickled code is refused before that code can run.

What a checkpoint holds, how each part checks it and when each part takes it is the registry's
(:class:`fitkit.training.state.RunState`); this module reads and writes the files and walks it:
read, check every part (nothing changes on a problem), then load every part.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fitkit.distributed import dcp as _dcp
from fitkit.distributed import progress as _progress
from fitkit.distributed.group import is_rank_zero
from fitkit.files import (
    CheckpointError,
    atomic_save,
    is_sharded,
    load_safetensors,
    safe_load,
    save_safetensors,
    state_dict_differences,
)
from fitkit.files.swap import readable_path, restore_interrupted
from fitkit.training import partial as _partial
from fitkit.training import run_files as _run_files
from fitkit.training.state import ResumePoint, RunState, raise_differences, rng_state, set_rng_state

if TYPE_CHECKING:
    from fitkit.model import Model

__all__ = [
    "atomic_save",
    "safe_load",
    "is_rank_zero",
    "check_path",
    "checkpoint_state",
    "load_checkpoint",
    "ResumePoint",
    "rng_state",
    "set_rng_state",
]


def checkpoint_state(model: Model, tensors: bool = True) -> dict[str, Any]:
    """The full training state of ``model`` as a ``weights_only``-loadable dict (every part of
    its :class:`~fitkit.training.state.RunState`).

    ``tensors=False``: without the module and optimizer states (``None``), the part a sharded
    checkpoint keeps beside its shards.
    """
    return RunState(model, tensors).state_dict()


def load_checkpoint(model: Model, path: str | os.PathLike, taken: tuple[str, ...] = _partial.PART_NAMES) -> int:
    """Restore ``model``'s state from ``path`` and leave the position for the next ``fit``.

    All or nothing: every part taken checks the file's state before any part changes.
    ``taken``: the parts to load (:func:`fitkit.training.partial.taken_parts`); the others are
    neither checked nor loaded, and what was taken is logged.

    Returns:
        The epoch to pass as ``initial_epoch`` (0 without ``"position"``).
    """
    check_path(path)
    path = readable_path(path)  # a save killed between its renames kept the old checkpoint beside it
    if taken != _partial.PART_NAMES:
        return _load_partial(model, path, taken)
    if is_sharded(path):  # a folder of shards (strategy="fsdp"): each rank reads its own
        state, problems, differences = _dcp.inspect(model, path)
        run = RunState(model, tensors=False)
        run.check(state, path, problems, differences)
        _dcp.load_tensors(model, path)
    else:
        state = safe_load(path, model.device)
        if not isinstance(state, dict) or "fitkit_version" not in state:
            raise CheckpointError(f"{str(path)!r} is not a fitkit checkpoint. Fix: use load_weights for a state dict.")
        run = RunState(model)
        run.check(state, path)
    model._core.await_resume(run.load_state_dict(state))
    return int(state["epoch"])


def _load_partial(model: Model, path: str | os.PathLike, taken: tuple[str, ...]) -> int:
    """The parts ``taken`` of a one-file checkpoint, all or nothing among them."""
    if is_sharded(path):
        raise ValueError(
            f"{str(path)!r} is a sharded checkpoint (a folder), which loads whole. Fix: load it whole, or "
            "write a one-file checkpoint (save_checkpoint(path, sharded=False)) to load part of it."
        )
    state = safe_load(path, model.device)
    if not isinstance(state, dict) or "fitkit_version" not in state:
        raise CheckpointError(f"{str(path)!r} is not a fitkit checkpoint. Fix: use load_weights for a state dict.")
    run = RunState(model, only=_partial.registry_names(taken))
    run.check(state, path)
    run.load_state_dict(state)
    left = [n for n in _partial.PART_NAMES if n not in taken]
    logging.getLogger("fitkit").info(
        "Loaded %s from %r; left out: %s.", ", ".join(taken), str(path), ", ".join(left) or "nothing"
    )
    following = _partial.for_next_fit(state, taken)
    if following is None:
        return 0  # no position: the next fit starts afresh
    model._core.await_resume(ResumePoint(following))
    return int(state["epoch"])


def check_path(path: object) -> None:
    """``TypeError`` unless ``path`` is a str or a path (before anything is read or gathered).

    Example:
        >>> check_path(3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: Expected `path` to be a str or a path. Received: path=3 (int). Fix: ...
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(
            f"Expected `path` to be a str or a path. Received: path={path!r} ({type(path).__name__}). "
            "Fix: pass a file name such as 'model.pt'."
        )


def save_checkpoint(
    model: Model, path: str | os.PathLike, sharded: bool | None = None, async_save: bool = False
) -> None:
    """One file written by rank 0, or (``sharded``; the default under FSDP) a folder of shards."""
    check_path(path)
    if sharded is None:
        sharded = _dcp.is_sharded_default(model)
    if not isinstance(sharded, bool) or not isinstance(async_save, bool):
        raise TypeError(
            f"Expected `sharded` (True, False or None) and `async_save` to be bools. Received: "
            f"sharded={sharded!r}, async_save={async_save!r}."
        )
    if async_save and not sharded:
        raise ValueError(
            "async_save=True writes a sharded checkpoint (a folder, torch.distributed.checkpoint), but "
            "this one is a single file. Fix: pass sharded=True, or use strategy='fsdp' under torchrun."
        )
    with _progress.doing("writing a checkpoint"):  # a rank that hangs here is named so
        _write(model, path, sharded, async_save)


def _write(model: Model, path: str | os.PathLike, sharded: bool, async_save: bool) -> None:
    if sharded:
        _dcp.save(model, checkpoint_state(model, tensors=False), path, async_save)
        return
    _dcp.wait()  # a sharded save in flight finishes first (saves stay in call order)
    state = checkpoint_state(model)
    if is_rank_zero():
        restore_interrupted(path)  # a swap killed between its renames: its old checkpoint is the one to replace
        if is_sharded(path):  # a folder there (of an FSDP run): replaced once the file is complete
            tmp = os.path.join(os.path.dirname(os.fspath(path)) or ".", f".{os.path.basename(path)}.file.tmp")
            atomic_save(state, tmp)
            _dcp.swap_into_place(tmp, path)
        else:
            atomic_save(state, path)
        _run_files.adopt(model, path)  # a file of a keep_last pattern joins its rotation


def trainable_names(model: Model) -> set[str]:
    """The state-dict keys of the module's parameters that have ``requires_grad`` (e.g. LoRA adapters)."""
    return {name for name, p in model.module.named_parameters() if p.requires_grad}


def check_trainable_only(value: object) -> None:
    """Require a bool for ``trainable_only`` (a string such as ``"no"`` would read as true).

    Example:
        >>> check_trainable_only("no")
        Traceback (most recent call last):
        ...
        TypeError: Expected `trainable_only` to be a bool. Received: trainable_only='no'. Fix: pass True or False.
    """
    if not isinstance(value, bool):
        raise TypeError(
            f"Expected `trainable_only` to be a bool. Received: trainable_only={value!r}. Fix: pass True or False."
        )


def save_weights(model: Model, path: str | os.PathLike, trainable_only: bool = False) -> None:
    """The module's state dict to ``path`` (rank 0 writes; gathering is collective under FSDP).

    A path ending in ``.safetensors`` writes safetensors (tied weights stored once);
    ``trainable_only`` keeps the trainable parameters alone.
    """
    check_trainable_only(trainable_only)
    check_path(path)
    keep = trainable_names(model) if trainable_only else None
    if keep is not None and not keep:  # the same on every rank: all refuse before the collective
        raise ValueError(
            f"save_weights(trainable_only=True) would write an empty file to {os.fspath(path)!r}: no parameter of "
            "the module requires grad (all are frozen). Received: trainable_only=True. Fix: unfreeze the "
            "parameters to save (p.requires_grad_(True)), or pass trainable_only=False to save every weight."
        )
    state = model.state_dict()  # unwrapped: no `module.` prefixes, full tensors under FSDP
    if keep is not None:
        state = {k: v for k, v in state.items() if k in keep}
    if is_rank_zero():
        if os.fspath(path).endswith(".safetensors"):
            save_safetensors(state, path)
        else:
            atomic_save(state, path)


def load_weights(model: Model, path: str | os.PathLike, strict: bool = True, trainable_only: bool = False) -> None:
    """A state dict (or a checkpoint's module part) from ``path`` into ``model``, all or nothing;
    ``trainable_only``: the file holds the trainable parameters alone (compared with those)."""
    state: Any
    check_trainable_only(trainable_only)
    check_path(path)
    if os.fspath(path).endswith(".safetensors"):
        state = load_safetensors(path, model.device)
    else:
        state = safe_load(path, model.device)
    if isinstance(state, dict) and "module" in state and "fitkit_version" in state:
        state = state["module"]
    expected = model.module.state_dict()
    keep = trainable_names(model)
    if trainable_only:
        expected = {k: v for k, v in expected.items() if k in keep}
    elif strict:
        _refuse_a_trainable_only_file(path, state, keep, expected)
    raise_differences(path, state_dict_differences(expected, state, strict))
    model.load_state_dict(state, strict=strict and not trainable_only)


def _refuse_a_trainable_only_file(
    path: str | os.PathLike[str], state: Mapping[str, object], trainable: set[str], expected: dict[str, Any]
) -> None:
    """A file of the trainable parameters alone (``save_weights(..., trainable_only=True)``, e.g.
    LoRA adapters) loaded as a whole model: one line that names ``trainable_only``, instead of one
    line per frozen weight missing from the file."""
    if not isinstance(state, dict) or not state or set(state) == set(expected) or not set(state) <= trainable:
        return
    raise ValueError(
        f"{str(path)!r} holds only trainable parameters ({len(state)} of the module's {len(expected)} "
        "state-dict entries), as save_weights(..., trainable_only=True) writes them (adapters such as "
        "LoRA's); nothing was loaded. Expected `trainable_only=True` to load such a file. Received: "
        f"trainable_only=False. Fix: model.load_weights({str(path)!r}, trainable_only=True)."
    )
