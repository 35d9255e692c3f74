"""Gradient accumulation: sample-exact groups, partial last group, nothing leaks across epochs."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import Callback


class Bias(nn.Module):
    """y_pred = b for every sample: the MSE gradient is 2 * mean(b - y), computable by hand."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x * 0 + self.b


class GradRecorder(Callback):
    def __init__(self):
        super().__init__()
        self.grads, self.batches = [], []

    def on_backward_end(self, batch):
        self.grads.append(self.model.module.b.grad.item())
        self.batches.append(batch)


def _fit_bias(x, y, k, batch_size=1, epochs=2, **fit_kwargs):
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="mse", gradient_accumulation_steps=k)
    rec = GradRecorder()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=[rec], **fit_kwargs)
    return model, rec


def test_issue_scenario_exact_gradients():
    # y = 1..5, batch 1, k = 2: groups (1, 2), (3, 4), (5); grad = 2 * mean(0 - y) over the group.
    y = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    _, rec = _fit_bias(torch.zeros(5), y, k=2)
    assert rec.grads == [-3.0, -7.0, -10.0, -3.0, -7.0, -10.0]
    assert rec.batches == [1, 3, 4, 1, 3, 4]  # fired once per optimizer step, on its last micro-batch


def test_uneven_micro_batches_are_weighted_by_size():
    # batch 2, k = 2 over 5 samples: group 1 = [1, 2] + [3, 4] -> -5; group 2 = [5] -> -10.
    y = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    _, rec = _fit_bias(torch.zeros(5), y, k=2, batch_size=2, epochs=1)
    assert rec.grads == [-5.0, -10.0]


def test_sample_weights_inside_a_group_are_exact():
    # weights [1, 3] on y [1, 2]: grad = 2 * (1*(0-1) + 3*(0-2)) / 4 = -3.5
    y = torch.tensor([1.0, 2.0])
    _, rec = _fit_bias(torch.zeros(2), y, k=2, epochs=1, sample_weight=torch.tensor([1.0, 3.0]))
    assert rec.grads == [-3.5]


def test_dataloader_input_and_step_count():
    y = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    loader = DataLoader(TensorDataset(torch.zeros(5), y), batch_size=1)
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
        loss="mse",
        gradient_accumulation_steps=2,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
        scheduler_interval="step",
    )
    rec = GradRecorder()
    model.fit(loader, epochs=2, verbose=0, callbacks=[rec])
    assert rec.grads == [-3.0, -7.0, -10.0, -3.0, -7.0, -10.0]
    assert model.scheduler.last_epoch == 6  # one scheduler step per optimizer step


def test_accumulated_step_equals_one_big_batch():
    torch.manual_seed(0)
    x, y = torch.randn(12, 3), torch.randn(12, 1)
    net = nn.Linear(3, 1)
    a, b = fitkit.Model(net, device="cpu"), fitkit.Model(__import__("copy").deepcopy(net), device="cpu")
    a.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse", gradient_accumulation_steps=3)
    b.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
    a.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    b.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    for pa, pb in zip(a.module.parameters(), b.module.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_accumulation_steps(bad):
    model = fitkit.Model(Bias(), device="cpu")
    with pytest.raises((TypeError, ValueError), match="gradient_accumulation_steps"):
        model.compile(loss="mse", gradient_accumulation_steps=bad)
    assert model.optimizer is None  # a failed compile changes nothing
