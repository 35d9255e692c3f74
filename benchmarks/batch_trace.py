"""The files one steady-state training batch of ``fit`` goes through, in order, and those of one
checkpoint save inside ``fit``.

``sys.setprofile`` records the Python call events into fitkit's files: for the batch, from the
end of batch 3's ``on_train_batch_end`` to that of batch 4 (``fit`` on in-memory tensors, Adam,
MSE, no accumulation); for the save, the whole ``model.save_checkpoint`` call that a callback
makes at batch 3 of the same fit (with an EarlyStopping, so a callback state travels). Calls
into ``files/writing.py`` below ``atomic_save`` (the bytes on disk) and into the file helpers it
calls are counted as they come. Consecutive calls in one file are folded into one stop.
Deterministic: no timing.

Run: ``python benchmarks/batch_trace.py``. Prints, for the batch and for the save, the count of
calls, files and hand-overs, then the path.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from torch import nn

import fitkit


def trace() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(file relative to the package, function)`` of every fitkit call in one steady batch,
    and in one checkpoint save inside fit."""
    torch.manual_seed(0)
    x, y = torch.randn(256, 16), torch.randn(256, 1)
    model = fitkit.Model(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)), device="cpu")
    model.compile(optimizer="adam", loss="mse")
    root = os.path.dirname(fitkit.__file__) + os.sep
    batch: list[tuple[str, str]] = []
    save: list[tuple[str, str]] = []

    def recorder(events):
        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(root):
                events.append((frame.f_code.co_filename[len(root) :], frame.f_code.co_name))

        return profile

    folder = tempfile.mkdtemp()

    class Mark(fitkit.callbacks.Callback):
        def on_train_batch_end(self, index, logs=None):
            if index == 3:
                sys.setprofile(recorder(save))
                model.save_checkpoint(os.path.join(folder, "c.pt"))
                sys.setprofile(recorder(batch))
            elif index == 4:
                sys.setprofile(None)

    stop = fitkit.callbacks.EarlyStopping(monitor="loss", patience=3)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[stop, Mark()])
    return batch, save


def _report(name: str, events: list[tuple[str, str]]) -> None:
    path: list[str] = []
    for file, _ in events:
        if not path or path[-1] != file:
            path.append(file)
    print(f"{name}: calls {len(events)}, files {len({f for f, _ in events})}, hand-overs {len(path) - 1}")
    print("  " + " -> ".join(path))


def main() -> None:
    batch, save = trace()
    _report("one batch", batch)
    _report("one checkpoint save", save)


if __name__ == "__main__":
    main()
