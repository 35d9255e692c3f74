"""ModelCheckpoint's initial_value_threshold / every_n_epochs / save_last and EarlyStopping's
stopping_threshold / divergence_threshold / check_finite, driven by monitor sequences set by hand."""

from __future__ import annotations

import math
import os

import pytest
import torch

import fitkit
from fitkit.callbacks import Callback, EarlyStopping, ModelCheckpoint


class Feed(Callback):
    """Sets ``logs["score"]`` from a list at each epoch end (runs before the callbacks after it)."""

    def __init__(self, values):
        super().__init__()
        self.values = values

    def on_epoch_end(self, epoch, logs=None):
        logs["score"] = self.values[epoch]


def _fit(callbacks, epochs):
    model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="mse")
    history = model.fit(torch.zeros(4, 1), torch.zeros(4, 1), epochs=epochs, callbacks=callbacks, verbose=0)
    return model, history


def _files(folder):
    # The lock files a running fit holds (tests/files/test_files_locks.py) are not checkpoints.
    return sorted(n for n in os.listdir(folder) if not n.endswith(".lock"))


# -- ModelCheckpoint -------------------------------------------------------------------------
def test_initial_value_threshold_save_best_only(tmp_path):
    ckpt = ModelCheckpoint(
        tmp_path / "ep{epoch}.pt",
        monitor="score",
        mode="min",
        save_best_only=True,
        save_weights_only=True,
        initial_value_threshold=0.5,
    )
    _fit([Feed([0.9, 0.6, 0.4, 0.45, 0.3]), ckpt], epochs=5)
    # 0.9 and 0.6 do not beat 0.5; 0.4 does (epoch 3); 0.45 does not beat 0.4; 0.3 does.
    assert _files(tmp_path) == ["ep3.pt", "ep5.pt"]
    assert ckpt.best == 0.3 and ckpt.best_path == str(tmp_path / "ep5.pt")


def test_initial_value_threshold_never_beaten_writes_nothing(tmp_path):
    ckpt = ModelCheckpoint(
        tmp_path / "ep{epoch}.pt", monitor="score", mode="max", save_best_only=True, initial_value_threshold=0.9
    )
    _fit([Feed([0.5, 0.9, 0.8]), ckpt], epochs=3)
    assert _files(tmp_path) == [] and ckpt.best == 0.9 and ckpt.best_path is None


def test_initial_value_threshold_with_top_k(tmp_path):
    ckpt = ModelCheckpoint(
        tmp_path / "ep{epoch}.pt",
        monitor="score",
        mode="min",
        save_top_k=2,
        save_weights_only=True,
        initial_value_threshold=1.0,
    )
    _fit([Feed([3.0, 0.8, 2.0, 0.9, 0.7, 1.0]), ckpt], epochs=6)
    # Beat 1.0: 0.8 (ep2), 0.9 (ep4), 0.7 (ep5); the two best are ep2 and ep5.
    assert _files(tmp_path) == ["ep2.pt", "ep5.pt"]
    assert ckpt.kept == [(0.7, str(tmp_path / "ep5.pt")), (0.8, str(tmp_path / "ep2.pt"))]


def test_every_n_epochs(tmp_path):
    ckpt = ModelCheckpoint(tmp_path / "ep{epoch}.pt", save_weights_only=True, every_n_epochs=3)
    _fit([ckpt], epochs=7)
    assert _files(tmp_path) == ["ep3.pt", "ep6.pt"]


def test_every_n_epochs_0_writes_no_ranked_file_only_last(tmp_path):
    ckpt = ModelCheckpoint(
        tmp_path / "ep{epoch}.pt", monitor="score", mode="min", save_top_k=2, every_n_epochs=0, save_last=True
    )
    model, _ = _fit([Feed([3.0, 2.0, 1.0]), ckpt], epochs=3)
    assert _files(tmp_path) == ["last.pt"] and ckpt.kept == [] and ckpt.best is None
    assert torch.load(tmp_path / "last.pt", weights_only=True)["epoch"] == 3  # written at every epoch end
    alone = ModelCheckpoint(tmp_path / "none" / "ep{epoch}.pt", every_n_epochs=0)
    _fit([alone], epochs=2)
    assert not (tmp_path / "none").exists()


