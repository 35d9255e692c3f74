"""Checkpoint cost under ``strategy="fsdp"``: a full gather to one file vs sharded DCP folders.

Trains the GPT preset (``fitkit.layers.GPT``, ~29.4M parameters with the defaults) with AdamW
for one step on every rank, then measures, per rank:

- ``save full``: ``save_checkpoint(path, sharded=False)``: module and optimizer gathered onto
  rank 0's CPU, one file (the only way before sharded checkpoints);
- ``save dcp``: ``save_checkpoint(path)``: every rank writes its own shards;
- ``save async``: ``save_checkpoint(path, async_save=True)``: the time training is blocked
  (staging copy), and the time until the background write is done;
- ``load full`` / ``load dcp``: into a freshly compiled model.

Each figure is the wall time of the call and the peak resident memory above the process's
memory just before it (sampled every 2 ms). Run:

    torchrun --nproc_per_node=2 benchmarks/checkpoint_scale.py [--n-layer 8] [--n-embd 512]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fitkit
from fitkit.distributed import dcp, rank
from fitkit.layers import GPT

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """The peak resident memory above the start, sampled by a thread while the body runs."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        self.mb = (self.peak - self.base) / 2**20


def build(args: argparse.Namespace) -> fitkit.Model:
    torch.manual_seed(0)
    net = GPT(
        vocab_size=args.vocab, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )
    model = fitkit.Model(net, device="cpu", strategy="fsdp")
    model.compile(optimizer="adamw", loss="cross_entropy")
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--dir", default=None, help="where to write (default: a temp folder on rank 0's disk)")
    args = p.parse_args()
    model = build(args)
    params = sum(p.numel() for p in model.module.parameters())  # DTensors: global sizes
    x = torch.randint(0, args.vocab, (2, 32))
    model.fit(x, x, batch_size=2, epochs=1, verbose=0)  # creates the AdamW state
    folder = [args.dir or (tempfile.mkdtemp() if rank() == 0 else None)]
    dist.broadcast_object_list(folder, src=0)
    root = Path(folder[0])
    rows: dict[str, tuple[float, float]] = {}

    def measure(name: str, fn) -> None:
        dist.barrier()
        with PeakRSS() as m:
            fn()
        rows[name] = (m.seconds, m.mb)
        dist.barrier()

    # Async first: the memory a save frees stays with the process and would hide the next one's.
    measure("save async: blocked", lambda: model.save_checkpoint(root / "async", async_save=True))
    measure("save async: until written", dcp.wait)
    measure("save dcp", lambda: model.save_checkpoint(root / "dcp"))
    measure("save full (gather to rank 0)", lambda: model.save_checkpoint(root / "full.pt", sharded=False))
    fresh = build(args)
    measure("load dcp", lambda: fresh.load_checkpoint(root / "dcp"))
    measure("load full", lambda: fresh.load_checkpoint(root / "full.pt"))
    sizes = {
        "full.pt": (root / "full.pt").stat().st_size,
        "dcp": sum(f.stat().st_size for f in (root / "dcp").iterdir()),
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    if rank() == 0:
        print(
            f"GPT {params / 1e6:.1f}M parameters + AdamW, {dist.get_world_size()} ranks (gloo, CPU); "
            f"full file {sizes['full.pt'] / 2**20:.0f} MB, dcp folder {sizes['dcp'] / 2**20:.0f} MB"
        )
        head = "".join(f"  rank {r}: s  +MB" for r in range(len(every)))
        print(f"{'':32}{head}")
        for name in rows:
            cells = "".join(f"  {every[r][name][0]:7.2f} {every[r][name][1]:6.0f}" for r in range(len(every)))
            print(f"{name:32}{cells}")
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
