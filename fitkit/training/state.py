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
              ``epoch_rng``, ``trackers``, ``data_order``, ``pass_start``
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
   first fit with the planned step count (:meth:`Stepper.build_planned`), metrics built from
   the first batch (:mod:`fitkit.metrics.saved`). Nothing restores into a part that does not
   exist yet, and nothing built after the restore overwrites it.
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
from fitkit.files.differences import _SWITCHES
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


def _torch_rng(v: Any) -> bool:
    """A CPU torch RNG state (``torch.get_rng_state()``: a uint8 tensor of its fixed size)."""
    return _byte_tensor(v) and v.numel() == _TORCH_RNG_SIZE


_TORCH_RNG_SIZE = torch.get_rng_state().numel()
_U32 = 2**32


def _python_rng(py: Any) -> bool:
    # random.getstate(): (3, 624 words + the index, the cached gauss value)
    if not (isinstance(py, Sequence) and len(py) == 3 and py[0] == 3 and isinstance(py[1], Sequence)
            and len(py[1]) == 625 and (py[2] is None or isinstance(py[2], float))):  # fmt: skip
        return False
    words = py[1]
    return all(is_count(w) and w < _U32 for w in words) and words[-1] <= 624


def _numpy_rng(nps: Any) -> bool:
    # np.random.get_state(): ("MT19937", 624 words, position, has_gauss, cached_gaussian)
    if not (isinstance(nps, Sequence) and len(nps) == 5 and nps[0] == "MT19937"
            and isinstance(nps[1], torch.Tensor) and nps[1].dim() == 1 and nps[1].numel() == 624
            and not nps[1].is_floating_point() and not nps[1].is_complex() and nps[1].dtype != torch.bool
            and is_count(nps[2]) and nps[2] <= 624 and nps[3] in (0, 1) and isinstance(nps[3], int)
            and is_number(nps[4])):  # fmt: skip
        return False
    return bool(((nps[1] >= 0) & (nps[1] < _U32)).all())


def _rng_problems(rng: Any) -> list[str]:
    """What in a saved RNG state :func:`set_rng_state` could not take (checked before it runs)."""
    if not isinstance(rng, Mapping):
        return [f"checkpoint['rng'] is {type(rng).__name__}, expected the RNG states fitkit saves"]
    out = []
    if not _python_rng(rng.get("python")):
        out.append("checkpoint['rng']['python'] is not a state of Python's random module "
                   "(random.getstate(): version 3, 625 words < 2**32, a float or None)")  # fmt: skip
    if not _numpy_rng(rng.get("numpy")):
        out.append("checkpoint['rng']['numpy'] is not a state of NumPy's global generator "
                   "(('MT19937', 624 integer words < 2**32, a position <= 624, 0 or 1, a float))")  # fmt: skip
    if not _torch_rng(rng.get("torch")):
        out.append(f"checkpoint['rng']['torch'] is {_shown(rng.get('torch'))}, expected a torch RNG state "
                   f"(a uint8 tensor of {_TORCH_RNG_SIZE} bytes)")  # fmt: skip
    cuda = rng.get("cuda", [])
    if not (isinstance(cuda, Sequence) and not isinstance(cuda, str) and all(_byte_tensor(s) for s in cuda)):
        out.append("checkpoint['rng']['cuda'] is not a list of CUDA RNG states")
    return out


def _shown(value: Any) -> str:
    """A value as an error message shows it (a tensor by its dtype and shape)."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value)[:60]


def _kind(v: Any, lengths: bool = True) -> str | None:
    """What a hyper-parameter or scheduler field is, for comparing a file's with the live one's
    (``None``: anything goes, e.g. a field that is ``None`` until first used)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "a bool"
    if is_number(v) or (isinstance(v, torch.Tensor) and v.numel() == 1):
        return "a number"
    if isinstance(v, str):
        return "a str"
    if isinstance(v, (list, tuple)):
        return f"a list of {len(v)}" if lengths else "a list"
    if isinstance(v, Mapping):
        return "a dict"
    return None


