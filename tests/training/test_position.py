"""A crash and a BackupAndRestore resume under ``steps_per_epoch`` end where the uninterrupted
run ends: the resumed epoch skips what was done, and a pass carried over across epochs
continues where it stood."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from conftest import Bias

import fitkit
from fitkit.callbacks import BackupAndRestore, Callback

X, Y = torch.zeros(10, 1), torch.arange(10.0).reshape(-1, 1)  # batch i (size 1) has y = i


class Crash(Exception):
    pass


class CrashAt(Callback):
    def __init__(self, n: int):
        super().__init__()
        self.n, self.seen = n, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.n:
            raise Crash


def _run(epochs, spe, callbacks=()):
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss="mse")  # one step: b = that batch's y
    with warnings.catch_warnings():  # 10 batches, 4 per epoch: the third epoch runs out (one warning)
        warnings.simplefilter("ignore", fitkit.FitkitWarning)
        h = model.fit(
            X, Y, batch_size=1, epochs=epochs, steps_per_epoch=spe, shuffle=False, verbose=0, callbacks=list(callbacks)
        )
    return model, h


@pytest.mark.parametrize(
    "epochs, spe, crash_at, save_freq",
    [
        (1, 10, 6, 1),
        (2, 4, 6, 1),
        (3, 4, 10, "epoch"),
        (3, 4, 7, 2),
        (4, 4, 11, 1),  # the backup after the pass's last batch, in the epoch it ended early: that epoch ends
        (3, 5, 12, 1),
    ],  # a backup inside the pass opened after one that ended with epoch 2
)
def test_a_resume_under_steps_per_epoch_equals_the_uninterrupted_run(tmp_path, epochs, spe, crash_at, save_freq):
    ref, ref_h = _run(epochs, spe)
    with pytest.raises(Crash):
        _run(epochs, spe, [BackupAndRestore(tmp_path, save_freq=save_freq), CrashAt(crash_at)])
    model, h = _run(epochs, spe, [BackupAndRestore(tmp_path, save_freq=save_freq)])
    assert model.module.b.item() == ref.module.b.item()
    assert h.history["loss"] == ref_h.history["loss"]
    assert model.global_step == ref.global_step


def test_tuple_validation_data_with_several_inputs_and_outputs_is_x_and_y():
    class TwoOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.b = torch.nn.Parameter(torch.zeros(1))

        def forward(self, a, c):
            return a + self.b, c + self.b

    a, c = torch.zeros(2, 1), torch.ones(2, 1)
    y1, y2 = torch.full((2, 1), 1.0), torch.full((2, 1), 3.0)
    model = fitkit.Model(TwoOut(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss=["mse", "mse"])
    h = model.fit((a, c), (y1, y2), epochs=1, validation_data=((a, c), (y1, y2)), verbose=0)
    assert h.history["val_loss"] == [5.0]  # (0 - 1)^2 + (1 - 3)^2


def test_a_checkpoint_deciding_on_epochs_without_validation_fails_before_step_1(tmp_path):
    from fitkit.callbacks import ModelCheckpoint

    model = fitkit.Model(Bias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss="mse")
    ckpt = ModelCheckpoint(tmp_path / "ep{epoch}.pt", monitor="val_loss", save_best_only=True, every_n_epochs=2)
    with pytest.raises(ValueError, match=r"decides at epochs \[2, 4, 6\].*validation runs at epochs \[1, 3, 5\]"):
        model.fit(
            X[:1],
            Y[:1],
            epochs=6,
            batch_size=1,
            validation_data=(X[:1], Y[:1]),
            validation_freq=[1, 3, 5],
            callbacks=[ckpt],
            verbose=0,
        )
    assert model.module.b.item() == 0.0 and list(tmp_path.iterdir()) == []


# -- the Position value itself --------------------------------------------------------------------
def test_position_counts_global_samples_and_reads_checkpoints_of_every_version():
    from fitkit.data import DeviceLoader, TensorBatches
    from fitkit.training.position import Position

    running = Position(2, batch_size=4, world=2, n_used=20)  # two ranks: a global batch of 8
    running.begin_epoch(2)
    running.enter()
    running.done(2)
    assert running.samples == 16
    running.done(3)
    assert running.samples == 20  # capped at the samples an epoch uses
    saved = running.state_dict(pass_offset=0)
    assert saved == {"epoch": 2, "step_in_epoch": 3, "samples_in_epoch": 20, "pass_offset": 0, "world_size": 2}
    old = Position.load_state_dict({"epoch": 1, "step_in_epoch": 2, "batch_size": 4})  # no samples, no pass
    assert (old.epoch, old.batches, old.pass_offset) == (1, 2, 0)
    tensors = DeviceLoader(TensorBatches(torch.zeros(8, 1), None, None, 4, False), torch.device("cpu"))
    assert old.skip_for(tensors) == (2, None)  # no sample count saved: by batches
    assert Position.load_state_dict({**saved, "batch_size": 4}).skip_for(tensors) == (0, 20)  # by samples
    tensors_of_3 = DeviceLoader([(torch.zeros(3, 1),)], torch.device("cpu"))
    tensors_of_3.batch_size = 3
    with pytest.raises(ValueError, match="batch_size=4.*Fix: resume with batch_size=4"):
        old.skip_for(tensors_of_3)
    running.leave()
    running.end_epoch(2)
    assert running.state_dict(pass_offset=5) == {
        "epoch": 3,
        "step_in_epoch": 0,
        "samples_in_epoch": 0,
        "pass_offset": 5,
    }


def test_a_source_resumed_by_batches_at_another_world_size_is_refused_before_a_step(tmp_path):
    """An IterableDataset's batches at another world size hold other samples: a clear error, not a skip."""
    import pytest
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    import fitkit
    from fitkit.files import atomic_save

    def make():
        torch.manual_seed(0)
        model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
        model.compile(optimizer="sgd", loss="mse")
        return model

    class Rows(IterableDataset):  # an iterable: its order is not one list fitkit knows
        def __iter__(self):
            g = torch.Generator().manual_seed(3)
            yield from zip(torch.randn(12, 2, generator=g), torch.randn(12, 1, generator=g), strict=True)

    loader = DataLoader(Rows(), batch_size=4)

    def save_at_1(b, logs):
        if b == 1:
            model.save_checkpoint(tmp_path / "c.pt")

    save = fitkit.callbacks.LambdaCallback(on_train_batch_end=save_at_1)
    model = make()
    model.fit(loader, epochs=1, verbose=0, callbacks=[save])  # inside epoch 1, 2 batches done, on 1 process
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert (state["step_in_epoch"], state["world_size"]) == (2, 1)
    atomic_save({**state, "world_size": 2}, tmp_path / "c.pt")  # as if taken on 2 processes
    resumed = make()
    start = resumed.load_checkpoint(tmp_path / "c.pt")
    before = [p.detach().clone() for p in resumed.module.parameters()]
    with pytest.raises(
        ValueError,
        match=r"on 2 process\(es\), and this fit runs on 1\. The data cannot be re-split: "
        r"fitkit does not know the order of this source \(DataLoader: an iterable",
    ):
        resumed.fit(loader, epochs=1, initial_epoch=start, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, resumed.module.parameters(), strict=True))


