"""Several named validation sets: ``fit(validation_data={"name": data, ...})`` and
``evaluate({"name": data, ...})`` (Lightning's and the Transformers Trainer's dict of
evaluation sets).

Each set is validated in turn, in the dict's order, with totals of its own, so every set's loss
and metrics are exact per-sample means over that set alone (the same numbers as ``evaluate`` on
the set by itself). ``fit`` logs each set's values as ``val_<name>_<key>`` and the first set's
also as ``val_<key>``, so a monitor that names no set (``EarlyStopping(monitor="val_loss")``)
follows the first set; ``evaluate`` returns ``{"<name>_<key>": ...}`` for every set (the
Trainer's ``eval_<name>_<key>`` without its prefix).

A dict is read as named sets when every value is a validation source of its own: an
``(x_val, y_val)`` or ``(x_val, y_val, sample_weight)`` tuple, a Dataset, a DataLoader or another
iterable of batches. A dict whose values are all tensors or arrays stays what it was: one set
whose inputs are a dict (``module(**x)``). A dict that mixes the two kinds is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fitkit.training.eval_loop import EvalLoop, signal_held

if TYPE_CHECKING:
    from fitkit.callbacks.base import CallbackList
    from fitkit.data import DeviceLoader
    from fitkit.model import Model

__all__ = ["ValidationSets", "named_sets", "prefixed_keys", "run_validation"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _is_array(v: object) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray)) or (
        isinstance(v, Mapping) and len(v) > 0 and all(_is_array(u) for u in v.values())
    )


def _is_source(v: object) -> bool:
    """Whether ``v`` is a validation source of its own (not one input tensor of a dict batch)."""
    if v is None or isinstance(v, (str, bytes, int, float, bool)) or _is_array(v):
        return False
    if isinstance(v, tuple):
        return len(v) in (1, 2, 3)  # (x_val,), (x_val, y_val), (x_val, y_val, sample_weight)
    return hasattr(v, "__iter__") or hasattr(v, "__getitem__")  # Dataset, DataLoader, list of batches


def named_sets(data: object, argument: str = "validation_data") -> dict[str, Any] | None:
    """The named sets of a dict of validation sources, or ``None`` for any other ``data``.

    Args:
        data: what the user passed as ``argument``.
        argument: the argument's name, for errors.

    Returns:
        ``{name: source}`` in the dict's order, or ``None`` when ``data`` is not a dict of sets
        (a dict whose values are all tensors or arrays is one set of dict inputs).

    Raises:
        ValueError: an empty dict; a dict mixing sources and tensors; a name that is not a
            non-empty string of letters, digits, ``_``, ``.`` or ``-`` starting with a letter or
            digit.

    Example:
        >>> x, y = torch.zeros(4, 2), torch.zeros(4, 1)
        >>> list(named_sets({"clean": (x, y), "noisy": (x, y)}))
        ['clean', 'noisy']
        >>> named_sets({"input_ids": x, "mask": x}) is None  # one set with dict inputs
        True
    """
    if not isinstance(data, Mapping) or isinstance(data, torch.Tensor):
        return None
    if not data:
        raise ValueError(
            f"Expected `{argument}` as a dict of named validation sets to hold at least one set. Received an "
            'empty dict. Fix: pass {"name": (x_val, y_val), ...}, or drop the argument.'
        )
    kinds = {name: _is_source(v) for name, v in data.items()}
    if not any(kinds.values()):
        return None
    if not all(kinds.values()):
        sources = [repr(k) for k, s in kinds.items() if s]
        others = [f"{k!r} ({type(data[k]).__name__})" for k, s in kinds.items() if not s]
        raise ValueError(
            f"`{argument}` is a dict that mixes validation sets ({', '.join(sources)}) with values that are not "
            f"sets ({', '.join(others)}), so it is neither named sets nor one batch of dict inputs. Fix: for "
            'several sets make every value a set: {"name": (x_val, y_val), "other": DataLoader(...)}; for one '
            "set with dict inputs make every value a tensor or array."
        )
    for name in data:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"Expected each name of `{argument}`'s validation sets to be a non-empty string of letters, digits, "
                f"'_', '.' or '-' (it names the log keys val_<name>_<metric>). Received: {name!r}. Fix: rename the "
                "set, e.g. 'test' or 'ood_2'."
            )
    return dict(data)


def prefixed_keys(names: list[str], keys: list[str], argument: str = "validation_data") -> list[str]:
    """The log keys of several sets: ``keys`` (the first set's), then ``<name>_<key>`` per set.

    Raises:
        ValueError: a set's key equals a key of the logs (a set named ``"top"`` and a metric
            ``"top_loss"``).

    Example:
        >>> prefixed_keys(["a", "b"], ["loss", "mae"])
        ['loss', 'mae', 'a_loss', 'a_mae', 'b_loss', 'b_mae']
    """
    out = list(keys)
    for name in names:
        for key in keys:
            new = f"{name}_{key}"
            if new in out:
                raise ValueError(
                    f"The validation set {name!r} logs {new!r}, which is already a key of the logs, so one value "
                    f"would overwrite the other. Received set names {names} and keys {keys}. Fix: rename the set "
                    f"in `{argument}`."
                )
            out.append(new)
    return out


class ValidationSets:
    """Named validation loaders, validated in turn (see the module's docstring).

    Args:
        loaders: ``{name: DeviceLoader}`` in the order to validate.
    """

    def __init__(self, loaders: dict[str, Any]):
        self.loaders = dict(loaders)

    @property
    def names(self) -> list[str]:
        return list(self.loaders)

    def items(self) -> list[tuple[str, Any]]:
        return list(self.loaders.items())

    def map(self, fn: Callable[[DeviceLoader], DeviceLoader]) -> ValidationSets:
        """A ``ValidationSets`` of ``fn(loader)`` for each set (for example a cap on its batches)."""
        return ValidationSets({name: fn(loader) for name, loader in self.loaders.items()})


def run_validation(
    model: Model,
    validation: DeviceLoader | ValidationSets,
    callbacks: CallbackList,
    steps: int | None,
    what: str = "validation_data",
) -> dict[str, float]:
    """Loss and metrics of one validation or evaluation: one :class:`EvalLoop` per set.

    For :class:`ValidationSets`, every set's values under ``<name>_<key>``, and inside ``fit``
    (``what="validation_data"``) the first set's also under their own keys (``fit`` then
    prefixes them all with ``val_``).
    """
    if not isinstance(validation, ValidationSets):
        return EvalLoop(model, validation, callbacks, steps, what=what).run()
    logs: dict[str, float] = {}
    for i, (name, loader) in enumerate(validation.items()):
        label = what if what == "evaluate" else f"{what}[{name!r}]"  # "evaluate": a loss of nothing is an error
        if i and signal_held(model):
            break  # a signal: the fit stops; the sets after this one do not run
        set_logs = EvalLoop(model, loader, callbacks, steps, what=label).run()
        if i == 0 and what != "evaluate":
            logs.update(set_logs)
        logs.update({f"{name}_{k}": v for k, v in set_logs.items()})
    return logs
