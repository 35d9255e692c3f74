"""CSVLogger, TensorBoard and History.plot: what lands in the files."""

from __future__ import annotations

import csv
import errno
import os
import re
import sys

import numpy as np
import pytest
import torch
from conftest import line_data, line_model
from torch import nn

import fitkit
from fitkit.callbacks import BackupAndRestore, CSVLogger, LambdaCallback, TensorBoard
from fitkit.checks import FitkitWarning


def _data(n: int = 16):
    x = torch.linspace(-1, 1, n).unsqueeze(1)
    return x, 3 * x + 1


def _model() -> fitkit.Model:
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse", metrics=["mae"])
    return model


def _rows(path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


class _Crash(Exception):
    pass


def _crash_at(epoch: int) -> LambdaCallback:
    def fn(e, logs):
        if e == epoch:
            raise _Crash

    return LambdaCallback(on_epoch_end=fn)


def test_csv_logger_writes_the_header_once_and_one_row_per_epoch(tmp_path):
    x, y = _data()
    path = tmp_path / "log.csv"
    h = _model().fit(x, y, epochs=3, validation_data=(x, y), verbose=0, callbacks=[CSVLogger(path)])
    rows = _rows(path)
    assert rows[0] == ["epoch", "learning_rate", "loss", "mae", "val_loss", "val_mae"]
    assert [r[0] for r in rows[1:]] == ["0", "1", "2"]
    assert [float(r[2]) for r in rows[1:]] == h.history["loss"]  # str(float) round-trips exactly


def test_csv_logger_overwrites_or_appends(tmp_path):
    x, y = _data()
    path = tmp_path / "log.csv"
    model = _model()
    model.fit(x, y, epochs=2, verbose=0, callbacks=[CSVLogger(path, separator=";")])
    model.fit(x, y, epochs=1, verbose=0, callbacks=[CSVLogger(path, separator=";")])
    assert len(_rows(path)) == 2  # overwritten: header + 1 row
    model.fit(x, y, epochs=2, verbose=0, callbacks=[CSVLogger(path, separator=";", append=True)])
    rows = [r[0].split(";")[0] for r in _rows(path)]
    assert rows == ["epoch", "0", "0", "1"]


def test_csv_logger_appends_on_resume_without_duplicate_rows(tmp_path):
    x, y = _data()
    path, backup = tmp_path / "log.csv", tmp_path / "backup"
    ref = tmp_path / "ref.csv"
    _model().fit(x, y, epochs=4, verbose=0, callbacks=[CSVLogger(ref)])
    torch.manual_seed(0)
    model = _model()
    # The crash comes after CSVLogger wrote epoch 2's row but before the backup of epoch 2.
    with pytest.raises(_Crash):
        model.fit(x, y, epochs=4, verbose=0, callbacks=[CSVLogger(path), _crash_at(2), BackupAndRestore(backup)])
    assert [r[0] for r in _rows(path)] == ["epoch", "0", "1", "2"]
    torch.manual_seed(0)
    model = _model()
    model.fit(x, y, epochs=4, verbose=0, callbacks=[CSVLogger(path), BackupAndRestore(backup)])
    assert _rows(path) == _rows(ref)  # epoch 2's row was cut, then written once, from the backup


def test_tensorboard_scalars_read_back_equal_history(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = _data()
    h = _model().fit(x, y, epochs=3, validation_data=(x, y), verbose=0, callbacks=[TensorBoard(tmp_path)])
    found, evaluations = {}, {}
    for run, prefix in (("train", ""), ("validation", "val_")):
        acc = EventAccumulator(str(tmp_path / run))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            events = acc.Scalars(tag)
            if tag.startswith("evaluation_"):  # Keras: each validation at optimizer.iterations
                assert run == "validation" and [e.step for e in events] == [1, 2, 3], tag  # one step per epoch
                evaluations["val_" + tag.removeprefix("evaluation_").removesuffix("_vs_iterations")] = [
                    e.value for e in events
                ]
                continue
            assert [e.step for e in events] == [0, 1, 2]
            found[prefix + tag.removeprefix("epoch_")] = [e.value for e in events]
    assert sorted(found) == sorted(h.history)
    for key, values in h.history.items():
        assert found[key] == [float(np.float32(v)) for v in values], key  # stored as float32
    assert sorted(evaluations) == sorted(k for k in h.history if k.startswith("val_"))
    for key, values in evaluations.items():
        assert values == found[key], key


def test_tensorboard_batch_scalars_every_n_batches(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = _data()
    _model().fit(x, y, epochs=2, batch_size=4, verbose=0, callbacks=[TensorBoard(tmp_path, update_freq=3)])
    acc = EventAccumulator(str(tmp_path / "train"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("batch_loss")] == [3, 6]  # optimizer steps 3 and 6 of 8


def test_tensorboard_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    expected = (
        r"Install the `tensorboard` extra: "
        r"`pip install '\.\[tensorboard\]'` from a checkout \(`pip install 'torch-fitkit\[tensorboard\]'`"
    )
    with pytest.raises(ImportError, match=expected):
        TensorBoard("unused")


def test_history_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    x, y = _data()
    h = _model().fit(x, y, epochs=2, validation_data=(x, y), verbose=0)
    fig = h.plot(path=tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [ax.get_title() for ax in fig.axes] == ["loss", "mae"]
    with pytest.raises(ValueError, match="Unknown history keys"):
        h.plot(keys=["accuracy"])


# -- whole rows, no writes through links, a deleted file or folder ------------------------------
def _line_fit(callbacks, epochs=3):
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(1, 1, bias=False), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss="mse")
    x = torch.zeros(4, 1)  # the loss is 0.0 in every epoch
    model.fit(x, x, epochs=epochs, callbacks=callbacks, verbose=0)
    return model


def test_csv_logger_replaces_a_symlink_instead_of_writing_through_it(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious\n")
    link = tmp_path / "log.csv"
    link.symlink_to(target)
    _line_fit([CSVLogger(link)], epochs=2)
    assert target.read_text() == "precious\n"
    assert not link.is_symlink()
    assert link.read_text() == "epoch,learning_rate,loss\n0,0.5,0.0\n1,0.5,0.0\n"


def test_csv_logger_recreates_a_file_deleted_mid_run_with_its_header(tmp_path):
    path = tmp_path / "log.csv"
    delete = LambdaCallback(on_epoch_begin=lambda epoch, logs: path.unlink() if epoch == 1 else None)
    _line_fit([CSVLogger(path), delete])
    assert path.read_text() == "epoch,learning_rate,loss\n1,0.5,0.0\n2,0.5,0.0\n"


def test_tensorboard_names_a_folder_deleted_mid_run_and_the_run_goes_on(tmp_path):
    """A logger never ends a run: one warning names the folder and the fix, nothing more is
    written in this fit, and training finishes (before: FileNotFoundError ended the fit)."""
    pytest.importorskip("tensorboard")
    import shutil

    log_dir = tmp_path / "tb"
    delete = LambdaCallback(on_epoch_begin=lambda epoch, logs: shutil.rmtree(log_dir) if epoch == 1 else None)
    with pytest.warns(FitkitWarning) as caught:
        model = _line_fit([TensorBoard(log_dir), delete])
    stopped = [str(w.message) for w in caught if "TensorBoard stopped writing" in str(w.message)]
    assert len(stopped) == 1 and re.search(r"TensorBoard's folder '.*tb/train' was deleted while fit.*Fix", stopped[0])
    assert model.history.epoch == [0, 1, 2] and not log_dir.exists()  # it trained on and wrote nothing more


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
    model = line_model()
    with pytest.warns(
        FitkitWarning, match=r"CSVLogger stopped writing .* which goes on: .*log.csv.*No space left"
    ) as caught:
        history = model.fit(x, y, epochs=3, verbose=0, callbacks=[CSVLogger(path, append=True)])
    monkeypatch.undo()
    assert len([w for w in caught if "stopped writing" in str(w.message)]) == 1  # once, not per epoch
    assert history.epoch == [0, 1, 2]  # the run went on
    assert path.read_text() == whole  # the partial row was cut off


def test_tensorboard_on_a_full_disk_warns_once_and_the_run_goes_on(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", full)
    board = TensorBoard(tmp_path / "tb", update_freq=1)
    with pytest.warns(FitkitWarning) as caught:
        model = _line_fit([board])
    stopped = [str(w.message) for w in caught if "TensorBoard stopped writing" in str(w.message)]
    assert len(stopped) == 1 and "No space left on device" in stopped[0]
    assert model.history.epoch == [0, 1, 2] and model.global_step == 3
    monkeypatch.undo()
    _line_fit([board])  # the next fit writes again
    assert list((tmp_path / "tb" / "train").glob("events.out.tfevents.*"))


def test_history_plot_on_a_full_disk_keeps_the_old_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    h = fitkit.callbacks.History()
    h.on_epoch_end(0, {"loss": 1.0})
    h.on_epoch_end(1, {"loss": 0.5})
    path = tmp_path / "history.png"
    h.plot(path=str(path))
    old = path.read_bytes()
    real = Figure.savefig

    def half_then_full(self, fname, **kwargs):  # part of the PNG reaches the disk, then it is full
        real(self, fname, **kwargs)
        with open(fname, "r+b") as f:
            f.truncate(100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half_then_full)
    with pytest.raises(OSError, match=r"history.png.*Fix: free space") as caught:
        h.plot(path=str(path))
    assert caught.value.errno == errno.ENOSPC
    assert path.read_bytes() == old and sorted(p.name for p in tmp_path.iterdir()) == ["history.png"]
