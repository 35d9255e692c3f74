"""EMA and SWA: exact averages, validation on the averaged weights, resume, BatchNorm update."""

from __future__ import annotations

import math

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
    model.fit(
        x, y, batch_size=4, epochs=2, validation_data=(x, y), callbacks=[EMA(0.8, evaluate_with_ema=False)], verbose=0
    )
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


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"half_life": 0}, ValueError, r"Expected `half_life` to be a positive number\. Received: half_life=0\."),
        ({"half_life": "10ba"}, TypeError, r"Expected `half_life` to be a positive number\. Received: half_life=.10ba"),
        ({"half_life": float("inf")}, ValueError, r"finite positive number\. Received: half_life=inf"),
        ({"half_life": 4, "decay": 0.9}, ValueError, r"Pass `decay` or `half_life`, not both\. Received: decay=0\.9"),
        (
            {"update_interval": "batch"},
            ValueError,
            r"Expected `update_interval` to be one of 'step', 'epoch'\. Received: update_interval='batch'",
        ),
        (
            {"update_interval": "epoch", "update_every_n_steps": 2},
            ValueError,
            r"`update_every_n_steps` counts optimizer steps.*Received: update_every_n_steps=2\. Fix:",
        ),
        (
            {"update_interval": "epoch", "overwrite_every_n_steps": 3},
            ValueError,
            r"Received: overwrite_every_n_steps=3\. Fix:",
        ),
    ],
)
def test_ema_half_life_and_interval_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        EMA(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "updates"),
    [
        # half_life in optimizer steps, every step / every 2nd step (Composer: exp(-log 2 * n / h))
        ({"half_life": 3}, "steps"),
        ({"half_life": 3, "update_every_n_steps": 2}, "steps"),
        ({"half_life": 0.5, "update_starting_at_step": 2}, "steps"),
        # half_life in epochs, updated at epoch ends
        ({"half_life": 2, "update_interval": "epoch"}, "epochs"),
        ({"half_life": 1, "update_interval": "epoch", "update_starting_at_epoch": 1}, "epochs"),
        ({"decay": 0.75, "update_interval": "epoch"}, "epochs"),
    ],
)
def test_ema_half_life_and_epoch_updates_follow_the_hand_loop(kwargs, updates):
    """The average against a hand loop: w_k = 0.5**k (4 steps an epoch), decay from Composer's formula."""
    model = _scalar_model()
    ema = EMA(swap_at_end=False, **kwargs)
    _fit_scalar(model, [ema], epochs=3, n=4)
    every = kwargs.get("update_every_n_steps", 1)
    decay = kwargs.get("decay", math.exp(-math.log(2) * every / kwargs.get("half_life", 1)))
    assert ema.decay == decay
    if updates == "steps":
        start = kwargs.get("update_starting_at_step")
        steps = [k + 1 for k in range(12) if k % every == 0 and (start is None or k >= start)]
        ema_w = None if start is not None else 1.0  # a start given: the first update copies
    else:
        first = kwargs.get("update_starting_at_epoch")
        steps = [4 * (e + 1) for e in range(3) if first is None or e >= first]
        ema_w = None if first is not None else 1.0
    for k in steps:
        w = torch.tensor(0.5) ** k
        ema_w = w if ema_w is None else torch.lerp(torch.as_tensor(ema_w), w, 1 - decay)
    got = ema.averaged_model.module.weight.item()
    assert got == pytest.approx(float(ema_w), rel=1e-6)
    assert ema.num_averaged == len(steps) + (
        kwargs.get("update_starting_at_step") is None and kwargs.get("update_starting_at_epoch") is None
    )


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
    model.fit(
        (x, x), y, batch_size=4, epochs=2, shuffle=False, callbacks=[SWA(swa_lrs=0.1, swa_epoch_start=1)], verbose=0
    )
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


# -- the WeightAveraging base: rules, functions, exact steps -------------------------------------
from _syncs import CountSteps, SyncCounter  # noqa: E402

from fitkit.callbacks import EarlyStopping, ModelCheckpoint, SwapEMAWeights, WeightAveraging  # noqa: E402


def _scalar_model(lr: float = 0.25) -> fitkit.Model:
    """w <- w - lr * 2w on x = 1, y = 0 (mse): from 1, w_k = (1 - 2 lr)**k."""
    model = fitkit.Model(nn.Linear(1, 1, bias=False), device="cpu")
    nn.init.ones_(model.module.weight)
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=lr), loss="mse")
    return model


def _fit_scalar(model, callbacks, epochs=1, n=4, **kw):
    x = torch.ones(n, 1)
    return model.fit(
        x, torch.zeros(n, 1), batch_size=1, epochs=epochs, callbacks=callbacks, verbose=0, shuffle=False, **kw
    )


