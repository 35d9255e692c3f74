"""One script for a CUDA machine: GPU tests, zero host syncs per step, predict's memory, step times.

Run from the repository root on a machine with one CUDA GPU (sized to finish in under 10 minutes
on a recent GPU; each part prints its own time and the total)::

    python benchmarks/gpu_check.py              # every part
    python benchmarks/gpu_check.py --no-tests   # skip the pytest part
    python benchmarks/gpu_check.py --only syncs # one part: tests, syncs, predict, mlp or timing
    python benchmarks/gpu_check.py --dry-run    # no GPU: the mlp and timing code on the CPU, tiny sizes
    python benchmarks/gpu_check.py --dry-run --compile  # ... and the torch.compile case (about 1 min)

1. **tests**: the CUDA-marked tests (``pytest -m requires_cuda``).
2. **syncs**: for each configuration (the matrix of ``tests/training/test_host_syncs.py``: callbacks,
   precisions, accumulation, clipping, schedulers, validation, weights, a DataLoader, a user
   torchmetrics object, ``evaluate`` and ``predict``), at least 50 steady-state steps run under
   ``torch.cuda.set_sync_debug_mode("error")``: any host sync in a step raises. Epoch ends and
   log points are outside the checked steps. A table says which configurations passed (a
   configuration with fewer than 50 steps checked fails too).
3. **predict**: a vocabulary-sized output (``(N, 32000)`` logits) through ``predict``: the peak
   device memory against the outputs' size (the device should hold about one batch), and the
   time against a plain loop that copies each batch with ``.cpu()``.
4. **mlp**: the small classifier (64 -> 256 -> 10, batch 128, data on the device) where kernel
   launches are the step time: ``fit`` against a hand loop, cross-entropy and cross-entropy +
   ``metrics=["accuracy"]`` (the hand loop counts its accuracy on the device: argmax, eq, sum)
   in fp32, and cross-entropy + accuracy in bf16-mixed against a hand autocast loop; the loss
   written as a module too (``nn.CrossEntropyLoss()``, and with ``label_smoothing=0.1`` against
   a hand loop passing it to ``F.cross_entropy``); medians of the per-repeat pairs, as ms/step
   and ratios.
5. **timing**: fitkit against a plain loop on the GPT preset and the same batches, in fp32,
   bf16-mixed, 16-mixed (GradScaler, fused AdamW) and bf16-mixed + ``torch.compile``; medians
   of several repeats, printed as a table of ms/step and ratios.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fitkit
from fitkit.callbacks import Callback

PARTS = ("tests", "syncs", "predict", "mlp", "timing")
STEADY = 50  # steps each sync configuration checks at least


# -- 2. host syncs --------------------------------------------------------------------------------


class SyncOn(Callback):
    """First in the list: turns host syncs into errors from the begin of steady batch ``start``."""

    def __init__(self, start: int = 2):
        super().__init__()
        self.start, self.checked = start, 0

    def _on(self, batch: int) -> None:
        if batch >= self.start:
            torch.cuda.set_sync_debug_mode("error")
            self.checked += 1

    def on_train_batch_begin(self, batch, logs=None):
        self._on(batch)

    def on_test_batch_begin(self, batch, logs=None):
        self._on(batch)

    def on_predict_batch_begin(self, batch, logs=None):
        self._on(batch)


class SyncOff(Callback):
    """Last of the user's callbacks: back to normal at each batch end (logging may read after it)."""

    def on_train_batch_end(self, batch, logs=None):
        torch.cuda.set_sync_debug_mode(0)

    def on_test_batch_end(self, batch, logs=None):
        torch.cuda.set_sync_debug_mode(0)

    def on_predict_batch_end(self, batch, logs=None):
        torch.cuda.set_sync_debug_mode(0)


