"""Is a checkpoint's content what fitkit wrote? Types and ranges, checked before anything loads.

A checksum guards integrity, not origin: an edited file with its checksum recomputed passes
it. These checks make such a file (or one from a buggy writer) fail with one clear error that
lists every problem, before the module, the optimizer or any callback is changed. The helpers
here serve the parts of a run's state (:mod:`fitkit.training.state`), each checking its own keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["callback_state_problems", "typed_problems", "is_count", "is_number", "is_score"]


#: Counts past this do not fit the int64 tensors torch keeps them in (no run reaches it).
COUNT_LIMIT = 2**63


def is_count(value: Any) -> bool:
    """An int ``>= 0`` (not a bool) below :data:`COUNT_LIMIT`."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < COUNT_LIMIT


def is_number(value: Any) -> bool:
    """An int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_score(value: Any) -> bool:
    """A monitored value as a callback keeps it: a number, not NaN (``inf`` is where a best
    starts; a NaN is never a best, and ranks no file)."""
    return is_number(value) and value == value


def typed_problems(
    state: Any,
    spec: Mapping[str, tuple[Callable[[Any], bool], str]],
    where: str,
    optional: set[str] | frozenset[str] = frozenset(),
) -> list[str]:
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
            shown = (
                repr(value)
                if not isinstance(value, torch.Tensor)
                else f"a {value.dtype} tensor of shape {tuple(value.shape)}"
            )
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
