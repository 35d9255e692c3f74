"""What a fit's budgets and intervals can reach, warned about before step 1.

A budget already spent (``max_steps`` at or below ``model.global_step``) trains nothing; an
interval longer than the fit (``validation_interval`` steps that no step of this fit reaches)
never validates; an ``EarlyStopping`` whose ``start_from_epoch`` is past the last epoch never
looks; a ``ModelCheckpoint(every_n_epochs=)`` past the fit writes nothing. None of these is an
error (a script may be rerun on a finished model), so each is a
:class:`~fitkit.checks.FitkitWarning` naming the option and the fix. A ``patience`` longer than
the fit is not warned: a large patience is how people keep the best value without stopping.
All are decided from the plan (counts, no data), once per fit: nothing runs per step.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Callable

from fitkit.checks import FitkitWarning

if TYPE_CHECKING:
    from fitkit.model import Model
    from fitkit.training.step_validation import ValidationInterval

__all__ = ["fit_steps", "warn_unreachable"]


def fit_steps(
    global_step: int,
    batches: int | None,
    accumulation: Callable[[int], int],
    initial_epoch: int,
    epochs: int | None,
    max_steps: int | None,
) -> int | None:
    """The optimizer steps this fit can take (``None``: unknown before it runs).

    Args:
        global_step: the model's step count before the fit.
        batches: training batches per epoch, ``None`` when unknown.
        accumulation: ``epoch -> gradient_accumulation_steps`` of that epoch.
        initial_epoch, epochs: the epochs ``initial_epoch .. epochs - 1`` (``epochs=None``: unbounded).
        max_steps: the step budget (counts ``global_step``, across fits), or ``None``.

    Example:
        >>> fit_steps(0, 4, lambda e: 1, 0, 2, None), fit_steps(5, 4, lambda e: 1, 0, 2, 7), fit_steps(9, 4, lambda e: 1, 0, 2, 7)
        (8, 2, 0)
        >>> fit_steps(0, None, lambda e: 1, 0, 2, None) is None
        True
    """  # noqa: E501
    by_epochs = None
    if batches is not None and epochs is not None:
        by_epochs = sum(math.ceil(batches / accumulation(e)) for e in range(initial_epoch, epochs))
    if max_steps is None:
        return by_epochs
    left = max(0, max_steps - global_step)
    return left if by_epochs is None else min(left, by_epochs)


def warn_unreachable(
    model: Model,
    *,
    max_steps: int | None,
    interval: ValidationInterval | None,
    validation_interval: object,
    steps: int | None,
    initial_epoch: int,
    epochs: int | None,
    callbacks: list[Any],
) -> None:
    """A ``FitkitWarning`` for each budget already spent and each interval longer than the fit."""
    step = model.global_step
    if max_steps is not None and step >= max_steps:
        _warn(
            f"fit(max_steps={max_steps}) is already spent: the model has taken {step} optimizer steps "
            "(`max_steps` counts `model.global_step`, across fits), so this fit trains nothing. Fix: pass "
            f"max_steps > {step}, e.g. max_steps=model.global_step + 100, or drop it and pass `epochs=`."
        )
        return
    if interval is not None and interval.steps_between and not interval.fraction and steps is not None:
        k = interval.steps_between
        if (step + steps) // k == step // k:  # no step of this fit lands on a multiple of k
            _warn(
                f"fit(validation_interval={validation_interval!r}) is longer than this fit: it validates at every "
                f"{k}th optimizer step, but the fit goes from step {step} to {step + steps}, so it never "
                "validates (and callbacks that monitor `val_` keys never act). Fix: pass validation_interval <= "
                f"{max(1, steps)}, a fraction of the epoch such as 0.5, or drop it to validate at each epoch end."
            )
    _warn_early_stopping(callbacks, initial_epoch, epochs, interval is not None)
    _warn_checkpoint_epochs(callbacks, initial_epoch, epochs)


def _warn_checkpoint_epochs(callbacks: list[Any], initial_epoch: int, epochs: int | None) -> None:
    from fitkit.callbacks.checkpointing import ModelCheckpoint

    if epochs is None or epochs <= initial_epoch:
        return
    for cb in callbacks:
        n = cb.every_n_epochs if isinstance(cb, ModelCheckpoint) else 0
        if (
            n
            and cb.save_freq == "epoch"
            and cb.last_path is None
            and not any((e + 1) % n == 0 for e in range(initial_epoch, epochs))
        ):
            _warn(
                f"ModelCheckpoint(every_n_epochs={n}) writes nothing in this fit: it saves at epochs {n}, "
                f"{2 * n}, ... (1-based), and the fit runs epochs {initial_epoch + 1} to {epochs}. Fix: pass "
                f"every_n_epochs <= {epochs}, more epochs, or save_last=True for a file at every epoch end."
            )


def _warn_early_stopping(callbacks: list[Any], initial_epoch: int, epochs: int | None, by_interval: bool) -> None:
    from fitkit.callbacks.monitor import EarlyStopping

    if epochs is None:
        return
    for cb in callbacks:
        if not isinstance(cb, EarlyStopping) or (by_interval and cb.monitor.startswith("val_")):
            continue
        if epochs <= max(initial_epoch, cb.start_from_epoch):  # no epoch end it decides at
            _warn(
                f"EarlyStopping(start_from_epoch={cb.start_from_epoch}) never acts: this fit ends after epoch "
                f"index {epochs - 1} (epochs={epochs}), before the first epoch it watches. Fix: pass "
                f"start_from_epoch < {epochs}, or more epochs."
            )


def _warn(message: str) -> None:
    warnings.warn(message, category=FitkitWarning, stacklevel=5)