def test_every_n_epochs_with_save_best_only_decides_on_those_epochs_only(tmp_path):
    ckpt = ModelCheckpoint(
        tmp_path / "ep{epoch}.pt",
        monitor="score",
        mode="min",
        save_best_only=True,
        save_weights_only=True,
        every_n_epochs=2,
    )
    # Epoch 1's 0.1 is never looked at; epoch 2's 0.5 is the first best, epoch 4's 0.6 is worse,
    # epoch 6's 0.4 is better.
    _fit([Feed([0.1, 0.5, 0.0, 0.6, 0.0, 0.4]), ckpt], epochs=6)
    assert _files(tmp_path) == ["ep2.pt", "ep6.pt"]


def test_save_last_is_the_latest_full_state_at_every_event(tmp_path):
    seen = []

    class Spy(Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(_files(tmp_path))

    ckpt = ModelCheckpoint(
        tmp_path / "ep{epoch}.pt",
        monitor="score",
        mode="min",
        save_best_only=True,
        save_weights_only=True,
        save_last=True,
        every_n_epochs=2,
    )
    # Spy runs before the write of this epoch (writes happen after every callback's epoch end).
    model, _ = _fit([Feed([0.5, 0.5, 0.9, 0.9, 0.1]), ckpt, Spy()], epochs=5)
    assert seen == [[], [], ["ep2.pt", "last.pt"], ["ep2.pt", "last.pt"], ["ep2.pt", "last.pt"]]
    # Epoch 4 (0.9) wrote no ranked file, but last.pt: a full checkpoint of epoch 4.
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    assert state["epoch"] == 4 and "optimizer" in state
    fresh = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
    fresh.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="mse")
    assert fresh.load_checkpoint(tmp_path / "last.pt") == 4


def test_save_last_as_path_and_with_save_freq(tmp_path):
    last = tmp_path / "sub" / "latest.pt"
    ckpt = ModelCheckpoint(tmp_path / "b{batch}.pt", save_weights_only=True, save_freq=2, save_last=last)
    model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="mse")
    model.fit(torch.zeros(6, 1), torch.zeros(6, 1), batch_size=1, epochs=1, callbacks=[ckpt], verbose=0)
    assert _files(tmp_path) == ["b2.pt", "b4.pt", "b6.pt", "sub"]
    state = torch.load(last, weights_only=True)
    assert (state["epoch"], state["step_in_epoch"]) == (0, 6)


def test_save_top_k_never_evicts_last(tmp_path):
    ckpt = ModelCheckpoint(
        tmp_path / "ep{epoch}.pt", monitor="score", mode="min", save_top_k=1, save_weights_only=True, save_last=True
    )
    _fit([Feed([3.0, 2.0, 1.0]), ckpt], epochs=3)
    assert _files(tmp_path) == ["ep3.pt", "last.pt"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"initial_value_threshold": 0.5}, ValueError, "needs `save_best_only=True` or `save_top_k=k`"),
        ({"initial_value_threshold": "a", "save_best_only": True}, TypeError, "to be a number"),
        ({"every_n_epochs": -1}, ValueError, r"Expected `every_n_epochs` >= 0\. Received: every_n_epochs=-1"),
        ({"every_n_epochs": 0, "save_freq": 5}, ValueError, "`every_n_epochs` counts epochs"),
        ({"every_n_epochs": 2, "save_freq": 5}, ValueError, "`every_n_epochs` counts epochs"),
        ({"save_last": 3}, TypeError, "Expected `save_last` to be a bool or a path"),
    ],
)
def test_model_checkpoint_option_errors(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        ModelCheckpoint(tmp_path / "ep{epoch}.pt", **kwargs)


def test_save_last_with_a_changing_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="Fix: pass `save_last` as a path"):
        ModelCheckpoint(str(tmp_path / "{epoch}" / "model.pt"), save_last=True)


def test_threshold_and_last_resume_with_the_checkpoint(tmp_path):
    ckpt = ModelCheckpoint(
        tmp_path / "ep{epoch}.pt", monitor="score", mode="min", save_best_only=True, initial_value_threshold=0.5
    )
    state = {"best": 0.5, "best_path": None, "kept": [], "batches_seen": 0}
    assert ckpt.state_dict() == state
    ckpt.load_state_dict({**state, "best": 0.2})
    _fit([Feed([0.3, 0.1]), ckpt], epochs=2)  # the restored best 0.2 holds: 0.3 is not saved
    assert _files(tmp_path) == ["ep2.pt"]


