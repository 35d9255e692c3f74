"""LearningRateFinder: a sweep at the start of fit that leaves the model as it was, then trains at the suggestion."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import BackupAndRestore, Callback, LambdaCallback, LearningRateFinder


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 3, generator=g)
    return x, x @ torch.tensor([[1.0], [-1.0], [0.5]]) + 0.1 * torch.randn(48, 1, generator=g)


def _model(lr: float = 0.01, **kw) -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=lr), loss="mse", **kw)
    return model


def _weights(model):
    return [t.detach().clone() for t in model.module.state_dict().values()]


class AtStart(Callback):
    """What the model holds when training is about to start (after the finder's on_train_begin)."""

    def on_train_begin(self, logs=None):
        self.weights = _weights(self.model)
        self.state = self.model.optimizer.state_dict()["state"]
        self.step, self.rng = self.model.global_step, torch.get_rng_state()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_finder_restores_the_model_then_trains_at_the_suggestion(accumulation):
    x, y = _data()
    model = _model(gradient_accumulation_steps=accumulation)
    before, rng = _weights(model), torch.get_rng_state()
    finder, start = LearningRateFinder(start_lr=1e-4, end_lr=1.0, num_steps=20), AtStart()
    torch.set_rng_state(rng)
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[finder, start], verbose=0)
    s = finder.result.suggestion
    assert s is not None and len(finder.result.lrs) >= 6
    assert all(torch.equal(a, b) for a, b in zip(start.weights, before, strict=True))  # bit for bit
    assert start.state == {} and start.step == 0 and torch.equal(start.rng, rng)
    assert model.optimizer.param_groups[0]["lr"] == s
    plain = _model(lr=s, gradient_accumulation_steps=accumulation)  # the same run, compiled at the suggestion
    torch.set_rng_state(rng)
    plain.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), _weights(plain), strict=True))
    assert model.global_step == plain.global_step == 12 // accumulation


def test_a_resumed_fit_keeps_the_rate_found_and_does_not_sweep(tmp_path):
    x, y = _data()

    class Crash(Exception):
        pass

    def crash(batch, logs):
        if model.global_step == 8:
            raise Crash

    model = _model()
    finder = LearningRateFinder(start_lr=1e-4, end_lr=1.0, num_steps=20)
    with pytest.raises(Crash):
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=3,
            verbose=0,
            callbacks=[finder, BackupAndRestore(tmp_path), LambdaCallback(on_train_batch_end=crash)],
        )
    found = finder.result.suggestion
    model, again = _model(), LearningRateFinder(start_lr=1e-4, end_lr=1.0, num_steps=20)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[again, BackupAndRestore(tmp_path)])
    assert again.result is None and model.optimizer.param_groups[0]["lr"] == found


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "log"}, ValueError, "'exponential' or 'linear'"),
        ({"num_steps": 1}, ValueError, "num_steps"),
        ({"end_lr": 1e-9}, ValueError, "end_lr"),
        ({"smooth": "x"}, TypeError, "smooth"),
    ],
)
def test_learning_rate_finder_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        LearningRateFinder(**kwargs)


def test_the_finder_needs_fit():
    model = _model()
    finder = LearningRateFinder()
    finder.set_model(model)
    with pytest.raises(ValueError, match="only inside `fit`"):
        finder.on_train_begin()
    assert isinstance(model, fitkit.Model)
