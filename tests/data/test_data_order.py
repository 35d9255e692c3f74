from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset

import fitkit
from fitkit.callbacks import BackupAndRestore, LambdaCallback
from fitkit.checks import FitkitWarning

N, BS = 12, 2


class Crash(Exception):
    pass


class Rows(nn.Module):
    """A linear model on x[:, 1:] that records the row ids (x[:, 0]) of every training batch."""

    def __init__(self, seen: list):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.linear = nn.Linear(2, 1)
        with torch.no_grad():
            for p in self.linear.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.seen = seen

    def forward(self, x):
        if self.training:
            self.seen.extend(int(i) for i in x[:, 0])
        return self.linear(x[:, 1:])


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.arange(N, dtype=torch.float32)[:, None], torch.randn(N, 2, generator=g)], 1)
    return x, x[:, 1:2] * 2 - x[:, 2:3]


def _loader(kind: str):
    x, y = _data()
    ds = TensorDataset(x, y)
    if kind == "generator":
        return DataLoader(ds, batch_size=BS, shuffle=True, generator=torch.Generator().manual_seed(123))
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(ds, batch_size=BS, shuffle=True, generator=torch.Generator().manual_seed(123))
    if kind == "stateful_workers":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(
            ds, batch_size=BS, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(123)
        )
    raise ValueError(kind)


def _model(seen: list) -> fitkit.Model:
    model = fitkit.Model(Rows(seen), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5), loss="mse")
    return model


def _run(kind: str, tmp_path, crash_at: int | None = None):
    """Fit 3 epochs; with ``crash_at``, crash at that global batch, then resume from the backup."""
    seen: list = []
    model = _model(seen)
    backup = BackupAndRestore(tmp_path / "backup", save_freq=1)
    calls = []

    def crash(batch, logs):
        calls.append(batch)
        if crash_at is not None and len(calls) == crash_at:
            raise Crash

    cbs = [backup, LambdaCallback(on_train_batch_begin=crash)]
    if crash_at is None:
        model.fit(_loader(kind), epochs=3, verbose=0, callbacks=cbs)
        return model, seen
    with pytest.raises(Crash):
        model.fit(_loader(kind), epochs=3, verbose=0, callbacks=cbs)
    seen_before = list(seen)
    del seen[:]
    resumed = _model(seen)
    calls.clear()
    resumed.fit(_loader(kind), epochs=3, verbose=0, callbacks=[BackupAndRestore(tmp_path / "backup", save_freq=1)])
    return resumed, seen_before + seen


def _epochs(seen: list) -> list[list[int]]:
    return [sorted(seen[i : i + N]) for i in range(0, len(seen), N)]