def test_already_sharded_data_resumed_at_another_world_size_is_refused_before_a_step(tmp_path):
    """Each rank's share of already_sharded data is the user's split: fitkit cannot redo it."""
    import pytest
    import torch

    import fitkit
    from fitkit.distributed import already_sharded
    from fitkit.files import atomic_save

    def make():
        torch.manual_seed(0)
        model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
        model.compile(optimizer="sgd", loss="mse")
        return model

    x, y = torch.randn(12, 2), torch.randn(12, 1)
    model = make()
    save = fitkit.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: b == 1 and model.save_checkpoint(tmp_path / "c.pt")
    )
    model.fit(already_sharded(x), y, batch_size=4, epochs=1, verbose=0, callbacks=[save])
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert (state["step_in_epoch"], state["samples_in_epoch"], state["world_size"]) == (2, 8, 1)
    atomic_save({**state, "world_size": 2}, tmp_path / "c.pt")  # as if taken on 2 processes
    resumed = make()
    start = resumed.load_checkpoint(tmp_path / "c.pt")
    before = [p.detach().clone() for p in resumed.module.parameters()]
    with pytest.raises(
        ValueError,
        match=r"on 2 process\(es\), and this fit runs on 1\. The data cannot be re-split: "
        r"it is marked already_sharded.*Fix: resume on 2 process\(es\)",
    ):
        resumed.fit(already_sharded(x), y, batch_size=4, epochs=1, initial_epoch=start, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, resumed.module.parameters(), strict=True))


# -- a shuffled pass carried over across epochs, resumed ------------------------------------------
class _Scaled(torch.nn.Module):
    """``Linear(1, 1)`` on ``x / 32`` behind a dropout: the RNG states matter for the weights."""

    def __init__(self):
        super().__init__()
        self.lin, self.drop = torch.nn.Linear(1, 1), torch.nn.Dropout(0.25)

    def forward(self, x):
        return self.lin(self.drop(x / 32))


