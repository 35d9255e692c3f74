from __future__ import annotations

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import EMA, LambdaCallback


class Scale(nn.Module):
    """``w * x``: elementwise, so it stays float32 under fp16 autocast (the GradScaler decides)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.w * x


class TimmLike:
    """timm's scheduler protocol, recording what fitkit calls."""

    def __init__(self):
        self.updates: list[int] = []

    def step(self, epoch, metric=None):
        pass

    def step_update(self, num_updates, metric=None):
        self.updates.append(num_updates)

    def state_dict(self):
        return {"updates": list(self.updates)}

    def load_state_dict(self, state):
        self.updates = list(state["updates"])


def _inf_in_the_middle():
    return [(torch.tensor([[v]]), torch.zeros(1, 1)) for v in (1.0, float("inf"), 1.0)]


def test_a_step_the_grad_scaler_skips_does_not_count(tmp_path):
    net = Scale()
    model = fitkit.Model(net, device="cpu")
    timm = TimmLike()
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse", precision="16-mixed", scheduler=timm)
    seen = []
    ema = EMA(decay=0.9)
    watch = LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append((model.global_step, net.w.item())))
    model.fit(_inf_in_the_middle(), verbose=0, callbacks=[ema, watch])
    # mse on w * 1 with target 0: w -= 0.25 * 2w; the inf batch's step is skipped by the scaler.
    assert seen == [(1, 0.5), (1, 0.5), (2, 0.25)]
    # EMA averages after the two real steps only: 0.9 * (0.9 * 1 + 0.1 * 0.5) + 0.1 * 0.25.
    assert ema.averaged_model.module.w.item() == pytest.approx(0.88)
    assert timm.updates == [1, 2]
    model.save_checkpoint(tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=False)["global_step"] == 2


def test_a_skipped_step_holds_a_per_step_torch_scheduler_back():
    model = fitkit.Model(Scale(), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss="mse", precision="16-mixed",
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5), scheduler_interval="step",
    )  # fmt: skip
    lrs = []
    watch = LambdaCallback(on_train_batch_end=lambda batch, logs: lrs.append(model.optimizer.param_groups[0]["lr"]))
    model.fit(_inf_in_the_middle(), verbose=0, callbacks=[watch])
    assert lrs == [0.5, 0.5, 0.25] and model.global_step == 2
