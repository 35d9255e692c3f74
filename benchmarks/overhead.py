"""fitkit's overhead against plain hand-written loops, measured side by side in one run.

A tiny MLP makes the step overhead-bound (the model itself costs ~100 us a step on a CPU), so
anything fitkit adds per step shows. Each contender trains the same module from the same
initial weights on the same data; the repeats alternate between contenders, and the medians
are compared:

- ``fit(tensors)`` vs a plain loop with one ``randperm`` per epoch and index slicing;
- ``fit(DataLoader)`` vs a plain loop over the same ``DataLoader``;
- ``fit(verbose=1)`` (rich bar, throttled) vs ``fit(verbose=0)``;
- Lightning, Keras (torch backend, run with ``KERAS_BACKEND=torch``) and Poutyne on the same
  work, if installed.

Run: ``python benchmarks/overhead.py [--repeats 7] [--epochs 3] [--clock cpu]``. Prints a table of
the ratios. ``--clock cpu`` times this process's CPU time instead of the wall clock: on a machine
shared with other jobs, the time spent waiting for a core is then left out.
"""

from __future__ import annotations

import argparse
import copy
import io
import os
import statistics
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import ProgressBar


def make_data(n: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    y = x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def make_net(features: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, 1))


def plain_slicing(net, x, y, epochs, bs) -> float:
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    n = len(x)
    for _ in range(epochs):
        perm = torch.randperm(n)
        total = torch.zeros(())
        for i in range(0, n, bs):
            idx = perm[i : i + bs]
            xb, yb = x[idx], y[idx]
            loss = F.mse_loss(net(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach() * len(xb)  # the epoch mean a tutorial loop reports
        float(total / n)
    return float(total / n)


def plain_loader(net, loader, epochs) -> float:
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(epochs):
        total, count = torch.zeros(()), 0
        for xb, yb in loader:
            loss = F.mse_loss(net(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach() * len(xb)
            count += len(xb)
        float(total / count)
    return float(total / count)


def fitkit_run(net, data, epochs, bs, verbose=0, y=None) -> float:
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss="mse")
    cbs = []
    if verbose:
        # A terminal-like console writing to memory: the live bar renders as on a real terminal.
        cbs = [ProgressBar(verbose, console=Console(file=io.StringIO(), force_terminal=True, width=120))]
    hist = model.fit(data, y, epochs=epochs, batch_size=bs, verbose=verbose, callbacks=cbs)
    return hist.history["loss"][-1]


def lightning_run(net, x, y, epochs, bs):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, _):
            xb, yb = batch
            return F.mse_loss(self.net(xb), yb)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    loader = DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(Module(), loader)


def poutyne_run(net, x, y, epochs, bs):
    import poutyne

    model = poutyne.Model(net, torch.optim.Adam(net.parameters(), lr=1e-3), "mse")
    model.fit(x, y, epochs=epochs, batch_size=bs, verbose=False)


def keras_run(net, x, y, epochs, bs):
    # Keras 3 on its torch backend, wrapping the same torch module (keras.layers.TorchModuleWrapper).
    import keras

    class Wrapped(keras.Model):
        def __init__(self):
            super().__init__()
            self.net = keras.layers.TorchModuleWrapper(net)

        def call(self, inputs):
            return self.net(inputs)

    model = Wrapped()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    model.fit(x.numpy(), y.numpy(), epochs=epochs, batch_size=bs, verbose=0)


def timed(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time, or this process's CPU time (less sensitive to other jobs)")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)  # overhead-bound work; threads only add noise
    x, y = make_data(args.samples, args.features)
    base = make_net(args.features)
    ep, bs = args.epochs, args.batch_size
    loader = DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True)

    contenders = {
        "plain slicing loop": lambda: plain_slicing(copy.deepcopy(base), x, y, ep, bs),
        "fitkit fit(tensors)": lambda: fitkit_run(copy.deepcopy(base), x, ep, bs, y=y),
        "plain DataLoader loop": lambda: plain_loader(copy.deepcopy(base), loader, ep),
        "fitkit fit(DataLoader)": lambda: fitkit_run(copy.deepcopy(base), loader, ep, bs),
        "fitkit fit(tensors, verbose=1)": lambda: fitkit_run(copy.deepcopy(base), x, ep, bs, verbose=1, y=y),
    }
    try:
        import lightning  # noqa: F401

        contenders["lightning (DataLoader)"] = lambda: lightning_run(copy.deepcopy(base), x, y, ep, bs)
    except ImportError:
        pass

    try:
        import poutyne  # noqa: F401

        contenders["poutyne (tensors)"] = lambda: poutyne_run(copy.deepcopy(base), x, y, ep, bs)
    except ImportError:
        pass
    if os.environ.get("KERAS_BACKEND") == "torch":
        try:
            import keras  # noqa: F401

            contenders["keras (torch backend)"] = lambda: keras_run(copy.deepcopy(base), x, y, ep, bs)
        except ImportError:
            pass

    for fn in contenders.values():  # warm-up: imports, allocator, first-call costs
        fn()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            times[name].append(timed(fn, clock))
    med = {k: statistics.median(v) for k, v in times.items()}
    steps = ep * -(-args.samples // bs)

    table = Table(title=f"Tiny MLP, {args.samples} samples, batch {bs}, {ep} epochs ({steps} steps), "
                        f"median of {args.repeats}, {args.clock} time")  # fmt: skip
    for col in ("run", "median s", "us/step", "ratio", "against"):
        table.add_column(col)
    pairs = {
        "fitkit fit(tensors)": "plain slicing loop",
        "fitkit fit(DataLoader)": "plain DataLoader loop",
        "fitkit fit(tensors, verbose=1)": "fitkit fit(tensors)",
        "lightning (DataLoader)": "plain slicing loop",
        "poutyne (tensors)": "plain slicing loop",
        "keras (torch backend)": "plain slicing loop",
    }
    for name, t in med.items():
        ref = pairs.get(name)
        ratio = f"{t / med[ref]:.3f}" if ref in med else ""
        table.add_row(name, f"{t:.3f}", f"{t / steps * 1e6:.1f}", ratio, ref or "")
    Console().print(table)


if __name__ == "__main__":
    main()
