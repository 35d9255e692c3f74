"""Every file of a sharded checkpoint is covered by a SHA-256 recorded at save (its manifest) and
checked before a load: a flipped byte, a truncation, a shard of another run, an extra or a missing
file are named and change nothing; BackupAndRestore falls back past them; a folder written before
manifests existed still loads. A save killed between its two renames loses nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch import nn

import fitkit
from fitkit.files import CheckpointError, consolidate_weights
from fitkit.files.manifest import MANIFEST_NAME, verify_manifest
from fitkit.files.swap import kept_copy

pytestmark = pytest.mark.slow  # the first import of torch.distributed.checkpoint


def _model(seed: int = 0) -> fitkit.Model:
    torch.manual_seed(seed)
    model = fitkit.Model(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)), device="cpu")
    model.compile(optimizer="adam", loss="mse")
    return model


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g)


def _trained(path, seed: int = 0) -> fitkit.Model:
    model = _model(seed)
    model.fit(*_data(), batch_size=4, epochs=1, verbose=0)
    model.save_checkpoint(path, sharded=True)
    return model


def _everything(model):
    import copy

    return copy.deepcopy(model.module.state_dict()), copy.deepcopy(model.optimizer.state_dict())


def _same(a, b) -> bool:
    (ma, oa), (mb, ob) = a, b
    if ma.keys() != mb.keys() or not all(torch.equal(ma[k], mb[k]) for k in ma):
        return False
    if oa["state"].keys() != ob["state"].keys():
        return False
    return all(
        torch.equal(torch.as_tensor(oa["state"][i][f]), torch.as_tensor(ob["state"][i][f]))
        for i in oa["state"]
        for f in oa["state"][i]
    )


def _flip(file, where: float) -> None:
    data = bytearray(file.read_bytes())
    i = min(len(data) - 1, max(0, int(len(data) * where)))
    data[i] ^= 0x01
    file.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    import hashlib

    _trained(tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_text())
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == sorted([".metadata", "__0_0.distcp", "fitkit_state.pt", MANIFEST_NAME])
    assert manifest["format"] == 1 and sorted(manifest["files"]) == [n for n in names if n != MANIFEST_NAME]
    for name, record in manifest["files"].items():
        data = (tmp_path / "ck" / name).read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_an_async_save_writes_the_manifest_last_in_the_background(tmp_path):
    from fitkit.distributed import dcp

    model = _model()
    model.fit(*_data(), batch_size=4, epochs=1, verbose=0)
    model.save_checkpoint(tmp_path / "ck", sharded=True, async_save=True)
    dcp.wait()
    assert verify_manifest(tmp_path / "ck") is True
    assert sorted(json.loads((tmp_path / "ck" / MANIFEST_NAME).read_text())["files"]) == [
        ".metadata",
        "__0_0.distcp",
        "fitkit_state.pt",
    ]


_FILES = [".metadata", "__0_0.distcp", "fitkit_state.pt"]


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("name", _FILES)
def test_a_flipped_byte_in_any_file_is_named_and_nothing_changes(tmp_path, name, where):
    _trained(tmp_path / "ck")
    _flip(tmp_path / "ck" / name, where)
    model = _model(seed=3)
    model.fit(*_data(), batch_size=4, epochs=1, verbose=0)  # an optimizer state to keep
    before = _everything(model)
    with pytest.raises(CheckpointError, match=rf"{name}'") as info:  # the file named, whatever check sees it
        model.load_checkpoint(tmp_path / "ck")
    assert str(tmp_path / "ck") in str(info.value)
    assert _same(_everything(model), before) and model._core.pop_resume() is None
    with pytest.raises(CheckpointError, match=rf"{name}'"):
        consolidate_weights(tmp_path / "ck", tmp_path / "w.pt")
    assert not (tmp_path / "w.pt").exists()


def test_a_byte_flip_in_a_shard_is_caught_by_its_digest(tmp_path):
    # The flip keeps the size and the index, so only the digest can see it.
    _trained(tmp_path / "ck")
    _flip(tmp_path / "ck" / "__0_0.distcp", 0.5)
    with pytest.raises(CheckpointError, match=r"its file '__0_0\.distcp' does not match its manifest \(SHA-256"):
        _model().load_checkpoint(tmp_path / "ck")


def test_a_truncated_state_file_is_named(tmp_path):
    _trained(tmp_path / "ck")
    state = tmp_path / "ck" / "fitkit_state.pt"
    size = state.stat().st_size
    with open(state, "r+b") as f:
        f.truncate(size - 3)
    message = rf"its file 'fitkit_state\.pt' has {size - 3} bytes, its manifest records {size} \(truncated\)"
    with pytest.raises(CheckpointError, match=message):
        _model().load_checkpoint(tmp_path / "ck")


def test_a_shard_of_another_run_is_named_and_nothing_changes(tmp_path):
    _trained(tmp_path / "ck", seed=0)
    _trained(tmp_path / "other", seed=5)  # same shapes, other values
    mine, theirs = tmp_path / "ck" / "__0_0.distcp", tmp_path / "other" / "__0_0.distcp"
    assert mine.read_bytes() != theirs.read_bytes()
    shutil.copyfile(theirs, mine)
    model = _model(seed=3)
    model.fit(*_data(), batch_size=4, epochs=1, verbose=0)
    before = _everything(model)
    with pytest.raises(CheckpointError, match=r"its file '__0_0\.distcp' does not match its manifest"):
        model.load_checkpoint(tmp_path / "ck")
    assert _same(_everything(model), before)


def test_an_extra_or_a_missing_file_is_named(tmp_path):
    _trained(tmp_path / "ck")
    shutil.copyfile(tmp_path / "ck" / "__0_0.distcp", tmp_path / "ck" / "__1_0.distcp")
    with pytest.raises(CheckpointError, match=r"it holds '__1_0\.distcp', a file its manifest does not list"):
        _model().load_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "__1_0.distcp").unlink()
    (tmp_path / "ck" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"'__0_0\.distcp' is missing"):
        _model().load_checkpoint(tmp_path / "ck")


def test_a_damaged_manifest_is_named(tmp_path):
    _trained(tmp_path / "ck")
    (tmp_path / "ck" / MANIFEST_NAME).write_text('{"format": 1, "files": {"x": {"size": "3"}}}')
    with pytest.raises(CheckpointError, match=rf"its {MANIFEST_NAME} does not list files"):
        _model().load_checkpoint(tmp_path / "ck")


def test_a_newest_backup_with_a_flipped_byte_falls_back_to_the_previous_one(tmp_path):
    _trained(tmp_path / "backup.prev.pt")  # epoch 1 done, 4 steps
    newest = _model()
    newest.fit(*_data(), batch_size=2, epochs=1, verbose=0)  # epoch 1 done, 8 steps
    newest.save_checkpoint(tmp_path / "backup.pt", sharded=True)
    _flip(tmp_path / "backup.pt" / "__0_0.distcp", 0.5)
    resumed = _model(seed=3)
    with pytest.warns(
        fitkit.checks.FitkitWarning,
        match=r"(?s)is damaged, so training resumes from the previous "
        r"backup.*'__0_0\.distcp' does not match its manifest",
    ):
        history = resumed.fit(
            *_data(), batch_size=4, epochs=2, verbose=0, callbacks=[fitkit.callbacks.BackupAndRestore(tmp_path)]
        )
    assert history.epoch == [0, 1] and resumed.global_step == 4 + 4  # from the newest: 8 + 4


def test_a_folder_without_a_manifest_loads_as_before_without_a_warning(tmp_path):
    model = _trained(tmp_path / "ck")
    (tmp_path / "ck" / MANIFEST_NAME).unlink()  # as written before manifests existed
    assert verify_manifest(tmp_path / "ck") is False
    other = _model(seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert other.load_checkpoint(tmp_path / "ck") == 1
    assert _same(_everything(other), _everything(model))


# -- a save killed between its two renames --------------------------------------------------
CHILD = """
import os, sys, time, torch, fitkit
from torch import nn
out = sys.argv[1]
torch.manual_seed(0)
model = fitkit.Model(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)), device="cpu")
model.compile(optimizer="adam", loss="mse")
x, y = torch.randn(16, 3), torch.randn(16, 1)
model.fit(x, y, batch_size=4, epochs=1, verbose=0)
model.save_checkpoint(os.path.join(out, "ck"), sharded=True)
torch.save(model.module.state_dict(), os.path.join(out, "first.pt"))
model.fit(x, y, batch_size=4, epochs=1, verbose=0)
plain_replace = os.replace
def pausing_replace(src, dst):
    plain_replace(src, dst)
    if os.path.basename(os.fspath(dst)) == ".ck.old":  # the old checkpoint moved aside; the new not yet in
        open(os.path.join(out, "between"), "w").close()
        time.sleep(600)