# -- EarlyStopping ---------------------------------------------------------------------------
def _stop(values, **kwargs):
    stop = EarlyStopping(monitor="score", **kwargs)
    _, history = _fit([Feed(values), stop], epochs=len(values))
    return stop, len(history.epoch)


def test_stopping_threshold_stops_at_once():
    stop, ran = _stop([0.9, 0.5, 0.1, 0.05, 0.01], mode="min", patience=10, stopping_threshold=0.1)
    # 0.1 is not strictly below 0.1; 0.05 is (epoch index 3).
    assert (stop.stopped_epoch, ran) == (3, 4)
    assert stop.stop_reason == "stopping_threshold: score = 0.0500 < 0.1000."
    assert stop.best == 0.05 and stop.best_epoch == 3  # that epoch is the best one


def test_stopping_threshold_max_mode_at_epoch_zero():
    stop, ran = _stop([0.99, 0.5], mode="max", stopping_threshold=0.95)
    assert (stop.stopped_epoch, ran) == (0, 1)
    assert stop.stop_reason == "stopping_threshold: score = 0.9900 > 0.9500."


def test_divergence_threshold():
    stop, ran = _stop([1.0, 0.8, 5.0, 12.0, 0.1], mode="min", patience=10, divergence_threshold=10.0)
    assert (stop.stopped_epoch, ran) == (3, 4)
    assert stop.stop_reason == "divergence_threshold: score = 12.0000 > 10.0000."
    assert stop.best == 0.8  # a diverged value never becomes the best


def test_divergence_threshold_max_mode_equal_is_not_worse():
    stop, ran = _stop([0.5, 0.2, 0.1], mode="max", patience=10, divergence_threshold=0.2)
    assert (stop.stopped_epoch, ran) == (2, 3)
    assert stop.stop_reason == "divergence_threshold: score = 0.1000 < 0.2000."


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_check_finite(bad):
    stop, ran = _stop([0.5, 0.4, bad, 0.1], mode="min", patience=10, check_finite=True)
    assert (stop.stopped_epoch, ran) == (2, 3)
    assert stop.stop_reason == f"not finite: score = {bad}; best 0.4000 at epoch 2."


def test_nan_without_check_finite_counts_as_no_improvement():
    stop, ran = _stop([0.5, math.nan, math.nan, 0.1], mode="min", patience=2)
    assert (stop.stopped_epoch, ran) == (2, 3)
    assert stop.stop_reason == "patience: score did not improve for 2 epoch(s); best 0.5000 at epoch 1."


def test_patience_reason_and_verbose_message(capsys):
    stop, ran = _stop([0.5, 0.6, 0.7, 0.1], mode="min", patience=2, verbose=1)
    assert (stop.stopped_epoch, ran) == (2, 3)
    out = capsys.readouterr().out
    assert out == "Epoch 3: early stopping (patience: score did not improve for 2 epoch(s); best 0.5000 at epoch 1.)\n"


def test_not_stopped_has_no_reason():
    stop, ran = _stop(
        [0.5, 0.4, 0.3], mode="min", patience=1, stopping_threshold=0.0, divergence_threshold=9.0, check_finite=True
    )
    assert (stop.stop_reason, stop.stopped_epoch, ran) == (None, 0, 3)


def test_thresholds_wait_for_start_from_epoch():
    stop, ran = _stop([0.01, 0.02, 0.03, 0.04], mode="min", patience=10, stopping_threshold=0.1, start_from_epoch=2)
    assert (stop.stopped_epoch, ran) == (2, 3)


def test_stop_reason_is_part_of_the_state():
    stop, _ = _stop([1.0, 20.0], mode="min", divergence_threshold=10.0)
    other = EarlyStopping(monitor="score", mode="min")
    other.load_state_dict(stop.state_dict())
    assert other.stop_reason == "divergence_threshold: score = 20.0000 > 10.0000."


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"stopping_threshold": "x"}, TypeError, r"`stopping_threshold` to be a number\. Received: stopping"),
        ({"divergence_threshold": [1]}, TypeError, "Expected `divergence_threshold` to be a number"),
        ({"check_finite": 1}, TypeError, r"Expected `check_finite` to be a bool\. Received: check_finite=1"),
    ],
)
def test_early_stopping_option_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        EarlyStopping(**kwargs)
