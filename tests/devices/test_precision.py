"""Mixed precision: bf16 / fp16 autocast on the CPU, GradScaler skipped steps and checkpoints."""

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import Callback, LambdaCallback


class DtypeProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.seen = []

    def forward(self, x):
        out = self.lin(x)
        self.seen.append(out.dtype)
        return out


@pytest.mark.parametrize(
    "precision, dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16), ("32", torch.float32)]
)
def test_autocast_dtype_and_float32_weights(precision, dtype):
    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    net = DtypeProbe()
    model = fitkit.Model(net, device="cpu")
    model.compile(loss="cross_entropy", metrics=["accuracy"], precision=precision)
    hist = model.fit(x, y, epochs=2, batch_size=8, verbose=0, validation_data=(x, y))
    assert set(net.seen) == {dtype}  # training, validation and the pre-flight check all autocast
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert all(torch.isfinite(torch.tensor(v)).all() for v in hist.history["loss"])
    assert (model.grad_scaler is not None) == (precision == "16-mixed")


class InfOnFirstBatch(nn.Module):
    """Gradients are inf for the first batch (its input 99 stands for inf), finite afterwards.

    The inf is made inside the module: in-memory data holding inf is refused before step 1.
    """

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return torch.where(x == 99.0, torch.full_like(x, float("inf")), x) * self.w


def test_fp16_skipped_step_keeps_weights_and_scheduler_without_warning():
    x = torch.tensor([[99.0], [1.0], [2.0]])
    y = torch.tensor([[0.0], [0.0], [0.0]])
    model = fitkit.Model(InfOnFirstBatch(), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss="mse",
        precision="16-mixed",
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
        scheduler_interval="step",
    )
    steps_taken = []

    class Watch(Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps_taken.append(self.model.module.w.item())

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PyTorch's "scheduler.step() before optimizer.step()" too
        model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0, callbacks=[Watch()])
    # Batch 0 has an inf gradient: skipped, weight unchanged, scheduler not advanced.
    assert steps_taken[0] == 1.0
    assert model.scheduler.last_epoch == 2  # two real steps out of three batches
    # Real steps: w <- w - lr * 2*w*x^2 with lr 0.1 then 0.05 (scheduler advanced once).
    w1 = 1.0 - 0.1 * 2 * 1.0 * 1.0
    w2 = w1 - 0.05 * 2 * w1 * 4.0
    assert steps_taken[1:] == pytest.approx([w1, w2], abs=1e-6)
    assert model.grad_scaler.get_scale() == 65536.0 * 0.5  # backed off once


def test_bf16_matches_fp32_within_bf16_precision():
    # bf16 needs no scaler (its exponent range is fp32's); it should land where fp32 lands.
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    net = nn.Linear(4, 1)
    a, b = fitkit.Model(copy.deepcopy(net), device="cpu"), fitkit.Model(copy.deepcopy(net), device="cpu")
    a.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse", precision="bf16-mixed")
    b.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
    a.fit(x, y, epochs=3, batch_size=8, shuffle=False, verbose=0)
    b.fit(x, y, epochs=3, batch_size=8, shuffle=False, verbose=0)
    for pa, pb in zip(a.module.parameters(), b.module.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=3e-2, rtol=0)  # bf16 has ~3 significant digits


def test_scaler_state_round_trips_through_checkpoint(tmp_path):
    x, y = torch.tensor([[99.0], [1.0]]), torch.zeros(2, 1)
    model = fitkit.Model(InfOnFirstBatch(), device="cpu")
    model.compile(optimizer="sgd", loss="mse", precision="16-mixed")
    model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0)
    model.save_checkpoint(tmp_path / "ckpt.pt")
    other = fitkit.Model(InfOnFirstBatch(), device="cpu")
    other.compile(optimizer="sgd", loss="mse", precision="16-mixed")
    other.load_checkpoint(tmp_path / "ckpt.pt")
    assert other.grad_scaler.get_scale() == model.grad_scaler.get_scale() == 32768.0
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["scaler"]["scale"] == 32768.0


def test_unknown_precision():
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    with pytest.raises(ValueError, match="Unknown precision 'fp16'. Valid values: 32, bf16-mixed, 16-mixed"):
        model.compile(loss="mse", precision="fp16")


def test_predict_under_bf16_returns_float32():
    model = fitkit.Model(nn.Linear(4, 2), device="cpu")
    model.compile(loss="mse", precision="bf16-mixed")
    x = torch.randn(5, 4)
    out = model.predict(x, verbose=0)
    assert out.dtype == torch.float32 and out.shape == (5, 2)
    # the values are the bf16 computation's, widened: they equal a bf16 autocast forward
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model.module(x)
    assert ref.dtype == torch.bfloat16
    assert torch.equal(out, ref.float())


# -- fp16 with a fused optimizer: the GradScaler's verdict stays on the device ------------------


