"""find_batch_size: the sizes tried against a fake out-of-memory limit, and everything put back."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.tools.batch_size_finder import find_batch_size, is_out_of_memory


class Limited(nn.Module):
    """Raises an out-of-memory error for a batch above ``limit`` samples, as a full GPU would."""

    def __init__(self, limit: int, message: str | None = None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.3), nn.Linear(4, 1))
        self.limit, self.message, self.sizes = limit, message, []

    def forward(self, x):
        self.sizes.append(len(x))
        if len(x) > self.limit:
            if self.message is None:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
            raise RuntimeError(self.message)
        return self.net(x)


def _model(limit: int, **kwargs) -> tuple[fitkit.Model, Limited]:
    torch.manual_seed(0)
    net = Limited(limit, **kwargs)
    model = fitkit.Model(net, device="cpu")
    model.compile(
        optimizer="adam", loss="mse", scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    )
    return model, net


def _data(n: int = 200):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)


def _state(model: fitkit.Model) -> dict:
    return {
        "module": {k: v.clone() for k, v in model.module.state_dict().items()},
        "optimizer": repr(model.optimizer.state_dict()),
        "opt_tensors": [t.clone() for s in model.optimizer.state.values() for t in s.values()],
        "scheduler": model.scheduler.state_dict(),
        "step": model.global_step,
        "rng": (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()),
    }


def _same(a: dict, b: dict) -> bool:
    return (
        all(torch.equal(a["module"][k], b["module"][k]) for k in a["module"])
        and a["optimizer"] == b["optimizer"]
        and all(torch.equal(s, t) for s, t in zip(a["opt_tensors"], b["opt_tensors"], strict=True))
        and a["scheduler"] == b["scheduler"]
        and a["step"] == b["step"]
        and a["rng"][:2] == b["rng"][:2]
        and torch.equal(a["rng"][2], b["rng"][2])
    )


def test_doubles_until_out_of_memory_and_restores_everything_bitwise():
    x, y = _data()
    model, net = _model(limit=40)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # optimizer and scheduler state to keep
    before = _state(model)
    net.sizes.clear()
    result = find_batch_size(model, x, y, steps_per_trial=2)
    assert result.batch_size == 32
    assert result.trials == [(2, True), (4, True), (8, True), (16, True), (32, True), (64, False)]
    assert net.sizes == [2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64]  # 2 steps per trial; the 64 fails at once
    assert _same(before, _state(model))
    # and the next fit is the fit without the search, bit for bit
    after = model.fit(x, y, batch_size=16, epochs=1, verbose=0).history
    ref, _ = _model(limit=40)  # the same start, without the search
    ref.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert after == ref.fit(x, y, batch_size=16, epochs=1, verbose=0).history
    assert all(torch.equal(a, b) for a, b in zip(model.module.parameters(), ref.module.parameters(), strict=True))


def test_stops_at_the_data_size_max_val_and_max_trials():
    x, y = _data(20)
    model, _ = _model(limit=1000)
    assert find_batch_size(model, x, y).trials == [(2, True), (4, True), (8, True), (16, True), (32, True)]
    assert find_batch_size(model, x, y).batch_size == 20  # one batch holds all 20 samples
    assert find_batch_size(model, x, y, max_val=6).trials == [(2, True), (4, True), (6, True)]
    assert find_batch_size(model, x, y, max_trials=2).batch_size == 4
    assert find_batch_size(model, TensorDataset(x, y), init_val=8).trials == [(8, True), (16, True), (32, True)]


def test_a_cpu_allocator_message_counts_and_other_errors_are_raised():
    x, y = _data(64)
    model, _ = _model(limit=8, message="[enforce fail at alloc_cpu.cpp:114] DefaultCPUAllocator: can't allocate memory")
    assert model.find_batch_size(x, y).batch_size == 8
    model, _ = _model(limit=1)
    assert model.find_batch_size(x, y).trials == [(2, False)]
    assert model.find_batch_size(x, y).batch_size is None
    model, net = _model(limit=8, message="mat1 and mat2 shapes cannot be multiplied")
    before = _state(model)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        model.find_batch_size(x, y)
    assert _same(before, _state(model))  # put back after an error too
    assert not is_out_of_memory(RuntimeError("shapes cannot be multiplied"))


def test_bad_arguments():
    x, y = _data(8)
    model, _ = _model(limit=8)
    with pytest.raises(TypeError, match="loader.dataset"):
        model.find_batch_size(DataLoader(TensorDataset(x, y), batch_size=2))
    with pytest.raises(ValueError, match="init_val"):
        model.find_batch_size(x, y, init_val=0)
    with pytest.raises(ValueError, match="max_val"):
        model.find_batch_size(x, y, init_val=4, max_val=2)
    with pytest.raises(RuntimeError, match="compile"):
        find_batch_size(fitkit.Model(nn.Linear(3, 1), device="cpu"), x, y)
