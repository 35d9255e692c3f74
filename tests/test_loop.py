"""The per-group learning-rate log keys: a group's "name" names its key."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import CSVLogger


def _model(groups) -> fitkit.Model:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(groups(net), lr=0.1), loss="mse")
    return model


def test_named_groups_log_learning_rate_slash_name(tmp_path):
    model = _model(lambda net: [{"params": net[0].parameters(), "name": "body", "lr": 0.05},
                                {"params": net[1].parameters(), "name": "head"}])  # fmt: skip
    x = torch.randn(8, 2)
    history = model.fit(x, x[:, :1], epochs=2, verbose=0, callbacks=[CSVLogger(tmp_path / "log.csv")])
    assert history.history["learning_rate/body"] == [0.05, 0.05]
    assert history.history["learning_rate/head"] == [0.1, 0.1]
    assert history.history["learning_rate"] == [0.05, 0.05]  # group 0, as always
    assert "learning_rate/pg1" not in history.history
    header = (tmp_path / "log.csv").read_text().splitlines()[0].split(",")
    assert "learning_rate/body" in header and "learning_rate/head" in header
    assert model.history.params["metrics"] == ["loss", "learning_rate", "learning_rate/body", "learning_rate/head"]


def test_unnamed_groups_keep_pg_keys_beside_named_ones():
    model = _model(lambda net: [{"params": net[0].parameters()},
                                {"params": net[1].parameters(), "lr": 0.01, "name": "head"}])  # fmt: skip
    x = torch.randn(8, 2)
    history = model.fit(x, x[:, :1], epochs=1, verbose=0)
    assert history.history["learning_rate/head"] == [0.01] and "learning_rate/pg1" not in history.history
    model = _model(lambda net: [{"params": net[0].parameters(), "name": "body"},
                                {"params": net[1].parameters(), "lr": 0.01}])  # fmt: skip
    history = model.fit(x, x[:, :1], epochs=1, verbose=0)
    assert history.history["learning_rate/body"] == [0.1] and history.history["learning_rate/pg1"] == [0.01]


@pytest.mark.parametrize("names", [("a", "a"), ("", "b"), (3, "b")])
def test_bad_group_names_are_an_error_before_step_1(names):
    model = _model(lambda net: [{"params": net[0].parameters(), "name": names[0]},
                                {"params": net[1].parameters(), "name": names[1]}])  # fmt: skip
    before = [p.detach().clone() for p in model.module.parameters()]
    x = torch.randn(8, 2)
    with pytest.raises(ValueError, match="distinct, non-empty strings"):
        model.fit(x, x[:, :1], epochs=1, verbose=0)
    assert model.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))