def _kind_problems(saved: Mapping[str, Any], live: Mapping[str, Any], where: str,
                   skip: frozenset[str] = frozenset(), lists: bool = True) -> list[str]:  # fmt: skip
    """Fields whose kind (number, str, list of n, ...) differs from the live object's same field.

    ``lists``: also compare list lengths and items (an optimizer's ``betas``); a scheduler's
    lists may grow (a custom scheduler's history), so for it a list is only a list.
    """
    out = []
    for key, mine in live.items():
        if key in skip or key not in saved:
            continue
        theirs = saved[key]
        a, b = _kind(theirs, lists), _kind(mine, lists)
        if a is not None and b is not None and a != b:
            out.append(f"{where}[{key!r}] is {_shown(theirs)}, expected {b} as the model's")
        elif lists and isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)):
            out += [f"{where}[{key!r}][{i}] is {_shown(t)}, expected {_kind(m)} as the model's"
                    for i, (t, m) in enumerate(zip(theirs, mine, strict=True))
                    if _kind(t) is not None and _kind(m) is not None and _kind(t) != _kind(m)]  # fmt: skip
    return out


def _positive(v: Any) -> bool:
    return is_count(v) and v > 0


def _param_state_value(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, torch.Tensor)):
        return True
    return isinstance(v, (list, tuple)) and all(x is None or isinstance(x, (int, float, torch.Tensor)) for x in v)


def _optimizer_problems(saved: Any, optimizer: Any, saved_class: Any) -> list[str]:
    """An ``Optimizer.state_dict()``: its structure, and for the model's optimizer class each
    group's hyper-parameters (present, of the model's kinds: ``lr`` a number, ``betas`` two)."""
    where = "checkpoint['optimizer']"
    spec: Spec = {"state": (_mapping, "a dict {parameter id: state}"),
                  "param_groups": (lambda g: isinstance(g, list) and all(_mapping(x) for x in g), "a list of dicts")}
    out = typed_problems(saved, spec, where)
    if out:
        return out
    for pid, pstate in saved["state"].items():
        at = f"{where}['state'][{pid!r}]"
        if not is_count(pid):
            out.append(f"{where}['state'] has the key {pid!r}, expected parameter ids (ints >= 0)")
        elif not (_mapping(pstate) and all(isinstance(k, str) for k in pstate)):
            out.append(f"{at} is {_shown(pstate)}, expected a dict {{name: tensor}}")
        else:
            out += [f"{at}[{k!r}] is {_shown(v)}, expected a tensor or a number"
                    for k, v in pstate.items() if not _param_state_value(v)]  # fmt: skip
    ids: list[Any] = []
    for i, group in enumerate(saved["param_groups"]):
        params = group.get("params")
        if not (isinstance(params, list) and all(is_count(p) for p in params)):
            out.append(f"{where}['param_groups'][{i}]['params'] is {_shown(params)}, expected a list of parameter ids")
        else:
            ids += params
    if len(ids) != len(set(ids)):
        out.append(f"{where}['param_groups'] name a parameter id twice")
    same_class = optimizer is not None and saved_class == type(optimizer).__name__
    if out or not same_class or len(saved["param_groups"]) != len(optimizer.param_groups):
        return out  # another class or other groups: a difference (ValueError), reported there
    needed = set(optimizer.defaults) - _SWITCHES - {"params"}
    for i, (theirs, mine) in enumerate(zip(saved["param_groups"], optimizer.param_groups, strict=True)):
        at = f"{where}['param_groups'][{i}]"
        out += [f"{at} has no {k!r}" for k in sorted(needed - set(theirs)) if k in mine]
        out += _kind_problems(theirs, mine, at, frozenset({"params"}))
    return out or _param_state_layout_problems(saved, optimizer)


# torch's own optimizers keep these per-parameter states as scalars, every other state tensor
# in the shape of its parameter (LBFGS keeps flat vectors, Adafactor factored ones).
_SCALAR_STATES = frozenset({"step", "mu_product", "eta", "mu"})
_OWN_LAYOUT = ("LBFGS", "Adafactor")


