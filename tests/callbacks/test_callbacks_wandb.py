"""WandbLogger in W&B's offline mode: the run's own file (``run-<id>.wandb``) is read back."""

import contextlib
import importlib.util
import json
import shutil
import struct
import time

import pytest
import torch
from _tmpfs import tmpfs

import fitkit
from fitkit.callbacks import ModelCheckpoint, WandbLogger
from fitkit.checks import FitkitWarning

wandb = pytest.importorskip("wandb")
pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    # No network: the run is written under its dir (passed to each logger too: wandb reads the
    # environment once per process).
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _records(path):
    """The protobuf records of a ``.wandb`` file (LevelDB's log format: 32 KiB blocks of chunks)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def _finished_records(path):
    """The run's records once its writer has written the final ``exit`` record (wandb's service
    process may still be flushing when ``finish`` returns)."""
    for _ in range(200):
        records = list(_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        time.sleep(0.05)
    raise AssertionError(f"{path} has no exit record")


def _run(tmp_path):
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, artifacts = {}, {}, []
    for r in _finished_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[r.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "artifact":
            artifacts.append((r.artifact.name, r.artifact.type, [m.path for m in r.artifact.manifest.contents]))
    return history, config, artifacts


def _model():
    torch.manual_seed(0)
    model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    model.compile(optimizer=torch.optim.SGD(model.module.parameters(), lr=0.05), loss="mse")
    return model


def _data(n=16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g)


def test_an_offline_run_holds_config_step_and_epoch_logs_and_the_best_checkpoint(tmp_path):
    x, y = _data()
    model = _model()
    best = ModelCheckpoint(tmp_path / "best.pt", monitor="loss", save_best_only=True, save_weights_only=True)
    logger = WandbLogger(
        project="fitkit-test",
        config={"note": "digits"},
        log_every_n_steps=2,
        log_checkpoints=True,
        dir=str(tmp_path),
        mode="offline",
    )
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[logger, best])
    assert logger.run is None  # finished at the end of the fit
    steps, config, artifacts = _run(tmp_path)
    assert sorted(steps) == [2, 4, 6, 8]  # optimizer steps
    for step in (2, 6):
        assert set(steps[step]) == {"batch/loss", "batch/learning_rate"}
        assert steps[step]["batch/learning_rate"] == 0.05
    for epoch, step in ((0, 4), (1, 8)):
        assert steps[step]["epoch/epoch"] == epoch
        assert steps[step]["epoch/loss"] == history.history["loss"][epoch]  # the same float, exactly
        assert steps[step]["epoch/learning_rate"] == history.history["learning_rate"][epoch]
    # the batch log of the epoch's last step: its running mean, the epoch's loss
    assert steps[8]["batch/loss"] == pytest.approx(history.history["loss"][1], rel=1e-6)
    assert {
        k: config[k]
        for k in ("optimizer", "lr", "batch_size", "epochs", "steps_per_epoch", "loss", "num_params", "note")
    } == {
        "optimizer": "SGD",
        "lr": 0.05,
        "batch_size": 4,
        "epochs": 2,
        "steps_per_epoch": 4,
        "loss": "mse",
        "num_params": 3,
        "note": "digits",
    }
    assert len(artifacts) == 1 and artifacts[0][1:] == ("model", ["best.pt"])


def test_validations_inside_epochs_are_logged_at_their_step(tmp_path):
    x, y = _data()
    model = _model()
    history = model.fit(
        x,
        y,
        batch_size=4,
        epochs=1,
        shuffle=False,
        verbose=0,
        validation_data=(x[:8], y[:8]),
        validation_interval=2,
        callbacks=[WandbLogger(project="fitkit-test", dir=str(tmp_path), mode="offline")],
    )
    steps, _, _ = _run(tmp_path)
    assert sorted(steps) == [2, 4]
    assert set(steps[2]) == {"step/val_loss"}
    assert steps[4]["epoch/val_loss"] == history.history["val_loss"][0] == steps[4]["step/val_loss"]


def test_a_wandb_failure_warns_and_training_goes_on(tmp_path, monkeypatch):
    x, y = _data()
    model, logger = _model(), WandbLogger(project="fitkit-test", dir=str(tmp_path), mode="offline")

    def broken(*args, **kwargs):
        raise ConnectionError("the network is gone")

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", broken)
    with pytest.warns(FitkitWarning, match=r"WandbLogger: wandb.log failed \(ConnectionError: the network is gone\)"):
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[logger])
    assert model.global_step == 8  # both epochs ran
    assert logger.run is None and wandb.run is None  # the run it started is finished all the same


def test_missing_wandb_and_bad_arguments_are_named(monkeypatch):
    with pytest.raises(ValueError, match=r"log_every_n_steps.*Received: log_every_n_steps=0"):
        WandbLogger(log_every_n_steps=0)
    with pytest.raises(TypeError, match=r"`checkpoint` to be a path or a ModelCheckpoint. Received: int"):
        WandbLogger(checkpoint=3)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    expected = (
        r"Install the `wandb` extra: "
        r"`pip install '\.\[wandb\]'` from a checkout \(`pip install 'torch-fitkit\[wandb\]'`"
    )
    with pytest.raises(ImportError, match=expected):
        WandbLogger()


def test_a_run_the_user_opened_is_logged_into_and_left_open(tmp_path):
    x, y = _data()
    run = wandb.init(project="fitkit-test", dir=str(tmp_path), mode="offline", config={"mine": 1})
    try:
        logger = WandbLogger()
        _model().fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[logger])
        assert wandb.run is run  # not finished by the logger
        assert run.config["mine"] == 1 and run.config["batch_size"] == 4  # the fit's config added
        run.log({"after_fit": 1.0}, step=5)
    finally:
        run.finish()
    steps, _, _ = _run(tmp_path)
    assert steps[4]["epoch/epoch"] == 0 and steps[5] == {"after_fit": 1.0}


def _fill(folder) -> None:
    """Write zeros into ``folder`` until its disk is full."""
    with open(folder / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)


def test_a_full_disk_under_the_run_warns_once_naming_the_folder(tmp_path, monkeypatch):
    # Runs everywhere: the run's disk reads as full from the second epoch on (statvfs), as a
    # real full disk does (the test below, root only).
    x, y = _data()
    model, logger = _model(), WandbLogger(project="fitkit-test", dir=str(tmp_path), mode="offline")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=0) if model.epoch >= 1 else real(p))
    with pytest.warns(
        FitkitWarning,
        match=r"WandbLogger: the disk holding the run's folder '.*offline-run-.*' is "
        r"full \(0 bytes free\).*training goes on\. Fix",
    ) as caught:
        history = model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[logger])
    assert len([w for w in caught if "is full" in str(w.message)]) == 1  # once, at the end of epoch 2
    assert len(history.history["loss"]) == 3 and model.global_step == 12
    history, _, _ = _run(tmp_path)
    assert [h["epoch/epoch"] for h in history.values() if "epoch/epoch" in h] == [0, 1]  # none after the warning


def test_a_real_full_disk_under_the_run_warns_and_training_goes_on(tmp_path, monkeypatch):
    with tmpfs(tmp_path / "small", "8m") as folder:
        monkeypatch.setenv("WANDB_DIR", str(folder))
        x, y = _data()
        model, logger = _model(), WandbLogger(project="fitkit-test", dir=str(folder), mode="offline")
        fill = fitkit.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: epoch == 1 and _fill(folder))
        with pytest.warns(FitkitWarning, match=r"WandbLogger: the disk holding the run's folder .* is full"):
            history = model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[fill, logger])
        assert len(history.history["loss"]) == 3 and model.global_step == 12
