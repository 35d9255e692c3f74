"""EarlyStopping's threshold_mode: an improvement by a fraction of the best (torch's plateau rule) or by an amount."""

from __future__ import annotations

import pytest
import torch

import fitkit
from fitkit.callbacks import EarlyStopping, LambdaCallback
from fitkit.callbacks.monitor import is_improvement


def _scripted(values):
    """A callback that writes values[epoch] as the epoch log key "score_loss"."""
    return LambdaCallback(on_epoch_end=lambda epoch, logs: logs.__setitem__("score_loss", values[epoch]))


def _run(stop, values):
    model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    return model.fit(
        torch.zeros(2, 1), torch.zeros(2, 1), epochs=len(values), verbose=0, callbacks=[_scripted(values), stop]
    )


def test_rel_counts_min_delta_as_a_fraction_of_the_best():
    values = [100.0, 94.0, 90.0, 8.0, 7.9, 7.0]
    # rel 5%: 94 < 95 improves, 90 > 89.3 does not, 8 does, 7.9 > 7.6 does not, 7.0 < 7.6 does
    stop = EarlyStopping(monitor="score_loss", min_delta=0.05, threshold_mode="rel", patience=2)
    history = _run(stop, values)
    assert stop.best == 7.0 and stop.best_epoch == 5 and stop.stop_reason is None and len(history.epoch) == 6
    # abs 5: 7.9 and 7.0 are no improvement on 8 (not below 3): two epochs without, it stops
    absolute = EarlyStopping(monitor="score_loss", min_delta=5.0, patience=2)
    _run(absolute, values)
    assert absolute.best == 8.0 and absolute.stopped_epoch == 5


def test_rel_for_max_and_the_baseline():
    assert is_improvement(1.06, 1.0, "max", 0.05, "rel") and not is_improvement(1.05, 1.0, "max", 0.05, "rel")
    assert is_improvement(0.94, 1.0, "min", 0.05, "rel") and not is_improvement(0.95, 1.0, "min", 0.05, "rel")
    values = [9.5, 8.0, 7.9, 7.8]
    # rel 10%: 9.5 misses the baseline's 9 (the wait goes on), 8.0 < 8.55 improves and beats it,
    # 7.9 and 7.8 are above 7.2: two epochs without improvement
    stop = EarlyStopping(monitor="score_loss", min_delta=0.1, threshold_mode="rel", baseline=10.0, patience=2)
    _run(stop, values)
    assert stop.best == 8.0 and stop.stopped_epoch == 3
    absolute = EarlyStopping(monitor="score_loss", min_delta=0.1, baseline=10.0, patience=2)
    _run(absolute, values)
    assert absolute.best == 7.8 and absolute.stop_reason is None  # 7.8 + 0.1 < 8.0


def test_threshold_mode_errors_before_step_1():
    with pytest.raises(ValueError, match="threshold_mode.*'abs' or 'rel'.*Received: threshold_mode='relative'"):
        EarlyStopping(threshold_mode="relative")
