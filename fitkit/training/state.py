"""A run's state: a registry of named stateful parts, saved, checked and restored as one.

A checkpoint holds the state of every part of a run, by name. Each part saves its own state,
checks a state against itself and loads it; :mod:`fitkit.training.checkpoint` only reads and
writes files and walks this registry, never reaching into another object's fields.

============  ===========================================================  ==================
part          checkpoint keys                                              restored
============  ===========================================================  ==================
module        ``module``                                                   at load
optimizer     ``optimizer``, ``optimizer_class``                           at load
stepper       ``scaler``, ``global_step``                                  at load
scheduler     ``scheduler``, ``scheduler_class``                           at load, or at birth
position      ``epoch``, ``step_in_epoch``, ``samples_in_epoch``,          next fit
              ``pass_offset``, ``batch_size``, ``world_size``,
              ``epoch_rng``, ``trackers``, ``data_order``,
              ``pass_start``, ``lrs_used``, ``train_length``,
              ``train_fingerprint``, ``validation_due``
rng           ``rng``                                                      next fit
callbacks     ``callbacks``, ``callback_config``                           after on_train_begin
history       ``history``                                                  after on_train_begin
============  ===========================================================  ==================

Restoring is all or nothing, with one defined moment per part:

1. every part checks the state before any part changes: types and ranges (a
   :class:`~fitkit.files.CheckpointError`: content fitkit does not write), then whether it fits
   this model (a ``ValueError``: shapes, optimizer class and groups, scheduler class);
2. the parts that exist load at once;
3. the parts of the next fit wait in a :class:`ResumePoint` that the fit applies where each
   belongs, and a part built later gets its state at birth: a scheduler factory built at the
   first fit with the planned step count
   (:meth:`fitkit.training.scheduling.SchedulerDriver.build_planned`), metrics built from the
   first batch (:mod:`fitkit.metrics.saved`). Nothing restores into a part that does not
   exist yet, and nothing built after the restore overwrites it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fitkit.checks import FitkitWarning
from fitkit.files import CheckpointError
from fitkit.files.content import callback_state_problems
from fitkit.training.parts import (
    CallbacksPart,
    HistoryPart,
    ModulePart,
    OptimizerPart,
    Part,
    PositionPart,
    RngPart,
    SchedulerPart,
    StepperPart,
    VersionPart,
    rng_state,
    set_rng_state,
    stateful,
)
from fitkit.training.position import Position

if TYPE_CHECKING:
    from fitkit.callbacks.base import CallbackList
    from fitkit.model import Model

__all__ = ["RunState", "ResumePoint", "rng_state", "set_rng_state", "raise_problems", "raise_differences"]


# -- the registry ----------------------------------------------------------------------------------
class RunState:
    """The named stateful parts of a compiled model's run (see the module's table).

    Args:
        model: the compiled :class:`~fitkit.Model`.
        tensors: with the module and optimizer states; ``False``: the part a sharded checkpoint
            keeps beside its shards (``None`` there).
        only: the names of the parts to check and load (a partial load,
            :mod:`fitkit.training.partial`); ``None``: every part.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> run = RunState(model)
        >>> [p.name for p in run.parts]
        ['version', 'module', 'optimizer', 'stepper', 'scheduler', 'position', 'rng', 'callbacks', 'history']
        >>> state = run.state_dict(); state["global_step"], state["epoch"]
        (0, 0)
        >>> run.problems({**state, "epoch": -3})
        ["checkpoint['epoch'] is -3, expected an int >= 0"]
    """

    def __init__(self, model: Model, tensors: bool = True, only: set[str] | None = None):
        self.model = model
        running = model._core.running_fit()
        self.parts: list[Part] = [
            VersionPart(),
            ModulePart(model, tensors),
            OptimizerPart(model, tensors),
            StepperPart(model),
            SchedulerPart(model),
            PositionPart(model),
            RngPart(),
            CallbacksPart(running.callbacks if running is not None else None),
            HistoryPart(model),
        ]
        if only is not None:
            self.parts = [p for p in self.parts if p.name in only]

    def state_dict(self) -> dict[str, Any]:
        """Every part's keys in one ``weights_only``-loadable dict (a collective under torchrun
        inside an epoch: the running totals are summed over ranks)."""
        state: dict[str, Any] = {}
        for part in self.parts:
            state.update(part.state_dict())
        return state

    def problems(self, state: Mapping[str, object]) -> list[str]:
        """Every value in ``state`` that fitkit does not write, over all parts (nothing changes)."""
        if not isinstance(state, Mapping):
            return [f"checkpoint is a {type(state).__name__}, expected a dict"]
        return [p for part in self.parts for p in part.content_problems(state)]

    def differences(self, state: Mapping[str, Any]) -> list[str]:
        """What in a well-formed state does not fit this model, over all parts."""
        return [d for part in self.parts for d in part.differences(state)]

    def check(
        self,
        state: Mapping[str, object],
        path: str | os.PathLike[str],
        problems: Sequence[str] = (),
        differences: Sequence[str] = (),
    ) -> None:
        """Raise before any part changes: :class:`~fitkit.files.CheckpointError` for content
        fitkit does not write, ``ValueError`` for a state that does not fit this model
        (``problems`` / ``differences``: found elsewhere, e.g. in a sharded checkpoint's index)."""
        raise_problems(repr(str(path)), [*problems, *self.problems(state)], CheckpointError)
        raise_differences(path, [*differences, *self.differences(state)])

    def load_state_dict(self, state: Mapping[str, Any]) -> ResumePoint:
        """Load a checked state: the parts that exist take theirs now; the rest wait in the
        returned :class:`ResumePoint` for the next fit (callers :meth:`check` first)."""
        for part in self.parts:
            part.load_state_dict(state)
        return ResumePoint(dict(state))


class ResumePoint:
    """A loaded checkpoint's parts of the next fit, applied where each belongs.

    Attributes:
        position: the :class:`~fitkit.training.position.Position` to continue at (epoch, batches and
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

    def at_epoch_start(self) -> ResumePoint:
        """This point moved to the start of its epoch (``fit(resume="restart_epoch")``): the
        weights, optimizer, step count, RNG states and history as saved; the epoch's batches done,
        its running totals and its loader's order dropped, so the epoch starts over."""
        state = {k: v for k, v in self.state.items() if k not in ("trackers", "data_order", "epoch_rng", "pass_start")}
        state.update(step_in_epoch=0, samples_in_epoch=0, pass_offset=0)
        return ResumePoint(state)

    def apply_callbacks(self, callbacks: CallbackList) -> None:
        """Callback states and the history (after ``on_train_begin``, so they are this fit's)."""
        saved, config = self.state["callbacks"], self.state.get("callback_config", {})
        mine = stateful(callbacks.callbacks)
        raise_problems(
            "The checkpoint",
            callback_state_problems(saved, mine),
            CheckpointError,
            "so no callback state and no history was restored (the weights and the optimizer were)",
        )
        for key, cb in mine.items():
            if key in config and config[key] != cb.watches():
                warnings.warn(
                    f"{key} was saved watching {config[key]} and now watches {cb.watches()}: its saved "
                    "state (best value, patience) is not restored. Fix: resume with the same settings.",
                    category=FitkitWarning,
                    stacklevel=4,
                )
                continue
            if key in saved:
                cb.load_state_dict(saved[key])
                # Loaded after on_train_begin: the flag that asks the next on_train_begin to
                # keep a loaded state is consumed here.
                cb.loaded_by_fit()
        history = self.state["history"]
        for cb in callbacks.callbacks:
            if type(cb).__name__ == "History" and history is not None:
                cb.load_state_dict(history)


def raise_problems(
    what: str, problems: list[str], error: type[Exception], outcome: str = "so nothing was loaded"
) -> None:
    """One error listing every problem of a checkpoint's content (``outcome``: what was not loaded)."""
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise error(
            f"{what} holds content fitkit does not write (damaged, or edited), {outcome}:\n"
            f"{lines}\nFix: use an earlier checkpoint (BackupAndRestore keeps the previous backup as "
            "backup.prev.pt) or the file as fitkit wrote it."
        )


def raise_differences(path: str | os.PathLike[str], differences: Sequence[str]) -> None:
    """One ``ValueError`` listing what in a checkpoint does not fit the model (nothing loaded)."""
    if differences:
        lines = "\n".join(f"  - {d}" for d in differences)
        raise ValueError(
            f"{str(path)!r} does not fit this model, so nothing was loaded:\n{lines}\nFix: build and "
            "compile the model as it was when the file was written (same layers, optimizer class "
            "and parameter groups), or load a matching subset of the weights yourself with "
            "model.load_state_dict({...}, strict=False)."
        )
