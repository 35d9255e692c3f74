"""The scheduler driver (``fitkit.training.scheduling``): when each kind of LR scheduler steps,
with exact learning rates, on its own and inside ``fit``."""

from __future__ import annotations

import torch
from conftest import Bias
from torch.optim import lr_scheduler

import fitkit
from fitkit.training.budget import planned_scheduler
from fitkit.training.scheduling import SchedulerDriver, plateau_of


def _opt(lr: float = 1.0) -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _lr(opt: torch.optim.Optimizer) -> float:
    return opt.param_groups[0]["lr"]


class TimmLike:
    """timm's protocol: ``step(epoch, metric)`` and ``step_update(num_updates, metric)``; each
    update sets ``lr = base * 0.5 ** num_updates`` (as timm, the scheduler writes the groups)."""

    def __init__(self, optimizer: torch.optim.Optimizer, plateau: bool = False):
        self.optimizer, self.base = optimizer, _lr(optimizer)
        self.calls: list[tuple] = []
        if plateau:  # timm's PlateauLRScheduler wraps torch's
            self.lr_scheduler = lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)

    def step(self, epoch, metric=None):
        self.calls.append(("step", epoch, metric))

    def step_update(self, num_updates, metric=None):
        self.calls.append(("step_update", num_updates))
        for group in self.optimizer.param_groups:
            group["lr"] = self.base * 0.5**num_updates

    def state_dict(self):
        return {"calls": list(self.calls)}

    def load_state_dict(self, state):
        self.calls = list(state["calls"])


# -- the driver on its own -------------------------------------------------------------------
def test_a_step_interval_lambda_lr_steps_after_each_optimizer_step():
    opt = _opt()
    driver = SchedulerDriver(opt, lr_scheduler.LambdaLR(opt, lambda s: 0.5**s), "step")
    assert driver.per_step and not driver.timm
    used = []
    for _ in range(3):
        opt.step()
        driver.step(None)
        used.append(driver.lrs_used)
        driver.step_epoch(0, {"loss": 1.0}, validated=False, validates=False)  # a per-step scheduler: no epoch step
    assert used == [[1.0], [0.5], [0.25]]
    assert _lr(opt) == 0.125 and driver.scheduler.last_epoch == 3


def test_an_epoch_interval_step_lr_steps_at_epoch_ends_only():
    opt = _opt()
    driver = SchedulerDriver(opt, lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), "epoch")
    assert not driver.per_step
    lrs = []
    for epoch in range(5):
        opt.step()
        lrs.append(_lr(opt))
        driver.step_epoch(epoch, {"loss": 1.0}, validated=False, validates=False)
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.25]
    assert _lr(opt) == 0.25 and driver.lrs_used is None  # nothing stepped per optimizer step


def test_reduce_lr_on_plateau_steps_on_val_loss_and_skips_epochs_without_validation():
    opt = _opt()
    driver = SchedulerDriver(opt, lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1), "epoch")
    lrs = []
    # (val_loss, validated): 1.0 best, 0.5 better, then flat; the unvalidated epoch is no bad epoch.
    for epoch, (val_loss, validated) in enumerate(
        [(1.0, True), (0.5, True), (0.5, True), (9.0, False), (0.5, True), (0.5, True), (0.5, True)]
    ):
        logs = {"loss": 7.0, "val_loss": val_loss}  # an epoch without validation: a stale val_loss
        driver.step_epoch(epoch, logs, validated=validated, validates=True)
        lrs.append(_lr(opt))
    assert lrs == [1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25]
    # A fit without validation steps it on the training loss.
    driver.step_epoch(7, {"loss": 0.5}, validated=False, validates=False)
    driver.step_epoch(8, {"loss": 0.5}, validated=False, validates=False)
    assert _lr(opt) == 0.125
    # A validation inside an epoch steps it on that validation's loss.
    driver.step_on_validation(9, {"loss": 0.5})
    driver.step_on_validation(9, {"loss": 0.5})
    assert _lr(opt) == 0.0625


def test_a_timm_scheduler_gets_step_update_with_the_step_count_and_step_with_the_epoch_metric():
    opt = _opt()
    sched = TimmLike(opt)
    driver = SchedulerDriver(opt, sched, "epoch")  # timm's get both, whatever the interval
    assert driver.timm and driver.per_step
    opt.step()
    driver.step(1)
    opt.step()
    driver.step(2)
    driver.step_epoch(0, {"loss": 0.75}, validated=False, validates=False)
    driver.step_epoch(1, {"loss": 0.5}, validated=False, validates=True)  # validation not scheduled: None
    driver.step_on_validation(1, {"loss": 0.25})  # timm's wait for the epoch end
    assert sched.calls == [("step_update", 1), ("step_update", 2), ("step", 1, 0.75), ("step", 2, None)]
    assert driver.lrs_used == [0.5] and _lr(opt) == 0.25


def test_a_timm_plateau_scheduler_steps_only_with_a_metric():
    opt = _opt()
    sched = TimmLike(opt, plateau=True)
    assert plateau_of(sched) is sched.lr_scheduler
    driver = SchedulerDriver(opt, sched, "epoch")
    driver.step_epoch(0, {"loss": 0.5}, validated=False, validates=True)  # no validation this epoch
    driver.step_epoch(1, {"loss": 0.5, "val_loss": 0.25}, validated=True, validates=True)
    driver.step_on_validation(1, {"loss": 0.25})
    assert sched.calls == [("step", 2, 0.25)]


