"""Does a saved state fit this model? Pure comparisons, run before anything is loaded.

``nn.Module.load_state_dict`` copies tensor by tensor and fails at the first bad one, after the
earlier ones changed; ``Optimizer.load_state_dict`` accepts another optimizer's state and fails
at the next step (``KeyError: 'momentum'``) or silently drops a hyper-parameter. These functions
list every difference first, one line each, so a loader can raise once and change nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["state_dict_differences", "optimizer_differences", "check_state_dict_fits"]

# Param-group keys that are implementation switches torch added over versions, not what makes
# one optimizer another: ignored when a file does not name its optimizer class.
OPTIMIZER_SWITCHES = {"foreach", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay"}


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def state_dict_differences(current: Mapping[str, Any], incoming: Mapping[str, Any], strict: bool = True) -> list[str]:
    """Every way ``incoming`` (a file's state dict) does not fit ``current`` (the module's).

    Args:
        current: the module's ``state_dict()`` (only shapes and dtypes are read).
        incoming: the state dict to load.
        strict: also report missing and unexpected keys, as ``load_state_dict(strict=True)``.
            Shapes and dtypes are compared either way.

    Returns:
        One line per difference (missing keys, unexpected keys, shape and dtype mismatches);
        empty when the state fits.

    Example:
        >>> big, small = torch.nn.Linear(64, 10), torch.nn.Linear(64, 5)
        >>> for line in state_dict_differences(big.state_dict(), small.state_dict()):
        ...     print(line)
        'weight': shape (5, 64) in the file, (10, 64) in the module
        'bias': shape (5,) in the file, (10,) in the module
    """
    if not isinstance(incoming, Mapping):
        return [f"the file holds a {type(incoming).__name__}, not a state dict ({{name: tensor}})"]
    out = []
    if strict:
        out += [f"{k!r}: in the module, missing from the file" for k in current if k not in incoming]
        out += [f"{k!r}: in the file, not in the module" for k in incoming if k not in current]
    for key, mine in current.items():
        if key not in incoming or not isinstance(mine, torch.Tensor):  # extra state loads as given
            continue
        theirs = incoming[key]
        if not isinstance(theirs, torch.Tensor):
            out.append(f"{key!r}: a {type(theirs).__name__} in the file, a tensor in the module")
            continue
        if theirs.shape != mine.shape:
            out.append(f"{key!r}: shape {_shape(theirs)} in the file, {_shape(mine)} in the module")
        if theirs.dtype != mine.dtype:
            out.append(f"{key!r}: dtype {theirs.dtype} in the file, {mine.dtype} in the module")
    return out


def check_state_dict_fits(module: torch.nn.Module, state: Any, strict: bool = True) -> None:
    """Raise, changing nothing, unless ``state`` loads into ``module`` whole.

    ``nn.Module.load_state_dict`` copies tensor by tensor and raises at the end (or at a bad
    tensor), after the others changed; this lists every difference first.

    Raises:
        RuntimeError: one line per difference (torch's error type for a state that does not fit).

    Example:
        >>> check_state_dict_fits(torch.nn.Linear(2, 1), {"weight": torch.zeros(1, 2)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: The state dict does not fit the module, so nothing was loaded:
          - 'bias': in the module, missing from the file...
    """
    differences = state_dict_differences(module.state_dict(), state, strict)
    if differences:
        lines = "\n".join(f"  - {d}" for d in differences)
        raise RuntimeError(
            f"The state dict does not fit the module, so nothing was loaded:\n{lines}\nFix: pass the state "
            "dict of the same architecture (cast tensors with .to(dtype) first), or strict=False to load only "
            "the keys both hold."
        )


def optimizer_differences(
    optimizer: torch.optim.Optimizer, state: Mapping[str, Any], saved_class: str | None
) -> list[str]:
    """Every way a saved ``Optimizer.state_dict()`` does not fit ``optimizer``.

    Compared: the optimizer class (``saved_class``, the file's ``type(opt).__name__``; for a
    file without it, the hyper-parameter keys of each param group, so Adam and SGD differ), the
    number of param groups, the parameters per group, and the shape of each per-parameter state
    tensor against its parameter (a state dimension of 1 is a factored statistic, as in
    Adafactor, and fits; ``LBFGS`` keeps no per-parameter state and is not compared).

    Args:
        optimizer: the model's optimizer.
        state: the file's optimizer state dict (integer parameter ids).
        saved_class: the optimizer class name the file records, or ``None``.

    Returns:
        One line per difference; empty when the state fits.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(3))
        >>> adam = torch.optim.Adam([w], weight_decay=0.1)
        >>> optimizer_differences(torch.optim.AdamW([w]), adam.state_dict(), "Adam")
        ['optimizer: Adam in the file, AdamW in the model']
        >>> optimizer_differences(torch.optim.SGD([w], lr=0.1), adam.state_dict(), None)  # doctest: +ELLIPSIS
        ["optimizer group 0: hyper-parameters ['amsgrad', 'betas', 'eps'] only in the file, ['dampening', ...
    """
    name = type(optimizer).__name__
    out = []
    if saved_class is not None and saved_class != name:
        out.append(f"optimizer: {saved_class} in the file, {name} in the model")
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups"), list):
        return [*out, "optimizer: the file's optimizer state is not an Optimizer.state_dict()"]
    saved_groups, groups = state["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(groups):
        return [*out, f"optimizer: param groups: {len(saved_groups)} in the file, {len(groups)} in the model"]
    out += _group_differences(saved_groups, groups, saved_class)
    if saved_class == name:
        out += [
            d for i, (a, b) in enumerate(zip(saved_groups, groups, strict=True)) for d in _switch_differences(i, a, b)
        ]
    if out or isinstance(optimizer, torch.optim.LBFGS):
        return out
    return _state_shape_differences(state, saved_groups, groups)


def _group_differences(saved_groups: list[Any], groups: list[Any], saved_class: str | None) -> list[str]:
    out = []
    for i, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        if len(saved["params"]) != len(group["params"]):
            out.append(
                f"optimizer group {i}: parameters: {len(saved['params'])} in the file, "
                f"{len(group['params'])} in the model"
            )
        if saved_class is None:
            out += _hyper_parameter_differences(i, saved, group)
    return out


#: Switches that choose a kernel, not the update: torch picks them per device, either loads.
KERNEL_SWITCHES = frozenset({"foreach", "fused"})


def _switch_differences(i: int, saved: Mapping[str, Any], group: Mapping[str, Any]) -> list[str]:
    """The switches of the update (``maximize``, ``amsgrad``, ``nesterov``, ``capturable``, ...) of
    a file of the model's optimizer class: the file's replace the model's at load, so a file of
    another setting would change the update."""
    return [
        f"optimizer group {i}: {k}={saved[k]!r} in the file, {v!r} in the model (a switch of the update)"
        for k, v in group.items()
        if isinstance(v, bool) and k not in KERNEL_SWITCHES and k in saved and saved[k] is not v
    ]


def _state_shape_differences(state: Mapping[str, Any], saved_groups: list[Any], groups: list[Any]) -> list[str]:
    """Per-parameter state tensors whose shape does not fit their parameter's."""
    out = []
    ids = [p for g in saved_groups for p in g["params"]]
    params = dict(zip(ids, (p for g in groups for p in g["params"]), strict=True))
    for pid, pstate in (state.get("state") or {}).items():
        param = params.get(pid)
        if param is None:
            out.append(f"optimizer state of parameter {pid}: no such parameter in the file's param groups")
            continue
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor) and value.dim() and not _fits(value.shape, param.shape):
                out.append(
                    f"optimizer state {key!r} of parameter {pid}: shape {_shape(value)} in the file, "
                    f"parameter shape {_shape(param)} in the model"
                )
    return out


def _hyper_parameter_differences(i: int, saved: Mapping[str, Any], group: Mapping[str, Any]) -> list[str]:
    theirs, mine = set(saved) - {"params"} - OPTIMIZER_SWITCHES, set(group) - {"params"} - OPTIMIZER_SWITCHES
    out = []
    if theirs != mine:
        out.append(
            f"optimizer group {i}: hyper-parameters {sorted(theirs - mine)} only in the file, "
            f"{sorted(mine - theirs)} only in the model (another optimizer class)"
        )
    key = "decoupled_weight_decay"  # what tells AdamW from Adam in torch >= 2.6
    if key in saved and key in group and bool(saved[key]) != bool(group[key]):
        out.append(f"optimizer group {i}: {key}={saved[key]} in the file, {group[key]} in the model (Adam vs AdamW)")
    return out


def _fits(state_shape: torch.Size, param_shape: torch.Size) -> bool:
    if len(state_shape) != len(param_shape):
        return True  # another layout (a flattened or factored statistic): nothing to compare
    return all(s == p or s == 1 for s, p in zip(state_shape, param_shape, strict=True))
