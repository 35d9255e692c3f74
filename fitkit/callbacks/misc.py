"""Small stock callbacks: ``TerminateOnNaN``, ``LambdaCallback``, ``LearningRateScheduler``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fitkit.callbacks.base import HOOKS, Callback
from fitkit.distributed import say

__all__ = ["TerminateOnNaN", "LambdaCallback"]


class TerminateOnNaN(Callback):
    """Stop training at the first batch whose loss is NaN or infinite; that step never happens.

    The check runs after the backward pass and before the optimizer step
    (``on_backward_end``): a non-finite loss vetoes the step (``model.skip_optimizer_step()``), so the
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
        >>> x = torch.tensor([[1.0], [float("nan")]])  # a list of batches: in-memory NaN is refused
        >>> history = model.fit([(x[:1], x[:1]), (x[1:], x[1:])], epochs=3, callbacks=[TerminateOnNaN()], verbose=0)
        >>> history.epoch, model.module.weight.isfinite().all().item()
        ([0], True)
    """

    def __init__(self, raise_error: bool = False):
        super().__init__()
        self.raise_error = bool(raise_error)

    def on_backward_end(self, batch):
        model = self.model
        loss = model.step_loss  # the whole accumulation window's loss: a NaN anywhere shows
        if loss is None or bool(torch.isfinite(loss).all()):  # one sync per optimizer step
            return
        model.skip_optimizer_step()
        model.stop_training = True
        if self.raise_error:
            model.optimizer.zero_grad(set_to_none=True)
            raise RuntimeError(
                f"The loss is {loss.item()} at batch {batch} of epoch {model.epoch}; training "
                "stopped before that step, so the weights are those of the previous step."
            )
        say(self.params.get("verbose", 0), f"Batch {batch}: invalid loss {loss.item()}, terminating training.")


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