class _IdModel(fitkit.Model):
    """Records the sample ids (``x``: sample i is ``(i, i)``) of every batch it trains."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(_Scaled(), device="cpu")
        self.ids: list[list[int]] = []
        self.compile(optimizer="sgd", loss="mse")

    def train_step(self, batch):
        self.ids.append(batch[0].flatten().long().tolist())
        super().train_step(batch)


class _Rows(torch.utils.data.Dataset):
    """A map-style Dataset: sample i is ``(i, i)``."""

    def __init__(self, n: int):
        self.x = torch.arange(float(n)).unsqueeze(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.x[i]


def _shuffled(kind: str, n: int) -> tuple[tuple, dict]:
    """``fit``'s data arguments: ``n`` samples, batches of 4, reshuffled every pass."""
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.arange(float(n)).unsqueeze(1)
    if kind == "tensors":
        return (x, x), {"batch_size": 4, "shuffle": True}
    if kind == "dataset":
        return (_Rows(n),), {"batch_size": 4, "shuffle": True}
    if kind == "stateful":  # torchdata's: it saves its own position
        stateful = pytest.importorskip("torchdata.stateful_dataloader")
        return (stateful.StatefulDataLoader(TensorDataset(x, x), batch_size=4, shuffle=True),), {}
    own = torch.Generator().manual_seed(5) if kind == "generator" else None  # the loader's own generator
    return (DataLoader(TensorDataset(x, x), batch_size=4, shuffle=True, generator=own),), {}


def _fit_ids(kind: str, n: int, spe: int, epochs: int, callbacks=(), model=None, **kwargs) -> _IdModel:
    model = _IdModel() if model is None else model
    args, data_kwargs = _shuffled(kind, n)
    with warnings.catch_warnings():  # a pass that runs out inside an epoch warns
        warnings.simplefilter("ignore", fitkit.FitkitWarning)
        model.fit(
            *args, **data_kwargs, epochs=epochs, steps_per_epoch=spe, verbose=0, callbacks=list(callbacks), **kwargs
        )
    return model


def _same_weights(a: fitkit.Model, b: fitkit.Model) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True))


