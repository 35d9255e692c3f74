"""OptimizerMonitor (gradient and update norms) and LearningRateMonitor (momentum, betas, weight decay)
against a hand-written torch loop."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import LearningRateMonitor, OptimizerMonitor
from fitkit.checks import FitkitWarning

N, BATCH = 12, 4


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=g)
    return x, x @ torch.tensor([[1.0], [-1.0], [0.5]]) + 0.1 * torch.randn(N, 1, generator=g)


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _norm(tensors, p):
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t, p) for t in tensors]), p).item()


def _hand_norms(every: int, accumulation: int, p: float, epochs: int = 2):
    """The same training by hand: each step's (grad norms, update norms) per parameter name."""
    module, (x, y) = _module(), _data()
    opt = _optimizer(module.parameters())
    names = [n for n, _ in module.named_parameters()]
    rows, steps, out = BATCH * accumulation, 0, {}
    for _ in range(epochs):
        for start in range(0, N, rows):  # one optimizer step over an accumulation group's rows
            opt.zero_grad()
            loss = nn.functional.mse_loss(module(x[start : start + rows]), y[start : start + rows])
            loss.backward()
            before = [q.detach().clone() for q in module.parameters()]
            grads = [q.grad.clone() for q in module.parameters()]
            opt.step()
            steps += 1
            if steps % every == 0:
                changes = [q.detach() - b for q, b in zip(module.parameters(), before, strict=True)]
                out[steps] = (dict(zip(names, grads, strict=True)), dict(zip(names, changes, strict=True)))
    return out


@pytest.mark.parametrize(
    ("every", "accumulation", "p"),
    [(1, 1, 2.0), (2, 1, 2.0), (4, 1, 1.0), (1, 2, 2.0), (3, 2, math.inf)],
)
def test_optimizer_monitor_norms_match_the_hand_loop(every, accumulation, p):
    model = fitkit.Model(_module(), device="cpu")
    model.compile(optimizer=_optimizer, loss="mse", gradient_accumulation_steps=accumulation)
    monitor = OptimizerMonitor(log_every_n_steps=every, norm_type=p)
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, callbacks=[monitor], verbose=0)
    hand = _hand_norms(every, accumulation, p)
    assert monitor.steps == sorted(hand)
    names = [n for n, _ in model.module.named_parameters()]
    assert sorted(monitor.history) == sorted(
        ["grad_norm", "update_norm", *(f"grad_norm/{n}" for n in names), *(f"update_norm/{n}" for n in names)]
    )
    for i, step in enumerate(monitor.steps):
        grads, changes = hand[step]
        assert monitor.history["grad_norm"][i] == pytest.approx(_norm(list(grads.values()), p), rel=1e-5)
        assert monitor.history["update_norm"][i] == pytest.approx(_norm(list(changes.values()), p), rel=1e-5)
        for n in names:
            assert monitor.history[f"grad_norm/{n}"][i] == pytest.approx(
                torch.linalg.vector_norm(grads[n], p).item(), rel=1e-5
            )
            assert monitor.history[f"update_norm/{n}"][i] == pytest.approx(
                torch.linalg.vector_norm(changes[n], p).item(), rel=1e-5
            )


def test_optimizer_monitor_totals_only_and_grad_norm_before_clipping():
    model = fitkit.Model(nn.Linear(1, 1, bias=False), device="cpu")
    nn.init.ones_(model.module.weight)
    model.compile(optimizer=lambda q: torch.optim.SGD(q, lr=0.25), loss="mse", clip_grad_norm=0.5)
    monitor = OptimizerMonitor(log_every_n_steps=1, per_parameter=False)
    model.fit(torch.ones(2, 1), torch.zeros(2, 1), batch_size=1, shuffle=False, callbacks=[monitor], verbose=0)
    # w = 1: grad 2 (logged before clipping), clipped to 0.5, update 0.125; w = 0.875: grad 1.75, update 0.125
    # (clip_grad_norm_ scales by 0.5 / (norm + 1e-6): float32 rounding within 1e-6)
    assert sorted(monitor.history) == ["grad_norm", "update_norm"]
    assert monitor.history["grad_norm"] == pytest.approx([2.0, 1.75], rel=1e-6)
    assert monitor.history["update_norm"] == pytest.approx([0.125, 0.125], rel=1e-6)
    assert monitor.steps == [1, 2]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"log_every_n_steps": 0}, ValueError, r"Expected `log_every_n_steps` >= 1\. Received: log_every_n_steps=0\."),
        ({"log_every_n_steps": 2.0}, TypeError, r"Expected `log_every_n_steps` to be an int\. Received"),
        ({"norm_type": 0}, ValueError, r"Expected `norm_type` to be a positive number\. Received: norm_type=0\."),
        ({"per_parameter": 1}, TypeError, r"Expected `per_parameter` to be a bool\. Received: per_parameter=1\."),
    ],
)
def test_optimizer_monitor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        OptimizerMonitor(**kwargs)


