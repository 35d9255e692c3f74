"""Every input kind fit / evaluate / predict take, validation_split, set_epoch, validation_freq."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from conftest import cpu_model, fixed_linear
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, Sampler, TensorDataset

import fitkit


class Recorder(nn.Module):
    """A linear layer on the first feature that records what each training forward saw."""

    def __init__(self, in_features: int = 1):
        super().__init__()
        self.lin = fixed_linear(in_features, 1, weight=1.0)  # y_pred = sum of the features
        self.train_rows: list[list[float]] = []
        self.dtypes: list[torch.dtype] = []

    def forward(self, x):
        self.dtypes.append(x.dtype)
        if self.training:
            self.train_rows.append(x[:, 0].tolist())
        return self.lin(x)


def sgd0():
    return functools.partial(torch.optim.SGD, lr=0.0)


def compiled(module, loss="mse", **kw) -> fitkit.Model:
    model = cpu_model(module)
    model.compile(sgd0(), loss, **kw)
    return model


X10 = torch.arange(10.0).unsqueeze(1)
Y10 = torch.zeros(10, 1)


# -- input kinds ------------------------------------------------------------------------------


def test_numpy_float64_becomes_float32():
    rec = Recorder(2)
    model = compiled(rec)
    x = np.random.randn(6, 2)  # float64
    y = np.random.randn(6, 1)
    history = model.fit(x, y, batch_size=4, verbose=0)
    assert set(rec.dtypes) == {torch.float32}
    assert type(history.history["loss"][0]) is float
    out = model.predict(x, verbose=0)
    assert out.dtype == torch.float32 and out.shape == (6, 1)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = fixed_linear(2, 1, weight=1.0)
        self.b = fixed_linear(3, 1, weight=10.0)

    def forward(self, u, v):
        return self.a(u) + self.b(v)


def test_tuple_x_calls_module_with_positional_inputs():
    u, v = torch.ones(5, 2), torch.ones(5, 3)
    model = compiled(TwoInputs())
    assert model.predict((u, v), batch_size=2, verbose=0).tolist() == [[32.0]] * 5
    assert model.evaluate((u, v), torch.full((5, 1), 32.0), verbose=0) == {"loss": 0.0}
    assert model.fit((u.numpy(), v.numpy()), torch.zeros(5, 1), batch_size=2, verbose=0).history["loss"] == [1024.0]


def test_dict_x_calls_module_with_keyword_inputs():
    x = {"v": torch.ones(5, 3), "u": torch.ones(5, 2)}
    model = compiled(TwoInputs())
    assert model.predict(x, batch_size=2, verbose=0).tolist() == [[32.0]] * 5
    assert model.fit(x, torch.zeros(5, 1), batch_size=2, verbose=0).history["loss"] == [1024.0]
    batches = [({"u": torch.ones(2, 2), "v": torch.ones(2, 3)}, torch.zeros(2, 1))]
    assert model.evaluate(batches, verbose=0) == {"loss": 1024.0}


class ItemsDataset(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor([0.0])


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(10):
            yield torch.tensor([float(i)]), torch.tensor([0.0])


@pytest.mark.parametrize(
    "make",
    [
        lambda: {"x": X10, "y": Y10, "batch_size": 4},
        lambda: {"x": X10.numpy(), "y": Y10.numpy(), "batch_size": 4},
        lambda: {"x": ItemsDataset(), "batch_size": 4},
        lambda: {"x": TensorDataset(X10, Y10), "batch_size": 4},
        lambda: {"x": Stream(), "batch_size": 4},
        lambda: {"x": DataLoader(TensorDataset(X10, Y10), batch_size=4)},
        lambda: {"x": [(X10[i : i + 4], Y10[i : i + 4]) for i in range(0, 10, 4)]},
    ],
    ids=["tensors", "numpy", "Dataset", "TensorDataset", "IterableDataset", "DataLoader", "list"],
)
def test_every_input_kind_sees_every_sample_once_per_epoch(make):
    rec = Recorder()
    model = compiled(rec)
    history = model.fit(**make(), epochs=2, verbose=0)
    rows = [v for batch in rec.train_rows for v in batch]
    assert sorted(rows) == sorted(list(range(10)) * 2)
    assert [len(b) for b in rec.train_rows] == [4, 4, 2] * 2  # a short last batch
    assert history.history["loss"] == [28.5, 28.5]  # mean of i**2 for i < 10
    assert model.evaluate(**make(), verbose=0) == {"loss": 28.5}
    assert model.predict(**{k: v for k, v in make().items() if k != "y"}, verbose=0).shape == (10, 1)


def test_in_memory_shuffle_draws_one_randperm_per_epoch():
    rec = Recorder()
    model = compiled(rec)
    torch.manual_seed(3)
    model.fit(X10, Y10, batch_size=4, epochs=2, shuffle=True, verbose=0)
    torch.manual_seed(3)
    expected = []
    for _ in range(2):
        perm = torch.randperm(10)
        expected += [perm[i : i + 4].float().tolist() for i in range(0, 10, 4)]
    assert rec.train_rows == expected
    rec.train_rows.clear()
    model.fit(X10, Y10, batch_size=4, shuffle=False, verbose=0)
    assert rec.train_rows == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_generator_with_steps_per_epoch():
    def batches():
        i = 0
        while True:  # infinite
            yield torch.full((2, 1), float(i)), torch.zeros(2, 1)
            i += 1

    rec = Recorder()
    model = compiled(rec)
    history = model.fit(batches(), steps_per_epoch=3, epochs=2, verbose=0)
    assert [b[0] for b in rec.train_rows] == [0, 1, 2, 3, 4, 5]  # one stream across epochs
    assert history.params["steps"] == 3
    assert history.history["loss"] == pytest.approx([(0 + 1 + 4) / 3, (9 + 16 + 25) / 3], rel=1e-6)


def test_steps_per_epoch_restarts_a_reiterable_source():
    # Keras 3: 3 batches, 2 per epoch -> epoch 2 runs the last batch and ends early (the data ran
    # out), epoch 3 starts a fresh pass.
    rec = Recorder()
    model = compiled(rec)
    with pytest.warns(UserWarning, match="ran out after 1 of steps_per_epoch=2 batches in epoch 2"):
        model.fit(X10, Y10, batch_size=4, steps_per_epoch=2, epochs=3, shuffle=False, verbose=0)
    assert [b[0] for b in rec.train_rows] == [0, 4, 8, 0, 4]


def test_finite_generator_running_out_warns_and_stops():
    rec = Recorder()
    model = compiled(rec)
    gen = ((torch.ones(2, 1), torch.zeros(2, 1)) for _ in range(3))
    with pytest.warns(fitkit.FitkitWarning) as caught:
        history = model.fit(gen, steps_per_epoch=2, epochs=3, verbose=0)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "ran out after 1 of steps_per_epoch=2 batches in epoch 2" in messages[0]
    assert "yielded no batch in epoch 3" in messages[1]
    assert len(rec.train_rows) == 3
    assert history.epoch == [0, 1]  # epoch 2 ran 1 batch and ended early; epoch 3 had none


class NoLen:
    """Iterable without ``len()``: the progress shows an unknown total."""

    def __iter__(self):
        for i in range(0, 10, 5):
            yield X10[i : i + 5], Y10[i : i + 5]


def test_iterable_without_len():
    model = compiled(Recorder())
    history = model.fit(NoLen(), epochs=2, verbose=0)
    assert history.params["steps"] is None
    assert history.history["loss"] == [28.5, 28.5]
    assert model.evaluate(NoLen(), verbose=0) == {"loss": 28.5}


def test_iterable_without_len_with_a_live_progress_bar():
    from io import StringIO

    from rich.console import Console

    console = Console(file=StringIO(), force_terminal=True, width=100)
    bar = fitkit.callbacks.ProgressBar(verbose=1, console=console, refresh_interval=0.0)
    model = compiled(Recorder())
    model.fit(NoLen(), epochs=1, callbacks=[bar], verbose=1)
    assert "Epoch 1/1 - 2 steps" in console.file.getvalue()


# -- validation -------------------------------------------------------------------------------


def test_validation_split_takes_the_tail_before_shuffling():
    rec = Recorder()
    model = compiled(rec)
    history = model.fit(X10, Y10, validation_split=0.3, batch_size=3, epochs=2, shuffle=True, verbose=0)
    seen = sorted(v for batch in rec.train_rows for v in batch)
    assert seen == sorted(list(range(7)) * 2)
    assert history.history["val_loss"] == pytest.approx([(49 + 64 + 81) / 3] * 2, rel=1e-6)


def test_validation_split_with_sample_weight_splits_the_weights():
    model = compiled(Recorder())
    w = torch.arange(1.0, 11.0)
    history = model.fit(X10, Y10, sample_weight=w, validation_split=0.2, verbose=0)
    assert history.history["val_loss"] == pytest.approx([(9 * 64 + 10 * 81) / 19], rel=1e-6)
    assert history.history["loss"] == pytest.approx([sum((i + 1) * i * i for i in range(8)) / 36])


def test_validation_split_on_a_dataset():
    # regression: the split Dataset used to be refused as `validation_data`
    rec = Recorder()
    model = compiled(rec)
    history = model.fit(TensorDataset(X10, Y10), validation_split=0.2, batch_size=4, verbose=0)
    assert sorted(v for b in rec.train_rows for v in b) == list(range(8))
    assert history.history["val_loss"] == [(64 + 81) / 2]


def test_validation_split_on_a_dataset_keeps_sample_weights():
    # regression: the split used to drop the sample weights of a Dataset
    model = compiled(Recorder())
    w = torch.arange(1.0, 11.0)
    history = model.fit(TensorDataset(X10, Y10), sample_weight=w, validation_split=0.2, verbose=0)
    assert history.history["val_loss"] == pytest.approx([(9 * 64 + 10 * 81) / 19], rel=1e-6)


@pytest.mark.parametrize(
    "validation_data",
    [
        lambda: (X10[8:], Y10[8:]),
        lambda: (X10[8:].numpy(), Y10[8:].numpy()),
        lambda: (X10[8:], Y10[8:], torch.tensor([1.0, 3.0])),
        lambda: TensorDataset(X10[8:], Y10[8:]),
        lambda: DataLoader(TensorDataset(X10[8:], Y10[8:]), batch_size=1),
        lambda: [(X10[8:9], Y10[8:9]), (X10[9:], Y10[9:])],  # regression: a list of batches was refused
    ],
    ids=["tuple", "numpy", "weighted", "Dataset", "DataLoader", "list-of-batches"],
)
def test_validation_data_kinds(validation_data):
    model = compiled(Recorder())
    data = validation_data()
    history = model.fit(X10[:8], Y10[:8], validation_data=data, verbose=0)
    expected = (64 + 3 * 81) / 4 if isinstance(data, tuple) and len(data) == 3 else (64 + 81) / 2
    assert history.history["val_loss"] == [expected]


def test_validation_freq():
    model = compiled(Recorder())
    history = model.fit(X10, Y10, validation_split=0.2, validation_freq=2, epochs=5, verbose=0)
    assert len(history.history["loss"]) == 5 and len(history.history["val_loss"]) == 2
    history = model.fit(X10, Y10, validation_split=0.2, validation_freq=[1, 4], epochs=5, verbose=0)
    assert len(history.history["val_loss"]) == 2


def test_validation_freq_fires_the_test_hooks_on_those_epochs_only():
    calls = []

    class Hooks(fitkit.Callback):
        def on_test_begin(self, logs=None):
            calls.append(("test", self.model.epoch))

        def on_epoch_end(self, epoch, logs=None):
            calls.append(("epoch", epoch, "val_loss" in logs))

    model = compiled(Recorder())
    model.fit(X10, Y10, validation_split=0.2, validation_freq=2, epochs=4, callbacks=[Hooks()], verbose=0)
    assert calls == [
        ("epoch", 0, False),
        ("test", 1),
        ("epoch", 1, True),
        ("epoch", 2, False),
        ("test", 3),
        ("epoch", 3, True),
    ]


# -- samplers ---------------------------------------------------------------------------------


class EpochSampler(RandomSampler):
    def __init__(self, data):
        super().__init__(data)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def test_set_epoch_is_called_once_per_epoch():
    # regression: the default BatchSampler wraps the same sampler, which was set twice
    ds = TensorDataset(X10, Y10)
    sampler = EpochSampler(ds)
    model = compiled(Recorder())
    model.fit(DataLoader(ds, batch_size=4, sampler=sampler), initial_epoch=1, epochs=4, verbose=0)
    assert sampler.epochs == [1, 2, 3]


def test_set_epoch_on_a_batch_sampler_sampler():
    from torch.utils.data import BatchSampler

    ds = TensorDataset(X10, Y10)
    sampler = EpochSampler(ds)
    model = compiled(Recorder())
    model.fit(DataLoader(ds, batch_sampler=BatchSampler(sampler, 4, drop_last=False)), epochs=2, verbose=0)
    assert sampler.epochs == [0, 1]


class EpochBuckets(Sampler):
    """A bucketing batch sampler as Lightning and Accelerate users write one: buckets of
    neighbouring rows (rows of similar length), in an order seeded by the epoch it was told."""

    def __init__(self, n: int, batch_size: int, seed: int = 0):
        self.buckets = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
        self.seed, self.epoch = seed, 0
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        order = torch.randperm(len(self.buckets), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return iter([self.buckets[i] for i in order.tolist()])


# EpochBuckets(10, 4)'s batches of X10's rows: buckets [0-3], [4-7], [8-9] in the order of
# randperm(3) seeded 0, 1, 2.
BUCKETS_BY_EPOCH = {
    0: [[8.0, 9.0], [0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]],
    1: [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0], [0.0, 1.0, 2.0, 3.0]],
    2: [[0.0, 1.0, 2.0, 3.0], [8.0, 9.0], [4.0, 5.0, 6.0, 7.0]],
}


def test_a_batch_samplers_set_epoch_is_called_once_per_epoch_with_its_index():
    ds = TensorDataset(X10, Y10)
    buckets = EpochBuckets(len(ds), 4)
    rec = Recorder()
    compiled(rec).fit(DataLoader(ds, batch_sampler=buckets), epochs=3, verbose=0)
    assert buckets.epochs == [0, 1, 2]
    assert rec.train_rows == BUCKETS_BY_EPOCH[0] + BUCKETS_BY_EPOCH[1] + BUCKETS_BY_EPOCH[2]


class _Crash(Exception):
    pass


def _fit_buckets(buckets: EpochBuckets, rec: Recorder, folder, crash_in_epoch: int | None = None) -> None:
    """3 epochs over X10 in ``buckets``' batches with a BackupAndRestore at epoch ends; a crash
    after batch 1 of ``crash_in_epoch``."""
    from fitkit.callbacks import BackupAndRestore, LambdaCallback

    model = compiled(rec)

    def crash(batch, logs):
        if model.epoch == crash_in_epoch and batch == 1:
            raise _Crash

    callbacks = [LambdaCallback(on_train_batch_end=crash), BackupAndRestore(folder, save_freq="epoch")]
    model.fit(DataLoader(TensorDataset(X10, Y10), batch_sampler=buckets), epochs=3, verbose=0, callbacks=callbacks)


def test_a_resumed_fit_tells_the_batch_sampler_its_own_epoch(tmp_path):
    buckets, rec = EpochBuckets(10, 4), Recorder()
    compiled(rec).fit(DataLoader(TensorDataset(X10, Y10), batch_sampler=buckets), initial_epoch=2, epochs=3, verbose=0)
    assert buckets.epochs == [2]
    assert rec.train_rows == BUCKETS_BY_EPOCH[2]

    # A crash inside epoch 1; the rerun resumes at its start (the backup of epoch 0's end).
    crashed = EpochBuckets(10, 4)
    with pytest.raises(_Crash):
        _fit_buckets(crashed, Recorder(), tmp_path, crash_in_epoch=1)
    assert crashed.epochs == [0, 1]
    buckets, rec = EpochBuckets(10, 4), Recorder()
    _fit_buckets(buckets, rec, tmp_path)
    assert buckets.epochs == [1, 2]
    assert rec.train_rows == BUCKETS_BY_EPOCH[1] + BUCKETS_BY_EPOCH[2]


def test_validation_steps_and_evaluate_steps_bound_infinite_generators():
    def forever(value):
        while True:
            yield torch.full((2, 1), value), torch.zeros(2, 1)

    rec = Recorder()
    model = compiled(rec)
    history = model.fit(
        forever(1.0), steps_per_epoch=2, validation_data=forever(2.0), validation_steps=3, epochs=2, verbose=0
    )
    assert history.history["loss"] == [1.0, 1.0] and history.history["val_loss"] == [4.0, 4.0]
    assert model.evaluate(forever(3.0), steps=4, verbose=0) == {"loss": 9.0}
    assert model.predict(forever(1.0), steps=3, verbose=0).shape == (6, 1)