@pytest.mark.parametrize("kind", ["tensors", "dataloader", "generator", "dataset", "stateful"])
@pytest.mark.parametrize(
    "n, spe, epochs, steps, save_freq, crash_at, backup_step",
    [(30, 3, 4, 11, "epoch", 5, 3), (30, 3, 4, 11, 1, 5, 4), (30, 3, 4, 11, 1, 9, 8), (32, 4, 3, 12, 1, 11, 10)],
    ids=["epoch-end", "mid-epoch", "after-the-pass-ran-out", "in-a-pass-opened-after-one-ended-with-an-epoch"],
)
def test_a_crash_under_steps_per_epoch_resumes_on_the_samples_of_the_uninterrupted_run(
    tmp_path, kind, n, spe, epochs, steps, save_freq, crash_at, backup_step
):
    """30 samples are 8 batches of 4 (the last of 2): epochs of 3, 3, 2 (the data runs out, the
    epoch ends early), then 3 of a new pass; 32 samples with 4 per epoch end the pass with epoch 2.
    A backup at an epoch end, or inside one (``save_freq=1``), in a pass carried over from the
    epochs before: the resumed run trains the uninterrupted run's batches from there on."""
    ref = _fit_ids(kind, n, spe, epochs)
    per_pass = -(-n // 4)
    assert len(ref.ids) == ref.global_step == steps  # 3 + 3 + 2 + 3, or 4 + 4 + 4
    assert sorted(i for b in ref.ids[:per_pass] for i in b) == list(range(n))  # each sample once per pass
    assert ref.ids[:per_pass] != [list(range(i, min(i + 4, n))) for i in range(0, n, 4)]  # shuffled
    with pytest.raises(Crash):
        _fit_ids(kind, n, spe, epochs, [BackupAndRestore(tmp_path, save_freq=save_freq), CrashAt(crash_at)])
    assert torch.load(tmp_path / "backup.pt", weights_only=True)["global_step"] == backup_step
    resumed = _fit_ids(kind, n, spe, epochs, [BackupAndRestore(tmp_path, save_freq=save_freq)])
    assert resumed.ids == ref.ids[backup_step:]
    assert _same_weights(resumed, ref)
    assert resumed.history.history["loss"] == ref.history.history["loss"]


def _fit_32(model: _IdModel, epochs: int, initial_epoch: int = 0, callbacks=()) -> _IdModel:
    """32 samples, batches of 4, 2 per epoch: a pass spans 4 epochs."""
    x = torch.arange(32.0).unsqueeze(1)
    model.fit(
        x,
        x,
        batch_size=4,
        epochs=epochs,
        steps_per_epoch=2,
        shuffle=True,
        initial_epoch=initial_epoch,
        verbose=0,
        callbacks=list(callbacks),
    )
    return model


def _checkpoint_of_32(folder, save_freq) -> Any:
    """A ModelCheckpoint at the end of epoch 1 (``"epoch"``) or after batch 3, inside epoch 2 (3)."""
    if save_freq == "epoch":
        ckpt = fitkit.callbacks.ModelCheckpoint(folder / "c{epoch}.pt", monitor="loss", save_freq=save_freq)
        _fit_32(_IdModel(), 1, callbacks=[ckpt])
        (path,) = folder.iterdir()
        return path
    # {batch} names each save: the run's final step (batch 2 of epoch 2) is saved too, beside batch 3 overall
    ckpt = fitkit.callbacks.ModelCheckpoint(folder / "c{epoch}-{batch}.pt", monitor="loss", save_freq=save_freq)
    _fit_32(_IdModel(), 2, callbacks=[ckpt])
    assert sorted(p.name for p in folder.iterdir()) == ["c2-1.pt", "c2-2.pt"]
    return folder / "c2-1.pt"


@pytest.mark.parametrize("save_freq", ["epoch", 3])
def test_a_checkpoint_loaded_into_a_new_model_trains_the_rest_of_the_shuffled_pass(tmp_path, save_freq):
    """Epoch 2 continues the pass epoch 1 began. From a ModelCheckpoint at the end of epoch 1 (or
    inside epoch 2), a new model that loads it trains the batches the uninterrupted run trains."""
    ref = _fit_32(_IdModel(), 2)
    assert ref.ids == [[21, 15, 1, 9], [31, 2, 23, 5], [13, 18, 12, 6], [30, 28, 14, 0]]  # (seed 0)
    path = _checkpoint_of_32(tmp_path, save_freq)
    resumed = _IdModel()
    start = resumed.load_checkpoint(path)
    torch.manual_seed(1)  # between load and fit: the file's RNG states are the ones that count
    _fit_32(resumed, 2, initial_epoch=start)
    # epoch 2 as the uninterrupted run trains it (drawing the rest of the pass anew trained [[18, 25, 29, 21], ...])
    assert resumed.ids == ([[13, 18, 12, 6], [30, 28, 14, 0]] if save_freq == "epoch" else [[30, 28, 14, 0]])
    assert _same_weights(resumed, ref)
    state = torch.load(path, weights_only=True)  # 2 batches of the pass before epoch 2, drawn in epoch 1
    assert (state["epoch"], state["step_in_epoch"], state["pass_offset"]) == (1, 0 if save_freq == "epoch" else 1, 2)
    assert state["pass_start"]["epoch"] == 0 and state["pass_start"]["order"] is None  # no generator of its own


@pytest.mark.parametrize("save_freq", ["epoch", 3])
def test_a_checkpoint_without_the_pass_start_of_an_older_fitkit_resumes_as_before(tmp_path, save_freq):
    """A file without ``pass_start`` loads, and its resume draws the rest of the pass anew from the
    file's RNG state (what fitkit did before it saved the pass's start)."""
    from fitkit.files import atomic_save

    path = _checkpoint_of_32(tmp_path, save_freq)
    state = torch.load(path, weights_only=True)
    del state["pass_start"], state["fitkit_checksum"]
    atomic_save(state, path)  # as an older fitkit wrote it
    resumed = _IdModel()
    _fit_32(resumed, 2, initial_epoch=resumed.load_checkpoint(path))
    # the lists the resume of the same file trained before (the uninterrupted run: [[13, 18, 12, 6], [30, 28, 14, 0]])
    assert resumed.ids == ([[18, 25, 29, 21], [8, 4, 20, 19]] if save_freq == "epoch" else [[8, 4, 20, 19]])


def test_the_pass_start_is_kept_inside_an_epoch_and_while_a_pass_carries_over():
    from fitkit.training.parts import PositionPart
    from fitkit.training.position import Position

    start = {"epoch": 1, "rng": torch.get_rng_state(), "order": None}
    running = Position(3, batch_size=4)
    running.begin_epoch(3)
    running.enter()
    running.done(1)
    assert running.state_dict(pass_offset=0, pass_start=start)["pass_start"] is start  # the pass opened this epoch
    running.leave()
    running.end_epoch(3)
    assert "pass_start" not in running.state_dict(pass_offset=0, pass_start=start)  # the next epoch opens a pass
    saved = running.state_dict(pass_offset=5, pass_start=start)
    assert saved == {"epoch": 4, "step_in_epoch": 0, "samples_in_epoch": 0, "pass_offset": 5, "pass_start": start}
    loaded = Position.load_state_dict(saved)
    assert (loaded.pass_offset, loaded.pass_start) == (5, start)
    assert Position.load_state_dict({"epoch": 4, "step_in_epoch": 0, "pass_offset": 5}).pass_start is None  # older
    base = {"epoch": 4, "step_in_epoch": 0}
    check = PositionPart(None).content_problems  # the registry's position part checks its own keys
    assert check({**base, "pass_start": start}) == []
    (problem,) = check({**base, "pass_start": {**start, "epoch": -1}})  # an edited file
    assert problem == "checkpoint['pass_start']['epoch'] is -1, expected an int >= 0"  # the field it names
