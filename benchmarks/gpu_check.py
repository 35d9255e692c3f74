"""One script for a CUDA machine: GPU tests, a zero-host-sync check, and GPT step timings.

Run from the repository root on a machine with a CUDA GPU::

    python benchmarks/gpu_check.py            # all three parts
    python benchmarks/gpu_check.py --no-tests # skip the pytest part

1. Runs the CUDA-marked tests (``pytest -m requires_cuda``).
2. Trains the GPT preset and, after warm-up, runs 50 steady-state steps under
   ``torch.cuda.set_sync_debug_mode("error")``: any host sync fitkit does per step raises.
3. Times fitkit against a plain loop on the same GPT and batches, in fp32, bf16-mixed and
   bf16-mixed + torch.compile, and prints the ratios (medians over several repeats).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import fitkit
from fitkit.callbacks import Callback
from fitkit.layers import GPT


class SyncGuard(Callback):
    """Turn host syncs into errors for batches [start, start + n)."""

    def __init__(self, start: int, n: int):
        super().__init__()
        self.start, self.end = start, start + n
        self.checked = 0

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.start:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        if self.start <= batch < self.end:
            self.checked += 1

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.end - 1:
            torch.cuda.set_sync_debug_mode(0)


def make_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384, bias=False)


def batches(n: int, device: torch.device, bs: int = 32, T: int = 256):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 65, (n, bs, T + 1), generator=g).to(device)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def plain_loop(net, data, precision: str, compiled: bool) -> float:
    net = torch.compile(net) if compiled else net
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, fused=True)
    dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in data:
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            logits = net(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def fitkit_loop(net, data, precision: str, compiled: bool, callbacks=()) -> float:
    model = fitkit.Model(net, device="cuda")
    model.compile(optimizer="adamw", loss="cross_entropy", precision=precision, jit_compile=compiled)
    model.optimizer.param_groups[0]["lr"] = 3e-4
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.fit(data, epochs=1, verbose=0, callbacks=list(callbacks))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-tests", action="store_true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a CUDA GPU.")
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}")

    if not args.no_tests:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "requires_cuda", "tests"])
        print(f"CUDA tests exit code: {rc}")

    data = batches(80, dev)
    for precision in ("32", "bf16-mixed"):
        guard = SyncGuard(start=20, n=50)
        fitkit_loop(make_gpt(), data, precision, compiled=False, callbacks=[guard])
        print(f"sync check {precision}: {guard.checked} steady-state steps with no host sync")

    data = batches(args.steps, dev)
    for precision, compiled in (("32", False), ("bf16-mixed", False), ("bf16-mixed", True)):
        base = make_gpt()
        plain_loop(copy.deepcopy(base), data[:10], precision, compiled)  # warm-up / compile
        fitkit_loop(copy.deepcopy(base), data[:10], precision, compiled)
        p, f = [], []
        for _ in range(args.repeats):
            p.append(plain_loop(copy.deepcopy(base), data, precision, compiled))
            f.append(fitkit_loop(copy.deepcopy(base), data, precision, compiled))
        mp, mf = statistics.median(p), statistics.median(f)
        label = precision + (" + compile" if compiled else "")
        print(f"{label:22s} plain {mp / len(data) * 1e3:7.2f} ms/step  fitkit {mf / len(data) * 1e3:7.2f} "
              f"ms/step  ratio {mf / mp:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
