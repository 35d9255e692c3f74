"""``steps_per_epoch`` as Keras 3 defines it.

The data iterator carries over across epochs; an epoch ends early (one warning) when the data
runs out, and the next starts a fresh pass. ``params["steps"]`` is, at each ``on_epoch_begin``,
the number of batches that epoch will really run.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import Callback

# 10 batches of 4 rows.
X = torch.linspace(-1, 1, 40).unsqueeze(1)
Y = 3 * X + 1


class Count(Callback):
    """Batches per epoch, ``params["steps"]`` at each epoch begin, weights after each batch."""

    def on_train_begin(self, logs=None):
        self.batches, self.steps, self.weights, self.logs = [], [], [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.batches.append(0)
        self.steps.append(self.params["steps"])

    def on_train_batch_end(self, batch, logs=None):
        self.batches[-1] += 1
        self.weights.append([p.detach().clone() for p in self.model.module.parameters()])

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(sorted(logs))


def _model() -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
    return model


def _fit(data, steps_per_epoch, epochs=4, **kwargs):
    count = Count()
    x, y = data if isinstance(data, tuple) else (data, None)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        model = _model()
        model.fit(
            x,
            y,
            batch_size=4,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            shuffle=False,
            callbacks=[count],
            verbose=0,
            **kwargs,
        )
    return model, count, [str(w.message) for w in rec]


def _loader():
    return DataLoader(TensorDataset(X, Y), batch_size=4)


@pytest.mark.parametrize("kind", ["tensors", "dataloader"])
def test_steps_per_epoch_equal_to_the_data_runs_every_epoch_full(kind):
    data = (X, Y) if kind == "tensors" else _loader()
    model, count, warned = _fit(data, 10)
    assert count.batches == [10, 10, 10, 10] and count.steps == [10, 10, 10, 10] and warned == []
    assert count.logs == [["learning_rate", "loss"]] * 4  # every epoch logs its loss
    _, reference, _ = _fit(data, None)
    assert all(
        torch.equal(a, b)
        for wa, wb in zip(count.weights, reference.weights, strict=True)
        for a, b in zip(wa, wb, strict=True)
    )


@pytest.mark.parametrize("kind", ["tensors", "dataloader"])
def test_half_the_data_per_epoch_is_the_same_run_as_two_plain_epochs(kind):
    data = (X, Y) if kind == "tensors" else _loader()
    _, count, warned = _fit(data, 5, epochs=4)
    _, plain, _ = _fit(data, None, epochs=2)
    assert count.batches == [5, 5, 5, 5] and count.steps == [5, 5, 5, 5] and warned == []
    assert len(count.weights) == len(plain.weights) == 20
    assert all(
        torch.equal(a, b)
        for wa, wb in zip(count.weights, plain.weights, strict=True)
        for a, b in zip(wa, wb, strict=True)
    )


@pytest.mark.parametrize("kind", ["tensors", "dataloader"])
def test_nine_steps_over_ten_batches_run_nine_then_the_one_left(kind):
    _, count, warned = _fit((X, Y) if kind == "tensors" else _loader(), 9)
    assert count.batches == [9, 1, 9, 1] and sum(count.batches) == 20
    assert count.steps == [9, 1, 9, 1]  # what each epoch really runs
    assert len(warned) == 1 and warned[0].startswith("The training data ran out after 1 of steps_per_epoch=9")


@pytest.mark.parametrize("kind", ["tensors", "dataloader"])
def test_more_steps_than_batches_run_the_batches_there_are(kind):
    _, count, warned = _fit((X, Y) if kind == "tensors" else _loader(), 11)
    assert count.batches == [10, 10, 10, 10] and count.steps == [10, 10, 10, 10]
    assert len(warned) == 1 and warned[0].startswith("The training data ran out after 10 of steps_per_epoch=11")


class Sized:
    """An iterable with ``__len__`` (2) that would yield more batches (3)."""

    def __len__(self):
        return 2

    def __iter__(self):
        return iter([(X[i * 4 : (i + 1) * 4], Y[i * 4 : (i + 1) * 4]) for i in range(3)])


def test_an_iterable_with_len_gives_len_batches_per_epoch():
    _, count, warned = _fit(Sized(), None, epochs=3)
    assert count.batches == [2, 2, 2] and count.steps == [2, 2, 2] and warned == []


def test_a_generator_with_steps_per_epoch_runs_on_until_it_is_used_up():
    batches = ((X[i * 4 : (i + 1) * 4], Y[i * 4 : (i + 1) * 4]) for i in range(7))
    _, count, warned = _fit(batches, 3, epochs=4)
    # 3 + 3 + 1 batches: the third epoch ends early; the fourth finds the generator used up.
    assert count.batches == [3, 3, 1, 0] and count.steps == [3, 3, 3, 3]
    assert warned[0].startswith("The training data ran out after 1 of steps_per_epoch=3 batches in epoch 3")
    assert warned[1].startswith("The training data (generator) yielded no batch in epoch 4")


def test_steps_per_epoch_with_validation_logs_loss_and_val_loss_every_epoch():
    _, count, _ = _fit((X, Y), 9, validation_data=(X[:8], Y[:8]))
    assert count.batches == [9, 1, 9, 1]
    assert count.logs == [["learning_rate", "loss", "val_loss"]] * 4


def test_shuffled_epochs_of_half_the_data_see_each_row_once_per_pass():
    seen = []

    class Record(nn.Linear):
        def forward(self, x):
            seen.append(x.detach().flatten().clone())
            return super().forward(x)

    model = fitkit.Model(Record(1, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    rows = torch.arange(40.0).unsqueeze(1)
    model.fit(rows, rows, batch_size=4, epochs=4, steps_per_epoch=5, shuffle=True, verbose=0)
    first_pass, second_pass = torch.cat(seen[-20:-10]), torch.cat(seen[-10:])  # epochs 1-2, epochs 3-4
    assert sorted(first_pass.tolist()) == sorted(second_pass.tolist()) == [float(i) for i in range(40)]
    assert first_pass.tolist() != [float(i) for i in range(40)]  # shuffled, each row once per pass


def test_a_saved_pass_start_draws_that_pass_again_and_leaves_the_global_rng_as_it_was():
    from fitkit.data import DeviceLoader, TensorBatches

    def loader():  # 6 shuffled batches of 2, 2 per epoch
        return DeviceLoader(TensorBatches(torch.arange(12), None, None, 2, True), torch.device("cpu"), steps=2)

    running = loader()
    first = [b[0].tolist() for b in running.epoch_batches(0)]
    start, taken = running.pass_start, running.carried_over  # what a checkpoint at the end of epoch 1 keeps
    second = [b[0].tolist() for b in running.epoch_batches(1)]
    assert (first, second, taken, start["epoch"]) == ([[8, 0], [5, 9]], [[7, 4], [2, 10]], 2, 0)  # (seed 0)
    torch.manual_seed(7)  # another RNG state: the pass's own comes from `start`
    before = torch.get_rng_state()
    resumed = loader()
    assert [b[0].tolist() for b in resumed.epoch_batches(1, pass_offset=taken, pass_start=start)] == second
    assert torch.equal(torch.get_rng_state(), before)
    assert (resumed.pass_offset, resumed.carried_over, resumed.pass_start) == (2, 4, start)
