"""The loop's invariant 1: an optimizer step applies whole accumulation windows only.

Every stop source (a callback's ``model.stop_training`` at any hook, ``Timer`` / ``max_time``,
``EarlyStopping`` inside the epoch, ``max_steps``, SIGTERM, ``min_steps`` / ``min_epochs``
holds) at every place of a window of 3 micro-batches finishes the open window: its step is
applied, its loss share is in the epoch loss, and no gradient is left in ``.grad``. Checked
against a hand loop, exactly: the windows hold micro-batches of 1, 1 and 2 samples (shares 1/4,
1/4, 1/2), the model is a bias on zero inputs and the targets are small integers, so every
weight, gradient and loss is a dyadic rational that float32 holds exactly.
"""

from __future__ import annotations

import inspect
import os
import signal

import pytest
import torch

import fitkit
from fitkit.callbacks import Callback, EarlyStopping, Timer
from tests.conftest import fixed_linear

K = 3  # micro-batches per window
SIZES = [1, 1, 2] * 3  # one epoch: 3 windows of 4 samples
LR = 0.125


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    targets = [1.0, 2.0, 5.0, 3.0, -2.0, 4.0, 6.0, 0.0, 1.0, 7.0, 3.0, 2.0]
    out, i = [], 0
    for size in SIZES:
        out.append((torch.zeros(size, 1), torch.tensor(targets[i : i + size]).reshape(size, 1)))
        i += size
    return out


def _hand(steps: int) -> tuple[torch.Tensor, list[float]]:
    """``steps`` optimizer steps of whole windows by hand: the bias and each epoch's loss."""
    net = fixed_linear(1, 1)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    batches = _batches() * 3
    per_epoch = len(SIZES) // K
    sums = [[0.0, 0] for _ in range(-(-steps // per_epoch))]
    for w in range(steps):
        window = batches[K * w : K * w + K]
        rows = sum(len(y) for _, y in window)
        for x, y in window:
            loss = torch.nn.functional.mse_loss(net(x), y)
            (loss * (len(y) / rows)).backward()
            sums[w // per_epoch][0] += loss.item() * len(y)
            sums[w // per_epoch][1] += len(y)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return net.bias.detach().clone(), [total / count for total, count in sums]


class StopAt(Callback):
    """Sets ``model.stop_training`` at ``hook`` from batch ``at`` of each epoch on (every call)."""

    def __init__(self, hook: str, at: int):
        super().__init__()
        self.hook, self.at = hook, at

    def _maybe(self, batch: int) -> None:
        if batch >= self.at:
            self.model.stop_training = True

    def on_train_batch_begin(self, batch, logs=None):
        if self.hook == "on_train_batch_begin":
            self._maybe(batch)

    def on_train_batch_end(self, batch, logs=None):
        if self.hook in ("on_train_batch_end", "hold"):
            self._maybe(batch)

    def on_backward_end(self, batch):
        if self.hook == "on_backward_end":
            self._maybe(batch)


class Ticks(Callback):
    """A clock for a ``Timer``: one second per training batch (listed before the Timer)."""

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def on_train_batch_end(self, batch, logs=None):
        self.now += 1.0


class Sigterm(Callback):
    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _source(name: str, at: int, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, int]:
    """fit's keywords for a stop requested at batch ``at`` of epoch 0, and the steps expected."""
    window_end = at // K + 1  # the window that holds batch `at`, finished
    if name in ("on_train_batch_begin", "on_train_batch_end", "on_backward_end"):
        return {"callbacks": [StopAt(name, at)]}, window_end
    if name == "Timer":
        ticks = Ticks()
        return {"callbacks": [ticks, Timer(at + 1, clock=ticks)]}, window_end
    if name == "max_time":
        ticks = Ticks()
        # the Timer that max_time adds reads this clock (its __init__ is wrapped by its declared options)
        monkeypatch.setattr(inspect.unwrap(Timer.__init__), "__defaults__", ("step", ticks))
        return {"callbacks": [ticks], "max_time": at + 1}, window_end
    if name == "EarlyStopping":  # inside the epoch: validations every `window_end` steps
        stop = EarlyStopping(monitor="val_loss", stopping_threshold=1e9, verbose=0)
        return {"callbacks": [stop], "validation_data": _batches()[:1], "validation_interval": window_end}, window_end
    if name == "max_steps":
        return {"max_steps": window_end}, window_end
    if name == "min_steps":  # asked to stop from batch `at` on, held until 3 steps
        return {"callbacks": [StopAt("hold", at)], "min_steps": 3}, 3
    if name == "min_epochs":  # asked to stop from batch `at` of each epoch on: dropped in epoch 0, heard in 1
        return {"callbacks": [StopAt("hold", at)], "min_epochs": 1}, len(SIZES) // K + window_end
    assert name == "SIGTERM"
    return {"callbacks": [Sigterm(at)]}, window_end


SOURCES = [
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_backward_end",
    "Timer",
    "max_time",
    "EarlyStopping",
    "max_steps",
    "min_steps",
    "min_epochs",
    "SIGTERM",
]


@pytest.mark.parametrize("position", [1, 2, 3], ids=lambda p: f"micro{p}")
@pytest.mark.parametrize("source", SOURCES)
def test_every_stop_finishes_the_open_window(source, position, monkeypatch):
    at = K + position - 1  # batch of epoch 0 in its second window
    kwargs, steps = _source(source, at, monkeypatch)
    net = fixed_linear(1, 1)
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss="mse", gradient_accumulation_steps=K)
    epochs = 3
    if source == "SIGTERM":
        with pytest.raises(SystemExit) as exit_info:
            model.fit(_batches(), epochs=epochs, verbose=0, **kwargs)
        assert exit_info.value.code == 128 + signal.SIGTERM
    else:
        history = model.fit(_batches(), epochs=epochs, verbose=0, **kwargs)
    bias, epoch_losses = _hand(steps)
    assert model.global_step == steps
    assert torch.equal(net.bias.detach(), bias), (net.bias, bias)
    assert net.weight.grad is None and net.bias.grad is None  # no micro-batch's gradient left over
    if source != "SIGTERM":  # a signal ends the epoch without its logs
        assert history.history["loss"] == epoch_losses


def test_a_stop_after_the_first_micro_batch_applies_the_whole_window():
    """The issue's example: ``stop_training`` after micro-batch 1 of a window of 3."""
    net = fixed_linear(1, 1)
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss="mse", gradient_accumulation_steps=K)
    history = model.fit(_batches(), epochs=1, verbose=0, callbacks=[StopAt("on_train_batch_end", 0)])
    # window 1: targets 1, 2, (5, 3) -> mean 2.75; grad 2 * (0 - 2.75) = -5.5; bias 0 + 0.125 * 5.5
    assert net.bias.item() == 0.6875 and model.global_step == 1 and net.bias.grad is None
    # losses 1, 4, (25 + 9) / 2 = 17, by rows: (1 + 4 + 2 * 17) / 4
    assert history.history["loss"] == [9.75]