class Steps(Callback):
    """Records global_step at each update of the averaging callback it watches."""

    def __init__(self, avg):
        super().__init__()
        self.avg, self.updates, self.seen = avg, [], 0

    def on_train_batch_end(self, batch, logs=None):
        if self.avg.num_averaged != self.seen:
            self.seen = self.avg.num_averaged
            self.updates.append(self.model.global_step)


def test_weight_averaging_updates_at_the_exact_steps_with_the_equal_mean():
    model = _scalar_model()
    avg = WeightAveraging(update_every_n_steps=3, update_starting_at_step=2, swap_at_end=False)
    steps = Steps(avg)
    _fit_scalar(model, [avg, steps], epochs=3)  # 12 steps; 0-based 3, 6, 9 -> global steps 4, 7, 10
    assert steps.updates == [4, 7, 10]
    assert avg.num_averaged == int(avg.averaged_model.n_averaged) == 3
    expected = (0.5**4 + 0.5**7 + 0.5**10) / 3
    assert avg.averaged_model.module.weight.item() == pytest.approx(expected, rel=1e-6)
    assert model.module.weight.item() == 0.5**12  # swap_at_end=False: the trained weights stay


def test_weight_averaging_start_epoch_counts_under_accumulation():
    model = _scalar_model()
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse", gradient_accumulation_steps=2)
    avg = WeightAveraging(update_starting_at_epoch=1)
    steps = Steps(avg)
    _fit_scalar(model, [avg, steps], epochs=3)  # 2 optimizer steps per epoch: epochs 1, 2 -> steps 3..6
    assert steps.updates == [3, 4, 5, 6]
    assert model.module.weight.item() == pytest.approx(sum(0.5**k for k in (3, 4, 5, 6)) / 4, rel=1e-6)


def test_weight_averaging_user_functions_and_rule():
    calls = []

    def avg_fn(a, c, n):
        calls.append(int(n))
        return a + c  # a running sum

    class EveryOtherEpoch(WeightAveraging):
        def should_update(self, step_idx=None, epoch_idx=None):
            return epoch_idx is not None and epoch_idx % 2 == 0

    model = _scalar_model()
    avg = EveryOtherEpoch(avg_fn=avg_fn, swap_at_end=False)
    _fit_scalar(model, [avg], epochs=5, n=1)  # epoch ends 0, 2, 4: w = 0.5, 0.125, 0.03125
    # one trial call on copies before step 1 (a broken function is refused then), then the first update
    # copies; then n_averaged = 1, 2 (a device tensor)
    assert calls == [1, 1, 2]
    assert avg.averaged_model.module.weight.item() == 0.5 + 0.125 + 0.03125

    def multi(avgs, curs, n):
        torch._foreach_lerp_(avgs, curs, 0.25)

    model = _scalar_model()
    avg = WeightAveraging(multi_avg_fn=multi, swap_at_end=False)
    _fit_scalar(model, [avg], n=3)  # 0.5 copied, then lerp to 0.25 and 0.125
    first = 0.5 + 0.25 * (0.25 - 0.5)
    assert avg.averaged_model.module.weight.item() == pytest.approx(first + 0.25 * (0.125 - first), rel=1e-7)


def test_ema_start_and_thinning_follow_the_hand_formula():
    model = _scalar_model()
    ema = EMA(decay=0.5, update_starting_at_step=1, update_every_n_steps=2)
    steps = Steps(ema)
    _fit_scalar(model, [ema, steps], n=6)  # 0-based 2, 4 -> global 3, 5; the first one copies
    assert steps.updates == [3, 5]
    assert ema.averaged_model.module.weight.item() == 0.5 * 0.5**3 + 0.5 * 0.5**5


def test_ema_overwrite_every_n_steps_trains_on_from_the_average():
    model = _scalar_model()
    _fit_scalar(model, [EMA(decay=0.5, overwrite_every_n_steps=2)], n=2)
    # ema_0 = 1; step 1: w = .5, ema .75; step 2: w = .25, ema .5 -> the weights become .5
    assert model.module.weight.item() == 0.5


def test_compile_use_ema_has_keras_semantics():
    model = _scalar_model()
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse", use_ema=True, ema_momentum=0.75)
    x, y = torch.ones(2, 1), torch.zeros(2, 1)
    h = model.fit(x, y, batch_size=1, epochs=1, validation_data=(x, y), verbose=0)
    # the first step's weights 0.5 copied, then 0.75 * 0.5 + 0.25 * 0.25
    ema = 0.75 * 0.5 + 0.25 * 0.25
    assert h.history["val_loss"] == [0.25**2]  # validation on the training weights (Keras)
    assert model.module.weight.item() == ema  # finalize_variable_values at the end of fit
    assert model.evaluate(x, y, verbose=0)["loss"] == pytest.approx(ema**2, rel=1e-7)


