"""The process group fitkit starts under torchrun: its timeout, and the failing rank's
traceback in torchrun's failure summary."""

from __future__ import annotations

import pytest
from _torchrun import run_torchrun

from fitkit.distributed import check_timeout
from fitkit.distributed.agreement import METRICS, STEP, STOP, mismatch

HANG = """
import time, fitkit
from fitkit.distributed import rank
from _dist_scenarios import data, net

class Hang(fitkit.callbacks.Callback):  # rank 1 stalls, alive, past the other's timeout
    def on_train_batch_end(self, batch, logs=None):
        if rank() == 1 and self.model.global_step == 2:
            (OUT / "hung").write_text(str(time.time()))
            time.sleep(HANG_SECONDS)

x, y, _ = data(40)
model = fitkit.Model(net(), device="cpu", timeout=1)
model.compile(optimizer="sgd", loss="mse")
model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[Hang()])
(OUT / f"finished{rank()}").touch()
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_a_hanging_rank_ends_the_job_with_the_timeout_in_torchruns_summary(tmp_path):
    # Rank 1 sleeps 60 s inside its step: the job still ends soon after rank 0's 1 s timeout,
    # because torchrun's SIGTERM is not held on rank 1 once rank 0 failed (before, rank 1 held it
    # to finish its step, until torchrun's kill 30 s later). The subprocess limit is a hang guard.
    proc = run_torchrun("HANG_SECONDS = 60\n" + HANG, tmp_path, check=False, timeout=45)
    assert proc.returncode != 0
    assert not list(tmp_path.glob("finished*"))
    assert (tmp_path / "hung").exists()
    # rank 1 left by its own SystemExit(143) on torchrun's SIGTERM, not by the SIGKILL (-9) that
    # follows it after 30 s
    failures = proc.stderr[proc.stderr.index("Failures:") : proc.stderr.index("Root Cause")]
    assert "rank      : 1" in failures and "exitcode  : 143" in failures
    summary = proc.stderr[proc.stderr.index("Root Cause (first observed failure)") :]
    assert "rank      : 0" in summary and "error_file: <N/A>" not in summary
    assert "Timed out waiting 1000ms" in summary  # gloo's message, with rank 0's traceback:
    assert "in run_epoch" in summary and "model.fit(x, y" in summary
    # ... and where every rank was: rank 1, behind, named
    assert "fitkit: rank(s) 1 behind rank 0, which was epoch 0, in batch 3: hung or slow there." in summary
    assert "rank 1: epoch 0, after batch 2 (in its callbacks) for" in summary


PHASE_HANG = """
import time, fitkit
import fitkit.training.checkpoint as ck
from fitkit.distributed import rank
from _dist_scenarios import data, net

class Hang(fitkit.callbacks.Callback):  # rank 1 stalls in the epoch's last batch's callbacks
    def on_train_batch_end(self, batch, logs=None):
        if CASE == "last_batch" and rank() == 1 and self.model.global_step == 5:
            time.sleep(60)

plain = ck.atomic_save
def slow_save(*args, **kwargs):  # rank 0 (the one that writes) stalls inside the write
    time.sleep(60)
    return plain(*args, **kwargs)
if CASE == "checkpoint" and rank() == 0:
    ck.atomic_save = slow_save
