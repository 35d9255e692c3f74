"""Callback protocol and the monitoring / LR / NaN / lambda callbacks (fed scripted logs)."""

from __future__ import annotations

import pytest
import torch
import torchmetrics
from torch import nn

import fitkit
from fitkit.callbacks import (
    Callback,
    CallbackList,
    EarlyStopping,
    LambdaCallback,
    LearningRateScheduler,
    ReduceLROnPlateau,
    TerminateOnNaN,
)
from fitkit.callbacks.base import HOOKS
from fitkit.callbacks.monitor import resolve_mode


def _regression(n: int = 16):
    x = torch.linspace(-1, 1, n).unsqueeze(1)
    return x, 3 * x + 1


def _model(lr: float = 0.1, optimizer=torch.optim.SGD, **compile_kwargs) -> fitkit.Model:
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(optimizer=lambda p: optimizer(p, lr=lr), loss="mse", **compile_kwargs)
    return model


def _weights(model: fitkit.Model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _script(key: str, values: list[float]) -> LambdaCallback:
    """Put ``values[epoch]`` into the epoch logs as ``key`` (before callbacks later in the list)."""
    return LambdaCallback(on_epoch_end=lambda epoch, logs: logs.__setitem__(key, values[epoch]))


def _snapshotter(model: fitkit.Model, into: list) -> LambdaCallback:
    return LambdaCallback(on_epoch_end=lambda epoch, logs: into.append(_weights(model)))


# -- the hook protocol ------------------------------------------------------------------------
class Recorder(Callback):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []
        self.batch_log_types: set[type] = set()
        self.epoch_log_types: set[type] = set()


def _record(hook):
    def fn(self, *args):
        self.calls.append((hook, *[a for a in args if isinstance(a, int)]))
        if hook == "on_train_batch_end":
            self.batch_log_types |= {type(v) for v in args[1].values()}
        if hook == "on_epoch_end":
            self.epoch_log_types |= {type(v) for v in args[1].values()}

    return fn


for _hook in HOOKS:
    setattr(Recorder, _hook, _record(_hook))


def test_hook_sequence_two_epochs_two_batches_with_validation():
    x, y = _regression(8)
    model = _model()
    rec = Recorder()
    model.fit(x, y, batch_size=4, epochs=2, validation_data=(x[:4], y[:4]), callbacks=[rec], verbose=0)
    expected = [("on_train_begin",)]
    for epoch in range(2):
        expected.append(("on_epoch_begin", epoch))
        for batch in range(2):
            expected += [("on_train_batch_begin", batch), ("on_backward_end", batch), ("on_train_batch_end", batch)]
        expected += [("on_test_begin",), ("on_test_batch_begin", 0), ("on_test_batch_end", 0), ("on_test_end",)]
        expected += [("on_validation_end",), ("on_epoch_end", epoch)]
    expected.append(("on_train_end",))
    assert rec.calls == expected
    assert rec.batch_log_types == {torch.Tensor} and rec.epoch_log_types == {float}


def test_lambda_callback_registers_only_the_hooks_given():
    seen = []
    cb = LambdaCallback(on_train_begin=lambda logs: seen.append("begin"), on_batch_end=lambda b, logs: seen.append(b))
    cl = CallbackList([cb], model=None, params={})
    assert cl.wants("on_train_batch_end") and not cl.wants("on_epoch_end")
    x, y = _regression(8)
    _model().fit(x, y, batch_size=4, epochs=1, callbacks=[cb], verbose=0)
    assert seen == ["begin", 0, 1]
    with pytest.raises(TypeError, match="Unknown hook 'on_epoch_finish'"):
        LambdaCallback(on_epoch_finish=print)
    with pytest.raises(TypeError, match="callable"):
        LambdaCallback(on_epoch_end=3)


# -- EarlyStopping ------------------------------------------------------------------------------
def test_early_stopping_restores_the_epoch_index_2_snapshot_of_a_scripted_monitor():
    # 3, 2, 1, 1.5, 1.6: the minimum 1 is at epoch index 2 (the third epoch).
    x, y = _regression()
    model, snaps = _model(), []
    stop = EarlyStopping(monitor="scripted_loss", patience=10, restore_best_weights=True)
    model.fit(
        x,
        y,
        epochs=5,
        verbose=0,
        callbacks=[_script("scripted_loss", [3, 2, 1, 1.5, 1.6]), stop, _snapshotter(model, snaps)],
    )
    final = _weights(model)
    assert len(snaps) == 5 and stop.best_epoch == 2 and stop.best == 1 and stop.stopped_epoch == 0
    assert all(torch.equal(final[k], snaps[2][k]) for k in final)
    assert not torch.equal(final["weight"], snaps[4]["weight"])  # a deep copy, not a live view


def test_early_stopping_restores_when_another_callback_stops_training():
    x, y = _regression()
    model, snaps = _model(), []
    stopper = LambdaCallback(on_epoch_end=lambda e, logs: setattr(model, "stop_training", e == 3))
    stop = EarlyStopping(monitor="s_loss", patience=10, restore_best_weights=True)
    h = model.fit(
        x,
        y,
        epochs=8,
        verbose=0,
        callbacks=[_script("s_loss", [3, 1, 2, 2.5]), stop, _snapshotter(model, snaps), stopper],
    )
    assert h.epoch == [0, 1, 2, 3]
    assert torch.equal(model.module.weight, snaps[1]["weight"])


def test_early_stopping_patience_and_min_delta_follow_keras():
    x, y = _regression()
    model = _model()
    # improvements smaller than min_delta do not count: best stays 1.0 from epoch 0
    stop = EarlyStopping(monitor="s_loss", min_delta=0.1, patience=2)
    h = model.fit(x, y, epochs=10, verbose=0, callbacks=[_script("s_loss", [1.0, 0.95, 0.92, 0.5, 0.4]), stop])
    assert h.epoch == [0, 1, 2] and stop.stopped_epoch == 2 and stop.best == 1.0


def test_early_stopping_baseline_never_beaten_stops_after_patience_and_restores_best():
    x, y = _regression()
    model, snaps = _model(), []
    stop = EarlyStopping(monitor="s_loss", patience=2, baseline=0.5, restore_best_weights=True)
    script = _script("s_loss", [3, 2, 1, 1.5, 1.6, 1.7])
    h = model.fit(x, y, epochs=10, verbose=0, callbacks=[script, stop, _snapshotter(model, snaps)])
    # improvements that miss the baseline keep the wait growing; the first non-improvement stops
    assert h.epoch == [0, 1, 2, 3] and stop.stopped_epoch == 3
    assert torch.equal(model.module.weight, snaps[2]["weight"])


def test_early_stopping_start_from_epoch_ignores_warm_up_epochs():
    x, y = _regression()
    stop = EarlyStopping(monitor="s_loss", patience=0, start_from_epoch=2)
    h = _model().fit(x, y, epochs=10, verbose=0, callbacks=[_script("s_loss", [1, 5, 4, 6, 7]), stop])
    assert h.epoch == [0, 1, 2, 3] and stop.best == 4


def test_early_stopping_is_reusable_and_keeps_a_loaded_state():
    x, y = _regression()
    model = _model()
    stop = EarlyStopping(monitor="s_loss", patience=1)
    model.fit(x, y, epochs=3, verbose=0, callbacks=[_script("s_loss", [1, 2, 3]), stop])
    assert stop.stopped_epoch == 1 and stop.best == 1
    h = model.fit(x, y, epochs=3, verbose=0, callbacks=[_script("s_loss", [5, 4, 3]), stop])
    assert h.epoch == [0, 1, 2] and stop.best == 3 and stop.stopped_epoch == 0  # state was reset
    state = stop.state_dict()
    fresh = EarlyStopping(monitor="s_loss", patience=1)
    fresh.load_state_dict({**state, "best": 0.0})
    h = model.fit(x, y, epochs=3, verbose=0, callbacks=[_script("s_loss", [5, 4, 3]), fresh])
    assert h.epoch == [0, 1] and fresh.best == 0.0  # the loaded best survived on_train_begin


def test_mode_auto_directions():
    model = fitkit.Model(nn.Linear(2, 3), device="cpu")
    model.compile(loss="cross_entropy", metrics=["accuracy", "auroc"])
    assert resolve_mode("val_loss", "auto", model) == "min"
    assert resolve_mode("val_reconstruction_error", "auto", model) == "min"
    assert resolve_mode("val_auroc", "auto", model) == "max"
    assert resolve_mode("accuracy", "auto", model) == "max"
    assert resolve_mode("val_mae", "auto", model) == "min"  # by name
    with pytest.raises(
        ValueError, match="cannot tell whether a larger or smaller 'val_score'.*mode='min' or mode='max'"
    ):
        resolve_mode("val_score", "auto", model)
    with pytest.raises(ValueError, match="Expected `mode` to be 'auto', 'min' or 'max'"):
        EarlyStopping(mode="down")


def test_mode_auto_follows_a_torchmetrics_metric_object():
    model = fitkit.Model(nn.Linear(2, 1), device="cpu")
    model.compile(loss="mse", metrics={"r2": torchmetrics.R2Score(), "ev": torchmetrics.ExplainedVariance()})
    assert resolve_mode("val_r2", "auto", model) == "max"
    assert resolve_mode("ev", "auto", model) == "max"


class _NoDirection(torchmetrics.Metric):
    higher_is_better = None

    def __init__(self):
        super().__init__()
        self.add_state("n", torch.zeros(()), dist_reduce_fx="sum")

    def update(self, preds, target):
        self.n += preds.shape[0]

    def compute(self):
        return self.n


def test_mode_auto_refuses_a_metric_without_a_direction_before_the_first_step(tmp_path):
    x, y = _regression()
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse", metrics={"count": _NoDirection()})
    before = _weights(model)
    ckpt = fitkit.callbacks.ModelCheckpoint(tmp_path / "c.pt", monitor="count", save_best_only=True)
    with pytest.raises(ValueError, match="ModelCheckpoint cannot tell whether a larger or smaller 'count'"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[ckpt])
    assert torch.equal(before["weight"], model.module.weight) and not any(tmp_path.iterdir())


def test_unknown_direction_raises_before_the_first_step():
    x, y = _regression()
    model = _model()
    before = _weights(model)
    with pytest.raises(ValueError, match="EarlyStopping cannot tell .* 'score'"):
        model.fit(x, y, epochs=2, verbose=0, callbacks=[_script("score", [1.0, 2.0]), EarlyStopping(monitor="score")])
    assert all(torch.equal(before[k], v) for k, v in _weights(model).items())


def test_val_monitor_without_validation_data_raises_before_the_first_step():
    x, y = _regression()
    model = _model()
    before = _weights(model)
    with pytest.raises(ValueError, match="monitors 'val_loss', but fit has no validation data"):
        model.fit(x, y, epochs=2, verbose=0, callbacks=[EarlyStopping()])
    assert torch.equal(before["weight"], model.module.weight)


def test_missing_monitor_key_lists_the_available_keys():
    x, y = _regression()
    message = r"monitors 'mystery_loss', which the logs will not hold\. Available keys: learning_rate, loss"
    with pytest.raises(ValueError, match=message):
        _model().fit(x, y, epochs=2, verbose=0, callbacks=[EarlyStopping(monitor="mystery_loss")])


def test_val_monitor_skips_epochs_without_validation():
    x, y = _regression()
    stop = EarlyStopping(patience=5)
    h = _model().fit(x, y, epochs=4, verbose=0, validation_data=(x, y), validation_freq=2, callbacks=[stop])
    assert h.epoch == [0, 1, 2, 3] and stop.best == h.history["val_loss"][-1]


# -- learning rates ------------------------------------------------------------------------------
class _SumModule(nn.Module):
    """The loss is the parameter itself: its gradient is exactly 1 at every step."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        return self.w.expand(x.shape[0])  # (B,)


def test_step_lr_history_and_weight_moves_are_exact():
    model = fitkit.Model(_SumModule(), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        loss=lambda y_pred, y: y_pred.mean(),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.1),
    )
    h = model.fit(torch.zeros(1, 1), torch.zeros(1), batch_size=1, epochs=3, verbose=0)
    lrs = h.history["learning_rate"]
    # 0.1 * 0.1 is 0.010000000000000002 in binary floating point: the LR torch used, exactly.
    assert lrs == [1.0, 0.1, 0.1 * 0.1] and lrs == pytest.approx([1.0, 0.1, 0.01], rel=1e-15, abs=0)
    assert model.module.w.item() == ((0.0 - 1.0) - 0.1) - 0.1 * 0.1


def test_learning_rate_scheduler_sets_each_epoch_rate_before_the_epoch():
    x, y = _regression()
    model = _model(lr=1.0)
    h = model.fit(x, y, epochs=3, verbose=0, callbacks=[LearningRateScheduler(lambda epoch, lr: lr * 0.5)])
    assert h.history["learning_rate"] == [0.5, 0.25, 0.125]
    h = model.fit(x, y, epochs=2, verbose=0, callbacks=[LearningRateScheduler(lambda epoch: 0.1 * (epoch + 1))])
    assert h.history["learning_rate"] == [0.1, 0.2]
    with pytest.raises(TypeError, match="`schedule` must return a number. Received: 'fast'"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[LearningRateScheduler(lambda epoch, lr: "fast")])


def test_reduce_lr_on_plateau_follows_keras_with_cooldown_and_min_lr():
    x, y = _regression()
    model = _model(lr=1.0)
    reduce = ReduceLROnPlateau(monitor="s_loss", factor=0.5, patience=2, cooldown=1, min_lr=0.2)
    h = model.fit(x, y, epochs=9, verbose=0, callbacks=[_script("s_loss", [1.0] * 9), reduce])
    assert h.history["learning_rate"] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.2, 0.2]
    assert reduce.state_dict() == {"best": 1.0, "wait": 2, "cooldown_counter": 0}
    with pytest.raises(ValueError, match=r"Expected `factor` in \[0, 1\)"):
        ReduceLROnPlateau(factor=2.0)


def test_reduce_lr_on_plateau_resets_the_wait_on_improvement():
    x, y = _regression()
    model = _model(lr=1.0)
    reduce = ReduceLROnPlateau(monitor="s_loss", factor=0.1, patience=2, min_delta=0.0)
    h = model.fit(x, y, epochs=6, verbose=0, callbacks=[_script("s_loss", [5, 6, 4, 6, 6, 6]), reduce])
    assert h.history["learning_rate"] == pytest.approx([1, 1, 1, 1, 1, 0.1], rel=1e-12)


# -- TerminateOnNaN -------------------------------------------------------------------------------
def _nan_data():
    # In-memory data with a NaN is refused before step 1, so the NaN comes in a list of batches.
    x = torch.ones(8, 1)
    x[5] = float("nan")  # batch 2 of 4 (batch_size 2), epoch 0
    return [(x[i : i + 2], torch.ones(2, 1)) for i in range(0, 8, 2)], None


def _optimizer_state(model: fitkit.Model) -> list[torch.Tensor]:
    state = model.optimizer.state_dict()["state"]
    return [v.clone() for s in state.values() for v in s.values()]  # step, exp_avg, exp_avg_sq


@pytest.mark.parametrize("fused", [True, False])
def test_terminate_on_nan_skips_the_step_and_every_later_one_and_stops_at_the_check(fused):
    # Fused Adam takes the veto on the device (no host read); torch's default Adam reads it.
    x, y = _nan_data()
    model = _model(optimizer=lambda p, lr: torch.optim.Adam(p, lr=lr, fused=fused))
    steps = []
    after = LambdaCallback(
        on_train_batch_end=lambda b, logs: steps.append((b, _weights(model), _optimizer_state(model)))
    )
    h = model.fit(x, y, epochs=3, verbose=0, callbacks=[TerminateOnNaN(), after])
    # The verdict is read at the epoch end: batch 3 runs, and its step is vetoed too.
    assert [b for b, _, _ in steps] == [0, 1, 2, 3] and h.epoch == [0]
    assert torch.equal(model.module.weight, steps[1][1]["weight"])  # the NaN step never happened
    assert model.global_step == 2
    # Adam's state is that of step 2 exactly: step count, first and second moments.
    assert all(torch.equal(a, b) for a, b in zip(_optimizer_state(model), steps[1][2], strict=True))
    assert all(s["step"].item() == 2 for s in model.optimizer.state_dict()["state"].values())


def test_terminate_on_nan_with_check_every_1_stops_at_that_batch():
    x, y = _nan_data()
    model = _model(optimizer=torch.optim.Adam)
    seen = []
    after = LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(b))
    h = model.fit(x, y, epochs=3, verbose=0, callbacks=[TerminateOnNaN(check_every=1), after])
    assert seen == [0, 1, 2] and h.epoch == [0] and model.global_step == 2


def test_terminate_on_nan_stops_inside_the_epoch_at_the_next_check():
    x = torch.ones(20, 1)
    x[5] = float("nan")  # batch 2 (batch_size 2)
    batches = [(x[i : i + 2], torch.ones(2, 1)) for i in range(0, 20, 2)]
    model = _model(optimizer=lambda p, lr: torch.optim.SGD(p, lr=lr, fused=True))
    seen = []
    after = LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(b))
    model.fit(batches, epochs=2, verbose=0, callbacks=[TerminateOnNaN(check_every=4), after])
    assert seen == [0, 1, 2, 3] and model.global_step == 2  # read after 4 steps: batch 3


def test_terminate_on_nan_with_gradient_accumulation_checks_every_micro_batch():
    x, y = _nan_data()  # NaN in batch 2 = first micro-batch of the second group of 2
    model = _model(gradient_accumulation_steps=2)
    weights = []
    record = LambdaCallback(on_backward_end=lambda b: weights.append(_weights(model)))
    h = model.fit(x, y, epochs=2, verbose=0, callbacks=[TerminateOnNaN(), record])
    assert h.epoch == [0] and model.global_step == 1
    assert torch.equal(model.module.weight, weights[-1]["weight"]) and model.module.weight.isfinite().all()


def test_terminate_on_nan_can_raise():
    x, y = _nan_data()
    model = _model(optimizer=lambda p, lr: torch.optim.SGD(p, lr=lr, fused=True))
    with pytest.raises(RuntimeError, match="The loss is nan at batch 2 of epoch 0; that optimizer step and every"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[TerminateOnNaN(raise_error=True)])
    assert model.module.weight.isfinite().all() and model.global_step == 2


def test_terminate_on_nan_under_fp16_joins_the_scalers_verdict():
    x, y = _nan_data()
    model = _model(optimizer=lambda p, lr: torch.optim.SGD(p, lr=lr, fused=True), precision="16-mixed")
    after = []
    record = LambdaCallback(on_train_batch_end=lambda b, logs: after.append(_weights(model)))
    model.fit(x, y, epochs=2, verbose=0, callbacks=[TerminateOnNaN(), record])
    assert len(after) == 4 and model.global_step == 2
    assert torch.equal(model.module.weight, after[1]["weight"])


def test_terminate_on_nan_check_every_must_be_positive():
    with pytest.raises(ValueError, match="check_every"):
        TerminateOnNaN(check_every=0)


def test_early_stopping_fed_synthetic_logs_directly():
    class FakeModel:
        stop_training = False
        metrics = None

    stop = EarlyStopping(monitor="val_accuracy", mode="max", patience=1)
    stop.set_model(FakeModel())
    for epoch, acc in enumerate([0.5, 0.7, 0.6]):
        stop.on_epoch_end(epoch, {"val_accuracy": acc})
    assert stop.model.stop_training and stop.stopped_epoch == 2 and stop.best == 0.7
    auto = EarlyStopping(monitor="val_loss", patience=0)  # "auto", resolved at the first epoch end
    auto.set_model(FakeModel())
    auto.on_epoch_end(0, {"val_loss": 1.0})
    auto.on_epoch_end(1, {"val_loss": 0.5})
    assert not auto.model.stop_training and auto.best == 0.5
