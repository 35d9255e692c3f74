"""fit(min_epochs=..., min_steps=...): a stop requested before the minimum is dropped (Lightning's
Trainer flags), so EarlyStopping decides again later; signals and max_steps still stop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import EarlyStopping, LambdaCallback


def _model() -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(2, 1), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="mse")  # nothing improves
    return model


X, Y = torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), torch.zeros(8, 1)


def test_early_stopping_waits_for_min_epochs():
    # the same loss every epoch (lr 0, no shuffling): EarlyStopping(patience=1) stops after epoch
    # index 1 (Keras: the first epoch sets the best, the second does not improve) ...
    assert _model().fit(
        X, Y, batch_size=4, epochs=10, shuffle=False, verbose=0, callbacks=[EarlyStopping(monitor="loss", patience=1)]
    ).epoch == [0, 1]
    # ... and with min_epochs=4 its requests after epochs 2 and 3 are dropped; the one after 4 stops
    history = _model().fit(
        X,
        Y,
        batch_size=4,
        epochs=10,
        min_epochs=4,
        shuffle=False,
        verbose=0,
        callbacks=[EarlyStopping(monitor="loss", patience=1)],
    )
    assert history.epoch == [0, 1, 2, 3]


def test_a_stop_inside_an_epoch_waits_for_min_steps():
    model = _model()
    stop = LambdaCallback(on_train_batch_end=lambda b, logs: setattr(model, "stop_training", True))
    history = model.fit(X, Y, batch_size=1, epochs=5, min_steps=11, verbose=0, callbacks=[stop])
    assert model.global_step == 11 and history.epoch == [0, 1]  # the request after step 11 stops


def test_max_steps_still_ends_training():
    model = _model()
    model.fit(X, Y, batch_size=1, max_steps=6, min_epochs=0, min_steps=6, verbose=0)
    assert model.global_step == 6


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"min_epochs": 5, "epochs": 3}, ValueError, r"min_epochs=5 asks for more than epochs=3"),
        ({"min_steps": 10, "max_steps": 4}, ValueError, r"min_steps=10 asks for more than max_steps=4"),
        ({"min_epochs": -1}, ValueError, "min_epochs"),
        ({"min_steps": 2.5}, TypeError, "min_steps"),
    ],
)
def test_bad_minimums_are_refused_before_step_1(kwargs, error, match):
    model = _model()
    with pytest.raises(error, match=match):
        model.fit(X, Y, batch_size=4, verbose=0, **kwargs)
    assert model.global_step == 0
