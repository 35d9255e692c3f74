"""Under bf16-mixed / 16-mixed, targets are never rounded to the output's half precision: losses
and built-in metrics are computed in float32 from the module's output, as autocast computes its
losses. Values equal plain PyTorch's under torch.autocast, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fitkit

PRECISIONS = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _net(inputs: int = 3, outputs: int = 1) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(inputs, outputs)


def _model(net: nn.Module, precision: str, loss: str = "mse", metrics=("mae",)) -> fitkit.Model:
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss=loss, metrics=list(metrics), precision=precision)
    return model


@pytest.mark.parametrize("precision", PRECISIONS)
def test_evaluate_takes_targets_at_their_own_precision(precision):
    # 1.001 and 2.003 are not bfloat16 / float16 numbers; 66000 overflows float16
    x = torch.ones(3, 3)
    y = torch.tensor([[1.001], [2.003], [66000.0]])
    net = _net()
    model = _model(net, precision)
    with torch.no_grad(), torch.autocast("cpu", dtype=PRECISIONS[precision]):
        pred = net(x).float()
    result = model.evaluate(x, y, batch_size=3, verbose=0)
    assert result["loss"] == float(F.mse_loss(pred, y))
    assert result["mae"] == pytest.approx(float(F.l1_loss(pred, y)), rel=1e-7)
    assert result["loss"] < float("inf") and result["mae"] < float("inf")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_training_step_equals_the_hand_autocast_step(precision):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([[0.45], [1.001], [-2.003], [3.1415]])
    hand = _net()
    opt = torch.optim.SGD(hand.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "16-mixed")  # 16-mixed: fitkit's GradScaler too
    losses = []
    for _ in range(8):  # fp16's first steps may be skipped while the scale comes down
        opt.zero_grad()
        with torch.autocast("cpu", dtype=PRECISIONS[precision]):
            loss = F.mse_loss(hand(x).float(), y)  # the loss in float32, y as it came
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.detach()))
    model = _model(_net(), precision)
    history = model.fit(x, y, batch_size=4, epochs=8, shuffle=False, verbose=0)
    assert history.history["loss"] == losses
    assert losses[-1] != losses[0]  # the weights moved
    for p, q in zip(model.module.parameters(), hand.parameters(), strict=True):
        assert torch.equal(p, q)


def test_probability_targets_for_cross_entropy_stay_float32_under_bf16():
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    probs = torch.tensor([[0.7001, 0.2999], [0.1234, 0.8766], [0.5, 0.5], [0.999, 0.001]])
    net = _net(3, 2)
    model = _model(net, "bf16-mixed", loss="cross_entropy", metrics=())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = net(x).float()
    assert model.evaluate(x, probs, batch_size=4, verbose=0)["loss"] == float(F.cross_entropy(logits, probs))
