"""Validation as an explicit state and monitors checked before step 1.

Whether an epoch validated is the fit loop's state (``model.validated``, ``params["do_validation"]``);
CSVLogger, the monitoring callbacks and a ``ReduceLROnPlateau`` scheduler read it instead of
guessing from the keys in the logs.
"""

from __future__ import annotations

import csv
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import (
    BackupAndRestore,
    Callback,
    CSVLogger,
    EarlyStopping,
    LambdaCallback,
    ModelCheckpoint,
    ReduceLROnPlateau,
)


class Bias(nn.Module):
    """``y_pred = b`` for every row: one parameter, starting at 0."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return self.b.expand(x.shape[0], 1)  # (B, 1)


def _bias_model(lr: float, **compile_kwargs) -> fitkit.Model:
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=lr), loss="mse", **compile_kwargs)
    return model


def _col(values):
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)  # (N, 1)


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _script(key, values):
    return LambdaCallback(on_epoch_end=lambda epoch, logs: logs.__setitem__(key, values[epoch]))


# The CSV module: bias at 0, lr 0, train y = [1, 1, 3, 3] (mse 5), validation y = [2, 2] (mse 4).
X4, Y4 = torch.zeros(4, 1), _col([1, 1, 3, 3])
VAL = (torch.zeros(2, 1), _col([2, 2]))


# -- the state ------------------------------------------------------------------------------------
def test_model_validated_is_false_until_the_epochs_validation_ran():
    model = _bias_model(0.0)
    seen = []
    watch = LambdaCallback(
        on_epoch_begin=lambda epoch, logs: seen.append(("begin", epoch, model.validated)),
        on_test_begin=lambda logs: seen.append(("test", model.epoch, model.validated)),
        on_epoch_end=lambda epoch, logs: seen.append(("end", epoch, model.validated)),
    )
    model.fit(X4, Y4, epochs=3, batch_size=4, validation_data=VAL, validation_freq=[2, 3], callbacks=[watch], verbose=0)
    assert seen == [
        ("begin", 0, False),
        ("end", 0, False),
        ("begin", 1, False),
        ("test", 1, False),
        ("end", 1, True),
        ("begin", 2, False),
        ("test", 2, False),
        ("end", 2, True),
    ]


# -- CSVLogger ------------------------------------------------------------------------------------
def test_csv_logger_keeps_val_columns_with_validation_freq(tmp_path):
    path = tmp_path / "log.csv"
    _bias_model(0.0).fit(
        X4, Y4, epochs=4, batch_size=4, validation_data=VAL, validation_freq=2, callbacks=[CSVLogger(path)], verbose=0
    )
    assert path.read_text() == (
        "epoch,learning_rate,loss,val_loss\n0,0.0,5.0,NA\n1,0.0,5.0,4.0\n2,0.0,5.0,NA\n3,0.0,5.0,4.0\n"
    )


def test_csv_logger_columns_plan_plus_first_epoch_extras_later_keys_warned_once(tmp_path):
    path = tmp_path / "log.csv"
    extra = LambdaCallback(
        on_epoch_end=lambda epoch, logs: logs.update(
            {"zeta": 1.0, "alpha": 2.0} if epoch == 0 else {"zeta": 1.0, "late": 3.0}
        )
    )
    model = _bias_model(0.0, metrics=["mae"])
    with pytest.warns(UserWarning, match=r"epoch 2 hold late, which the file's columns .* do not have") as rec:
        model.fit(
            X4,
            Y4,
            epochs=3,
            batch_size=4,
            validation_data=VAL,
            validation_freq=[3],
            callbacks=[extra, CSVLogger(path)],
            verbose=0,
        )
    assert sum("CSVLogger" in str(w.message) for w in rec) == 1  # once, not at epochs 2 and 3
    assert _rows(path) == [
        ["epoch", "alpha", "learning_rate", "loss", "mae", "val_loss", "val_mae", "zeta"],
        ["0", "2.0", "0.0", "5.0", "2.0", "NA", "NA", "1.0"],
        ["1", "NA", "0.0", "5.0", "2.0", "NA", "NA", "1.0"],
        ["2", "NA", "0.0", "5.0", "2.0", "4.0", "2.0", "1.0"],
    ]


def test_csv_logger_append_takes_the_columns_of_the_files_header(tmp_path):
    path = tmp_path / "log.csv"
    _bias_model(0.0).fit(X4, Y4, epochs=1, batch_size=4, callbacks=[CSVLogger(path)], verbose=0)
    # The second run validates: its val_loss is not a column of the file, so it is left out.
    with pytest.warns(UserWarning, match="hold val_loss, which the file's columns"):
        _bias_model(0.0).fit(
            X4, Y4, epochs=2, batch_size=4, validation_data=VAL, callbacks=[CSVLogger(path, append=True)], verbose=0
        )
    assert _rows(path) == [
        ["epoch", "learning_rate", "loss"],
        ["0", "0.0", "5.0"],
        ["0", "0.0", "5.0"],
        ["1", "0.0", "5.0"],
    ]


class _Crash(RuntimeError):
    pass


def test_csv_logger_column_order_is_stable_across_a_resume(tmp_path):
    path, ref, backup = tmp_path / "log.csv", tmp_path / "ref.csv", tmp_path / "backup"
    extra = _script("score", [0.5, 0.25, 0.125, 0.0625])
    fit = dict(epochs=4, batch_size=4, validation_data=VAL, validation_freq=2, verbose=0)
    torch.manual_seed(0)  # resuming gives the uninterrupted run's values for the same seed
    _bias_model(0.1).fit(X4, Y4, callbacks=[extra, CSVLogger(ref)], **fit)

    def crash(epoch, logs):
        if epoch == 2:
            raise _Crash

    torch.manual_seed(0)
    with pytest.raises(_Crash):
        _bias_model(0.1).fit(
            X4,
            Y4,
            callbacks=[extra, CSVLogger(path), LambdaCallback(on_epoch_end=crash), BackupAndRestore(backup)],
            **fit,
        )
    torch.manual_seed(0)
    _bias_model(0.1).fit(X4, Y4, callbacks=[extra, CSVLogger(path), BackupAndRestore(backup)], **fit)
    assert _rows(path) == _rows(ref)
    assert _rows(path)[0] == ["epoch", "learning_rate", "loss", "score", "val_loss"]
    assert [r[4] for r in _rows(path)[1:]] == ["NA", _rows(ref)[2][4], "NA", _rows(ref)[4][4]]


# -- a ReduceLROnPlateau scheduler ------------------------------------------------------------------
# Bias at 0 with targets +-a: the gradient is 0, so the losses stay a^2 (train 100, validation 1).
XT, YT = torch.zeros(4, 1), _col([10, -10, 10, -10])
VT = (torch.zeros(2, 1), _col([1, -1]))


def _plateau_model():
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    return _bias_model(0.1, scheduler=lambda opt: plateau(opt, factor=0.5, patience=1))


def test_plateau_scheduler_sees_val_loss_only_on_epochs_that_validated():
    model = _plateau_model()
    h = model.fit(XT, YT, epochs=4, batch_size=4, validation_data=VT, validation_freq=2, verbose=0)
    assert h.history["loss"] == [100.0] * 4 and h.history["val_loss"] == [1.0, 1.0]
    assert model.optimizer.param_groups[0]["lr"] == 0.1  # it saw [1, 1]: one bad epoch, patience 1


def test_plateau_scheduler_reduces_on_the_third_validation_and_on_loss_without_validation():
    model = _plateau_model()
    h = model.fit(XT, YT, epochs=6, batch_size=4, validation_data=VT, validation_freq=2, verbose=0)
    assert h.history["learning_rate"] == [0.1] * 6  # the reduction comes at the end of epoch 6
    assert model.optimizer.param_groups[0]["lr"] == 0.05  # [1, 1, 1]: two bad epochs > patience 1
    model = _plateau_model()
    model.fit(XT, YT, epochs=3, batch_size=4, verbose=0)  # no validation at all: steps on loss
    assert model.optimizer.param_groups[0]["lr"] == 0.05


class TimmLike:
    """timm's scheduler protocol (``step(epoch, metric)``, ``step_update``), recording the calls."""

    def __init__(self, optimizer, plateau=False):
        self.calls = []
        if plateau:  # timm's PlateauLRScheduler wraps torch's
            self.lr_scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)

    def step(self, epoch, metric=None):
        self.calls.append((epoch, metric))

    def step_update(self, num_updates, metric=None):
        pass


