"""The loop's invariant 3: the checks before step 1 leave no trace.

The first-batch check (of the training and the validation data) and the sanity validation
(``num_sanity_val_steps``) run the module, the loss and the metrics on real batches; afterwards
the global RNGs (python, numpy, torch), every loader's own generator and sampler, the BatchNorm
statistics, the metric states and a one-shot source are as they found them. Property: for every
check and every kind of validation stream, a seeded run with the check equals the same run
without it, bit for bit (weights, buffers, every logged value).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
import fitkit.training.planning as planning
import fitkit.training.preflight as preflight


class Noisy(nn.Module):
    """Draws from the global RNGs in every mode (torch, numpy, python): a check that leaked a
    draw would shift every later one."""

    def forward(self, x):
        scale = 1.0 + 0.01 * (np.random.rand() + random.random())
        return x * scale + 0.01 * torch.randn_like(x)


def _net() -> nn.Module:
    g = torch.Generator().manual_seed(7)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), Noisy(), nn.Dropout(0.25), nn.Linear(4, 1))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return net


class Cycling:
    """A Keras-``Sequence``-style iterator: ``__iter__`` returns itself, ``__len__`` bounds a pass."""

    def __init__(self, batches):
        self.batches, self.i = batches, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        return batch


def _validation(kind: str, vx: torch.Tensor, vy: torch.Tensor):
    batches = [(vx[i : i + 4], vy[i : i + 4]) for i in range(0, len(vx), 4)]
    if kind == "tensors":
        return vx, vy
    if kind == "DataLoader":
        return DataLoader(TensorDataset(vx, vy), batch_size=4)
    if kind == "DataLoader(shuffle, generator)":
        return DataLoader(TensorDataset(vx, vy), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    if kind == "generator":  # one-shot: a check that consumed a batch would leave validation without it
        return (b for b in batches)
    assert kind == "cycling iterator with len"
    return Cycling(batches)


def _run(check: str, on: bool, kind: str, monkeypatch: pytest.MonkeyPatch):
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 3, generator=data), torch.randn(24, 1, generator=data)
    vx, vy = torch.randn(12, 3, generator=data), torch.randn(12, 1, generator=data)
    if check == "first batch" and not on:
        for module in (preflight, planning):
            monkeypatch.setattr(module, "first_batch_check", lambda model, batch, *a, **k: batch[0])
    net = _net()
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.05), loss="mse", metrics=["mae"])
    sanity = 2 if check == "sanity" and on else 0
    epochs = 1 if kind == "generator" else 3  # a generator validates once
    train = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)  # its order draws from the global RNG
    history = model.fit(
        train, epochs=epochs, verbose=0, validation_data=_validation(kind, vx, vy), num_sanity_val_steps=sanity
    )
    monkeypatch.undo()
    return {k: v.clone() for k, v in net.state_dict().items()}, history.history


KINDS = ["tensors", "DataLoader", "DataLoader(shuffle, generator)", "generator", "cycling iterator with len"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("check", ["first batch", "sanity"])
def test_a_run_with_the_check_equals_the_run_without_it(check, kind, monkeypatch):
    with_state, with_logs = _run(check, True, kind, monkeypatch)
    without_state, without_logs = _run(check, False, kind, monkeypatch)
    assert with_state.keys() == without_state.keys()
    for name, value in without_state.items():
        assert torch.equal(with_state[name], value), name  # weights and BatchNorm statistics, bit for bit
    assert with_logs == without_logs  # loss, val_loss, val_mae of every epoch
    assert set(with_logs) >= {"loss", "val_loss", "val_mae"}


def test_sanity_validation_leaves_a_shuffling_loaders_generator_where_it_was():
    """The issue's example: the sanity check advanced a validation DataLoader's own generator."""
    loader = DataLoader(
        TensorDataset(torch.randn(8, 3), torch.randn(8, 1)),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
    )
    before = loader.generator.get_state()
    model = fitkit.Model(nn.Linear(3, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    global_before = torch.get_rng_state()
    from fitkit.training.quick import sanity_check

    sanity_check(model, planning.validation_loaders(model, loader, None), 2)
    assert torch.equal(loader.generator.get_state(), before)
    assert torch.equal(torch.get_rng_state(), global_before)


def test_sanity_validation_tees_a_one_shot_source():
    """A generator's first batches are checked and validated again: nothing is consumed."""
    seen: list[int] = []

    def source():
        for i in range(3):
            seen.append(i)
            yield torch.full((2, 1), float(i)), torch.zeros(2, 1)

    model = fitkit.Model(nn.Linear(1, 1, bias=False), device="cpu")
    with torch.no_grad():
        model.module.weight.fill_(1.0)
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="mse")
    history = model.fit(
        [(torch.zeros(2, 1), torch.zeros(2, 1))], epochs=1, verbose=0, validation_data=source(), num_sanity_val_steps=2
    )
    assert seen == [0, 1, 2]  # each batch drawn once
    assert history.history["val_loss"] == [(0.0 + 1.0 + 4.0) / 3]  # all three batches validated


def test_sanity_all_of_a_one_shot_source_without_len_is_refused_before_step_1():
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    before = [p.detach().clone() for p in model.module.parameters()]
    batches = ((torch.zeros(2, 1), torch.zeros(2, 1)) for _ in range(3))
    with pytest.raises(
        ValueError,
        match=r"Expected `num_sanity_val_steps` >= 1 for `validation_data` \(generator\)"
        r".*Received: num_sanity_val_steps=-1\. Fix: pass num_sanity_val_steps=N",
    ):
        model.fit([(torch.zeros(2, 1), torch.zeros(2, 1))], validation_data=batches, num_sanity_val_steps=-1, verbose=0)
    assert model.global_step == 0
    assert all(torch.equal(p, b) for p, b in zip(model.module.parameters(), before, strict=True))
