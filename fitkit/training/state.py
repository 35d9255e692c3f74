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
              ``epoch_rng``, ``trackers``, ``data_order``
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
   (:meth:`~fitkit.training.scheduling.SchedulerDriver.build_planned`), metrics built from the
   first batch (:mod:`fitkit.metrics.saved`). Nothing restores into a part that does not exist
   yet, and nothing built after the restore overwrites it.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fitkit.checks import FitkitWarning
from fitkit.files import CheckpointError, optimizer_differences, state_dict_differences
from fitkit.files.content import callback_state_problems, is_count, is_number, typed_problems
from fitkit.training.position import Position

if TYPE_CHECKING:
    from fitkit.callbacks.base import CallbackList
    from fitkit.model import Model

__all__ = ["RunState", "ResumePoint", "rng_state", "set_rng_state", "raise_problems", "raise_differences"]

Check = Callable[[Any], bool]
Spec = dict[str, tuple[Check, str]]


def _optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _mapping(v: Any) -> bool:
    return isinstance(v, Mapping)


def _str(v: Any) -> bool:
    return isinstance(v, str)


# -- RNG states ------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Python, numpy, torch and CUDA RNG states, in a ``weights_only``-loadable form.

    Example:
        >>> state = rng_state(); a = torch.rand(1); set_rng_state(state); torch.equal(a, torch.rand(1))
        True
    """
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


def _byte_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1


def _rng_problems(rng: Any) -> list[str]:
    """What in a saved RNG state :func:`set_rng_state` could not take (checked before it runs)."""
    if not isinstance(rng, Mapping):
        return [f"checkpoint['rng'] is {type(rng).__name__}, expected the RNG states fitkit saves"]
    out = []
    py = rng.get("python")
    if not (isinstance(py, Sequence) and len(py) == 3 and isinstance(py[1], Sequence)
            and all(isinstance(i, int) for i in py[1])):  # fmt: skip
        out.append("checkpoint['rng']['python'] is not a state of Python's random module")
    nps = rng.get("numpy")
    if not (isinstance(nps, Sequence) and len(nps) == 5 and isinstance(nps[0], str)
            and isinstance(nps[1], torch.Tensor) and nps[1].numel() == 624):  # fmt: skip
        out.append("checkpoint['rng']['numpy'] is not a state of NumPy's global generator")
    if not _byte_tensor(rng.get("torch")):
        out.append("checkpoint['rng']['torch'] is not a torch RNG state (a uint8 tensor)")
    cuda = rng.get("cuda", [])
    if not (isinstance(cuda, Sequence) and all(_byte_tensor(s) for s in cuda)):
        out.append("checkpoint['rng']['cuda'] is not a list of CUDA RNG states")
    return out


# -- the parts -------------------------------------------------------------------------------------
class Part:
    """One stateful part of a run: its checkpoint keys, its state, its checks, its load.

    Subclasses set :attr:`name` and :attr:`spec` (``{key: (check, expected)}``; keys in
    :attr:`optional` may be absent, as in files of an older fitkit).
    """

    name = ""
    spec: Spec = {}
    optional: frozenset[str] = frozenset()

    def state_dict(self) -> dict[str, Any]:
        """This part's keys of the checkpoint."""
        raise NotImplementedError

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        """Types and ranges: one line per value fitkit does not write."""
        return typed_problems({k: state[k] for k in self.spec if k in state}, self.spec, "checkpoint", self.optional)

    def differences(self, state: Mapping[str, Any]) -> list[str]:
        """What in a well-formed state does not fit this run (shapes, classes, groups)."""
        return []

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the state (checked): at once, or kept until the part exists."""


class ModulePart(Part):
    """The module's weights and buffers (``None`` in a sharded checkpoint's non-tensor part)."""

    name = "module"

    def __init__(self, model: Model, tensors: bool):
        self.model, self.tensors = model, tensors
        self.spec = {"module": (_mapping if tensors else _optional(_mapping), "a state dict")}

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.model.state_dict() if self.tensors else None}

    def differences(self, state: Mapping[str, Any]) -> list[str]:
        if state["module"] is None:  # sharded: compared from the shards' index
            return []
        return state_dict_differences(self.model.module.state_dict(), state["module"])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["module"] is not None:
            self.model.load_state_dict(state["module"])


class OptimizerPart(Part):
    """The optimizer's state and class (gathered from its shards under FSDP)."""

    name = "optimizer"
    spec = {"optimizer": (_optional(_mapping), "an optimizer state dict or None"),
            "optimizer_class": (_optional(_str), "a class name or None")}  # fmt: skip
    optional = frozenset({"optimizer_class"})

    def __init__(self, model: Model, tensors: bool):
        self.model, self.tensors = model, tensors

    def state_dict(self) -> dict[str, Any]:
        model, opt = self.model, self.model.optimizer
        state = None
        if self.tensors and opt is not None:  # an uncompiled model has none
            parallel = model.parallel
            state = parallel.optimizer_state_dict(model.module, opt) if parallel is not None else opt.state_dict()
        return {"optimizer": state, "optimizer_class": type(opt).__name__ if opt is not None else None}

    def differences(self, state: Mapping[str, Any]) -> list[str]:
        if state["optimizer"] is None:
            return []
        if self.model.optimizer is None:
            return ["optimizer: the file has one, the model none (compile it first)"]
        return optimizer_differences(self.model.optimizer, state["optimizer"], state.get("optimizer_class"))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        model, saved = self.model, state["optimizer"]
        if saved is None or model.optimizer is None:
            return
        if model.parallel is not None:
            model.parallel.load_optimizer_state_dict(model.module, model.optimizer, saved)
        else:
            model.optimizer.load_state_dict(saved)


