"""TensorBoard in Keras' layout: evaluation_<key>_vs_iterations for every evaluation,
write_steps_per_second (a fake clock) and histogram_freq, read back from the event files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fitkit
from fitkit.callbacks import TensorBoard

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _model(lr: float = 0.1) -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=lr), loss="mse", metrics=["mae"])
    return model


def _data(n: int = 8):
    x = torch.linspace(-1, 1, 2 * n).reshape(n, 2)
    return x, x.sum(1, keepdim=True)


def _read(folder):
    acc = EventAccumulator(str(folder), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    return acc


def _scalars(acc, tag):
    return [(e.step, e.value) for e in acc.Scalars(tag)]


class FakeClock:
    """Seconds that advance only when told."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_every_validation_is_written_at_its_optimizer_step(tmp_path):
    x, y = _data()
    model = _model()
    seen = []  # the validation values and the step at each
    watch = fitkit.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append((model.global_step, logs["val_loss"], logs["val_mae"]))
    )
    model.fit(x, y, batch_size=4, epochs=3, validation_data=(x, y), verbose=0, callbacks=[watch, TensorBoard(tmp_path)])
    acc = _read(tmp_path / "validation")
    assert sorted(acc.Tags()["scalars"]) == [
        "epoch_loss",
        "epoch_mae",
        "evaluation_loss_vs_iterations",
        "evaluation_mae_vs_iterations",
    ]
    f32 = lambda v: float(np.float32(v))  # noqa: E731  (event files store float32)
    assert _scalars(acc, "evaluation_loss_vs_iterations") == [(s, f32(v)) for s, v, _ in seen]
    assert _scalars(acc, "evaluation_mae_vs_iterations") == [(s, f32(m)) for s, _, m in seen]
    assert [s for s, _, _ in seen] == [2, 4, 6]  # 2 steps per epoch
    assert "evaluation_loss_vs_iterations" not in _read(tmp_path / "train").Tags()["scalars"]


def test_evaluate_with_the_callback_writes_at_the_models_step(tmp_path):
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)  # 4 steps, no callback
    result = model.evaluate(x, y, verbose=0, callbacks=[TensorBoard(tmp_path)])
    acc = _read(tmp_path / "validation")
    assert _scalars(acc, "evaluation_loss_vs_iterations") == [(4, float(np.float32(result["loss"])))]
    assert _scalars(acc, "evaluation_mae_vs_iterations") == [(4, float(np.float32(result["mae"])))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["validation"]


def test_in_epoch_validations_each_get_their_step(tmp_path):
    x, y = _data()
    model = _model()
    model.fit(
        x,
        y,
        batch_size=2,
        epochs=2,
        validation_data=(x, y),
        validation_interval=2,
        verbose=0,
        callbacks=[TensorBoard(tmp_path)],
    )
    acc = _read(tmp_path / "validation")
    assert [s for s, _ in _scalars(acc, "evaluation_loss_vs_iterations")] == [2, 4, 6, 8]
    assert _scalars(acc, "evaluation_loss_vs_iterations") == _scalars(acc, "step_loss")


def test_steps_per_second_with_a_fake_clock(tmp_path):
    clock = FakeClock()
    x, y = _data()
    model = _model()

    def tick(batch, logs):
        clock.now += 0.5  # each step takes half a second

    ticker = fitkit.callbacks.LambdaCallback(on_train_batch_end=tick)
    board = TensorBoard(tmp_path, update_freq=2, write_steps_per_second=True, clock=clock)
    history = model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=[ticker, board])  # 4 steps per epoch
    acc = _read(tmp_path / "train")
    assert _scalars(acc, "epoch_steps_per_second") == [(0, 2.0), (1, 2.0)]
    assert _scalars(acc, "batch_steps_per_second") == [(2, 2.0), (4, 2.0), (6, 2.0), (8, 2.0)]
    assert "steps_per_second" not in history.history  # written to TensorBoard only, as in Keras


def test_steps_per_second_counts_the_epochs_steps_since_it_began(tmp_path):
    clock = FakeClock()
    x, y = _data()
    model = _model()
    durations = iter([1.0, 1.0, 2.0, 4.0, 0.5, 0.5, 0.5, 0.5])

    def tick(batch, logs):
        clock.now += next(durations)

    ticker = fitkit.callbacks.LambdaCallback(on_train_batch_end=tick)
    board = TensorBoard(tmp_path, write_steps_per_second=True, clock=clock)
    model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=[ticker, board])
    assert _scalars(_read(tmp_path / "train"), "epoch_steps_per_second") == [(0, 0.5), (1, 2.0)]  # 4/8 s, 4/2 s


def test_no_time_passed_writes_no_rate(tmp_path):
    x, y = _data()
    _model().fit(
        x, y, epochs=1, verbose=0, callbacks=[TensorBoard(tmp_path, write_steps_per_second=True, clock=FakeClock())]
    )
    assert "epoch_steps_per_second" not in _read(tmp_path / "train").Tags()["scalars"]


def test_histograms_every_n_epochs(tmp_path):
    x, y = _data()
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    weights = {}
    snap = fitkit.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: weights.__setitem__(
            epoch, {k: v.detach().clone() for k, v in model.state_dict().items()}
        )
    )
    model.fit(x, y, batch_size=4, epochs=5, verbose=0, callbacks=[snap, TensorBoard(tmp_path, histogram_freq=2)])
    acc = _read(tmp_path / "train")
    floating = [k for k, v in model.state_dict().items() if v.is_floating_point()]
    assert "1.num_batches_tracked" not in floating
    assert sorted(acc.Tags()["histograms"]) == sorted(f"{k.replace('.', '/')}/histogram" for k in floating)
    for key in floating:
        events = acc.Histograms(f"{key.replace('.', '/')}/histogram")
        assert [e.step for e in events] == [0, 2, 4]  # Keras: epochs 0, n, 2n (0-based)
        for e in events:
            values = weights[e.step][key]
            h = e.histogram_value
            assert h.num == values.numel()
            assert h.min == pytest.approx(values.min().item()) and h.max == pytest.approx(values.max().item())
            assert h.sum == pytest.approx(values.sum().item(), abs=1e-5)


def test_no_histograms_by_default(tmp_path):
    x, y = _data()
    _model().fit(x, y, epochs=2, verbose=0, callbacks=[TensorBoard(tmp_path)])
    assert _read(tmp_path / "train").Tags()["histograms"] == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"histogram_freq": -1}, ValueError, r"Expected `histogram_freq` >= 0\. Received: histogram_freq=-1\. Fix:"),
        ({"histogram_freq": 1.5}, TypeError, r"Expected `histogram_freq` to be an int\. Received: histogram_freq=1\.5"),
        (
            {"write_steps_per_second": 1},
            TypeError,
            r"Expected `write_steps_per_second` to be a bool\. Received: write_steps_per_second=1\.",
        ),
        ({"clock": 3.0}, TypeError, r"Expected `clock` to be a callable returning seconds\. Received: clock=3\.0\."),
    ],
)
def test_bad_options(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        TensorBoard(tmp_path / "tb", **kwargs)
