"""Weights and full training checkpoints: atomic writes, ``weights_only`` loads, exact resume.

A checkpoint is one file that ``torch.load(path, weights_only=True)`` reads: plain containers
of tensors, numbers and strings. fitkit itself only ever loads with ``weights_only=True``, so
a file carrying pickled code is refused before that code can run.
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any

import numpy as np
import torch

from fitkit.files import (  # atomic_save, safe_load: also re-exported for existing imports
    atomic_save,
    load_safetensors,
    optimizer_differences,
    safe_load,
    save_safetensors,
    state_dict_differences,
)

__all__ = ["atomic_save", "safe_load", "is_rank_zero", "CheckpointMixin"]


def is_rank_zero() -> bool:
    """Whether this process writes files: rank 0 of ``torch.distributed``, or not distributed.

    Callbacks that write files or print check it, so a ``torchrun`` job writes each file once.

    Example:
        >>> is_rank_zero()
        True
    """
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
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


def _callback_key(cb: Any, seen: dict[str, int]) -> str:
    name = type(cb).__name__
    n = seen.get(name, 0)
    seen[name] = n + 1
    return name if n == 0 else f"{name}_{n}"


class CheckpointMixin:
    """``save_weights`` / ``load_weights`` / ``save_checkpoint`` / ``load_checkpoint``."""

    _resume: dict[str, Any] | None = None
    _resumed_steps = 0  # batches of the current epoch a mid-epoch resume skipped

    def save_weights(self, path: str | os.PathLike) -> None:
        """Write the module's state dict to ``path`` atomically (under torchrun: rank 0 writes).

        With ``strategy="fsdp"`` gathering the state is a collective: call it on every rank.
        The file holds only tensors (no optimizer state); reload it with :meth:`load_weights`.
        A path ending in ``.safetensors`` writes safetensors (``pip install fitkit[safetensors]``;
        tied weights are stored once, see :func:`fitkit.files.save_safetensors`).

        Args:
            path: the file to write; missing parent folders are created, an existing file is
                replaced.

        Raises:
            OSError: the file cannot be written (the old file, if any, is left as it was).

        Example:
            >>> import os, tempfile
            >>> from torch import nn
            >>> import fitkit
            >>> _ = torch.manual_seed(0)
            >>> model = fitkit.Model(nn.Linear(2, 1), device="cpu")
            >>> with tempfile.TemporaryDirectory() as d:
            ...     model.save_weights(os.path.join(d, "weights.pt"))
            ...     sorted(torch.load(os.path.join(d, "weights.pt"), weights_only=True))
            ['bias', 'weight']
        """
        state = self.state_dict()  # unwrapped: no `module.` prefixes, full tensors under FSDP
        if is_rank_zero():
            # -- files: safetensors by extension ---------------------------------------------
            if os.fspath(path).endswith(".safetensors"):
                save_safetensors(state, path)
            else:
                atomic_save(state, path)

    def load_weights(self, path: str | os.PathLike, strict: bool = True) -> None:
        """Load a state dict saved by :meth:`save_weights` (or a checkpoint) onto ``model.device``.

        The file is read with ``torch.load(..., weights_only=True)`` (a ``.safetensors`` path
        with safetensors). A file written by :meth:`save_checkpoint` works too: only its module
        weights are loaded. Loading is all-or-nothing: keys, shapes and dtypes are compared
        first, and on any difference the module is left unchanged.

        Args:
            path: the file to read.
            strict: require the file's keys to match the module's exactly, as in
                ``nn.Module.load_state_dict``.

        Raises:
            FileNotFoundError: no file at ``path``.
            RuntimeError: an unsafe file (pickled code; refused before it runs).
            fitkit.files.CheckpointError: a damaged file, or not a checkpoint.
            ValueError: the file does not fit the module (keys with ``strict=True``, shapes,
                dtypes); the message lists every difference. Nothing was loaded.

        Example:
            >>> import os, tempfile
            >>> from torch import nn
            >>> import fitkit
            >>> _ = torch.manual_seed(0)
            >>> model = fitkit.Model(nn.Linear(2, 1), device="cpu")
            >>> other = fitkit.Model(nn.Linear(2, 1), device="cpu")
            >>> with tempfile.TemporaryDirectory() as d:
            ...     model.save_weights(os.path.join(d, "weights.pt"))
            ...     other.load_weights(os.path.join(d, "weights.pt"))
            >>> torch.equal(other.module.weight, model.module.weight)
            True
        """
        # -- files: safetensors by extension, all-or-nothing --------------------------------
        if os.fspath(path).endswith(".safetensors"):
            state = load_safetensors(path, self.device)
        else:
            state = safe_load(path, self.device)
        if isinstance(state, dict) and "module" in state and "fitkit_version" in state:
            state = state["module"]
        _raise_differences(path, state_dict_differences(self.module.state_dict(), state, strict))
        self.load_state_dict(state, strict=strict)

    # -- full training state -----------------------------------------------------------------
    def _position(self) -> tuple[int, int]:
        """(epoch to run next, batches of it already done)."""
        if getattr(self, "_in_epoch", False):
            return self._epoch, self._step_index + 1
        return getattr(self, "_epochs_done", 0), 0

    def checkpoint_state(self) -> dict[str, Any]:
        """The full training state as a ``weights_only``-loadable dict."""
        from fitkit import __version__

        epoch, step = self._position()
        callbacks, seen = {}, {}
        for cb in self._callbacks.callbacks:
            if type(cb).__name__ in ("History", "ProgressBar"):
                continue
            callbacks[_callback_key(cb, seen)] = cb.state_dict()
        state: dict[str, Any] = {
            "fitkit_version": __version__,
            "module": self.state_dict(),
            "optimizer": self._optimizer_state_dict() if self.optimizer is not None else None,
            "optimizer_class": type(self.optimizer).__name__ if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "epoch": epoch,
            "step_in_epoch": step,
            "global_step": self._global_step,
            "rng": _rng_state(),
            "callbacks": callbacks,
            "history": self.history.state_dict() if self.history is not None else None,
        }
        if step:
            state["epoch_rng"] = self._epoch_rng
            state["trackers"] = self._tracker_state()
        return state

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write the full training state to ``path`` atomically (see API.md, Checkpoints).

        Under torchrun rank 0 writes (its RNG states); the state is unwrapped, so the file
        resumes at any world size. With ``strategy="fsdp"`` call it on every rank (gathering
        the shards is a collective).

        Args:
            path: the file to write; missing parent folders are created, an existing file is
                replaced.

        Raises:
            OSError: the file cannot be written (the old file, if any, is left as it was).
        """
        state = self.checkpoint_state()
        if is_rank_zero():
            atomic_save(state, path)

    def _optimizer_state_dict(self) -> dict[str, Any]:
        if self._parallel is not None:  # FSDP: gathered, in the plain optimizer's format
            return self._parallel.optimizer_state_dict(self.module, self.optimizer)
        return self.optimizer.state_dict()

    def load_checkpoint(self, path: str | os.PathLike) -> int:
        """Restore a checkpoint; the next ``fit(..., initial_epoch=k)`` continues from it.

        Tensors are mapped onto ``model.device``. RNG states, the position inside the epoch
        and callback states are applied when ``fit`` reaches that point, so code run in
        between does not change the result.

        Args:
            path: a file written by :meth:`save_checkpoint`.

        Returns:
            ``k``: the epoch to pass as ``initial_epoch`` (0-based).

        Raises:
            FileNotFoundError: no file at ``path``.
            RuntimeError: the model is not compiled (the optimizer must exist), or the file is
                unsafe.
            fitkit.files.CheckpointError: a damaged file, or one from a newer fitkit.
            ValueError: the file is not a fitkit checkpoint (e.g. one from :meth:`save_weights`),
                or it does not fit the model: the module's keys, shapes, dtypes, the optimizer's
                class, param groups or state shapes (every difference is listed). Nothing was
                loaded: module, optimizer, scheduler and step count are unchanged.
        """
        self._require_compiled("load_checkpoint")
        state = safe_load(path, self.device)
        if not isinstance(state, dict) or "fitkit_version" not in state:
            raise ValueError(
                f"{str(path)!r} is not a fitkit checkpoint. Fix: use load_weights for a state dict."
            )
        # -- files: compare everything before changing anything -----------------------------
        differences = state_dict_differences(self.module.state_dict(), state["module"])
        if state["optimizer"] is not None:
            differences += optimizer_differences(self.optimizer, state["optimizer"], state.get("optimizer_class"))
        _raise_differences(path, differences)
        self.load_state_dict(state["module"])
        if state["optimizer"] is not None:
            if self._parallel is not None:
                self._parallel.load_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])
            else:
                self.optimizer.load_state_dict(state["optimizer"])
        if state["scheduler"] is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"] is not None and self._scaler is not None:
            self._scaler.load_state_dict(state["scaler"])
        self._global_step = state["global_step"]
        if self._global_step and self.scheduler is not None:
            # The optimizer did step, in another process: tell torch's scheduler so, or its
            # "scheduler.step() before optimizer.step()" check warns when the resumed epoch
            # has no batch left to run.
            self.optimizer._opt_called = True
        self._resume = state
        return int(state["epoch"])

    # -- applying a resume inside fit ----------------------------------------------------------
    def _apply_resume_at_train_begin(self) -> None:
        state = self._resume
        if state is None:
            return
        seen: dict[str, int] = {}
        for cb in self._callbacks.callbacks:
            if type(cb).__name__ in ("History", "ProgressBar"):
                continue
            key = _callback_key(cb, seen)
            if key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][key])
                # Loaded after on_train_begin, so the state is this fit's: the flag that asks
                # the next on_train_begin to keep a loaded state is consumed here.
                if getattr(cb, "_restored", False):
                    cb._restored = False
        if state["history"] is not None and self.history is not None:
            self.history.load_state_dict(state["history"])
        if state["epoch"] != self._initial_epoch:
            warnings.warn(
                f"The loaded checkpoint continues at epoch {state['epoch']}, but fit starts at "
                f"initial_epoch={self._initial_epoch}; its position and RNG state are not used. "
                f"Fix: fit(..., initial_epoch={state['epoch']}).",
                stacklevel=4,
            )
            self._resume = None

    def _resume_epoch_begin(self, epoch: int) -> None:
        """At the start of the resumed epoch: RNG states for an epoch-boundary checkpoint."""
        state = self._resume
        if state is None or state["epoch"] != epoch:
            return
        if not state["step_in_epoch"]:
            _set_rng_state(state["rng"])
            self._resume = None

    def _take_resume_point(self):
        self._resumed_steps = 0
        state = self._resume
        if state is None or state["epoch"] != self._epoch or not state["step_in_epoch"]:
            return None
        self._resume = None

        def resume(loader):
            # Replay the epoch's data order from the RNG state it started with, skip what was
            # done, then continue from the RNG state of the moment the checkpoint was taken.
            skip = state["step_in_epoch"]
            self._resumed_steps = skip
            # A later checkpoint in this epoch must replay the same order: keep its RNG state.
            self._epoch_rng = state["epoch_rng"].cpu()
            torch.set_rng_state(self._epoch_rng)
            loader.skip = skip
            it = iter(loader)
            first = next(it, None)
            _set_rng_state(state["rng"])
            self._load_tracker_state(state["trackers"])
            rest = it if first is None else _chain(first, it)
            return rest, skip

        return resume

    def _tracker_state(self) -> dict[str, Any]:
        metrics = {}
        for e in self.metrics.entries or []:
            metrics[e.key] = {k: (list(v) if isinstance(v, list) else v) for k, v in e.metric.metric_state.items()}
            metrics[e.key]["_update_count"] = e.metric._update_count
        return {
            "loss_total": self._loss_total,
            "loss_count": self._loss_count,
            "loss_wsum": self._loss_wsum,
            "metrics": metrics,
        }

    def _load_tracker_state(self, state: dict[str, Any]) -> None:
        self._loss_total = state["loss_total"].to(self.device)
        self._loss_count = state["loss_count"]
        self._loss_wsum = state["loss_wsum"]
        for e in self.metrics.entries or []:
            saved = state["metrics"].get(e.key)
            if saved is None:
                continue
            for k, v in saved.items():
                if k == "_update_count":
                    e.metric._update_count = v
                else:
                    setattr(e.metric, k, v)


def _raise_differences(path: str | os.PathLike, differences: list[str]) -> None:
    if differences:
        lines = "\n".join(f"  - {d}" for d in differences)
        raise ValueError(
            f"{str(path)!r} does not fit this model, so nothing was loaded:\n{lines}\nFix: build and "
            "compile the model as it was when the file was written (same layers, optimizer class "
            "and parameter groups), or load a matching subset of the weights yourself with "
            "model.load_state_dict({...}, strict=False)."
        )


def _chain(first: Any, it: Any):
    yield first
    yield from it