def _sync_configs(tmp: str) -> dict[str, tuple[dict[str, Any], dict[str, Any], list[Any]]]:
    import torchmetrics

    from fitkit import callbacks as cb

    g = torch.Generator().manual_seed(1)
    return {
        "plain": ({}, {}, []),
        "metrics by name": ({"metrics": ["accuracy", "f1", "precision", "recall"]}, {}, []),
        "accuracy": ({"metrics": ["accuracy"]}, {}, []),
        "accuracy + bf16-mixed": ({"metrics": ["accuracy"], "precision": "bf16-mixed"}, {}, []),
        "ignore_index 0 + accuracy": ({"loss": nn.CrossEntropyLoss(ignore_index=0), "metrics": ["accuracy"]}, {}, []),
        "bf16-mixed": ({"precision": "bf16-mixed"}, {}, []),
        "16-mixed (fused adam)": ({"precision": "16-mixed"}, {}, []),
        "accumulation 2": ({"gradient_accumulation_steps": 2}, {}, []),
        "clip_grad_norm": ({"clip_grad_norm": 1.0}, {}, []),
        "clip_grad_value": ({"clip_grad_value": 0.1}, {}, []),
        "step scheduler": (
            {
                "scheduler": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 0.01, total_steps=1000),
                "scheduler_interval": "step",
            },
            {},
            [],
        ),
        "epoch scheduler": ({"scheduler": lambda o: torch.optim.lr_scheduler.StepLR(o, 1)}, {}, []),
        "validation": ({"metrics": ["accuracy"]}, {"validation_split": 0.2}, []),
        "sample weights": ({}, {"sample_weight": torch.rand(4096, generator=g)}, []),
        "class weights": ({}, {"class_weight": {i: 1.0 + i / 10 for i in range(10)}}, []),
        "TerminateOnNaN": ({}, {}, [cb.TerminateOnNaN()]),
        "TerminateOnNaN + 16-mixed": ({"precision": "16-mixed"}, {}, [cb.TerminateOnNaN()]),
        "EarlyStopping": ({}, {}, [cb.EarlyStopping(monitor="loss")]),
        "ModelCheckpoint": ({}, {}, [cb.ModelCheckpoint(f"{tmp}/best.pt", monitor="loss")]),
        "BackupAndRestore": ({}, {}, [cb.BackupAndRestore(f"{tmp}/backup")]),
        "CSVLogger": ({}, {}, [cb.CSVLogger(f"{tmp}/log.csv")]),
        "EMA": ({}, {}, [cb.EMA()]),
        "SWA": ({}, {}, [cb.SWA(swa_lrs=0.01, swa_epoch_start=1)]),
        "user MulticlassF1Score": ({"metrics": {"f1": torchmetrics.classification.MulticlassF1Score(10)}}, {}, []),
        "verbose 1": ({"metrics": ["accuracy"]}, {"verbose": 1}, []),
    }


def _classifier(device: torch.device, **compile_kwargs: Any) -> fitkit.Model:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    model = fitkit.Model(net, device=device)
    compile_kwargs.setdefault("optimizer", "adam")
    compile_kwargs.setdefault("loss", "cross_entropy")
    model.compile(jit_compile=False, **compile_kwargs)
    return model


def check_syncs(device: torch.device) -> list[tuple[str, str, int]]:
    """``(configuration, result, steps checked)`` for every configuration."""
    import tempfile

    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4096, 64, generator=g), torch.randint(0, 10, (4096,), generator=g)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        configs = _sync_configs(tmp)
        configs["DataLoader input"] = ({}, {"loader": True}, [])
        for name, (compile_kwargs, fit_kwargs, callbacks) in configs.items():
            fit_kwargs = dict(fit_kwargs)
            model = _classifier(device, **compile_kwargs)
            on = SyncOn()
            verbose = fit_kwargs.pop("verbose", 0)
            data = (
                (DataLoader(TensorDataset(x, y), batch_size=128, shuffle=True),)
                if fit_kwargs.pop("loader", False)
                else (x, y)
            )
            try:
                model.fit(
                    *data,
                    batch_size=128,
                    epochs=2,
                    verbose=verbose,
                    callbacks=[on, *callbacks, SyncOff()],
                    **fit_kwargs,
                )
                rows.append((name, "0 syncs", on.checked))
            except RuntimeError as e:
                rows.append((name, f"SYNC: {str(e).splitlines()[0][:70]}", on.checked))
            finally:
                torch.cuda.set_sync_debug_mode(0)
        x2, y2 = torch.cat([x, x]), torch.cat([y, y])  # 64 batches: 62 steady ones
        for verb in ("evaluate", "predict"):
            model = _classifier(device, metrics=["accuracy", "f1"])
            on = SyncOn()
            try:
                if verb == "evaluate":
                    model.evaluate(x2, y2, batch_size=128, verbose=0, callbacks=[on, SyncOff()])
                else:
                    model.predict(x2, batch_size=128, verbose=0, callbacks=[on, SyncOff()])
                rows.append((verb, "0 syncs", on.checked))
            except RuntimeError as e:
                rows.append((verb, f"SYNC: {str(e).splitlines()[0][:70]}", on.checked))
            finally:
                torch.cuda.set_sync_debug_mode(0)
    return rows


