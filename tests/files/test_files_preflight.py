"""Before step 1, each file callback checks that it can write where it is told to: a read-only
folder, an unformattable template and a name past the file system's limits fail at once."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile

import pytest
import torch
from _tmpfs import tmpfs

import fitkit
from fitkit.callbacks import BackupAndRestore, CSVLogger, ModelCheckpoint, TensorBoard
from fitkit.callbacks.mlflow import MLflowLogger
from fitkit.files.preflight import check_name_lengths, check_writable, format_with_dummies

X, Y = torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), torch.randn(8, 1)


def _model():
    torch.manual_seed(0)
    model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    return model


def _read_only(monkeypatch, folder):
    """The folder as the OS reports it when it is read-only (the tests may run as root, who may
    write anywhere; a real chmod is tested below for other users)."""
    real = os.access
    monkeypatch.setattr(
        os,
        "access",
        lambda p, mode, **kw: False if os.path.abspath(p) == str(folder) and mode & os.W_OK else real(p, mode, **kw),
    )


MAKERS = {
    "ModelCheckpoint": lambda d: ModelCheckpoint(d / "ep{epoch}.pt"),
    "ModelCheckpoint save_last": lambda d: ModelCheckpoint(d / "sub" / "m.pt", save_last=d / "last.pt"),
    "BackupAndRestore": lambda d: BackupAndRestore(d / "bk"),
    "CSVLogger": lambda d: CSVLogger(d / "log.csv"),
    "TensorBoard": lambda d: TensorBoard(d / "tb"),
    "MLflowLogger": lambda d: MLflowLogger(tracking_uri=f"sqlite:///{d}/mlflow.db"),
}


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_read_only_folder_is_refused_before_step_1_for_every_file_callback(tmp_path, monkeypatch, name):
    if name == "TensorBoard":
        pytest.importorskip("tensorboard")
    callback = MAKERS[name](tmp_path)
    _read_only(monkeypatch, tmp_path)
    model = _model()
    before = model.module.weight.clone()
    with pytest.raises(
        PermissionError, match=f"{name.split()[0]} writes under `.*`, but the folder '{tmp_path}'.*not writable.*Fix"
    ):
        model.fit(X, Y, epochs=2, callbacks=[callback], verbose=0)
    assert torch.equal(model.module.weight, before) and model.global_step == 0
    assert os.listdir(tmp_path) == []


@contextlib.contextmanager
def _really_read_only(folder):
    """``folder`` made read-only by the OS itself: chmod for a user; root writes through chmod, so
    for root a read-only tmpfs is mounted over it (root may mount here)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    with tmpfs(folder, "64k", read_only=True):
        yield


def test_a_really_read_only_folder_is_refused_before_step_1(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    with _really_read_only(folder):
        assert not os.access(folder, os.W_OK)  # the OS itself refuses, for this user
        model = _model()
        before = model.module.weight.clone()
        with pytest.raises(
            PermissionError, match=f"CSVLogger writes under `.*`, but the folder '{folder}'.*not writable.*Fix"
        ):
            model.fit(X, Y, epochs=1, callbacks=[CSVLogger(folder / "log.csv")], verbose=0)
        assert torch.equal(model.module.weight, before) and model.global_step == 0
        assert os.listdir(folder) == []


def test_save_weights_in_a_read_only_folder_names_the_file_not_its_temp(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / ".w.pt.123-abc.tmp"))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(PermissionError, match=f"Cannot write '{tmp_path}/w.pt': the folder .* not writable.*Fix") as e:
        _model().save_weights(tmp_path / "w.pt")
    assert ".tmp" not in str(e.value)


def test_templates_are_formatted_with_values_of_the_planned_types():
    assert (
        format_with_dummies("{epoch:03d}-{batch}-{val_loss:.3f}.pt", {"epoch", "batch", "val_loss"}, "M", "f")
        == "001-1-0.500.pt"
    )
    for template in ["{epoch:s}.pt", "{val_loss:d}.pt", "{epoch.real.x}.pt"]:
        with pytest.raises(ValueError, match="cannot format the values it will get"):
            format_with_dummies(template, {"epoch", "val_loss"}, "ModelCheckpoint", "filepath")


def test_names_and_paths_past_the_limits_are_refused(tmp_path):
    check_name_lengths(str(tmp_path / ("a" * 233)), "CSVLogger", "filename")  # 233 + 22 = 255 fits
    with pytest.raises(ValueError, match="of 256 bytes .* past this file system's limit of 255"):
        check_name_lengths(str(tmp_path / ("a" * 234)), "CSVLogger", "filename")
    deep = str(tmp_path / "/".join(["d" * 200] * 21))
    with pytest.raises(ValueError, match="makes a path of .* bytes .* limit of 4096"):
        check_name_lengths(deep, "CSVLogger", "filename")
    check_writable(tmp_path / "not" / "yet", "CSVLogger", "filename")  # made at the first write
