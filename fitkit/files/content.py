"""Is a checkpoint's content what fitkit wrote? Types and ranges, checked before anything loads.

A checksum guards integrity, not origin: an edited file with its checksum recomputed passes
it. These checks make such a file (or one from a buggy writer) fail with one clear error that
lists every problem, before the module, the optimizer or any callback is changed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["checkpoint_problems", "callback_state_problems", "typed_problems", "is_count", "is_number"]


def is_count(value: Any) -> bool:
    """An int ``>= 0`` (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_number(value: Any) -> bool:
    """An int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


_TOP: dict[str, tuple[Callable[[Any], bool], str]] = {
    "epoch": (is_count, "an int >= 0"),
    "step_in_epoch": (is_count, "an int >= 0"),
    "global_step": (is_count, "an int >= 0"),
    "samples_in_epoch": (_optional(is_count), "an int >= 0 or None"),
    "pass_offset": (_optional(is_count), "an int >= 0 or None"),
    "batch_size": (_optional(lambda v: is_count(v) and v > 0), "an int >= 1 or None"),
    "module": (lambda v: isinstance(v, Mapping), "a state dict"),
    "callbacks": (lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v), "a dict of callback states"),
    "callback_config": (_optional(lambda v: isinstance(v, Mapping)), "a dict"),
    "history": (_optional(lambda v: isinstance(v, Mapping)), "a dict or None"),
    "rng": (lambda v: isinstance(v, Mapping) and isinstance(v.get("torch"), torch.Tensor)
            and "python" in v and "numpy" in v, "the RNG states fitkit saves"),
    "pass_start": (lambda v: isinstance(v, Mapping) and is_count(v.get("epoch"))
                   and isinstance(v.get("rng"), torch.Tensor) and isinstance(v.get("order"), (Mapping, type(None))),
                   "the epoch, RNG state and order a pass was drawn from"),
}  # fmt: skip
_OPTIONAL = {"samples_in_epoch", "pass_offset", "pass_start", "batch_size", "callback_config"}


def typed_problems(state: Any, spec: Mapping[str, tuple[Callable[[Any], bool], str]], where: str,
                   optional: set[str] | frozenset[str] = frozenset()) -> list[str]:  # fmt: skip
    """One line per key of ``spec`` that ``state`` lacks or holds with a value its check refuses.

    Example:
        >>> typed_problems({"epoch": -1}, {"epoch": (is_count, "an int >= 0")}, "checkpoint")
        ["checkpoint['epoch'] is -1, expected an int >= 0"]
    """
    if not isinstance(state, Mapping):
        return [f"{where} is a {type(state).__name__}, expected a dict"]
    out = []
    for key, (check, expected) in spec.items():
        if key not in state:
            if key not in optional:
                out.append(f"{where} has no {key!r}")
            continue
        value = state[key]
        if not check(value):
            shown = repr(value) if not isinstance(value, torch.Tensor) else f"a tensor of shape {tuple(value.shape)}"
            out.append(f"{where}[{key!r}] is {shown[:60]}, expected {expected}")
    return out


def callback_state_problems(saved: Mapping[str, Any], callbacks: Mapping[str, Any]) -> list[str]:
    """The saved callback states against the fit's callbacks (``{key: callback}``).

    A callback that defines ``_state_problems(state) -> list[str]`` checks its own types; any
    other stateful callback of fitkit's needs at least a dict with the keys of its own state.
    """
    out: list[str] = []
    for key, cb in callbacks.items():
        if key not in saved:
            continue
        state = saved[key]
        check = getattr(cb, "_state_problems", None)
        if callable(check):
            out += [f"callbacks[{key!r}]: {p}" for p in check(state)]
        elif hasattr(cb, "_get_state"):
            if not isinstance(state, Mapping):
                out.append(f"callbacks[{key!r}] is a {type(state).__name__}, expected a dict")
                continue
            missing = sorted(set(cb._get_state()) - set(state))
            if missing:
                out.append(f"callbacks[{key!r}] has no {', '.join(map(repr, missing))}")
    return out


def checkpoint_problems(state: Mapping[str, Any], callbacks: Mapping[str, Any] | None = None) -> list[str]:
    """Every way a fitkit checkpoint's content is not what fitkit writes.

    Args:
        state: the loaded checkpoint.
        callbacks: ``{key: callback}`` of the running fit, when known: their saved states are
            checked too.

    Example:
        >>> checkpoint_problems({"epoch": "x"})[:2]
        ["checkpoint['epoch'] is 'x', expected an int >= 0", "checkpoint has no 'step_in_epoch'"]
    """
    out = typed_problems(state, _TOP, "checkpoint", _OPTIONAL)
    if callbacks and isinstance(state.get("callbacks"), Mapping):
        out += callback_state_problems(state["callbacks"], callbacks)
    return out
