"""The fit loop: one object per call, and nothing of it left on the model afterwards."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import Callback


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


def test_model_epoch_and_validated_after_fit_are_the_last_epochs():
    model = _model()
    x, y = torch.zeros(4, 3), torch.zeros(4, 1)
    model.fit(x, y, epochs=3, batch_size=2, verbose=0, validation_data=(x, y), validation_freq=2)
    assert (model.epoch, model.validated) == (2, False)  # epoch 3 (0-based 2) is not scheduled
    model.fit(x, y, epochs=2, batch_size=2, verbose=0, validation_data=(x, y), validation_freq=2)
    assert (model.epoch, model.validated) == (1, True)