def test_compile_use_ema_carries_the_average_into_the_next_fit():
    model = _scalar_model()
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse", use_ema=True, ema_momentum=0.5)
    _fit_scalar(model, [], n=1)  # the average copies 0.5; the weights become it
    _fit_scalar(model, [], n=1)  # Keras' iterations > 0: 0.5 * 0.5 + 0.5 * 0.25
    assert model.compiled_ema.num_averaged == 2 and model.module.weight.item() == 0.375


def test_compile_ema_overwrite_frequency():
    model = _scalar_model()
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.25),
        loss="mse",
        use_ema=True,
        ema_momentum=0.5,
        ema_overwrite_frequency=2,
    )
    w = []
    _fit_scalar(model, [LambdaCallback(on_train_batch_end=lambda b, logs: w.append(model.module.weight.item()))], n=3)
    # steps: w .5 (ema .5), .25 (ema .375 -> w .375), .1875 (ema .28125); the end: w = ema
    assert w == [0.5, 0.375, 0.1875]
    assert model.module.weight.item() == 0.28125


def test_swap_ema_weights_validates_on_the_ema_and_swap_on_epoch():
    model = _scalar_model()
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse", use_ema=True, ema_momentum=0.5)
    x, y = torch.ones(1, 1), torch.zeros(1, 1)
    seen = []
    probe = LambdaCallback(on_epoch_end=lambda e, logs: seen.append(model.module.weight.item()))
    h = model.fit(
        x, y, epochs=2, validation_data=(x, y), verbose=0, callbacks=[SwapEMAWeights(swap_on_epoch=True), probe]
    )
    # ema: 0.5, then 0.5 * 0.5 + 0.5 * 0.25 = 0.375; the weights after step 2: 0.25
    assert h.history["val_loss"] == [0.25, 0.375**2]
    assert seen == [0.5, 0.375]  # callbacks after it see the EMA at the epoch end
    assert model.module.weight.item() == 0.375
    plain = _scalar_model()
    plain.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse", use_ema=True, ema_momentum=0.5)
    seen.clear()
    h = plain.fit(
        x,
        y,
        epochs=2,
        validation_data=(x, y),
        verbose=0,
        callbacks=[
            SwapEMAWeights(),
            LambdaCallback(on_epoch_end=lambda e, logs: seen.append(plain.module.weight.item())),
        ],
    )
    assert h.history["val_loss"] == [0.25, 0.375**2] and seen == [0.5, 0.25]


def test_swap_ema_weights_without_an_ema_is_an_error_before_step_1():
    model = _scalar_model()
    with pytest.raises(ValueError, match="use_ema=True"):
        _fit_scalar(model, [SwapEMAWeights()])
    assert model.global_step == 0 and model.module.weight.item() == 1.0


def test_compile_use_ema_with_an_ema_callback_validates_on_the_callbacks_average():
    # Issue 43 asked which of the two validates: the callback's (compile's EMA validates on the
    # training weights, as Keras' optimizer EMA does), and compile's ends fit in the module.
    model = _scalar_model()
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse", use_ema=True, ema_momentum=0.5)
    x, y = torch.ones(1, 1), torch.zeros(1, 1)
    h = model.fit(x, y, epochs=2, validation_data=(x, y), verbose=0, callbacks=[EMA(decay=0.9)])
    # weights 1 -> 0.5 -> 0.25; the callback's average from 1: 0.9 + 0.05 = 0.95, 0.855 + 0.025 = 0.88
    assert h.history["val_loss"] == pytest.approx([0.95**2, 0.88**2], rel=1e-6)
    assert model.module.weight.item() == 0.375  # compile's: 0.5 (the first step's weights), then 0.25 + 0.125
    with pytest.raises(ValueError, match=r"compile\(use_ema=True\)'s EMA and EMA \(callbacks\[0\]\) would each put"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[EMA(swap_at_end=True)])
    assert model.global_step == 2 and model.module.weight.item() == 0.375


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"avg_fn": 3}, TypeError, "avg_fn"),
        ({"avg_fn": lambda a, c, n: a, "multi_avg_fn": lambda a, c, n: None}, ValueError, "not both"),
        ({"update_every_n_steps": 0}, ValueError, "update_every_n_steps"),
        ({"update_starting_at_step": -1}, ValueError, "update_starting_at_step"),
        ({"update_starting_at_epoch": 1.5}, TypeError, "update_starting_at_epoch"),
        ({"swap_at_end": 1}, TypeError, "swap_at_end"),
    ],
)
def test_weight_averaging_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        WeightAveraging(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"use_ema": "yes"}, TypeError, "use_ema"),
        ({"use_ema": True, "ema_momentum": 1.5}, ValueError, "ema_momentum"),
        ({"use_ema": True, "ema_overwrite_frequency": 0}, ValueError, "ema_overwrite_frequency"),
    ],
)
def test_compile_ema_errors(kwargs, error, match):
    model = _scalar_model()
    with pytest.raises(error, match=match):
        model.compile(optimizer="sgd", loss="mse", **kwargs)
    assert model.compiled_ema is None


