"""Gradient accumulation that changes by epoch (Lightning's ``GradientAccumulationScheduler``).

``compile(gradient_accumulation_steps={0: 8, 4: 4, 8: 1})`` or the callback
:class:`~fitkit.callbacks.GradientAccumulationScheduler` with the same dict: from epoch ``e``
(0-based) on, each optimizer step accumulates ``scheduling[e]`` micro-batches, until the next
key. The value is applied when the epoch begins (after ``on_epoch_begin``), so every window of
an epoch has the same size but its last, and accumulation stays sample-exact as with an int
(each micro-batch's loss weighted by its share of its window's samples). A resumed fit applies
the schedule of the epoch it resumes in, so it continues exactly.

Epochs before the first key use the compiled int (the callback), or 1 (a dict in ``compile``,
Lightning's rule).
"""

from __future__ import annotations

from typing import Any

from fitkit.callbacks.base import Callback
from fitkit.checks import check_int
from fitkit.checks.declared import Option, declare, declared

__all__ = ["AccumulationSchedule", "GradientAccumulationScheduler"]


class AccumulationSchedule:
    """``{first_epoch: micro-batches per step}``, checked; called with an epoch it gives its value.

    Args:
        scheduling: a non-empty dict of int epochs >= 0 to ints >= 1.
        default: the value of the epochs before the first key.
        name: how errors name the argument.

    Raises:
        TypeError: not a dict, or a key or value that is not an int.
        ValueError: an empty dict, a key < 0 or a value < 1.

    Example:
        >>> schedule = AccumulationSchedule({0: 8, 4: 4, 8: 1})
        >>> [schedule(e) for e in (0, 3, 4, 7, 8, 20)]
        [8, 8, 4, 4, 1, 1]
        >>> AccumulationSchedule({2: 4}, default=2)(1)
        2
    """

    def __init__(self, scheduling: Any, default: int = 1, name: str = "scheduling"):
        example = "e.g. {0: 8, 4: 4, 8: 1} (from epoch 0: 8 micro-batches per step, from epoch 4: 4, ...)"
        if not isinstance(scheduling, dict):
            raise TypeError(
                f"Expected `{name}` to be a dict {{epoch: micro-batches per step}}. Received: {scheduling!r} "
                f"of type {type(scheduling).__name__}. Fix: pass a dict, {example}."
            )
        if not scheduling:
            raise ValueError(f"Expected `{name}` to hold at least one epoch. Received: {{}}. Fix: pass {example}.")
        for epoch, k in scheduling.items():
            check_int(f"{name}'s epoch key", epoch, 0, fix=f"use 0-based epoch numbers as keys, {example}.")
            check_int(f"{name}[{epoch}]", k, 1, fix=f"use ints >= 1 (micro-batches per optimizer step), {example}.")
        self.scheduling = {int(e): int(k) for e, k in sorted(scheduling.items())}
        self.default = int(default)

    def __call__(self, epoch: int) -> int:
        value = self.default
        for first, k in self.scheduling.items():
            if first > epoch:
                break
            value = k
        return value

    def __repr__(self) -> str:
        return f"AccumulationSchedule({self.scheduling!r}, default={self.default})"


_GRADIENT_ACCUMULATION_SCHEDULER_OPTIONS = declare(
    "GradientAccumulationScheduler",
    Option(
        "scheduling",
        "custom",
        checked_in="fitkit.callbacks.accumulation.AccumulationSchedule",
        bad=({}, {0: 0}, {-1: 2}, "4", 4, None),
    ),
)


class GradientAccumulationScheduler(Callback):
    """Change ``gradient_accumulation_steps`` at epoch starts: ``{first_epoch: micro-batches}``.

    Lightning's callback of the same name: ``GradientAccumulationScheduler({0: 8, 4: 4, 8: 1})``
    accumulates 8 micro-batches per optimizer step in epochs 0-3, 4 in epochs 4-7 and 1 from
    epoch 8 on. Epochs before the first key keep the compiled ``gradient_accumulation_steps``.
    The value is applied when each epoch begins; accumulation stays sample-exact, the planned
    step count (``params["total_steps"]``, a ``total_steps`` scheduler factory) follows the
    schedule, and a resumed fit continues exactly (see :class:`AccumulationSchedule`). The
    compiled value is back in place when ``fit`` ends. The fit loop reads the schedule when
    ``fit`` starts (the callback has no hook of its own).

    Args:
        scheduling: a dict of 0-based epochs (ints >= 0) to micro-batches per step (ints >= 1).

    Raises:
        TypeError: not a dict, or a key or value that is not an int.
        ValueError: an empty dict, a key < 0, a value < 1; at ``fit``, together with a dict
            ``compile(gradient_accumulation_steps=...)``.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> _ = model.fit(torch.zeros(8, 1), torch.zeros(8, 1), batch_size=1, epochs=3, verbose=0,
        ...               callbacks=[GradientAccumulationScheduler({0: 4, 1: 2, 2: 1})])
        >>> model.global_step  # 2 + 4 + 8 optimizer steps
        14
    """

    @declared(_GRADIENT_ACCUMULATION_SCHEDULER_OPTIONS)
    def __init__(self, scheduling: dict[int, int]):
        super().__init__()
        self.scheduling = AccumulationSchedule(scheduling, name="scheduling").scheduling

    def accumulation_for(self, compiled: int) -> AccumulationSchedule:
        """The schedule, with ``compiled`` for the epochs before its first key."""
        return AccumulationSchedule(self.scheduling, default=compiled)
