"""The checks the parts of a run's state make of a loaded checkpoint (:mod:`fitkit.training.state`).

Each returns one line per value fitkit does not write (types, ranges, lengths and shapes, named
by their nested field, e.g. ``checkpoint['trackers']['loss_total']``), or a predicate over one
value; nothing here changes anything, so every part can check before any part loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fitkit.files.content import COUNT_LIMIT, is_count, is_number, typed_problems
from fitkit.files.differences import OPTIMIZER_SWITCHES

if TYPE_CHECKING:
    pass

Check = Callable[[Any], bool]


Spec = dict[str, tuple[Check, str]]


def optional_check(check: Check) -> Check:
    return lambda v: v is None or check(v)


def mapping(v: Any) -> bool:
    return isinstance(v, Mapping)


def is_str(v: Any) -> bool:
    return isinstance(v, str)


def byte_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1


def torch_rng(v: Any) -> bool:
    """A CPU torch RNG state (``torch.get_rng_state()``: a uint8 tensor of its fixed size)."""
    return byte_tensor(v) and v.numel() == TORCH_RNG_SIZE


TORCH_RNG_SIZE = torch.get_rng_state().numel()


U32 = 2**32


def python_rng(py: Any) -> bool:
    # random.getstate(): (3, 624 words + the index, the cached gauss value)
    if not (
        isinstance(py, Sequence)
        and len(py) == 3
        and py[0] == 3
        and isinstance(py[1], Sequence)
        and len(py[1]) == 625
        and (py[2] is None or isinstance(py[2], float))
    ):
        return False
    words = py[1]
    return all(is_count(w) and w < U32 for w in words) and words[-1] <= 624


def numpy_rng(nps: Any) -> bool:
    # np.random.get_state(): ("MT19937", 624 words, position, has_gauss, cached_gaussian)
    if not (
        isinstance(nps, Sequence)
        and len(nps) == 5
        and nps[0] == "MT19937"
        and isinstance(nps[1], torch.Tensor)
        and nps[1].dim() == 1
        and nps[1].numel() == 624
        and not nps[1].is_floating_point()
        and not nps[1].is_complex()
        and nps[1].dtype != torch.bool
        and is_count(nps[2])
        and nps[2] <= 624
        and nps[3] in (0, 1)
        and isinstance(nps[3], int)
        and is_number(nps[4])
        and math.isfinite(nps[4])
    ):
        return False
    return bool(((nps[1] >= 0) & (nps[1] < U32)).all())


def rng_problems(rng: Any) -> list[str]:
    """What in a saved RNG state :func:`set_rng_state` could not take (checked before it runs)."""
    if not isinstance(rng, Mapping):
        return [f"checkpoint['rng'] is {type(rng).__name__}, expected the RNG states fitkit saves"]
    out = []
    if not python_rng(rng.get("python")):
        out.append(
            "checkpoint['rng']['python'] is not a state of Python's random module "
            "(random.getstate(): version 3, 625 words < 2**32, a float or None)"
        )
    if not numpy_rng(rng.get("numpy")):
        out.append(
            "checkpoint['rng']['numpy'] is not a state of NumPy's global generator "
            "(('MT19937', 624 integer words < 2**32, a position <= 624, 0 or 1, a float))"
        )
    if not torch_rng(rng.get("torch")):
        out.append(
            f"checkpoint['rng']['torch'] is {shown(rng.get('torch'))}, expected a torch RNG state "
            f"(a uint8 tensor of {TORCH_RNG_SIZE} bytes)"
        )
    cuda = rng.get("cuda", [])
    if not (isinstance(cuda, Sequence) and not isinstance(cuda, str) and all(byte_tensor(s) for s in cuda)):
        out.append("checkpoint['rng']['cuda'] is not a list of CUDA RNG states")
    return out


def shown(value: Any) -> str:
    """A value as an error message shows it (a tensor by its dtype and shape)."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value)[:60]


