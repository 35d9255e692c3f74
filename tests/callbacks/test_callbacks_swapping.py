"""One swap of the module's weights at a time, whatever the number of averaging callbacks.

The scalar model trains ``w <- w - 0.25 * 2w`` on ``x = 1, y = 0`` (mse): from ``w = 1`` the
weights after ``k`` steps are ``0.5**k`` and a batch's loss is ``w**2``, so every value below
is exact in float32.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fitkit
from fitkit.callbacks import (
    EMA,
    SWA,
    BackupAndRestore,
    EarlyStopping,
    LambdaCallback,
    SwapEMAWeights,
    WeightAveraging,
)
from fitkit.callbacks.swapping import check_weight_swaps, weight_swap

# Two batches of one row per epoch, three epochs: the epoch losses are the means of w**2.
LOSSES = [(1 + 0.25) / 2, (0.0625 + 0.015625) / 2, (0.00390625 + 0.0009765625) / 2]
assert LOSSES == [0.625, 0.0390625, 0.00244140625]


def _scalar(**compile_kwargs) -> fitkit.Model:
    model = fitkit.Model(nn.Linear(1, 1, bias=False), device="cpu")
    nn.init.ones_(model.module.weight)
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse", **compile_kwargs)
    return model


def _fit(model, callbacks, epochs=3, validate=True, **kw):
    x, y = torch.ones(2, 1), torch.zeros(2, 1)
    return model.fit(
        x,
        y,
        batch_size=1,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
        validation_data=(x, y) if validate else None,
        **kw,
    )


class EpochMean(WeightAveraging):
    """The equal-weight mean of the weights at the epoch ends (as SWA averages)."""

    def should_update(self, step_idx=None, epoch_idx=None):
        return epoch_idx is not None


# -- allowed: one average validated on, however many are kept -----------------------------------
@pytest.mark.parametrize("interval", [None, 1])
def test_several_averagers_one_validating_train_as_without_validation(interval):
    ema = EMA(decay=0.5)
    others = [WeightAveraging(evaluate_with_average=False, swap_at_end=False), EMA(0.5, evaluate_with_ema=False)]
    model = _scalar()
    h = _fit(model, [ema, *others], validation_interval=interval)
    plain = _scalar()
    assert _fit(plain, [], validate=False).history["loss"] == h.history["loss"] == LOSSES
    assert model.module.weight.item() == plain.module.weight.item() == 0.5**6
    assert ema.averaged_model.module.weight.item() == 0.0625  # 1 -> .75 -> .5 -> .3125 -> .1875 -> .109375 -> .0625
    if interval is None:
        assert h.history["val_loss"] == [0.5**2, 0.1875**2, 0.0625**2]  # the first EMA's, at each epoch end
    else:
        # A step's validation runs before that batch's on_train_batch_end, where the EMA updates.
        assert [v["val_loss"] for v in h.validations] == [e**2 for e in (1, 0.75, 0.5, 0.3125, 0.1875, 0.109375)]
    assert others[0].num_averaged == 6 and others[1].averaged_model.module.weight.item() == 0.0625
    assert weight_swap(model.module).holder is None


def test_the_raw_weights_after_fit_are_a_hand_written_loops():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 3, generator=g)
    y = x.sum(1, keepdim=True)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    model = fitkit.Model(ours, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), loss="mse")
    callbacks = [
        WeightAveraging(evaluate_with_average=False, swap_at_end=False),
        EMA(0.5),
        EMA(0.9, evaluate_with_ema=False),
    ]
    h = model.fit(
        x,
        y,
        batch_size=4,
        epochs=3,
        shuffle=False,
        validation_data=(x[:5], y[:5]),
        validation_interval=2,
        callbacks=callbacks,
        verbose=0,
    )
    opt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(3):
        total = 0.0
        for i in range(0, 12, 4):
            loss = F.mse_loss(theirs(x[i : i + 4]), y[i : i + 4])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        losses.append(total / 3)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters(), strict=True))
    assert h.history["loss"] == losses


def test_an_average_updated_while_another_is_swapped_in_reads_the_training_weights():
    """SwapEMAWeights(swap_on_epoch=True) holds the EMA from each epoch end; an epoch-end average after it."""
    ema, mean = EMA(decay=0.5), EpochMean(evaluate_with_average=False, swap_at_end=False)
    model = _scalar()
    h = _fit(model, [ema, SwapEMAWeights(swap_on_epoch=True), mean])
    # The weights at the epoch ends are .25, .0625, .015625 (not the EMA's .5, .1875, .0625).
    assert mean.averaged_model.module.weight.item() == (0.25 + 0.0625 + 0.015625) / 3 == 0.109375
    assert h.history["loss"] == LOSSES
    assert model.module.weight.item() == 0.0625  # the EMA stays in the module at the end (Keras)


def test_compile_use_ema_with_an_ema_callback_validates_on_the_callback_and_ends_with_the_compiled():
    model = _scalar(use_ema=True, ema_momentum=0.5)
    callback = EMA(decay=0.5)
    h = _fit(model, [callback], epochs=2)
    assert h.history["loss"] == LOSSES[:2]
    assert h.history["val_loss"] == [0.5**2, 0.1875**2]  # the callback's EMA, from w0 = 1
    # The compiled EMA copies step 1's weights: .5 -> .375 -> .25 -> .15625, written at the end.
    assert model.compiled_ema.num_averaged == 4 and model.module.weight.item() == 0.15625
    assert callback.averaged_model.module.weight.item() == 0.1875


# -- refused: two averages for one purpose, before step 1 ------------------------------------------
def _mlp(**compile_kwargs) -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), loss="mse", **compile_kwargs)
    return model


def _state(model) -> list[torch.Tensor]:
    optimizer = model.optimizer.state_dict()
    tensors = [t.detach().clone() for t in (*model.module.parameters(), *model.module.buffers())]
    return tensors + [s["momentum_buffer"].clone() for s in optimizer["state"].values()]


VALIDATED = r"Expected at most one averaged copy of the weights to validate on\. Received 2: "
AT_END = r"Expected at most one averaged copy of the weights to put into the module when fit ends\. Received 2: "


@pytest.mark.parametrize(
    ("use_ema", "make", "match"),
    [
        (
            False,
            lambda: [EMA(0.5), EMA(0.9)],
            VALIDATED + r"EMA \(callbacks\[0\]\) and EMA \(callbacks\[1\]\) would each swap their averaged weights "
            r"into the module for validation\. .*Fix: keep one averaging callback, or let one validate on its average",
        ),
        (
            False,
            lambda: [WeightAveraging(swap_at_end=False), EMA()],
            VALIDATED + r"WeightAveraging \(callbacks\[0\]\) and EMA \(callbacks\[1\]\)",
        ),
        (
            True,
            lambda: [SwapEMAWeights(), EMA()],
            VALIDATED + r"SwapEMAWeights \(callbacks\[0\]\) with compile\(use_ema=True\)'s EMA and "
            r"EMA \(callbacks\[1\]\)",
        ),
        (
            True,
            lambda: [SWA(swa_lrs=0.05, swa_epoch_start=1)],
            AT_END + r"compile\(use_ema=True\)'s EMA and SWA \(callbacks\[0\]\) would each put their averaged weights "
            r"into the module when fit ends.*Fix: keep one averaging callback, or pass swap_at_end=False",
        ),
        (
            False,
            lambda: [EMA(swap_at_end=True), WeightAveraging(evaluate_with_average=False)],
            AT_END + r"EMA \(callbacks\[0\]\) and WeightAveraging \(callbacks\[1\]\)",
        ),
        (
            False,
            lambda: [EMA(), SwapEMAWeights(swap_on_epoch=True), SWA(swa_lrs=0.05)],
            AT_END + r"SwapEMAWeights \(callbacks\[1\]\) with EMA \(callbacks\[0\]\) and SWA \(callbacks\[2\]\)",
        ),
    ],
    ids=[
        "two EMAs",
        "WeightAveraging and EMA",
        "SwapEMAWeights and an EMA",
        "use_ema and SWA",
        "two swaps at the end",
        "swap_on_epoch and SWA",
    ],
)
@pytest.mark.parametrize("interval", [None, 2])
def test_two_averages_for_one_purpose_are_refused_before_step_1(use_ema, make, match, interval):
    model = _mlp(use_ema=use_ema)
    x, y = torch.randn(12, 3), torch.randn(12, 1)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # momentum buffers to compare
    before, step = _state(model), model.global_step
    callbacks = make()
    with pytest.raises(ValueError, match=match):
        model.fit(
            x,
            y,
            batch_size=4,
            epochs=2,
            validation_data=(x, y),
            callbacks=callbacks,
            verbose=0,
            validation_interval=interval,
        )
    after = _state(model)
    assert len(after) == len(before) == 8 and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert model.global_step == step == 3
    assert all(cb.averaged_model is None for cb in callbacks if isinstance(cb, WeightAveraging))


def test_two_validating_averagers_without_validation_are_allowed():
    model = _scalar()
    first, second = EMA(0.5), EMA(0.25)
    assert _fit(model, [first, second], validate=False).history["loss"] == LOSSES
    assert first.averaged_model.module.weight.item() == 0.0625 and model.module.weight.item() == 0.5**6


def test_the_check_names_what_each_callback_swaps():
    model = _scalar()
    ema = EMA()
    check_weight_swaps(model, [ema, SwapEMAWeights(swap_on_epoch=True), EMA(evaluate_with_ema=False)])  # one EMA
    with pytest.raises(
        ValueError,
        match=r"Received 3: EMA \(callbacks\[0\]\), EMA \(callbacks\[1\]\) and "
        r"WeightAveraging \(callbacks\[2\]\)",
    ):
        check_weight_swaps(model, [EMA(), EMA(), WeightAveraging()])


# -- the end of fit ---------------------------------------------------------------------------
def _noisy(callbacks, **compile_kwargs):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 3, generator=g)
    y = x @ torch.linspace(-1, 1, 3).unsqueeze(1) + 0.1 * torch.randn(24, 1, generator=g)
    vx = torch.randn(10, 3, generator=g) + 0.5
    vy = vx @ torch.linspace(-1, 1, 3).unsqueeze(1)
    torch.manual_seed(0)
    model = fitkit.Model(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9), loss="mse", **compile_kwargs)
    h = model.fit(x, y, batch_size=4, epochs=6, validation_data=(vx, vy), callbacks=callbacks, verbose=0, shuffle=False)
    return model, h


@pytest.mark.parametrize("order", ["averager first", "restore first"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: EMA(decay=0.9, swap_at_end=True),
        lambda: SWA(swa_lrs=0.05, swa_epoch_start=3),
        lambda: WeightAveraging(evaluate_with_average=False),
    ],
    ids=["EMA", "SWA", "WeightAveraging"],
)
def test_restore_best_weights_wins_over_a_swap_at_the_end_in_either_order(make, order):
    averager = make()
    stop = EarlyStopping(monitor="val_loss", patience=10, restore_best_weights=True)
    model, h = _noisy([averager, stop] if order == "averager first" else [stop, averager])
    assert h.history["val_loss"].index(min(h.history["val_loss"])) == stop.best_epoch < 5  # a restore that matters
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in stop.best_weights.items())
    averaged = dict(averager.averaged_model.module.named_parameters())
    assert not all(torch.equal(state[k], averaged[k]) for k in averaged)  # the average did not overwrite it


@pytest.mark.parametrize("order", ["swap first", "restore first"])
def test_restore_best_weights_wins_over_swap_on_epoch_in_either_order(order):
    ema, swap = EMA(decay=0.9), SwapEMAWeights(swap_on_epoch=True)
    stop = EarlyStopping(monitor="val_loss", patience=10, restore_best_weights=True)
    model, h = _noisy([ema, swap, stop] if order == "swap first" else [stop, ema, swap])
    assert stop.best_epoch < 5
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in stop.best_weights.items())
    assert weight_swap(model.module).holder is None


def test_restore_best_weights_wins_over_compile_use_ema():
    stop = EarlyStopping(monitor="val_loss", patience=10, restore_best_weights=True)
    model, h = _noisy([stop], use_ema=True, ema_momentum=0.5)
    assert stop.best_epoch < 5
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in stop.best_weights.items())


# -- the protocol: swaps, a failed fit, resume ------------------------------------------------------
def test_two_averages_swapped_in_turn_give_the_training_weights_back_once():
    model = _scalar()
    a, b = EMA(0.5, evaluate_with_ema=False), EMA(0.25, evaluate_with_ema=False)
    _fit(model, [a, b], epochs=1, validate=False)  # raw .25; a: 1 -> .75 -> .5; b: 1 -> .625 -> .34375
    w = model.module.weight
    assert a.swap_in() and w.item() == 0.5 and a.state_dict()["training_weights"][0].item() == 0.25
    assert b.swap_in() and w.item() == 0.34375  # a's average came out first, then b's went in
    assert "training_weights" not in a.state_dict() and b.state_dict()["training_weights"][0].item() == 0.25
    a.swap_out()  # not in: nothing
    assert w.item() == 0.34375
    b.swap_out()
    assert w.item() == 0.25 and a.weight_swap is b.weight_swap is weight_swap(model.module)
    assert weight_swap(model.module).saved is None


def test_a_fit_that_raises_in_a_validation_gives_the_training_weights_back():
    model = _scalar()

    def fail(batch, logs):
        if model.epoch == 1:
            raise RuntimeError("validation broke")

    with pytest.raises(RuntimeError, match="validation broke"):
        _fit(model, [EMA(decay=0.5), LambdaCallback(on_test_batch_end=fail)])
    assert model.module.weight.item() == 0.0625  # the raw weights after 4 steps, not the EMA's .1875
    assert weight_swap(model.module).holder is None


class _Crash(Exception):
    pass


def _resumed_run(folder, crash_step=None):
    model = _scalar()
    ema, mean = EMA(decay=0.5), EpochMean(evaluate_with_average=False, swap_at_end=False)

    def crash(batch, logs):
        if model.global_step == crash_step:
            raise _Crash

    callbacks = [
        LambdaCallback(on_train_batch_end=crash),
        ema,
        SwapEMAWeights(swap_on_epoch=True),
        mean,
        BackupAndRestore(folder),
    ]
    _fit(model, callbacks)
    return model, ema, mean


def test_a_backup_taken_with_an_average_swapped_in_resumes_bit_exact(tmp_path):
    ref, ref_ema, ref_mean = _resumed_run(tmp_path / "ref")
    with pytest.raises(_Crash):
        _resumed_run(tmp_path / "run", crash_step=3)  # the backup of epoch 0's end: the EMA is in the module
    model, ema, mean = _resumed_run(tmp_path / "run")
    assert model.module.weight.item() == ref.module.weight.item() == 0.0625
    assert mean.averaged_model.module.weight.item() == ref_mean.averaged_model.module.weight.item() == 0.109375
    assert ema.averaged_model.module.weight.item() == ref_ema.averaged_model.module.weight.item() == 0.0625
    assert model.history.history == ref.history.history
    assert model.history.history["loss"] == LOSSES
