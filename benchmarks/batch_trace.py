"""The files one steady-state training batch of ``fit`` goes through, in order.

``sys.setprofile`` records the Python call events into fitkit's files from the end of batch 3's
``on_train_batch_end`` to that of batch 4 (``fit`` on in-memory tensors, Adam, MSE, no
accumulation); consecutive calls in one file are folded into one stop. Deterministic: no timing.

Run: ``python benchmarks/batch_trace.py``. Prints the count of calls, files and hand-overs, then
the path.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

import fitkit


def trace() -> list[tuple[str, str]]:
    """``(file relative to the package, function)`` of every fitkit call in one steady batch."""
    torch.manual_seed(0)
    x, y = torch.randn(256, 16), torch.randn(256, 1)
    model = fitkit.Model(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)), device="cpu")
    model.compile(optimizer="adam", loss="mse")
    root = os.path.dirname(fitkit.__file__) + os.sep
    events: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            events.append((frame.f_code.co_filename[len(root):], frame.f_code.co_name))

    class Mark(fitkit.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                sys.setprofile(profile)
            elif batch == 4:
                sys.setprofile(None)

    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[Mark()])
    return events


def main() -> None:
    events = trace()
    path: list[str] = []
    for file, _ in events:
        if not path or path[-1] != file:
            path.append(file)
    print(f"calls {len(events)}, files {len({f for f, _ in events})}, hand-overs {len(path) - 1}")
    print(" -> ".join(path))


if __name__ == "__main__":
    main()
