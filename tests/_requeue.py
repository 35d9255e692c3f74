"""The stop-and-resume scenario that the scheduler recipes of the scaling-out tutorial share.

A 2-rank run of ``TRAIN`` (3 epochs of 5 steps, a ``BackupAndRestore`` in ``runs/backup``)
waits at optimizer step 3 until the test has signalled it and then touched ``go``; the rerun,
after the test has touched ``requeued``, goes through. Each rank writes ``at3-<rank>`` when it
waits, ``exit-<rank>`` with the status of a ``SystemExit`` that ends its ``fit`` (143 for a
SIGTERM), and ``done-<rank>.pt`` when ``fit`` returns: the first step it began, the steps, its
world size, its node (torchrun's ``GROUP_RANK``) and its weights.
:func:`assert_resumed_like_uninterrupted` checks the rerun against one process's run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from _dist_scenarios import data, net
from _torchrun import TESTS_DIR

import fitkit

TRAIN = """
import os, sys, time
sys.path.insert(0, {tests!r})
import torch, fitkit
from fitkit.distributed import rank, world_size
from _dist_scenarios import data, net

class WaitAtStep3(fitkit.callbacks.Callback):  # first job only: the test signals while every rank is here
    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == 3 and not os.path.exists("requeued"):
            open(f"at3-{{rank()}}", "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists("go") and time.monotonic() < deadline:
                time.sleep(0.01)

torch.manual_seed(0)
x, y, w = data(40)
model = fitkit.Model(net(), device="cpu")
model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss="mse", metrics=["mae"])
begun = []
seen = fitkit.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: begun.append(model.global_step))
try:
    model.fit(x, y, sample_weight=w, batch_size=4, epochs=3, shuffle=True, verbose=0,
              callbacks=[fitkit.callbacks.BackupAndRestore("runs/backup"), WaitAtStep3(), seen])
except SystemExit as stop:
    open(f"exit-{{rank()}}", "w").write(str(stop.code))
    raise
params = {{k: v.detach().clone() for k, v in model.module.named_parameters()}}
torch.save({{"first": begun[0], "steps": model.global_step, "world": world_size(),
             "node": int(os.environ["GROUP_RANK"]), "params": params}}, f"done-{{rank()}}.pt")
"""


def write_train(folder: Path) -> None:
    """``folder/train.py``: ``TRAIN`` importing the test helpers from this folder."""
    (folder / "train.py").write_text(TRAIN.format(tests=str(TESTS_DIR)))


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment for a job on the CPU, without any launcher's variables, plus
    ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith(("PET_", "TORCHELASTIC_"))
    }
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "FITKIT_DEVICE": "cpu",
        "FITKIT_SIGNAL_SECONDS": "1e-9",
        "PYTHONPATH": os.pathsep.join([str(TESTS_DIR.parent), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }


def wait_at_step_3(folder: Path, running, output, timeout: float = 150) -> None:
    """Until both ranks wait at step 3; fails with ``output()`` if ``running()`` turns false."""
    deadline = time.monotonic() + timeout
    while not all((folder / f"at3-{r}").exists() for r in (0, 1)):
        assert running() and time.monotonic() < deadline, output()
        time.sleep(0.05)


def assert_stopped_at_step_3(folder: Path, out: str) -> None:
    """Each rank left ``fit`` with status 143, rank 0 said so, and the backup is at step 3."""
    assert [(folder / f"exit-{r}").read_text() for r in (0, 1)] == ["143", "143"], out[-3000:]
    assert "fitkit: SIGTERM received: stopping after optimizer step 3" in out, out[-3000:]
    assert torch.load(folder / "runs" / "backup" / "backup.pt", weights_only=True)["global_step"] == 3
    assert not list(folder.glob("done-*.pt"))


def assert_resumed_like_uninterrupted(folder: Path) -> list[dict]:
    """The rerun began at step 3 on both ranks, took the 12 others, and ends with the weights
    of the uninterrupted run (one process, batch 8 = 2 ranks x 4) to 1e-6; returns the
    ranks' records."""
    r0, r1 = (torch.load(folder / f"done-{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["first"] == r1["first"] == 3 and r0["steps"] == r1["steps"] == 15  # 40 rows / (2 x 4): 5 per epoch
    assert r0["world"] == r1["world"] == 2
    torch.manual_seed(0)
    x, y, w = data(40)
    ref = fitkit.Model(net(), device="cpu")
    ref.compile(optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss="mse", metrics=["mae"])
    ref.fit(x, y, sample_weight=w, batch_size=8, epochs=3, shuffle=True, verbose=0)
    for name, p in ref.module.named_parameters():
        assert torch.equal(r0["params"][name], r1["params"][name]), name
        torch.testing.assert_close(r0["params"][name], p.detach(), rtol=0, atol=1e-6)
    return [r0, r1]
