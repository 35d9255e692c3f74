"""What a :class:`~fitkit.Model` holds for fitkit's own packages: one internal object, ``model._core``.

The user's ``Model`` carries the public vocabulary (``module``, ``loss``, ``history``,
``global_step``, ``stop_training``, ...); everything the training core shares between its
parts lives here, under one clearly internal name: the compiled
:class:`~fitkit.training.stepper.Stepper`, DDP / FSDP (:class:`fitkit.distributed.Parallel`),
the phase stack and metric template (:class:`~fitkit.training.tracking.Phases`), the training
forward, the running fit, a loaded resume point waiting for the next fit, and the plain values
the model keeps of the last fit. Callbacks never read it (they use the public vocabulary).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fitkit import distributed as _distributed
from fitkit.compile import Forward
from fitkit.training.state import ResumePoint
from fitkit.training.tracking import Phases

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fitkit.metrics import MetricSet
    from fitkit.training.loop import FitLoop
    from fitkit.training.stepper import Stepper

__all__ = ["Core"]


class Core:
    """The training core's shared state of one model (``model._core``; not for users).

    Args:
        module: the wrapped module (on its device, or on the meta device under FSDP).
        parallel: DDP / FSDP under torchrun, else ``None``.
        device: the model's device.

    Example:
        >>> import torch
        >>> core = Core(torch.nn.Linear(1, 1), None, torch.device("cpu"))
        >>> core.stepper is None, core.running_fit() is None, core.fit_position()["epoch"]
        (True, True, 0)
    """

    def __init__(self, module: nn.Module, parallel: _distributed.Parallel | None, device: torch.device):
        self.stepper: Stepper | None = None
        self.parallel: _distributed.Parallel | None = parallel
        self.training_forward = Forward(module)
        self.phases = Phases(device, _distributed.reduce_loss_totals if parallel is not None else None)
        self.fit: FitLoop | None = None  # the running fit only (None once it returned or raised)
        self.resume: ResumePoint | None = None  # loaded, waiting for the next fit
        self.example_x: Any = None  # the last first batch checked (summary's output shapes)
        # What the model keeps of the last fit: plain values (model.epoch, model.validated, and
        # where a checkpoint taken now continues).
        self.fit_ended: dict[str, Any] | None = None
        self.last_epoch, self.last_validated = 0, False

    def require_compiled(self, verb: str) -> Stepper:
        """The stepper; ``RuntimeError`` naming ``verb`` and the fix before ``compile``."""
        if self.stepper is None:
            raise RuntimeError(
                f"`{verb}` needs a compiled model. Call `model.compile(optimizer=..., loss=...)` "
                f"before `model.{verb}(...)`."
            )
        return self.stepper

    # -- the training forward ------------------------------------------------------------------
    def wrap_for_training(self) -> Any:
        """Under torchrun the training forward is DDP's (built once the optimizer exists)."""
        if self.parallel is None or self.stepper is None:
            return None
        return self.parallel.wrap

    def new_forward(self, module: nn.Module, jit: dict[str, Any] | bool) -> None:
        """A new training forward for ``module`` (after ``compile`` or ``to``)."""
        self.training_forward = Forward(module, self.wrap_for_training(), jit)

    def install(self, module: nn.Module, stepper: Stepper, metrics: MetricSet, jit: dict[str, Any] | bool) -> None:
        """Take what ``compile`` built: the stepper (closing the one before), the metric template
        and a new training forward."""
        self.phases.configure(metrics)
        if self.stepper is not None:
            self.stepper.close()
        self.stepper = stepper
        self.new_forward(module, jit)

    def refresh_parallel(self) -> None:
        """Under DDP: a new training wrapper when the trainable parameters changed since the
        last was built (:mod:`fitkit.distributed.ddp`); the fit loop calls it before each
        optimizer step's first micro-batch. Nothing on one process or under FSDP."""
        if self.parallel is not None and not self.parallel.fsdp and self.stepper is not None:
            self.training_forward.refresh()

    # -- the running fit and what outlives it ------------------------------------------------------
    def running_fit(self) -> FitLoop | None:
        """The running fit loop (a checkpoint taken now holds its position), else ``None``."""
        loop = self.fit
        return loop if loop is not None and loop.running else None

    def fit_position(self) -> dict[str, Any]:
        """Where a checkpoint taken now continues: the running fit's position (inside an epoch,
        its RNG state and totals too), else where the last fit ended, else the start."""
        loop = self.running_fit()
        if loop is not None:
            return loop.state_dict()
        start = {"epoch": 0, "step_in_epoch": 0, "samples_in_epoch": 0, "pass_offset": 0, "batch_size": None}
        return dict(self.fit_ended or start)

    @contextlib.contextmanager
    def running(self, loop: FitLoop) -> Iterator[None]:
        """The model points at ``loop`` while it runs (``model.epoch``, ``model.callbacks`` read
        it); afterwards only plain values of it stay (:meth:`let_go`)."""
        outer, self.fit = self.fit, loop
        try:
            yield
        finally:
            self.fit = outer
            self.let_go(loop)

    def let_go(self, loop: FitLoop) -> None:
        """Keep plain values of a finished (or failed) fit; the loop and its data go."""
        self.last_epoch, self.last_validated = loop.epoch, bool(loop.validated)
        self.fit_ended = loop.state_dict(boundary=True)
        self.keep_example(loop.example)

    def keep_example(self, x: object) -> None:
        """Keep the last first batch checked: ``summary``'s input."""
        if x is not None:
            self.example_x = x

    def await_resume(self, point: ResumePoint) -> None:
        """Keep a loaded checkpoint's :class:`~fitkit.training.state.ResumePoint` for the next fit."""
        self.resume = point

    def pop_resume(self) -> ResumePoint | None:
        """Take the waiting resume point (a loaded resume point serves one fit only)."""
        point, self.resume = self.resume, None
        return point
