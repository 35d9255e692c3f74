"""The fit loop: one object per call, nothing of it left on the model afterwards; the per-group LR log keys."""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch
from conftest import Bias
from torch import nn

import fitkit
from fitkit.callbacks import Callback, CSVLogger, LambdaCallback


class Grab(Callback):
    """Holds weak references to the training data the loader iterates (after fit's float32 cast)."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.fail, self.data = fail, []

    def on_train_begin(self, logs=None):
        batches = self.params["train_data"].batches
        self.dtype = batches.x.dtype
        self.data = [weakref.ref(batches.x), weakref.ref(batches.y), weakref.ref(batches)]

    def on_train_batch_end(self, batch, logs=None):
        if self.fail:
            raise RuntimeError("boom")


def _model():
    torch.manual_seed(0)
    model = fitkit.Model(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)), device="cpu")
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


@pytest.mark.parametrize("fail", [False, True])
def test_the_finished_fit_lets_go_of_its_data_and_callbacks(fail):
    model = _model()
    # float64 data: fit casts it to the module's float32, a copy that only the loop holds
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    grab = Grab(fail)
    callback = weakref.ref(grab)
    if fail:
        with pytest.raises(RuntimeError, match="boom"):
            model.fit(x, y, epochs=2, batch_size=4, verbose=0, callbacks=[grab], validation_data=(x, y))
    else:
        model.fit(x, y, epochs=2, batch_size=4, verbose=0, callbacks=[grab], validation_data=(x, y))
    data = grab.data
    assert len(data) == 3 and grab.dtype == torch.float32  # the loop held the cast copy
    del grab
    gc.collect()
    assert callback() is None
    assert [r() is None for r in data] == [True, True, True]
    assert model.callbacks == []
    # What the model keeps are plain values: the last epoch and whether it validated.
    assert (model.epoch, model.validated) == ((0, False) if fail else (1, True))
    assert model.summary(print_fn=lambda table: None) is not None  # the example input is a copy


def test_a_fit_that_raised_inside_an_accumulation_window_leaves_nothing_of_it_to_the_next():
    # y_pred = 0, targets 1, MSE, lr 0: every micro-batch's loss is 1, so every window's is 1.0.
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.0), loss="mse", gradient_accumulation_steps=2)
    x, y = torch.zeros(8, 1), torch.ones(8, 1)

    def fail(batch, logs):  # after the window's first micro-batch: its loss and a veto are pending
        model.skip_optimizer_step()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[LambdaCallback(on_train_batch_end=fail)])
    assert (model.step_loss, model.closes_accumulation_window, model.global_step) == (None, True, 0)
    losses = []
    record = LambdaCallback(on_backward_end=lambda batch: losses.append(float(model.step_loss)))
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[record])
    assert losses == [1.0, 1.0]  # not 1.5: the failed fit's half window is not in the first
    assert model.global_step == 2  # and its veto did not skip the first step


def test_model_epoch_and_validated_after_fit_are_the_last_epochs():
    model = _model()
    x, y = torch.zeros(4, 3), torch.zeros(4, 1)
    model.fit(x, y, epochs=3, batch_size=2, verbose=0, validation_data=(x, y), validation_freq=2)
    assert (model.epoch, model.validated) == (2, False)  # epoch 3 (0-based 2) is not scheduled
    model.fit(x, y, epochs=2, batch_size=2, verbose=0, validation_data=(x, y), validation_freq=2)
    assert (model.epoch, model.validated) == (1, True)


# -- the per-group learning-rate log keys: a group's "name" names its key ------------------------
def _grouped(groups) -> fitkit.Model:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(groups(net), lr=0.1), loss="mse")
    return model


def test_named_groups_log_learning_rate_slash_name(tmp_path):
    model = _grouped(
        lambda net: [
            {"params": net[0].parameters(), "name": "body", "lr": 0.05},
            {"params": net[1].parameters(), "name": "head"},
        ]
    )
    x = torch.randn(8, 2)
    history = model.fit(x, x[:, :1], epochs=2, verbose=0, callbacks=[CSVLogger(tmp_path / "log.csv")])
    assert history.history["learning_rate/body"] == [0.05, 0.05]
    assert history.history["learning_rate/head"] == [0.1, 0.1]
    assert history.history["learning_rate"] == [0.05, 0.05]  # group 0, as always
    assert "learning_rate/pg1" not in history.history
    header = (tmp_path / "log.csv").read_text().splitlines()[0].split(",")
    assert "learning_rate/body" in header and "learning_rate/head" in header
    assert model.history.params["metrics"] == ["loss", "learning_rate", "learning_rate/body", "learning_rate/head"]


def test_unnamed_groups_keep_pg_keys_beside_named_ones():
    model = _grouped(
        lambda net: [{"params": net[0].parameters()}, {"params": net[1].parameters(), "lr": 0.01, "name": "head"}]
    )
    x = torch.randn(8, 2)
    history = model.fit(x, x[:, :1], epochs=1, verbose=0)
    assert history.history["learning_rate/head"] == [0.01] and "learning_rate/pg1" not in history.history
    model = _grouped(
        lambda net: [{"params": net[0].parameters(), "name": "body"}, {"params": net[1].parameters(), "lr": 0.01}]
    )
    history = model.fit(x, x[:, :1], epochs=1, verbose=0)
    assert history.history["learning_rate/body"] == [0.1] and history.history["learning_rate/pg1"] == [0.01]


@pytest.mark.parametrize("names", [("a", "a"), ("", "b"), (3, "b")])
def test_bad_group_names_are_an_error_before_step_1(names):
    model = _grouped(
        lambda net: [
            {"params": net[0].parameters(), "name": names[0]},
            {"params": net[1].parameters(), "name": names[1]},
        ]
    )
    before = [p.detach().clone() for p in model.module.parameters()]
    x = torch.randn(8, 2)
    with pytest.raises(ValueError, match="distinct, non-empty strings"):
        model.fit(x, x[:, :1], epochs=1, verbose=0)
    assert model.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))


def test_a_warmup_from_the_same_start_still_logs_every_group():
    lin = nn.Linear(1, 1)
    model = fitkit.Model(lin, device="cpu")
    model.compile(
        optimizer=torch.optim.SGD([{"params": [lin.weight], "lr": 0.1}, {"params": [lin.bias], "lr": 0.01}]),
        loss="mse",
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: min(1.0, step / 2)),
        scheduler_interval="step",
    )
    h = model.fit(torch.zeros(4, 1), torch.zeros(4, 1), epochs=3, batch_size=2, verbose=0)
    assert h.history["learning_rate"] == [0.05, 0.1, 0.1]
    assert h.history["learning_rate/pg1"] == [0.005, 0.01, 0.01]
