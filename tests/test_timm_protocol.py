"""timm's scheduler protocol: ``step_update(num_updates)`` per optimizer step, ``step(epoch + 1,
metric)`` per epoch, as timm's ``train.py`` calls them; the logged LR is the one used, and the
scheduler's state goes into checkpoints.

``WarmupCosine`` follows timm's documented ``Scheduler`` interface (``timm/scheduler/scheduler.py``):
the LR of step ``t`` comes from ``_get_lr(t)``, written into every param group by
``update_groups``, with ``t_in_epochs=False`` (per-update schedule) and ``state_dict`` =
``__dict__`` without the optimizer. timm itself cannot be imported on this project's CPU
machines (it needs torchvision, whose registry wheels are CUDA builds): the last test runs
timm's ``CosineLRScheduler`` where it imports and skips, saying why, elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import BackupAndRestore, LambdaCallback

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

    def __init__(self, optimizer: torch.optim.Optimizer, t_initial: int = T_INITIAL, lr_min: float = LR_MIN,
                 warmup_t: int = WARMUP_T, warmup_lr_init: float = WARMUP_INIT, t_in_epochs: bool = False):
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
        return [self.lr_min + 0.5 * (v - self.lr_min) * (1 + math.cos(math.pi * t / self.t_initial))
                for v in self.base_values]

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
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=BASE_LR, momentum=0.9), loss="mse",
                  scheduler=WarmupCosine, **compile_kwargs)
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
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=BASE_LR), loss="mse",
                  scheduler=lambda opt: WarmupCosine(opt, t_in_epochs=True))
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
        pytest.skip(f"timm cannot be imported here ({type(e).__name__}: {e}); it needs a torchvision "
                    "that loads against the installed torch")

    def build(opt):
        return CosineLRScheduler(opt, t_initial=T_INITIAL, lr_min=LR_MIN, warmup_t=WARMUP_T,
                                 warmup_lr_init=WARMUP_INIT, t_in_epochs=False)

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
