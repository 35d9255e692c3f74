"""The stepper: accumulation windows (sample-exact), fp16 skips that do not count, timm's scheduler
protocol, clipping and vetoes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import EMA, BackupAndRestore, Callback, LambdaCallback


class Scale(nn.Module):
    """``w * x``: elementwise, so it stays float32 under fp16 autocast (the GradScaler decides)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.w * x


class TimmLike:
    """timm's scheduler protocol, recording what fitkit calls."""

    def __init__(self):
        self.updates: list[int] = []

    def step(self, epoch, metric=None):
        pass

    def step_update(self, num_updates, metric=None):
        self.updates.append(num_updates)

    def state_dict(self):
        return {"updates": list(self.updates)}

    def load_state_dict(self, state):
        self.updates = list(state["updates"])


def _inf_in_the_middle():
    return [(torch.tensor([[v]]), torch.zeros(1, 1)) for v in (1.0, float("inf"), 1.0)]


def test_a_step_the_grad_scaler_skips_does_not_count(tmp_path):
    net = Scale()
    model = fitkit.Model(net, device="cpu")
    timm = TimmLike()
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.25), loss="mse", precision="16-mixed", scheduler=timm)
    seen = []
    ema = EMA(decay=0.9)
    watch = LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append((model.global_step, net.w.item())))
    model.fit(_inf_in_the_middle(), verbose=0, callbacks=[ema, watch])
    # mse on w * 1 with target 0: w -= 0.25 * 2w; the inf batch's step is skipped by the scaler.
    assert seen == [(1, 0.5), (1, 0.5), (2, 0.25)]
    # EMA averages after the two real steps only: 0.9 * (0.9 * 1 + 0.1 * 0.5) + 0.1 * 0.25.
    assert ema.averaged_model.module.w.item() == pytest.approx(0.88)
    assert timm.updates == [1, 2]
    model.save_checkpoint(tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=False)["global_step"] == 2


def test_a_skipped_step_holds_a_per_step_torch_scheduler_back():
    model = fitkit.Model(Scale(), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        loss="mse",
        precision="16-mixed",
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        scheduler_interval="step",
    )
    lrs = []
    watch = LambdaCallback(on_train_batch_end=lambda batch, logs: lrs.append(model.optimizer.param_groups[0]["lr"]))
    model.fit(_inf_in_the_middle(), verbose=0, callbacks=[watch])
    assert lrs == [0.5, 0.5, 0.25] and model.global_step == 2


