"""EMA and SWA: exact averages, validation on the averaged weights, resume, BatchNorm update."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import update_bn

import fitkit
from fitkit.callbacks import EMA, SWA, BackupAndRestore, Callback, LambdaCallback


def _data(n: int = 12, features: int = 3):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, features, generator=g)
    return x, x @ torch.linspace(-1, 1, features).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g)


def _model(seed: int = 0, module: nn.Module | None = None, lr: float = 0.1, **compile_kwargs) -> fitkit.Model:
    torch.manual_seed(seed)
    module = module if module is not None else nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    model = fitkit.Model(module, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9), loss="mse", **compile_kwargs)
    return model


def _weights(module: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*module.parameters(), *module.buffers())]


class Snapshots(Callback):
    """Records the module's tensors at train begin and at each batch end (or epoch end)."""

    def __init__(self, per: str = "batch"):
        super().__init__()
        self.per, self.taken = per, []

    def on_train_begin(self, logs=None):
        if self.per == "batch":
            self.taken.append(_weights(self.model.module))

    def on_train_batch_end(self, batch, logs=None):
        if self.per == "batch":
            self.taken.append(_weights(self.model.module))

    def on_epoch_end(self, epoch, logs=None):
        if self.per == "epoch":
            self.taken.append(_weights(self.model.module))


# -- EMA -------------------------------------------------------------------------------------
def test_ema_after_three_steps_is_the_hand_computed_average():
    x, y = _data()
    model, snaps, ema = _model(), Snapshots(), EMA(decay=0.9)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, callbacks=[snaps, ema], verbose=0)
    assert len(snaps.taken) == 4 and model.global_step == 3  # initial + 3 steps
    d = 0.9
    averaged = list(ema.averaged_model.module.parameters())
    for i, got in enumerate(averaged):
        w = [s[i] for s in snaps.taken]
        # torch's recurrence (the first update copies w0): e <- lerp(e, w_t, 1 - d).
        e = w[0].clone()
        for wt in w[1:]:
            e = torch.lerp(e, wt, 1 - d)
        assert torch.equal(got, e)
        closed = d**3 * w[0] + (1 - d) * (d**2 * w[1] + d * w[2] + w[3])
        torch.testing.assert_close(got, closed, rtol=1e-6, atol=0)
    assert int(ema.averaged_model.n_averaged) == 4
    assert not torch.equal(averaged[0], snaps.taken[-1][0])  # the module keeps its own weights


def test_ema_counts_optimizer_steps_not_micro_batches():
    x, y = _data(16)
    model, ema = _model(gradient_accumulation_steps=2), EMA(decay=0.5)
    model.fit(x, y, batch_size=4, epochs=1, callbacks=[ema], verbose=0)
    assert model.global_step == 2 and int(ema.averaged_model.n_averaged) == 3


def test_ema_validation_uses_the_averaged_weights_and_restores_the_training_ones():
    x, y = _data()
    xv, yv = x[:5] * 2, y[:5]
    plain = _model()
    plain.fit(x, y, batch_size=4, epochs=3, validation_data=(xv, yv), verbose=0)
    model, ema = _model(), EMA(decay=0.8)
    seen = []
    check = LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(logs["val_loss"]))
    model.fit(x, y, batch_size=4, epochs=3, validation_data=(xv, yv), callbacks=[ema, check], verbose=0)
    # Training is untouched, bit for bit: validating on the EMA swapped the weights back.
    assert all(torch.equal(a, b) for a, b in zip(_weights(model.module), _weights(plain.module), strict=True))
    averaged = fitkit.Model(ema.averaged_model.module, device="cpu")
    averaged.compile(loss="mse")
    assert seen[-1] == pytest.approx(averaged.evaluate(xv, yv, verbose=0)["loss"], rel=1e-6)
    assert seen[-1] != pytest.approx(plain.history.history["val_loss"][-1], rel=1e-3)


