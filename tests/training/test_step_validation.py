"""Validation inside an epoch: fit(validation_interval=...), history.validations, on_validation_end."""

from __future__ import annotations

import csv
import io

import pytest
import torch
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import (
    BackupAndRestore,
    CSVLogger,
    EarlyStopping,
    LambdaCallback,
    ModelCheckpoint,
    ProgressBar,
    ReduceLROnPlateau,
)


def _model(lr: float = 0.1, **compile_kwargs) -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Sequential(nn.Linear(3, 6), nn.Dropout(0.3), nn.Tanh(), nn.Linear(6, 1)), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=lr), loss="mse", metrics=["mae"], **compile_kwargs)
    return model


def _data(n: int = 12):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 3, generator=g)
    return x, x @ torch.tensor([[1.0], [-1.0], [0.5]])


def test_validation_every_n_optimizer_steps_is_recorded_with_its_step_and_exact_values():
    # 12 samples, batch 2: 6 steps per epoch; every 4 steps: global steps 4, 8, 12.
    x, y = _data()
    xv, yv = x[:5], y[:5]
    model, direct = _model(), []
    check = LambdaCallback(
        on_validation_end=lambda logs: direct.append(model.evaluate(xv, yv, batch_size=2, verbose=0))
    )
    h = model.fit(
        x, y, batch_size=2, epochs=2, validation_data=(xv, yv), validation_interval=4, verbose=0, callbacks=[check]
    )
    assert [(r["epoch"], r["step"]) for r in h.validations] == [(0, 4), (1, 8), (1, 12)]
    # each value is the validation of the weights at that step (an evaluate there agrees)
    assert [r["val_loss"] for r in h.validations] == [d["loss"] for d in direct]
    assert [r["val_mae"] for r in h.validations] == [d["mae"] for d in direct]
    # the epoch logs hold each epoch's last validation; history.history stays per epoch
    assert h.history["val_loss"] == [h.validations[0]["val_loss"], h.validations[2]["val_loss"]]
    assert len(h.history["loss"]) == 2


def test_a_fraction_validates_at_that_share_of_each_epochs_steps():
    # 16 samples, batch 2, accumulation 2: 4 steps per epoch; 0.5 -> every int(0.5 * 4) = 2 steps of the epoch.
    x, y = _data(16)
    model = _model(gradient_accumulation_steps=2)
    h = model.fit(x, y, batch_size=2, epochs=2, validation_data=(x, y), validation_interval=0.5, verbose=0)
    assert [(r["epoch"], r["step"]) for r in h.validations] == [(0, 2), (0, 4), (1, 6), (1, 8)]


def test_inside_epoch_validation_leaves_the_training_stream_unchanged():
    # Dropout, shuffled training data and a shuffled validation DataLoader (it draws from the RNG).
    x, y = _data(20)
    val = DataLoader(TensorDataset(x[:7], y[:7]), batch_size=3, shuffle=True)
    runs = []
    for validation in ({}, {"validation_data": val, "validation_interval": 3}):
        model, order = _model(), []
        watch = LambdaCallback(on_train_batch_begin=lambda b, logs, order=order: order.append(torch.rand(1).item()))
        h = model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[watch], **validation)
        runs.append((model.state_dict(), h.history["loss"], h.history["mae"], order))
    (w0, loss0, mae0, order0), (w1, loss1, mae1, order1) = runs
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert loss0 == loss1 and mae0 == mae1 and order0 == order1
    assert [r["step"] for r in h.validations] == [3, 6, 9, 12, 15]


