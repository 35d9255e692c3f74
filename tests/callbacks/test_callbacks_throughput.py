"""ThroughputMonitor: rates from a fake clock, validation excluded, tokens, FLOPs and MFU, no host sync per step."""

from __future__ import annotations

import pytest
import torch
from _syncs import CountSteps
from torch import nn

import fitkit
from fitkit.callbacks import CSVLogger, LambdaCallback, ThroughputMonitor
from fitkit.callbacks.throughput import peak_flops_of


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _ticks(clock, train=0.5, test=10.0):
    """Advances the fake clock by `train` seconds a training batch and `test` a validation batch."""

    def on_train(batch, logs):
        clock.now += train

    def on_test(batch, logs):
        clock.now += test

    return LambdaCallback(on_train_batch_begin=on_train, on_test_batch_begin=on_test)


def _model(module=None, **kw):
    torch.manual_seed(0)
    model = fitkit.Model(module if module is not None else nn.Linear(3, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse", **kw)
    return model


def test_samples_and_batches_per_second_are_rows_over_fake_training_seconds(tmp_path):
    clock = FakeClock()
    monitor = ThroughputMonitor(count_flops=False, clock=clock)
    x, y = torch.randn(10, 3), torch.randn(10, 1)
    history = _model().fit(
        x,
        y,
        batch_size=4,
        epochs=2,
        validation_data=(x, y),
        verbose=0,
        callbacks=[_ticks(clock), monitor, CSVLogger(tmp_path / "log.csv")],
    )
    # 3 batches (4 + 4 + 2 rows) of 0.5 s: 10 / 1.5 samples/s, 3 / 1.5 batches/s; the 10 s
    # a validation batch takes are not training time
    assert history.history["throughput/samples_per_sec"] == [10 / 1.5, 10 / 1.5]
    assert history.history["throughput/batches_per_sec"] == [2.0, 2.0]
    assert "throughput/tokens_per_sec" not in history.history and "throughput/flops_per_step" not in history.history
    header = (tmp_path / "log.csv").read_text().splitlines()[0].split(",")
    assert "throughput/samples_per_sec" in header


def test_batch_logs_every_n_batches_and_under_accumulation():
    clock, seen = FakeClock(), []
    monitor = ThroughputMonitor(log_every_n_steps=2, clock=clock)
    record = LambdaCallback(on_train_batch_end=lambda b, logs: seen.append((b, logs.get("throughput/samples_per_sec"))))
    model = _model(gradient_accumulation_steps=2)
    x, y = torch.randn(12, 3), torch.randn(12, 1)
    clock.now = 0.0
    history = model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[_ticks(clock, train=0.25), monitor, record])
    assert seen == [(0, None), (1, 8.0), (2, None), (3, 8.0), (4, None), (5, 8.0)]  # 4 rows / 0.5 s
    assert history.history["throughput/samples_per_sec"] == [8.0]  # 12 rows / 1.5 s
    flops = history.history["throughput/flops_per_step"][0]
    assert flops == 2 * (2 * 2 * 3 * 1) * 2  # (forward + weight gradient) of a 2-row batch, 2 batches a step


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(10, 4), nn.Linear(4, 10)

    def forward(self, ids):
        return self.out(self.emb(ids))


def test_tokens_per_second_and_mfu_from_a_given_peak():
    clock = FakeClock()
    monitor = ThroughputMonitor(peak_flops=1e6, clock=clock)
    ids = torch.randint(0, 10, (6, 5), generator=torch.Generator().manual_seed(0))
    model = fitkit.Model(TinyLM(), device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy")
    history = model.fit(ids, ids, batch_size=3, epochs=1, verbose=0, callbacks=[_ticks(clock, train=2.0), monitor])
    h = history.history
    assert h["throughput/tokens_per_sec"] == [30 / 4.0] and h["throughput/samples_per_sec"] == [6 / 4.0]
    flops = 2 * (3 * 5) * 4 * 10 * 2  # the output layer, forward and weight gradient (and input gradient)
    assert h["throughput/flops_per_step"] == [float(monitor.flops_per_batch)]
    assert monitor.flops_per_batch >= flops
    assert h["throughput/flops_per_sec"] == [monitor.flops_per_batch * 2 / 4.0]
    assert h["throughput/mfu"] == [monitor.flops_per_batch * 2 / 4.0 / 1e6]


def test_peak_table():
    assert peak_flops_of("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989e12
    assert peak_flops_of("NVIDIA H100 PCIe", "32") == 51e12
    assert peak_flops_of("Tesla V100-SXM2-16GB", "bf16-mixed") is None  # no bf16 tensor cores
    assert peak_flops_of("Intel Xeon", "32") is None


def test_no_host_sync_per_step():
    monitor = ThroughputMonitor(log_every_n_steps=1000, count_flops=False)
    counter = CountSteps(2, 9)
    x, y = torch.randn(40, 3), torch.randn(40, 1)
    _model().fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[monitor, counter])
    assert counter.count == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"log_every_n_steps": 0}, ValueError, "log_every_n_steps"),
        ({"peak_flops": -1.0}, ValueError, "peak_flops"),
        ({"count_flops": "yes"}, TypeError, "count_flops"),
        ({"clock": 3}, TypeError, "clock"),
    ],
)
def test_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        ThroughputMonitor(**kwargs)