def test_a_fit_hands_the_stepper_hooks_and_a_window_of_its_own_and_a_nested_step_has_its_own():
    model = fitkit.Model(Scale(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="mse", gradient_accumulation_steps=2)
    stepper = model._core.stepper
    idle = stepper.fit, stepper.window
    forwards, losses = [], []

    def record(module, args, output):  # the training forwards (fit's checks and validation run in eval mode)
        if module.training:
            forwards.append((stepper.fit, stepper.window))

    model.module.register_forward_hook(record)

    def nested(batch, logs):  # inside the first window: its loss is pending
        if batch == 0:
            losses.append(model.step_loss.item())
            model.train_on_batch(torch.ones(1, 1), torch.zeros(1, 1))
            losses.append(model.step_loss.item())

    callbacks = [LambdaCallback(on_train_batch_end=nested, on_backward_end=lambda batch: None)]
    x, y = torch.ones(4, 1), torch.zeros(4, 1)
    model.fit(x, y, batch_size=1, shuffle=False, validation_data=(x, y), verbose=0, callbacks=callbacks)
    fit_hooks, fit_window = forwards[0]
    assert fit_hooks not in idle and fit_window not in idle
    assert fit_hooks.validates and fit_hooks.before_step is not None
    assert [f == (fit_hooks, fit_window) for f in forwards] == [True, False, True, True, True]
    own_hooks, own_window = forwards[1]  # train_on_batch: no hook of the fit, a window of its own
    assert own_hooks.before_step is None and own_window is not fit_window and own_window.loss is None
    assert losses == [0.5, 0.5]  # (w * 1 - 0)^2 = 1, half of the window; the same window after the nested step
    assert (stepper.fit, stepper.window) == idle and model.global_step == 3  # the fit dropped both


class Bias(nn.Module):
    """y_pred = b for every sample: the MSE gradient is 2 * mean(b - y), computable by hand."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x * 0 + self.b


class GradRecorder(Callback):
    def __init__(self):
        super().__init__()
        self.grads, self.batches = [], []

    def on_backward_end(self, batch):
        self.grads.append(self.model.module.b.grad.item())
        self.batches.append(batch)


def _fit_bias(x, y, k, batch_size=1, epochs=2, **fit_kwargs):
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="mse", gradient_accumulation_steps=k)
    rec = GradRecorder()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=[rec], **fit_kwargs)
    return model, rec


def test_issue_scenario_exact_gradients():
    # y = 1..5, batch 1, k = 2: groups (1, 2), (3, 4), (5); grad = 2 * mean(0 - y) over the group.
    y = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    _, rec = _fit_bias(torch.zeros(5), y, k=2)
    assert rec.grads == [-3.0, -7.0, -10.0, -3.0, -7.0, -10.0]
    assert rec.batches == [1, 3, 4, 1, 3, 4]  # fired once per optimizer step, on its last micro-batch


def test_uneven_micro_batches_are_weighted_by_size():
    # batch 2, k = 2 over 5 samples: group 1 = [1, 2] + [3, 4] -> -5; group 2 = [5] -> -10.
    y = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    _, rec = _fit_bias(torch.zeros(5), y, k=2, batch_size=2, epochs=1)
    assert rec.grads == [-5.0, -10.0]


def test_sample_weights_inside_a_group_are_exact():
    # weights [1, 3] on y [1, 2]: grad = 2 * (1*(0-1) + 3*(0-2)) / 4 = -3.5
    y = torch.tensor([1.0, 2.0])
    _, rec = _fit_bias(torch.zeros(2), y, k=2, epochs=1, sample_weight=torch.tensor([1.0, 3.0]))
    assert rec.grads == [-3.5]


def test_dataloader_input_and_step_count():
    y = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    loader = DataLoader(TensorDataset(torch.zeros(5), y), batch_size=1)
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
        loss="mse",
        gradient_accumulation_steps=2,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
        scheduler_interval="step",
    )
    rec = GradRecorder()
    model.fit(loader, epochs=2, verbose=0, callbacks=[rec])
    assert rec.grads == [-3.0, -7.0, -10.0, -3.0, -7.0, -10.0]
    assert model.scheduler.last_epoch == 6  # one scheduler step per optimizer step


def test_accumulated_step_equals_one_big_batch():
    torch.manual_seed(0)
    x, y = torch.randn(12, 3), torch.randn(12, 1)
    net = nn.Linear(3, 1)
    a, b = fitkit.Model(net, device="cpu"), fitkit.Model(__import__("copy").deepcopy(net), device="cpu")
    a.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse", gradient_accumulation_steps=3)
    b.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
    a.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    b.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    for pa, pb in zip(a.module.parameters(), b.module.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_accumulation_steps(bad):
    model = fitkit.Model(Bias(), device="cpu")
    with pytest.raises((TypeError, ValueError), match="gradient_accumulation_steps"):
        model.compile(loss="mse", gradient_accumulation_steps=bad)
    assert model.optimizer is None  # a failed compile changes nothing


BASE_LR, WARMUP_INIT, LR_MIN, WARMUP_T, T_INITIAL = 0.1, 0.01, 0.001, 3, 10


BASE_LR, WARMUP_INIT, LR_MIN, WARMUP_T, T_INITIAL = 0.1, 0.01, 0.001, 3, 10


BASE_LR, WARMUP_INIT, LR_MIN, WARMUP_T, T_INITIAL = 0.1, 0.01, 0.001, 3, 10


BASE_LR, WARMUP_INIT, LR_MIN, WARMUP_T, T_INITIAL = 0.1, 0.01, 0.001, 3, 10


BASE_LR, WARMUP_INIT, LR_MIN, WARMUP_T, T_INITIAL = 0.1, 0.01, 0.001, 3, 10


def hand_lr(t: int) -> float:
    """The LR of the step taken after ``t`` updates: linear warmup, then cosine to LR_MIN."""
    if t < WARMUP_T:
        return WARMUP_INIT + t * (BASE_LR - WARMUP_INIT) / WARMUP_T
    if t >= T_INITIAL:
        return LR_MIN
    return LR_MIN + 0.5 * (BASE_LR - LR_MIN) * (1 + math.cos(math.pi * t / T_INITIAL))


class WarmupCosine:
    """A timm-style scheduler (``step``, ``step_update``, ``state_dict``, ``load_state_dict``).

    The arithmetic is that of timm's ``CosineLRScheduler`` with its defaults (one cycle, no
    noise, ``warmup_prefix=False``: the warmup's steps count in ``t_initial``). ``calls`` records
    each call, and is part of the state, so a resumed run's record continues the interrupted one's.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        t_initial: int = T_INITIAL,
        lr_min: float = LR_MIN,
        warmup_t: int = WARMUP_T,
        warmup_lr_init: float = WARMUP_INIT,
        t_in_epochs: bool = False,
    ):
        self.optimizer = optimizer
        self.base_values = [g["lr"] for g in optimizer.param_groups]
        self.t_initial, self.lr_min, self.warmup_t, self.warmup_lr_init = t_initial, lr_min, warmup_t, warmup_lr_init
        self.warmup_steps = [(v - warmup_lr_init) / warmup_t for v in self.base_values]
        self.t_in_epochs = t_in_epochs
        self.metric = None
        self.calls: list[tuple[str, int, float | None]] = []
        self.update_groups([warmup_lr_init] * len(self.base_values))

    def _get_lr(self, t: int) -> list[float]:
        if t < self.warmup_t:
            return [self.warmup_lr_init + t * s for s in self.warmup_steps]
        if t >= self.t_initial:  # one cycle (timm's cycle_limit=1), then lr_min
            return [self.lr_min for _ in self.base_values]
        # timm's default warmup_prefix=False: the cosine runs over t in [0, t_initial).
        return [
            self.lr_min + 0.5 * (v - self.lr_min) * (1 + math.cos(math.pi * t / self.t_initial))
            for v in self.base_values
        ]

    def update_groups(self, values: list[float]) -> None:
        for group, value in zip(self.optimizer.param_groups, values, strict=True):
            group["lr"] = value

    def step(self, epoch: int, metric: float | None = None) -> None:
        self.calls.append(("step", epoch, metric))
        self.metric = metric
        if self.t_in_epochs:
            self.update_groups(self._get_lr(epoch))

    def step_update(self, num_updates: int, metric: float | None = None) -> None:
        self.calls.append(("step_update", num_updates, metric))
        self.metric = metric
        if not self.t_in_epochs:
            self.update_groups(self._get_lr(num_updates))

    def state_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


