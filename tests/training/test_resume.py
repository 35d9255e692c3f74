"""Exact resume: save_checkpoint / load_checkpoint and BackupAndRestore in-process, and SIGKILL at
random steps then the same script again (subprocesses): the same final weights as no kill."""

from __future__ import annotations

import random
import runpy
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import NoisyNet
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import BackupAndRestore, EarlyStopping, LambdaCallback, ModelCheckpoint


def _data(n: int = 12):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1 * torch.randn(n, 1, generator=g)


def _model(seed: int = 0, **compile_kwargs) -> fitkit.Model:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.25), nn.Tanh(), nn.Linear(8, 1))  # dropout: RNG matters
    model = fitkit.Model(module, device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.Adam(p, lr=0.1),
        loss="mse",
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
        **compile_kwargs,
    )
    return model


def _disturb_rngs() -> None:
    torch.rand(7)
    random.random()
    np.random.rand(3)


def _assert_same_run(model: fitkit.Model, ref: fitkit.Model) -> None:
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=1e-6)
    assert model.history.epoch == ref.history.epoch
    for key, values in ref.history.history.items():
        assert model.history.history[key] == pytest.approx(values, rel=1e-6), key


class _Crash(Exception):
    pass


def _crash_at_step(model_ref: list, step: int) -> LambdaCallback:
    def fn(batch, logs):
        if model_ref[0].global_step == step:
            raise _Crash

    return LambdaCallback(on_train_batch_end=fn)


# -- save_checkpoint / load_checkpoint ------------------------------------------------------------
def test_resume_at_an_epoch_boundary_equals_the_uninterrupted_run(tmp_path):
    x, y = _data()
    ref = _model()
    ref.fit(x, y, batch_size=4, epochs=4, shuffle=True, verbose=0)

    first = _model()
    first.fit(x, y, batch_size=4, epochs=2, shuffle=True, verbose=0)
    first.save_checkpoint(tmp_path / "c.pt")
    resumed = _model(seed=1)  # other initial weights: all of them come from the file
    initial_epoch = resumed.load_checkpoint(tmp_path / "c.pt")
    _disturb_rngs()  # between load and fit: fit restores the RNG states itself
    resumed.fit(x, y, batch_size=4, epochs=4, initial_epoch=initial_epoch, shuffle=True, verbose=0)

    assert initial_epoch == 2
    _assert_same_run(resumed, ref)
    assert resumed.optimizer.param_groups[0]["lr"] == 0.1 * 0.5**4
    assert all(s["step"].item() == 12 for s in resumed.optimizer.state_dict()["state"].values())
    assert resumed.global_step == 12


def test_resume_inside_an_epoch_equals_the_uninterrupted_run(tmp_path):
    x, y = _data()
    ref = _model()
    path = tmp_path / "mid.pt"
    save = LambdaCallback(on_train_batch_end=lambda b, logs: ref.epoch == 1 and b == 1 and ref.save_checkpoint(path))
    ref.fit(x, y, batch_size=4, epochs=4, verbose=0, callbacks=[save])

    resumed = _model(seed=1)
    initial_epoch = resumed.load_checkpoint(path)
    _disturb_rngs()
    resumed.fit(x, y, batch_size=4, epochs=4, initial_epoch=initial_epoch, verbose=0, callbacks=[save])

    assert initial_epoch == 1 and torch.load(path, weights_only=True)["step_in_epoch"] == 2
    _assert_same_run(resumed, ref)  # the epoch-1 logs too: the running loss was restored
    assert all(s["step"].item() == 12 for s in resumed.optimizer.state_dict()["state"].values())


def test_a_checkpoint_from_the_last_batch_of_an_epoch_resumes_at_its_end(tmp_path):
    x, y = _data()
    ref = _model()
    path = tmp_path / "last.pt"
    save = LambdaCallback(on_train_batch_end=lambda b, logs: ref.epoch == 1 and b == 2 and ref.save_checkpoint(path))
    ref.fit(x, y, batch_size=4, epochs=3, validation_data=(x, y), verbose=0, callbacks=[save])
    resumed = _model(seed=1)
    resumed.fit(
        x,
        y,
        batch_size=4,
        epochs=3,
        initial_epoch=resumed.load_checkpoint(path),
        validation_data=(x, y),
        verbose=0,
        callbacks=[save],
    )
    _assert_same_run(resumed, ref)


