"""fitkit's overhead against plain hand-written loops, measured side by side in one run.

A tiny MLP makes the step overhead-bound (the model itself costs ~100 us a step on a CPU), so
anything fitkit adds per step shows. Each contender trains the same module from the same
initial weights on the same data; the repeats alternate between contenders, and the medians
are compared:

- ``fit(tensors)`` vs a plain loop with one ``randperm`` per epoch and index slicing;
- ``fit(DataLoader)`` vs a plain loop over the same ``DataLoader``;
- classification: ``loss="cross_entropy"`` (4 classes), with ``metrics=["accuracy"]`` against a
  hand loop that counts its accuracy on the device (argmax, eq, sum), each over tensors and over
  a ``DataLoader``; and ``precision="bf16-mixed"`` against a hand autocast loop;
- the same classification written as a module (``nn.CrossEntropyLoss()``, with and without
  accuracy, over tensors and a ``DataLoader``), with label smoothing
  (``nn.CrossEntropyLoss(label_smoothing=0.1)`` against ``F.cross_entropy(..., label_smoothing=0.1)``),
  ``nn.MSELoss()``, and over a ``DataLoader`` of a map-style dataset that is not a
  ``TensorDataset`` (torchvision's layout: ``data`` and ``targets`` attributes);
- ``fit(verbose=1)`` (rich bar, throttled) vs ``fit(verbose=0)``;
- Lightning, Keras (torch backend, run with ``KERAS_BACKEND=torch``) and Poutyne on the same
  work, if installed.

Run: ``python benchmarks/overhead.py [--repeats 7] [--epochs 3] [--clock cpu] [--only cross]``.
Prints a table of the ratios: of the medians, and the median of the ratios of each repeat's pair
(the two runs of a pair are timed in the same repeat, so a change of load between repeats cancels).
``--clock cpu`` times this process's CPU time instead of the wall clock: on a machine
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
from torch.utils.data import DataLoader, Dataset, TensorDataset

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


def make_classes(x: torch.Tensor) -> torch.Tensor:
    """Four classes: the quadrant of the first two features."""
    return (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()


def make_classifier(features: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, 4))


class Pairs(Dataset):
    """A map-style dataset that is not a ``TensorDataset``: torchvision's ``data`` / ``targets``."""

    def __init__(self, data: torch.Tensor, targets: torch.Tensor):
        self.data, self.targets = data, targets

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i], self.targets[i]