# -- 3. predict's memory ----------------------------------------------------------------------------


def check_predict(device: torch.device, rows: int = 20_000, vocab: int = 32_000, batch: int = 256) -> dict[str, float]:
    torch.manual_seed(0)
    net = nn.Linear(256, vocab).to(device)
    x = torch.randn(rows, 256)
    model = fitkit.Model(net, device=device)
    model.predict(x[: batch * 2], batch_size=batch, verbose=0)  # warm-up (allocator, pinned pool)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    out = model.predict(x, batch_size=batch, verbose=0)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base
    start = time.perf_counter()
    with torch.no_grad():
        plain = torch.cat([net(x[i : i + batch].to(device)).cpu() for i in range(0, rows, batch)])
    plain_s = time.perf_counter() - start
    exact = torch.equal(out, plain)
    return {
        "outputs_mb": out.numel() * 4 / 2**20,
        "device_peak_mb": peak / 2**20,
        "batch_outputs_mb": batch * vocab * 4 / 2**20,
        "fitkit_s": seconds,
        "plain_s": plain_s,
        "same_values": float(exact),
    }


# -- 4. the small classifier: fit vs a hand loop ---------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def mlp_data(device: torch.device, n: int, features: int = 64, classes: int = 10):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    return x.to(device), x[:, :classes].argmax(1).to(device)


def make_mlp(features: int = 64, classes: int = 10) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 256), nn.ReLU(), nn.Linear(256, classes))


def mlp_hand(net, x, y, batch: int, epochs: int, accuracy: bool, precision: str, loss: Any = "cross_entropy") -> float:
    """The hand loop of ``benchmarks/hot_path.py`` on the device: one randperm per epoch, index
    slicing, the epoch loss (and the correct labels) summed on the device, read once per epoch."""
    device = x.device
    net = net.to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    bf16 = precision == "bf16-mixed"
    smoothing = getattr(loss, "label_smoothing", 0.0)
    _sync(device)
    start = time.perf_counter()
    for _ in range(epochs):
        perm = torch.randperm(len(x), device=device)
        total = torch.zeros((), device=device)
        correct = torch.zeros((), dtype=torch.long, device=device)
        for i in range(0, len(x), batch):
            idx = perm[i : i + batch]
            xb, yb = x[idx], y[idx]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                out = net(xb)
            out = out.float() if bf16 else out
            step_loss = F.cross_entropy(out, yb, label_smoothing=smoothing)
            opt.zero_grad(set_to_none=True)
            step_loss.backward()
            opt.step()
            total += step_loss.detach() * len(xb)
            if accuracy:
                correct += (out.detach().argmax(1) == yb).sum()
        float(total / len(x))
        if accuracy:
            float(correct / len(x))
    _sync(device)
    return time.perf_counter() - start


def mlp_fitkit(
    net, x, y, batch: int, epochs: int, accuracy: bool, precision: str, loss: Any = "cross_entropy"
) -> float:
    model = fitkit.Model(net, device=x.device)
    model.compile(
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
        loss=loss,
        precision=precision,
        metrics=["accuracy"] if accuracy else None,
        jit_compile=False,
    )
    _sync(x.device)
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0)
    _sync(x.device)
    return time.perf_counter() - start


