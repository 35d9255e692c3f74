"""ModelCheckpoint: the final step of a run that ends between saves is saved (Trainer,
torchtitan), and keep_last=N keeps the N newest files it wrote (the Trainer's
save_total_limit), never the best one, across a resume. Which files exist is asserted exactly."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import BackupAndRestore, LambdaCallback, ModelCheckpoint


def _model() -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    return model


def _files(folder) -> list[str]:
    return sorted(p for p in os.listdir(folder) if p.endswith(".pt"))


X, Y = torch.zeros(20, 1), torch.zeros(20, 1)


def test_the_final_step_between_two_saves_is_saved(tmp_path):
    model = _model()
    model.fit(
        X,
        Y,
        batch_size=1,
        max_steps=9,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path / "s{step}.pt", save_freq=5, save_weights_only=True)],
    )
    assert _files(tmp_path) == ["s5.pt", "s9.pt"]
    saved = torch.load(tmp_path / "s9.pt", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in model.module.state_dict().items())  # the final weights


def test_a_run_ending_on_a_multiple_writes_no_second_file(tmp_path):
    _model().fit(
        X,
        Y,
        batch_size=1,
        max_steps=10,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path / "s{step}.pt", save_freq=5, save_weights_only=True, save_last=True)],
    )
    assert _files(tmp_path) == ["last.pt", "s10.pt", "s5.pt"]


def test_keep_last_keeps_the_newest_files_oldest_deleted_first(tmp_path):
    (tmp_path / "e9.pt").write_bytes(b"not ours")  # a file of the pattern it did not write: kept
    _model().fit(
        X,
        Y,
        batch_size=10,
        epochs=5,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path / "e{epoch}.pt", save_weights_only=True, keep_last=2)],
    )
    assert _files(tmp_path) == ["e4.pt", "e5.pt", "e9.pt"]


def test_keep_last_never_deletes_the_best_file(tmp_path):
    scores = iter([1.0, 0.5, 0.9, 0.8, 0.7])  # the best at epoch 2
    score = LambdaCallback(on_epoch_end=lambda e, logs: logs.__setitem__("score", next(scores)))
    _model().fit(
        X,
        Y,
        batch_size=10,
        epochs=5,
        verbose=0,
        callbacks=[
            score,
            ModelCheckpoint(tmp_path / "e{epoch}.pt", monitor="score", mode="min", save_best_only=True, keep_last=1),
        ],
    )
    assert _files(tmp_path) == ["e2.pt"]  # epochs 1 and 2 improved; the best stays


class _Crash(Exception):
    pass


def _rotating_run(folder, backup, crash_at: int | None = None):
    model = _model()

    def crash(epoch, logs):
        if epoch == crash_at:
            raise _Crash

    model.fit(
        X,
        Y,
        batch_size=10,
        epochs=6,
        verbose=0,
        callbacks=[
            ModelCheckpoint(folder / "e{epoch}.pt", save_weights_only=True, keep_last=2),
            BackupAndRestore(backup),
            LambdaCallback(on_epoch_end=crash),
        ],
    )


def test_a_resumed_run_goes_on_rotating(tmp_path):
    with pytest.raises(_Crash):
        _rotating_run(tmp_path / "ckpt", tmp_path / "backup", crash_at=2)  # in epoch 3, before its saves
    assert _files(tmp_path / "ckpt") == ["e1.pt", "e2.pt"]
    _rotating_run(tmp_path / "ckpt", tmp_path / "backup")
    # the restored list [e1, e2] rotates on: without it, e1 and e2 would stay beside e5 and e6
    assert _files(tmp_path / "ckpt") == ["e5.pt", "e6.pt"]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"keep_last": 0}, ValueError, "keep_last"),
        ({"keep_last": "2"}, TypeError, "keep_last"),
        ({"keep_last": 2, "save_top_k": 2}, ValueError, "one callback keeps one list"),
    ],
)
def test_bad_keep_last_is_refused(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        ModelCheckpoint(tmp_path / "e{epoch}.pt", **kwargs)


def test_keep_last_needs_a_name_per_save(tmp_path):
    with pytest.raises(ValueError, match=r"keep_last=2.*must differ per save"):
        ModelCheckpoint(tmp_path / "model.pt", keep_last=2)


def test_train_time_interval_saves_after_that_much_training_time(tmp_path):
    """ModelCheckpoint(train_time_interval=timedelta(seconds=2.5)) with a fake clock of 1 s per
    batch: files after steps 3, 6 and 9 (the time restarts at each save), none at epoch ends;
    with accumulation 2 a due save waits for the window's end; bad arguments are refused."""
    import datetime

    import torch
    from torch import nn

    import fitkit
    from fitkit.callbacks import LambdaCallback, ModelCheckpoint

    now = [0.0]
    tick = LambdaCallback(on_train_batch_begin=lambda b, logs: now.__setitem__(0, now[0] + 1.0))
    ck = ModelCheckpoint(
        tmp_path / "m-{step}.pt",
        monitor="loss",
        train_time_interval=datetime.timedelta(seconds=2.5),
        clock=lambda: now[0],
    )
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    x, y = torch.randn(20, 2), torch.randn(20, 1)
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[tick, ck])
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".pt") == ["m-3.pt", "m-6.pt", "m-9.pt"]
    saved = torch.load(tmp_path / "m-6.pt", weights_only=True)
    assert saved["global_step"] == 6

    # accumulation 2: due after batch 3 (mid-window), saved at batch 4's end (step 2); 2 s more by step 3
    now[0] = 0.0
    acc = fitkit.Model(nn.Linear(2, 1), device="cpu")
    acc.compile(optimizer="sgd", loss="mse", gradient_accumulation_steps=2)
    ck2 = ModelCheckpoint(
        tmp_path / "acc" / "m-{step}.pt",
        monitor="loss",
        train_time_interval=datetime.timedelta(seconds=2.5),
        clock=lambda: now[0],
    )
    acc.fit(x[:12], y[:12], batch_size=2, epochs=1, verbose=0, callbacks=[tick, ck2])
    assert sorted(p.name for p in (tmp_path / "acc").iterdir() if p.suffix == ".pt") == ["m-2.pt"]  # then 2 s: none

    with pytest.raises(TypeError, match="train_time_interval"):
        ModelCheckpoint(tmp_path / "a.pt", train_time_interval=30)
    with pytest.raises(ValueError, match="train_time_interval.*save_freq=5"):
        ModelCheckpoint(tmp_path / "a.pt", train_time_interval=datetime.timedelta(seconds=1), save_freq=5)
