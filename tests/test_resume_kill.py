"""SIGKILL at random steps, then the same script again: the same final weights as no kill."""

from __future__ import annotations

import random
import runpy
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

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
        futures = {seed: pool.submit(_killed_then_finished, script, tmp_path / f"seed{seed}", kills)
                   for seed, kills in plans.items()}  # fmt: skip
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
