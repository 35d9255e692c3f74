"""fit(max_samples=N): training ends with the optimizer step whose accumulation window brings the
samples trained on (from epoch 0) to N or more; a window is never cut. Checked against a hand loop
over the same windows, with accumulation, across epochs, with a planned scheduler and on resume."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitkit

X = torch.arange(20, dtype=torch.float32).reshape(10, 2) / 10
Y = X.sum(1, keepdim=True)
LR = 0.1


def _model(accumulation: int = 1, scheduler=None) -> fitkit.Model:
    module = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(module.weight)
    model = fitkit.Model(module, device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=LR),
        loss="mse",
        gradient_accumulation_steps=accumulation,
        scheduler=scheduler,
    )
    return model


def _hand(windows: list[list[tuple[int, int]]]) -> torch.Tensor:
    """SGD steps, one per window of batches [a, b): the window's mean over its samples."""
    w = torch.zeros(1, 2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=LR)
    for window in windows:
        rows = torch.cat([torch.arange(a, b) for a, b in window])
        loss = torch.nn.functional.mse_loss(X[rows] @ w.T, Y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w.detach()


B4 = [(0, 4), (4, 8), (8, 10)]  # batches of 4, 4, 2 per epoch


@pytest.mark.parametrize(
    "accumulation, max_samples, windows, epochs",
    [
        (1, 8, [[B4[0]], [B4[1]]], [0]),  # exactly 8: after the second batch
        (1, 9, [[B4[0]], [B4[1]], [B4[2]]], [0]),  # 9 is inside the short last batch: it completes
        (2, 9, [B4[:2], B4[2:]], [0]),  # 8 after window 1, 10 after window 2 (the short one)
        (2, 5, [B4[:2]], [0]),  # the budget ends inside a window: the window (8 samples) completes
        (2, 12, [B4[:2], B4[2:], B4[:2]], [0, 1]),  # 10 in epoch 0, then one window of epoch 1
        (3, 14, [B4, B4], [0, 1]),  # one window per epoch of 10 samples: 20 >= 14
    ],
)
def test_the_sample_budget_ends_at_the_window_that_reaches_it(accumulation, max_samples, windows, epochs):
    model = _model(accumulation)
    history = model.fit(X, Y, batch_size=4, max_samples=max_samples, shuffle=False, verbose=0)
    assert model.global_step == len(windows)
    assert history.epoch == epochs
    torch.testing.assert_close(model.module.weight.detach(), _hand(windows), rtol=0, atol=1e-6)


def test_the_sample_budget_plans_the_schedulers_steps_and_the_smaller_budget_wins():
    seen = {}

    def linear(opt, total_steps):
        seen["total_steps"] = total_steps
        return torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=total_steps)

    model = _model(2, scheduler=linear)
    history = model.fit(X, Y, batch_size=4, max_samples=12, shuffle=False, verbose=0)
    assert seen["total_steps"] == 3 and history.params["total_steps"] == 3
    model = _model()
    model.fit(X, Y, batch_size=4, max_samples=100, max_steps=2, verbose=0)
    assert model.global_step == 2


def test_a_resumed_fit_keeps_the_budget_counted_from_epoch_0(tmp_path):
    from fitkit.callbacks import LambdaCallback

    class Stop(Exception):
        pass

    model = _model()

    def crash(batch, logs):
        if model.global_step == 2:
            model.save_checkpoint(tmp_path / "ckpt.pt")
            raise Stop

    with pytest.raises(Stop):
        model.fit(
            X,
            Y,
            batch_size=4,
            max_samples=25,
            shuffle=False,
            verbose=0,
            callbacks=[LambdaCallback(on_train_batch_end=crash)],
        )
    resumed = _model()
    resumed.load_checkpoint(tmp_path / "ckpt.pt")
    resumed.fit(X, Y, batch_size=4, max_samples=25, shuffle=False, verbose=0)
    # 25 samples: epochs 0 and 1 (20), then 4 + 4 of epoch 2: 8 steps, as without the crash
    assert resumed.global_step == 8
    windows = [[b] for b in B4] * 2 + [[B4[0]], [B4[1]]]
    torch.testing.assert_close(resumed.module.weight.detach(), _hand(windows), rtol=0, atol=1e-6)


def test_a_sample_budget_needs_known_batch_sizes():
    model = _model()
    with pytest.raises(
        ValueError,
        match=r"fit\(max_samples=5\) needs the size of every training batch.*Fix: "
        r"pass max_steps=",
    ):
        model.fit(iter([(X[:4], Y[:4])]), max_samples=5, verbose=0)
    with pytest.raises(ValueError, match=r"Expected `max_samples` >= 1\. Received: max_samples=0"):
        model.fit(X, Y, max_samples=0, verbose=0)
    assert model.global_step == 0
