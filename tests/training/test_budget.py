"""Step budgets: fit(max_steps=...), the planned step count and the schedulers built from it."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import BackupAndRestore, LambdaCallback
from fitkit.checks import FitkitWarning


def _model(accumulation: int = 1, scheduler=None, interval: str = "step", lr: float = 0.1) -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.2), nn.Linear(4, 1)), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=lr),
        loss="mse",
        scheduler=scheduler,
        scheduler_interval=interval,
        gradient_accumulation_steps=accumulation,
    )
    return model


def _data(n: int = 10):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 3, generator=g)
    return x, x.sum(1, keepdim=True)


def _recorder(model: fitkit.Model, out: dict) -> LambdaCallback:
    def batch_end(batch, logs):
        out.setdefault("batches", []).append((model.epoch, batch, model.global_step))

    def begin(logs):
        out["params"] = dict(model.callbacks[0].params)

    def before_step(batch):
        out.setdefault("lrs", []).append(model.optimizer.param_groups[0]["lr"])

    return LambdaCallback(on_train_batch_end=batch_end, on_train_begin=begin, on_backward_end=before_step)


def test_max_steps_stops_after_n_optimizer_steps_across_epochs_and_ends_the_cut_epoch():
    # 10 samples, batch 2: 5 batches per epoch; accumulation 2: 3 steps per epoch (2 + 2 + 1 batches).
    x, y = _data()
    model, seen = _model(accumulation=2), {}
    history = model.fit(
        x, y, batch_size=2, max_steps=7, validation_data=(x, y), verbose=0, callbacks=[_recorder(model, seen)]
    )
    assert model.global_step == 7
    assert history.epoch == [0, 1, 2]  # epochs unbounded: the budget ends the fit
    # the third epoch stops after its first window (2 micro-batches), never inside one
    assert [(e, b) for e, b, _ in seen["batches"] if e == 2] == [(2, 0), (2, 1)]
    assert len(seen["batches"]) == 12
    assert len(history.history["val_loss"]) == 3  # the cut epoch validates and reaches History
    assert (seen["params"]["max_steps"], seen["params"]["total_steps"], seen["params"]["epochs"]) == (7, 7, 3)


def test_epochs_and_max_steps_whichever_comes_first():
    x, y = _data()
    model = _model()
    assert model.fit(x, y, batch_size=2, epochs=2, max_steps=100, verbose=0).epoch == [0, 1]
    assert model.global_step == 10
    # the counter runs over fits: a second fit with the same budget has 90 steps left
    model.fit(x, y, batch_size=2, epochs=1, max_steps=12, verbose=0)
    assert model.global_step == 12
    with pytest.warns(FitkitWarning, match=r"fit\(max_steps=12\) is already spent: the model has taken 12"):
        assert model.fit(x, y, batch_size=2, max_steps=12, verbose=0).epoch == []  # spent: nothing runs


def test_max_steps_ends_one_long_epoch_of_an_endless_source():
    def endless():
        g = torch.Generator().manual_seed(0)
        while True:
            xb = torch.randn(2, 3, generator=g)
            yield xb, xb.sum(1, keepdim=True)

    model = _model(accumulation=3)
    history = model.fit(endless(), max_steps=4, verbose=0)
    assert history.epoch == [0] and model.global_step == 4


def _warmup_decay(optimizer, total_steps, warmup=2):
    # linear warmup over `warmup` steps, then linear decay to 0 at `total_steps`
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else max(0.0, (total_steps - s) / (total_steps - warmup))
    )


@pytest.mark.parametrize("form", ["total_steps", "num_training_steps"])
def test_a_scheduler_factory_built_from_the_planned_steps_gives_the_hand_lrs(form):
    factory = (
        _warmup_decay
        if form == "total_steps"
        else (lambda opt, num_training_steps: _warmup_decay(opt, num_training_steps))
    )
    x, y = _data()
    model, seen = _model(scheduler=factory), {}
    assert model.scheduler is None  # built at the start of fit
    model.fit(x, y, batch_size=2, max_steps=7, verbose=0, callbacks=[_recorder(model, seen)])
    # total 7, warmup 2: 0.1 * [1/2, 1, 5/5, 4/5, 3/5, 2/5, 1/5]
    assert seen["lrs"] == pytest.approx([0.05, 0.1, 0.1, 0.08, 0.06, 0.04, 0.02], abs=1e-12)


def test_the_planned_steps_without_max_steps_follow_epochs_and_accumulation():
    x, y = _data()
    model, seen = _model(accumulation=2, scheduler=functools.partial(_warmup_decay, warmup=1)), {}
    model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=[_recorder(model, seen)])
    assert seen["params"]["total_steps"] == 6 and seen["params"]["max_steps"] is None  # 2 x ceil(5 / 2)
    assert seen["lrs"] == pytest.approx([0.1, 0.1, 0.08, 0.06, 0.04, 0.02], abs=1e-12)  # (6 - s) / 5


def test_a_partial_that_fills_total_steps_is_an_ordinary_factory():
    model = _model(scheduler=functools.partial(_warmup_decay, total_steps=4))
    assert type(model.scheduler).__name__ == "LambdaLR"


class _Crash(Exception):
    pass


def _budget_run(tmp_path, crash_at=None, save_freq=2):
    x, y = _data(12)
    model, seen = _model(accumulation=2, scheduler=_warmup_decay), {}

    def crash(batch, logs):
        if model.global_step == crash_at:
            raise _Crash

    callbacks = [
        LambdaCallback(on_train_batch_end=crash),
        _recorder(model, seen),
        BackupAndRestore(tmp_path, save_freq=save_freq),
    ]
    model.fit(x, y, batch_size=2, max_steps=8, validation_data=(x, y), verbose=0, callbacks=callbacks)
    return model, seen


@pytest.mark.parametrize(("save_freq", "crash_at"), [(2, 5), ("epoch", 7)])
def test_a_resumed_budget_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path, save_freq, crash_at):
    # 12 samples, batch 2, accumulation 2: 3 steps per epoch; max_steps=8 cuts the third epoch.
    ref, ref_seen = _budget_run(tmp_path / "ref", save_freq=save_freq)
    with pytest.raises(_Crash):
        _budget_run(tmp_path / "run", crash_at, save_freq)
    resumed, seen = _budget_run(tmp_path / "run", save_freq=save_freq)
    assert resumed.global_step == ref.global_step == 8
    assert resumed.history.epoch == ref.history.epoch == [0, 1, 2]
    for k, v in ref.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    assert resumed.history.history == ref.history.history
    assert seen["lrs"] == ref_seen["lrs"][-len(seen["lrs"]) :]  # the same schedule continues


def test_a_checkpoint_loaded_before_the_first_fit_restores_a_planned_scheduler(tmp_path):
    x, y = _data()
    model = _model(scheduler=_warmup_decay)
    model.fit(x, y, batch_size=2, max_steps=3, verbose=0)
    model.save_checkpoint(tmp_path / "c.pt")
    again = _model(scheduler=_warmup_decay)
    assert again.load_checkpoint(tmp_path / "c.pt") == 1  # the budget ended epoch 0
    again.fit(x, y, batch_size=2, max_steps=5, initial_epoch=1, verbose=0)
    model.fit(x, y, batch_size=2, max_steps=5, initial_epoch=1, verbose=0)
    assert again.scheduler.last_epoch == model.scheduler.last_epoch == 5
    assert again.optimizer.param_groups[0]["lr"] == model.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (2.5, TypeError), (True, TypeError)])
def test_a_bad_max_steps_is_an_error_before_step_1(value, error):
    x, y = _data()
    model = _model()
    before = [p.clone() for p in model.module.parameters()]
    with pytest.raises(error, match=r"`max_steps`.*Received: max_steps=.*Fix:"):
        model.fit(x, y, max_steps=value, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))


def test_a_planned_scheduler_without_a_known_step_count_is_an_error_before_step_1():
    model = _model(scheduler=_warmup_decay)
    batches = (b for b in [(torch.zeros(2, 3), torch.zeros(2, 1))])
    with pytest.raises(ValueError, match=r"takes `total_steps`.*unknown.*Fix: pass `max_steps="):
        model.fit(batches, epochs=2, verbose=0)
    assert model.global_step == 0 and model.scheduler is None


def test_the_progress_line_of_an_unbounded_budget_run_names_no_epoch_count():
    import io

    from rich.console import Console

    from fitkit.callbacks import ProgressBar

    def endless():
        while True:
            yield torch.zeros(2, 3), torch.zeros(2, 1)

    console = Console(file=io.StringIO(), force_terminal=False, width=200)
    _model().fit(endless(), max_steps=3, callbacks=[ProgressBar(2, console=console)])
    out = console.file.getvalue()
    assert out.startswith("Epoch 1 - 3 steps - ") and "None" not in out


def test_the_budget_the_accumulation_schedule_and_step_validation_add_no_host_sync_per_step():
    from _syncs import CountSteps

    from fitkit.callbacks import GradientAccumulationScheduler

    x, y = _data(40)
    counts = []
    for options in ({}, {"max_steps": 12, "validation_data": (x, y), "validation_interval": 9}):
        model, count = _model(), CountSteps(2, 8)  # steps 3-8: no validation falls in them
        extra = [GradientAccumulationScheduler({0: 2})] if options else []
        model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[count, *extra], **options)
        counts.append(count.count)
    assert counts[1] == counts[0] == 0


def test_a_float_epochs_trains_the_fraction_of_the_next_epochs_steps():
    """epochs=2.5 (the Trainer's num_train_epochs): 10 samples, batch 2, accumulation 2 gives 3
    steps per epoch (2 + 2 + 1 batches); 2.5 epochs = 6 + ceil(0.5 * 3) = 8 steps, the third
    epoch cut after its second window, validated and in History; a planned scheduler sees 8."""
    x, y = _data()
    model, seen = _model(accumulation=2, scheduler=functools.partial(_warmup_decay, warmup=1)), {}
    history = model.fit(
        x, y, batch_size=2, epochs=2.5, validation_data=(x, y), verbose=0, callbacks=[_recorder(model, seen)]
    )
    assert model.global_step == 8 and history.epoch == [0, 1, 2]
    assert [(e, b) for e, b, _ in seen["batches"] if e == 2] == [(2, 0), (2, 1), (2, 2), (2, 3)]
    assert len(history.history["val_loss"]) == 3
    assert (seen["params"]["max_steps"], seen["params"]["total_steps"], seen["params"]["epochs"]) == (8, 8, 3)
    assert seen["lrs"] == pytest.approx([0.1 * (8 - s) / 7 if s else 0.1 for s in range(8)], abs=1e-12)


def test_a_float_epochs_and_max_steps_whichever_comes_first_and_whole_floats_are_ints():
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=2, epochs=2.5, max_steps=11, verbose=0)  # 12.5 -> 13 steps; 11 first
    assert model.global_step == 11
    model = _model()
    history = model.fit(x, y, batch_size=2, epochs=2.0, verbose=0)  # 2.0 is 2: no budget
    assert model.global_step == 10 and history.params["max_steps"] is None
    model = _model()
    model.fit(x, y, batch_size=2, epochs=0.1, verbose=0)  # ceil(0.1 * 5) = 1 step
    assert model.global_step == 1


@pytest.mark.parametrize("epochs", [-0.5, float("nan"), float("inf")])
def test_a_bad_float_epochs_is_an_error_before_step_1(epochs):
    x, y = _data()
    model = _model()
    before = [p.clone() for p in model.module.parameters()]
    with pytest.raises(ValueError, match=r"epochs.*Fix:"):
        model.fit(x, y, batch_size=2, epochs=epochs, verbose=0)
    assert model.global_step == 0
    assert all(torch.equal(p, q) for p, q in zip(model.module.parameters(), before, strict=True))


def test_a_float_epochs_over_data_without_a_length_is_an_error_before_step_1():
    x, y = _data()
    model = _model()
    with pytest.raises(ValueError, match=r"epochs=1\.5 trains a fraction.*Fix: pass `steps_per_epoch=`"):
        model.fit(((x[i : i + 2], y[i : i + 2]) for i in range(0, 10, 2)), epochs=1.5, verbose=0)
    assert model.global_step == 0