def _data(n: int = 20):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5]])


def _model(seed: int = 0, **compile_kwargs) -> fitkit.Model:
    torch.manual_seed(seed)
    model = fitkit.Model(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=BASE_LR, momentum=0.9),
        loss="mse",
        scheduler=WarmupCosine,
        **compile_kwargs,
    )
    return model


def _lr_recorder(model: fitkit.Model) -> list[float]:
    used: list[float] = []
    model.optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    return used


def test_a_timm_scheduler_is_recognised_by_its_protocol_as_instance_or_factory():
    model = _model()
    assert isinstance(model.scheduler, WarmupCosine) and model.scheduler.optimizer is model.optimizer
    assert model.optimizer.param_groups[0]["lr"] == WARMUP_INIT  # set at construction, as timm does
    other = _model()
    built = WarmupCosine(other.optimizer)
    other.compile(optimizer=other.optimizer, loss="mse", scheduler=built)  # an instance on the model's optimizer
    assert other.scheduler is built
    with pytest.raises(ValueError, match=r"built on another optimizer.*Fix: build it on `model.optimizer`"):
        other.compile(optimizer="sgd", loss="mse", scheduler=built)  # compile builds a new optimizer


def test_each_optimizer_step_uses_the_hand_formula_and_step_update_counts_optimizer_steps():
    # 20 samples, batch 4, accumulation 2: windows of 2, 2, 1 batches = 3 optimizer steps per epoch.
    x, y = _data()
    model = _model(gradient_accumulation_steps=2)
    used = _lr_recorder(model)
    history = model.fit(x, y, batch_size=4, epochs=4, shuffle=False, verbose=0)

    assert used == pytest.approx([hand_lr(t) for t in range(12)], rel=1e-15)
    updates = [n for kind, n, _ in model.scheduler.calls if kind == "step_update"]
    assert updates == list(range(1, 13))
    epochs = [(n, metric) for kind, n, metric in model.scheduler.calls if kind == "step"]
    assert epochs == [(e + 1, history.history["loss"][e]) for e in range(4)]  # no validation: the loss
    # Each step call comes after that epoch's three updates, as in timm's train.py.
    assert [c[0] for c in model.scheduler.calls[:4]] == ["step_update"] * 3 + ["step"]
    # The logged LR is the one the epoch's last step used, not the next step's.
    assert history.history["learning_rate"] == [used[2], used[5], used[8], used[11]]
    assert model.optimizer.param_groups[0]["lr"] == hand_lr(12) == LR_MIN  # what the next step would use


