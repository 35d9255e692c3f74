"""Whether a fit stops here: ``model.stop_training``, the step budget, and a signal, agreed over
the ranks under torchrun (:class:`~fitkit.training.signals.RankAgreement`). One per ``fit`` call.
"""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING, Any

from fitkit.distributed.group import is_rank_zero
from fitkit.training.signals import RankAgreement

if TYPE_CHECKING:
    from fitkit.callbacks.base import CallbackList
    from fitkit.model import Model
    from fitkit.training.signals import Interrupt

__all__ = ["StopDecision"]


class StopDecision:
    """The stop decision of one fit.

    Args:
        model: the :class:`~fitkit.Model` (its public ``stop_training`` flag and ``global_step``).
        callbacks: the fit's callbacks (a signal's backup is written by them).
        max_steps: the step budget, or ``None``.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu"); model.compile(loss="mse")
        >>> stop = StopDecision(model, None, max_steps=0)
        >>> stop.budget_spent(), stop.now()
        (True, False)
    """

    def __init__(
        self,
        model: Model,
        callbacks: CallbackList | None,
        max_steps: int | None,
        min_epochs: int | None = None,
        min_steps: int | None = None,
    ):
        self.model, self.callbacks, self.max_steps = model, callbacks, max_steps
        self.min_epochs, self.min_steps = min_epochs, min_steps  # no stop request is heard before both
        self.agreement: RankAgreement | Any = None  # the fit's RankAgreement while it runs
        self.interrupted = False  # a signal stopped training at a step boundary; the backup is written
        self.interrupt: Interrupt | Any = None

    def begin(self, interrupt: Interrupt, triggers: list[Any] | None = None, where: Any = None) -> None:
        """The fit's signal catcher (:func:`~fitkit.training.signals.deferred`): where the ranks
        agree, on signals, stops and the fit's time ``triggers``; ``where()``: this rank's
        ``(epoch, batches done in it)``, checked at each agreement."""
        self.interrupt = interrupt
        self.agreement = RankAgreement(interrupt, self.model._core.parallel is not None, triggers, where)

    def save_on_signal(self) -> None:
        """At the end of training: a signal not yet acted on writes its backup now."""
        if self.interrupt is not None and self.interrupt.signum is not None and not self.interrupted:
            self.interrupted = True
            self._announce()
            if self.callbacks is not None:
                self.callbacks.save_on_interrupt()

    def _announce(self) -> None:
        """One line on rank 0's standard error: the signal, the step it stops after, what it does."""
        if not is_rank_zero():
            return
        signum = int(self.interrupt.signum or signal.SIGTERM)
        name = signal.Signals(signum).name
        backup = "writing a backup, " if self.callbacks is not None and self.callbacks.backs_up else ""
        end = "raising KeyboardInterrupt" if signum == signal.SIGINT else f"exiting with status {128 + signum}"
        print(
            f"fitkit: {name} received: stopping after optimizer step {self.model.global_step}, {backup}"
            f"running on_train_end, then {end}.",
            file=sys.stderr,
            flush=True,
        )

    def budget_spent(self) -> bool:
        """``max_steps`` optimizer steps are done (a resumed fit counts the checkpoint's)."""
        return self.max_steps is not None and self.model.global_step >= self.max_steps

    def at_boundary(self) -> bool:
        """After an optimizer step, where the ranks agree: a signal (save, then stop) or a stop."""
        model = self.model
        if self.agreement.at_step_boundary(model.stop_training):
            self.interrupted = True
            self._announce()
            if self.callbacks is not None:
                self.callbacks.save_on_interrupt()  # at this step boundary, inside the epoch
            return True
        if self.agreement.stop_agreed:  # a stop on some rank, agreed at this point
            model.stop_training = True
            return not self.held()
        return False

    def held(self, epoch_end: bool = False) -> bool:
        """A stop request comes before ``min_epochs`` / ``min_steps`` (Lightning's): it is dropped
        (``stop_training`` back to False) and training goes on. The same on every rank: it
        depends on the epoch and ``global_step`` alone."""
        model = self.model
        if not model.stop_training or (self.min_epochs is None and self.min_steps is None):
            return False
        done = model.epoch + (1 if epoch_end else 0)  # epochs completed at this point
        if (self.min_epochs is not None and done < self.min_epochs) or (
            self.min_steps is not None and model.global_step < self.min_steps
        ):
            model.stop_training = False
            return True
        return False

    def now(self, epoch_end: bool = False) -> bool:
        """Whether training stops here (``model.stop_training``; agreed over ranks under torchrun)."""
        model = self.model
        if model._core.parallel is None:
            return model.stop_training and not self.held(epoch_end)
        if epoch_end:  # one all-reduce: a stop, or a signal, on any rank holds for all
            model.stop_training = self.agreement.at_epoch_end(model.stop_training)
            return model.stop_training and not self.held(epoch_end)
        stepper = model._core.stepper
        if stepper is None or not stepper.fit.stop_agreed:
            return False
        model.stop_training = True
        return not self.held()