def test_on_validation_end_comes_before_the_batch_hooks_and_at_epoch_ends_without_an_interval():
    x, y = _data(8)
    events: list = []
    cb = LambdaCallback(
        on_validation_end=lambda logs: events.append(("val", logs["step"])),
        on_train_batch_end=lambda b, logs: events.append(("batch", b)),
        on_epoch_end=lambda e, logs: events.append(("epoch", e)),
    )
    model = _model()
    model.fit(x, y, batch_size=4, epochs=2, validation_data=(x, y), validation_interval=3, verbose=0, callbacks=[cb])
    assert events == [("batch", 0), ("batch", 1), ("epoch", 0), ("val", 3), ("batch", 0), ("batch", 1), ("epoch", 1)]
    events.clear()
    h = _model().fit(x, y, batch_size=4, epochs=2, validation_data=(x, y), verbose=0, callbacks=[cb])
    assert events == [
        ("batch", 0),
        ("batch", 1),
        ("val", 2),
        ("epoch", 0),
        ("batch", 0),
        ("batch", 1),
        ("val", 4),
        ("epoch", 1),
    ]
    assert [r["val_loss"] for r in h.validations] == h.history["val_loss"]


def _script(values: list[float]) -> LambdaCallback:
    """Replaces each validation's val_loss by the next scripted value (before the monitors read it)."""
    it = iter(values)
    return LambdaCallback(on_validation_end=lambda logs: logs.__setitem__("val_loss", next(it)))


def test_early_stopping_acts_at_each_validation_and_stops_inside_the_epoch():
    x, y = _data()  # 6 steps per epoch; validations every 2 steps
    stop = EarlyStopping(monitor="val_loss", patience=2)
    model = _model()
    h = model.fit(
        x,
        y,
        batch_size=2,
        epochs=5,
        validation_data=(x, y),
        validation_interval=2,
        verbose=0,
        callbacks=[_script([3.0, 2.0, 2.5, 2.6, 9.0]), stop],
    )
    # best 2.0 at the 2nd validation; the 4th (step 8, epoch 1) is the 2nd without improvement
    assert model.global_step == 8 and h.epoch == [0, 1]
    assert (stop.best, stop.wait, stop.stopped_epoch) == (2.0, 2, 1)
    assert "did not improve for 2 validation(s)" in stop.stop_reason


def test_model_checkpoint_names_its_files_by_step_at_each_validation(tmp_path):
    x, y = _data()
    ckpt = ModelCheckpoint(
        str(tmp_path / "s{step}.pt"), monitor="val_loss", save_best_only=True, save_weights_only=True
    )
    _model().fit(
        x,
        y,
        batch_size=2,
        epochs=2,
        validation_data=(x, y),
        validation_interval=3,
        verbose=0,
        callbacks=[_script([3.0, 2.0, 2.5, 1.0]), ckpt],
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s12.pt", "s3.pt", "s6.pt"]
    assert ckpt.best == 1.0 and ckpt.best_path.endswith("s12.pt")


def _lr_at_validations(model: fitkit.Model, seen: list) -> LambdaCallback:
    return LambdaCallback(on_validation_end=lambda logs: seen.append(model.optimizer.param_groups[0]["lr"]))


@pytest.mark.parametrize("form", ["callback", "compiled"])
def test_plateau_reductions_follow_the_validations_not_the_epochs(form):
    # The loss stays 0: no validation after the first improves; 6 validations in 2 epochs.
    x = torch.zeros(12, 3)

    def plateau(o):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5)

    model = _model(scheduler=plateau if form == "compiled" else None)
    nn.init.zeros_(model.module[-1].weight), nn.init.zeros_(model.module[-1].bias)
    callbacks = [ReduceLROnPlateau(monitor="val_loss", patience=1, factor=0.5)] if form == "callback" else []
    seen: list = []
    model.fit(
        x,
        torch.zeros(12, 1),
        batch_size=2,
        epochs=2,
        validation_data=(x, torch.zeros(12, 1)),
        validation_interval=2,
        verbose=0,
        callbacks=[*callbacks, _lr_at_validations(model, seen)],
    )
    # reductions at validations 2..6; none at the epoch ends (that would give 0.1 * 0.5 ** 7)
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**5, abs=0)


