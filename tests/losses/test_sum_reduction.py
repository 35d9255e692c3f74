"""A loss's reduction is the user's: nn.MSELoss(reduction="sum") trains on the gradient of the
sum (over the accumulation window too), and reports the sum per batch (epoch: the mean of the
batches' sums weighted by their rows, Keras' rule). Hand values throughout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fitkit


def _model(loss, accumulation: int = 1) -> fitkit.Model:
    net = nn.Linear(1, 1)
    nn.init.zeros_(net.weight)
    nn.init.zeros_(net.bias)
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss=loss, gradient_accumulation_steps=accumulation)
    return model


X, Y = torch.ones(4, 1), torch.tensor([[1.0], [2.0], [3.0], [4.0]])


def test_evaluate_reports_the_sum_per_batch():
    model = _model(nn.MSELoss(reduction="sum"))
    assert model.evaluate(X, Y, batch_size=4, verbose=0) == {"loss": 30.0}  # 1 + 4 + 9 + 16
    assert model.evaluate(X, Y, batch_size=2, verbose=0) == {"loss": 15.0}  # batches 5 and 25, 2 rows each


@pytest.mark.parametrize("accumulation, batch_size", [(1, 4), (2, 2), (4, 1)])
def test_the_step_follows_the_gradient_of_the_sum_with_or_without_accumulation(accumulation, batch_size):
    model = _model(nn.MSELoss(reduction="sum"), accumulation)
    model.fit(X, Y, batch_size=batch_size, shuffle=False, verbose=0)
    assert model.global_step == 1
    assert model.module.bias.item() == 20.0  # d/db sum((b - y)^2) at 0 = -2 * 10; lr 1
    assert model.module.weight.item() == 20.0  # x = 1


def test_sample_weights_weigh_the_terms_of_the_sum():
    model = _model(nn.MSELoss(reduction="sum"))
    history = model.fit(X, Y, sample_weight=torch.tensor([1.0, 0.0, 0.0, 2.0]), batch_size=4, verbose=0)
    assert history.history["loss"] == [33.0]  # 1 * 1 + 2 * 16
    assert model.module.bias.item() == 18.0  # 2 * (1 * 1 + 2 * 4)


def test_a_sum_cross_entropy_skips_ignored_targets_as_torch_does():
    torch.manual_seed(0)
    net = nn.Linear(3, 4)
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer="sgd", loss=nn.CrossEntropyLoss(reduction="sum"))
    x = torch.randn(5, 3)
    y = torch.tensor([0, 3, -100, 1, 2])
    with torch.no_grad():
        expected = F.cross_entropy(net(x), y, reduction="sum")
    assert model.evaluate(x, y, batch_size=5, verbose=0)["loss"] == float(expected)


def test_reduction_none_keeps_fitkits_mean_and_the_default_is_unchanged():
    for loss in (nn.MSELoss(reduction="none"), nn.MSELoss(), "mse"):
        assert _model(loss).evaluate(X, Y, batch_size=4, verbose=0) == {"loss": 7.5}