os.replace = pausing_replace
model.save_checkpoint(os.path.join(out, "ck"), sharded=True)
"""


def test_a_save_killed_between_its_renames_loses_nothing(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "between").exists():
            assert child.poll() is None, "the child ended before it reached the renames"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    ck = tmp_path / "ck"
    assert not ck.exists() and kept_copy(ck).is_dir() and (tmp_path / ".ck.tmp").is_dir()
    first = torch.load(tmp_path / "first.pt", weights_only=True)
    resumed = _model(seed=3)
    assert resumed.load_checkpoint(ck) == 1  # the old checkpoint, found at its kept name
    assert all(torch.equal(v, first[k]) for k, v in resumed.module.state_dict().items())

    # The next save puts the old one back before anything else: a failing save leaves it in place.
    def failing_write(self, plan, planner):
        raise OSError(28, "No space left on device", "__0_0.distcp")

    with monkeypatch.context() as m:
        m.setattr(FileSystemWriter, "write_data", failing_write)
        with pytest.raises(OSError):
            resumed.save_checkpoint(ck, sharded=True)
    assert ck.is_dir() and not kept_copy(ck).exists() and verify_manifest(ck)
    resumed.fit(*_data(), batch_size=4, epochs=2, initial_epoch=1, verbose=0)
    resumed.save_checkpoint(ck, sharded=True)  # a complete save replaces it and leaves no copy behind
    assert sorted(os.listdir(tmp_path)) == ["between", "ck", "first.pt"]
    again = _model(seed=4)
    assert again.load_checkpoint(ck) == 2
    assert all(torch.equal(v, resumed.module.state_dict()[k]) for k, v in again.module.state_dict().items())


def test_backup_and_restore_resumes_from_a_backup_kept_by_a_cut_swap(tmp_path):
    _trained(tmp_path / "backup.prev.pt")  # 4 steps
    newest = _model()
    newest.fit(*_data(), batch_size=2, epochs=1, verbose=0)  # 8 steps
    newest.save_checkpoint(tmp_path / "backup.pt", sharded=True)
    os.replace(tmp_path / "backup.pt", kept_copy(tmp_path / "backup.pt"))  # a kill between the two renames
    resumed = _model(seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = resumed.fit(
            *_data(),
            batch_size=4,
            epochs=2,
            verbose=0,
            callbacks=[fitkit.callbacks.BackupAndRestore(tmp_path, delete_checkpoint=False)],
        )
    assert history.epoch == [0, 1] and resumed.global_step == 8 + 4  # the newest backup, not the previous one
    assert sorted(p for p in os.listdir(tmp_path) if not p.endswith(".lock")) == ["backup.prev.pt", "backup.pt"]
    assert (tmp_path / "backup.pt").is_file()  # one process writes one-file backups


def test_a_swap_cut_after_its_second_rename_keeps_the_new_checkpoint(tmp_path):
    from fitkit.files.swap import readable_path, restore_interrupted, swap_into_place

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "f").write_text("new")
    kept_copy(tmp_path / "ck").mkdir()  # the old one, not yet deleted when the kill came
    (kept_copy(tmp_path / "ck") / "f").write_text("old")
    assert readable_path(tmp_path / "ck") == tmp_path / "ck"
    assert restore_interrupted(tmp_path / "ck") is False and (tmp_path / "ck" / "f").read_text() == "new"
    (tmp_path / "next").mkdir()
    (tmp_path / "next" / "f").write_text("next")
    swap_into_place(tmp_path / "next", tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"] and (tmp_path / "ck" / "f").read_text() == "next"