def test_csv_logger_writes_a_row_per_validation_with_its_step(tmp_path):
    x, y = _data()
    path = tmp_path / "log.csv"
    h = _model().fit(
        x,
        y,
        batch_size=4,
        epochs=2,
        validation_data=(x, y),
        validation_interval=2,
        verbose=0,
        callbacks=[CSVLogger(path)],
    )
    rows = list(csv.DictReader(path.open()))
    assert [(r["epoch"], r["step"], r["loss"] != "NA", r["val_loss"] != "NA") for r in rows] == [
        ("0", "2", False, True),
        ("0", "3", True, False),
        ("1", "4", False, True),
        ("1", "6", False, True),
        ("1", "6", True, False),
    ]
    assert [float(r["val_loss"]) for r in rows if r["val_loss"] != "NA"] == pytest.approx(
        [r["val_loss"] for r in h.validations], rel=1e-15
    )


def test_tensorboard_writes_each_validation_at_its_global_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fitkit.callbacks import TensorBoard

    x, y = _data()
    h = _model().fit(
        x,
        y,
        batch_size=4,
        epochs=2,
        validation_data=(x, y),
        validation_interval=2,
        verbose=0,
        callbacks=[TensorBoard(tmp_path)],
    )
    acc = EventAccumulator(str(tmp_path / "validation"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("step_loss")] == [r["step"] for r in h.validations] == [2, 4, 6]


def test_the_progress_bar_prints_a_line_per_validation():
    x, y = _data()
    console = Console(file=io.StringIO(), force_terminal=False, width=200)
    _model().fit(
        x,
        y,
        batch_size=4,
        epochs=1,
        validation_data=(x, y),
        validation_interval=2,
        callbacks=[ProgressBar(2, console=console)],
    )
    out = console.file.getvalue()
    assert "Validation at step 2 (epoch 1) - val_loss: " in out and "val_mae: " in out


class _Crash(Exception):
    pass


def _resume_run(folder, crash_at=None):
    x, y = _data()
    model = _model()

    def crash(batch, logs):
        if model.global_step == crash_at:
            raise _Crash

    stop = EarlyStopping(monitor="val_loss", patience=3)
    by_step = {2: 3.0, 4: 2.0, 6: 2.5, 8: 2.6, 10: 2.7, 12: 2.8}  # keyed by step: the same after a resume
    script = LambdaCallback(on_validation_end=lambda logs: logs.__setitem__("val_loss", by_step[logs["step"]]))
    callbacks = [script, stop, LambdaCallback(on_train_batch_end=crash), BackupAndRestore(folder, save_freq=1)]
    model.fit(
        x, y, batch_size=2, epochs=3, validation_data=(x, y), validation_interval=2, verbose=0, callbacks=callbacks
    )
    return model, stop


def test_a_backup_taken_after_a_step_validation_resumes_exactly(tmp_path):
    ref, ref_stop = _resume_run(tmp_path / "ref")
    with pytest.raises(_Crash):
        _resume_run(tmp_path / "run", crash_at=7)  # the last backup is step 6's, after its validation
    backup = torch.load(tmp_path / "run" / "backup.pt", weights_only=True)
    assert [r["step"] for r in backup["history"]["validations"]] == [2, 4, 6]
    assert (backup["global_step"], backup["callbacks"]["EarlyStopping"]["wait"]) == (6, 1)
    model, stop = _resume_run(tmp_path / "run")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in ref.state_dict().items())
    assert model.history.history == ref.history.history and model.history.validations == ref.history.validations
    assert (
        (stop.best, stop.wait, stop.stopped_epoch)
        == (ref_stop.best, ref_stop.wait, ref_stop.stopped_epoch)
        == (2.0, 3, 1)
    )
    assert model.global_step == ref.global_step == 10


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "match"),
    [
        (0, {}, ValueError, r"`validation_interval` to be a positive number\. Received: validation_interval=0\. Fix:"),
        (1.5, {}, ValueError, r"float `validation_interval` in \(0, 1\]\. Received: validation_interval=1\.5"),
        (
            "4",
            {},
            TypeError,
            r"`validation_interval` to be an int, a float or a timedelta\. Received: validation_interval='4'",
        ),
        (True, {}, TypeError, r"validation_interval=True of type bool"),
        (2, {"validation_data": None}, ValueError, r"no validation data\. Fix: pass `validation_data="),
        (2, {"validation_freq": 2}, ValueError, r"both say when to validate\. Fix: pass one of them"),
    ],
)
def test_a_bad_validation_interval_is_an_error_before_step_1(value, kwargs, error, match):
    x, y = _data()
    model = _model()
    before = [p.clone() for p in model.module.parameters()]
    options = {"validation_data": (x, y), **kwargs}
    with pytest.raises(error, match=match):
        model.fit(x, y, validation_interval=value, verbose=0, **options)
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))