class StepperPart(Part):
    """The optimizer steps taken and the GradScaler's state (none before ``compile``)."""

    name = "stepper"
    spec = {"global_step": (is_count, "an int >= 0"), "scaler": (_optional(_mapping), "a GradScaler state or None")}

    def __init__(self, model: Model):
        self.stepper = model.stepper

    def state_dict(self) -> dict[str, Any]:
        if self.stepper is None:
            return {"scaler": None, "global_step": 0}
        return self.stepper.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.stepper is not None:
            self.stepper.load_state_dict({"scaler": state["scaler"], "global_step": state["global_step"]})


class SchedulerPart(Part):
    """The LR scheduler's state and class; a factory built at the first fit gets it at birth."""

    name = "scheduler"
    spec = {"scheduler": (_optional(_mapping), "a scheduler state dict or None"),
            "scheduler_class": (_optional(_str), "a class name or None")}  # fmt: skip
    optional = frozenset({"scheduler_class"})

    def __init__(self, model: Model):
        self.model, self.stepper = model, model.stepper
        self.driver = None if model.stepper is None else model.stepper.scheduling

    def state_dict(self) -> dict[str, Any]:
        sched = None if self.driver is None else self.driver.scheduler
        return {"scheduler": sched.state_dict() if sched is not None else None,
                "scheduler_class": type(sched).__name__ if sched is not None else None}  # fmt: skip

    def differences(self, state: Mapping[str, Any]) -> list[str]:
        driver = self.driver
        if driver is not None and driver.planned is not None:  # not built yet: it gets the state at birth
            return []
        return _scheduler_differences(None if driver is None else driver.scheduler, state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        stepper, driver, saved = self.stepper, self.driver, state["scheduler"]
        if stepper is None or driver is None:
            return
        if saved is not None and driver.scheduler is not None:
            driver.scheduler.load_state_dict(saved)
        elif driver.planned is not None:
            driver.keep_scheduler_state(saved)  # loaded once the first fit has built it
        if stepper.global_step and driver.scheduler is not None:
            # The optimizer did step, in another process: tell torch's scheduler so, or its
            # "scheduler.step() before optimizer.step()" check warns when the resumed epoch
            # has no batch left to run.
            self.model.optimizer._opt_called = True  # type: ignore[union-attr]


def _scheduler_differences(scheduler: Any, state: Mapping[str, Any]) -> list[str]:
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


def _trackers(v: Any) -> bool:
    return (isinstance(v, Mapping) and isinstance(v.get("loss_total"), torch.Tensor)
            and is_number(v.get("loss_count")) and v["loss_count"] >= 0
            and (v.get("loss_wsum") is None or isinstance(v.get("loss_wsum"), torch.Tensor))
            and isinstance(v.get("metrics"), Mapping))  # fmt: skip


class PositionPart(Part):
    """Where the run is in the data: epoch, batches and samples done, the carried-over pass,
    the epoch's RNG state, the running totals and metric states, the loader's own order."""

    name = "position"
    spec = {
        "epoch": (is_count, "an int >= 0"),
        "step_in_epoch": (is_count, "an int >= 0"),
        "samples_in_epoch": (_optional(is_count), "an int >= 0 or None"),
        "pass_offset": (_optional(is_count), "an int >= 0 or None"),
        "batch_size": (_optional(lambda v: is_count(v) and v > 0), "an int >= 1 or None"),
        "world_size": (_optional(lambda v: is_count(v) and v > 0), "an int >= 1 or None"),
        "epoch_rng": (_optional(_byte_tensor), "a torch RNG state or None"),
        "trackers": (_optional(_trackers), "the running totals fitkit saves or None"),
        "data_order": (_optional(_mapping), "a dict or None"),
    }
    optional = frozenset({"samples_in_epoch", "pass_offset", "batch_size", "world_size", "epoch_rng",
                          "trackers", "data_order"})  # fmt: skip

    def __init__(self, model: Model):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return self.model.fit_position()

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        out = super().content_problems(state)
        inside = is_count(state.get("step_in_epoch")) and state["step_in_epoch"] > 0
        if inside and not out and (state.get("epoch_rng") is None or state.get("trackers") is None):
            out.append(f"checkpoint is inside epoch {state['epoch'] + 1} without its RNG state and running totals")
        return out


class RngPart(Part):
    """Python, NumPy, torch and CUDA RNG states of the moment the checkpoint was taken."""

    name = "rng"

    def state_dict(self) -> dict[str, Any]:
        return {"rng": rng_state()}

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        return ["checkpoint has no 'rng'"] if "rng" not in state else _rng_problems(state["rng"])


class CallbacksPart(Part):
    """The running fit's callback states (by class name) and what each watches."""

    name = "callbacks"
    spec = {"callbacks": (lambda v: _mapping(v) and all(isinstance(k, str) for k in v), "a dict of callback states"),
            "callback_config": (_optional(_mapping), "a dict")}  # fmt: skip
    optional = frozenset({"callback_config"})

    def __init__(self, running: CallbackList | None):
        self.callbacks = stateful(running.callbacks if running is not None else [])

    def state_dict(self) -> dict[str, Any]:
        return {"callbacks": {k: cb.state_dict() for k, cb in self.callbacks.items()},
                "callback_config": {k: watches(cb) for k, cb in self.callbacks.items()}}  # fmt: skip

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        out = super().content_problems(state)
        if not out:
            out += callback_state_problems(state["callbacks"], self.callbacks)
        return out


def _history(v: Any) -> bool:
    if v is None:
        return True
    if not (isinstance(v, Mapping) and isinstance(v.get("history"), Mapping) and isinstance(v.get("epoch"), list)):
        return False
    columns = all(isinstance(c, list) and all(is_number(x) for x in c) for c in v["history"].values())
    return columns and all(is_count(e) for e in v["epoch"]) and isinstance(v.get("validations", []), list)


class HistoryPart(Part):
    """The History so far (log values as Python numbers)."""

    name = "history"
    spec = {"history": (_history, "a History state ({'history': {key: [numbers]}, 'epoch': [ints]}) or None")}

    def __init__(self, model: Model):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.model.history.state_dict() if self.model.history is not None else None}


