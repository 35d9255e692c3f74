"""File-owning callbacks: the previous backup, stale temps, loadable logs, whole CSV rows, close()."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from conftest import line_data, line_model

import fitkit
from fitkit.callbacks import BackupAndRestore, Callback, CSVLogger, LambdaCallback, ModelCheckpoint, TensorBoard
from fitkit.files import CheckpointError


class _Crash(Exception):
    pass


def _crash_at_epoch(epoch: int) -> LambdaCallback:
    def crash(e, logs):
        if e == epoch:
            raise _Crash

    return LambdaCallback(on_epoch_end=crash)


def _data():
    return line_data(32)


def _model() -> fitkit.Model:
    return line_model()


def _fit(callbacks, epochs=5):
    model = _model()
    history = model.fit(*_data(), epochs=epochs, batch_size=8, shuffle=True, callbacks=callbacks, verbose=0)
    return model, history


# -- the previous backup ----------------------------------------------------------------------
def test_a_damaged_backup_resumes_from_the_previous_one_with_a_warning(tmp_path):
    reference, ref_history = _fit([])
    folder = tmp_path / "backup"
    with pytest.raises(_Crash):
        _fit([BackupAndRestore(folder), _crash_at_epoch(3)])  # backups after epochs 0, 1, 2
    assert sorted(os.listdir(folder)) == ["backup.prev.pt", "backup.pt"]
    assert torch.load(folder / "backup.prev.pt", weights_only=True)["epoch"] == 2
    data = (folder / "backup.pt").read_bytes()
    (folder / "backup.pt").write_bytes(data[: len(data) - 100])
    with pytest.warns(
        UserWarning,
        match=r"backup .*backup.pt' is damaged, so training resumes from the previous "
        r"backup .*backup.prev.pt'",
    ):
        model, history = _fit([BackupAndRestore(folder)])
    assert history.epoch == [0, 1, 2, 3, 4] and history.history["loss"] == pytest.approx(ref_history.history["loss"])
    assert torch.equal(model.module.weight, reference.module.weight)
    assert not folder.exists()  # both deleted at a normal end


def test_without_a_previous_backup_the_damage_is_raised(tmp_path):
    folder = tmp_path / "backup"
    folder.mkdir()
    (folder / "backup.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="backup.pt' is empty"):
        _fit([BackupAndRestore(folder)])


def test_a_crash_between_keeping_the_previous_and_writing_the_new_backup(tmp_path):
    reference, _ = _fit([])
    folder = tmp_path / "backup"
    with pytest.raises(_Crash):
        _fit([BackupAndRestore(folder), _crash_at_epoch(2)])
    os.replace(folder / "backup.pt", folder / "backup.prev.pt")  # as if killed right after the rename
    model, history = _fit([BackupAndRestore(folder)])
    assert history.epoch == [0, 1, 2, 3, 4] and torch.equal(model.module.weight, reference.module.weight)


def test_a_backup_only_keeps_a_good_backup_as_the_previous_one(tmp_path):
    folder = tmp_path / "backup"
    with pytest.raises(_Crash):
        _fit([BackupAndRestore(folder), _crash_at_epoch(2)])
    (folder / "backup.pt").write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="is damaged"), pytest.raises(_Crash):
        _fit([BackupAndRestore(folder), _crash_at_epoch(2)])  # resumes at epoch 1, writes after it
    assert torch.load(folder / "backup.prev.pt", weights_only=True)["epoch"] == 1  # never the garbage
    assert torch.load(folder / "backup.pt", weights_only=True)["epoch"] == 2
    with pytest.raises(_Crash):
        _fit([BackupAndRestore(folder), _crash_at_epoch(3)])  # resumes from the good backup.pt
    assert torch.load(folder / "backup.prev.pt", weights_only=True)["epoch"] == 2
    assert torch.load(folder / "backup.pt", weights_only=True)["epoch"] == 3


# -- stale temps -------------------------------------------------------------------------------
def test_stale_temps_of_a_killed_write_are_removed_at_the_next_start(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "backup").mkdir()
    stale = [tmp_path / "ckpt" / ".ep03.pt.a1b2c3.tmp", tmp_path / "backup" / ".backup.pt.zz9.tmp"]
    kept = [tmp_path / "ckpt" / "notes.txt", tmp_path / "ckpt" / ".other.pt.a1.tmp"]
    for p in stale + kept:
        p.write_bytes(b"x" * 1000)
    crash = LambdaCallback(on_train_begin=lambda logs: (_ for _ in ()).throw(_Crash()))
    with pytest.raises(_Crash):
        _fit([ModelCheckpoint(tmp_path / "ckpt" / "ep{epoch:02d}.pt"), BackupAndRestore(tmp_path / "backup"), crash])
    assert [p.exists() for p in stale] == [False, False] and all(p.exists() for p in kept)


# -- log values that load back ---------------------------------------------------------------------
class _F1(Callback):
    """A user metric on its own held-out set, as scikit-learn returns it: a numpy float."""

    def on_epoch_end(self, epoch, logs=None):
        logs["val_f1"] = np.float64(0.5 + epoch / 10)


def test_numpy_log_values_become_floats_and_the_backup_loads_back(tmp_path):
    folder = tmp_path / "backup"
    with pytest.raises(_Crash):
        _fit([_F1(), BackupAndRestore(folder), _crash_at_epoch(2)])
    saved = torch.load(folder / "backup.pt", weights_only=True)
    assert saved["history"]["history"]["val_f1"] == [0.5, 0.6]
    model, history = _fit([_F1(), BackupAndRestore(folder)])
    assert history.history["val_f1"] == [0.5, 0.6, 0.7, 0.8, 0.9]
    assert all(type(v) is float for v in history.history["val_f1"])


class _NumpyState(Callback):
    def state_dict(self):
        return {"x": np.zeros(2)}


def test_a_callback_state_that_would_not_load_back_fails_when_written(tmp_path):
    with pytest.raises(TypeError, match=r"checkpoint\['callbacks'\]\['_NumpyState'\]\['x'\] is a numpy.ndarray"):
        _fit([_NumpyState(), BackupAndRestore(tmp_path / "backup")])
    assert not (tmp_path / "backup" / "backup.pt").exists()


# -- CSVLogger ---------------------------------------------------------------------------------
def test_csv_a_partial_last_row_is_cut_at_the_next_start(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("epoch,learning_rate,loss\n0,0.05,4.1\n1,0.05,3.")  # a kill mid-row
    _fit([CSVLogger(path, append=True)], epochs=1)
    rows = path.read_text().splitlines()
    assert rows[:2] == ["epoch,learning_rate,loss", "0,0.05,4.1"] and rows[2].startswith("0,0.05,")
    assert len(rows) == 3 and path.read_text().endswith("\n")


def test_csv_a_partial_row_after_a_crash_is_cut_when_the_backup_resumes(tmp_path):
    path, folder = tmp_path / "log.csv", tmp_path / "backup"
    with pytest.raises(_Crash):
        _fit([CSVLogger(path), BackupAndRestore(folder), _crash_at_epoch(2)])
    whole = path.read_text()
    with open(path, "a") as f:
        f.write("2,0.05,1.2")  # half of a row after the backup of epoch 1
    with pytest.raises(_Crash):
        _fit([CSVLogger(path), BackupAndRestore(folder), _crash_at_epoch(3)])  # backup after epoch 2
    rows = path.read_text().splitlines(keepends=True)
    assert "".join(rows).startswith(whole) and [r.split(",")[0] for r in rows] == ["epoch", "0", "1", "2", "3"]
    path.write_text("".join(rows[:-1])[:-3])  # the file lost the end of a row the backup had seen
    _fit([CSVLogger(path), BackupAndRestore(folder)])
    rows = path.read_text().splitlines()
    assert [r.split(",")[0] for r in rows] == ["epoch", "0", "1", "3", "4"]  # never half a row


def test_csv_rows_are_written_with_one_write_each(tmp_path, monkeypatch):
    writes = []
    real_write, path = os.write, str(tmp_path / "log.csv")

    def spy(fd, data):  # the row goes to the file by os.write, unbuffered
        if os.readlink(f"/proc/self/fd/{fd}") == path:
            writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", spy)
    _fit([CSVLogger(tmp_path / "log.csv")], epochs=3)
    assert len(writes) == 3 and writes[0].startswith(b"epoch,") and all(w.endswith(b"\n") for w in writes)


def _open_fds_to(path) -> int:
    fds = os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []
    return sum(os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(path) for fd in fds)


def test_csv_close_is_idempotent_and_no_file_stays_open(tmp_path):
    path = tmp_path / "log.csv"
    logger = CSVLogger(path)
    with pytest.raises(_Crash):
        _fit([logger, _crash_at_epoch(1)])
    assert _open_fds_to(path) == 0
    logger.close()
    logger.close()
    assert path.read_text().count("\n") == 3  # header and two whole rows


def _writer_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread" and t.is_alive()}


def test_tensorboard_close_ends_the_writer_threads(tmp_path):
    pytest.importorskip("tensorboard")
    earlier = _writer_threads()  # left by other code in this process, if any
    _fit([TensorBoard(tmp_path / "ok")], epochs=1)
    assert _writer_threads() <= earlier  # on_train_end closes
    board = TensorBoard(tmp_path / "tb")
    with pytest.raises(_Crash):
        _fit([board, _crash_at_epoch(1)])  # on_train_end never ran: fit's finally closed it
    assert _writer_threads() <= earlier
    board.close()  # idempotent
    assert _writer_threads() <= earlier
    assert os.listdir(tmp_path / "tb" / "train")  # the events written before the crash are there


# -- paths checked at construction ------------------------------------------------------------
def test_file_owning_callbacks_check_their_paths_when_built(tmp_path):
    (tmp_path / "afile").write_text("x")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match="ModelCheckpoint writes a file at `filepath`, but it is an existing folder"):
        ModelCheckpoint(tmp_path)
    with pytest.raises(ValueError, match="CSVLogger writes a file at `filename`, but it is an existing folder"):
        CSVLogger(tmp_path)
    with pytest.raises(
        ValueError, match="BackupAndRestore writes a folder at `backup_dir`, but it is an existing file"
    ):
        BackupAndRestore(tmp_path / "afile")
    with pytest.raises(ValueError, match="BackupAndRestore writes a folder at `backup_dir`, but it is empty"):
        BackupAndRestore("")
    with pytest.raises(ValueError, match="TensorBoard writes a folder at `log_dir`, but it is an existing file"):
        TensorBoard(tmp_path / "afile")
    assert sorted(os.listdir(tmp_path)) == before


def test_a_formatted_checkpoint_path_that_is_a_folder_fails_before_writing(tmp_path):
    (tmp_path / "ep01").mkdir()
    model = _model()
    with pytest.raises(ValueError, match=r"names the existing folder .*ep01'"):
        model.fit(*_data(), epochs=1, callbacks=[ModelCheckpoint(str(tmp_path / "ep{epoch:02d}"))], verbose=0)
    assert os.listdir(tmp_path) == ["ep01"] and os.listdir(tmp_path / "ep01") == []


def test_thirty_failing_fits_leak_no_writer_thread(tmp_path):
    pytest.importorskip("tensorboard")
    earlier = _writer_threads()
    for i in range(30):
        with pytest.raises(_Crash):
            _fit([TensorBoard(tmp_path / f"tb{i}"), _crash_at_epoch(0)])
    assert _writer_threads() <= earlier


def test_a_full_disk_backup_says_where_the_last_good_backup_is(tmp_path, monkeypatch):
    import errno

    import fitkit
    from fitkit.callbacks import BackupAndRestore

    torch.manual_seed(0)
    model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    real, calls = model.save_checkpoint, []

    def full_on_the_second(path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path)

    monkeypatch.setattr(model, "save_checkpoint", full_on_the_second)
    folder = tmp_path / "bk"
    with pytest.raises(
        OSError,
        match=r"while writing the backup .*backup.pt'. The last good backup was moved to "
        r"'.*backup.prev.pt' before the write and is intact.*Fix",
    ) as caught:
        model.fit(torch.zeros(4, 2), torch.zeros(4, 1), epochs=3, callbacks=[BackupAndRestore(folder)], verbose=0)
    assert caught.value.errno == errno.ENOSPC
    assert sorted(p.name for p in folder.iterdir()) == ["backup.prev.pt"]
    assert torch.load(folder / "backup.prev.pt", weights_only=True)["epoch"] == 1  # epoch 1's backup, whole
