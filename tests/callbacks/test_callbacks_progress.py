"""The rich progress bar: throttled reads of batch logs, a bar only for phases that last."""

import io

import torch
from rich.console import Console

from fitkit.callbacks import BatchLogs, ProgressBar


class CountingLogs:
    def __init__(self):
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return {"loss": torch.tensor(0.5)}


def _bar(refresh_interval):
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    bar = ProgressBar(1, refresh_interval=refresh_interval, console=console)
    bar.set_params({"epochs": 2, "steps": 50})
    return bar, console


def test_live_bar_reads_logs_only_when_it_redraws():
    bar, console = _bar(refresh_interval=0.0)  # redraw on every batch
    counter = CountingLogs()
    bar.on_train_begin()
    bar.on_epoch_begin(0)
    for i in range(50):
        bar.on_train_batch_end(i, BatchLogs(counter))
    bar.on_epoch_end(0, {"loss": 0.25})
    out = console.file.getvalue()
    assert counter.reads == 50
    assert "Epoch 1/2" in out and "50/50" in out  # the live bar was drawn
    assert "Epoch 1/2 - 50 steps - " in out and "loss: 0.2500" in out  # then the summary line


def test_short_phase_draws_no_bar_and_reads_no_logs():
    bar, console = _bar(refresh_interval=3600.0)
    counter = CountingLogs()
    bar.on_train_begin()
    bar.on_epoch_begin(0)
    for i in range(50):
        bar.on_train_batch_end(i, BatchLogs(counter))
    bar.on_epoch_end(0, {"loss": 0.25})
    out = console.file.getvalue()
    assert counter.reads == 0  # no host sync for a bar nobody sees
    assert "50/50" not in out
    assert out.strip().startswith("Epoch 1/2 - 50 steps - ") and out.strip().endswith("loss: 0.2500")


def test_printed_numbers_have_one_format_and_returned_ones_every_digit(capsys):
    # One step per epoch on a zero model: the losses are computable by hand. What is printed is
    # rounded one way (4 decimals for losses and metrics, 4 significant digits for learning rates,
    # in the epoch lines and in the LR callback's message alike); History and evaluate keep every digit.
    import fitkit
    from fitkit.callbacks import LearningRateScheduler

    net = torch.nn.Linear(1, 1)
    torch.nn.init.zeros_(net.weight), torch.nn.init.zeros_(net.bias)
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.001), loss="mse")
    x, y = torch.ones(4, 1), torch.full((4, 1), 0.3)
    schedule = LearningRateScheduler(lambda epoch, lr: lr * 0.3 if epoch == 1 else lr, verbose=1)
    history = model.fit(x, y, epochs=2, batch_size=4, shuffle=False, verbose=2, callbacks=[schedule])

    first = torch.nn.functional.mse_loss(torch.zeros(4, 1), y)  # 0.09 in float32
    with torch.no_grad():  # the hand step: w, b -= lr * grad; the prediction after it
        grad = 2 * (0 - y).mean()
        after = torch.zeros(4, 1) - 0.001 * grad * 2  # both w (x = 1) and b moved by lr * grad
    second = torch.nn.functional.mse_loss(after, y)
    assert history.history["loss"] == [float(first), float(second)]  # every digit of float32
    assert history.history["learning_rate"] == [0.001, 0.001 * 0.3]  # 0.00030000000000000003
    out = capsys.readouterr().out
    assert "loss: 0.0900 - learning_rate: 0.001\n" in out
    assert f"loss: {float(second):.4f} - learning_rate: 0.0003\n" in out
    assert "Epoch 2: LearningRateScheduler set the learning rate to 0.0003.\n" in out
    result = model.evaluate(x, y, batch_size=4, verbose=0)
    with torch.no_grad():
        assert result == {"loss": float(torch.nn.functional.mse_loss(model.module(x), y))}
