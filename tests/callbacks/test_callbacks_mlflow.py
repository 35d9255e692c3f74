"""MLflowLogger against a real MLflow store (SQLite in a temporary folder), read back with MlflowClient."""

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tmpfs import tmpfs
from torch import nn

import fitkit
from fitkit.callbacks import BackupAndRestore, Callback, CSVLogger, MLflowLogger, ModelCheckpoint
from fitkit.callbacks import mlflow as mlflow_module

ROOT = Path(__file__).resolve().parents[2]
mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=g)
    return x, x.sum(1, keepdim=True)


def _model(accumulate=1):
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(3, 1), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        loss="mse",
        metrics=["mae"],
        gradient_accumulation_steps=accumulate,
    )
    return model


def _steps(client, run_id, key):
    return [m.step for m in client.get_metric_history(run_id, key)]


def _files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def test_params_metrics_and_artifacts_of_a_fit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anything written to the working directory would show below
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    (tmp_path / "store").mkdir()
    x, y = _data()
    model = _model(accumulate=2)
    best = ModelCheckpoint(tmp_path / "ckpt" / "best.pt", monitor="val_loss", save_best_only=True)
    logger = MLflowLogger(uri, experiment_name="unit", run_name="linear", log_every_n_steps=2, tags={"k": 1})
    history = model.fit(x, y, epochs=3, batch_size=2, validation_split=0.25, verbose=0, callbacks=[logger, best])
    client = MlflowClient(uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "linear" and run.data.tags["k"] == "1"
    assert client.get_experiment(run.info.experiment_id).name == "unit"
    params = run.data.params
    assert params["optimizer"] == "SGD" and float(params["lr"]) == 0.05
    assert params["epochs"] == "3" and params["precision"] == "32" and params["num_params"] == "4"
    assert params["gradient_accumulation_steps"] == "2" and params["loss"] == "mse"
    assert params["steps_per_epoch"] == "6" and params["module"] == "Linear"
    assert params.get("batch_size", "2") == "2"  # once fit hands batch_size to its callbacks
    for key in ("loss", "mae", "val_loss", "val_mae", "learning_rate"):
        metrics = client.get_metric_history(logger.run_id, key)
        assert [m.step for m in metrics] == [0, 1, 2], key
        assert [m.value for m in metrics] == history.history[key], key
    # 12 training samples, batches of 2, 2 batches per step: steps 1..9; every 2nd is logged.
    assert _steps(client, logger.run_id, "batch_loss") == [2, 4, 6, 8]
    artifacts = sorted(a.path for a in client.list_artifacts(logger.run_id))
    assert artifacts == ["checkpoints", "history.png"]
    assert [a.path for a in client.list_artifacts(logger.run_id, "checkpoints")] == ["checkpoints/best.pt"]
    # The store, its artifacts and the checkpoint: nothing else, nothing in the working directory.
    store = _files(tmp_path / "store")
    assert "mlflow.db" in store and all(f == "mlflow.db" or f.startswith("mlruns") for f in store)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "store"]