def test_a_fraction_needs_a_known_epoch_length():
    x, y = _data()
    batches = ((x[i : i + 2], y[i : i + 2]) for i in range(0, 12, 2))
    with pytest.raises(ValueError, match=r"fraction of the epoch.*Fix: pass an int validation_interval"):
        _model().fit(batches, validation_data=(x, y), validation_interval=0.5, verbose=0)


def test_max_steps_and_step_validation_together():
    x, y = _data()
    h = _model().fit(x, y, batch_size=2, max_steps=7, validation_data=(x, y), validation_interval=3, verbose=0)
    # 6 steps per epoch: both validations fall in epoch 0; epoch 1 (step 7) has none
    assert [(r["epoch"], r["step"]) for r in h.validations] == [(0, 3), (0, 6)] and h.epoch == [0, 1]
    assert h.history["val_loss"] == [h.validations[1]["val_loss"]]


_DIST_FIT = """
model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss="mse", metrics=["mae"])
h = model.fit(x, y, sample_weight=w, batch_size=BATCH, max_steps=7, validation_data=(xv, yv), validation_interval=2,
              shuffle=True, verbose=0, callbacks=[fitkit.callbacks.GradientAccumulationScheduler({0: 2, 1: 1})])
result = {"epoch": h.epoch, "step": model.global_step, "validations": h.validations, "loss": h.history["loss"],
          "weights": [p.detach().flatten().tolist() for p in model.module.parameters()]}
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_max_steps_step_validation_and_an_accumulation_schedule_under_torchrun_equal_one_process(tmp_path):
    import json

    from _dist_scenarios import data, net
    from _torchrun import run_torchrun

    setup = """