def test_ema_evaluate_with_ema_off_validates_the_training_weights():
    x, y = _data()
    plain = _model()
    plain.fit(x, y, batch_size=4, epochs=2, validation_data=(x, y), verbose=0)
    model = _model()
    model.fit(x, y, batch_size=4, epochs=2, validation_data=(x, y), callbacks=[EMA(0.8, evaluate_with_ema=False)],
              verbose=0)
    assert model.history.history["val_loss"] == plain.history.history["val_loss"]


def test_ema_swap_at_end():
    x, y = _data()
    model, ema = _model(), EMA(decay=0.7, swap_at_end=True)
    model.fit(x, y, batch_size=4, epochs=2, callbacks=[ema], verbose=0)
    got = list(model.module.parameters())
    want = list(ema.averaged_model.module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_ema_use_buffers_averages_batchnorm_statistics():
    x, y = _data()
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    model, snaps = _model(module=module), Snapshots()
    ema = EMA(decay=0.5)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, callbacks=[snaps, ema], verbose=0)
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    i = names.index("1.running_mean")
    e = snaps.taken[0][i].clone()
    for s in snaps.taken[1:]:
        e = torch.lerp(e, s[i], 0.5)
    assert torch.equal(ema.averaged_model.module[1].running_mean, e)


class _Crash(Exception):
    pass


def _ema_run(folder, crash_step=None):
    x, y = _data(20)
    model, ema = _model(), EMA(decay=0.75)

    def crash(batch, logs):
        if model.global_step == crash_step:
            raise _Crash

    callbacks = [LambdaCallback(on_train_batch_end=crash), ema, BackupAndRestore(folder, save_freq=2)]
    model.fit(x, y, batch_size=4, epochs=3, validation_data=(x[:6], y[:6]), callbacks=callbacks, verbose=0)
    return model, ema


def test_ema_resumes_bit_exact(tmp_path):
    ref_model, ref = _ema_run(tmp_path / "ref")
    with pytest.raises(_Crash):
        _ema_run(tmp_path / "run", crash_step=8)  # the backup is from batch 6 of 15
    model, ema = _ema_run(tmp_path / "run")
    assert int(ema.averaged_model.n_averaged) == int(ref.averaged_model.n_averaged) == 16
    for a, b in zip(ema.averaged_model.state_dict().values(), ref.averaged_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert model.history.history == ref_model.history.history


def test_ema_state_loaded_before_fit_is_continued():
    x, y = _data()
    first = _model()
    ema = EMA(decay=0.5)
    first.fit(x, y, batch_size=4, epochs=1, callbacks=[ema], verbose=0)
    state = ema.state_dict()
    again = EMA(decay=0.5)
    again.load_state_dict(state)
    first.fit(x, y, batch_size=4, epochs=2, initial_epoch=1, callbacks=[again], verbose=0)
    assert int(again.averaged_model.n_averaged) == 7  # 4 from the first fit, 3 more
    fresh = EMA(decay=0.5)
    first.fit(x, y, batch_size=4, epochs=3, initial_epoch=2, callbacks=[fresh], verbose=0)
    assert int(fresh.averaged_model.n_averaged) == 4  # a new EMA starts from the current weights


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"decay": 1.5}, ValueError, r"Expected `decay` in \[0, 1\]\. Received: decay=1\.5\."),
        ({"decay": -0.1}, ValueError, r"Expected `decay` >= 0\.0\. Received: decay=-0\.1\."),
        ({"decay": "0.9"}, TypeError, "Expected `decay` to be a number"),
        ({"swap_at_end": 1}, TypeError, r"Expected `swap_at_end` to be a bool\. Received: swap_at_end=1\."),
    ],
)
def test_ema_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        EMA(**kwargs)


# -- SWA -------------------------------------------------------------------------------------
def _bn_module():
    return nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1))


