"""Every built-in loss by name with each target kind it takes, on in-memory data and on a
DataLoader, run the same way on one process and under torchrun (batches of 8 over all ranks,
37 rows: the last global batch has 5), and the collectives each training step runs, counted by
torch's profiler (every ``c10d::`` op: fitkit's, DDP's, and a hook's). Under FSDP (``fsdp=``
options: a two-layer module whose first layer is a unit of its own, the root holding the
second) against a hand-written FSDP2 loop.
"""

from __future__ import annotations

import collections
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


#: ``loss="class_weights"``: torch's cross-entropy with these class weights (and ``ignore_index=-100``)
CLASS_WEIGHTS = torch.tensor([1.0, 3.0, 0.5, 2.0])
#: FSDP cases: ``name -> (loss, kind, source, options)``; options: ``accumulate`` (micro-batches
#: per step), ``float64`` (the module and the data in float64: FSDP would divide before and after
#: the sum), ``bf16`` (``FSDP(mixed_precision=torch.bfloat16)``, reductions in float32; both
#: layers are units then, the root holds none).
FSDP_CASES = {
    "ignored": ("cross_entropy", "ignored", "tensors", {}),
    "class_weights": ("class_weights", "ignored", "tensors", {}),
    "sample_weights": ("mse", "weighted", "tensors", {}),
    "loader": ("cross_entropy", "index", "loader", {}),
    "mse": ("mse", "regression", "tensors", {}),
    "accumulate": ("cross_entropy", "ignored", "tensors", {"accumulate": 2}),
    "float64": ("cross_entropy", "ignored", "tensors", {"float64": True}),
    "bf16": ("cross_entropy", "ignored", "loader", {"bf16": True}),
}


def first_layer(m: nn.Module) -> bool:
    """The FSDP cases' wrap policy: the first layer is a unit; the root holds the second."""
    return isinstance(m, nn.Linear) and m.in_features == 3


def _module(loss: str, kind: str, deep: bool = False) -> nn.Module:
    g = torch.Generator().manual_seed(7)
    out = C if kind in ("index", "ignored", "probabilities", "tokens") else 1
    layers: list[nn.Module] = [nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, out)] if deep else [nn.Linear(3, out)]
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
        self.names: list[collections.Counter] = []  # each step's collectives by name
        self._prof = None

    def _start(self):
        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.start()

    def on_train_begin(self, logs=None):
        self._start()

    def on_train_batch_end(self, batch, logs=None):
        self._prof.stop()
        self.names.append(_collectives(self._prof))
        self.per_step.append(sum(self.names[-1].values()))
        self._start()

    def on_train_end(self, logs=None):
        self._prof.stop()


def _collectives(prof) -> collections.Counter:
    """The ``c10d::`` ops a profile recorded, by name (``c10d::`` cut off)."""
    return collections.Counter(e.name[6:] for e in prof.events() if e.name.startswith("c10d::"))


def _full(module: nn.Module) -> dict:
    """Every parameter's full value (FSDP's shards gathered: a collective per parameter)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in module.named_parameters()
    }


def run_case(loss: str, kind: str, source: str, count: bool = False, fsdp: dict | None = None) -> dict:
    """One epoch of SGD; returns the parameters before and after, the epoch's loss and
    (``count``) the collectives of each step. ``fsdp``: :data:`FSDP_CASES` options: the
    two-layer module, ``strategy=FSDP(wrap=first_layer, ...)`` (plain training on one process)."""
    data = _data(kind)
    module = _module(loss, kind, deep=fsdp is not None)
    if fsdp is not None and fsdp.get("float64"):
        module.double()
        data = tuple(t.double() if t.is_floating_point() else t for t in data)
    init = {k: v.detach().clone() for k, v in module.named_parameters()}
    strategy, accumulate = "auto", 1
    if fsdp is not None:
        bf16 = fsdp.get("bf16", False)
        strategy = fitkit.distributed.FSDP(
            wrap=nn.Linear if bf16 else first_layer, mixed_precision=torch.bfloat16 if bf16 else None
        )
        accumulate = fsdp.get("accumulate", 1)
    model = fitkit.Model(module, device="cpu", strategy=strategy)
    loss_fn = nn.CrossEntropyLoss(weight=CLASS_WEIGHTS) if loss == "class_weights" else loss
    model.compile(
        optimizer=functools.partial(torch.optim.SGD, lr=0.1), loss=loss_fn, gradient_accumulation_steps=accumulate
    )
    batch_size = GLOBAL_BATCH // world_size()
    counter = CollectivesPerStep()
    callbacks = [counter] if count else []
    if source == "loader":
        h = model.fit(DataLoader(TensorDataset(*data), batch_size=batch_size), epochs=1, verbose=0, callbacks=callbacks)
    else:
        x, y, *w = data
        h = model.fit(
            x,
            y,
            sample_weight=w[0] if w else None,
            batch_size=batch_size,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
    return {
        "params": _full(module),
        "init": init,
        "loss": h.history["loss"][0],
        "per_step": counter.per_step,
        "names": counter.names,
    }


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
            nn.functional.mse_loss(ddp(x[4 * i : 4 * i + 4]), y[4 * i : 4 * i + 4]).backward()
            opt.step()
        out.append(sum(e.name.startswith("c10d::") for e in prof.events()))
    return out


def hand_fsdp_per_step(steps: int = 5, accumulate: int = 1, bf16: bool = False) -> list[collections.Counter]:
    """The collectives of each micro-batch of a hand-written FSDP2 loop (``fully_shard`` of the
    first layer (``bf16``: of both), then the root; forward, cross-entropy, backward, SGD step at each window's end,
    ``set_requires_gradient_sync(False)`` before the others), by name."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    net = _module("cross_entropy", "index", deep=True)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for unit in (net[0], net[2], net) if bf16 else (net[0], net):
        fully_shard(unit, mp_policy=policy)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = _data("index")
    out = []
    for i in range(steps * accumulate):
        last = (i + 1) % accumulate == 0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            net.set_requires_gradient_sync(last)
            nn.functional.cross_entropy(net(x[4 * i : 4 * i + 4]), y[4 * i : 4 * i + 4]).backward()
            if last:
                opt.step()
                opt.zero_grad()
        out.append(_collectives(prof))
    return out
