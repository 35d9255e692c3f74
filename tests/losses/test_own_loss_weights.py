"""Sample weights with a module's own loss (``compile(loss=None)``): a ``(B,)`` own loss (one value
per sample) is weighed as a compiled loss is, ``sum(w * l) / sum(w)``, across accumulation windows
and in the epoch mean; a 0-dim own loss (a mean the module took itself) refuses them before step 1."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitkit

T = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
W = torch.tensor([1.0, 2.0, 3.0, 1.0, 2.0, 3.0])
LR = 0.1


class OwnBias(nn.Module):
    """One bias ``b``; its own loss ``(b - target) ** 2`` per sample ``(B,)``, or their mean."""

    def __init__(self, per_sample: bool = True):
        super().__init__()
        self.b = nn.Parameter(torch.zeros(1))
        self.per_sample = per_sample

    def forward(self, target):
        losses = (self.b - target) ** 2  # (B,)
        return {"loss": losses if self.per_sample else losses.mean(), "logits": self.b.expand(len(target))}


def _hand(w: torch.Tensor, batch: int, accumulation: int) -> tuple[float, float]:
    """(b after one epoch, the epoch's weighted mean loss) of a plain SGD loop over the same windows."""
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([b], lr=LR)
    weighted_sum, weight_sum = 0.0, 0.0
    window = batch * accumulation
    for i in range(0, len(T), window):
        t, ww = T[i : i + window], w[i : i + window]
        loss = (ww * (b - t) ** 2).sum() / ww.sum()  # the window's mean: one step on it
        opt.zero_grad()
        loss.backward()
        opt.step()
        weighted_sum += float(loss.detach()) * float(ww.sum())
        weight_sum += float(ww.sum())
    return float(b.detach()), weighted_sum / weight_sum


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("weights", ["sample_weight", "class_weight"])
def test_a_per_sample_own_loss_takes_the_weights_exactly(accumulation, weights):
    model = fitkit.Model(OwnBias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss=None, gradient_accumulation_steps=accumulation)
    if weights == "sample_weight":
        kwargs, w = {"sample_weight": W}, W
    else:  # classes 0 / 1 weighed 1 / 3, read from y (the module's loss does not take y)
        y = torch.tensor([0, 1, 1, 0, 0, 1])
        kwargs, w = {"y": y, "class_weight": {0: 1.0, 1: 3.0}}, torch.tensor([1.0, 3.0, 3.0, 1.0, 1.0, 3.0])
    history = model.fit({"target": T}, batch_size=2, epochs=1, shuffle=False, verbose=0, **kwargs)
    b, loss = _hand(w, batch=2, accumulation=accumulation)
    assert float(model.module.b.detach()) == pytest.approx(b, abs=1e-6)
    assert history.history["loss"][0] == pytest.approx(loss, abs=1e-5)
    # evaluate: the weighted mean over the rows, with the trained b
    expected = float((W * (model.module.b.detach() - T) ** 2).sum() / W.sum())
    assert model.evaluate({"target": T}, sample_weight=W, batch_size=4, verbose=0)["loss"] == pytest.approx(expected)


def test_a_per_sample_own_loss_without_weights_is_the_mean():
    model = fitkit.Model(OwnBias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss=None)
    model.fit({"target": T}, batch_size=6, epochs=1, shuffle=False, verbose=0)
    b, _ = _hand(torch.ones(6), batch=6, accumulation=1)  # b = 0.1 * 2 * mean(T) = 0.7
    assert float(model.module.b.detach()) == pytest.approx(b, abs=1e-7) and b == pytest.approx(0.7)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda m: m.fit({"target": T}, sample_weight=W, batch_size=2, verbose=0),
            r"cannot reach the module's own loss: with compile\(loss=None\) the loss is the module's"
            r".*Fix: compile a loss"
            r".*or return one loss per sample",
        ),
        (
            lambda m: m.fit([({"target": T[:3]}, None, W[:3])], verbose=0),  # an iterable of (x, y, w) batches
            r"cannot reach the module's own loss",
        ),
        (lambda m: m.evaluate({"target": T}, sample_weight=W, verbose=0), r"cannot reach the module's own loss"),
        (
            lambda m: m.fit({"target": T}, class_weight={0: 1.0, 1: 2.0}, verbose=0),
            r"`class_weight` weighs each sample by the class in `y`, but y=None.*compile\(loss=None\) the loss is the "
            r"module's.*Fix: pass the class labels as `y=` with a compiled loss",
        ),
    ],
)
def test_weights_that_cannot_reach_a_mean_own_loss_are_refused_before_step_1(call, match):
    model = fitkit.Model(OwnBias(per_sample=False), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss=None)
    with pytest.raises(ValueError, match=match):
        call(model)
    assert float(model.module.b) == 0.0 and model.global_step == 0