def _fp16_fused(optimizer, **compile_kwargs) -> fitkit.Model:
    model = fitkit.Model(InfOnFirstBatch(), device="cpu")
    model.compile(optimizer=optimizer, loss="mse", precision="16-mixed", **compile_kwargs)
    return model


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_fp16_with_a_fused_optimizer_skips_on_the_device_and_does_not_count_the_step(name):
    x = torch.tensor([[1.0], [99.0], [2.0]])  # batch 1 has an inf gradient
    model = _fp16_fused(name)
    assert model.optimizer.defaults["fused"] and model._core.stepper.takes_found_inf
    seen = []
    record = LambdaCallback(
        on_train_batch_end=lambda b, logs: seen.append(
            (model.module.w.detach().clone(), copy.deepcopy(model.optimizer.state_dict()["state"]))
        )
    )
    model.fit(x, torch.zeros(3, 1), batch_size=1, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    assert torch.equal(seen[1][0], seen[0][0])  # the skipped step left the weight
    assert seen[1][1].keys() == seen[0][1].keys()  # and the optimizer state (Adam's step and moments)
    for pid, state in seen[0][1].items():
        assert all(torch.equal(seen[1][1][pid][k], v) for k, v in state.items())
    assert not torch.equal(seen[2][0], seen[1][0])
    assert model.global_step == 2  # read lazily: the device counted the skip
    assert model.grad_scaler.get_scale() == 65536.0 * 0.5


def test_fp16_fused_with_a_per_step_scheduler_does_not_advance_it_on_a_skipped_step():
    x = torch.tensor([[99.0], [1.0], [2.0]])
    model = _fp16_fused(
        "sgd", scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5), scheduler_interval="step"
    )
    model.optimizer.param_groups[0]["lr"] = model.scheduler.base_lrs[0] = 0.1
    steps_taken = []
    watch = LambdaCallback(on_train_batch_end=lambda b, logs: steps_taken.append(model.module.w.item()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(x, torch.zeros(3, 1), batch_size=1, epochs=1, shuffle=False, verbose=0, callbacks=[watch])
    assert model.scheduler.last_epoch == 2 and model.global_step == 2
    w1 = 1.0 - 0.1 * 2 * 1.0 * 1.0
    assert steps_taken == pytest.approx([1.0, w1, w1 - 0.05 * 2 * w1 * 4.0], abs=1e-6)


def test_global_step_counts_device_skips_in_checkpoints(tmp_path):
    model = _fp16_fused("sgd")
    model.fit(torch.tensor([[99.0], [1.0]]), torch.zeros(2, 1), batch_size=1, epochs=1, shuffle=False, verbose=0)
    model.save_checkpoint(tmp_path / "ckpt.pt")
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["global_step"] == 1


@pytest.mark.parametrize("accumulation", [1, 2])
def test_fp16_without_loss_scaling_is_the_hand_autocast_loop(accumulation):
    """compile(precision="16-mixed", loss_scale=False) (Keras' auto_scale_loss=False): fp16 autocast,
    a plain backward and step, no GradScaler; the weights equal a hand loop's bit for bit."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 4, generator=g), torch.randn(12, 2, generator=g)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    hand = copy.deepcopy(net)
    model = fitkit.Model(net, device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss="mse",
        precision="16-mixed",
        loss_scale=False,
        gradient_accumulation_steps=accumulation,
    )
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert model.grad_scaler is None and model.precision == "16-mixed"
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    rows = 4 * accumulation
    for _ in range(2):
        for start in range(0, 12, rows):
            opt.zero_grad()
            for lo in range(start, min(start + rows, 12), 4):  # micro-batches, each weighted by its share
                with torch.autocast("cpu", dtype=torch.float16):
                    out = hand(x[lo : lo + 4])
                    assert out.dtype == torch.float16
                    loss = nn.functional.mse_loss(out.float(), y[lo : lo + 4])
                (loss * 4 / min(rows, 12 - start)).backward()
            opt.step()
    for a, b in zip(net.parameters(), hand.parameters(), strict=True):
        assert torch.equal(a, b)
    assert model.global_step == 2 * math.ceil(12 / rows)


def test_fp16_without_loss_scaling_takes_every_step():
    """No scaler, so nothing skips the step of an inf gradient (the scaled run skips it: 2 steps of 3)."""
    x, y = torch.tensor([[99.0], [1.0], [2.0]]), torch.zeros(3, 1)
    steps = {}
    for loss_scale in (True, False):
        model = fitkit.Model(InfOnFirstBatch(), device="cpu")
        model.compile(
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse", precision="16-mixed", loss_scale=loss_scale
        )
        model.fit(x, y, batch_size=1, shuffle=False, verbose=0)
        steps[loss_scale] = (model.global_step, model.grad_scaler is None)
    assert steps == {True: (2, False), False: (3, True)}


def test_loss_scale_must_be_a_bool():
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    with pytest.raises(TypeError, match=r"Expected `loss_scale` to be a bool\. Received: loss_scale='no'\."):
        model.compile(loss="mse", precision="16-mixed", loss_scale="no")
    assert model.optimizer is None
