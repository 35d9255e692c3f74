"""Every built-in loss by name with each target kind it takes, on in-memory data and on a
DataLoader, run the same way on one process and under torchrun (batches of 8 over all ranks,
37 rows: the last global batch has 5), and the collectives each training step runs, counted by
torch's profiler (every ``c10d::`` op: fitkit's, DDP's, and a hook's).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.distributed import world_size

REGRESSION = ("mse", "mean_squared_error", "mae", "mean_absolute_error", "l1", "huber", "smooth_l1")
#: ``(loss name, target kind)``: regression and binary targets are floats ``(B, 1)``; class-index
#: targets are ``(B,)`` labels (``index``), labels with two ``-100`` (``ignored``), one-hot
#: probabilities (``probabilities``) or ``(B, T)`` labels of ``(B, T, C)`` logits (``tokens``, one ignored).
CASES = (
    [(name, "regression") for name in REGRESSION]
    + [("cross_entropy", k) for k in ("index", "ignored", "probabilities", "tokens")]
    + [("nll", k) for k in ("index", "ignored", "tokens")]
    + [("bce_with_logits", "binary"), ("bce", "binary"), ("mse", "weighted")]
)
SOURCES = ("tensors", "loader")
N, GLOBAL_BATCH, C, T = 37, 8, 4, 3


def _data(kind: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, T, 3, generator=g) if kind == "tokens" else torch.randn(N, 3, generator=g)
    if kind in ("regression", "weighted"):
        y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
    elif kind == "binary":
        y = (x[:, :1] > 0).float()
    elif kind == "tokens":
        y = torch.randint(0, C, (N, T), generator=g)
        y[3, 1] = -100
    else:
        y = torch.randint(0, C, (N,), generator=g)
        if kind == "ignored":
            y[[5, 36]] = -100  # one in the first global batch, one in the short last one
        elif kind == "probabilities":
            y = nn.functional.one_hot(y, C).float()
    return (x, y, torch.rand(N, generator=g) + 0.5) if kind == "weighted" else (x, y)


def _module(loss: str, kind: str) -> nn.Module:
    g = torch.Generator().manual_seed(7)
    out = C if kind in ("index", "ignored", "probabilities", "tokens") else 1
    layers: list[nn.Module] = [nn.Linear(3, out)]
    if loss == "nll":
        layers.append(nn.LogSoftmax(-1))
    elif loss == "bce":
        layers.append(nn.Sigmoid())
    module = nn.Sequential(*layers)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


class CollectivesPerStep(fitkit.callbacks.Callback):
    """The ``c10d::`` ops from one training batch's end to the next one's (the next batch's
    loading and its window's set-up included; the first: from the start of training)."""

    def __init__(self):
        super().__init__()
        self.per_step: list[int] = []
        self._prof = None

    def _start(self):
        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.start()

    def on_train_begin(self, logs=None):
        self._start()

    def on_train_batch_end(self, batch, logs=None):
        self._prof.stop()
        self.per_step.append(sum(e.name.startswith("c10d::") for e in self._prof.events()))
        self._start()

    def on_train_end(self, logs=None):
        self._prof.stop()


def run_case(loss: str, kind: str, source: str, count: bool = False) -> dict:
    """One epoch of SGD; returns the parameters before and after, the epoch's loss and
    (``count``) the collectives of each step."""
    data = _data(kind)
    module = _module(loss, kind)
    init = {k: v.detach().clone() for k, v in module.named_parameters()}
    model = fitkit.Model(module, device="cpu")
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.1), loss=loss)
    batch_size = GLOBAL_BATCH // world_size()
    counter = CollectivesPerStep()
    callbacks = [counter] if count else []
    if source == "loader":
        h = model.fit(DataLoader(TensorDataset(*data), batch_size=batch_size), epochs=1, verbose=0,
                      callbacks=callbacks)
    else:
        x, y, *w = data
        h = model.fit(x, y, sample_weight=w[0] if w else None, batch_size=batch_size, epochs=1, shuffle=False,
                      verbose=0, callbacks=callbacks)
    params = {k: v.detach().clone() for k, v in module.named_parameters()}
    return {"params": params, "init": init, "loss": h.history["loss"][0], "per_step": counter.per_step}


def hand_ddp_per_step(steps: int = 5) -> list[int]:
    """The collectives of each step of a hand-written DDP loop (forward, MSE, backward, SGD step)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_module("mse", "regression"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = _data("regression")
    out = []
    for i in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x[4 * i:4 * i + 4]), y[4 * i:4 * i + 4]).backward()
            opt.step()
        out.append(sum(e.name.startswith("c10d::") for e in prof.events()))
    return out