def test_swa_averages_epoch_ends_and_recomputes_batchnorm():
    x, y = _data(16)
    model, snaps = _model(module=_bn_module()), Snapshots(per="epoch")
    swa = SWA(swa_lrs=0.05, swa_epoch_start=3, annealing_epochs=2)
    model.fit(x, y, batch_size=4, epochs=5, shuffle=False, callbacks=[snaps, swa], verbose=0)
    module = model.module
    n_params = len(list(module.parameters()))
    # Epochs 3, 4, 5 (1-based) are averaged.
    assert int(swa.averaged_model.n_averaged) == 3
    for i, p in enumerate(module.parameters()):
        mean = torch.stack([s[i] for s in snaps.taken[2:]]).mean(0)
        torch.testing.assert_close(p.detach(), mean, rtol=1e-6, atol=1e-7)
    # BatchNorm statistics: recomputed on the averaged weights over the same batches.
    by_hand = _bn_module()
    by_hand.load_state_dict(module.state_dict())
    by_hand[1].reset_running_stats()
    update_bn([x[i : i + 4] for i in range(0, 16, 4)], by_hand)
    bn, ref = module[1], by_hand[1]
    assert torch.equal(bn.running_mean, ref.running_mean) and torch.equal(bn.running_var, ref.running_var)
    assert int(bn.num_batches_tracked) == 4
    # ... and not the statistics training left behind.
    assert not torch.equal(bn.running_mean, snaps.taken[-1][n_params])
    assert module.training  # flags as the user left them


def test_swa_learning_rates_follow_swalr():
    x, y = _data(8)
    model = _model(lr=0.1)
    swa = SWA(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=2, annealing_strategy="cos")
    history = model.fit(x, y, batch_size=4, epochs=5, callbacks=[swa], verbose=0)
    # Epoch 2 starts SWALR at the current rate; cos annealing: alpha(t) = (1 - cos(pi t)) / 2.
    half = 0.01 * 0.5 + 0.1 * 0.5
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.1, half, 0.01, 0.01], rel=1e-9)


def test_swa_sets_the_compiled_scheduler_aside_and_puts_it_back():
    x, y = _data(8)
    model = _model(lr=0.1, scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    sched = model.scheduler
    seen = []
    spy = LambdaCallback(on_epoch_begin=lambda epoch, logs: seen.append(model.scheduler))
    swa = SWA(swa_lrs=0.02, swa_epoch_start=3, annealing_epochs=0)
    history = model.fit(x, y, batch_size=4, epochs=4, callbacks=[swa, spy], verbose=0)
    # StepLR halves twice (epochs 1, 2); from epoch 3 SWALR sets 0.02 at once (no annealing).
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.05, 0.02, 0.02], rel=1e-9)
    assert seen == [sched, sched, None, None]
    assert model.scheduler is sched and sched.last_epoch == 2  # as it was when SWA began


def test_swa_fraction_start_and_no_batchnorm():
    x, y = _data(8)
    model, snaps = _model(), Snapshots(per="epoch")
    swa = SWA(swa_lrs=0.1, swa_epoch_start=0.5)  # int(0.5 * 4) = 2: epochs 2, 3, 4
    model.fit(x, y, batch_size=4, epochs=4, callbacks=[snaps, swa], verbose=0)
    assert int(swa.averaged_model.n_averaged) == 3
    first = next(model.module.parameters())
    torch.testing.assert_close(first.detach(), torch.stack([s[0] for s in snaps.taken[1:]]).mean(0))


def test_swa_stopped_before_it_starts_leaves_the_weights():
    x, y = _data(8)
    model, snaps = _model(), Snapshots(per="epoch")
    stop = LambdaCallback(on_epoch_end=lambda epoch, logs: setattr(model, "stop_training", epoch == 1))
    swa = SWA(swa_lrs=0.1, swa_epoch_start=4)
    model.fit(x, y, batch_size=4, epochs=6, callbacks=[snaps, stop, swa], verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model.module), snaps.taken[-1], strict=True))


