"""Small stock callbacks: ``TerminateOnNaN``, ``LambdaCallback``, ``LearningRateScheduler``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from fitkit.callbacks.base import HOOKS, Callback
from fitkit.callbacks.monitor import StatefulCallback, _say

__all__ = ["TerminateOnNaN", "LambdaCallback", "LearningRateScheduler"]


class TerminateOnNaN(Callback):
    """Stop training at the first batch whose loss is NaN or infinite; that step never happens.

    The check runs after the backward pass and before the optimizer step
    (``on_backward_end``): a non-finite loss vetoes the step (``model._skip_step``), so the
    bad gradients never reach the weights or the optimizer state, and training stops after
    that batch. With gradient accumulation the check covers every micro-batch of the group.

    Reading the loss on the host **syncs with the device once per optimizer step**; fitkit
    avoids such syncs elsewhere, so this callback is opt-in.

    Args:
        raise_error: raise ``RuntimeError`` instead of stopping quietly.

    Raises:
        RuntimeError: with ``raise_error=True``, at the first non-finite loss.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> before = model.module.weight.detach().clone()
        >>> x = torch.tensor([[1.0], [float("nan")]])
        >>> history = model.fit(x, x, batch_size=1, shuffle=False, epochs=3, callbacks=[TerminateOnNaN()], verbose=0)
        >>> history.epoch, model.module.weight.isfinite().all().item()
        ([0], True)
    """

    def __init__(self, raise_error: bool = False):
        super().__init__()
        self.raise_error = bool(raise_error)

    def on_backward_end(self, batch):
        model = self.model
        loss = model._step_loss.detach()
        # The epoch's running total holds the earlier micro-batches of this accumulation group.
        finite = bool(torch.isfinite(loss).all() & torch.isfinite(model._loss_total))  # one sync
        if finite:
            return
        model._skip_step = True
        model.stop_training = True
        if self.raise_error:
            model.optimizer.zero_grad(set_to_none=True)
            raise RuntimeError(
                f"The loss is {loss.item()} at batch {batch} of epoch {model._epoch}; training "
                "stopped before that step, so the weights are those of the previous step."
            )
        _say(self.params.get("verbose", 0), f"Batch {batch}: invalid loss {loss.item()}, terminating training.")


class LambdaCallback(Callback):
    """A callback made of functions: ``LambdaCallback(on_epoch_end=lambda epoch, logs: ...)``.

    Each keyword is a hook name of :class:`fitkit.callbacks.Callback` and its function takes
    that hook's arguments (``on_train_begin(logs)``, ``on_epoch_end(epoch, logs)``,
    ``on_backward_end(batch)``, ...). ``on_batch_begin`` / ``on_batch_end`` are Keras' names
    for the train batch hooks. Only the hooks given are called.

    Args:
        **hooks: ``hook_name=function`` pairs.

    Raises:
        TypeError: an unknown hook name, or a value that is not callable.

    Example:
        >>> seen = []
        >>> cb = LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append((epoch, logs["loss"])))
        >>> cb.on_epoch_end(0, {"loss": 0.5}); seen
        [(0, 0.5)]
    """

    _ALIASES = {"on_batch_begin": "on_train_batch_begin", "on_batch_end": "on_train_batch_end"}

    def __init__(self, **hooks: Callable[..., Any]):
        super().__init__()
        for name, fn in hooks.items():
            hook = self._ALIASES.get(name, name)
            if hook not in HOOKS:
                raise TypeError(f"Unknown hook {name!r}. Valid names: {', '.join(HOOKS)}.")
            if not callable(fn):
                raise TypeError(f"Expected `{name}` to be callable. Received: {fn!r}.")
            setattr(self, hook, fn)  # an instance attribute: CallbackList calls only these


class LearningRateScheduler(StatefulCallback):
    """Set the learning rate at the start of each epoch: ``lr = schedule(epoch, lr)`` (Keras).

    ``epoch`` is 0-based and ``lr`` the current learning rate; with several parameter groups
    the schedule is applied to each group's own rate. The new rate is the one
    ``history["learning_rate"]`` records for that epoch. The rates live in the optimizer,
    so a checkpoint carries them; a resume inside an epoch applies the schedule to the rates
    that epoch started from (kept in ``state_dict``), never twice.

    Args:
        schedule: ``(epoch: int, lr: float) -> float`` (a one-argument ``schedule(epoch)``
            works too).
        verbose: 1 prints the rate set at each epoch.

    Raises:
        TypeError: ``schedule`` is not callable, or returns something that is not a number.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss="mse")
        >>> halve = LearningRateScheduler(lambda epoch, lr: lr if epoch == 0 else lr / 2)
        >>> x = torch.zeros(4, 1)
        >>> model.fit(x, x, epochs=3, callbacks=[halve], verbose=0).history["learning_rate"]
        [1.0, 0.5, 0.25]
    """

    def __init__(self, schedule: Callable[..., float], verbose: int = 0):
        super().__init__()
        self._reset()
        if not callable(schedule):
            raise TypeError(f"Expected `schedule` to be a function (epoch, lr) -> lr. Received: {schedule!r}.")
        self.schedule, self.verbose = schedule, verbose
        try:
            params = inspect.signature(schedule).parameters.values()
            positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            self._two_args = len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)
        except (TypeError, ValueError):  # builtins without a signature
            self._two_args = True

    def _reset(self) -> None:
        self._epoch, self._before = -1, []  # the epoch begun last and the rates it started from

    def _get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "lrs_before": list(self._before)}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._epoch, self._before = state["epoch"], list(state["lrs_before"])

    def on_epoch_begin(self, epoch, logs=None):
        groups = self.model.optimizer.param_groups
        if epoch != self._epoch or len(self._before) != len(groups):
            self._before = [float(g["lr"]) for g in groups]
        self._epoch = epoch  # a resume inside this epoch starts again from self._before
        for group, old in zip(groups, self._before):
            lr = self.schedule(epoch, old) if self._two_args else self.schedule(epoch)
            if isinstance(lr, torch.Tensor) and lr.numel() == 1:
                lr = lr.item()
            if isinstance(lr, bool) or not isinstance(lr, (int, float)):
                raise TypeError(f"`schedule` must return a number. Received: {lr!r} at epoch {epoch}.")
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(float(lr))
            else:
                group["lr"] = float(lr)
        lr = float(groups[0]["lr"])
        _say(self.verbose, f"Epoch {epoch + 1}: LearningRateScheduler set the learning rate to {lr:.4g}.")
