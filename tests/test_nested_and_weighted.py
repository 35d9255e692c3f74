"""Regression tests: token losses with sample weights, steps and flags of nested calls, the
per-group learning rates of a warmup, and find_lr's stepper record."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import Bias
from torch import nn

import fitkit
from fitkit.callbacks import Callback, LambdaCallback


class FixedLogits(nn.Module):
    """Returns the stored logits of row ``x[:, 0]`` (one trainable scalar so fit can run)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits
        self.p = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.logits[x[:, 0].long()] + 0 * self.p


def test_a_sample_weight_weighs_each_of_its_real_tokens():
    class0 = torch.tensor([5.0, 0.0, 0.0])
    logits = torch.stack([class0.expand(4, 3), class0.expand(4, 3)])  # (B, T, C), always class 0
    targets = torch.tensor([[0, 0, -100, -100], [1, 1, 1, -100]])
    model = fitkit.Model(FixedLogits(logits), device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy")
    right, wrong = math.log(1 + 2 * math.exp(-5)), math.log(math.exp(5) + 2)  # CE of class 0 / 1
    idx = torch.tensor([[0.0], [1.0]])
    weighted = model.evaluate(idx, targets, sample_weight=torch.tensor([1.0, 3.0]), verbose=0)["loss"]
    # Row 0 has 2 real tokens of weight 1, row 1 has 3 of weight 3: sum(w * l) / sum(w) over tokens.
    assert weighted == pytest.approx((2 * 1 * right + 3 * 3 * wrong) / (2 * 1 + 3 * 3), rel=1e-6)
    # A weight of one for every sample is the unweighted mean over the real tokens.
    ones = model.evaluate(idx, targets, sample_weight=torch.ones(2), verbose=0)["loss"]
    assert ones == pytest.approx(model.evaluate(idx, targets, verbose=0)["loss"], rel=1e-12)
    assert ones == pytest.approx((2 * right + 3 * wrong) / 5, rel=1e-6)


def _accumulating():
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss="mse", gradient_accumulation_steps=2)
    return model


Y = torch.tensor([[1.0], [1.0], [3.0], [3.0]])


def test_train_on_batch_in_a_callback_is_a_step_of_its_own_inside_an_accumulation_window():
    model, seen = _accumulating(), []
    nested = LambdaCallback(
        on_train_batch_begin=lambda b, logs: b == 0 and model.train_on_batch(torch.zeros(1, 1), torch.zeros(1, 1)),
        on_train_batch_end=lambda b, logs: seen.append((b, model.module.b.item(), model.global_step)),
    )
    model.fit(torch.zeros(4, 1), Y, batch_size=1, shuffle=False, verbose=0, callbacks=[nested])
    # The nested step has a zero gradient (b = 0 = y). The fit's windows: gradient -2 -> b = 1,
    # then 2 * (1 - 3) = -4 -> b = 3. Two fit steps and the nested one.
    assert seen == [(0, 0.0, 1), (1, 1.0, 2), (2, 1.0, 2), (3, 3.0, 3)]


def test_train_on_batch_between_two_micro_batches_leaves_the_window_and_the_epoch_exact():
    model = _accumulating()
    nested = LambdaCallback(
        on_train_batch_end=lambda b, logs: b == 0 and model.train_on_batch(torch.zeros(1, 1), torch.zeros(1, 1))
    )
    h = model.fit(torch.zeros(4, 1), Y, batch_size=1, shuffle=False, verbose=0, callbacks=[nested])
    assert h.history["loss"] == [2.5]  # (1 + 1 + 4 + 4) / 4 with b = 0, then 1
    assert model.module.b.item() == 3.0 and model.global_step == 3


def test_a_nested_evaluates_stop_flag_does_not_cut_the_fits_validation():
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="mse", metrics=["mae"])

    class Stopper(Callback):
        def on_test_batch_end(self, batch, logs=None):
            self.model.stop_evaluating = True

    seen = []

    def during_validation(batch, logs):
        seen.append(batch)
        if batch == 0:
            model.evaluate(torch.zeros(4, 1), torch.zeros(4, 1), batch_size=1, verbose=0, callbacks=[Stopper()])

    h = model.fit(torch.zeros(4, 1), Y, batch_size=1, shuffle=False, verbose=0,
                  validation_data=(torch.zeros(4, 1), torch.tensor([[2.0], [2.0], [4.0], [4.0]])),
                  callbacks=[LambdaCallback(on_test_batch_end=during_validation)])  # fmt: skip
    assert seen == [0, 1, 2, 3] and h.history["val_loss"] == [10.0]


def test_a_warmup_from_the_same_start_still_logs_every_group():
    lin = nn.Linear(1, 1)
    model = fitkit.Model(lin, device="cpu")
    model.compile(
        optimizer=torch.optim.SGD([{"params": [lin.weight], "lr": 0.1}, {"params": [lin.bias], "lr": 0.01}]),
        loss="mse",
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: min(1.0, step / 2)),
        scheduler_interval="step",
    )
    h = model.fit(torch.zeros(4, 1), torch.zeros(4, 1), epochs=3, batch_size=2, verbose=0)
    assert h.history["learning_rate"] == [0.05, 0.1, 0.1]
    assert h.history["learning_rate/pg1"] == [0.005, 0.01, 0.01]


def test_find_lr_restores_the_last_steps_gradient_norm():
    torch.manual_seed(0)
    x, y = torch.randn(16, 2), torch.randn(16, 1)
    model = fitkit.Model(nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="adam", loss="mse", clip_grad_norm=1.0)
    model.fit(x, y, epochs=1, batch_size=4, verbose=0)
    before = model.grad_norm.clone()
    model.find_lr(x, y, batch_size=4, num_steps=10)
    assert torch.equal(model.grad_norm, before)
