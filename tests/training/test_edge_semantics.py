"""Edge semantics from the peers' suites.

Frozen or parameterless modules, two schedules on one optimizer, bad backup folders, NaN
monitor values, and ``ReduceLROnPlateau``'s ``cooldown`` as Keras 3 implements it.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import (
    BackupAndRestore,
    EarlyStopping,
    LambdaCallback,
    LearningRateScheduler,
    ModelCheckpoint,
    ReduceLROnPlateau,
)
from fitkit.callbacks.monitor import is_improvement

NAN = float("nan")
X = torch.tensor([[0.0], [1.0], [2.0], [3.0]])


def _script(key, values):
    """Put ``values[epoch]`` into the epoch logs as ``key`` (a user callback: before the others)."""
    return LambdaCallback(on_epoch_end=lambda epoch, logs: logs.__setitem__(key, values[epoch]))


def _model(lr: float = 1.0, **compile_kwargs) -> fitkit.Model:
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=lr), loss="mse", **compile_kwargs)
    return model


def _fit(model, callbacks, epochs):
    return model.fit(X, X, batch_size=4, epochs=epochs, shuffle=False, callbacks=callbacks, verbose=0)


def _recorded(fn):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in rec]


# -- modules with nothing to train ------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_frozen_module_trains_as_in_keras(optimizer):
    layer = nn.Linear(1, 1)
    with torch.no_grad():
        layer.weight.fill_(2.0), layer.bias.fill_(1.0)
    layer.requires_grad_(False)
    model = fitkit.Model(layer, device="cpu")
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    y = torch.tensor([[1.0], [3.0], [5.0], [8.0]])  # predictions 1, 3, 5, 7: one error of 1
    history, warned = _recorded(lambda: model.fit(X, y, batch_size=2, epochs=2, verbose=0))
    assert history.history["loss"] == [0.25, 0.25] and history.history["mae"] == [0.25, 0.25]
    assert layer.weight.item() == 2.0 and layer.bias.item() == 1.0
    assert len(warned) == 1 and warned[0].startswith("The module has no trainable parameter: fit computes")


class Double(nn.Module):
    """No parameters at all: ``y_pred = 2 x``."""

    def forward(self, x):
        return 2 * x


def test_parameterless_module_trains_as_in_keras():
    model = fitkit.Model(Double(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
    x, y = torch.tensor([[1.0], [2.0]]), torch.tensor([[2.0], [5.0]])  # errors 0 and 1
    history, warned = _recorded(lambda: model.fit(x, y, epochs=3, validation_data=(x, y), verbose=0))
    assert history.history["loss"] == [0.5] * 3 and history.history["val_loss"] == [0.5] * 3
    assert len(warned) == 1 and "no trainable parameter" in warned[0]
    assert model.evaluate(x, y, verbose=0) == {"loss": 0.5}


# -- two schedules on one optimizer -------------------------------------------------------------------
class Halve(LearningRateScheduler):
    def __init__(self):
        super().__init__(lambda epoch, lr: lr / 2)


@pytest.mark.parametrize(
    "callback",
    [LearningRateScheduler(lambda epoch, lr: lr), ReduceLROnPlateau("loss"), Halve()],
    ids=["LearningRateScheduler", "ReduceLROnPlateau", "subclass"],
)
def test_compiled_scheduler_and_an_lr_callback_are_an_error_before_step_1(callback):
    model = _model(scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1))
    before = model.module.weight.detach().clone()
    message = r"compile\(scheduler=StepLR\) and a \w+ callback would both set the learning rate .* Fix: use one"
    with pytest.raises(ValueError, match=message):
        _fit(model, [callback], 2)
    assert torch.equal(before, model.module.weight) and model.optimizer.param_groups[0]["lr"] == 1.0
    model.scheduler = None  # one schedule left: the callback's
    assert _fit(model, [Halve()], 2).history["learning_rate"] == [0.5, 0.25]


# -- bad backup folders -----------------------------------------------------------------------------
def test_backup_dir_empty_or_a_file_is_an_error_at_construction(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for bad, what in (("", "it is empty"), ("   ", "it is empty"), (a_file, "it is an existing file")):
        with pytest.raises(ValueError, match=rf"BackupAndRestore writes a folder at `backup_dir`, but {what}"):
            BackupAndRestore(bad)
    with pytest.raises(TypeError, match=r"Expected `backup_dir` to be a str or a path\. Received: backup_dir=3"):
        BackupAndRestore(3)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]  # no backup.pt in the working folder


# -- NaN is never the best ------------------------------------------------------------------------------
def test_is_improvement_never_takes_nan():
    assert not is_improvement(NAN, 1.0, "min") and not is_improvement(NAN, 1.0, "max")
    assert not is_improvement(1.0, NAN, "min")  # nothing beats a NaN reference either
    assert is_improvement(-math.inf, 1.0, "min") and not is_improvement(math.inf, 1.0, "min")


def test_early_stopping_first_value_nan_is_not_the_best():
    stop = EarlyStopping("s_loss", patience=1)
    history = _fit(_model(lr=0.0), [_script("s_loss", [NAN, 2.0, 2.0, 1.0]), stop], 4)
    assert history.epoch == [0, 1, 2] and stop.best == 2.0 and stop.best_epoch == 1
    assert stop.stop_reason == "patience: s_loss did not improve for 1 epoch(s); best 2.0000 at epoch 2."


def test_early_stopping_on_all_nan_stops_by_patience_and_restores_nothing():
    model = _model(lr=0.1)
    stop = EarlyStopping("s_loss", patience=1, restore_best_weights=True)
    history = _fit(model, [_script("s_loss", [NAN, NAN, NAN]), stop], 3)
    assert history.epoch == [0, 1] and stop.best is None and stop.best_weights is None
    assert stop.stop_reason == "patience: s_loss did not improve for 2 epoch(s)."
    with pytest.raises(ValueError, match=r"Expected `baseline` to be a number, not NaN"):
        EarlyStopping(baseline=NAN)


def test_early_stopping_restores_the_best_finite_epoch_not_a_nan_one():
    model = _model(lr=0.1)
    weights = []
    snap = LambdaCallback(on_epoch_end=lambda epoch, logs: weights.append(model.module.weight.detach().clone()))
    stop = EarlyStopping("s_loss", patience=2, restore_best_weights=True)
    _fit(model, [_script("s_loss", [NAN, 3.0, NAN, NAN, 1.0]), snap, stop], 5)
    assert stop.best == 3.0 and stop.best_epoch == 1 and stop.stopped_epoch == 3
    assert torch.equal(model.module.weight, weights[1])


def test_model_checkpoint_never_saves_a_nan_as_best(tmp_path):
    best = ModelCheckpoint(tmp_path / "best-{epoch}.pt", monitor="s_loss", save_best_only=True, save_weights_only=True)
    _fit(_model(lr=0.0), [_script("s_loss", [NAN, 2.0, NAN, 1.0]), best], 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-2.pt", "best-4.pt"] and best.best == 1.0
    for p in tmp_path.iterdir():
        p.unlink()
    top = ModelCheckpoint(tmp_path / "top-{epoch}.pt", monitor="s_loss", save_top_k=2, save_weights_only=True)
    _fit(_model(lr=0.0), [_script("s_loss", [NAN, 3.0, NAN, 2.0, 1.0]), top], 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["top-4.pt", "top-5.pt"]
    assert top.kept == [(1.0, str(tmp_path / "top-5.pt")), (2.0, str(tmp_path / "top-4.pt"))]
    with pytest.raises(ValueError, match=r"Expected `initial_value_threshold` to be a number, not NaN"):
        ModelCheckpoint(tmp_path / "m.pt", save_best_only=True, initial_value_threshold=NAN)


def test_reduce_lr_on_plateau_counts_nan_as_no_improvement():
    reduce = ReduceLROnPlateau("s_loss", factor=0.5, patience=2)
    history = _fit(_model(lr=1.0), [_script("s_loss", [NAN, NAN, NAN, 1.0, 1.0]), reduce], 5)
    assert history.history["learning_rate"] == [1.0, 1.0, 0.5, 0.5, 0.5] and reduce.best == 1.0


# -- ReduceLROnPlateau's cooldown: Keras 3's rule -----------------------------------------------------
def _lrs(values, **kwargs):
    reduce = ReduceLROnPlateau("s_loss", factor=0.5, min_delta=0.0, **kwargs)
    history = _fit(_model(lr=1.0), [_script("s_loss", values), reduce], len(values))
    return history.history["learning_rate"], reduce


def test_cooldown_one_skips_no_epoch():
    flat = [1.0] * 7
    expected = [1.0, 1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125]  # a reduction after every epoch from epoch 2
    assert _lrs(flat, patience=1, cooldown=0)[0] == expected
    assert _lrs(flat, patience=1, cooldown=1)[0] == expected


def test_cooldown_two_leaves_one_epoch_out_after_each_reduction():
    lrs, reduce = _lrs([1.0] * 7, patience=1, cooldown=2)
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125]  # reductions at epochs 2, 4, 6 (1-based)
    assert reduce.state_dict() == {"best": 1.0, "wait": 0, "cooldown_counter": 1}  # epoch 7 was left out


def test_cooldown_three_patience_two_and_an_improvement_inside_the_cooldown():
    # Reduction at epoch index 2; the next at 2 + max(3, 1) + 2 - 1 = 6 without improvement.
    assert _lrs([1.0] * 8, patience=2, cooldown=3)[0] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.25]
    lrs, reduce = _lrs([5.0, 5.0, 4.0, 4.0, 4.0], patience=1, cooldown=2)
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.25] and reduce.best == 4.0  # 4.0 in the cooldown became the best


def _keras3_lrs(values, patience, cooldown, factor=0.5, lr=1.0):
    """Keras 3's ``ReduceLROnPlateau.on_epoch_end`` (keras/src/callbacks/reduce_lr_on_plateau.py),
    mode min, min_delta 0: the learning rate each epoch trains with."""
    best, wait, counter, lrs = None, 0, 0, []
    for current in values:
        lrs.append(lr)
        if counter > 0:
            counter -= 1
            wait = 0
        if best is None or current < best:
            best, wait = current, 0
        elif not counter > 0:
            wait += 1
            if wait >= patience:
                lr, counter, wait = lr * factor, cooldown, 0
    return lrs


@pytest.mark.parametrize("patience", [0, 1, 2])
@pytest.mark.parametrize("cooldown", [0, 1, 2, 3])
def test_reduce_lr_on_plateau_matches_keras_3_step_by_step(patience, cooldown):
    values = [5.0, 4.0, 4.0, 4.0, 3.0, 3.5, 3.5, 2.0, 2.0, 2.0, 2.0, 1.0]
    assert _lrs(values, patience=patience, cooldown=cooldown)[0] == _keras3_lrs(values, patience, cooldown)