@pytest.mark.parametrize("plateau", [False, True])
def test_timm_scheduler_gets_the_validation_metric_or_none(plateau):
    model = _bias_model(0.1, scheduler=lambda opt: TimmLike(opt, plateau))
    model.fit(XT, YT, epochs=4, batch_size=4, validation_data=VT, validation_freq=2, verbose=0)
    # Never the training loss in place of a missing val_loss; a plateau scheduler waits for one.
    expected = [(2, 1.0), (4, 1.0)] if plateau else [(1, None), (2, 1.0), (3, None), (4, 1.0)]
    assert model.scheduler.calls == expected
    model = _bias_model(0.1, scheduler=lambda opt: TimmLike(opt, plateau))
    model.fit(XT, YT, epochs=2, batch_size=4, verbose=0)  # no validation at all: the training loss
    assert model.scheduler.calls == [(1, 100.0), (2, 100.0)]


def test_plateau_callback_skips_epochs_without_validation():
    model = _bias_model(0.1)
    reduce = ReduceLROnPlateau(factor=0.5, patience=1)
    h = model.fit(XT, YT, epochs=4, batch_size=4, validation_data=VT, validation_freq=2, callbacks=[reduce], verbose=0)
    # Epochs 1 and 3 have no val_loss: had they counted as "no improvement", epoch 3 would log 0.05.
    assert h.history["learning_rate"] == [0.1] * 4
    assert model.optimizer.param_groups[0]["lr"] == 0.05 and reduce.best == 1.0


