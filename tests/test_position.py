"""A crash and a BackupAndRestore resume under ``steps_per_epoch`` end where the uninterrupted
run ends: the resumed epoch skips what was done, and a pass carried over across epochs
continues where it stood."""

from __future__ import annotations

import warnings

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
        h = model.fit(X, Y, batch_size=1, epochs=epochs, steps_per_epoch=spe, shuffle=False, verbose=0,
                      callbacks=list(callbacks))  # fmt: skip
    return model, h


@pytest.mark.parametrize(
    "epochs, spe, crash_at, save_freq",
    [(1, 10, 6, 1), (2, 4, 6, 1), (3, 4, 10, "epoch"), (3, 4, 7, 2)],
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
        model.fit(X[:1], Y[:1], epochs=6, batch_size=1, validation_data=(X[:1], Y[:1]),
                  validation_freq=[1, 3, 5], callbacks=[ckpt], verbose=0)  # fmt: skip
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
    assert running.state_dict(pass_offset=5) == {"epoch": 3, "step_in_epoch": 0, "samples_in_epoch": 0,
                                                 "pass_offset": 5}  # fmt: skip


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
    with pytest.raises(ValueError, match=r"on 2 process\(es\), and this fit runs on 1\. The data cannot be re-split: "
                       r"fitkit does not know the order of this source \(DataLoader: an iterable"):  # fmt: skip
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
        on_train_batch_end=lambda b, logs: b == 1 and model.save_checkpoint(tmp_path / "c.pt"))
    model.fit(already_sharded(x), y, batch_size=4, epochs=1, verbose=0, callbacks=[save])
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert (state["step_in_epoch"], state["samples_in_epoch"], state["world_size"]) == (2, 8, 1)
    atomic_save({**state, "world_size": 2}, tmp_path / "c.pt")  # as if taken on 2 processes
    resumed = make()
    start = resumed.load_checkpoint(tmp_path / "c.pt")
    before = [p.detach().clone() for p in resumed.module.parameters()]
    with pytest.raises(ValueError, match=r"on 2 process\(es\), and this fit runs on 1\. The data cannot be re-split: "
                       r"it is marked already_sharded.*Fix: resume on 2 process\(es\)"):  # fmt: skip
        resumed.fit(already_sharded(x), y, batch_size=4, epochs=1, initial_epoch=start, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, resumed.module.parameters(), strict=True))
