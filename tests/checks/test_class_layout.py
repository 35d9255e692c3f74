"""Logits (B, T, V) with T == V fit two class layouts: loss and metrics must agree on one."""

import pytest
import torch
import torch.nn.functional as F

import fitkit
from fitkit.layers import GPT
from fitkit.losses import class_layout


def test_ambiguous_lm_logits_use_the_last_dim_for_loss_and_metrics():
    torch.manual_seed(0)
    gpt = GPT(vocab_size=16, block_size=16, n_layer=1, n_head=2, n_embd=16)
    model = fitkit.Model(gpt, device="cpu")
    model.compile("adamw", loss="cross_entropy", metrics=["accuracy"])
    x, y = torch.randint(0, 16, (4, 16)), torch.randint(0, 16, (4, 16))
    with pytest.warns(UserWarning, match="fit two layouts"):
        logs = model.evaluate(x, y, verbose=0)
    with torch.no_grad():
        logits = gpt.eval()(x)  # (4, 16, 16)
    expected = F.cross_entropy(logits.reshape(-1, 16), y.reshape(-1)).item()
    assert logs["loss"] == pytest.approx(expected, rel=1e-6)
    assert logs["accuracy"] == pytest.approx((logits.argmax(-1) == y).float().mean().item())
    # a shorter, unambiguous context afterwards keeps loss and metrics consistent (no crash)
    logs = model.evaluate(x[:, :15], y[:, :15], verbose=0)
    assert logs["accuracy"] == pytest.approx((logits[:, :15].argmax(-1) == y[:, :15]).float().mean().item())


def test_layout_rules():
    assert class_layout(torch.zeros(2, 5), torch.zeros(2)) == "dim1"
    assert class_layout(torch.zeros(2, 5, 7), torch.zeros(2, 7)) == "dim1"
    assert class_layout(torch.zeros(2, 7, 5), torch.zeros(2, 7)) == "last"
    assert class_layout(torch.zeros(2, 5, 5), torch.zeros(2, 5), previous="dim1") == "dim1"
    assert class_layout(torch.zeros(2, 5), torch.zeros(3)) is None
