"""Regression tests: a scheduler of another class, callbacks watching another key, a bad
validation DataLoader before step 1, and a CSV row that a full disk cut short."""

from __future__ import annotations

import errno
import os
from functools import partial

import pytest
import torch
from conftest import line_data, line_model, params_of, same_params
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import CSVLogger, EarlyStopping, LambdaCallback

X, Y = torch.randn(32, 4), torch.randint(0, 3, (32,))


def _classifier(scheduler=None) -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(torch.nn.Linear(4, 3), device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy", scheduler=scheduler)
    return model


def test_a_checkpoint_with_another_scheduler_class_changes_nothing(tmp_path):
    saved = _classifier(partial(lr_scheduler.StepLR, step_size=1, gamma=0.5))
    saved.fit(X, Y, epochs=1, verbose=0)
    saved.save_checkpoint(tmp_path / "c.pt")
    model = _classifier(partial(lr_scheduler.ExponentialLR, gamma=0.9))
    before = params_of(model.module)
    with pytest.raises(ValueError, match="scheduler: StepLR in the file, ExponentialLR in the model"):
        model.load_checkpoint(tmp_path / "c.pt")
    assert same_params(model.module, before) and model.scheduler.gamma == 0.9 and model.global_step == 0
    with pytest.raises(ValueError, match="scheduler: the file has StepLR, the model none"):
        _classifier().load_checkpoint(tmp_path / "c.pt")


def test_a_callback_that_now_watches_another_key_starts_fresh(tmp_path):
    x, y = line_data(16)
    model = line_model()
    stop = EarlyStopping(monitor="loss", patience=1)
    save = LambdaCallback(on_epoch_end=lambda epoch, logs: model.save_checkpoint(tmp_path / "c.pt"))
    model.fit(x, y, epochs=2, verbose=0, callbacks=[stop, save])
    resumed = line_model()
    resumed.load_checkpoint(tmp_path / "c.pt")
    other = EarlyStopping(monitor="learning_rate", mode="min", patience=5)
    with pytest.warns(fitkit.FitkitWarning, match="was saved watching .*'loss'.* now watches .*'learning_rate'"):
        resumed.fit(x, y, initial_epoch=2, epochs=3, verbose=0, callbacks=[other])
    assert other.best == 0.05  # its own first value, not the saved best loss


def test_a_bad_validation_dataloader_fails_before_step_1(tmp_path):
    model = _classifier()
    before = params_of(model.module)
    bad = DataLoader(TensorDataset(torch.randn(8, 5), Y[:8]), batch_size=8)
    with pytest.raises(ValueError, match="first validation batch failed in the module's forward.*mat1 and mat2"):
        model.fit(X, Y, epochs=2, batch_size=8, verbose=0, validation_data=bad)
    assert same_params(model.module, before) and model.global_step == 0


def test_the_validation_check_leaves_a_shuffled_fit_unchanged(monkeypatch):
    val = DataLoader(TensorDataset(X[:8], Y[:8]), batch_size=4, shuffle=True)
    checked = _classifier()
    torch.manual_seed(1)
    checked.fit(X, Y, epochs=2, batch_size=8, verbose=0, validation_data=val)
    monkeypatch.setattr(fitkit.planning, "_check_first_validation_batch", lambda model, loader: None)
    unchecked = _classifier()
    torch.manual_seed(1)
    unchecked.fit(X, Y, epochs=2, batch_size=8, verbose=0, validation_data=val)
    assert torch.equal(checked.module.weight, unchecked.module.weight)  # the peek put the RNG back


def test_a_full_disk_leaves_whole_csv_rows_and_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "log.csv"
    logger = CSVLogger(path)
    x, y = line_data(8)
    line_model().fit(x, y, epochs=2, verbose=0, callbacks=[logger])
    whole = path.read_text()
    real_write = os.write

    def full_disk_write(fd, data):  # part of the row reaches the disk, then it is full
        if os.readlink(f"/proc/self/fd/{fd}") != str(path):
            return real_write(fd, data)
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk_write)
    with pytest.raises(OSError, match="log.csv") as caught:
        line_model().fit(x, y, epochs=1, verbose=0, callbacks=[CSVLogger(path, append=True)])
    monkeypatch.undo()
    assert caught.value.errno == errno.ENOSPC
    assert path.read_text() == whole  # the partial row was cut off