import json, torch, fitkit
from fitkit.distributed import rank
from _dist_scenarios import data, net
torch.manual_seed(0)
x, y, w = data(40)
xv, yv, _ = data(11, seed=1)
model = fitkit.Model(net(), device="cpu")
BATCH = 4
"""
    run_torchrun(setup + _DIST_FIT + "(OUT / f'rank{rank()}.json').write_text(json.dumps(result))\n", tmp_path)
    torch.manual_seed(0)
    x, y, w = data(40)
    xv, yv, _ = data(11, seed=1)
    scope = {
        "torch": torch,
        "fitkit": fitkit,
        "x": x,
        "y": y,
        "w": w,
        "xv": xv,
        "yv": yv,
        "BATCH": 8,
        "model": fitkit.Model(net(), device="cpu"),
    }
    exec(_DIST_FIT, scope)
    ref = scope["result"]
    # 5 global batches per epoch: epoch 0 at accumulation 2 (3 steps), then 1 per step; 7 steps
    assert (ref["epoch"], ref["step"]) == ([0, 1], 7)
    assert [(v["epoch"], v["step"]) for v in ref["validations"]] == [(0, 2), (1, 4), (1, 6)]
    for r in (0, 1):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert (got["epoch"], got["step"]) == (ref["epoch"], ref["step"])
        assert [(v["epoch"], v["step"]) for v in got["validations"]] == [(0, 2), (1, 4), (1, 6)]
        for a, b in zip(got["validations"], ref["validations"], strict=True):
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        for a, b in zip(got["weights"], ref["weights"], strict=True):
            assert a == pytest.approx(b, abs=1e-5)


def test_validate_at_end_scores_the_last_step_of_an_epoch_bound_and_of_a_budget():
    # 12 samples, batch 4: 3 steps per epoch; every 2 steps over 2 epochs: 2, 4, 6 (6 is the end anyway)
    x, y = _data()
    model = _model()
    history = model.fit(
        x, y, batch_size=4, epochs=2, validation_data=(x, y), validation_interval=2, validate_at_end=True, verbose=0
    )
    assert [r["step"] for r in history.validations] == [2, 4, 6]  # no second validation at step 6
    # every 4 steps, budget 7: 4 by the interval, 7 at the end, scored on the final weights
    model = _model()
    history = model.fit(
        x, y, batch_size=4, max_steps=7, validation_data=(x, y), validation_interval=4, validate_at_end=True, verbose=0
    )
    assert [(r["epoch"], r["step"]) for r in history.validations] == [(1, 4), (2, 7)]
    assert history.history["val_loss"][-1] == history.validations[-1]["val_loss"]
    assert history.validations[-1]["val_loss"] == model.evaluate(x, y, batch_size=4, verbose=0)["loss"]
    # without it (the default), the run's last validation stays the one at step 4
    model = _model()
    history = model.fit(x, y, batch_size=4, max_steps=7, validation_data=(x, y), validation_interval=4, verbose=0)
    assert [r["step"] for r in history.validations] == [4]


def test_validate_at_end_does_not_validate_after_an_early_stop():
    # 3 steps per epoch, every 2 steps; a callback stops after epoch 0 (step 3): only step 2 is
    # validated, while the same run planned for 1 epoch ends at step 3 and validates it.
    x, y = _data()
    stop = LambdaCallback(on_epoch_end=lambda epoch, logs: setattr(model, "stop_training", True))
    model = _model()
    history = model.fit(
        x,
        y,
        batch_size=4,
        epochs=10,
        validation_data=(x, y),
        validation_interval=2,
        validate_at_end=True,
        verbose=0,
        callbacks=[stop],
    )
    assert model.global_step == 3 and [r["step"] for r in history.validations] == [2]
    model = _model()
    history = model.fit(
        x, y, batch_size=4, epochs=1, validation_data=(x, y), validation_interval=2, validate_at_end=True, verbose=0
    )
    assert [r["step"] for r in history.validations] == [2, 3]


@pytest.mark.parametrize("value, error", [("yes", TypeError), (True, ValueError)])
def test_a_bad_validate_at_end_is_an_error_before_step_1(value, error):
    x, y = _data()
    model = _model()
    with pytest.raises(error, match="validate_at_end"):
        model.fit(x, y, batch_size=4, validation_data=(x, y), validate_at_end=value, verbose=0)
    assert model.global_step == 0


def test_a_timedelta_interval_validates_once_that_much_training_time_has_passed(monkeypatch):
    """validation_interval=timedelta(seconds=2.5) with a fake clock that ticks 1 s per training
    batch: validations after steps 3, 6 and 9 (the time restarts at each validation), none at
    other steps; a timedelta <= 0 and a wrong type are refused before training."""
    import datetime

    from fitkit.training.step_validation import ValidationInterval

    now = [0.0]
    monkeypatch.setattr(ValidationInterval, "clock", staticmethod(lambda: now[0]))
    tick = fitkit.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: now.__setitem__(0, now[0] + 1.0))
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    x, y = torch.randn(20, 2), torch.randn(20, 1)
    h = model.fit(
        x,
        y,
        batch_size=2,
        epochs=1,
        verbose=0,
        callbacks=[tick],
        validation_data=(x[:4], y[:4]),
        validation_interval=datetime.timedelta(seconds=2.5),
    )
    assert [v["step"] for v in h.validations] == [3, 6, 9]
    for bad, error in ((datetime.timedelta(0), ValueError), ("30m", TypeError)):
        with pytest.raises(error, match="validation_interval"):
            model.fit(x, y, batch_size=2, verbose=0, validation_data=(x, y), validation_interval=bad)
    assert model.global_step == 10


@pytest.mark.parametrize(
    "call, kwargs",
    [
        ("fit", {"steps_per_epoch": 2.5}),
        ("fit", {"validation_steps": 0.5, "validation_data": "data"}),
        ("evaluate", {"steps": 1.5}),
        ("predict", {"steps": 1.5}),
    ],
)
def test_a_fractional_step_count_is_refused_with_the_fractions_that_exist(call, kwargs):
    """Keras documents steps as ints (whole batches): a float names the arguments that do take a
    fraction, before anything runs."""
    model = _model()
    x, y = _data()
    kwargs = {k: (x, y) if v == "data" else v for k, v in kwargs.items()}
    args = (x,) if call == "predict" else (x, y)
    fix = r"to be an int\. Received: .*Fix: steps count whole batches.*limit_train_batches"
    with pytest.raises(TypeError, match=fix):
        getattr(model, call)(*args, batch_size=2, verbose=0, **kwargs)
    assert model.global_step == 0


# -- validation_interval=RunFraction(f): fractions of the run's planned steps (Composer's "0.25dur") --
def _run_fraction_model():
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
    return model


def _hand_val_losses(steps: set[int], x, y, xv, yv) -> dict[int, float]:
    """The validation MSE after each of ``steps`` optimizer steps of plain SGD over x, y in order."""
    torch.manual_seed(0)
    layer = nn.Linear(1, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    out = {}
    for step in range(1, max(steps) + 1):
        i = 4 * ((step - 1) % 5)
        opt.zero_grad()
        nn.functional.mse_loss(layer(x[i : i + 4]), y[i : i + 4]).backward()
        opt.step()
        if step in steps:
            with torch.no_grad():
                out[step] = nn.functional.mse_loss(layer(xv), yv).item()
    return out


@pytest.mark.parametrize(
    "fit_kwargs, fraction, expected",
    [
        ({"epochs": 2}, 0.25, [(0, 3), (0, 5), (1, 8), (1, 10)]),  # 10 planned steps
        ({"max_steps": 7}, 0.5, [(0, 4), (1, 7)]),  # planned by max_steps: 3.5 -> 4, then the end
        ({"epochs": 2}, 1.0, [(1, 10)]),
    ],
)
def test_run_fraction_validates_at_fractions_of_the_planned_run(fit_kwargs, fraction, expected):
    from fitkit.training.budget import RunFraction

    x = torch.linspace(-1, 1, 20).reshape(20, 1)
    y, xv = 3 * x + 1, torch.linspace(-1, 1, 6).reshape(6, 1)
    yv = 3 * xv + 1
    h = _run_fraction_model().fit(
        x,
        y,
        batch_size=4,
        shuffle=False,
        validation_data=(xv, yv),
        verbose=0,
        validation_interval=RunFraction(fraction),
        **fit_kwargs,
    )
    assert [(v["epoch"], v["step"]) for v in h.validations] == expected
    hand = _hand_val_losses({s for _, s in expected}, x, y, xv, yv)
    assert [v["val_loss"] for v in h.validations] == pytest.approx([hand[s] for _, s in expected], rel=1e-6)


def test_run_fraction_bad_values_and_an_unknown_plan_are_refused_before_step_1():
    from fitkit.training.budget import RunFraction

    with pytest.raises(ValueError, match=r"Expected RunFraction's value in \(0, 1\].*Received: 1.5"):
        RunFraction(1.5)
    with pytest.raises(TypeError, match=r"Expected a number in \(0, 1\] for RunFraction"):
        RunFraction("0.5")
    model = _run_fraction_model()
    batches = ((torch.zeros(4, 1), torch.zeros(4, 1)) for _ in range(3))
    with pytest.raises(ValueError, match=r"RunFraction\(0.5\) is a fraction of the run.*unknown.*Fix: pass `max_"):
        model.fit(
            batches,
            validation_data=(torch.zeros(4, 1), torch.zeros(4, 1)),
            validation_interval=RunFraction(0.5),
            verbose=0,
        )
    assert model.global_step == 0