def _param_state_layout_problems(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> list[str]:
    """A state tensor of one of torch's optimizers that has not its parameter's number of
    dimensions (a 0-dim ``exp_avg``): torch's fused and foreach kernels index it as the
    parameter, past its end. Same dimensions, another shape: a difference, reported there."""
    name = type(optimizer).__name__
    if not type(optimizer).__module__.startswith("torch.optim") or name in _OWN_LAYOUT:
        return []
    ids = [p for g in saved["param_groups"] for p in g["params"]]
    if len(ids) != sum(len(g["params"]) for g in optimizer.param_groups):
        return []  # another number of parameters: a difference, reported there
    params = dict(zip(ids, (p for g in optimizer.param_groups for p in g["params"]), strict=True))
    out = []
    for pid, pstate in saved["state"].items():
        param = params.get(pid)
        if param is None:
            continue
        for key, v in pstate.items():
            at = f"checkpoint['optimizer']['state'][{pid}][{key!r}]"
            if not isinstance(v, torch.Tensor):
                continue
            if key in _SCALAR_STATES:
                if v.numel() != 1:
                    out.append(f"{at} is {_shown(v)}, expected a scalar ({name} keeps {key!r} as one number)")
            elif v.dim() != param.dim() or v.is_floating_point() != param.is_floating_point():
                kind = "floating-point" if param.is_floating_point() else str(param.dtype)
                out.append(f"{at} is {_shown(v)}, expected a {kind} tensor of its parameter's shape "
                           f"{tuple(param.shape)}")  # fmt: skip
    for group in saved["param_groups"]:  # each parameter stepped keeps the same states
        keys = {pid: set(saved["state"][pid]) for pid in group["params"] if saved["state"].get(pid)}
        union = set().union(*keys.values())
        for pid, k in keys.items():
            if k != union:
                out.append(f"checkpoint['optimizer']['state'][{pid}] has no {', '.join(map(repr, sorted(union - k)))} "
                           f"({name} keeps {sorted(union)} for each parameter of its group)")
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

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        out = super().content_problems(state)
        if out or state.get("optimizer") is None:
            return out
        return _optimizer_problems(state["optimizer"], self.model.optimizer, state.get("optimizer_class"))

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

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        out = super().content_problems(state)
        if out or not state.get("scaler"):  # None, or a disabled GradScaler's {}
            return out
        return typed_problems(state["scaler"], _SCALER, "checkpoint['scaler']")

    def __init__(self, model: Model):
        self.stepper = model.stepper

    def state_dict(self) -> dict[str, Any]:
        if self.stepper is None:
            return {"scaler": None, "global_step": 0}
        return self.stepper.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.stepper is not None:
            self.stepper.load_state_dict({"scaler": state["scaler"], "global_step": state["global_step"]})


_SCALER: Spec = {
    "scale": (lambda v: is_number(v) and v > 0, "a number > 0"),
    "growth_factor": (lambda v: is_number(v) and v > 0, "a number > 0"),
    "backoff_factor": (lambda v: is_number(v) and v > 0, "a number > 0"),
    "growth_interval": (_positive, "an int >= 1"),
    "_growth_tracker": (is_count, "an int >= 0"),
}


def _numbers(v: Any) -> bool:
    return isinstance(v, list) and all(_kind(x) == "a number" for x in v)


class SchedulerPart(Part):
    """The LR scheduler's state and class; a factory built at the first fit gets it at birth."""

    name = "scheduler"
    spec = {"scheduler": (_optional(_mapping), "a scheduler state dict or None"),
            "scheduler_class": (_optional(_str), "a class name or None")}  # fmt: skip
    optional = frozenset({"scheduler_class"})

    def __init__(self, model: Model):
        self.model, self.stepper = model, model.stepper

    def state_dict(self) -> dict[str, Any]:
        sched = None if self.stepper is None else self.stepper.scheduler
        return {"scheduler": sched.state_dict() if sched is not None else None,
                "scheduler_class": type(sched).__name__ if sched is not None else None}  # fmt: skip

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        """The fields every torch scheduler keeps, and for the model's scheduler class (built)
        each field of the kind the model's has (``gamma`` a number, one ``base_lrs`` per group)."""
        out = super().content_problems(state)
        saved, where = state.get("scheduler"), "checkpoint['scheduler']"
        if out or saved is None:
            return out
        groups = None if self.model.optimizer is None else len(self.model.optimizer.param_groups)
        lrs = f"a list of {groups} number(s), one per parameter group" if groups else "a list of numbers"
        spec: Spec = {
            "last_epoch": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= -1, "an int >= -1"),
            "_step_count": (is_count, "an int >= 0"),
            "base_lrs": (lambda v: _numbers(v) and (groups is None or len(v) == groups), lrs),
            "_last_lr": (lambda v: _numbers(v) and (groups is None or len(v) == groups), lrs),
        }
        out = typed_problems(saved, spec, where, optional=frozenset(spec))
        mine = None if self.stepper is None else self.stepper.scheduler
        if not out and mine is not None and state.get("scheduler_class") == type(mine).__name__:
            out = _kind_problems(saved, mine.state_dict(), where, lists=False)
        return out

    def differences(self, state: Mapping[str, Any]) -> list[str]:
        stepper = self.stepper
        if stepper is not None and stepper.planned is not None:  # not built yet: it gets the state at birth
            return []
        return _scheduler_differences(None if stepper is None else stepper.scheduler, state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        stepper, saved = self.stepper, state["scheduler"]
        if stepper is None:
            return
        if saved is not None and stepper.scheduler is not None:
            stepper.scheduler.load_state_dict(saved)
        elif stepper.planned is not None:
            stepper.keep_scheduler_state(saved)  # loaded once the first fit has built it
        if stepper.global_step and stepper.scheduler is not None:
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


def _scalar_float(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()


_TRACKERS: Spec = {
    "loss_total": (_scalar_float, "a 0-dim floating-point tensor (the loss sum)"),
    "loss_count": (lambda v: is_number(v) and 0 <= v < float("inf"), "a count >= 0"),
    "loss_wsum": (_optional(_scalar_float), "a 0-dim floating-point tensor or None"),
    "metrics": (lambda v: _mapping(v) and all(isinstance(k, str) for k in v), "a dict {metric key: states}"),
}


def _metric_state_value(key: str, v: Any) -> bool:
    if key == "_update_count":
        return is_count(v)
    return isinstance(v, torch.Tensor) or (isinstance(v, list) and all(isinstance(t, torch.Tensor) for t in v))


def _trackers_problems(v: Any, where: str) -> list[str]:
    """The running totals of a checkpoint inside an epoch (:meth:`RunningTotals.state_dict`)."""
    out = typed_problems(v, _TRACKERS, where)
    if out:
        return out
    for key, states in v["metrics"].items():
        at = f"{where}['metrics'][{key!r}]"
        if not (_mapping(states) and all(isinstance(k, str) for k in states)):
            out.append(f"{at} is {_shown(states)}, expected a dict {{state name: tensor}}")
            continue
        out += [f"{at}[{k!r}] is {_shown(s)}, expected "
                f"{'an int >= 0' if k == '_update_count' else 'a tensor or a list of tensors'}"
                for k, s in states.items() if not _metric_state_value(k, s)]  # fmt: skip
    return out


def _data_order_problems(v: Any, where: str) -> list[str]:
    """A loader's own order (:func:`fitkit.data.order.capture`): its generators and samplers'
    states, or a ``StatefulDataLoader``'s own state."""
    if v is None or (_mapping(v) and "stateful" in v):
        return []
    spec: Spec = {"generators": (lambda g: isinstance(g, list) and all(_torch_rng(t) for t in g),
                                 f"a list of torch Generator states (uint8 tensors of {_TORCH_RNG_SIZE} bytes)"),
                  "samplers": (lambda s: isinstance(s, list), "a list of sampler states")}  # fmt: skip
    return typed_problems(v, spec, where)


def _pass_start_problems(v: Any, where: str) -> list[str]:
    if v is None:
        return []
    spec: Spec = {"epoch": (is_count, "an int >= 0"),
                  "rng": (_torch_rng, f"a torch RNG state (a uint8 tensor of {_TORCH_RNG_SIZE} bytes)")}  # fmt: skip
    out = typed_problems(v, spec, where)
    return out if out else _data_order_problems(v.get("order"), f"{where}['order']")


class PositionPart(Part):
    """Where the run is in the data: epoch, batches and samples done, the carried-over pass and
    what drew it, the epoch's RNG state, the running totals and metric states, the loader's own order."""

    name = "position"
    spec = {
        "epoch": (is_count, "an int >= 0"),
        "step_in_epoch": (is_count, "an int >= 0"),
        "samples_in_epoch": (_optional(is_count), "an int >= 0 or None"),
        "pass_offset": (_optional(is_count), "an int >= 0 or None"),
        "batch_size": (_optional(_positive), "an int >= 1 or None"),
        "world_size": (_optional(_positive), "an int >= 1 or None"),
        "epoch_rng": (_optional(_torch_rng), f"a torch RNG state (a uint8 tensor of {_TORCH_RNG_SIZE} bytes) or None"),
    }
    optional = frozenset({"samples_in_epoch", "pass_offset", "batch_size", "world_size", "epoch_rng",
                          "trackers", "data_order", "pass_start"})  # fmt: skip

    def __init__(self, model: Model):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return self.model.fit_position()

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
            out += _trackers_problems(state["trackers"], "checkpoint['trackers']")
        out += _data_order_problems(state.get("data_order"), "checkpoint['data_order']")
        out += _pass_start_problems(state.get("pass_start"), "checkpoint['pass_start']")
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
        return ["checkpoint has no 'rng'"] if "rng" not in state else _rng_problems(state["rng"])


class CallbacksPart(Part):
    """The running fit's callback states (by class name) and what each watches."""

    name = "callbacks"
    spec = {"callbacks": (lambda v: _mapping(v) and all(isinstance(k, str) for k in v), "a dict of callback states"),
            "callback_config": (_optional(lambda v: _mapping(v) and all(
                _mapping(w) and all(isinstance(x, str) for x in (*w, *w.values())) for w in v.values())),
                "a dict {callback key: {'monitor' / 'mode': str}}")}  # fmt: skip
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


def _history_problems(v: Any, where: str) -> list[str]:
    """A :class:`~fitkit.callbacks.History` state: one number per epoch that logged the key."""
    if v is None:
        return []
    spec: Spec = {
        "history": (lambda h: _mapping(h) and all(isinstance(k, str) for k in h), "a dict {log key: [numbers]}"),
        "epoch": (lambda e: isinstance(e, list) and all(is_count(i) for i in e), "a list of ints >= 0"),
        "validations": (lambda r: isinstance(r, list) and all(_mapping(x) and all(isinstance(k, str) for k in x)
                                                              for x in r), "a list of dicts"),
    }  # fmt: skip
    out = typed_problems(v, spec, where, optional=frozenset({"validations"}))
    if out:
        return out
    epochs = len(v["epoch"])
    for key, column in v["history"].items():
        if not (isinstance(column, list) and all(is_number(x) for x in column)):
            out.append(f"{where}['history'][{key!r}] is {_shown(column)}, expected a list of numbers")
        elif len(column) > epochs:
            out.append(f"{where}['history'][{key!r}] holds {len(column)} values for {epochs} epoch(s) "
                       f"({where}['epoch']), expected at most one per epoch")  # fmt: skip
    return out


class HistoryPart(Part):
    """The History so far (log values as Python numbers)."""

    name = "history"
    spec = {"history": (lambda v: v is None or _mapping(v), "a History state ({'history': {key: [numbers]}, "
                        "'epoch': [ints]}) or None")}  # fmt: skip

    def __init__(self, model: Model):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.model.history.state_dict() if self.model.history is not None else None}

    def content_problems(self, state: Mapping[str, Any]) -> list[str]:
        out = super().content_problems(state)
        return out if out else _history_problems(state["history"], "checkpoint['history']")


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
        raise_problems("The checkpoint", callback_state_problems(saved, mine), CheckpointError,
                       "so no callback state and no history was restored (the weights and the optimizer were)")
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


def raise_problems(what: str, problems: list[str], error: type[Exception],
                   outcome: str = "so nothing was loaded") -> None:  # fmt: skip
    """One error listing every problem of a checkpoint's content (``outcome``: what was not loaded)."""
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise error(
            f"{what} holds content fitkit does not write (damaged, or edited), {outcome}:\n"
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