def _hand_step(net, opt, xb, yb, kind, correct):
    """One step of a tutorial loop: ``kind`` is mse, cross_entropy, accuracy (cross-entropy and
    the correct predictions counted on the device), smoothing (cross-entropy with label
    smoothing 0.1) or bf16 (mse under bf16 autocast)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bf16"):
        out = net(xb)
    if kind == "bf16":
        out = out.float()
    if kind in ("mse", "bf16"):
        loss = F.mse_loss(out, yb)
    else:
        loss = F.cross_entropy(out, yb, label_smoothing=0.1 if kind == "smoothing" else 0.0)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if kind == "accuracy":
        correct += (out.detach().argmax(1) == yb).sum()
    return loss


def plain_slicing(net, x, y, epochs, bs, kind="mse") -> float:
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    n = len(x)
    for _ in range(epochs):
        perm = torch.randperm(n)
        total, correct = torch.zeros(()), torch.zeros((), dtype=torch.long)
        for i in range(0, n, bs):
            idx = perm[i : i + bs]
            xb, yb = x[idx], y[idx]
            loss = _hand_step(net, opt, xb, yb, kind, correct)
            total += loss.detach() * len(xb)  # the epoch mean a tutorial loop reports
        float(total / n)
        if kind == "accuracy":
            float(correct / n)
    return float(total / n)


def plain_loader(net, loader, epochs, kind="mse") -> float:
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(epochs):
        total, count, correct = torch.zeros(()), 0, torch.zeros((), dtype=torch.long)
        for xb, yb in loader:
            loss = _hand_step(net, opt, xb, yb, kind, correct)
            total += loss.detach() * len(xb)
            count += len(xb)
        float(total / count)
        if kind == "accuracy":
            float(correct / count)
    return float(total / count)


#: fitkit's compile options for each kind of hand loop.
COMPILE = {
    "mse": {"loss": "mse"},
    "cross_entropy": {"loss": "cross_entropy"},
    "accuracy": {"loss": "cross_entropy", "metrics": ["accuracy"]},
    "bf16": {"loss": "mse", "precision": "bf16-mixed"},
    "module": {"loss": nn.CrossEntropyLoss()},
    "module+accuracy": {"loss": nn.CrossEntropyLoss(), "metrics": ["accuracy"]},
    "smoothing": {"loss": nn.CrossEntropyLoss(label_smoothing=0.1)},
    "mse module": {"loss": nn.MSELoss()},
}
#: The hand loop each module spelling is compared with.
HAND = {"module": "cross_entropy", "module+accuracy": "accuracy", "smoothing": "smoothing", "mse module": "mse"}


def fitkit_run(net, data, epochs, bs, verbose=0, y=None, kind="mse") -> float:
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), **COMPILE[kind])
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
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
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


def _module_rows(contenders, pairs, regression, classification, sizes) -> None:
    """The rows of the losses written as modules (and label smoothing), and of a DataLoader over a
    dataset that is not a ``TensorDataset``, each against its hand loop."""
    x, y, base = regression
    classes, classifier, class_loader = classification
    ep, bs = sizes
    for kind, hand_kind in HAND.items():
        net, target = (base, y) if kind == "mse module" else (classifier, classes)
        hand, fit = f"plain slicing loop, {hand_kind}", f"fitkit fit(tensors), {kind}"
        hand = "plain slicing loop" if hand_kind == "mse" else hand
        if hand_kind == "smoothing":
            contenders[hand] = lambda m=net, t=target: plain_slicing(copy.deepcopy(m), x, t, ep, bs, kind="smoothing")
        contenders[fit] = lambda k=kind, m=net, t=target: fitkit_run(copy.deepcopy(m), x, ep, bs, y=t, kind=k)
        pairs[fit] = hand
    hand, fit = "plain DataLoader loop, cross_entropy", "fitkit fit(DataLoader), module"
    contenders[fit] = lambda: fitkit_run(copy.deepcopy(classifier), class_loader, ep, bs, kind="module")
    pairs[fit] = hand
    pairs_loader = DataLoader(Pairs(x, classes), batch_size=bs, shuffle=True)
    hand, fit = "plain loop, Pairs DataLoader", "fitkit fit(Pairs DataLoader), module"
    contenders[hand] = lambda: plain_loader(copy.deepcopy(classifier), pairs_loader, ep, kind="cross_entropy")
    contenders[fit] = lambda: fitkit_run(copy.deepcopy(classifier), pairs_loader, ep, bs, kind="module")
    pairs[fit] = hand


def timed(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def main() -> None:  # noqa: C901  (one flat script: its options, its rows, its table)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or this process's CPU time (less sensitive to other jobs)",
    )
    parser.add_argument("--only", default="", help="run only the rows whose name contains this")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)  # overhead-bound work; threads only add noise
    x, y = make_data(args.samples, args.features)
    base = make_net(args.features)
    ep, bs = args.epochs, args.batch_size
    loader = DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True)
    classes, classifier = make_classes(x), make_classifier(args.features)
    class_loader = DataLoader(TensorDataset(x, classes), batch_size=bs, shuffle=True)

    contenders = {
        "plain slicing loop": lambda: plain_slicing(copy.deepcopy(base), x, y, ep, bs),
        "fitkit fit(tensors)": lambda: fitkit_run(copy.deepcopy(base), x, ep, bs, y=y),
        "plain DataLoader loop": lambda: plain_loader(copy.deepcopy(base), loader, ep),
        "fitkit fit(DataLoader)": lambda: fitkit_run(copy.deepcopy(base), loader, ep, bs),
        "fitkit fit(tensors, verbose=1)": lambda: fitkit_run(copy.deepcopy(base), x, ep, bs, verbose=1, y=y),
    }
    pairs = {
        "fitkit fit(tensors)": "plain slicing loop",
        "fitkit fit(DataLoader)": "plain DataLoader loop",
        "fitkit fit(tensors, verbose=1)": "fitkit fit(tensors)",
        "lightning (DataLoader)": "plain slicing loop",
        "poutyne (tensors)": "plain slicing loop",
        "keras (torch backend)": "plain slicing loop",
    }
    _module_rows(contenders, pairs, (x, y, base), (classes, classifier, class_loader), (ep, bs))
    for kind in ("cross_entropy", "accuracy", "bf16"):
        net, target = (base, y) if kind == "bf16" else (classifier, classes)
        hand, fit = f"plain slicing loop, {kind}", f"fitkit fit(tensors), {kind}"
        contenders[hand] = lambda k=kind, m=net, t=target: plain_slicing(copy.deepcopy(m), x, t, ep, bs, kind=k)
        contenders[fit] = lambda k=kind, m=net, t=target: fitkit_run(copy.deepcopy(m), x, ep, bs, y=t, kind=k)
        pairs[fit] = hand
        if kind != "bf16":
            hand, fit = f"plain DataLoader loop, {kind}", f"fitkit fit(DataLoader), {kind}"
            contenders[hand] = lambda k=kind: plain_loader(copy.deepcopy(classifier), class_loader, ep, kind=k)
            contenders[fit] = lambda k=kind: fitkit_run(copy.deepcopy(classifier), class_loader, ep, bs, kind=k)
            pairs[fit] = hand
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

    if args.only:  # the rows asked for, and the rows they are compared with
        keep = {k for k in contenders if args.only in k}
        keep |= {pairs[k] for k in keep if k in pairs}
        contenders = {k: v for k, v in contenders.items() if k in keep}
    for fn in contenders.values():  # warm-up: imports, allocator, first-call costs
        fn()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            times[name].append(timed(fn, clock))
    med = {k: statistics.median(v) for k, v in times.items()}
    steps = ep * -(-args.samples // bs)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    table = Table(
        title=f"Tiny MLP, {args.samples} samples, batch {bs}, {ep} epochs ({steps} steps), "
        f"median of {args.repeats}, {args.clock} time, load {load:.2f}"
    )
    for col in ("run", "median s", "us/step", "ratio", "paired ratio", "against"):
        table.add_column(col)
    for name, t in med.items():
        ref = pairs.get(name)
        ratio = f"{t / med[ref]:.3f}" if ref in med else ""
        paired = (
            f"{statistics.median(a / b for a, b in zip(times[name], times[ref], strict=True)):.3f}"
            if ref in med
            else ""
        )
        table.add_row(name, f"{t:.3f}", f"{t / steps * 1e6:.1f}", ratio, paired, ref or "")
    Console().print(table)


if __name__ == "__main__":
    main()