def test_a_resume_inside_an_epoch_restores_the_loaders_own_generator(tmp_path):
    reference, order = _run("generator", tmp_path / "a")
    # Crash at the 3rd batch of epoch 1 (global batch 6 + 3): its backup holds 2 batches of the epoch.
    resumed, seen = _run("generator", tmp_path / "b", crash_at=N // BS + 3)
    assert _epochs(seen) == [list(range(N))] * 3  # every row trained exactly once per epoch
    assert seen == order  # in the uninterrupted run's order
    for a, b in zip(reference.module.parameters(), resumed.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


@pytest.mark.parametrize("kind", ["stateful", pytest.param("stateful_workers", marks=pytest.mark.slow)])
def test_a_stateful_dataloader_resumes_from_its_own_state(kind, tmp_path):
    _, order = _run(kind, tmp_path / "a")
    _, seen = _run(kind, tmp_path / "b", crash_at=N // BS + 3)
    # The interrupted epoch continues in its own order, each row once, fitkit skipping nothing
    # itself; the epochs after it draw what torchdata's restored loader draws.
    assert seen[: 2 * N] == order[: 2 * N]
    assert _epochs(seen) == [list(range(N))] * 3


def test_a_resume_at_an_epoch_boundary_continues_the_generator(tmp_path):
    reference, order = _run("generator", tmp_path / "a")
    resumed, seen = _run("generator", tmp_path / "b", crash_at=N // BS + 1)  # the first batch of epoch 1
    assert seen == order
    for a, b in zip(reference.module.parameters(), resumed.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


class Stream(IterableDataset):
    def __iter__(self):
        x, y = _data()
        return iter(list(zip(x, y, strict=True)))


class Reversed(Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(Stream(), batch_size=BS),
        lambda: DataLoader(TensorDataset(*_data()), batch_size=BS, sampler=Reversed(N)),
    ],
)
def test_a_resume_inside_an_epoch_warns_where_the_order_cannot_be_restored(make, tmp_path):
    seen: list = []
    model = _model(seen)

    def crash(batch, logs):
        if len(seen) == 3 * BS:
            raise Crash

    with pytest.raises(Crash):
        model.fit(
            make(),
            epochs=1,
            verbose=0,
            callbacks=[BackupAndRestore(tmp_path, save_freq=1), LambdaCallback(on_train_batch_begin=crash)],
        )
    with pytest.warns(FitkitWarning, match=r"Resuming inside epoch 1: .*cannot restore the order.*StatefulDataLoader"):
        _model([]).fit(make(), epochs=1, verbose=0, callbacks=[BackupAndRestore(tmp_path, save_freq=1)])


def test_a_dataloader_built_otherwise_is_refused_before_the_first_resumed_step(tmp_path):
    seen: list = []
    model = _model(seen)
    with pytest.raises(Crash):
        model.fit(
            _loader("generator"),
            epochs=1,
            verbose=0,
            callbacks=[
                BackupAndRestore(tmp_path, save_freq=1),
                LambdaCallback(on_train_batch_begin=lambda b, logs: b == 2 and (_ for _ in ()).throw(Crash())),
            ],
        )
    plain = DataLoader(TensorDataset(*_data()), batch_size=BS, shuffle=True)  # no generator of its own
    with pytest.raises(ValueError, match=r"state of 1 data generator.*has 0 and 0.*Fix: resume with a DataLoader"):
        _model([]).fit(plain, epochs=1, verbose=0, callbacks=[BackupAndRestore(tmp_path, save_freq=1)])


class EpochStream(IterableDataset):
    """Keras' PyDataset hooks and a state of its own: each epoch streams the rows in the order of
    randperm(seed 100 + epoch); on_epoch_end moves to the next epoch (as a PyDataset reshuffles there)."""

    def __init__(self, calls: list):
        self.epoch, self.calls = 0, calls

    def __iter__(self):
        x, y = _data()
        order = torch.randperm(N, generator=torch.Generator().manual_seed(100 + self.epoch))
        return iter([(x[i], y[i]) for i in order])

    def __len__(self):
        return N

    def on_epoch_begin(self):
        self.calls.append(("begin", self.epoch))

    def on_epoch_end(self):
        self.calls.append(("end", self.epoch))
        self.epoch += 1

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]


def _stream_run(tmp_path, crash_at: int | None = None):
    seen, calls = [], []
    model = _model(seen)
    batches = []

    def crash(batch, logs):
        batches.append(batch)
        if crash_at is not None and len(batches) == crash_at:
            raise Crash

    cbs = [BackupAndRestore(tmp_path, save_freq=1), LambdaCallback(on_train_batch_begin=crash)]
    if crash_at is None:
        model.fit(DataLoader(EpochStream(calls), batch_size=BS), epochs=3, verbose=0, callbacks=cbs)
        return model, seen, calls
    with pytest.raises(Crash):
        model.fit(DataLoader(EpochStream(calls), batch_size=BS), epochs=3, verbose=0, callbacks=cbs)
    before, before_calls = list(seen), list(calls)
    resumed_seen, resumed_calls = [], []
    resumed = _model(resumed_seen)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FitkitWarning)  # its order is restorable: no warning
        resumed.fit(
            DataLoader(EpochStream(resumed_calls), batch_size=BS),
            epochs=3,
            verbose=0,
            callbacks=[BackupAndRestore(tmp_path, save_freq=1)],
        )
    return resumed, before + resumed_seen, (before_calls, resumed_calls)


def test_a_datasets_epoch_hooks_run_and_its_state_resumes_inside_an_epoch(tmp_path):
    reference, order, calls = _stream_run(tmp_path / "a")
    assert calls == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1), ("begin", 2), ("end", 2)]
    expected = [int(i) for e in range(3) for i in torch.randperm(N, generator=torch.Generator().manual_seed(100 + e))]
    assert order == expected
    # crash at the 3rd batch of epoch 1; the backup of its 2nd batch holds the dataset's state of the epoch start
    resumed, seen, (before, after) = _stream_run(tmp_path / "b", crash_at=N // BS + 3)
    assert seen == order  # epoch 1 replayed from its saved state (epoch=1), its done batches skipped
    assert before == [("begin", 0), ("end", 0), ("begin", 1)]
    # the resumed epoch's hook runs on the fresh dataset (epoch 0), then the state saved after it loads (epoch 1)
    assert after == [("begin", 0), ("end", 1), ("begin", 2), ("end", 2)]
    for a, b in zip(reference.module.parameters(), resumed.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


class HookedRows(TensorDataset):
    """A map-style dataset with Keras' PyDataset hooks."""

    def __init__(self, *tensors):
        super().__init__(*tensors)
        self.calls: list[str] = []

    def on_epoch_begin(self):
        self.calls.append("begin")

    def on_epoch_end(self):
        self.calls.append("end")


@pytest.mark.parametrize("kwargs", [{}, {"sample_weight": torch.ones(N)}, {"validation_split": 0.25}])
def test_a_wrapped_datasets_epoch_hooks_run_once_per_training_epoch(kwargs):
    """Behind fitkit's sample-weight wrapper or validation_split's Subset, the user's dataset is found."""
    ds = HookedRows(*_data())
    _model([]).fit(ds, batch_size=BS, epochs=2, verbose=0, **kwargs)
    assert ds.calls == ["begin", "end", "begin", "end"]
