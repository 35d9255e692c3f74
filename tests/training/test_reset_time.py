"""fit(reset_time=True) (Composer's reset_time): a second fit on a trained model starts a fresh
run, its step counts at 0; without it, epochs count per call (Keras) and max_steps across
calls (Lightning). Weights and learning rates against a hand-written loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import LambdaCallback, ModelCheckpoint
from fitkit.checks import FitkitWarning

LR = 0.1
X = torch.linspace(-1, 1, 20).reshape(20, 1)
Y = 3 * X + 1


def _decay(optimizer, total_steps):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (2 * total_steps))


def _model() -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9),
        loss="mse",
        scheduler=_decay,
        scheduler_interval="step",
    )
    return model


def _hand(plan: list[int]) -> tuple[nn.Linear, list[float]]:
    """SGD with momentum over X, Y in batches of 4, in order; the LR decays linearly over each
    run's planned steps (``plan``: the steps of each run, the momentum carried over)."""
    torch.manual_seed(0)
    layer = nn.Linear(1, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=LR, momentum=0.9)
    lrs, batch = [], 0
    for total in plan:
        for s in range(total):
            lr = LR * (1 - s / (2 * total))
            for group in opt.param_groups:
                group["lr"] = lr
            lrs.append(lr)
            i = 4 * (batch % 5)
            batch += 1
            opt.zero_grad()
            nn.functional.mse_loss(layer(X[i : i + 4]), Y[i : i + 4]).backward()
            opt.step()
    return layer, lrs


def _lr_log(model, lrs):
    return LambdaCallback(on_train_batch_begin=lambda b, logs: lrs.append(model.optimizer.param_groups[0]["lr"]))


def test_a_fresh_run_counts_its_steps_from_0_and_rebuilds_the_schedule(tmp_path):
    model, lrs = _model(), []
    model.fit(X, Y, batch_size=4, shuffle=False, epochs=2, verbose=0, callbacks=[_lr_log(model, lrs)])
    assert model.global_step == 10
    history = model.fit(
        X, Y, batch_size=4, shuffle=False, max_steps=8, reset_time=True, verbose=0, callbacks=[_lr_log(model, lrs)]
    )
    assert model.global_step == 8 and history.params["total_steps"] == 8 and history.epoch == [0, 1]
    layer, hand_lrs = _hand([10, 8])  # the second schedule: 8 planned steps, from the base LR again
    assert lrs == pytest.approx(hand_lrs, rel=1e-12)
    torch.testing.assert_close(model.module.state_dict(), layer.state_dict(), rtol=1e-6, atol=1e-7)


def test_without_it_max_steps_counts_every_fit_and_epochs_each_call():
    model = _model()
    model.fit(X, Y, batch_size=4, shuffle=False, epochs=2, verbose=0)
    with pytest.warns(FitkitWarning, match=r"max_steps=8\) is already spent"):
        model.fit(X, Y, batch_size=4, shuffle=False, max_steps=8, verbose=0)
    assert model.global_step == 10
    history = model.fit(X, Y, batch_size=4, shuffle=False, epochs=1, verbose=0)  # one more epoch (Keras)
    assert model.global_step == 15 and history.epoch == [0]


def test_a_fraction_save_freq_follows_the_fresh_run(tmp_path):
    model = _model()
    model.fit(X, Y, batch_size=4, epochs=2, verbose=0)
    model.fit(
        X,
        Y,
        batch_size=4,
        epochs=2,
        reset_time=True,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path / "a" / "s{step:02d}.pt", save_freq=0.5)],
    )
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["s05.pt", "s10.pt"]
    with pytest.warns(FitkitWarning, match=r"has taken 10 already, so it saves only at the end.*reset_time=True"):
        model.fit(
            X,
            Y,
            batch_size=4,
            epochs=2,
            verbose=0,
            callbacks=[ModelCheckpoint(tmp_path / "b" / "s{step:02d}.pt", save_freq=0.5)],
        )
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["s20.pt"]


def test_a_fit_refused_before_step_1_keeps_the_step_count():
    model = _model()
    model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="validation_split"):
        model.fit(X, Y, batch_size=4, epochs=1, reset_time=True, validation_split=1.5, verbose=0)
    assert model.global_step == 5
    with pytest.raises(TypeError, match=r"Expected `reset_time` to be a bool"):
        model.fit(X, Y, batch_size=4, epochs=1, reset_time="yes", verbose=0)
    assert model.global_step == 5
