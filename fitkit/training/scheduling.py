"""The LR scheduler of a compiled model and when it steps: :class:`SchedulerDriver`.

One driver per compiled model, held by its :class:`~fitkit.training.stepper.Stepper`. It holds
the scheduler (torch's, timm's, or a :class:`~fitkit.training.budget.PlannedScheduler` that the
first ``fit`` builds with its planned step count) and steps it:

- after each counted optimizer step (:meth:`SchedulerDriver.step`): a torch scheduler with
  ``scheduler_interval="step"`` gets ``step()``, a timm scheduler ``step_update(num_updates)``;
- at each epoch end (:meth:`SchedulerDriver.step_epoch`): a torch scheduler with
  ``scheduler_interval="epoch"`` gets ``step()``, a timm scheduler ``step(epoch + 1, metric)``;
- a plateau scheduler (torch's ``ReduceLROnPlateau``, or timm's ``PlateauLRScheduler``, which
  wraps one) gets its metric in one place only, :meth:`SchedulerDriver.step_plateau`: at epoch
  ends, and after each validation inside an epoch (``validation_interval``, torch's only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau

from fitkit.training.budget import PlannedScheduler

__all__ = ["SchedulerDriver", "is_timm_scheduler", "plateau_of"]


def is_timm_scheduler(scheduler: object) -> bool:
    """Whether ``scheduler`` follows timm's protocol (``step(epoch, metric)``, ``step_update``).

    A class is not a scheduler but a factory (``scheduler=CosineLRScheduler`` would be called on
    the optimizer), though its functions answer to the same names.

    Example:
        >>> class Cosine:
        ...     def step(self, epoch, metric=None): ...
        ...     def step_update(self, num_updates, metric=None): ...
        >>> is_timm_scheduler(Cosine()), is_timm_scheduler(Cosine), is_timm_scheduler(object())
        (True, False, False)
    """
    return (
        not isinstance(scheduler, type)
        and callable(getattr(scheduler, "step_update", None))
        and callable(getattr(scheduler, "step", None))
    )


def plateau_of(scheduler: object) -> ReduceLROnPlateau | None:
    """torch's ``ReduceLROnPlateau`` that decides ``scheduler``'s LR from a metric: the scheduler
    itself, or the one a timm scheduler wraps (timm's ``PlateauLRScheduler.lr_scheduler``).

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> plateau = ReduceLROnPlateau(opt)
        >>> class TimmPlateau:
        ...     lr_scheduler = plateau
        ...     def step(self, epoch, metric=None): ...
        ...     def step_update(self, num_updates, metric=None): ...
        >>> plateau_of(plateau) is plateau_of(TimmPlateau()) is plateau, plateau_of(None)
        (True, None)
    """
    if isinstance(scheduler, ReduceLROnPlateau):
        return scheduler
    inner = getattr(scheduler, "lr_scheduler", None) if is_timm_scheduler(scheduler) else None
    return inner if isinstance(inner, ReduceLROnPlateau) else None


class SchedulerDriver:
    """The compiled model's LR scheduler, stepped per optimizer step, per epoch or on a metric.

    Args:
        optimizer: the compiled optimizer (the scheduler's; its LRs are read after each step).
        scheduler: a torch LR scheduler, a timm scheduler (anything with timm's
            ``step(epoch, metric)`` and ``step_update(num_updates)``), a
            :class:`~fitkit.training.budget.PlannedScheduler` (built by :meth:`build_planned`), or
            ``None``.
        interval: ``"epoch"`` or ``"step"``: when a torch scheduler steps (timm ones get both).

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> driver = SchedulerDriver(opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), "step")
        >>> for _ in range(2):  # two optimizer steps, each followed by the scheduler's
        ...     opt.step(); driver.step(None)
        >>> driver.lrs_used, opt.param_groups[0]["lr"]  # the last step's LR, the next one's
        ([0.5], 0.25)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: object, interval: str):
        self.optimizer, self.interval = optimizer, interval
        # a factory built at the first fit with the planned step count (see build_planned)
        self.planned = scheduler if isinstance(scheduler, PlannedScheduler) else None
        self.factory = self.planned  # kept once built: fit(reset_time=True) builds it again
        self.scheduler: Any = None
        self.timm = False  # whether the scheduler follows timm's protocol
        self.per_step = False  # whether it steps after each optimizer step (read by the stepper)
        self.lrs_used: list[Any] | None = None  # the LRs of the last step, before a scheduler moved them
        self.set_scheduler(None if self.planned is not None else scheduler)

    def set_scheduler(self, scheduler: object) -> None:
        """Replace the scheduler (``None``: the LR moves only by callbacks)."""
        self.scheduler, self.timm = scheduler, is_timm_scheduler(scheduler)
        self.per_step = scheduler is not None and (self.timm or self.interval == "step")

    def build_planned(self, total: int | None, resolve: Callable[[Any, torch.optim.Optimizer, str], Any]) -> None:
        """Build the :class:`~fitkit.training.budget.PlannedScheduler` with ``total`` optimizer steps
        (the start of the first fit; ``resolve(scheduler, optimizer, interval)`` checks it),
        with the state a checkpoint left for it, if any."""
        planned = self.planned
        if planned is None or total is None:
            return
        # A restored run: the factory's first step (a warmup's lr 0, OneCycle's momentum) must not
        # overwrite the hyper-parameters the optimizer was restored with; the scheduler gets its
        # state at birth and the groups are put back as they were loaded.
        loaded = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        sched = resolve(planned.build(self.optimizer, total), self.optimizer, self.interval)
        if planned.state is not None and sched is not None:
            sched.load_state_dict(planned.state)
            for group, hyper in zip(self.optimizer.param_groups, loaded, strict=True):
                group.update(hyper)
        self.set_scheduler(sched)
        self.planned = None

    def rearm(self) -> Any:
        """``fit(reset_time=True)``: the factory is built again with the new fit's planned steps,
        without a checkpoint's state. Returns what :meth:`disarm` puts back."""
        before = self.planned
        if self.factory is not None:
            self.planned = PlannedScheduler(self.factory.factory, self.factory.keyword)
        return before

    def disarm(self, before: PlannedScheduler | None) -> None:
        """Undo :meth:`rearm` (a fit that failed before step 1)."""
        self.planned = before

    def keep_scheduler_state(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's scheduler state, loaded before the planned scheduler is built."""
        if self.planned is not None:
            self.planned.keep(state)

    def keep_lrs_used(self, lrs: list[Any] | None) -> None:
        """Set the record of the last step's LRs (``None``: a fit epoch starts afresh)."""
        self.lrs_used = lrs

    # -- stepping ----------------------------------------------------------------------------------
    def step(self, num_updates: int | None) -> None:
        """After a counted optimizer step, with :attr:`per_step` set: record the LRs the step used,
        then step the scheduler (timm's ``step_update`` gets ``num_updates``, ``global_step``)."""
        self.lrs_used = [g["lr"] for g in self.optimizer.param_groups]
        if self.timm:
            self.scheduler.step_update(num_updates=num_updates)
        else:
            self.scheduler.step()

    def step_epoch(self, epoch: int, logs: dict[str, float], validated: bool, validates: bool) -> None:
        """The per-epoch scheduler step, after validation.

        ``ReduceLROnPlateau`` steps on ``val_loss`` on epochs that ``validated``, on ``loss``
        when the fit ``validates`` not at all, and not at all on epochs whose validation was not
        scheduled. timm schedulers get ``step(epoch + 1, metric)``, as timm's training script,
        with the same metric (``None`` on epochs without validation, and a timm plateau
        scheduler is then not stepped).
        """
        sched = self.scheduler
        if sched is None or (not self.timm and self.interval != "epoch"):
            return
        metric = logs.get("val_loss") if validated else None if validates else logs.get("loss")
        if plateau_of(sched) is not None:
            self.step_plateau(metric, epoch)
        elif self.timm:
            sched.step(epoch + 1, metric)
        else:
            sched.step()

    def step_on_validation(self, epoch: int, val_logs: dict[str, float]) -> None:
        """A validation inside ``epoch``: a torch ``ReduceLROnPlateau`` (epoch interval) steps on
        its loss; timm's plateau waits for the epoch end (see :mod:`fitkit.training.step_validation`)."""
        if not self.timm and self.interval == "epoch" and plateau_of(self.scheduler) is not None:
            self.step_plateau(val_logs.get("loss"), epoch)

    def step_plateau(self, metric: float | None, epoch: int) -> None:
        """Step the plateau scheduler on ``metric`` (a loss; ``None``: no step): torch's
        ``step(metric)``, timm's ``step(epoch + 1, metric)``. The one place that does.

        Example:
            >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
            >>> driver = SchedulerDriver(opt, ReduceLROnPlateau(opt, factor=0.5, patience=0), "epoch")
            >>> for epoch, loss in enumerate([1.0, 1.0, None, 2.0]):  # None: no step, no bad epoch
            ...     driver.step_plateau(loss, epoch)
            >>> opt.param_groups[0]["lr"]
            0.25
        """
        if metric is None:
            return
        if self.timm:
            self.scheduler.step(epoch + 1, metric)
        else:
            self.scheduler.step(metric)