def test_a_resume_point_serves_one_fit_only(tmp_path):
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    model.save_checkpoint(tmp_path / "c.pt")
    model.load_checkpoint(tmp_path / "c.pt")
    with pytest.warns(UserWarning, match=r"continues at epoch 2, but fit starts at initial_epoch=0.*initial_epoch=2"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # no second warning
    assert model._core.resume is None


# -- BackupAndRestore ---------------------------------------------------------------------------
def _crash_at_train_end() -> LambdaCallback:
    def fn(logs):
        raise _Crash

    return LambdaCallback(on_train_end=fn)


def _backup_run(tmp_path, crash_step=None, save_freq="epoch", epochs=5, accumulation=1, stop=False, crash_at_end=False):
    x, y = _data(20)
    holder: list = []
    model = _model(gradient_accumulation_steps=accumulation)
    holder.append(model)
    callbacks = [
        _crash_at_train_end() if crash_at_end else _crash_at_step(holder, -1 if crash_step is None else crash_step),
        EarlyStopping(monitor="loss", patience=0, min_delta=0.05) if stop else LambdaCallback(),
        ModelCheckpoint(tmp_path / "ckpt" / "ep{epoch}.pt", monitor="loss", save_top_k=2),
        BackupAndRestore(tmp_path / "backup", save_freq=save_freq),
    ]
    model.fit(x, y, batch_size=4, epochs=epochs, validation_data=(x[:8], y[:8]), verbose=0, callbacks=callbacks)
    return model


@pytest.mark.parametrize(
    ("save_freq", "crash_step", "accumulation", "position"),
    [("epoch", 12, 1, (2, 0)), (2, 7, 1, (1, 1)), (3, 16, 1, (2, 5)), (2, 8, 2, (2, 2))],
    ids=["epoch-backup", "every-2-batches", "every-3-batches-at-epoch-end", "accumulation-2"],
)
def test_backup_and_restore_after_a_crash_equals_the_uninterrupted_run(
    tmp_path, save_freq, crash_step, accumulation, position
):
    # 20 samples, batch 4: 5 batches per epoch (3 optimizer steps with accumulation 2).
    ref = _backup_run(tmp_path / "ref", save_freq=save_freq, accumulation=accumulation)
    with pytest.raises(_Crash):
        _backup_run(tmp_path / "run", crash_step, save_freq, accumulation=accumulation)
    backup = torch.load(tmp_path / "run" / "backup" / "backup.pt", weights_only=True)  # kept when fit raises
    assert (backup["epoch"], backup["step_in_epoch"]) == position
    resumed = _backup_run(tmp_path / "run", save_freq=save_freq, accumulation=accumulation)
    _assert_same_run(resumed, ref)
    assert not (tmp_path / "run" / "backup").exists()  # deleted after a fit that ended normally
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir()) == sorted(
        p.name for p in (tmp_path / "ref" / "ckpt").iterdir()
    )


@pytest.mark.parametrize("save_freq", ["epoch", 2])
def test_backup_and_restore_keeps_the_early_stopping_epoch_count(tmp_path, save_freq):
    ref = _backup_run(tmp_path / "ref", save_freq=save_freq, epochs=30, stop=True)
    assert 2 < len(ref.history.epoch) < 30
    crash = 5 * len(ref.history.epoch) - 3  # inside the last epoch: 5 batches per epoch
    with pytest.raises(_Crash):
        _backup_run(tmp_path / "run", crash, save_freq=save_freq, epochs=30, stop=True)
    _assert_same_run(_backup_run(tmp_path / "run", save_freq=save_freq, epochs=30, stop=True), ref)
    # A crash after EarlyStopping stopped the run, before the backup was deleted: the rerun
    # stops at the same epoch (the stopping epoch was not backed up; it is replayed).
    with pytest.raises(_Crash):
        _backup_run(tmp_path / "end", save_freq=save_freq, epochs=30, stop=True, crash_at_end=True)
    assert torch.load(tmp_path / "end" / "backup" / "backup.pt", weights_only=True)["epoch"] < len(ref.history.epoch)
    _assert_same_run(_backup_run(tmp_path / "end", save_freq=save_freq, epochs=30, stop=True), ref)


