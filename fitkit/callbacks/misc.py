"""Small stock callbacks: ``TerminateOnNaN``, ``LambdaCallback``, ``LearningRateScheduler``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fitkit.callbacks.base import HOOKS, Callback
from fitkit.callbacks.signatures import check_hook_arity
from fitkit.checks import check_bool, check_int
from fitkit.checks.declared import Option, declare, declared
from fitkit.distributed import say

__all__ = ["TerminateOnNaN", "LambdaCallback"]


_TERMINATE_ON_NAN_OPTIONS = declare(
    "TerminateOnNaN",
    Option("raise_error", "bool"),
    Option("check_every", "int", minimum=1),
)


class TerminateOnNaN(Callback):
    """Stop training once a loss is NaN or infinite; that step, and every later one, never happens.

    The check runs after the backward pass and before the optimizer step (``on_backward_end``)
    and is decided on the device: from the first non-finite loss on, every optimizer step is
    vetoed (``model.skip_optimizer_step(when=...)``), so the bad gradients never reach the
    weights or the optimizer state (Adam's moments and step count included), and the weights
    stay those of the last finite step. With gradient accumulation the check covers every
    micro-batch of the window (``model.step_loss``).

    Reading the verdict on the host is what stops ``fit``; that is done where a read costs
    nothing extra: at the end of each epoch and every ``check_every`` optimizer steps. So
    training stops at most ``check_every`` steps after the bad one (all of them skipped), and
    no step waits for the host. ``check_every=1`` stops right after the bad step, at the cost
    of one host sync per step.

    The veto needs no host read with optimizers whose step takes ``found_inf`` (torch's
    ``fused=True`` Adam, AdamW, SGD, Adagrad; fitkit builds these by name) and under
    ``precision="16-mixed"``; other optimizers, and a per-step scheduler (it must know whether
    to advance), read it once per step. Under torchrun the veto is all-reduced on the device
    (a NaN on one rank skips the step on all), and no step adds a collective or a host read of
    its own (``device_veto_only``): the stop is agreed where the ranks agree anyway, at the
    signal agreement points (:class:`fitkit.training.signals.RankAgreement`) or the epoch end, so every
    rank stops at the same step, all steps from the bad one on skipped.

    Args:
        raise_error: raise ``RuntimeError`` at the stop instead of stopping quietly.
        check_every: optimizer steps between two reads of the verdict (and at each epoch end).

    Raises:
        TypeError: ``raise_error`` is not a bool.
        RuntimeError: with ``raise_error=True``, at the stop.
        ValueError: ``check_every`` < 1.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x = torch.tensor([[1.0], [float("nan")], [2.0]])  # a list of batches: in-memory NaN is refused
        >>> batches = [(x[i:i + 1], x[i:i + 1]) for i in range(3)]
        >>> history = model.fit(batches, epochs=3, callbacks=[TerminateOnNaN()], verbose=0)
        >>> history.epoch, model.global_step, model.module.weight.isfinite().all().item()
        ([0], 1, True)
    """

    device_veto_only = True  # vetoes with skip_optimizer_step(when=...): no per-step agreement

    @declared(_TERMINATE_ON_NAN_OPTIONS)
    def __init__(self, raise_error: bool = False, check_every: int = 100):
        super().__init__()
        check_bool("raise_error", raise_error)
        check_int("check_every", check_every, 1)
        self.raise_error = bool(raise_error)
        self.check_every = int(check_every)
        self._reset_flags()

    def _reset_flags(self) -> None:
        self._bad: torch.Tensor | None = None  # device bool: a non-finite loss was seen (sticky)
        self._first: torch.Tensor | None = None  # device: (index of the first bad check, its loss)
        self._seen = 0  # checks since the flags were last read
        self._where: list[tuple[int, int]] = []  # (epoch, batch) of each check since then
        self._stop: tuple[int, int, float] | None = None  # (epoch, batch, loss) of the first bad step, once read

    def on_train_begin(self, logs=None):
        self._reset_flags()

    def on_backward_end(self, batch):
        model = self.model
        loss = model.step_loss  # the whole accumulation window's loss: a NaN anywhere shows
        if loss is None:
            return
        loss = loss.detach().float().reshape(())
        bad = ~torch.isfinite(loss)
        if self._bad is None or self._first is None:
            self._bad = bad
            self._first = torch.stack([torch.zeros_like(loss), loss])
        else:
            new = bad & ~self._bad  # the first bad loss: keep where and what it was
            self._first = torch.where(new, torch.stack([torch.full_like(loss, self._seen), loss]), self._first)
            self._bad = self._bad | bad
        self._where.append((model.epoch, batch))
        self._seen += 1
        model.skip_optimizer_step(when=self._bad)  # every step from the first bad one on
        if self._seen >= self.check_every:
            self._check()

    def on_train_batch_end(self, batch, logs=None):
        if self._stop is not None:
            self._act(*self._stop)

    def on_epoch_end(self, epoch, logs=None):
        if self._bad is not None and self._seen:
            self._check()
        if self._stop is not None:
            self._act(*self._stop)

    def _check(self) -> None:
        """Read the verdict on the host (the one sync, every ``check_every`` steps / epoch)."""
        if self._bad is None or self._first is None:
            return
        bad, index, loss = torch.cat([self._bad.reshape(1).to(self._first), self._first]).tolist()
        where = self._where[int(index)] if bad else None
        self._seen, self._where = 0, []
        if where is not None and self._stop is None:
            self._stop = (*where, loss)
            self._first = torch.stack([torch.zeros_like(self._first[1]), self._first[1]])

    def _act(self, epoch: int, batch: int, loss: float) -> None:
        model = self.model
        model.stop_training = True
        if self.raise_error:
            self._stop = None
            raise RuntimeError(
                f"The loss is {loss} at batch {batch} of epoch {epoch}; that optimizer step and every "
                "later one were skipped, so the weights are those of the last finite step."
            )
        say(self.params.get("verbose", 0), f"Batch {batch}: invalid loss {loss}, terminating training.")
        self._stop = None


class LambdaCallback(Callback):
    """A callback made of functions: ``LambdaCallback(on_epoch_end=lambda epoch, logs: ...)``.

    Each keyword is a hook name of :class:`fitkit.callbacks.Callback` and its function takes
    that hook's arguments (``on_train_begin(logs)``, ``on_epoch_end(epoch, logs)``,
    ``on_backward_end(batch)``, ...). ``on_batch_begin`` / ``on_batch_end`` are Keras' names
    for the train batch hooks. Only the hooks given are called.

    Args:
        **hooks: ``hook_name=function`` pairs.

    Raises:
        TypeError: an unknown hook name, a value that is not callable, or a function that
            cannot take the hook's arguments (``on_epoch_end=lambda: None``).

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
            check_hook_arity(hook, fn, name)
            setattr(self, hook, fn)  # an instance attribute: CallbackList calls only these
