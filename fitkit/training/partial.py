"""Loading part of a checkpoint: ``load_checkpoint(path, weights_only=True)`` or
``load_checkpoint(path, ignore_keys=[...])`` (Composer's ``load_weights_only`` and
``load_ignore_keys``): fine-tuning from a pre-training checkpoint without its optimizer,
scheduler or position.

A checkpoint's parts, by the names ``ignore_keys`` takes (:mod:`fitkit.training.state`):

=================  ===========================================================================
name               what it restores
=================  ===========================================================================
``"module"``       the weights
``"optimizer"``    the optimizer's state and hyper-parameters (its class and groups are compared)
``"global_step"``  ``model.global_step`` and the GradScaler's scale
``"scheduler"``    the LR scheduler's state
``"position"``     where the next fit continues (epoch, batches done, RNG states)
``"callbacks"``    the callbacks' states (best values, patience, kept files)
``"history"``      the History so far
=================  ===========================================================================

The parts left out are neither checked nor loaded: an optimizer of another class, or a
scheduler the model does not have, is no mismatch then. ``callbacks`` and ``history`` continue
a run, so they are taken only with ``position``: without it the next fit starts afresh at epoch
0 (``load_checkpoint`` returns 0). What was taken and what was left out is logged (logger
``"fitkit"``, level INFO) and returned by :func:`taken_parts`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["PART_NAMES", "taken_parts", "registry_names", "for_next_fit"]

#: The names ``ignore_keys`` takes, in the order a checkpoint lists its parts.
PART_NAMES = ("module", "optimizer", "global_step", "scheduler", "position", "callbacks", "history")
_REGISTRY = {"global_step": ("stepper",), "position": ("position", "rng")}  # a name -> the registry's parts


def taken_parts(weights_only: object, ignore_keys: object) -> tuple[str, ...]:
    """The parts of a checkpoint to load, checked before anything is read.

    Raises:
        TypeError: ``weights_only`` not a bool; ``ignore_keys`` not a list of names.
        ValueError: an unknown name; every part left out; both arguments.

    Example:
        >>> taken_parts(False, None)
        ('module', 'optimizer', 'global_step', 'scheduler', 'position', 'callbacks', 'history')
        >>> taken_parts(True, None), taken_parts(False, ["optimizer", "scheduler", "position"])
        (('module',), ('module', 'global_step'))
        >>> taken_parts(False, ["optimiser"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Unknown part 'optimiser' in `ignore_keys`. Valid names: module, optimizer, ...
    """
    if not isinstance(weights_only, bool):
        raise TypeError(f"Expected `weights_only` to be a bool. Received: weights_only={weights_only!r}.")
    if ignore_keys is None:
        ignored: set[str] = set()
    elif isinstance(ignore_keys, str) or not isinstance(ignore_keys, Iterable):
        raise TypeError(
            f"Expected `ignore_keys` to be a list of part names. Received: ignore_keys={ignore_keys!r}. "
            "Fix: e.g. ignore_keys=['optimizer', 'scheduler', 'position']."
        )
    else:
        ignored = set(ignore_keys)
        for name in sorted(ignored - set(PART_NAMES), key=str):
            raise ValueError(f"Unknown part {name!r} in `ignore_keys`. Valid names: {', '.join(PART_NAMES)}.")
    if weights_only and ignored:
        raise ValueError(
            f"`weights_only=True` loads the module alone, and ignore_keys={ignore_keys!r} names parts to leave "
            "out. Fix: pass one of them."
        )
    if weights_only:
        return ("module",)
    if "position" in ignored:  # the callbacks and the history continue a run: not without its position
        ignored |= {"callbacks", "history"}
    taken = tuple(n for n in PART_NAMES if n not in ignored)
    if not taken:
        raise ValueError(f"ignore_keys={ignore_keys!r} leaves out every part: nothing would load. Fix: keep one.")
    return taken


def registry_names(taken: Iterable[str]) -> set[str]:
    """The :class:`~fitkit.training.state.RunState` part names of ``taken`` (the version always)."""
    return {"version"} | {r for name in taken for r in _REGISTRY.get(name, (name,))}


def for_next_fit(state: dict[str, Any], taken: tuple[str, ...]) -> dict[str, Any] | None:
    """The state a loaded checkpoint leaves for the next fit: ``None`` without ``position``;
    callbacks and history left out are empty."""
    if "position" not in taken:
        return None
    state = dict(state)
    if "callbacks" not in taken:
        state["callbacks"], state["callback_config"] = {}, {}
    if "history" not in taken:
        state["history"] = None
    return state