def test_swa_with_a_one_shot_generator_warns_and_keeps_the_statistics():
    x, y = _data(8)
    model = _model(module=_bn_module())
    swa = SWA(swa_lrs=0.1, swa_epoch_start=1)
    batches = ((x[i : i + 4], y[i : i + 4]) for i in range(0, 8, 4))
    with pytest.warns(UserWarning, match="could not recompute the BatchNorm statistics"):
        model.fit(batches, epochs=1, callbacks=[swa], verbose=0)
    assert int(model.module[1].num_batches_tracked) == 2  # from training


def test_swa_tuple_inputs_reach_the_module_as_arguments():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)
            self.out = nn.Linear(3, 1)

        def forward(self, a, b):
            return self.out(self.bn(a + b))

    x, y = _data(8)
    model = _model(module=Two())
    model.fit((x, x), y, batch_size=4, epochs=2, shuffle=False,
              callbacks=[SWA(swa_lrs=0.1, swa_epoch_start=1)], verbose=0)
    assert int(model.module.bn.num_batches_tracked) == 2  # reset by update_bn, then 2 batches
    torch.testing.assert_close(model.module.bn.running_mean, (x + x).mean(0))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"swa_lrs": 0.0}, ValueError, "Expected `swa_lrs` to be a positive number or a list of them"),
        ({"swa_lrs": [0.1, -1]}, ValueError, "Received: swa_lrs=\\[0.1, -1\\]"),
        ({"swa_lrs": 0.1, "swa_epoch_start": 0}, ValueError, "Expected `swa_epoch_start` to be an int >= 1"),
        ({"swa_lrs": 0.1, "swa_epoch_start": 1.5}, ValueError, r"or a float in \(0, 1\]"),
        ({"swa_lrs": 0.1, "swa_epoch_start": "2"}, TypeError, "to be an int or a float"),
        ({"swa_lrs": 0.1, "annealing_epochs": -1}, ValueError, "Expected `annealing_epochs` >= 0"),
        ({"swa_lrs": 0.1, "annealing_strategy": "exp"}, ValueError, "'cos' or 'linear'"),
    ],
)
def test_swa_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        SWA(**kwargs)


def test_swa_lrs_per_group_must_match_the_groups():
    x, y = _data(8)
    model = _model()
    before = _weights(model.module)
    with pytest.raises(ValueError, match="`swa_lrs` has 2 values, but the optimizer has 1 parameter groups"):
        model.fit(x, y, epochs=1, callbacks=[SWA(swa_lrs=[0.1, 0.2])], verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model.module), before, strict=True))



def _swa_run(folder, crash_step=None):
    x, y = _data(16)
    torch.manual_seed(0)  # the module's initial weights: the same in every run
    model = _model(module=_bn_module(), scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    swa = SWA(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=2)

    def crash(batch, logs):
        if model.global_step == crash_step:
            raise _Crash

    callbacks = [LambdaCallback(on_train_batch_end=crash), swa, BackupAndRestore(folder, save_freq=3)]
    model.fit(x, y, batch_size=4, epochs=4, callbacks=callbacks, verbose=0)
    return model, swa


def test_swa_resumes_exactly(tmp_path):
    ref_model, ref = _swa_run(tmp_path / "ref")
    with pytest.raises(_Crash):
        _swa_run(tmp_path / "run", crash_step=14)  # the backup is from the end of epoch 3 (1-based), inside SWA
    model, swa = _swa_run(tmp_path / "run")
    assert int(swa.averaged_model.n_averaged) == int(ref.averaged_model.n_averaged) == 3
    for a, b in zip(_weights(model.module), _weights(ref_model.module), strict=True):
        assert torch.equal(a, b)
    assert model.history.history == ref_model.history.history
    assert model.scheduler.last_epoch == ref_model.scheduler.last_epoch == 1