class VersionPart(Part):
    """The fitkit version that wrote the checkpoint."""

    name = "version"
    spec = {"fitkit_version": (_str, "a version string")}

    def state_dict(self) -> dict[str, Any]:
        from fitkit import __version__

        return {"fitkit_version": __version__}


def stateful(callbacks: Sequence[Any]) -> dict[str, Any]:
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


def watches(cb: Any) -> dict[str, str]:
    """What a callback's saved state means: the key it watches and the direction."""
    return {k: str(getattr(cb, k)) for k in ("monitor", "mode") if isinstance(getattr(cb, k, None), str)}


# -- the registry ----------------------------------------------------------------------------------
class RunState:
    """The named stateful parts of a compiled model's run (see the module's table).

    Args:
        model: the compiled :class:`~fitkit.Model`.
        tensors: with the module and optimizer states; ``False``: the part a sharded checkpoint
            keeps beside its shards (``None`` there).

    Example:
        >>> import fitkit
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

    def __init__(self, model: Model, tensors: bool = True):
        self.model = model
        running = model.running_fit()
        self.parts: list[Part] = [
            VersionPart(), ModulePart(model, tensors), OptimizerPart(model, tensors), StepperPart(model),
            SchedulerPart(model), PositionPart(model), RngPart(),
            CallbacksPart(running.callbacks if running is not None else None), HistoryPart(model),
        ]  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Every part's keys in one ``weights_only``-loadable dict (a collective under torchrun
        inside an epoch: the running totals are summed over ranks)."""
        state: dict[str, Any] = {}
        for part in self.parts:
            state.update(part.state_dict())
        return state

    def problems(self, state: Any) -> list[str]:
        """Every value in ``state`` that fitkit does not write, over all parts (nothing changes)."""
        if not isinstance(state, Mapping):
            return [f"checkpoint is a {type(state).__name__}, expected a dict"]
        return [p for part in self.parts for p in part.content_problems(state)]

    def differences(self, state: Mapping[str, Any]) -> list[str]:
        """What in a well-formed state does not fit this model, over all parts."""
        return [d for part in self.parts for d in part.differences(state)]

    def check(self, state: Any, path: Any, problems: Sequence[str] = (), differences: Sequence[str] = ()) -> None:
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

    def apply_callbacks(self, callbacks: CallbackList) -> None:
        """Callback states and the history (after ``on_train_begin``, so they are this fit's)."""
        saved, config = self.state["callbacks"], self.state.get("callback_config", {})
        mine = stateful(callbacks.callbacks)
        raise_problems("The checkpoint", callback_state_problems(saved, mine), ValueError)
        for key, cb in mine.items():
            if key in config and config[key] != watches(cb):
                warnings.warn(
                    f"{key} was saved watching {config[key]} and now watches {watches(cb)}: its saved "
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


def raise_problems(what: str, problems: list[str], error: type[Exception]) -> None:
    """One error listing every problem of a checkpoint's content (nothing was loaded)."""
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise error(
            f"{what} holds content fitkit does not write (damaged, or edited), so nothing was loaded:\n"
            f"{lines}\nFix: use an earlier checkpoint (BackupAndRestore keeps the previous backup as "
            "backup.prev.pt) or the file as fitkit wrote it."
        )


def raise_differences(path: Any, differences: Sequence[str]) -> None:
    """One ``ValueError`` listing what in a checkpoint does not fit the model (nothing loaded)."""
    if differences:
        lines = "\n".join(f"  - {d}" for d in differences)
        raise ValueError(
            f"{str(path)!r} does not fit this model, so nothing was loaded:\n{lines}\nFix: build and "
            "compile the model as it was when the file was written (same layers, optimizer class "
            "and parameter groups), or load a matching subset of the weights yourself with "
            "model.load_state_dict({...}, strict=False)."
        )