def kind_of(v: Any, lengths: bool = True) -> str | None:
    """What a hyper-parameter or scheduler field is, for comparing a file's with the live one's
    (``None``: anything goes, e.g. a field that is ``None`` until first used)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "a bool"
    if is_number(v):
        return "a number" if math.isfinite(v) and abs(v) < COUNT_LIMIT else "a number out of range"
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return "a number" if not v.is_complex() else "a complex number"
    if isinstance(v, complex):
        return "a complex number"
    if isinstance(v, str):
        return "a str"
    if isinstance(v, (list, tuple)):
        return f"a list of {len(v)}" if lengths else "a list"
    if isinstance(v, Mapping):
        return "a dict"
    return None


def kind_problems(
    saved: Mapping[str, Any],
    live: Mapping[str, Any],
    where: str,
    skip: frozenset[str] = frozenset(),
    lists: bool = True,
) -> list[str]:
    """Fields whose kind (number, str, list of n, ...) differs from the live object's same field.

    ``lists``: also compare list lengths and items (an optimizer's ``betas``); a scheduler's
    lists may grow (a custom scheduler's history), so for it a list is only a list.
    """
    out = []
    for key, mine in live.items():
        if key in skip or key not in saved:
            continue
        theirs = saved[key]
        a, b = kind_of(theirs, lists), kind_of(mine, lists)
        if a is not None and b is not None and a != b:
            out.append(f"{where}[{key!r}] is {shown(theirs)}, expected {b} as the model's")
        elif _negated(theirs, mine):
            out.append(f"{where}[{key!r}] is {shown(theirs)}, expected a number >= 0 as the model's")
        elif lists and isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)):
            out += [
                f"{where}[{key!r}][{i}] is {shown(t)}, expected {kind_of(m)}{' >= 0' if _negated(t, m) else ''} "
                "as the model's"
                for i, (t, m) in enumerate(zip(theirs, mine, strict=True))
                if _negated(t, m) or (kind_of(t) is not None and kind_of(m) is not None and kind_of(t) != kind_of(m))
            ]
    return out


def _negated(saved: Any, live: Any) -> bool:
    """A negative number where the live one is >= 0: every rate, factor, size and count of
    torch's optimizers and schedulers is (their constructors refuse negative ones)."""
    return kind_of(saved) == kind_of(live) == "a number" and is_number(saved) and is_number(live) and live >= 0 > saved


def positive(v: Any) -> bool:
    return is_count(v) and v > 0


def param_state_value(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, torch.Tensor)):
        return True
    return isinstance(v, (list, tuple)) and all(x is None or isinstance(x, (int, float, torch.Tensor)) for x in v)


def optimizer_problems(saved: Any, optimizer: Any, saved_class: Any) -> list[str]:
    """An ``Optimizer.state_dict()``: its structure, and for the model's optimizer class each
    group's hyper-parameters (present, of the model's kinds: ``lr`` a number, ``betas`` two)."""
    where = "checkpoint['optimizer']"
    spec: Spec = {
        "state": (mapping, "a dict {parameter id: state}"),
        "param_groups": (lambda g: isinstance(g, list) and all(mapping(x) for x in g), "a list of dicts"),
    }
    out = typed_problems(saved, spec, where)
    if out:
        return out
    for pid, pstate in saved["state"].items():
        at = f"{where}['state'][{pid!r}]"
        if not is_count(pid):
            out.append(f"{where}['state'] has the key {pid!r}, expected parameter ids (ints >= 0)")
        elif not (mapping(pstate) and all(isinstance(k, str) for k in pstate)):
            out.append(f"{at} is {shown(pstate)}, expected a dict {{name: tensor}}")
        else:
            out += [
                f"{at}[{k!r}] is {shown(v)}, expected a tensor or a number"
                for k, v in pstate.items()
                if not param_state_value(v)
            ]
    ids: list[Any] = []
    for i, group in enumerate(saved["param_groups"]):
        params = group.get("params")
        if not (isinstance(params, list) and all(is_count(p) for p in params)):
            out.append(f"{where}['param_groups'][{i}]['params'] is {shown(params)}, expected a list of parameter ids")
        else:
            ids += params
    if len(ids) != len(set(ids)):
        out.append(f"{where}['param_groups'] name a parameter id twice")
    same_class = optimizer is not None and saved_class == type(optimizer).__name__
    if out or not same_class or len(saved["param_groups"]) != len(optimizer.param_groups):
        return out  # another class or other groups: a difference (ValueError), reported there
    needed = set(optimizer.defaults) - OPTIMIZER_SWITCHES - {"params"}
    for i, (theirs, mine) in enumerate(zip(saved["param_groups"], optimizer.param_groups, strict=True)):
        at = f"{where}['param_groups'][{i}]"
        out += [f"{at} has no {k!r}" for k in sorted(needed - set(theirs)) if k in mine]
        out += kind_problems(theirs, mine, at, frozenset({"params"}))
        out += [
            f"{at}[{k!r}] is {shown(theirs[k])}, expected None or a bool (a kernel switch)"
            for k in ("foreach", "fused")
            if k in theirs and not (theirs[k] is None or isinstance(theirs[k], bool))
        ]
    return out or param_state_layout_problems(saved, optimizer)


# torch's own optimizers keep these per-parameter states as scalars, every other state tensor
# in the shape of its parameter (LBFGS keeps flat vectors, Adafactor factored ones).
SCALAR_STATES = frozenset({"step", "mu_product", "eta", "mu"})


OWN_LAYOUT = ("LBFGS", "Adafactor")


def param_state_layout_problems(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> list[str]:
    """A state tensor of one of torch's optimizers that has not its parameter's number of
    dimensions (a 0-dim ``exp_avg``): torch's fused and foreach kernels index it as the
    parameter, past its end. Same dimensions, another shape: a difference, reported there."""
    name = type(optimizer).__name__
    if not type(optimizer).__module__.startswith("torch.optim") or name in OWN_LAYOUT:
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
            if isinstance(v, torch.Tensor):
                out += _state_tensor_problems(at, key, v, param, name)
    return out + _group_state_key_problems(saved, name)


def _state_tensor_problems(at: str, key: str, v: torch.Tensor, param: torch.Tensor, name: str) -> list[str]:
    """One saved state tensor against its parameter: a scalar state one number, any other its dimensions."""
    if key in SCALAR_STATES:
        if v.numel() != 1:
            return [f"{at} is {shown(v)}, expected a scalar ({name} keeps {key!r} as one number)"]
        if key == "step" and (v.is_complex() or not math.isfinite(float(v)) or float(v) < 0):
            return [f"{at} is {v.item()!r}, expected a step count: a real, finite number >= 0"]
    elif v.dim() != param.dim() or v.is_floating_point() != param.is_floating_point():
        kind = "floating-point" if param.is_floating_point() else str(param.dtype)
        return [f"{at} is {shown(v)}, expected a {kind} tensor of its parameter's shape {tuple(param.shape)}"]
    return []


def _group_state_key_problems(saved: Mapping[str, Any], name: str) -> list[str]:
    """Each parameter stepped in a group keeps the same states."""
    out = []
    for group in saved["param_groups"]:  # each parameter stepped keeps the same states
        keys = {pid: set(saved["state"][pid]) for pid in group["params"] if saved["state"].get(pid)}
        union = set().union(*keys.values())
        for pid, k in keys.items():
            if k != union:
                out.append(
                    f"checkpoint['optimizer']['state'][{pid}] has no {', '.join(map(repr, sorted(union - k)))} "
                    f"({name} keeps {sorted(union)} for each parameter of its group)"
                )
    return out


#: Flags torch sets only inside ``step()`` (a saved state has them ``False``): ``_is_initial``
#: makes several schedulers return their initial rates.
SCHEDULER_FLAGS: Spec = {
    flag: (lambda v: v is False, "False (torch sets it only inside step())")
    for flag in ("_is_initial", "_get_lr_called_within_step")
}


SCALER: Spec = {
    "scale": (lambda v: is_number(v) and v > 0, "a number > 0"),
    "growth_factor": (lambda v: is_number(v) and v > 0, "a number > 0"),
    "backoff_factor": (lambda v: is_number(v) and v > 0, "a number > 0"),
    "growth_interval": (positive, "an int >= 1"),
    "_growth_tracker": (is_count, "an int >= 0"),
}


def numbers(v: Any) -> bool:
    """A list of learning rates: finite numbers >= 0."""
    return isinstance(v, list) and all(kind_of(x) == "a number" and float(x) >= 0 for x in v)


def scheduler_differences(scheduler: Any, state: Mapping[str, Any]) -> list[str]:
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


def scalar_float(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()


TRACKERS: Spec = {
    "loss_total": (scalar_float, "a 0-dim floating-point tensor (the loss sum)"),
    "loss_count": (lambda v: is_number(v) and 0 <= v < COUNT_LIMIT, "a count >= 0"),
    "loss_wsum": (optional_check(scalar_float), "a 0-dim floating-point tensor or None"),
    "metrics": (lambda v: mapping(v) and all(isinstance(k, str) for k in v), "a dict {metric key: states}"),
}


def metric_state_value(key: str, v: Any) -> bool:
    if key == "_update_count":
        return is_count(v)
    return _real_tensor(v) or (isinstance(v, list) and all(map(_real_tensor, v)))


def _real_tensor(v: Any) -> bool:
    """A metric's state: torchmetrics keeps real tensors (a complex one would compute a complex value)."""
    return isinstance(v, torch.Tensor) and not v.is_complex()


def trackers_problems(v: Any, where: str) -> list[str]:
    """The running totals of a checkpoint inside an epoch (:meth:`RunningTotals.state_dict`)."""
    out = typed_problems(v, TRACKERS, where)
    if out:
        return out
    shares = v.get("shares")  # each rank's own totals (torchrun), in the same layout
    if shares is not None and not isinstance(shares, list):
        return [f"{where}['shares'] is {shown(shares)}, expected a list (one dict of totals per rank)"]
    for r, share in enumerate(shares or []):
        out += trackers_problems(share, f"{where}['shares'][{r}]")
    terms = v.get("terms")  # a loss of terms (fitkit.losses.terms): their names and sums
    if terms is not None and not (
        mapping(terms)
        and isinstance(terms.get("names"), list)
        and all(isinstance(n, str) for n in terms["names"])
        and isinstance(terms.get("total"), torch.Tensor)
        and terms["total"].is_floating_point()
        and tuple(terms["total"].shape) == (len(terms["names"]),)
    ):
        out.append(f"{where}['terms'] is {shown(terms)}, expected a dict {{'names': [str], 'total': (K,) tensor}}")
    for key, states in v["metrics"].items():
        at = f"{where}['metrics'][{key!r}]"
        if not (mapping(states) and all(isinstance(k, str) for k in states)):
            out.append(f"{at} is {shown(states)}, expected a dict {{state name: tensor}}")
            continue
        out += [
            f"{at}[{k!r}] is {shown(s)}, expected "
            f"{'an int >= 0' if k == '_update_count' else 'a tensor or a list of tensors (real)'}"
            for k, s in states.items()
            if not metric_state_value(k, s)
        ]
    return out


def data_order_problems(v: Any, where: str) -> list[str]:
    """A loader's own order (:func:`fitkit.data.order.capture`): its generators and samplers'
    states, or a ``StatefulDataLoader``'s own state."""
    if v is None or (mapping(v) and "stateful" in v):
        return []
    spec: Spec = {
        "generators": (
            lambda g: isinstance(g, list) and all(torch_rng(t) for t in g),
            f"a list of torch Generator states (uint8 tensors of {TORCH_RNG_SIZE} bytes)",
        ),
        "samplers": (lambda s: isinstance(s, list), "a list of sampler states"),
    }
    return typed_problems(v, spec, where)


def pass_start_problems(v: Any, where: str) -> list[str]:
    if v is None:
        return []
    spec: Spec = {
        "epoch": (is_count, "an int >= 0"),
        "rng": (torch_rng, f"a torch RNG state (a uint8 tensor of {TORCH_RNG_SIZE} bytes)"),
    }
    out = typed_problems(v, spec, where)
    return out if out else data_order_problems(v.get("order"), f"{where}['order']")


def history_problems(v: Any, where: str) -> list[str]:
    """A :class:`~fitkit.callbacks.History` state: one number per epoch that logged the key."""
    if v is None:
        return []
    spec: Spec = {
        "history": (lambda h: mapping(h) and all(isinstance(k, str) for k in h), "a dict {log key: [numbers]}"),
        "epoch": (lambda e: isinstance(e, list) and all(is_count(i) for i in e), "a list of ints >= 0"),
        "validations": (
            lambda r: isinstance(r, list) and all(mapping(x) and all(isinstance(k, str) for k in x) for x in r),
            "a list of dicts",
        ),
    }
    out = typed_problems(v, spec, where, optional=frozenset({"validations"}))
    if out:
        return out
    epochs = len(v["epoch"])
    for key, column in v["history"].items():
        if not (isinstance(column, list) and all(is_number(x) for x in column)):
            out.append(f"{where}['history'][{key!r}] is {shown(column)}, expected a list of numbers")
        elif len(column) > epochs:
            out.append(
                f"{where}['history'][{key!r}] holds {len(column)} values for {epochs} epoch(s) "
                f"({where}['epoch']), expected at most one per epoch"
            )
    return out
