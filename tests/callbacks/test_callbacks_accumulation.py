"""GradientAccumulationScheduler and compile(gradient_accumulation_steps={...}): accumulation by epoch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import BackupAndRestore, GradientAccumulationScheduler, LambdaCallback

X = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]], dtype=torch.float64)
Y = torch.tensor([[2.0], [1.0], [0.0], [3.0], [1.0]], dtype=torch.float64)


def _model(accumulation=1) -> fitkit.Model:
    module = nn.Linear(1, 1, bias=False).double()
    nn.init.constant_(module.weight, 0.5)
    model = fitkit.Model(module, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.01), loss="mse", gradient_accumulation_steps=accumulation)
    return model


def _hand(windows_by_epoch: list[list[int]]) -> list[float]:
    """Each window's gradient of the mean squared error: mean over its samples of 2 (w x - y) x."""
    w, grads = 0.5, []
    for windows in windows_by_epoch:
        i = 0
        for size in windows:
            xs, ys = X[i : i + size, 0].tolist(), Y[i : i + size, 0].tolist()
            g = sum(2 * (w * x - y) * x for x, y in zip(xs, ys, strict=True)) / size
            grads.append(g)
            w -= 0.01 * g
            i += size
    return grads


def _grads(model: fitkit.Model, out: list) -> LambdaCallback:
    return LambdaCallback(
        on_backward_end=lambda batch: out.append(model.module.weight.grad.item()),
        on_train_begin=lambda logs: out.append(model.callbacks[0].params["total_steps"]),
    )


@pytest.mark.parametrize("form", ["callback", "compile"])
def test_each_windows_gradient_equals_the_hand_computation(form):
    # 5 samples, batch 1: {0: 3, 1: 2, 2: 1} gives windows [3, 2], [2, 2, 1], [1] * 5.
    schedule = {0: 3, 1: 2, 2: 1}
    model = _model(schedule if form == "compile" else 1)
    seen: list = []
    callbacks = [_grads(model, seen)] + ([GradientAccumulationScheduler(schedule)] if form == "callback" else [])
    h = model.fit(X, Y, batch_size=1, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    assert seen[0] == 10  # params["total_steps"]: 2 + 3 + 5
    assert seen[1:] == pytest.approx(_hand([[3, 2], [2, 2, 1], [1] * 5]), rel=1e-12, abs=0)
    assert model.global_step == 10 and h.epoch == [0, 1, 2]
    # after fit: the callback's fit puts the compiled 1 back; a compiled dict is at its epoch 0 value
    assert model.gradient_accumulation_steps == (1 if form == "callback" else 3)


def test_epochs_before_the_first_key_keep_the_compiled_value_or_1_in_compile():
    seen: list = []
    model = _model(2)
    model.fit(
        X,
        Y,
        batch_size=1,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[_grads(model, seen), GradientAccumulationScheduler({1: 5})],
    )
    assert seen[0] == 3 + 1 and len(seen) - 1 == 4  # epoch 0 at the compiled 2: [2, 2, 1]; epoch 1: [5]
    assert model.gradient_accumulation_steps == 2
    model, seen = _model({1: 5}), []
    model.fit(X, Y, batch_size=1, epochs=2, shuffle=False, verbose=0, callbacks=[_grads(model, seen)])
    assert seen[0] == 5 + 1  # epoch 0 at 1 (Lightning's default), epoch 1 at 5


class _Crash(Exception):
    pass


def _run(folder, crash_at=None):
    torch.manual_seed(0)
    x = torch.randn(12, 3)
    y = x.sum(1, keepdim=True)
    model = fitkit.Model(nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.2), nn.Linear(4, 1)), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss="mse")

    def crash(batch, logs):
        if model.global_step == crash_at:
            raise _Crash

    model.fit(
        x,
        y,
        batch_size=2,
        epochs=3,
        verbose=0,
        callbacks=[
            GradientAccumulationScheduler({0: 3, 1: 2}),
            LambdaCallback(on_train_batch_end=crash),
            BackupAndRestore(folder, save_freq=2),
        ],
    )
    return model


def test_a_resume_inside_a_scheduled_epoch_equals_the_uninterrupted_run(tmp_path):
    ref = _run(tmp_path / "ref")
    assert ref.global_step == 2 + 3 + 3
    with pytest.raises(_Crash):
        _run(tmp_path / "run", crash_at=4)  # inside epoch 1, at accumulation 2
    model = _run(tmp_path / "run")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in ref.state_dict().items())
    assert model.history.history == ref.history.history and model.global_step == 8


@pytest.mark.parametrize(
    ("schedule", "error", "match"),
    [
        ({}, ValueError, r"to hold at least one epoch\. Received: \{\}\. Fix:"),
        ({-1: 2}, ValueError, r"epoch key` >= 0\. Received: .*=-1\. Fix: use 0-based epoch numbers"),
        ({0: 0}, ValueError, r"\[0\]` >= 1\. Received: .*=0\. Fix: use ints >= 1"),
        ({"0": 2}, TypeError, r"epoch key` to be an int\. Received: .*='0'"),
        ({0: 1.5}, TypeError, r"\[0\]` to be an int\. Received: .*=1\.5"),
        ([8], TypeError, r"to be a dict \{epoch: micro-batches per step\}\. Received: \[8\] of type list\. Fix:"),
    ],
)
def test_a_bad_schedule_is_a_clear_error(schedule, error, match):
    with pytest.raises(error, match=match):
        GradientAccumulationScheduler(schedule)
    if isinstance(schedule, dict):
        with pytest.raises(error, match=match):
            _model(schedule)
    else:
        with pytest.raises(TypeError, match=r"`gradient_accumulation_steps` to be an int\. .*Fix: .*or a dict"):
            _model(schedule)


def test_two_schedules_for_one_fit_are_an_error_before_step_1():
    model = _model({0: 2})
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=\{\.\.\.\}\) and a Gradient.*Fix: keep one"):
        model.fit(X, Y, batch_size=1, verbose=0, callbacks=[GradientAccumulationScheduler({0: 3})])
    assert model.global_step == 0 and model.module.weight.item() == 0.5
