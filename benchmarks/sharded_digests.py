"""What the sharded checkpoint's manifest costs: save and load with and without it.

One process, a plain module of ``--params`` parameters (default 4.2M) with Adam: a checkpoint of
about 50 MB (weights and two moments in float32). Measures, median of ``--repeat`` runs:

- ``save``: ``save_checkpoint(path, sharded=True)``, with the manifest (hashing every file once)
  and with ``write_manifest`` replaced by a no-op (the save before manifests existed);
- ``load``: ``load_checkpoint`` of the folder with its manifest (every byte hashed before the
  load) and of the same folder with the manifest removed (nothing to check);
- ``write_manifest`` / ``verify_manifest`` alone.

The files are in the page cache (just written): the figures are the hashing's CPU cost, not a
disk's. Run:

    python benchmarks/sharded_digests.py [--params 4200000] [--repeat 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import fitkit
from fitkit.distributed import dcp
from fitkit.files import manifest


def build(params: int) -> fitkit.Model:
    width = int((params / 2) ** 0.5)
    torch.manual_seed(0)
    model = fitkit.Model(nn.Sequential(nn.Linear(width, width), nn.Linear(width, width)), device="cpu")
    model.compile(optimizer="adam", loss="mse")
    x = torch.randn(8, width)
    model.fit(x, x, batch_size=8, epochs=1, verbose=0)  # Adam's two moments exist
    return model


def median_time(f: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=4_200_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    model = build(args.params)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    ck = root / "ck"
    try:
        model.save_checkpoint(ck, sharded=True)  # warm-up: imports, first DCP plan
        size = sum(f.stat().st_size for f in ck.iterdir())
        n = sum(p.numel() for p in model.module.parameters())
        print(f"{n / 1e6:.2f}M parameters, checkpoint {size / 1e6:.1f} MB in {root}")
        rows = {"save with manifest": median_time(lambda: model.save_checkpoint(ck, sharded=True), args.repeat)}
        plain = dcp.write_manifest
        dcp.write_manifest = lambda folder: {}  # type: ignore[assignment]
        try:
            rows["save without"] = median_time(lambda: model.save_checkpoint(ck, sharded=True), args.repeat)
        finally:
            dcp.write_manifest = plain
        model.save_checkpoint(ck, sharded=True)
        rows["write_manifest alone"] = median_time(lambda: manifest.write_manifest(ck), args.repeat)
        rows["verify_manifest alone"] = median_time(lambda: manifest.verify_manifest(ck), args.repeat)
        other = build(args.params)
        rows["load with manifest"] = median_time(lambda: other.load_checkpoint(ck), args.repeat)
        os.remove(ck / manifest.MANIFEST_NAME)
        rows["load without"] = median_time(lambda: other.load_checkpoint(ck), args.repeat)
        for name, seconds in rows.items():
            print(f"{name:24s} {seconds * 1000:8.1f} ms")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
