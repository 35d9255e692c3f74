"""The named stateful parts of a run (:mod:`fitkit.training.state`): each saves its keys of a
checkpoint, checks a state against itself (with :mod:`fitkit.training.state_checks`) and loads it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fitkit.files import optimizer_differences, state_dict_differences
from fitkit.files.content import callback_state_problems, is_count, typed_problems
from fitkit.training.state_checks import (
    SCALER,
    SCHEDULER_FLAGS,
    TORCH_RNG_SIZE,
    Spec,
    data_order_problems,
    history_problems,
    is_str,
    kind_problems,
    mapping,
    numbers,
    optimizer_problems,
    optional_check,
    pass_start_problems,
    positive,
    rng_problems,
    scheduler_differences,
    shown,
    torch_rng,
    trackers_problems,
)

if TYPE_CHECKING:
    from fitkit.callbacks.base import CallbackList
    from fitkit.model import Model


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


def _rates(v: object) -> bool:
    """A list of learning rates, one per parameter group (a checkpoint's ``lrs_used``)."""
    return isinstance(v, list) and all(isinstance(lr, float) and 0 <= lr < float("inf") for lr in v)


def _tuples(obj: object) -> Any:
    # random.setstate wants tuples; a round trip may hand back lists.
    if isinstance(obj, (list, tuple)):
        return tuple(_tuples(o) for o in obj)
    return obj


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
        self.spec = {"module": (mapping if tensors else optional_check(mapping), "a state dict")}

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
    spec = {
        "optimizer": (optional_check(mapping), "an optimizer state dict or None"),
        "optimizer_class": (optional_check(is_str), "a class name or None"),
    }
    optional = frozenset({"optimizer_class"})

    def __init__(self, model: Model, tensors: bool):
        self.model, self.tensors = model, tensors

    def state_dict(self) -> dict[str, Any]:
        model, opt = self.model, self.model.optimizer
        state = None
        if self.tensors and opt is not None:  # an uncompiled model has none
            parallel = model._core.parallel
            state = parallel.optimizer_state_dict(model.module, opt) if parallel is not None else opt.state_dict()
        return {"optimizer": state, "optimizer_class": type(opt).__name__ if opt is not None else None}

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        out = super().content_problems(state)
        if out or state.get("optimizer") is None:
            return out
        return optimizer_problems(state["optimizer"], self.model.optimizer, state.get("optimizer_class"))

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
        if model._core.parallel is not None:
            model._core.parallel.load_optimizer_state_dict(model.module, model.optimizer, saved)
        else:
            model.optimizer.load_state_dict(saved)


class StepperPart(Part):
    """The optimizer steps taken and the GradScaler's state (none before ``compile``)."""

    name = "stepper"
    spec = {"global_step": (is_count, "an int >= 0"), "scaler": (optional_check(mapping), "a GradScaler state or None")}

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        out = super().content_problems(state)
        if out or not state.get("scaler"):  # None, or a disabled GradScaler's {}
            return out
        return typed_problems(state["scaler"], SCALER, "checkpoint['scaler']")

    def __init__(self, model: Model):
        self.stepper = model._core.stepper

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
    spec = {
        "scheduler": (optional_check(mapping), "a scheduler state dict or None"),
        "scheduler_class": (optional_check(is_str), "a class name or None"),
    }
    optional = frozenset({"scheduler_class"})

    def __init__(self, model: Model):
        self.model, self.stepper = model, model._core.stepper

    def state_dict(self) -> dict[str, Any]:
        sched = None if self.stepper is None else self.stepper.scheduling.scheduler
        return {
            "scheduler": sched.state_dict() if sched is not None else None,
            "scheduler_class": type(sched).__name__ if sched is not None else None,
        }

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        """The fields every torch scheduler keeps, and for the model's scheduler class (built)
        each field of the kind the model's has (``gamma`` a number, one ``base_lrs`` per group)."""
        out = super().content_problems(state)
        saved, where = state.get("scheduler"), "checkpoint['scheduler']"
        if out or saved is None:
            return out
        groups = None if self.model.optimizer is None else len(self.model.optimizer.param_groups)
        lrs = f"a list of {groups} number(s), one per parameter group" if groups else "a list of numbers"
        lrs += ", each finite and >= 0"
        spec: Spec = {
            "last_epoch": (lambda v: v == -1 or is_count(v), "an int >= -1"),
            "_step_count": (is_count, "an int >= 0"),
            "base_lrs": (lambda v: numbers(v) and (groups is None or len(v) == groups), lrs),
            "_last_lr": (lambda v: numbers(v) and (groups is None or len(v) == groups), lrs),
            **SCHEDULER_FLAGS,
        }
        out = typed_problems(saved, spec, where, optional=frozenset(spec))
        mine = None if self.stepper is None else self.stepper.scheduling.scheduler
        if not out and mine is not None and state.get("scheduler_class") == type(mine).__name__:
            out = kind_problems(saved, mine.state_dict(), where, frozenset({"last_epoch"}), lists=False)
        return out

    def differences(self, state: Mapping[str, Any]) -> list[str]:
        stepper = self.stepper
        if stepper is not None and stepper.scheduling.planned is not None:  # not built yet: it gets the state at birth
            return []
        return scheduler_differences(None if stepper is None else stepper.scheduling.scheduler, state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        stepper, saved = self.stepper, state["scheduler"]
        if stepper is None:
            return
        if saved is not None and stepper.scheduling.scheduler is not None:
            stepper.scheduling.scheduler.load_state_dict(saved)
        elif stepper.scheduling.planned is not None:
            stepper.scheduling.keep_scheduler_state(saved)  # loaded once the first fit has built it
        if stepper.global_step and stepper.scheduling.scheduler is not None:
            # The optimizer did step, in another process: tell torch's scheduler so, or its
            # "scheduler.step() before optimizer.step()" check warns when the resumed epoch
            # has no batch left to run.
            self.model.optimizer._opt_called = True  # type: ignore[union-attr]


class PositionPart(Part):
    """Where the run is in the data: epoch, batches and samples done, the carried-over pass and
    what drew it, the epoch's RNG state, the running totals and metric states, the loader's own order."""

    name = "position"
    spec = {
        "epoch": (is_count, "an int >= 0"),
        "step_in_epoch": (is_count, "an int >= 0"),
        "samples_in_epoch": (optional_check(is_count), "an int >= 0 or None"),
        "pass_offset": (optional_check(is_count), "an int >= 0 or None"),
        "batch_size": (optional_check(positive), "an int >= 1 or None"),
        "world_size": (optional_check(positive), "an int >= 1 or None"),
        "epoch_rng": (
            optional_check(torch_rng),
            f"a torch RNG state (a uint8 tensor of {TORCH_RNG_SIZE} bytes) or None",
        ),
        "lrs_used": (optional_check(_rates), "a list of finite floats >= 0 (each parameter group's rate) or None"),
        "train_length": (optional_check(is_count), "an int >= 0 or None"),
        "train_fingerprint": (optional_check(lambda v: isinstance(v, str)), "a str or None"),
        "validation_due": (optional_check(lambda v: isinstance(v, bool)), "a bool or None"),
    }
    optional = frozenset(
        {
            "samples_in_epoch",
            "pass_offset",
            "batch_size",
            "world_size",
            "epoch_rng",
            "trackers",
            "data_order",
            "pass_start",
            "lrs_used",
            "train_length",
            "train_fingerprint",
            "validation_due",
        }
    )

    def __init__(self, model: Model):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return self.model._core.fit_position()

    def differences(self, state: Mapping[str, Any]) -> list[str]:
        """The running metric states against the compiled metrics, once built (else at their birth)."""
        from fitkit.metrics.saved import metric_state_problems

        trackers, entries = state.get("trackers"), self.model.metrics.entries
        if trackers is None or not state.get("step_in_epoch") or entries is None:
            return []
        return metric_state_problems(entries, trackers["metrics"])

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        out = super().content_problems(state)
        if state.get("trackers") is not None:
            out += trackers_problems(state["trackers"], "checkpoint['trackers']")
        out += data_order_problems(state.get("data_order"), "checkpoint['data_order']")
        out += pass_start_problems(state.get("pass_start"), "checkpoint['pass_start']")
        if out:
            return out
        step, samples, size = state["step_in_epoch"], state.get("samples_in_epoch"), state.get("batch_size")
        if step > 0 and (state.get("epoch_rng") is None or state.get("trackers") is None):
            out.append(f"checkpoint is inside epoch {state['epoch'] + 1} without its RNG state and running totals")
        # A running fit counts at most one batch of every rank per batch done (a resume at
        # another batch size carries less than one batch over): more is not a count it wrote.
        if samples and size is not None and samples >= (step + 1) * size * (state.get("world_size") or 1):
            out.append(
                f"checkpoint['samples_in_epoch'] is {samples}, more than {step} batch(es) of {size} sample(s) "
                f"on {state.get('world_size') or 1} process(es) can hold (step_in_epoch={step}, batch_size={size})"
            )
        return out


class RngPart(Part):
    """Python, NumPy, torch and CUDA RNG states of the moment the checkpoint was taken."""

    name = "rng"

    def state_dict(self) -> dict[str, Any]:
        return {"rng": rng_state()}

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        return ["checkpoint has no 'rng'"] if "rng" not in state else rng_problems(state["rng"])


class CallbacksPart(Part):
    """The running fit's callback states (by class name) and what each watches."""

    name = "callbacks"
    spec = {
        "callbacks": (lambda v: mapping(v) and all(isinstance(k, str) for k in v), "a dict of callback states"),
        "callback_config": (
            optional_check(lambda v: mapping(v) and all(map(_watches, v.values()))),
            "a dict {callback key: {'monitor' / 'mode': str}}",
        ),
    }
    optional = frozenset({"callback_config"})

    def __init__(self, running: CallbackList | None):
        self.callbacks = stateful(running.callbacks if running is not None else [])

    def state_dict(self) -> dict[str, Any]:
        return {
            "callbacks": {k: cb.state_dict() for k, cb in self.callbacks.items()},
            "callback_config": {k: cb.watches() for k, cb in self.callbacks.items()},
        }

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        out = super().content_problems(state)
        config: Any = state.get("callback_config")
        if isinstance(config, Mapping):  # each entry named (the line above shows the dict cut short)
            out += [
                f"checkpoint['callback_config'][{key!r}] is {shown(w)}, expected a dict {{'monitor' / 'mode': str}}"
                for key, w in config.items()
                if not _watches(w)
            ]
        if not out:
            out += callback_state_problems(state["callbacks"], self.callbacks)
        return out


class HistoryPart(Part):
    """The History so far (log values as Python numbers)."""

    name = "history"
    spec = {
        "history": (
            lambda v: v is None or mapping(v),
            "a History state ({'history': {key: [numbers]}, 'epoch': [ints]}) or None",
        )
    }

    def __init__(self, model: Model):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.model.history.state_dict() if self.model.history is not None else None}

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        out = super().content_problems(state)
        return out if out else history_problems(state["history"], "checkpoint['history']")


class VersionPart(Part):
    """The fitkit version that wrote the checkpoint."""

    name = "version"
    spec = {"fitkit_version": (lambda v: is_str(v) and re.match(r"\d+\.\d+", v) is not None, "a version string")}

    def state_dict(self) -> dict[str, Any]:
        from fitkit import __version__

        return {"fitkit_version": __version__}


def _watches(v: Any) -> bool:
    """What a callback watches, as :meth:`~fitkit.callbacks.Callback.watches` returns it."""
    return mapping(v) and all(isinstance(x, str) for x in (*v, *v.values()))


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
