"""Weights and full training checkpoints: atomic writes, ``weights_only`` loads, exact resume.

A checkpoint is one file that ``torch.load(path, weights_only=True)`` reads: plain containers
of tensors, numbers and strings. fitkit itself only ever loads with ``weights_only=True``, so
a file carrying pickled code is refused before that code can run.

:func:`checkpoint_state` gathers the state (module, optimizer, scheduler, step count, the
running fit's position and totals, RNG states, callbacks, history); :func:`load_checkpoint`
restores the model's part at once and leaves a :class:`ResumePoint` that the next ``fit``
applies where it belongs (callback states after ``on_train_begin``, RNG states at the epoch
start, the position inside the epoch at its first batch).
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any

import numpy as np
import torch

from fitkit.checks import FitkitWarning
from fitkit.distributed import dcp as _dcp
from fitkit.distributed.group import is_rank_zero
from fitkit.files import (
    CheckpointError,
    atomic_save,
    is_sharded,
    load_safetensors,
    optimizer_differences,
    safe_load,
    save_safetensors,
    state_dict_differences,
)
from fitkit.files.content import callback_state_problems, checkpoint_problems
from fitkit.position import Position

__all__ = [
    "atomic_save", "safe_load", "is_rank_zero", "check_path", "checkpoint_state", "load_checkpoint", "ResumePoint",
]


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch and CUDA RNG states, in a ``weights_only``-loadable form."""
    np_state: Any = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(_tuples(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.cpu().numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _tuples(obj: Any) -> Any:
    # random.setstate wants tuples; a round trip may hand back lists.
    if isinstance(obj, (list, tuple)):
        return tuple(_tuples(o) for o in obj)
    return obj


def _stateful(callbacks: Any) -> dict[str, Any]:
    """``{key: callback}`` for every callback whose state travels (not History or the bar)."""
    out: dict[str, Any] = {}
    seen: dict[str, int] = {}
    for cb in callbacks:
        name = type(cb).__name__
        if name in ("History", "ProgressBar"):
            continue
        n = seen.get(name, 0)
        seen[name] = n + 1
        out[name if n == 0 else f"{name}_{n}"] = cb
    return out


def _config(cb: Any) -> dict[str, str]:
    """What a callback's saved state means: the key it watches and the direction."""
    return {k: str(getattr(cb, k)) for k in ("monitor", "mode") if isinstance(getattr(cb, k, None), str)}


class ResumePoint:
    """A loaded checkpoint's position, applied by the next ``fit``.

    Attributes:
        position: the :class:`~fitkit.position.Position` to continue at (epoch, batches and
            samples done in it, pass offset, the epoch's RNG state).
        rng: the RNG states of the moment the checkpoint was taken.
        trackers: the running totals of a checkpoint taken inside an epoch, else ``None``.
    """

    def __init__(self, state: dict[str, Any]):
        self.state = state
        self.position = Position.load_state_dict(state)
        self.rng = state["rng"]
        self.trackers = state.get("trackers")

    @property
    def epoch(self) -> int:
        """The epoch to run next (0-based)."""
        return self.position.epoch

    def apply_callbacks(self, callbacks: Any) -> None:
        """Callback states and the history (after ``on_train_begin``, so they are this fit's)."""
        saved, config = self.state["callbacks"], self.state.get("callback_config", {})
        _raise_problems("The checkpoint", callback_state_problems(saved, _stateful(callbacks.callbacks)), ValueError)
        for key, cb in _stateful(callbacks.callbacks).items():
            if key in config and config[key] != _config(cb):
                warnings.warn(
                    f"{key} was saved watching {config[key]} and now watches {_config(cb)}: its saved "
                    "state (best value, patience) is not restored. Fix: resume with the same settings.",
                    category=FitkitWarning, stacklevel=4,
                )
                continue
            if key in saved:
                cb.load_state_dict(saved[key])
                # Loaded after on_train_begin: the flag that asks the next on_train_begin to
                # keep a loaded state is consumed here.
                if getattr(cb, "_restored", False):
                    cb._restored = False
        history = self.state["history"]
        for cb in callbacks.callbacks:
            if type(cb).__name__ == "History" and history is not None:
                cb.load_state_dict(history)

def checkpoint_state(model: Any, tensors: bool = True) -> dict[str, Any]:
    """The full training state of ``model`` as a ``weights_only``-loadable dict.

    ``tensors=False``: without the module and optimizer states (``None``), the part a sharded
    checkpoint keeps beside its shards.
    """
    from fitkit import __version__

    loop = model._running_fit()
    if loop is not None:
        part = loop.state_dict()  # inside an epoch: its RNG state and totals too
    else:  # no fit running: where the last fit ended (plain values), else the start
        part = dict(model._fit_ended or {"epoch": 0, "step_in_epoch": 0, "samples_in_epoch": 0,
                                         "pass_offset": 0, "batch_size": None})  # fmt: skip
    callbacks = loop.callbacks.callbacks if loop is not None else []
    stepper = model._stepper
    history = model.history.state_dict() if model.history is not None else None
    steps = stepper.state_dict() if stepper is not None else {"scaler": None, "global_step": 0}
    trackers = {k: part.pop(k) for k in ("epoch_rng", "trackers") if k in part}
    state: dict[str, Any] = {
        "fitkit_version": __version__,
        "module": model.state_dict() if tensors else None,
        "optimizer": _optimizer_state_dict(model) if model.optimizer is not None and tensors else None,
        "optimizer_class": type(model.optimizer).__name__ if model.optimizer is not None else None,
        "scheduler": model.scheduler.state_dict() if model.scheduler is not None else None,
        "scheduler_class": type(model.scheduler).__name__ if model.scheduler is not None else None,
        "scaler": steps["scaler"],
        **part,
        "global_step": steps["global_step"],
        "rng": rng_state(),
        "callbacks": {k: cb.state_dict() for k, cb in _stateful(callbacks).items()},
        "callback_config": {k: _config(cb) for k, cb in _stateful(callbacks).items()},
        "history": history,
        **trackers,
    }
    return state


def _optimizer_state_dict(model: Any) -> dict[str, Any]:
    if model._parallel is not None:  # FSDP: gathered, in the plain optimizer's format
        return model._parallel.optimizer_state_dict(model.module, model.optimizer)
    return model.optimizer.state_dict()


def load_checkpoint(model: Any, path: str | os.PathLike) -> int:
    """Restore ``model``'s state from ``path`` and leave the position for the next ``fit``.

    Returns:
        The epoch to pass as ``initial_epoch``.
    """
    check_path(path)
    if is_sharded(path):  # a folder of shards (strategy="fsdp"): each rank reads its own
        state, differences = _dcp.inspect(model, path)
        if getattr(model._stepper, "planned", None) is None:  # else a scheduler built at the first fit
            differences += _scheduler_differences(model.scheduler, state)
        _raise_differences(path, differences)
        _dcp.load_tensors(model, path)
        return _load_rest(model, state)
    state = safe_load(path, model.device)
    if not isinstance(state, dict) or "fitkit_version" not in state:
        raise CheckpointError(
            f"{str(path)!r} is not a fitkit checkpoint. Fix: use load_weights for a state dict."
        )
    # All or nothing: its content, then whether it fits, before changing anything.
    loop = model._running_fit()
    running = loop.callbacks.callbacks if loop is not None else []
    _raise_problems(repr(str(path)), checkpoint_problems(state, _stateful(running)), CheckpointError)
    differences = state_dict_differences(model.module.state_dict(), state["module"])
    if state["optimizer"] is not None:
        differences += optimizer_differences(model.optimizer, state["optimizer"], state.get("optimizer_class"))
    planned = getattr(model._stepper, "planned", None)  # a scheduler built at the first fit
    if planned is None:
        differences += _scheduler_differences(model.scheduler, state)
    _raise_differences(path, differences)
    model.load_state_dict(state["module"])
    if state["optimizer"] is not None:
        if model._parallel is not None:
            model._parallel.load_optimizer_state_dict(model.module, model.optimizer, state["optimizer"])
        else:
            model.optimizer.load_state_dict(state["optimizer"])
    return _load_rest(model, state)


def _load_rest(model: Any, state: dict[str, Any]) -> int:
    """Scheduler, scaler, step count and the resume point (after module and optimizer)."""
    if state["scheduler"] is not None and model.scheduler is not None:
        model.scheduler.load_state_dict(state["scheduler"])
    elif getattr(model._stepper, "planned", None) is not None:
        model._stepper.keep_scheduler_state(state["scheduler"])  # loaded once the first fit has built it
    stepper = model._stepper
    stepper.load_state_dict({"scaler": state["scaler"], "global_step": state["global_step"]})
    if stepper.global_step and model.scheduler is not None:
        # The optimizer did step, in another process: tell torch's scheduler so, or its
        # "scheduler.step() before optimizer.step()" check warns when the resumed epoch
        # has no batch left to run.
        model.optimizer._opt_called = True
    model._await_resume(ResumePoint(state))
    return int(state["epoch"])


def check_path(path: Any) -> None:
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


def save_checkpoint(model: Any, path: str | os.PathLike, sharded: bool | None = None, async_save: bool = False) -> None:
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
    if sharded:
        _dcp.save(model, checkpoint_state(model, tensors=False), path, async_save)
        return
    _dcp.wait()  # a sharded save in flight finishes first (saves stay in call order)
    state = checkpoint_state(model)
    if is_rank_zero():
        if is_sharded(path):  # a folder there (of an FSDP run): replaced once the file is complete
            tmp = os.path.join(os.path.dirname(os.fspath(path)) or ".", f".{os.path.basename(path)}.file.tmp")
            atomic_save(state, tmp)
            _dcp.swap_into_place(tmp, path)
        else:
            atomic_save(state, path)


def save_weights(model: Any, path: str | os.PathLike) -> None:
    """The module's state dict to ``path`` (rank 0 writes; gathering is collective under FSDP).

    A path ending in ``.safetensors`` writes safetensors (tied weights stored once).
    """
    check_path(path)
    state = model.state_dict()  # unwrapped: no `module.` prefixes, full tensors under FSDP
    if is_rank_zero():
        if os.fspath(path).endswith(".safetensors"):
            save_safetensors(state, path)
        else:
            atomic_save(state, path)


def load_weights(model: Any, path: str | os.PathLike, strict: bool = True) -> None:
    """A state dict (or a checkpoint's module part) from ``path`` into ``model``, all or nothing."""
    state: Any
    check_path(path)
    if os.fspath(path).endswith(".safetensors"):
        state = load_safetensors(path, model.device)
    else:
        state = safe_load(path, model.device)
    if isinstance(state, dict) and "module" in state and "fitkit_version" in state:
        state = state["module"]
    _raise_differences(path, state_dict_differences(model.module.state_dict(), state, strict))
    model.load_state_dict(state, strict=strict)


def _scheduler_differences(scheduler: Any, state: dict[str, Any]) -> list[str]:
    """The compiled scheduler against the file's: both or neither, of the same class and fields.

    torch's ``load_state_dict`` of a scheduler is a blind ``__dict__`` update: another class's
    state would load silently and change the schedule.
    """
    saved, saved_class = state.get("scheduler"), state.get("scheduler_class")
    mine = None if scheduler is None else type(scheduler).__name__
    if saved is None:  # none saved (or a callback such as SWA had set it aside): the model's stays
        return []
    if scheduler is None:
        return [f"scheduler: the file has {saved_class or 'one'}, the model none"]
    if saved_class is not None and saved_class != mine:
        return [f"scheduler: {saved_class} in the file, {mine} in the model"]
    keys, now = set(saved), set(scheduler.state_dict())
    if saved_class is None and keys != now:
        return [f"scheduler: its state has the fields {sorted(keys)}, the model's {mine} has {sorted(now)}"]
    return []


def _raise_problems(what: str, problems: list[str], error: type[Exception]) -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise error(
            f"{what} holds content fitkit does not write (damaged, or edited), so nothing was loaded:\n"
            f"{lines}\nFix: use an earlier checkpoint (BackupAndRestore keeps the previous backup as "
            "backup.prev.pt) or the file as fitkit wrote it."
        )


def _raise_differences(path: str | os.PathLike, differences: list[str]) -> None:
    if differences:
        lines = "\n".join(f"  - {d}" for d in differences)
        raise ValueError(
            f"{str(path)!r} does not fit this model, so nothing was loaded:\n{lines}\nFix: build and "
            "compile the model as it was when the file was written (same layers, optimizer class "
            "and parameter groups), or load a matching subset of the weights yourself with "
            "model.load_state_dict({...}, strict=False)."
        )