def test_a_second_crash_inside_the_resumed_epoch_still_resumes_exactly(tmp_path):
    ref = _backup_run(tmp_path / "ref", save_freq=1)
    for crash, position in ((7, (1, 1)), (9, (1, 3))):  # the second backup is from the resumed epoch
        with pytest.raises(_Crash):
            _backup_run(tmp_path / "run", crash, save_freq=1)
        backup = torch.load(tmp_path / "run" / "backup" / "backup.pt", weights_only=True)
        assert (backup["epoch"], backup["step_in_epoch"]) == position
    _assert_same_run(_backup_run(tmp_path / "run", save_freq=1), ref)


def test_a_relative_lr_schedule_is_not_applied_twice_by_a_resume_inside_an_epoch(tmp_path):
    from fitkit.callbacks import LearningRateScheduler

    x, y = _data(20)
    halve = lambda epoch, lr: lr * 0.5  # noqa: E731

    def run(folder, crash_step=None):
        holder = [_model()]
        holder[0].scheduler = None  # only the callback moves the rate
        callbacks = [
            _crash_at_step(holder, -1 if crash_step is None else crash_step),
            LearningRateScheduler(halve),
            BackupAndRestore(folder, save_freq=2),
        ]
        return holder[0].fit(x, y, batch_size=4, epochs=4, verbose=0, callbacks=callbacks)

    ref = run(tmp_path / "ref")
    with pytest.raises(_Crash):
        run(tmp_path / "run", crash_step=8)  # the backup is from batch 2 of epoch 1
    assert ref.history["learning_rate"] == [0.05, 0.025, 0.0125, 0.00625]
    assert run(tmp_path / "run").history["learning_rate"] == ref.history["learning_rate"]


@pytest.mark.parametrize("source", ["arrays", "dataloader"])
def test_a_resumed_fit_of_a_module_drawing_noise_in_eval_mode_equals_the_uninterrupted_run(tmp_path, source):
    # The resumed fit checks its first batch again, after the backup's RNG states were restored:
    # that check's forward (noise in eval mode too) must not move the RNG the next step draws from.
    x = torch.linspace(-1, 1, 18).unsqueeze(1)

    def run(folder, crash_step=None):
        holder: list = []
        torch.manual_seed(0)
        model = fitkit.Model(NoisyNet(), device="cpu")
        model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
        holder.append(model)
        data, kwargs = (
            ((x, -0.5 * x), {"batch_size": 4})
            if source == "arrays"
            else ((DataLoader(TensorDataset(x, -0.5 * x), batch_size=4, shuffle=True),), {})
        )
        callbacks = [
            _crash_at_step(holder, -1 if crash_step is None else crash_step),
            BackupAndRestore(folder, save_freq=2),
        ]
        model.fit(*data, epochs=3, verbose=0, callbacks=callbacks, **kwargs)
        return model

    ref = run(tmp_path / "ref")
    with pytest.raises(_Crash):
        run(tmp_path / "run", crash_step=5)  # 5 batches per epoch: the backup is from batch 4 of epoch 0
    assert torch.load(tmp_path / "run" / "backup.pt", weights_only=True)["step_in_epoch"] == 4
    resumed = run(tmp_path / "run")
    assert torch.equal(resumed.module.lin.weight, ref.module.lin.weight)  # bit for bit
    for name, value in ref.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name  # bit for bit
    assert int(resumed.module.rows_seen) == int(ref.module.rows_seen) == 3 * 18
    assert resumed.history.history["loss"] == ref.history.history["loss"]


