"""One script for a CUDA machine: GPU tests, zero host syncs per step, predict's memory, step times.

Run from the repository root on a machine with one CUDA GPU (about 3-5 minutes on a recent GPU)::

    python benchmarks/gpu_check.py              # every part
    python benchmarks/gpu_check.py --no-tests   # skip the pytest part
    python benchmarks/gpu_check.py --only syncs # one part: tests, syncs, predict or timing

1. **tests**: the CUDA-marked tests (``pytest -m requires_cuda``).
2. **syncs**: for each configuration (the matrix of ``tests/test_host_syncs.py``: callbacks,
   precisions, accumulation, clipping, schedulers, validation, weights, a DataLoader, a user
   torchmetrics object, ``evaluate`` and ``predict``), the steady-state steps run under
   ``torch.cuda.set_sync_debug_mode("error")``: any host sync in a step raises. Epoch ends and
   log points are outside the checked steps. A table says which configurations passed.
3. **predict**: a vocabulary-sized output (``(N, 32000)`` logits) through ``predict``: the peak
   device memory against the outputs' size (the device should hold about one batch), and the
   time against a plain loop that copies each batch with ``.cpu()``.
4. **timing**: fitkit against a plain loop on the GPT preset and the same batches, in fp32,
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

PARTS = ("tests", "syncs", "predict", "timing")


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
        "bf16-mixed": ({"precision": "bf16-mixed"}, {}, []),
        "16-mixed (fused adam)": ({"precision": "16-mixed"}, {}, []),
        "accumulation 2": ({"gradient_accumulation_steps": 2}, {}, []),
        "clip_grad_norm": ({"clip_grad_norm": 1.0}, {}, []),
        "clip_grad_value": ({"clip_grad_value": 0.1}, {}, []),
        "step scheduler": ({"scheduler": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 0.01, total_steps=1000),
                            "scheduler_interval": "step"}, {}, []),  # fmt: skip
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
            data = (DataLoader(TensorDataset(x, y), batch_size=128, shuffle=True),) if fit_kwargs.pop("loader", False) \
                else (x, y)  # fmt: skip
            try:
                model.fit(*data, batch_size=128, epochs=2, verbose=verbose, callbacks=[on, *callbacks, SyncOff()],
                          **fit_kwargs)  # fmt: skip
                rows.append((name, "0 syncs", on.checked))
            except RuntimeError as e:
                rows.append((name, f"SYNC: {str(e).splitlines()[0][:70]}", on.checked))
            finally:
                torch.cuda.set_sync_debug_mode(0)
        for verb in ("evaluate", "predict"):
            model = _classifier(device, metrics=["accuracy", "f1"])
            on = SyncOn()
            try:
                if verb == "evaluate":
                    model.evaluate(x, y, batch_size=128, verbose=0, callbacks=[on, SyncOff()])
                else:
                    model.predict(x, batch_size=128, verbose=0, callbacks=[on, SyncOff()])
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
    return {"outputs_mb": out.numel() * 4 / 2**20, "device_peak_mb": peak / 2**20,
            "batch_outputs_mb": batch * vocab * 4 / 2**20, "fitkit_s": seconds, "plain_s": plain_s,
            "same_values": float(exact)}  # fmt: skip


# -- 4. step times ----------------------------------------------------------------------------------


def make_gpt(seed: int = 0) -> nn.Module:
    from fitkit.layers import GPT

    torch.manual_seed(seed)
    return GPT(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384, bias=False)


def batches(n: int, device: torch.device, bs: int = 32, T: int = 256):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 65, (n, bs, T + 1), generator=g).to(device)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def plain_loop(net, data, precision: str, compiled: bool) -> float:
    net = torch.compile(net) if compiled else net
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, fused=True)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cuda") if precision == "16-mixed" else None
    torch.cuda.synchronize()
    start = time.perf_counter()
    total = torch.zeros((), device=data[0][0].device)
    for x, y in data:
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
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
    torch.cuda.synchronize()
    return time.perf_counter() - start


def fitkit_loop(net, data, precision: str, compiled: bool) -> float:
    model = fitkit.Model(net, device="cuda")
    model.compile(optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4, fused=True), loss="cross_entropy",
                  precision=precision, jit_compile=compiled)  # fmt: skip
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.fit(data, epochs=1, verbose=0)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def time_steps(device: torch.device, steps: int, repeats: int) -> list[tuple[str, float, float]]:
    data = batches(steps, device)
    rows = []
    for precision, compiled in (("32", False), ("bf16-mixed", False), ("16-mixed", False), ("bf16-mixed", True)):
        base = make_gpt()
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest part")
    parser.add_argument("--only", choices=PARTS, help="run one part only")
    parser.add_argument("--steps", type=int, default=40, help="GPT steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender (medians)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    parts = [args.only] if args.only else [p for p in PARTS if not (p == "tests" and args.no_tests)]
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, fitkit {fitkit.__version__}")
    failed = False
    if "tests" in parts:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "requires_cuda", "tests"])
        print(f"CUDA tests exit code: {rc}")
        failed |= rc not in (0, 5)  # 5: no test collected
    if "syncs" in parts:
        rows = check_syncs(dev)
        _table("Host syncs in steady-state steps (set_sync_debug_mode('error'))", ("configuration", "result",
               "steps checked"), rows)  # fmt: skip
        failed |= any(r[1] != "0 syncs" for r in rows)
    if "predict" in parts:
        r = check_predict(dev)
        _table("predict: (20000, 32000) float32 logits, batch 256", tuple(r), [tuple(r.values())])
    if "timing" in parts:
        rows = time_steps(dev, args.steps, args.repeats)
        _table(f"GPT 6x384, batch 32x256, {args.steps} steps, median of {args.repeats}",
               ("precision", "plain ms/step", "fitkit ms/step", "ratio"),
               [(label, p, f, f / p) for label, p, f in rows])  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
