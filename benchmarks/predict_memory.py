"""Peak host memory of ``predict`` on 1M rows (a separate process per measurement).

Method: a fresh Python process builds the inputs (1M x 16 float32, 64 MB) and a Linear(16, 10),
then reads its peak resident set size (``ru_maxrss``) before and after one
``model.predict(x, batch_size=4096)``; the difference is what predict added at its peak.
The outputs are 1M x 10 float32 (40 MB): holding them once is +40 MB, a list of batches plus
their concatenation twice that. ``tracemalloc`` does not see torch's allocations, so RSS it is.

Run: ``python benchmarks/predict_memory.py [--rows 1000000]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import resource, torch, fitkit, json
torch.set_num_threads(1)
x = torch.randn({rows}, 16)
model = fitkit.Model(torch.nn.Linear(16, 10), device="cpu")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = model.predict(x, batch_size=4096, verbose=0)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"peak_added_mb": (after - before) / 1024, "outputs_mb": out.numel() * 4 / 2**20}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    result = subprocess.run(
        [sys.executable, "-c", CHILD.format(rows=args.rows)], capture_output=True, text=True, check=True
    )
    r = json.loads(result.stdout.strip().splitlines()[-1])
    print(
        f"predict on {args.rows} rows: outputs {r['outputs_mb']:.1f} MB, peak RSS added {r['peak_added_mb']:.1f} MB "
        f"({r['peak_added_mb'] / r['outputs_mb']:.2f}x the outputs)"
    )


if __name__ == "__main__":
    main()