# -- a validation source that yields no batch -------------------------------------------------------
def _one_shot():
    yield torch.zeros(2, 1), _col([2, 2])


def test_used_up_validation_generator_is_refused_before_step_1():
    """A generator validated in 3 epochs would be used up by the first: refused before step 1 (invariant 2)."""
    model = _bias_model(0.0)
    ends = []
    watch = LambdaCallback(on_epoch_end=lambda epoch, logs: ends.append((epoch, logs["val_loss"])))
    message = r"`validation_data` to give a pass for each of the 3 validations.*Fix: pass a re-iterable source"
    with pytest.raises(ValueError, match=message):
        model.fit(
            X4,
            Y4,
            epochs=3,
            batch_size=4,
            validation_data=_one_shot(),
            callbacks=[watch, EarlyStopping("val_loss")],
            verbose=0,
        )
    assert ends == [] and model.global_step == 0 and model.module.b.item() == 0.0


def test_used_up_validation_generator_is_refused_when_two_scheduled_validations_would_need_it():
    ends = []
    watch = LambdaCallback(on_epoch_end=lambda epoch, logs: ends.append(epoch))
    with pytest.raises(ValueError, match=r"each of the 2 validations this fit schedules"):
        _bias_model(0.0).fit(
            X4, Y4, epochs=4, batch_size=4, validation_data=_one_shot(), validation_freq=2, callbacks=[watch], verbose=0
        )
    assert ends == []  # epochs 2 and 4 validate: refused before epoch 1 trained


def test_empty_validation_dataloader_is_an_error_before_step_1():
    model = _bias_model(0.1)
    empty = DataLoader(TensorDataset(torch.zeros(0, 1), torch.zeros(0, 1)), batch_size=2)
    with pytest.raises(ValueError, match=r"`validation_data` \(DataLoader\) has 0 batches"):
        model.fit(X4, Y4, epochs=2, batch_size=4, validation_data=empty, verbose=0)
    assert model.module.b.item() == 0.0


# -- monitors that cannot hold a value when the callback decides ----------------------------------------
def test_batch_level_val_monitor_is_an_error_before_step_1(tmp_path):
    model = _bias_model(0.1)
    ckpt = ModelCheckpoint(tmp_path / "m.pt", monitor="val_loss", save_best_only=True, save_freq=2)
    message = (
        r"ModelCheckpoint monitors 'val_loss' every 2 batches, but batch logs hold only the running "
        r"training values \(loss\); 'val_loss' exists at epoch ends only\. Fix: pass save_freq='epoch'"
    )
    with pytest.raises(ValueError, match=message):
        model.fit(X4, Y4, epochs=2, batch_size=1, validation_data=VAL, callbacks=[ckpt], verbose=0)
    assert model.module.b.item() == 0.0 and list(tmp_path.iterdir()) == []


