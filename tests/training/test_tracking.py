"""The phase stack (``tracking.Phases``): a ``train_on_batch`` or ``evaluate`` nested in a fit keeps
its own window, totals and stop flag, and the fit's stay exact."""

from __future__ import annotations

import torch
from conftest import Bias

import fitkit
from fitkit.callbacks import Callback, LambdaCallback


def _accumulating():
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss="mse", gradient_accumulation_steps=2)
    return model


Y = torch.tensor([[1.0], [1.0], [3.0], [3.0]])


def test_train_on_batch_in_a_callback_is_a_step_of_its_own_inside_an_accumulation_window():
    model, seen = _accumulating(), []
    nested = LambdaCallback(
        on_train_batch_begin=lambda b, logs: b == 0 and model.train_on_batch(torch.zeros(1, 1), torch.zeros(1, 1)),
        on_train_batch_end=lambda b, logs: seen.append((b, model.module.b.item(), model.global_step)),
    )
    model.fit(torch.zeros(4, 1), Y, batch_size=1, shuffle=False, verbose=0, callbacks=[nested])
    # The nested step has a zero gradient (b = 0 = y). The fit's windows: gradient -2 -> b = 1,
    # then 2 * (1 - 3) = -4 -> b = 3. Two fit steps and the nested one.
    assert seen == [(0, 0.0, 1), (1, 1.0, 2), (2, 1.0, 2), (3, 3.0, 3)]


def test_train_on_batch_between_two_micro_batches_leaves_the_window_and_the_epoch_exact():
    model = _accumulating()
    nested = LambdaCallback(
        on_train_batch_end=lambda b, logs: b == 0 and model.train_on_batch(torch.zeros(1, 1), torch.zeros(1, 1))
    )
    h = model.fit(torch.zeros(4, 1), Y, batch_size=1, shuffle=False, verbose=0, callbacks=[nested])
    assert h.history["loss"] == [2.5]  # (1 + 1 + 4 + 4) / 4 with b = 0, then 1
    assert model.module.b.item() == 3.0 and model.global_step == 3


def test_a_nested_evaluates_stop_flag_does_not_cut_the_fits_validation():
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="mse", metrics=["mae"])

    class Stopper(Callback):
        def on_test_batch_end(self, batch, logs=None):
            self.model.stop_evaluating = True

    seen = []

    def during_validation(batch, logs):
        seen.append(batch)
        if batch == 0:
            model.evaluate(torch.zeros(4, 1), torch.zeros(4, 1), batch_size=1, verbose=0, callbacks=[Stopper()])

    h = model.fit(
        torch.zeros(4, 1),
        Y,
        batch_size=1,
        shuffle=False,
        verbose=0,
        validation_data=(torch.zeros(4, 1), torch.tensor([[2.0], [2.0], [4.0], [4.0]])),
        callbacks=[LambdaCallback(on_test_batch_end=during_validation)],
    )
    assert seen == [0, 1, 2, 3] and h.history["val_loss"] == [10.0]