def test_step_gets_the_validation_loss_when_fit_validates():
    x, y = _data()
    model = _model()
    history = model.fit(x, y, batch_size=8, epochs=3, validation_data=(x[:8], y[:8]), verbose=0)
    epochs = [(n, metric) for kind, n, metric in model.scheduler.calls if kind == "step"]
    assert epochs == [(e + 1, history.history["val_loss"][e]) for e in range(3)]
    updates = [n for kind, n, _ in model.scheduler.calls if kind == "step_update"]
    assert updates == list(range(1, 10))  # 3 batches per epoch, validation steps nothing


def test_an_epoch_schedule_moves_the_lr_at_epoch_ends_only():
    x, y = _data()
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(3, 1), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=BASE_LR),
        loss="mse",
        scheduler=lambda opt: WarmupCosine(opt, t_in_epochs=True),
    )
    used = _lr_recorder(model)
    history = model.fit(x, y, batch_size=10, epochs=4, verbose=0)
    assert used == pytest.approx([hand_lr(e) for e in range(4) for _ in range(2)], rel=1e-15)
    assert history.history["learning_rate"] == used[1::2]


def test_the_scheduler_state_is_in_the_checkpoint(tmp_path):
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    model.save_checkpoint(tmp_path / "c.pt")
    saved = torch.load(tmp_path / "c.pt", weights_only=True)["scheduler"]
    assert saved["calls"] == model.scheduler.calls and saved["base_values"] == [BASE_LR]
    assert "optimizer" not in saved


class _Crash(Exception):
    pass


def _backup_run(folder, crash_step: int | None = None, save_freq="epoch") -> fitkit.Model:
    x, y = _data()
    model = _model(gradient_accumulation_steps=2)

    def crash(batch, logs):
        if model.global_step == crash_step:
            raise _Crash

    callbacks = [BackupAndRestore(folder / "backup", save_freq=save_freq), LambdaCallback(on_train_batch_end=crash)]
    model.fit(x, y, batch_size=4, epochs=4, validation_data=(x[:8], y[:8]), verbose=0, callbacks=callbacks)
    return model


@pytest.mark.parametrize(("save_freq", "crash_step"), [("epoch", 7), (2, 5)], ids=["epoch-backup", "every-2-batches"])
def test_a_resume_continues_the_schedule_exactly(tmp_path, save_freq, crash_step):
    ref = _backup_run(tmp_path / "ref", save_freq=save_freq)
    with pytest.raises(_Crash):
        _backup_run(tmp_path / "run", crash_step, save_freq)
    resumed = _backup_run(tmp_path / "run", save_freq=save_freq)

    assert resumed.history.history == ref.history.history
    assert resumed.scheduler.calls == ref.scheduler.calls  # no update counted twice or skipped
    assert resumed.optimizer.param_groups[0]["lr"] == ref.optimizer.param_groups[0]["lr"] == LR_MIN
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=0, atol=1e-7)


def test_timm_cosine_scheduler_gives_the_lr_of_timms_own_loop():
    try:
        from timm.scheduler import CosineLRScheduler
    except Exception as e:  # ImportError, or torchvision failing to load against this torch
        pytest.skip(
            f"timm cannot be imported here ({type(e).__name__}: {e}); it needs a torchvision "
            "that loads against the installed torch"
        )

    def build(opt):
        return CosineLRScheduler(
            opt, t_initial=T_INITIAL, lr_min=LR_MIN, warmup_t=WARMUP_T, warmup_lr_init=WARMUP_INIT, t_in_epochs=False
        )

    x, y = _data()
    model = _model()
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=BASE_LR), loss="mse", scheduler=build)
    used = _lr_recorder(model)
    history = model.fit(x, y, batch_size=4, epochs=3, verbose=0)  # 5 steps per epoch

    # timm's train.py: step_update(num_updates) after each optimizer step, step(epoch + 1) after
    # each epoch, on a scheduler of its own.
    opt = torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=BASE_LR)
    sched, expected, num_updates = build(opt), [], 0
    for epoch in range(3):
        for _ in range(5):
            expected.append(opt.param_groups[0]["lr"])
            num_updates += 1
            sched.step_update(num_updates=num_updates)
        sched.step(epoch + 1)
    assert used == pytest.approx(expected, rel=1e-12)
    assert history.history["learning_rate"] == pytest.approx([expected[4], expected[9], expected[14]], rel=1e-12)
