"""Under torchrun: a mid-epoch backup holds every rank's samples and totals (so it resumes
exactly at another world size), a SIGTERM to one rank stops every rank at one step (agreed by
steps and by time), and a job restarted by torchrun resumes from its latest backup."""

from __future__ import annotations

import json

import pytest
import torch
from _dist_scenarios import data, net
from _torchrun import run_torchrun

import fitkit

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SETUP = """
import json, os, signal, torch, fitkit
from fitkit.distributed import rank
from _dist_scenarios import data, net
torch.manual_seed(0)
x, y, w = data(40)
model = fitkit.Model(net(), device="cpu")
model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss="mse", metrics=["mae"])
"""


def _one_process(callbacks=()):
    torch.manual_seed(0)
    x, y, w = data(40)
    model = fitkit.Model(net(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss="mse", metrics=["mae"])
    h = model.fit(x, y, sample_weight=w, batch_size=8, epochs=3, shuffle=True, verbose=0, callbacks=list(callbacks))
    return model, h


def test_a_mid_epoch_backup_from_2_ranks_resumes_exactly_on_1(tmp_path):
    run_torchrun(
        SETUP
        + """
class Stop(fitkit.callbacks.Callback):  # ends the run as a crash would, after the last backup
    def on_train_batch_end(self, batch, logs=None):
        if self.model.epoch == 1 and batch == 3:
            self.model.stop_training = True
model.fit(x, y, sample_weight=w, batch_size=4, epochs=3, shuffle=True, verbose=0,
          callbacks=[fitkit.callbacks.BackupAndRestore(OUT / "bk", save_freq=2, delete_checkpoint=False), Stop()])
""",
        tmp_path,
    )
    state = torch.load(tmp_path / "bk" / "backup.pt", weights_only=True)
    assert (state["epoch"], state["step_in_epoch"], state["samples_in_epoch"]) == (1, 3, 24)  # 3 global batches of 8
    ref, ref_h = _one_process()
    resumed, h = _one_process([fitkit.callbacks.BackupAndRestore(tmp_path / "bk")])
    assert h.history["loss"] == pytest.approx(ref_h.history["loss"], rel=1e-6)
    assert h.history["mae"] == pytest.approx(ref_h.history["mae"], rel=1e-6)
    for a, b in zip(resumed.module.parameters(), ref.module.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_sigterm_to_one_rank_or_twice_to_every_rank_stops_both_at_one_step_with_one_backup(tmp_path):
    run_torchrun(
        SETUP
        + """
class Term(fitkit.callbacks.Callback):
    def __init__(self, every_rank):
        super().__init__()
        self.every_rank = every_rank
    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == 3 and (rank() == 0 or self.every_rank):
            os.kill(os.getpid(), signal.SIGTERM)
            if self.every_rank:  # as SLURM signals every process and torchrun forwards its own copy
                os.kill(os.getpid(), signal.SIGTERM)
# By steps (a time budget no run reaches), then by time (a budget every step exceeds), then a
# SIGTERM twice to every rank (by time).
for name, seconds in (("steps", "1000"), ("time", "1e-9"), ("all", "1e-9")):
    os.environ["FITKIT_SIGNAL_SECONDS"] = seconds
    torch.manual_seed(0)
    model = fitkit.Model(net(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss="mse", metrics=["mae"])
    code = None
    try:
        model.fit(x, y, batch_size=2, epochs=5, verbose=0,
                  callbacks=[fitkit.callbacks.BackupAndRestore(OUT / name, save_freq=1, delete_checkpoint=False),
                             Term(name == "all")])
    except SystemExit as e:
        code = e.code
    json.dump({"code": code, "step": model.global_step}, open(OUT / f"{name}{rank()}.json", "w"))
# The relaunch of the all-process stop: it resumes after step 3 and redoes none.
stopped_at = torch.load(OUT / "all" / "backup.pt", weights_only=True)["global_step"]  # on disk at every rank's exit
torch.distributed.barrier()  # both ranks read the backup before the relaunch deletes it at its end
torch.manual_seed(0)
model = fitkit.Model(net(), device="cpu")
model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss="mse", metrics=["mae"])
begun = []
seen = fitkit.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: begun.append(model.global_step))
model.fit(x, y, batch_size=2, epochs=5, verbose=0, callbacks=[fitkit.callbacks.BackupAndRestore(OUT / "all"), seen])
out = {"backup": stopped_at, "first": begun[0], "steps": model.global_step}
json.dump(out, open(OUT / f"relaunch{rank()}.json", "w"))
torch.distributed.barrier()
""",
        tmp_path,
        check=False,
    )
    for name, step in (("steps", 9), ("time", 3), ("all", 3)):
        # steps: agreements after step 1, then every 8 steps (1, 9, ...); time: after every step
        r0, r1 = (json.loads((tmp_path / f"{name}{r}.json").read_text()) for r in (0, 1))
        assert r0 == r1 == {"code": 143, "step": step}, name
        if name != "all":  # (its relaunch deleted it at its end: read there)
            assert torch.load(tmp_path / name / "backup.pt", weights_only=True)["global_step"] == step
    r0, r1 = (json.loads((tmp_path / f"relaunch{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 == {"backup": 3, "first": 3, "steps": 50}  # 40 rows / (2 x 2) = 10 steps per epoch


def test_a_restarted_job_resumes_from_the_latest_backup(tmp_path):
    """torchrun --max-restarts=1 (static rendezvous: --master_addr / --master_port): rank 1 is
    SIGKILLed at step 7 of the first attempt; the second attempt resumes from the sharded
    backup of step 6 and ends with the weights of an uninterrupted run."""
    run_torchrun(
        SETUP.replace('device="cpu")', 'device="cpu", strategy="fsdp")')
        + """
from _dist_scenarios import full_params
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
class Kill(fitkit.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if attempt == 0 and rank() == 1 and self.model.global_step == 7:
            os.kill(os.getpid(), signal.SIGKILL)
model.fit(x, y, sample_weight=w, batch_size=4, epochs=3, shuffle=True, verbose=0,
          callbacks=[fitkit.callbacks.BackupAndRestore(OUT / "bk", save_freq=2), Kill()])
torch.save({"attempt": attempt, "params": full_params(model), "step": model.global_step}, OUT / f"r{rank()}.pt")
""",
        tmp_path,
        args=("--max-restarts=1",),
        timeout=180,
    )
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["attempt"] == r1["attempt"] == 1 and r0["step"] == r1["step"] == 15
    ref, _ = _one_process()
    for name, p in ref.module.named_parameters():
        assert torch.equal(r0["params"][name], r1["params"][name]), name
        torch.testing.assert_close(r0["params"][name], p.detach(), rtol=0, atol=1e-6)


def test_a_sigterm_while_a_rank_waits_for_a_slow_peer_ends_every_process_with_a_named_line(tmp_path):
    """Rank 1 sleeps in a batch's hook; rank 0 waits for it in a collective, where no signal
    handler runs. A SIGTERM to every process (torchrun's agent included) ends both ranks once
    FITKIT_SIGNAL_GRACE (3 s here) has passed, each with its line, and no stop backup: the last
    backup stays. The process group's timeout is 600 s and torchrun's kill comes 30 s after its
    SIGTERM; the subprocess timeout is a hang guard only."""
    proc = run_torchrun(
        """
import os, signal, threading, time, torch, fitkit
os.environ["FITKIT_SIGNAL_GRACE"] = "3"
from fitkit.distributed import rank
from _dist_scenarios import data, net
(OUT / f"pid{rank()}").write_text(str(os.getpid()))
x, y, w = data(64)
class Slow(fitkit.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if rank() == 1 and self.model.global_step == 2:
            pids = [os.getppid(), int((OUT / "pid0").read_text()), os.getpid()]  # torchrun's agent, both ranks
            threading.Timer(1.0, lambda: [os.kill(p, signal.SIGTERM) for p in pids]).start()
            time.sleep(300)
model = fitkit.Model(net(), device="cpu", timeout=600)
model.compile(optimizer="sgd", loss="mse")
backup = fitkit.callbacks.BackupAndRestore(OUT / "backup", save_freq=1)
model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[Slow(), backup])
(OUT / f"finished{rank()}").write_text("")
""",
        tmp_path,
        check=False,
        timeout=200,
    )
    assert proc.returncode != 0
    assert not list(tmp_path.glob("finished*"))
    for r in (0, 1):
        line = (
            f"fitkit: SIGTERM received 3 s ago, but rank {r} could not reach a step where the ranks agree to stop: "
            "it waits for another rank (in a collective) or runs a long step or callback. Exiting with status 143 "
            "without a stop backup (FITKIT_SIGNAL_GRACE=3)"
        )
        assert line in proc.stderr, r
    # each line names where every rank was: rank 0 in step 2's backup (a collective of the
    # running totals), rank 1 in the hook before it
    where = "fitkit: Where each rank was: rank 0: epoch 0, after batch 2 (in its callbacks), writing a checkpoint for "
    assert proc.stderr.count(where) == 2
    assert proc.stderr.count("; rank 1: epoch 0, after batch 2 (in its callbacks) for ") == 2
    # step 2's backup never completed: step 1's is the newest there is (the resume point)
    kept = [p for p in (tmp_path / "backup").glob("backup*.pt")]
    assert kept and max(torch.load(p, weights_only=True)["global_step"] for p in kept) == 1