#: (label, accuracy, precision, the loss as written)
MLP_CASES = (
    ("cross_entropy", False, "32", "cross_entropy"),
    ("cross_entropy + accuracy", True, "32", "cross_entropy"),
    ("cross_entropy + accuracy, bf16-mixed", True, "bf16-mixed", "cross_entropy"),
    ("nn.CrossEntropyLoss()", False, "32", nn.CrossEntropyLoss()),
    ("nn.CrossEntropyLoss() + accuracy", True, "32", nn.CrossEntropyLoss()),
    ("nn.CrossEntropyLoss(label_smoothing=0.1)", False, "32", nn.CrossEntropyLoss(label_smoothing=0.1)),
)


def time_mlp(device: torch.device, rows: int, epochs: int, repeats: int, batch: int = 128):
    """``(case, hand ms/step, fitkit ms/step, median of the per-repeat ratios)`` per case."""
    x, y = mlp_data(device, rows)
    steps = epochs * -(-rows // batch)
    out = []
    for label, accuracy, precision, loss in MLP_CASES:
        base = make_mlp()
        mlp_hand(copy.deepcopy(base), x[: batch * 4], y[: batch * 4], batch, 1, accuracy, precision, loss)  # warm-up
        mlp_fitkit(copy.deepcopy(base), x[: batch * 4], y[: batch * 4], batch, 1, accuracy, precision, loss)
        hand, fit = [], []
        for _ in range(repeats):
            hand.append(mlp_hand(copy.deepcopy(base), x, y, batch, epochs, accuracy, precision, loss))
            fit.append(mlp_fitkit(copy.deepcopy(base), x, y, batch, epochs, accuracy, precision, loss))
        ratio = statistics.median(f / h for f, h in zip(fit, hand, strict=True))
        out.append((label, statistics.median(hand) / steps * 1e3, statistics.median(fit) / steps * 1e3, ratio))
    return out


# -- 5. step times ----------------------------------------------------------------------------------


def make_gpt(seed: int = 0, tiny: bool = False) -> nn.Module:
    from fitkit.layers import GPT

    torch.manual_seed(seed)
    if tiny:  # --dry-run on a CPU
        return GPT(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=32, bias=False)
    return GPT(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384, bias=False)


def batches(n: int, device: torch.device, bs: int = 32, T: int = 256):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 65, (n, bs, T + 1), generator=g).to(device)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def plain_loop(net, data, precision: str, compiled: bool) -> float:
    net = torch.compile(net) if compiled else net
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, fused=True)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    device = data[0][0].device
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
    _sync(device)
    start = time.perf_counter()
    total = torch.zeros((), device=device)
    for x, y in data:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = net(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        total += loss.detach()
    float(total)
    _sync(device)
    return time.perf_counter() - start


def fitkit_loop(net, data, precision: str, compiled: bool) -> float:
    device = data[0][0].device
    model = fitkit.Model(net, device=device)
    model.compile(
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4, fused=True),
        loss="cross_entropy",
        precision=precision,
        jit_compile=compiled,
    )
    _sync(device)
    start = time.perf_counter()
    model.fit(data, epochs=1, verbose=0)
    _sync(device)
    return time.perf_counter() - start


GPT_CASES = (("32", False), ("bf16-mixed", False), ("16-mixed", False), ("bf16-mixed", True))


def time_steps(
    device: torch.device, steps: int, repeats: int, tiny: bool = False, cases=GPT_CASES
) -> list[tuple[str, float, float]]:
    data = batches(steps, device, bs=2, T=16) if tiny else batches(steps, device)
    rows = []
    for precision, compiled in cases:
        base = make_gpt(tiny=tiny)
        plain_loop(copy.deepcopy(base), data[:10], precision, compiled)  # warm-up / compile
        fitkit_loop(copy.deepcopy(base), data[:10], precision, compiled)
        p, f = [], []
        for _ in range(repeats if not compiled else max(1, repeats - 1)):
            p.append(plain_loop(copy.deepcopy(base), data, precision, compiled))
            f.append(fitkit_loop(copy.deepcopy(base), data, precision, compiled))
        label = precision + (" + compile" if compiled else "")
        rows.append((label, statistics.median(p) / len(data) * 1e3, statistics.median(f) / len(data) * 1e3))
    return rows


