"""The rich progress bar: throttled reads of batch logs, a bar only for phases that last."""

import io

import torch
from rich.console import Console

from fitkit.callbacks import BatchLogs, ProgressBar


class CountingLogs:
    def __init__(self):
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return {"loss": torch.tensor(0.5)}


def _bar(refresh_interval):
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    bar = ProgressBar(1, refresh_interval=refresh_interval, console=console)
    bar.set_params({"epochs": 2, "steps": 50})
    return bar, console


def test_live_bar_reads_logs_only_when_it_redraws():
    bar, console = _bar(refresh_interval=0.0)  # redraw on every batch
    counter = CountingLogs()
    bar.on_train_begin()
    bar.on_epoch_begin(0)
    for i in range(50):
        bar.on_train_batch_end(i, BatchLogs(counter))
    bar.on_epoch_end(0, {"loss": 0.25})
    out = console.file.getvalue()
    assert counter.reads == 50
    assert "Epoch 1/2" in out and "50/50" in out  # the live bar was drawn
    assert "Epoch 1/2 - 50 steps - " in out and "loss: 0.2500" in out  # then the summary line


def test_short_phase_draws_no_bar_and_reads_no_logs():
    bar, console = _bar(refresh_interval=3600.0)
    counter = CountingLogs()
    bar.on_train_begin()
    bar.on_epoch_begin(0)
    for i in range(50):
        bar.on_train_batch_end(i, BatchLogs(counter))
    bar.on_epoch_end(0, {"loss": 0.25})
    out = console.file.getvalue()
    assert counter.reads == 0  # no host sync for a bar nobody sees
    assert "50/50" not in out
    assert out.strip().startswith("Epoch 1/2 - 50 steps - ") and out.strip().endswith("loss: 0.2500")