x, y, _ = data(40)
model = fitkit.Model(net(), device="cpu", timeout=5)  # 1 s: a loaded machine may exceed it in a step
model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
backup = fitkit.callbacks.BackupAndRestore(OUT / "bk", save_freq=2)
model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[Hang(), backup])
"""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "line"),
    [
        # 5 steps an epoch: rank 0 waits in the epoch end's metric sync (was: the same place as rank 1)
        (
            "last_batch",
            "fitkit: rank(s) 1 behind rank 0, which was epoch 0, at its end (its metrics): hung or slow "
            "there. Where each rank was: rank 0: epoch 0, at its end (its metrics) for ",
        ),
        # the backup after step 2: rank 1 goes on to step 3's all-reduce
        (
            "checkpoint",
            "fitkit: rank(s) 0 behind rank 1, which was epoch 0, in batch 3: hung or slow there. Where "
            "each rank was: rank 0: epoch 0, after batch 2 (in its callbacks), writing a checkpoint for ",
        ),
    ],
)
def test_a_hang_names_the_rank_and_its_phase(tmp_path, case, line):
    proc = run_torchrun(f"CASE = {case!r}\n" + PHASE_HANG, tmp_path, check=False, timeout=150)
    assert proc.returncode != 0
    assert line in proc.stderr


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
    fix = r"task 1 of 2 that srun started without torchrun.*Fix: .*srun --ntasks-per-node=1 torchrun"
    with pytest.raises(RuntimeError, match=fix):
        fitkit.Model(torch.nn.Linear(2, 1), device="cpu")


@pytest.mark.parametrize(
    ("env", "tasks"),
    [
        ({"SLURM_STEP_NUM_TASKS": "4"}, 4),  # srun
        ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}, 4),  # a step that sets the job's names only
        ({"SLURM_STEPID": "3", "SLURM_NPROCS": "4"}, 4),  # older srun: the old names
        ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "", "SLURM_NPROCS": "3"}, 3),  # the first one set counts
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "8"}, 2),  # the step's own count first
        ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "8"}, 1),  # srun -n 1 in a job of 8 tasks
        ({"SLURM_NTASKS": "4", "SLURM_NPROCS": "4"}, 1),  # the batch script itself: no step variable
        ({"SLURM_STEP_ID": "0"}, 1),  # a step with no count: one task
        ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "many"}, 1),  # not a number: not ours to judge
    ],
)
def test_srun_detection_reads_every_variable_slurm_sets_for_a_step(env, tasks):
    from fitkit.distributed.group import check_not_bare_srun

    env = {"SLURM_PROCID": "1", **env}
    if tasks == 1:
        assert check_not_bare_srun(env) is None
        return
    with pytest.raises(RuntimeError, match=rf"task 1 of {tasks} that srun started without torchrun.*Fix: "):
        check_not_bare_srun(env)


def test_where_ranks_were_names_the_ranks_behind(monkeypatch):
    """The failing rank's line from the store's places (a fake store of 3 ranks): rank 2 has
    not begun the batch rank 0 waits in; rank 1 has."""
    import json as _json

    from fitkit.distributed import progress

    class Store:
        def __init__(self, data):
            self.data = data

        def check(self, keys):
            return all(k in self.data for k in keys)

        def get(self, key):
            return self.data[key].encode()

    now = 1000.0
    store = Store(
        {
            f"fitkit/progress/{r}": _json.dumps({"place": place, "since": now - age})
            for r, place, age in ((0, [1, 4, 4], 2.0), (1, [1, 4, 5], 2.5), (2, [1, 3, 4], 9.0))
        }
    )
    monkeypatch.setattr(progress, "_store", lambda: store)
    monkeypatch.setattr(progress.time, "time", lambda: now)
    monkeypatch.setattr(progress.dist, "get_world_size", lambda: 3)
    assert progress.where_ranks_were(me=0) == (
        "fitkit: rank(s) 2 behind rank 0, which was epoch 1, in batch 5: hung or slow there. Where each rank "
        "was: rank 0: epoch 1, in batch 5 for 2.0 s; rank 1: epoch 1, after batch 5 (in its callbacks) for "
        "2.5 s; rank 2: epoch 1, after batch 4 (in its callbacks) for 9.0 s."
    )
    assert not progress.peer_failed()
    progress.mark_failed("rank 0: RuntimeError")  # the fake store has no set: nothing is raised
    store.data["fitkit/failed"] = "rank 0: RuntimeError"
    assert progress.peer_failed()


class _FakeStore:
    def __init__(self, data):
        self.data = data

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key].encode()


def _where(monkeypatch, places, failed=None, me=0):
    """progress.where_ranks_were(me) over a fake store of ``places`` (each 5.0 s old)."""
    import json as _json

    from fitkit.distributed import progress

    data = {f"fitkit/progress/{r}": _json.dumps({"place": p, "since": 995.0}) for r, p in enumerate(places)}
    if failed is not None:
        data["fitkit/failed"] = _json.dumps(failed)
    monkeypatch.setattr(progress, "_store", lambda: _FakeStore(data))
    monkeypatch.setattr(progress.time, "time", lambda: 1000.0)
    monkeypatch.setattr(progress.dist, "get_world_size", lambda: len(places))
    return progress.where_ranks_were(me=me)


@pytest.mark.parametrize(
    ("hung", "waiting", "said"),
    [
        # the last batch's callbacks, while rank 0 syncs the epoch's metrics (was: the same place)
        ([0, 5, 6, 0, None], [0, 5, 6, 2, None], "epoch 0, after batch 6 (in its callbacks)"),
        ([0, 5, 6, 2, None], [0, 5, 6, 3, None], "epoch 0, at its end (its metrics)"),  # the epoch end
        ([0, 5, 6, 3, None], [0, 5, 6, 4, None], "epoch 0, in its validation"),  # validation
        (
            [0, 2, 3, 0, "writing a checkpoint"],
            [0, 3, 3, 0, None],  # a checkpoint write in a batch's callbacks
            "epoch 0, after batch 3 (in its callbacks), writing a checkpoint",
        ),
        (
            [1, 5, 6, 4, "writing a checkpoint"],
            [2, -1, 0, 0, None],
            "epoch 1, in its epoch-end callbacks, writing a checkpoint",
        ),
    ],
)
def test_a_hang_is_named_with_its_rank_and_phase(monkeypatch, hung, waiting, said):
    line = _where(monkeypatch, [waiting, hung])
    assert line.startswith(f"fitkit: rank(s) 1 behind rank 0, which was {_describe(waiting)}: hung or slow there. ")
    assert f"rank 1: {said} for 5.0 s." in line


def _describe(place):
    from fitkit.distributed import progress

    return progress._describe(place)


def test_after_an_exception_the_survivors_name_the_failed_rank_as_failed(monkeypatch):
    # rank 1 raised in batch 3; rank 0, whose collective then broke, was in batch 4's step
    line = _where(
        monkeypatch,
        [[0, 3, 3, 0, None], [0, 2, 2, 0, None], [0, 1, 2, 0, None]],
        failed={"rank": 1, "error": "RuntimeError"},
    )
    assert line == (
        "fitkit: rank 1 failed (RuntimeError) at epoch 0, in batch 3; rank 0 stopped because of it. rank(s) 2 "
        "behind rank 0, which was epoch 0, in batch 4: hung or slow there. Where each rank was: rank 0: epoch 0, "
        "in batch 4 for 5.0 s; rank 1: epoch 0, in batch 3 for 5.0 s; rank 2: epoch 0, after batch 2 (in its "
        "callbacks) for 5.0 s."
    )
    # the failed rank's own line (written before its mark) is unchanged
    assert "failed" not in _where(monkeypatch, [[0, 3, 3, 0, None], [0, 2, 2, 0, None]], me=1)


def test_timeout_is_refused_for_a_process_group_fitkit_did_not_start():
    """Ray Train's TorchTrainer (or the script) starts the group with its own timeout: fitkit
    cannot change it, so Model(timeout=) says where to set it instead of being ignored."""
    import torch
    import torch.distributed as dist

    import fitkit

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"started before fitkit .*TorchConfig\(timeout_s=5\)"):
            fitkit.Model(torch.nn.Linear(1, 1), device="cpu", timeout=5)
        assert fitkit.Model(torch.nn.Linear(1, 1), device="cpu").device.type == "cpu"  # without: the group's own
    finally:
        dist.destroy_process_group()


def test_a_mismatch_names_every_rank_by_place_grouping_ranks_at_the_same_one():
    places = [[METRICS, 1, 12, 2], [METRICS, 1, 12, 2], [STOP, 1, 12, 0], [STEP, 1, 13, 0], [METRICS, 1, 12, 0]]
    text = mismatch(places)
    assert text.startswith("fitkit: the ranks reached different collectives, where each would wait for the others")
    received = text[text.index("Received: ") : text.index(" Rank(s) ")]
    assert received == (
        "Received: ranks 0, 1: epoch 1, the metric sync at the epoch's end (2 metrics), after 12 batches; "
        "rank 2: epoch 1, the stop agreement at the epoch's end (after its callbacks), after 12 batches; "
        "rank 3: epoch 1, the signal agreement after an optimizer step, after 13 batches; "
        "rank 4: epoch 1, the metric sync at the epoch's end (0 metrics), after 12 batches."
    )
    assert "Rank(s) 2, 3, 4 differ from rank 0; every rank raises this error. Fix: run the same collectives" in text
