"""The loop's invariant 5: what is logged is what was used.

An epoch logs, as ``learning_rate``, the rate its last optimizer step used (a per-step schedule
has moved on since). A fit resumed from a backup shows the same rates in ``History`` and in the
CSV row as the run that was never interrupted, wherever the backup was written: inside an
epoch, at its last batch (the epoch's steps are all done, its end is not), or at its end.
Property over those resume points x the scheduler's interval, against rates computed by hand
(``StepLR(step_size=1, gamma=0.5)``: each step, or each epoch, halves the rate).
"""

from __future__ import annotations

import csv

import pytest
import torch

import fitkit
from fitkit.callbacks import BackupAndRestore, Callback, CSVLogger
from tests.conftest import fixed_linear

LR, BATCHES, EPOCHS = 0.5, 4, 3


class Crash(Exception):
    pass


class CrashAt(Callback):
    """Raises once, after the backup of its point was written: at the next batch's begin
    (``"mid-epoch"``), at the epoch's end before any logger (``"last batch"``: the last backup
    is that batch's), or at the next epoch's begin (``"epoch end"``)."""

    def __init__(self, point: str):
        super().__init__()
        self.point, self.done = point, False

    def _crash(self, now: bool) -> None:
        if now and not self.done:
            self.done = True
            raise Crash

    def on_train_batch_begin(self, batch, logs=None):
        self._crash(self.point == "mid-epoch" and self.model.epoch == 1 and batch == 2)

    def on_epoch_end(self, epoch, logs=None):
        self._crash(self.point == "last batch" and epoch == 1)

    def on_epoch_begin(self, epoch, logs=None):
        self._crash(self.point == "epoch end" and epoch == 2)


def _fit(tmp, interval: str, crash: CrashAt | None, save_freq):
    model = fitkit.Model(fixed_linear(2, 1, weight=0.25), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=LR),
        loss="mse",
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        scheduler_interval=interval,
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4 * BATCHES, 2, generator=g), torch.randn(4 * BATCHES, 1, generator=g)
    crashes = [crash] if crash is not None else []
    callbacks = [BackupAndRestore(tmp / "backup", save_freq=save_freq), *crashes, CSVLogger(tmp / "log.csv")]
    return model.fit(x, y, batch_size=4, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=callbacks)


def _csv_rates(path) -> list[float]:
    with open(path, newline="") as f:
        return [float(row["learning_rate"]) for row in csv.DictReader(f)]


POINTS = {"mid-epoch": 1, "last batch": 1, "epoch end": "epoch"}  # -> BackupAndRestore's save_freq


@pytest.mark.parametrize("interval", ["step", "epoch"])
@pytest.mark.parametrize("point", list(POINTS))
def test_a_resumed_fit_logs_the_rates_the_uninterrupted_one_used(tmp_path, point, interval):
    save_freq = POINTS[point]
    if interval == "step":  # epoch e's last step is step 4e + 3 (0-based): the rate it used
        expected = [LR * 0.5 ** (BATCHES * e + BATCHES - 1) for e in range(EPOCHS)]
    else:
        expected = [LR * 0.5**e for e in range(EPOCHS)]
    straight = _fit(tmp_path / "straight", interval, None, save_freq)
    assert straight.history["learning_rate"] == expected
    with pytest.raises(Crash):
        _fit(tmp_path / "resumed", interval, CrashAt(point), save_freq)
    resumed = _fit(tmp_path / "resumed", interval, None, save_freq)
    assert resumed.history["learning_rate"] == expected
    assert resumed.history["loss"] == straight.history["loss"]
    assert _csv_rates(tmp_path / "resumed" / "log.csv") == expected
    assert _csv_rates(tmp_path / "straight" / "log.csv") == expected