def test_a_planned_scheduler_is_built_at_the_first_fit_with_its_step_count_and_saved_state():
    def warmup(optimizer, total_steps):
        return lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / total_steps)

    ref_opt = _opt()  # the interrupted run: two steps of 4 (LR 0.25, 0.5), then 0.75
    ref = warmup(ref_opt, 4)
    for _ in range(2):
        ref_opt.step()
        ref.step()
    opt = _opt()
    driver = SchedulerDriver(opt, planned_scheduler(warmup), "step")
    assert driver.scheduler is None and driver.planned is not None and not driver.per_step
    driver.keep_scheduler_state(ref.state_dict())  # a checkpoint loaded before the first fit
    opt.param_groups[0]["lr"] = _lr(ref_opt)  # and its optimizer state
    driver.build_planned(4, lambda sched, optimizer, interval: sched)
    assert driver.planned is None and driver.per_step and driver.scheduler.last_epoch == 2
    assert _lr(opt) == 0.75  # the factory's first step (LR 0.25) did not overwrite the loaded LR
    opt.step()
    driver.step(None)
    assert driver.lrs_used == [0.75] and _lr(opt) == 1.0


# -- inside fit --------------------------------------------------------------------------------
def _bias(scheduler, lr: float = 1.0, **compile_kwargs) -> fitkit.Model:
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=lr), loss="mse", scheduler=scheduler, **compile_kwargs)
    return model


def _lr_recorder(model: fitkit.Model) -> list[float]:
    used: list[float] = []
    model.optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(_lr(opt)))
    return used


def test_fit_steps_a_step_interval_lambda_lr_after_each_step():
    model = _bias(lambda opt: lr_scheduler.LambdaLR(opt, lambda s: 0.5**s), scheduler_interval="step")
    used = _lr_recorder(model)
    history = model.fit(torch.zeros(4, 1), torch.zeros(4, 1), batch_size=2, epochs=2, verbose=0)
    assert used == [1.0, 0.5, 0.25, 0.125]
    assert history.history["learning_rate"] == [0.5, 0.125]  # each epoch's last step
    assert _lr(model.optimizer) == 0.0625 and model.scheduler_interval == "step"


def test_fit_steps_an_epoch_interval_step_lr_at_epoch_ends():
    model = _bias(lambda opt: lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    used = _lr_recorder(model)
    history = model.fit(torch.zeros(4, 1), torch.zeros(4, 1), batch_size=2, epochs=4, verbose=0)
    assert used == [1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    assert history.history["learning_rate"] == [1.0, 1.0, 0.5, 0.5]
    assert _lr(model.optimizer) == 0.25


# y_pred = b = 0 = y in training (no gradient, b stays 0), and 1 on the validation data: val_loss is 1.0.
X, Y, VAL = torch.zeros(4, 1), torch.zeros(4, 1), (torch.zeros(2, 1), torch.ones(2, 1))


def test_fit_steps_reduce_lr_on_plateau_on_val_loss_at_epoch_ends():
    model = _bias(lambda opt: lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0))
    history = model.fit(X, Y, batch_size=2, epochs=3, validation_data=VAL, verbose=0)
    assert history.history["val_loss"] == [1.0, 1.0, 1.0]
    assert history.history["learning_rate"] == [1.0, 1.0, 0.5]  # the LR each epoch ran with
    assert _lr(model.optimizer) == 0.25  # epoch 1 and 2 were bad: halved twice


def test_fit_steps_reduce_lr_on_plateau_on_each_validation_inside_an_epoch_and_not_again_at_its_end():
    model = _bias(lambda opt: lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0))
    history = model.fit(X, Y, batch_size=2, epochs=2, validation_data=VAL, validation_interval=1, verbose=0)
    assert [v["step"] for v in history.validations] == [1, 2, 3, 4]
    assert history.history["learning_rate"] == [0.5, 0.125]  # after validations 2, and 3 and 4
    assert _lr(model.optimizer) == 0.125


def test_fit_drives_a_timm_like_scheduler_with_step_counts_and_epoch_losses():
    # b = 0, y = 1: the first loss is 1, its gradient -2; the LR halves after each step (0.25 first).
    model = _bias(TimmLike, lr=0.25)
    used = _lr_recorder(model)
    history = model.fit(torch.zeros(4, 1), torch.ones(4, 1), batch_size=2, epochs=2, shuffle=False, verbose=0)
    assert used == [0.25, 0.125, 0.0625, 0.03125]
    # b: 0 -> 0.5 -> 0.625 -> 0.671875 -> ...: losses 1, 0.25 | 0.140625, 0.107666015625
    assert history.history["loss"] == [0.625, 0.1241455078125]
    assert model.scheduler.calls == [
        ("step_update", 1),
        ("step_update", 2),
        ("step", 1, 0.625),
        ("step_update", 3),
        ("step_update", 4),
        ("step", 2, 0.1241455078125),
    ]
    assert history.history["learning_rate"] == [0.125, 0.03125]