class KillAfter(Callback):
    """Raises at the end of an epoch, before the backup of that epoch is written."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt("killed")


def test_a_resumed_fit_logs_into_the_same_run(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    x, y = _data()
    backup = tmp_path / "backup"
    model = _model()
    first = MLflowLogger(uri, experiment_name="resume", log_every_n_steps=4, log_plot=False)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, epochs=4, batch_size=4, verbose=0, callbacks=[first, BackupAndRestore(backup), KillAfter(1)])
    first.close()  # what fit does with its callbacks when it raises
    first.close()  # idempotent
    client = MlflowClient(uri)
    assert client.get_run(first.run_id).info.status == "FAILED"
    # Epoch 1 was logged but not backed up: the resumed fit replays it.
    assert _steps(client, first.run_id, "loss") == [0, 1]

    model = _model()  # a new process: new objects, the backup on disk
    second = MLflowLogger(uri, experiment_name="resume", log_every_n_steps=4, log_plot=False)
    history = model.fit(x, y, epochs=4, batch_size=4, verbose=0, callbacks=[second, BackupAndRestore(backup)])
    assert second.run_id == first.run_id
    runs = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    metrics = client.get_metric_history(second.run_id, "loss")
    assert [m.step for m in metrics] == [0, 1, 2, 3]  # each epoch once
    assert [m.value for m in metrics] == history.history["loss"]  # the values the history holds
    assert _steps(client, second.run_id, "batch_loss") == [4, 8, 12, 16]
    assert runs[0].data.params["optimizer"] == "SGD" and runs[0].data.params["epochs"] == "4"


def test_default_store_is_sqlite_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logger = MLflowLogger(experiment_name="default-store", log_plot=False)
    assert logger.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    x, y = _data()
    _model().fit(x, y, epochs=2, batch_size=8, verbose=0, callbacks=[logger])
    assert (tmp_path / "mlflow.db").is_file()
    assert _steps(MlflowClient(logger.tracking_uri), logger.run_id, "loss") == [0, 1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    assert MLflowLogger().tracking_uri == "sqlite:///elsewhere.db"


def test_a_failed_fit_ends_its_run_and_a_second_fit_starts_a_new_one(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    x, y = _data()
    model = _model()
    logger = MLflowLogger(uri, experiment_name="two", log_plot=False)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, epochs=3, batch_size=8, verbose=0, callbacks=[logger, KillAfter(0)])
    logger.close()
    failed = logger.run_id
    model.fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[logger])
    logger.close()  # after on_train_end: nothing to do
    client = MlflowClient(uri)
    assert logger.run_id != failed
    assert client.get_run(failed).info.status == "FAILED"
    assert client.get_run(logger.run_id).info.status == "FINISHED"


def test_only_rank_zero_logs(tmp_path, monkeypatch):
    monkeypatch.setattr(mlflow_module, "is_rank_zero", lambda: False)
    x, y = _data()
    logger = MLflowLogger(f"sqlite:///{tmp_path}/mlflow.db", log_every_n_steps=1)
    _model().fit(x, y, epochs=2, batch_size=8, verbose=0, callbacks=[logger, CSVLogger(tmp_path / "log.csv")])
    logger.close()
    assert logger.run_id is None and not (tmp_path / "mlflow.db").exists()


def test_a_given_checkpoint_path_is_logged(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    weights = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(1)}, weights)
    logger = MLflowLogger(uri, experiment_name="given", checkpoint=weights, log_plot=False)
    x, y = _data()
    _model().fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[logger])
    paths = [a.path for a in MlflowClient(uri).list_artifacts(logger.run_id, "checkpoints")]
    assert paths == ["checkpoints/weights.pt"]


def test_bad_arguments(monkeypatch):
    with pytest.raises(
        ValueError,
        match=r"Expected `log_every_n_steps` to be a positive int or None\. "
        r"Received: log_every_n_steps=0\.",
    ):
        MLflowLogger("sqlite:///x.db", log_every_n_steps=0)
    with pytest.raises(TypeError, match="Expected `checkpoint` to be a path or a ModelCheckpoint. Received: int."):
        MLflowLogger("sqlite:///x.db", checkpoint=3)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "mlflow" else real(n, *a))
    expected = (
        r"needs mlflow\. Install the `mlflow` extra: "
        r"`pip install '\.\[mlflow\]'` from a checkout \(`pip install 'torch-fitkit\[mlflow\]'`"
    )
    with pytest.raises(ImportError, match=expected):
        MLflowLogger("sqlite:///x.db")


@pytest.mark.slow
def test_each_validation_inside_an_epoch_is_logged_at_its_step(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    x, y = _data()
    logger = MLflowLogger(uri, experiment_name="steps", log_plot=False)
    history = _model().fit(
        x, y, epochs=2, batch_size=4, validation_data=(x, y), validation_interval=3, verbose=0, callbacks=[logger]
    )
    client = MlflowClient(uri)
    metrics = client.get_metric_history(logger.run_id, "step_val_loss")
    # 4 steps per epoch: validations at global steps 3 and 6
    assert [m.step for m in metrics] == [v["step"] for v in history.validations] == [3, 6]
    assert [m.value for m in metrics] == pytest.approx([v["val_loss"] for v in history.validations], rel=1e-12)
    assert _steps(client, logger.run_id, "val_loss") == [0, 1]  # the epoch logs: each epoch's last validation


# -- a store that cannot be written, and two runs creating one store ------------------------
def test_a_store_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    x, y = _data()
    logger = MLflowLogger(
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", log_every_n_steps=1, experiment_name="e"
    )  # its artifacts next to the store, not in the working directory
    model = _model()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[logger])  # the store exists, a run in it

    calls = []

    def full(*args, **kwargs):
        calls.append(kwargs)
        raise mlflow.exceptions.MlflowException("(sqlite3.OperationalError) database or disk is full")

    monkeypatch.setattr(logger._client, "log_batch", full)
    with pytest.warns(
        fitkit.FitkitWarning,
        match=r"MLflowLogger stopped writing to sqlite:///.*mlflow.db for the rest "
        r"of this fit, which goes on: .*disk is full.*Fix",
    ) as caught:
        history = model.fit(x, y, batch_size=4, epochs=3, initial_epoch=1, verbose=0, callbacks=[logger])
    assert len([w for w in caught if "stopped writing" in str(w.message)]) == 1 and len(calls) == 1
    assert len(history.history["loss"]) == 2 and model.global_step == 12  # the two epochs trained

    reference = _model()
    reference.fit(x, y, batch_size=4, epochs=3, verbose=0)
    for p, q in zip(model.module.parameters(), reference.module.parameters(), strict=True):
        assert torch.equal(p, q)
    monkeypatch.undo()
    model.fit(x, y, batch_size=4, epochs=4, initial_epoch=3, verbose=0, callbacks=[logger])  # the next fit writes
    assert _steps(MlflowClient(logger.tracking_uri), logger.run_id, "loss") == [3]


def test_a_full_disk_under_a_real_store_warns_and_training_goes_on(tmp_path):
    with tmpfs(tmp_path / "small", "1200k") as folder:  # root only: the test above runs everywhere
        x, y = _data()
        logger = MLflowLogger(
            tracking_uri=f"sqlite:///{folder}/mlflow.db", experiment_name="e", log_every_n_steps=1, log_plot=False
        )
        model = _model()
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[logger])
        with open(folder / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:  # the rest of the disk
                f.write(b"\0" * 4096)
        with pytest.warns(fitkit.FitkitWarning, match=r"MLflowLogger stopped writing .* which goes on"):
            history = model.fit(x, y, batch_size=4, epochs=41, initial_epoch=1, verbose=0, callbacks=[logger])
        assert len(history.history["loss"]) == 40 and model.global_step == 164


_CHILD = """
import os, sys, time, warnings
import torch, fitkit
from fitkit.callbacks import MLflowLogger
warnings.simplefilter("error", fitkit.FitkitWarning)  # a failed write ends this child
folder, me = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
model.compile(optimizer="sgd", loss="mse")
logger = MLflowLogger(tracking_uri=f"sqlite:///{folder}/store/mlflow.db", experiment_name="e")
open(os.path.join(folder, "ready-" + me), "w").close()
while len([f for f in os.listdir(folder) if f.startswith("ready-")]) < 2:  # both start the store at once
    time.sleep(0.001)
model.fit(torch.ones(8, 2), torch.ones(8, 1), epochs=2, verbose=0, callbacks=[logger])
print(logger.run_id)
"""


def test_two_runs_creating_a_new_sqlite_store_at_once_both_log(tmp_path):
    (tmp_path / "store").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path), me],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for me in "ab"
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    client = MlflowClient(f"sqlite:///{tmp_path}/store/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted(out.strip() for out, _ in outs)
    for r in runs:
        assert _steps(client, r.info.run_id, "loss") == [0, 1] and r.info.status == "FINISHED"