# -- host syncs ----------------------------------------------------------------------------------
def test_torch_update_parameters_syncs_twice_per_call():
    module = nn.Linear(3, 1)
    averaged = torch.optim.swa_utils.AveragedModel(module, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    averaged.update_parameters(module)
    with SyncCounter() as counter:
        for _ in range(4):
            averaged.update_parameters(module)
    assert counter.count == 8  # the reason fitkit counts on the host


@pytest.mark.parametrize("make", [lambda: EMA(decay=0.9), lambda: WeightAveraging()])
def test_averaging_adds_no_host_sync_per_step(make):
    x, y = _data(40)
    model = _model()
    counter = CountSteps(2, 9)  # 7 steady steps, 7 updates
    model.fit(x, y, batch_size=4, epochs=2, callbacks=[make(), counter], verbose=0, shuffle=False)
    assert counter.count == 0


def test_an_epoch_end_average_adds_no_host_sync():
    """Steps 8 to 13 hold the end of epoch 0, where SWA averages: as many syncs as the plain loop's logs."""
    x, y = _data(40)
    counts = []
    for callbacks in ([], [SWA(swa_lrs=0.05, swa_epoch_start=1)], [WeightAveraging(update_starting_at_epoch=1)]):
        counter = CountSteps(8, 13)
        _model().fit(x, y, batch_size=4, epochs=2, callbacks=[*callbacks, counter], verbose=0, shuffle=False)
        counts.append(counter.count)
    assert counts[1] == counts[2] == counts[0]


def test_the_sync_counter_sees_a_sync():
    model = _model()
    x, y = _data(40)
    counter = CountSteps(2, 9)
    model.fit(
        x,
        y,
        batch_size=4,
        epochs=1,
        verbose=0,
        callbacks=[
            counter,
            LambdaCallback(on_train_batch_end=lambda b, logs: float(model.module[0].weight.detach().sum())),
        ],
    )
    assert counter.count == 7


# -- the weights that were scored are the weights kept -------------------------------------------
def _noisy_run(callbacks, epochs=6, ema_first=True, **compile_kwargs):
    x, y = _data(24)
    vx, vy = _data(10, 3)
    model = _model(lr=0.3, **compile_kwargs)
    h = model.fit(
        x, y, batch_size=4, epochs=epochs, validation_data=(vx + 0.5, vy), callbacks=callbacks, verbose=0, shuffle=False
    )
    return model, h, (vx + 0.5, vy)


@pytest.mark.parametrize("order", ["ema_first", "stop_first"])
def test_early_stopping_restores_the_ema_weights_that_scored_best(order):
    ema, stop = EMA(decay=0.9), EarlyStopping(monitor="val_loss", patience=10, restore_best_weights=True)
    model, h, (vx, vy) = _noisy_run([ema, stop] if order == "ema_first" else [stop, ema])
    best = min(h.history["val_loss"])
    assert stop.best == best
    assert model.evaluate(vx, vy, verbose=0)["loss"] == pytest.approx(best, rel=1e-6)
    assert best != pytest.approx(h.history["val_loss"][-1], rel=1e-3)  # a restore that matters


def test_model_checkpoint_best_files_hold_the_scored_ema_weights(tmp_path):
    ema = EMA(decay=0.9)
    weights = ModelCheckpoint(tmp_path / "best.pt", save_best_only=True, save_weights_only=True)
    full = ModelCheckpoint(tmp_path / "best_full.pt", save_best_only=True)
    model, h, (vx, vy) = _noisy_run([weights, ema, full])
    best = min(h.history["val_loss"])
    for name in ("best.pt", "best_full.pt"):
        other = _model()
        other.load_weights(tmp_path / name)
        assert other.evaluate(vx, vy, verbose=0)["loss"] == pytest.approx(best, rel=1e-6)


def test_a_best_full_checkpoint_resumes_the_training_weights_exactly(tmp_path):
    """The best file of an EMA-scored run: module = the EMA, the EMA's state carries the training weights."""
    ema = EMA(decay=0.9)
    full = ModelCheckpoint(tmp_path / "best.pt", save_best_only=True)
    raw = []
    probe = LambdaCallback(on_epoch_end=lambda e, logs: raw.append(_weights(probe.model.module)))
    model, h, _ = _noisy_run([ema, full, probe])
    best_epoch = h.history["val_loss"].index(min(h.history["val_loss"]))
    again, ema2 = _model(lr=0.3), EMA(decay=0.9)
    again.load_checkpoint(tmp_path / "best.pt")
    resumed = []
    again.fit(
        *_data(24),
        batch_size=4,
        epochs=best_epoch + 2,
        initial_epoch=best_epoch + 1,
        verbose=0,
        callbacks=[ema2, LambdaCallback(on_epoch_begin=lambda e, logs: resumed.append(_weights(again.module)))],
    )
    assert not all(
        torch.equal(a, b) for a, b in zip(_weights(ema2.averaged_model.module), raw[best_epoch], strict=True)
    )
    assert all(torch.equal(a, b) for a, b in zip(resumed[0], raw[best_epoch], strict=True))


def test_swa_with_early_stopping_restores_the_training_weights_it_scored():
    swa = SWA(swa_lrs=0.05, swa_epoch_start=3)
    stop = EarlyStopping(monitor="val_loss", patience=10, restore_best_weights=True)
    model, h, (vx, vy) = _noisy_run([swa, stop])  # validation scores the training weights
    assert model.evaluate(vx, vy, verbose=0)["loss"] == pytest.approx(min(h.history["val_loss"]), rel=1e-6)


def _swap_run(folder, crash_step=None):
    x, y = _data(20)
    model = _model(use_ema=True, ema_momentum=0.8)

    def crash(batch, logs):
        if model.global_step == crash_step:
            raise _Crash

    callbacks = [LambdaCallback(on_train_batch_end=crash), SwapEMAWeights(swap_on_epoch=True), BackupAndRestore(folder)]
    model.fit(x, y, batch_size=4, epochs=3, validation_data=(x[:6], y[:6]), callbacks=callbacks, verbose=0)
    return model


def test_swap_on_epoch_backups_resume_bit_exact(tmp_path):
    """An epoch-end backup holds the EMA in the module and the training weights in the EMA's state."""
    ref = _swap_run(tmp_path / "ref")
    with pytest.raises(_Crash):
        _swap_run(tmp_path / "run", crash_step=7)  # the backup of the end of epoch 1
    model = _swap_run(tmp_path / "run")
    assert all(torch.equal(a, b) for a, b in zip(_weights(model.module), _weights(ref.module), strict=True))
    assert model.history.history == ref.history.history


@pytest.mark.parametrize("which", ["avg_fn", "multi_avg_fn"])
def test_swa_passes_avg_fn_and_multi_avg_fn_to_the_base(which):
    # w: 1 -> 0.5 -> 0.25 -> 0.125 (SGD lr 0.25 on (w - 0)^2, SWALR at the same rate); averaged at
    # the ends of epochs 2 and 3 with a 0.9 / 0.1 moving average: 0.9 * 0.25 + 0.1 * 0.125
    model = fitkit.Model(nn.Linear(1, 1, bias=False), device="cpu")
    nn.init.ones_(model.module.weight)
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse")
    seen = []

    def avg_fn(a, c, n):
        seen.append(int(n))
        return 0.9 * a + 0.1 * c

    def multi_avg_fn(avg, cur, n):
        seen.append(int(n))
        torch._foreach_lerp_(avg, cur, 0.1)

    swa = SWA(swa_lrs=0.25, swa_epoch_start=2, **{which: avg_fn if which == "avg_fn" else multi_avg_fn})
    model.fit(torch.ones(1, 1), torch.zeros(1, 1), epochs=3, callbacks=[swa], verbose=0)
    expected = (
        torch.tensor(0.25) * 0.9 + torch.tensor(0.125) * 0.1
        if which == "avg_fn"
        else torch.tensor(0.25).lerp(torch.tensor(0.125), 0.1)
    )
    assert model.module.weight.item() == expected.item()
    # one trial on copies before step 1 (a broken function is refused then); the first average copies;
    # the second calls the function with n = 1
    assert seen == [1, 1]


def test_swa_refuses_both_avg_fns():
    with pytest.raises(ValueError, match="not both"):
        SWA(swa_lrs=0.1, avg_fn=lambda a, c, n: a, multi_avg_fn=lambda a, c, n: None)