def _table(title: str, header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in header:
        table.add_column(col)
    for row in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row))
    Console().print(table)


def _dry_run(args: argparse.Namespace) -> int:
    """The mlp and timing parts on the CPU at tiny sizes (no sync checks, no CUDA tests): the
    script's code runs; its numbers mean nothing."""
    dev = torch.device("cpu")
    start = time.perf_counter()
    rows = time_mlp(dev, rows=512, epochs=1, repeats=1)
    _table("dry run (CPU): mlp, 512 rows", ("case", "hand ms/step", "fitkit ms/step", "ratio"), rows)
    # fp32 and bf16-mixed (a CPU has no float16 GradScaler path worth checking); compiled on request
    cases = [c for c in GPT_CASES if c[0] != "16-mixed" and (args.compile or not c[1])]
    rows = time_steps(dev, steps=2, repeats=1, tiny=True, cases=tuple(cases))
    _table("dry run (CPU): tiny GPT, 2 steps", ("precision", "plain ms/step", "fitkit ms/step"), rows)
    print(f"dry run: {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest part")
    parser.add_argument("--only", choices=PARTS, help="run one part only")
    parser.add_argument("--steps", type=int, default=40, help="GPT steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender (medians)")
    parser.add_argument("--mlp-rows", type=int, default=32768, help="rows of the mlp part (batch 128)")
    parser.add_argument(
        "--dry-run", action="store_true", help="no GPU needed: run the mlp and timing code on the CPU at tiny sizes"
    )
    parser.add_argument("--compile", action="store_true", help="with --dry-run: the compiled case too (slow)")
    args = parser.parse_args(argv)
    if args.dry_run:
        return _dry_run(args)
    if not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA GPU (or --dry-run).", file=sys.stderr)
        return 2
    parts = [args.only] if args.only else [p for p in PARTS if not (p == "tests" and args.no_tests)]
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, fitkit {fitkit.__version__}")
    failed = False
    began = time.perf_counter()
    for part in parts:
        start = time.perf_counter()
        failed |= _run_part(part, dev, args)
        print(f"{part}: {time.perf_counter() - start:.0f} s")
    print(f"total: {time.perf_counter() - began:.0f} s")
    return 1 if failed else 0


def _run_part(part: str, dev: torch.device, args: argparse.Namespace) -> bool:
    """Run one part; ``True`` when it failed."""
    if part == "tests":
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "requires_cuda", "tests"])
        print(f"CUDA tests exit code: {rc}")
        return rc not in (0, 5)  # 5: no test collected
    if part == "syncs":
        rows = check_syncs(dev)
        _table(
            f"Host syncs in steady-state steps (set_sync_debug_mode('error'), >= {STEADY} each)",
            ("configuration", "result", "steps checked"),
            rows,
        )
        return any(r[1] != "0 syncs" or r[2] < STEADY for r in rows)
    if part == "predict":
        r = check_predict(dev)
        _table("predict: (20000, 32000) float32 logits, batch 256", tuple(r), [tuple(r.values())])
    elif part == "mlp":
        rows = time_mlp(dev, args.mlp_rows, epochs=2, repeats=max(args.repeats, 5))
        _table(
            f"MLP 64-256-10, batch 128, {args.mlp_rows} rows x 2 epochs, data on the device",
            ("case", "hand ms/step", "fitkit ms/step", "ratio (median of pairs)"),
            rows,
        )
    elif part == "timing":
        rows = time_steps(dev, args.steps, args.repeats)
        _table(
            f"GPT 6x384, batch 32x256, {args.steps} steps, median of {args.repeats}",
            ("precision", "plain ms/step", "fitkit ms/step", "ratio"),
            [(label, p, f, f / p) for label, p, f in rows],
        )
    return False


if __name__ == "__main__":
    sys.exit(main())
