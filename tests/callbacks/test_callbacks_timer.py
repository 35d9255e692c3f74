"""Timer: a time budget with a fake clock (1 s per clock read is not assumed: the clock is set
by the test). Stops at the exact step / epoch; a resumed run counts the time already spent."""

from __future__ import annotations

import datetime

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import BackupAndRestore, LambdaCallback, Timer


class Clock:
    """Seconds that advance by ``per_step`` at each training batch (set by a callback)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _model() -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    return model


def _tick(clock: Clock, seconds: float) -> LambdaCallback:
    def advance(batch, logs):
        clock.now += seconds

    return LambdaCallback(on_train_batch_begin=advance)


X, Y = torch.zeros(10, 1), torch.zeros(10, 1)


def test_a_step_budget_stops_at_the_step_that_spends_it():
    clock = Clock()
    timer = Timer(duration=7.5, clock=clock)  # 2 s a step: steps 1-3 leave 6 s, step 4 reaches 8
    model = _model()
    history = model.fit(X, Y, batch_size=2, epochs=10, verbose=0, callbacks=[_tick(clock, 2.0), timer])
    assert model.global_step == 4 and history.epoch == [0] and timer.stopped
    assert timer.elapsed == 8.0


def test_an_epoch_interval_stops_at_the_epoch_end():
    clock = Clock()
    timer = Timer(duration=datetime.timedelta(seconds=12), interval="epoch", clock=clock)  # 10 s an epoch
    model = _model()
    history = model.fit(X, Y, batch_size=2, epochs=10, verbose=0, callbacks=[_tick(clock, 2.0), timer])
    assert history.epoch == [0, 1] and model.global_step == 10


class _Crash(Exception):
    pass


def test_a_resumed_run_counts_the_time_spent_before(tmp_path):
    clock = Clock()

    def run(crash_at=None):
        model = _model()

        def crash(epoch, logs):
            if epoch == crash_at:
                raise _Crash

        model.fit(
            X,
            Y,
            batch_size=2,
            epochs=10,
            verbose=0,
            callbacks=[
                _tick(clock, 1.0),
                Timer(duration=23, clock=clock),
                BackupAndRestore(tmp_path),
                LambdaCallback(on_epoch_end=crash),
            ],
        )
        return model

    with pytest.raises(_Crash):
        run(crash_at=2)  # 15 steps run; the backup after epoch 2 holds 10 s
    clock.now += 1000.0  # the time between the crash and the relaunch does not count
    model = run()
    assert model.global_step == 23  # 10 s before + 13 steps of 1 s


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"duration": 0}, ValueError, "duration"),
        ({"duration": "12:00"}, ValueError, "DD:HH:MM:SS"),
        ({"duration": {"hourz": 1}}, TypeError, "timedelta keywords"),
        ({"duration": 5, "interval": "batch"}, ValueError, "interval"),
        ({"duration": 5, "clock": 3}, TypeError, "clock"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        Timer(**kwargs)


def test_fit_max_time_adds_a_timer():
    """fit(max_time=...) is Lightning's Trainer(max_time): a Timer with that duration. A budget
    spent by the first step stops there; an hour trains every epoch; two budgets are refused
    before anything changes, as is a bad duration."""
    import torch

    import fitkit

    x, y = torch.randn(16, 2), torch.randn(16, 1)
    model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, y, batch_size=4, epochs=3, verbose=0, max_time=1e-9)
    assert model.global_step == 1 and history.epoch == [0]
    history = model.fit(x, y, batch_size=4, epochs=3, verbose=0, max_time={"hours": 1})
    assert model.global_step == 13 and history.epoch == [0, 1, 2]
    before = [p.detach().clone() for p in model.module.parameters()]
    with pytest.raises(ValueError, match="two time budgets"):
        model.fit(x, y, batch_size=4, verbose=0, max_time=60, callbacks=[Timer(duration=60)])
    with pytest.raises(ValueError, match="'DD:HH:MM:SS'"):
        model.fit(x, y, batch_size=4, verbose=0, max_time="1 hour")
    assert model.global_step == 13 and all(
        torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True)
    )
