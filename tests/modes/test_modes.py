"""Modes: train / eval flags and grad mode per phase, frozen submodules, restoration on errors."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import Probe, cpu_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit

X = torch.randn(8, 2)
Y = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])


def _flags(module: nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in module.named_modules()}


def _probe_model() -> tuple[fitkit.Model, Probe]:
    probe = Probe()
    model = cpu_model(probe)
    model.compile("sgd", "cross_entropy", metrics=["accuracy"])
    return model, probe


def test_training_runs_in_train_mode_with_grad_and_validation_in_eval_without():
    model, probe = _probe_model()
    phases = []

    class Phase(fitkit.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            phases.append("train")

        def on_test_batch_begin(self, batch, logs=None):
            phases.append("val")

    with torch.no_grad():  # fit turns grad on for training even here, and turns it back off
        model.fit(X, Y, batch_size=4, epochs=2, validation_data=(X[:4], Y[:4]), callbacks=[Phase()], verbose=0)
        assert not torch.is_grad_enabled()
    # Skip the two shape-check forwards fit runs before the first step, in eval mode: the
    # training batch's with grad (its loss must have a gradient), the validation batch's without.
    calls = probe.calls[2:]
    assert probe.calls[:2] == [(False, True), (False, False)]
    assert phases == ["train", "train", "val", "train", "train", "val"]
    assert calls == [(True, True), (True, True), (False, False)] * 2


@pytest.mark.parametrize("verb", ["evaluate", "predict", "test_on_batch", "predict_on_batch"])
def test_evaluate_and_predict_run_in_eval_mode_without_grad(verb):
    model, probe = _probe_model()
    args = {"evaluate": (X, Y), "predict": (X,), "test_on_batch": (X, Y), "predict_on_batch": (X,)}[verb]
    kwargs = {"verbose": 0} if verb in ("evaluate", "predict") else {}
    getattr(model, verb)(*args, **kwargs)
    assert probe.calls and set(probe.calls) == {(False, False)}
    assert probe.training and torch.is_grad_enabled()


def test_evaluate_from_a_dataloader_in_eval_mode():
    model, probe = _probe_model()
    model.evaluate(DataLoader(TensorDataset(X, Y), batch_size=3), verbose=0)
    assert probe.calls == [(False, False)] * 3


def test_modes_are_restored_as_found():
    net = nn.Sequential(nn.Linear(2, 4), nn.Dropout(0.5), nn.BatchNorm1d(4), nn.Linear(4, 2))
    net[1].eval()  # a mix of flags, all of which must come back
    model = cpu_model(net)
    model.compile("sgd", "cross_entropy")
    found = _flags(net)
    model.fit(X, Y, batch_size=4, validation_split=0.25, verbose=0)
    assert _flags(net) == found
    model.evaluate(X, Y, verbose=0)
    model.predict(X, verbose=0)
    model.train_on_batch(X, Y)
    assert _flags(net) == found
    net.eval()
    with pytest.warns(UserWarning, match="Every submodule is in eval mode"):
        model.fit(X, Y, batch_size=4, verbose=0)
    assert not any(_flags(net).values())


def Boom(hook: str) -> fitkit.Callback:
    """A callback whose ``hook`` raises ``KeyError("boom")``."""

    def boom(self, *args, **kwargs):
        raise KeyError("boom")

    return type("Boom", (fitkit.Callback,), {hook: boom})()


@pytest.mark.parametrize("hook", ["on_train_begin", "on_train_batch_end", "on_test_batch_end", "on_epoch_end"])
@pytest.mark.parametrize("grad", [True, False])
def test_modes_are_restored_when_fit_raises(hook, grad):
    net = nn.Sequential(nn.Linear(2, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    net[2].eval()
    model = cpu_model(net)
    model.compile("sgd", "cross_entropy")
    found = _flags(net)
    with torch.set_grad_enabled(grad):
        with pytest.raises(KeyError, match="boom"):
            model.fit(X, Y, batch_size=4, validation_split=0.25, callbacks=[Boom(hook)], verbose=0)
        assert torch.is_grad_enabled() is grad
    assert _flags(net) == found


def test_modes_are_restored_when_evaluate_and_predict_raise():
    model, probe = _probe_model()
    with pytest.raises(KeyError, match="boom"):
        model.evaluate(X, Y, callbacks=[Boom("on_test_batch_end")], verbose=0)
    with pytest.raises(KeyError, match="boom"):
        model.predict(X, callbacks=[Boom("on_predict_batch_end")], verbose=0)
    assert probe.training and torch.is_grad_enabled()


def test_frozen_submodule_stays_in_eval_and_its_batchnorm_stats_do_not_move():
    torch.manual_seed(0)
    frozen = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4))
    head = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2))
    net = nn.Sequential(frozen, head)
    frozen.eval()
    seen = []
    frozen[1].register_forward_pre_hook(lambda m, _: seen.append(("frozen", m.training)))
    head[0].register_forward_pre_hook(lambda m, _: seen.append(("head", m.training)))
    frozen_stats = [b.clone() for b in frozen.buffers()]
    head_stats = [b.clone() for b in head.buffers()]
    model = cpu_model(net)
    model.compile("sgd", "cross_entropy")
    model.fit(X, Y, batch_size=4, epochs=2, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(frozen_stats, frozen.buffers(), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(head_stats, head.buffers(), strict=True))  # the rest trains
    training_calls = seen[2:]  # after the shape check
    assert set(training_calls) == {("frozen", False), ("head", True)}
    assert not frozen.training and not frozen[1].training and head.training


def test_gradients_left_by_user_code_do_not_leak_into_the_first_step():
    weights = []
    for stale in (False, True):
        torch.manual_seed(0)
        net = nn.Linear(2, 2)
        if stale:
            net.weight.grad = torch.full_like(net.weight, 1e3)
        model = cpu_model(net)
        model.compile(functools.partial(torch.optim.SGD, lr=0.1), "cross_entropy")
        model.fit(X, Y, batch_size=4, shuffle=False, verbose=0)
        weights.append(net.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])
