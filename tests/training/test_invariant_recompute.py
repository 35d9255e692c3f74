"""The loop's invariant 4: every training forward counts once.

``Model(net, activation_checkpointing=[Block])`` recomputes each ``Block``'s forward in the
backward; a norm layer with running statistics inside it must not update them a second time.
Property: for every kind of such layer (BatchNorm with an exponential or a cumulative average,
BatchNorm2d, InstanceNorm tracking its statistics) and with or without accumulation, the
checkpointed run equals the plain run bit for bit: weights, ``running_mean`` / ``running_var``,
``num_batches_tracked`` (one per training forward), and what ``predict`` / ``evaluate`` give.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fitkit

NORMS = {
    "BatchNorm1d": lambda: nn.BatchNorm1d(4),
    "BatchNorm1d(momentum=None)": lambda: nn.BatchNorm1d(4, momentum=None),
    "BatchNorm2d": lambda: nn.Sequential(nn.Unflatten(1, (4, 1, 1)), nn.BatchNorm2d(4), nn.Flatten()),
    "InstanceNorm1d(track_running_stats)": lambda: nn.Sequential(
        nn.Unflatten(1, (2, 2)), nn.InstanceNorm1d(2, affine=True, track_running_stats=True), nn.Flatten()
    ),
}


class Block(nn.Module):
    def __init__(self, norm: str):
        super().__init__()
        self.linear, self.norm, self.drop = nn.Linear(4, 4), NORMS[norm](), nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(torch.relu(self.norm(self.linear(x))))


def _run(net: nn.Module, units, accumulation: int):
    model = fitkit.Model(net, device="cpu", activation_checkpointing=units)
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse", gradient_accumulation_steps=accumulation)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g)
    torch.manual_seed(1)  # the same dropout masks in both runs
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    return model, model.predict(x, verbose=0), model.evaluate(x, y, verbose=0, return_dict=True)


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("norm", list(NORMS))
def test_a_recomputed_forward_leaves_the_running_statistics_as_the_plain_run(norm, accumulation):
    torch.manual_seed(0)
    net = nn.Sequential(Block(norm), Block(norm), nn.Linear(4, 1))
    plain_model, plain_out, plain_logs = _run(copy.deepcopy(net), None, accumulation)
    ckpt_model, ckpt_out, ckpt_logs = _run(net, [Block], accumulation)
    plain = plain_model.module.state_dict()
    for name, value in ckpt_model.module.state_dict().items():
        assert torch.equal(value, plain[name]), name
    counters = [int(v) for k, v in ckpt_model.module.state_dict().items() if k.endswith("num_batches_tracked")]
    forwards = 0 if norm.startswith("Instance") else 12  # 6 batches x 2 epochs (torch's InstanceNorm counts none)
    assert counters == [forwards, forwards]
    assert torch.equal(ckpt_out, plain_out)
    assert ckpt_logs == plain_logs


def test_the_issues_example_counts_each_batch_once():
    """``Block`` holding a ``BatchNorm``: ``num_batches_tracked`` was 2x with checkpointing."""
    torch.manual_seed(0)
    net = nn.Sequential(Block("BatchNorm1d"), nn.Linear(4, 1))
    model, _, _ = _run(net, [Block], 1)
    assert int(net[0].norm.num_batches_tracked) == 12
