"""The loop's invariant 2 before step 1: a phase whose source fitkit can tell never ends is refused.

What fitkit can tell of a source without ``len()``:

- **endless**: ``itertools.cycle``, ``itertools.count`` and ``itertools.repeat`` without ``times``
  never run out. A phase over one needs its steps (``steps_per_epoch`` for training, or a budget
  that ends the run: ``max_steps``, ``max_samples``, ``max_time`` / a ``Timer``;
  ``validation_steps`` for validation; ``steps`` for ``evaluate`` / ``predict``) or a quick-run
  cap (``limit_*_batches``, ``fast_dev_run``, ``overfit_batches``), else it is refused here.
- **one-shot**: an iterator (``iter(s) is s``), a generator say, is used up after one pass.
  Validation over one without ``validation_steps``, in a fit whose epochs validate more than once,
  is refused (the second validation would get no batch). Training over one runs its pass: with
  ``epochs`` > 1 and no ``steps_per_epoch`` the fit stops after it with a warning (Keras' rule);
  ``evaluate`` and ``predict`` run it until it runs out (Keras' rule).

Any other source without ``len()`` (a generator with a ``while True`` loop) cannot be told from a
long one: it runs until it runs out, or until a stop (a signal ends every phase within one batch).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from fitkit.callbacks.timer import Timer

if TYPE_CHECKING:
    from fitkit.training.quick import QuickRun
    from fitkit.training.step_validation import ValidationInterval, ValidationSchedule

__all__ = ["is_endless", "is_one_shot", "check_fit_bounds", "check_call_bound"]


def is_endless(source: object) -> bool:
    """Whether ``source`` never runs out, as fitkit can tell: ``itertools.cycle``, ``itertools.count``,
    ``itertools.repeat`` without ``times``.

    Example:
        >>> import itertools
        >>> is_endless(itertools.cycle([1])), is_endless(itertools.repeat(1)), is_endless(itertools.repeat(1, 3))
        (True, True, False)
        >>> is_endless([1, 2]), is_endless(x for x in [1])
        (False, False)
    """
    if isinstance(source, (itertools.cycle, itertools.count)):
        return True
    return isinstance(source, itertools.repeat) and operator.length_hint(source, -1) < 0


def is_one_shot(source: object) -> bool:
    """Whether ``source`` is used up after one pass: an iterator (``iter(s) is s``) without ``len()``
    (an iterator with ``__len__`` that cycles, Keras' ``Sequence`` style, gives a pass per ``len()``).

    Example:
        >>> is_one_shot(x for x in [1]), is_one_shot(iter([1, 2])), is_one_shot([1, 2])
        (True, True, False)
    """
    if not isinstance(source, Iterator) or hasattr(type(source), "__len__"):
        return False
    return iter(source) is source


def _kind(source: object) -> str:
    return f"itertools.{type(source).__name__}" if type(source).__module__ == "itertools" else type(source).__name__


def _refuse_endless(name: str, source: object, steps_name: str, phase: str, per: str, extra_fix: str = "") -> None:
    raise ValueError(
        f"Expected `{name}` to end, or `{steps_name}=` to bound {phase}. Received: {name}={_kind(source)} "
        f"(endless: it never runs out and has no len()) with {steps_name}=None, so {phase} would never end. "
        f"Fix: pass {steps_name}=N (batches per {per}){extra_fix}, or a source with __len__ (a list, a DataLoader)."
    )


def check_fit_bounds(
    x: object,
    o: Mapping[str, Any],
    quick: QuickRun,
    schedule: ValidationSchedule,
    interval: ValidationInterval | None,
) -> None:
    """``fit``'s sources against their bounds, before any batch is drawn (``o``: fit's keywords).

    Raises:
        ValueError: an endless training source without ``steps_per_epoch``, a quick-run cap or a
            budget that ends the run; an endless validation source without ``validation_steps``
            (or ``limit_val_batches``); a one-shot validation source without ``validation_steps``
            in a fit whose epochs validate more than once.
    """
    capped = bool(quick.fast_dev_run or quick.overfit_batches)  # a quick run caps every phase
    ends_run = o["max_steps"] is not None or o["max_samples"] is not None or _has_timer(o["callbacks"])
    if is_endless(x) and o["steps_per_epoch"] is None and quick.limit_train is None and not (capped or ends_run):
        extra = " or max_steps= / max_samples= / max_time= to end the run"
        _refuse_endless("x", x, "steps_per_epoch", "an epoch", "epoch", extra)
    if o["validation_steps"] is not None or quick.limit_val is not None or capped:
        return
    epochs = o["epochs"]
    # with validation_interval the count depends on the run: a used-up source fails at its second validation
    validations = len(schedule.epochs(o["initial_epoch"], epochs)) if epochs is not None and not interval else 1
    for name, source in _validation_sources(o["validation_data"]):
        _check_validation_source(name, source, validations)


def _check_validation_source(name: str, source: object, validations: int) -> None:
    """One validation source without ``validation_steps``, in a fit that validates ``validations`` times."""
    if is_endless(source):
        _refuse_endless(name, source, "validation_steps", "each validation", "validation")
    if is_one_shot(source) and validations > 1:
        raise ValueError(
            f"Expected `{name}` to give a pass for each of the {validations} validations this fit schedules. "
            f"Received: {name}={_kind(source)} (one-shot: used up after one pass, no len()) with "
            "validation_steps=None, so the second validation would get no batch. Fix: pass a re-iterable "
            "source (a list, a DataLoader), or validation_steps=N to take N batches per validation from one "
            "long iterator."
        )


def check_call_bound(source: object, steps: int | None, verb: str, argument: str = "x") -> None:
    """``evaluate`` / ``predict``: ``ValueError`` for an endless ``source`` (each named set of a dict)
    without ``steps``, before any batch is drawn.

    Example:
        >>> import itertools
        >>> check_call_bound(itertools.cycle([1]), 3, "evaluate")  # steps bound it
        >>> check_call_bound(itertools.cycle([1]), None, "predict")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Expected `x` to end, or `steps=` to bound predict. Received: x=itertools.cycle ...
    """
    if steps is not None:
        return
    sets = source.items() if isinstance(source, Mapping) else [(None, source)]
    for name, s in sets:
        if is_endless(s):
            _refuse_endless(argument if name is None else f"{argument}[{name!r}]", s, "steps", verb, "call")


def _validation_sources(data: object) -> list[tuple[str, object]]:
    """``(how errors name it, source)`` of each validation set (a dict's named sets, else the one)."""
    if data is None:
        return []
    if isinstance(data, Mapping):
        return [(f"validation_data[{name!r}]", s) for name, s in data.items()]
    return [("validation_data", data)]


def _has_timer(callbacks: Any) -> bool:
    return any(isinstance(cb, Timer) for cb in callbacks or ())