# One training job. Argument 1: its folder; argument 2: the optimizer step at which the
# process kills itself with SIGKILL (-1: never). Kills come from a callback, so they are
# deterministic; BackupAndRestore backs up every 3 batches (5 batches per epoch, so backups
# land inside epochs and at their ends).
SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from torch import nn
    import fitkit
    from fitkit.callbacks import BackupAndRestore, EarlyStopping, LambdaCallback, ModelCheckpoint


    def main(folder, kill_at):
        torch.set_num_threads(1)
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(40, 3, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3 * torch.randn(40, 1, generator=g)
        module = nn.Sequential(nn.Linear(3, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
        model = fitkit.Model(module, device="cpu")
        model.compile(
            optimizer=lambda p: torch.optim.Adam(p, lr=0.05), loss="mse",
            scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.7),
        )

        def maybe_kill(batch, logs):
            if model.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        callbacks = [
            LambdaCallback(on_train_batch_end=maybe_kill),
            EarlyStopping(monitor="val_loss", patience=1, min_delta=0.01, restore_best_weights=True),
            ModelCheckpoint(os.path.join(folder, "ckpt", "ep{epoch:02d}.pt"), monitor="val_loss", save_top_k=2),
            BackupAndRestore(os.path.join(folder, "backup"), save_freq=3),
        ]
        history = model.fit(x[:32], y[:32], batch_size=7, epochs=40, validation_data=(x[32:], y[32:]),
                            callbacks=callbacks, verbose=0)
        torch.save({"weights": model.state_dict(), "history": history.history, "epochs": history.epoch,
                    "steps": model.global_step}, os.path.join(folder, "final.pt"))


    if __name__ == "__main__":
        main(sys.argv[1], int(sys.argv[2]))
    """
)


def _run(script, folder, kill_at: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), str(folder), str(kill_at)], capture_output=True, text=True, timeout=300
    )


def _all_files_load(folder) -> list[str]:
    names = []
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != "final.pt" and path.suffix != ".lock":  # a killed run's locks stay
            torch.load(path, weights_only=True)  # raises on a partial or corrupt file
            names.append(str(path.relative_to(folder)))
    return names


def _uninterrupted_in_process(script, folder) -> dict:
    # The same script, run here: no interpreter start-up, and nothing kills it.
    folder.mkdir()
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    try:
        runpy.run_path(str(script))["main"](str(folder), -1)
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    return {"final": torch.load(folder / "final.pt", weights_only=True), "files": _all_files_load(folder)}


def _killed_then_finished(script, folder, kills: list[int]) -> dict:
    folder.mkdir()
    for step in kills:
        proc = _run(script, folder, step)
        assert proc.returncode == -signal.SIGKILL, (step, proc.stderr[-2000:])
        assert not (folder / "final.pt").exists()
        assert "backup/backup.pt" in _all_files_load(folder)  # and every other file loads too
    proc = _run(script, folder, -1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"final": torch.load(folder / "final.pt", weights_only=True), "files": _all_files_load(folder)}


@pytest.mark.slow
def test_sigkill_at_random_steps_then_rerun_equals_the_uninterrupted_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # The reference stops early at 20 steps (4 epochs of 5 batches); each seed picks a kill step.
    plans = {seed: [random.Random(seed).randrange(4, 20)] for seed in range(3)}  # after a first backup
    with ThreadPoolExecutor(len(plans)) as pool:  # one kill-then-rerun chain per seed, side by side
        futures = {
            seed: pool.submit(_killed_then_finished, script, tmp_path / f"seed{seed}", kills)
            for seed, kills in plans.items()
        }
        ref = _uninterrupted_in_process(script, tmp_path / "ref")
        results = {seed: f.result() for seed, f in futures.items()}
    assert ref["final"]["steps"] == 20 and ref["final"]["epochs"] == [0, 1, 2, 3]  # EarlyStopping ended it
    assert len(ref["files"]) == 2 and all(f.startswith("ckpt/ep") for f in ref["files"])
    for seed, got in results.items():
        final, why = got["final"], f"seed {seed}, kills at steps {plans[seed]}"
        assert final["epochs"] == ref["final"]["epochs"] and final["steps"] == 20, why
        for k, v in ref["final"]["weights"].items():
            torch.testing.assert_close(final["weights"][k], v, rtol=0, atol=1e-6, msg=why)
        for key, values in ref["final"]["history"].items():
            assert final["history"][key] == pytest.approx(values, rel=1e-6), (why, key)
        assert got["files"] == ref["files"], why  # the same top-2 checkpoints; the backup was deleted
