"""The process group fitkit starts under torchrun: its timeout, and the failing rank's
traceback in torchrun's failure summary."""

from __future__ import annotations

import pytest
from _torchrun import run_torchrun

from fitkit.distributed import check_timeout

HANG = """
import time, fitkit
from fitkit.distributed import rank
from _dist_scenarios import data, net

class Hang(fitkit.callbacks.Callback):  # rank 1 stalls, alive, past the other's timeout
    def on_train_batch_end(self, batch, logs=None):
        if rank() == 1 and self.model.global_step == 2:
            time.sleep(3)

x, y, _ = data(40)
model = fitkit.Model(net(), device="cpu", timeout=1)
model.compile(optimizer="sgd", loss="mse")
model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[Hang()])
(OUT / f"finished{rank()}").touch()
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_a_hanging_rank_ends_the_job_with_the_timeout_in_torchruns_summary(tmp_path):
    proc = run_torchrun(HANG, tmp_path, check=False, timeout=60)
    assert proc.returncode != 0
    assert not list(tmp_path.glob("finished*"))
    summary = proc.stderr[proc.stderr.index("Root Cause (first observed failure)"):]
    assert "rank      : 0" in summary and "error_file: <N/A>" not in summary
    assert "Timed out waiting 1000ms" in summary  # gloo's message, with rank 0's traceback:
    assert "in run_epoch" in summary and "model.fit(x, y" in summary


def test_timeout_is_checked(monkeypatch):
    assert check_timeout(2) == 2.0
    monkeypatch.setenv("FITKIT_DIST_TIMEOUT", "90")
    assert check_timeout(None) == 90.0 and check_timeout(5) == 5.0  # the argument wins
    with pytest.raises(TypeError, match=r"Expected `timeout` to be a number of seconds. Received: timeout='1m'"):
        check_timeout("1m")
    monkeypatch.setenv("FITKIT_DIST_TIMEOUT", "soon")
    with pytest.raises(TypeError, match="Received: FITKIT_DIST_TIMEOUT='soon'"):
        check_timeout(None)
    with pytest.raises(ValueError, match="Expected `timeout` to be a positive number of seconds. Received: timeout=-1"):
        check_timeout(-1)


def test_srun_without_torchrun_is_refused_at_model(monkeypatch):
    """``srun --ntasks=2 python train.py``: each task would train alone on all the data; the
    Model names the fix before anything runs. One task, or the batch script itself (no step
    variable), trains as one process."""
    import torch

    import fitkit

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    fitkit.Model(torch.nn.Linear(2, 1), device="cpu")  # the batch script: no SLURM_STEP_NUM_TASKS
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    with pytest.raises(RuntimeError, match=r"task 1 of 2 that srun started without torchrun.*Fix: .*srun --ntasks-per-node=1 torchrun"):
        fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
