"""Argument errors for the habits users bring: unknown keywords, classes instead of instances."""

from __future__ import annotations

import inspect

import pytest
import torch
import torchmetrics
from torch import nn

import fitkit


def _model() -> fitkit.Model:
    return fitkit.Model(nn.Linear(2, 1), device="cpu")


@pytest.mark.parametrize("keyword", ["lr", "learning_rate"])
def test_compile_with_a_learning_rate_names_the_ways_to_set_one(keyword):
    model = _model()
    with pytest.raises(TypeError) as info:
        model.compile("adam", "mse", **{keyword: 1e-3})
    msg = str(info.value)
    assert msg.startswith(f"Model.compile() got an unexpected keyword argument '{keyword}'. Fix: set the learning "
                          "rate on the optimizer")
    assert "torch.optim.AdamW(model.module.parameters(), lr=1e-3)" in msg
    assert "functools.partial(torch.optim.AdamW, lr=1e-3)" in msg
    assert "LearningRateScheduler" in msg and "compile(scheduler=...)" in msg
    valid = [n for n in inspect.signature(fitkit.Model.compile).parameters if n != "self"]
    assert valid[:4] == ["optimizer", "loss", "metrics", "loss_weights"] and "jit_compile" in valid
    assert msg.endswith(f"Valid keywords: {', '.join(valid)}.")
    assert model.optimizer is None  # nothing was compiled


def test_misspelt_keywords_of_fit_evaluate_predict_get_close_matches():
    model = _model()
    model.compile("sgd", "mse")
    x, y = torch.zeros(4, 2), torch.zeros(4, 1)
    before = model.module.weight.clone()
    with pytest.raises(TypeError, match=r"^Model\.fit\(\) got an unexpected keyword argument 'epoch'\. Fix: did you "
                                        r"mean 'epochs'\? Valid keywords: x, y, batch_size, epochs,"):
        model.fit(x, y, epoch=2, verbose=0)
    assert torch.equal(model.module.weight, before)
    with pytest.raises(TypeError, match=r"'batchsize'\. Fix: did you mean 'batch_size'\?"):
        model.evaluate(x, y, batchsize=2)
    with pytest.raises(TypeError, match=r"^Model\.predict\(\) got an unexpected keyword argument 'zzz'\. Fix: use "
                                        r"one of the valid keywords\. Valid keywords: x, batch_size, verbose, steps"):
        model.predict(x, zzz=1)


def test_the_documented_signatures_are_the_methods_own():
    assert "**" not in str(inspect.signature(fitkit.Model.fit))
    assert list(inspect.signature(fitkit.Model.compile).parameters)[:4] == ["self", "optimizer", "loss", "metrics"]


def test_a_loss_class_asks_for_an_instance():
    with pytest.raises(TypeError) as info:
        _model().compile("sgd", nn.CrossEntropyLoss)
    assert str(info.value) == ("Expected `loss` to be an instance, not a class. Received: loss=nn.CrossEntropyLoss "
                               "(the class). Fix: pass an instance, loss=nn.CrossEntropyLoss().")


def test_a_metric_class_asks_for_an_instance():
    with pytest.raises(TypeError, match=r"^Expected `metrics` to be an instance, not a class\. Received: "
                                        r"metrics=torchmetrics\.classification\.accuracy\.MulticlassAccuracy "
                                        r"\(the class\)\. Fix: pass an instance"):
        _model().compile("sgd", "mse", metrics=[torchmetrics.classification.MulticlassAccuracy])


def test_an_optimizer_class_is_a_factory():
    model = _model()
    model.compile(torch.optim.SGD, "mse")  # SGD(params): torch's default lr
    assert type(model.optimizer) is torch.optim.SGD and model.optimizer.param_groups[0]["lr"] == 1e-3
    model.fit(torch.ones(2, 2), torch.zeros(2, 1), batch_size=2, verbose=0)
    assert model.global_step == 1
