from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

import fitkit


class TimmPlateauLike:
    """timm's PlateauLRScheduler: the protocol, wrapping torch's ReduceLROnPlateau."""

    def __init__(self, optimizer, mode):
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler.ReduceLROnPlateau(optimizer, mode=mode, patience=0)

    def step(self, epoch, metric=None):
        if metric is not None:
            self.lr_scheduler.step(metric)

    def step_update(self, num_updates, metric=None):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _model():
    return fitkit.Model(nn.Linear(1, 1), device="cpu")


@pytest.mark.parametrize(
    "make",
    [
        lambda o: lr_scheduler.ReduceLROnPlateau(o, mode="max", patience=0),
        lambda o: TimmPlateauLike(o, "max"),
    ],
)
def test_a_plateau_scheduler_watching_a_rising_metric_is_refused_before_step_1(make):
    model = _model()
    with pytest.raises(ValueError, match=r"mode='max'\)\) is stepped on val_loss .*Fix: mode='min'"):
        model.compile(optimizer="sgd", loss="mse", scheduler=make)
    assert model.optimizer is None  # nothing compiled
    # Set after compile (or the mode changed): fit refuses before its first step.
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
    model.scheduler = make(model.optimizer)
    before = [p.detach().clone() for p in model.module.parameters()]
    x = torch.randn(8, 1)
    with pytest.raises(ValueError, match="would read every improvement as a plateau"):
        model.fit(x, 2 * x, validation_data=(x, 2 * x), verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))


def test_a_plateau_scheduler_in_min_mode_holds_the_lr_while_val_loss_falls():
    model = _model()
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss="mse",
        scheduler=lambda o: lr_scheduler.ReduceLROnPlateau(o, mode="min", patience=0),
    )
    x = torch.linspace(-1, 1, 16).unsqueeze(1)
    h = model.fit(x, 2 * x, epochs=3, batch_size=4, validation_data=(x, 2 * x), verbose=0)
    assert h.history["val_loss"] == sorted(h.history["val_loss"], reverse=True)
    assert model.optimizer.param_groups[0]["lr"] == 0.1
