"""Model(activation_checkpointing=...): gradients of the plain run bit for bit, recomputed forwards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitkit
from fitkit.distributed import FSDP
from fitkit.layers import TransformerBlock


class Counted(TransformerBlock):
    """A block that counts its forwards (the recompute in the backward included)."""

    calls = 0

    def forward(self, x):
        Counted.calls += 1
        return super().forward(x)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Counted(8, 2, dropout=0.2), Counted(8, 2, dropout=0.2), nn.Linear(8, 1))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(12, 3, 4, generator=g), torch.randn(12, 3, 1, generator=g)


def _fit(**model_kwargs) -> tuple[fitkit.Model, dict, list[torch.Tensor], int]:
    x, y = _data()
    model = fitkit.Model(_net(), device="cpu", **model_kwargs)
    model.compile(optimizer="adam", loss="mse")
    grads: list[torch.Tensor] = []
    keep = fitkit.callbacks.LambdaCallback(
        on_backward_end=lambda b: grads.extend(p.grad.clone() for p in model.module.parameters())
    )
    Counted.calls = 0
    torch.manual_seed(5)  # the dropout masks and the shuffle
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[keep])
    return model, history.history, grads, Counted.calls


@pytest.mark.parametrize("spec", [True, Counted, "Counted", [TransformerBlock], lambda m: isinstance(m, Counted)])
def test_gradients_equal_the_plain_run_bit_for_bit(spec):
    plain, plain_history, plain_grads, plain_calls = _fit()
    ckpt, history, grads, calls = _fit(activation_checkpointing=spec)
    assert plain_calls == 2 * 6 + 2  # 2 blocks x 6 steps, + the preflight's first batch through each block
    assert calls == 2 * 2 * 6 + 2  # each block's forward runs again in the backward
    assert len(grads) == len(plain_grads) == 6 * len(list(plain.module.parameters()))  # 6 steps
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))  # dropout masks replayed
    assert all(torch.equal(a, b) for a, b in zip(ckpt.module.parameters(), plain.module.parameters(), strict=True))
    assert history == plain_history
    assert list(ckpt.module.state_dict()) == list(plain.module.state_dict())  # keys unchanged
    assert [type(m) for m in ckpt.module] == [type(m) for m in plain.module]
    Counted.calls = 0
    x, _ = _data()
    torch.testing.assert_close(ckpt.predict(x, verbose=0), plain.predict(x, verbose=0), rtol=0, atol=0)
    assert Counted.calls == 2 * 2  # no recompute without autograd: once per block, in each predict


def test_bad_specs():
    with pytest.raises(ValueError, match="picks no submodule"):
        fitkit.Model(nn.Sequential(nn.Linear(2, 2)), device="cpu", activation_checkpointing=True)
    with pytest.raises(ValueError, match="FSDP checkpoints its own units"):
        fitkit.Model(_net(), device="cpu", strategy=FSDP(), activation_checkpointing=True)
    with pytest.raises(TypeError, match="activation_checkpointing"):
        fitkit.Model(_net(), device="cpu", activation_checkpointing=[3])