def test_batch_level_filepath_keys_are_checked_before_step_1(tmp_path):
    model = _bias_model(0.1, metrics=["mae"])
    with pytest.raises(
        ValueError,
        match=r"uses \{learning_rate\} every 2 batches, but batch logs hold only the "
        r"running training values \(loss, mae\)",
    ):
        model.fit(
            X4,
            Y4,
            epochs=1,
            batch_size=1,
            verbose=0,
            callbacks=[ModelCheckpoint(tmp_path / "{learning_rate}.pt", save_freq=2)],
        )
    with pytest.raises(ValueError, match=r"uses \{batch\}, but save_freq='epoch' saves at epoch ends"):
        model.fit(X4, Y4, epochs=1, batch_size=1, verbose=0, callbacks=[ModelCheckpoint(tmp_path / "{batch}.pt")])
    assert model.module.b.item() == 0.0 and list(tmp_path.iterdir()) == []
    # Running training keys do work at batch level: the files of batches 2 and 4.
    ckpt = ModelCheckpoint(tmp_path / "b{batch}-{mae:.1f}.pt", save_freq=2, save_weights_only=True)
    _bias_model(0.0, metrics=["mae"]).fit(X4, Y4, epochs=1, batch_size=1, callbacks=[ckpt], verbose=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b2-1.0.pt", "b4-2.0.pt"]


def test_unknowable_monitors_and_placeholders_fail_before_step_1(tmp_path):
    model = fitkit.Model(nn.Linear(1, 2), device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy", metrics=["accuracy"])
    before = model.module.weight.detach().clone()
    x, y = torch.zeros(4, 1), torch.tensor([1, 0, 1, 0])
    planned = r"Available keys: accuracy, learning_rate, loss, val_accuracy, val_loss \(params\['metrics'\]"
    for callback in (
        EarlyStopping("val_acc"),
        ReduceLROnPlateau("acc", mode="max"),
        ModelCheckpoint(tmp_path / "m.pt", monitor="val_acc", save_best_only=True),
    ):
        with pytest.raises(ValueError, match=rf"monitors '(val_)?acc', which the logs will not hold\. {planned}"):
            model.fit(x, y, epochs=1, batch_size=2, validation_data=(x, y), callbacks=[callback], verbose=0)
    with pytest.raises(ValueError, match=r"filepath '.*' uses \{val_acc\}, but fit has no validation data"):
        model.fit(x, y, epochs=1, batch_size=2, callbacks=[ModelCheckpoint(tmp_path / "{val_acc}.pt")], verbose=0)
    assert torch.equal(before, model.module.weight) and list(tmp_path.iterdir()) == []


def test_val_placeholder_skips_the_epochs_without_validation(tmp_path):
    ckpt = ModelCheckpoint(tmp_path / "ep{epoch}-{val_loss:.1f}.pt", save_weights_only=True)
    _bias_model(0.0).fit(
        X4, Y4, epochs=4, batch_size=4, validation_data=VAL, validation_freq=2, callbacks=[ckpt], verbose=0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ep2-4.0.pt", "ep4-4.0.pt"]


# -- val_ keys a callback adds ------------------------------------------------------------------------
class HeldOutF1(Callback):
    """A user callback scoring its own held-out set: the common Keras pattern."""

    def __init__(self, values, first_epoch=0):
        super().__init__()
        self.values, self.first_epoch = values, first_epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch >= self.first_epoch:
            logs["val_f1"] = self.values[epoch]


def test_val_key_from_a_callback_works_without_validation_data(tmp_path):
    model = _bias_model(0.1)
    stop = EarlyStopping("val_f1", mode="max", patience=1)
    ckpt = ModelCheckpoint(tmp_path / "best.pt", monitor="val_f1", mode="max", save_best_only=True)
    h = model.fit(
        X4, Y4, epochs=6, batch_size=4, callbacks=[HeldOutF1([0.5, 0.75, 0.75, 0.9, 0.9, 0.9]), stop, ckpt], verbose=0
    )
    assert h.epoch == [0, 1, 2] and stop.stopped_epoch == 2 and stop.best == 0.75
    assert ckpt.best == 0.75 and h.history["val_f1"] == [0.5, 0.75, 0.75]


def test_val_key_from_a_callback_counts_every_epoch_beside_validation_freq():
    stop = EarlyStopping("val_f1", mode="max", patience=2)
    h = _bias_model(0.1).fit(
        X4,
        Y4,
        epochs=4,
        batch_size=4,
        validation_data=VAL,
        validation_freq=2,
        verbose=0,
        callbacks=[HeldOutF1([0.5, 0.4, 0.3, 0.2]), stop],
    )
    assert h.epoch == [0, 1, 2] and stop.stop_reason.startswith("patience: val_f1 did not improve for 2 epoch(s)")


def test_key_missing_at_the_first_decision_lists_the_keys():
    message = r"EarlyStopping monitors 'val_f1', which the logs do not hold\. Available keys: learning_rate, loss\."
    with pytest.raises(ValueError, match=message):
        _bias_model(0.1).fit(
            X4,
            Y4,
            epochs=3,
            batch_size=4,
            verbose=0,
            callbacks=[HeldOutF1([0.5, 0.6, 0.7], first_epoch=1), EarlyStopping("val_f1", mode="max")],
        )
    # A callback after the monitor adds the key too late for it: the same error at epoch 1.
    with pytest.raises(ValueError, match=message):
        _bias_model(0.1).fit(
            X4,
            Y4,
            epochs=3,
            batch_size=4,
            verbose=0,
            callbacks=[EarlyStopping("val_f1", mode="max"), HeldOutF1([0.5, 0.6, 0.7])],
        )


# -- a training source that yields no batch -----------------------------------------------------------
def test_fit_and_evaluate_on_zero_rows_are_errors_and_predict_gives_zero_rows():
    model = fitkit.Model(nn.Linear(3, 2), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    before = model.module.weight.detach().clone()
    with pytest.raises(ValueError, match=r"`x` has 0 samples\. Fix: pass at least one sample"):
        model.fit(torch.zeros(0, 3), torch.zeros(0, 2), verbose=0)
    with pytest.raises(ValueError, match=r"`x` has 0 samples"):
        model.evaluate(torch.zeros(0, 3), torch.zeros(0, 2), verbose=0)
    assert torch.equal(before, model.module.weight)
    out = model.predict(torch.zeros(0, 3), verbose=0)
    assert out.shape == (0, 2) and out.dtype == torch.float32


def test_zero_rows_of_other_sources_and_predict_keeps_the_output_shape():
    model = fitkit.Model(nn.Embedding(10, 8), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    assert model.predict(torch.zeros(0, 5, dtype=torch.long), verbose=0).shape == (0, 5, 8)  # (0, T, C)
    empty = DataLoader(TensorDataset(torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5, 8)), batch_size=2)
    with pytest.raises(ValueError, match=r"`x` \(DataLoader\) has 0 batches"):
        model.fit(empty, verbose=0)
    with pytest.raises(ValueError, match=r"`evaluate` \(generator\) yielded no batch"):
        model.evaluate((b for b in []), verbose=0)
    with pytest.raises(ValueError, match=r"`x` \(generator\) yielded no batch, so there is nothing to predict"):
        model.predict((b for b in []), verbose=0)


def test_one_shot_training_generator_ends_training_instead_of_an_empty_epoch():
    model = _bias_model(0.0)
    batches = ((torch.zeros(4, 1), Y4) for _ in range(1))
    ends = []
    watch = LambdaCallback(on_epoch_end=lambda epoch, logs: ends.append(dict(logs)))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        h = model.fit(batches, epochs=3, callbacks=[EarlyStopping(monitor="loss"), watch], verbose=0)
    assert h.epoch == [0] and ends == [{"loss": 5.0, "learning_rate": 0.0}]
    assert [str(w.message)[:62] for w in rec] == ["The training data (generator) yielded no batch in epoch 2, so "]