# -- LearningRateMonitor ---------------------------------------------------------------------
def _groups(module):
    return [{"params": module[0].parameters(), "name": "body"}, {"params": module[2].parameters(), "lr": 0.01}]


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
            {"momentum": 0.9, "weight_decay": 0.01},
        ),
        (lambda m: torch.optim.RMSprop(m.parameters(), momentum=0.5), {"momentum": 0.5, "weight_decay": 0.0}),
        (
            lambda m: torch.optim.Adam(m.parameters(), betas=(0.8, 0.9)),
            {"momentum": 0.8, "beta2": 0.9, "weight_decay": 0.0},
        ),
        (
            lambda m: torch.optim.AdamW(_groups(m), betas=(0.85, 0.95)),  # named group 0, lr differs in group 1
            {
                "momentum": 0.85,
                "momentum/body": 0.85,
                "beta2": 0.95,
                "beta2/body": 0.95,
                "weight_decay": 0.01,
                "weight_decay/body": 0.01,
            },
        ),
        (
            lambda m: torch.optim.SGD(
                [{"params": m[0].parameters(), "momentum": 0.5}, {"params": m[2].parameters()}], lr=0.1, momentum=0.9
            ),
            {"momentum": 0.5, "momentum/pg1": 0.9, "weight_decay": 0.0},
        ),
    ],
)
def test_learning_rate_monitor_logs_the_groups_hyper_parameters(make, expected):
    model = fitkit.Model(_module(), device="cpu")
    model.compile(optimizer=lambda _: make(model.module), loss="mse")
    x, y = _data()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=2, callbacks=[LearningRateMonitor(log_weight_decay=True)], verbose=0
    )
    logged = {k: v for k, v in history.history.items() if k.split("/")[0] in ("momentum", "beta2", "weight_decay")}
    assert logged == {k: [v, v] for k, v in expected.items()}


def test_learning_rate_monitor_logs_the_momentum_of_the_epochs_last_step():
    """OneCycleLR cycles momentum per step: the epoch logs the momentum its last step used, as learning_rate."""

    def sched(o):
        return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=6)

    model = fitkit.Model(_module(), device="cpu")
    model.compile(optimizer=_optimizer, loss="mse", scheduler=sched, scheduler_interval="step")
    x, y = _data()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, callbacks=[LearningRateMonitor()], verbose=0)
    hand_opt = _optimizer(_module().parameters())
    hand_sched, used = sched(hand_opt), []
    for _ in range(6):  # 3 steps an epoch; the scheduler moves after each
        used.append((hand_opt.param_groups[0]["lr"], hand_opt.param_groups[0]["momentum"]))
        hand_opt.step()
        hand_sched.step()
    assert history.history["learning_rate"] == [used[2][0], used[5][0]]
    assert history.history["momentum"] == [used[2][1], used[5][1]]
    assert used[2][1] != used[5][1]  # the momentum did move
    assert "weight_decay" not in history.history


def test_learning_rate_monitor_warns_for_an_optimizer_without_momentum():
    model = fitkit.Model(_module(), device="cpu")
    model.compile(optimizer="adagrad", loss="mse")
    x, y = _data()
    with pytest.warns(FitkitWarning, match="Adagrad has no momentum; it is not logged"):
        history = model.fit(x, y, batch_size=BATCH, callbacks=[LearningRateMonitor()], verbose=0)
    assert "momentum" not in history.history and "beta2" not in history.history


def test_learning_rate_monitor_errors():
    with pytest.raises(TypeError, match=r"Expected `log_momentum` to be a bool\. Received: log_momentum='yes'\."):
        LearningRateMonitor(log_momentum="yes")
