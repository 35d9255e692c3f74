"""``GradientAccumulationScheduler``: micro-batches per optimizer step by epoch (Lightning's)."""

from __future__ import annotations

from fitkit.callbacks.base import Callback
from fitkit.checks.declared import Option, declare, declared
from fitkit.training.accumulation import AccumulationSchedule

__all__ = ["GradientAccumulationScheduler"]


_GRADIENT_ACCUMULATION_SCHEDULER_OPTIONS = declare(
    "GradientAccumulationScheduler",
    Option("scheduling", "custom", checked_in="fitkit.training.accumulation.AccumulationSchedule",
           bad=({}, {0: 0}, {-1: 2}, "4", 4, None)),
)


class GradientAccumulationScheduler(Callback):
    """Change ``gradient_accumulation_steps`` at epoch starts: ``{first_epoch: micro-batches}``.

    Lightning's callback of the same name: ``GradientAccumulationScheduler({0: 8, 4: 4, 8: 1})``
    accumulates 8 micro-batches per optimizer step in epochs 0-3, 4 in epochs 4-7 and 1 from
    epoch 8 on. Epochs before the first key keep the compiled ``gradient_accumulation_steps``.
    The value is applied when each epoch begins; accumulation stays sample-exact, the planned
    step count (``params["total_steps"]``, a ``total_steps`` scheduler factory) follows the
    schedule, and a resumed fit continues exactly (see :mod:`fitkit.training.accumulation`). The
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
