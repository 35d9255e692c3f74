"""A callback deletes, overwrites and uploads only the files its own path template makes inside
its own folder: restored names are relative to that folder and checked against it."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import fitkit
from fitkit.callbacks import BackupAndRestore, Callback, LambdaCallback, ModelCheckpoint
from fitkit.callbacks.mlflow import MLflowLogger
from fitkit.checks import FitkitWarning
from fitkit.files import atomic_save
from fitkit.files.owned import Owned

X, Y = torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), torch.randn(8, 1)
SCORES = [0.9, 0.8, 0.7, 0.6]  # each epoch better: save_top_k=1 writes it and evicts the last


class Feed(Callback):
    def on_epoch_end(self, epoch, logs=None):
        logs["score"] = SCORES[epoch]


class Crash(Exception):
    pass


def _model():
    torch.manual_seed(0)
    model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    return model


def _callbacks(folder, crash_at=None):
    def crash(epoch, logs):
        if epoch == crash_at:
            raise Crash()

    ckpt = ModelCheckpoint(
        folder / "ep{epoch:02d}.pt", monitor="score", mode="min", save_top_k=1, save_weights_only=True
    )
    return [Feed(), ckpt, BackupAndRestore(folder / "bk"), LambdaCallback(on_epoch_begin=crash)], ckpt


def _crashed_run(folder):
    cbs, _ = _callbacks(folder, crash_at=2)
    with pytest.raises(Crash):
        _model().fit(X, Y, epochs=4, callbacks=cbs, verbose=0)
    assert sorted(os.listdir(folder)) == ["bk", "ep02.pt"]


def test_a_copied_run_folder_resumes_with_its_own_files_and_never_deletes_the_originals(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _crashed_run(a)
    original = (a / "ep02.pt").read_bytes()
    shutil.copytree(a, b)
    cbs, ckpt = _callbacks(b)
    _model().fit(X, Y, epochs=4, callbacks=cbs, verbose=0)
    assert (a / "ep02.pt").read_bytes() == original  # the original run's file is untouched
    assert sorted(os.listdir(b)) == ["ep04.pt"]  # the copy's own ep02, ep03 were evicted
    assert ckpt.best_path == str(b / "ep04.pt") and ckpt.kept == [(0.6, str(b / "ep04.pt"))]


def test_a_backup_edited_to_list_a_file_outside_the_folder_never_deletes_it(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    precious = outside / "precious.txt"
    precious.write_text("keep me")
    also = tmp_path / "run" / "notes.txt"  # inside the folder, but not a file of the template
    _crashed_run(run)
    also.write_text("mine")
    backup = run / "bk" / "backup.pt"
    state = torch.load(backup, weights_only=True)
    state["callbacks"]["ModelCheckpoint"]["kept"] = [
        [0.1, "../outside/precious.txt"],
        [0.2, str(precious)],
        [0.3, "notes.txt"],
    ]
    state["callbacks"]["ModelCheckpoint"]["best_path"] = "../outside/precious.txt"
    atomic_save(state, backup)  # the checksum is recomputed: the file is "intact"
    cbs, ckpt = _callbacks(run)
    with pytest.warns(FitkitWarning, match="not a file of .*ep\\{epoch:02d\\}.pt.* it is ignored") as caught:
        _model().fit(X, Y, epochs=4, callbacks=cbs, verbose=0)
    assert len([w for w in caught if "is ignored" in str(w.message)]) == 4  # best_path and 3 kept names
    assert precious.read_text() == "keep me" and also.read_text() == "mine"
    assert sorted(os.listdir(run)) == ["ep02.pt", "ep04.pt", "notes.txt"]  # ep02 left the list: kept
    assert ckpt.kept == [(0.6, str(run / "ep04.pt"))]


def test_an_old_checkpoint_with_absolute_names_is_accepted_inside_the_folder_only(tmp_path):
    ckpt = ModelCheckpoint(tmp_path / "run" / "ep{epoch:02d}.pt", monitor="score", save_top_k=2)
    inside, outside = str(tmp_path / "run" / "ep03.pt"), str(tmp_path / "ep03.pt")
    with pytest.warns(FitkitWarning, match="ignored"):
        ckpt.load_state_dict(
            {"best": 0.5, "best_path": inside, "kept": [[0.5, inside], [0.7, outside]], "batches_seen": 0}
        )
    assert ckpt.kept == [(0.5, inside)] and ckpt.best_path == inside
    assert ckpt.state_dict()["kept"] == [[0.5, "ep03.pt"]]  # stored relative from now on


def test_owned_is_the_template_pattern_inside_its_folder(tmp_path):
    owned = Owned(str(tmp_path / "r" / "{epoch}" / "m{epoch:02d}.pt"), "ModelCheckpoint")
    assert owned.root == str(tmp_path / "r")
    assert owned.owns(tmp_path / "r" / "3" / "m03.pt")
    assert not owned.owns(tmp_path / "r" / "3" / "x03.pt")
    assert not owned.owns(tmp_path / "r" / ".." / "m03.pt")
    link = tmp_path / "r" / "link"
    (tmp_path / "r").mkdir()
    link.symlink_to(tmp_path)  # a folder link that leads out of the folder
    assert not owned.owns(link / "m03.pt")


def test_mlflow_uploads_only_a_file_its_checkpoint_owns(tmp_path):
    ckpt = ModelCheckpoint(tmp_path / "run" / "best.pt", save_best_only=True, monitor="loss")
    logger = MLflowLogger(tracking_uri=f"sqlite:///{tmp_path}/m.db", checkpoint=ckpt)
    ckpt.best_path = str(tmp_path / "run" / "best.pt")
    assert logger._best_checkpoint() == str(tmp_path / "run" / "best.pt")
    ckpt.best_path = str(tmp_path / "secret.pt")
    with pytest.warns(FitkitWarning, match="not a file of the ModelCheckpoint's filepath"):
        assert logger._best_checkpoint() is None
