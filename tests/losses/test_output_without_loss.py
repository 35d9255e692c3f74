"""Keras' ``loss=[..., None]``: an output without a loss trains nothing, and labels are given only
for the outputs that have one (or for all, the unused ones ignored)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitkit

X = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
Y = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))


class TwoHeads(nn.Module):
    """Two outputs: ``(head(x), aux(x))``; only the first has a loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head, self.aux = nn.Linear(3, 1), nn.Linear(3, 2)

    def forward(self, x):
        return self.head(x), self.aux(x)


@pytest.mark.parametrize("y", ["one tensor", "a list of one", "a full list"])
def test_an_output_without_a_loss_trains_on_the_others_labels_alone(y):
    targets = {"one tensor": Y, "a list of one": [Y], "a full list": [Y, torch.zeros(8, 2)]}[y]
    net = TwoHeads()
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=["mse", None], loss_weights=[2.0, 5.0])
    aux_before = net.aux.weight.detach().clone()
    history = model.fit(X, targets, batch_size=4, epochs=1, shuffle=False, verbose=0)
    hand = TwoHeads()
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    losses = []
    for i in (0, 4):
        loss = 2.0 * nn.functional.mse_loss(hand(X[i : i + 4])[0], Y[i : i + 4])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    torch.testing.assert_close(net.head.weight.detach(), hand.head.weight.detach(), rtol=0, atol=1e-6)
    assert torch.equal(net.aux.weight.detach(), aux_before)  # no loss: no gradient
    assert history.history["loss"][0] == pytest.approx(sum(losses) / 2, rel=1e-6)


def test_every_output_without_a_loss_is_refused():
    with pytest.raises(ValueError, match=r"Expected at least one loss among the outputs\. Received only None.*Fix"):
        fitkit.Model(TwoHeads(), device="cpu").compile(loss=[None, None])
