"""Shared fixtures: a per-test seed, tiny models with fixed weights, the ``requires_cuda`` mark."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import fitkit


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same global RNG state (python, numpy, torch)."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    return 0


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


def fixed_linear(in_features: int, out_features: int, weight: float = 0.0, bias: float = 0.0) -> nn.Linear:
    """A ``Linear`` whose every weight is ``weight`` and every bias ``bias``."""
    layer = nn.Linear(in_features, out_features)
    with torch.no_grad():
        layer.weight.fill_(weight)
        layer.bias.fill_(bias)
    return layer


def fixed_mlp(in_features: int = 3, hidden: int = 8, out_features: int = 1, dropout: float = 0.0) -> nn.Sequential:
    """Linear-ReLU-Dropout-Linear with weights drawn from a private generator (seed 1234)."""
    g = torch.Generator().manual_seed(1234)
    net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, out_features))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return net


def cpu_model(module: nn.Module) -> fitkit.Model:
    return fitkit.Model(module, device="cpu")


def params_of(module: nn.Module) -> list[torch.Tensor]:
    """Detached copies of every parameter and buffer, to compare before / after a call."""
    return [t.detach().clone() for t in (*module.parameters(), *module.buffers())]


def same_params(module: nn.Module, before: list[torch.Tensor]) -> bool:
    now = [t.detach() for t in (*module.parameters(), *module.buffers())]
    return len(now) == len(before) and all(torch.equal(a, b) for a, b in zip(now, before, strict=True))


class Probe(nn.Module):
    """A ``Linear`` that records ``(self.training, torch.is_grad_enabled())`` at every forward."""

    def __init__(self, in_features: int = 2, out_features: int = 2):
        super().__init__()
        self.lin = nn.Linear(in_features, out_features)
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, x):
        self.calls.append((self.training, torch.is_grad_enabled()))
        return self.lin(x)


class Bias(nn.Module):
    """``y_pred = b`` for every sample (one parameter, 0 at start): losses are computable by hand."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return x * 0 + self.b


class NoisyNet(nn.Module):
    """``Linear(1, 1)`` (weights 0) + noise drawn in eval mode too, then BatchNorm and dropout
    (train mode only); ``rows_seen`` counts the rows of every forward, in any mode."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.drop = nn.Linear(1, 1), nn.BatchNorm1d(1), nn.Dropout(0.5)
        self.register_buffer("rows_seen", torch.zeros((), dtype=torch.int64))
        with torch.no_grad():
            self.lin.weight.fill_(0.0)
            self.lin.bias.fill_(0.0)

    def forward(self, x):
        self.rows_seen += x.shape[0]
        return self.drop(self.bn(self.lin(x) + 0.1 * torch.randn_like(x)))


class CountingBackend:
    """A torch.compile backend that runs the captured graph eagerly and counts compilations."""

    def __init__(self):
        self.compiles = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        return gm.forward


def line_data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = 3x + 1`` on ``n`` points of [-1, 1], shape (n, 1)."""
    x = torch.linspace(-1, 1, n).unsqueeze(1)
    return x, 3 * x + 1


def line_model() -> fitkit.Model:
    """A seeded ``Linear(1, 1)`` compiled with SGD (lr 0.05) and MSE."""
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.05), loss="mse")
    return model


class WrappedFile:
    """A file object that forwards everything to ``f``; subclasses override ``write``."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def small_classifier(scheduler=None) -> fitkit.Model:
    """A seeded 4 -> 3 linear classifier (SGD, cross entropy), with an optional scheduler factory."""
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(4, 3), device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy", scheduler=scheduler)
    return model


def class_data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of 4 features and labels in {0, 1, 2}, the same on every call."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
