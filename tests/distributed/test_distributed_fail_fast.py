"""Under torchrun: an exception on a rank other than 0 ends the whole job, not after the
process group's timeout (30 minutes on gloo), with that rank's error in torchrun's summary."""

from __future__ import annotations

import json

import pytest
from _torchrun import run_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_an_exception_on_rank_1_ends_the_job_with_its_error(tmp_path):
    # The subprocess timeout is a hang guard, not a timing assertion: before the fix rank 1 waited
    # in the exit barrier while rank 0 waited in DDP's all-reduce, for the group's 30 minutes.
    proc = run_torchrun(
        """
import torch, fitkit
from fitkit.distributed import rank
from _dist_scenarios import data, net
x, y, w = data(64)
model = fitkit.Model(net(), device="cpu")
model.compile(optimizer="sgd", loss="mse")
class Boom(fitkit.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if rank() == 1 and self.model.global_step == 2:
            raise RuntimeError("rank 1 failed at step 2 on purpose")
model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[Boom()])
""",
        tmp_path,
        check=False,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "rank 1 failed at step 2 on purpose" in proc.stderr
    # a survivor whose collective broke names rank 1 as failed, not as hung or slow
    assert "hung or slow" not in proc.stderr
    survivor = [ln for ln in proc.stderr.splitlines() if "fitkit: rank 1 failed (RuntimeError) at epoch 0, " in ln]
    assert survivor and all("rank 0 stopped because of it." in ln for ln in survivor)


MISMATCHES = {
    # rank 1 clears its metric states in the epoch's last batch (as a rank that restored none):
    # both enter the metric sync, rank 1 with nothing to sync
    "no_metrics": (
        "epoch 0, the metric sync at the epoch's end (1 metric)",
        "epoch 0, the metric sync at the epoch's end (0 metrics)",
    ),
    # rank 1 enters the epoch-end stop agreement from its last batch's hook while rank 0 enters
    # the metric sync (the relaunch: ranks at different collectives)
    "early_stop_agreement": (
        "epoch 0, the metric sync at the epoch's end (1 metric)",
        "epoch 0, the stop agreement at the epoch's end (after its callbacks)",
    ),
    # rank 1 runs a signal agreement of its own after the epoch's last step
    "extra_signal_agreement": (
        "epoch 0, the metric sync at the epoch's end (1 metric)",
        "epoch 0, the signal agreement after an optimizer step",
    ),
}


def test_ranks_at_different_collectives_raise_a_named_error_at_once_on_every_rank(tmp_path):
    """Each forced mismatch in turn (the error caught, the group still usable), then one left
    uncaught: the job ends with it. The process group's timeout is 600 s; the subprocess
    timeout is a hang guard only."""
    proc = run_torchrun(
        f"""
import json, os, torch, fitkit
os.environ["FITKIT_SIGNAL_SECONDS"] = "1000"  # signal agreements after steps 1, 9, 17, ...: none at step 4
from fitkit.distributed import rank
from _dist_scenarios import data, net
from _loss_cases import CollectivesPerStep
x, y, w = data(32)
# first a run that stays in step: its collectives per step, by name (4 steps an epoch)
model = fitkit.Model(net(), device="cpu", timeout=600)
model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
counter = CollectivesPerStep()
model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[counter])
json.dump([dict(n) for n in counter.names], open(OUT / f"counted{{rank()}}.json", "w"))
class Astray(fitkit.callbacks.Callback):  # rank 1 leaves the agreed sequence in epoch 0's last batch
    def __init__(self, case):
        super().__init__()
        self.case = case
    def on_train_batch_end(self, batch, logs=None):
        if rank() != 1 or self.model.global_step != 4:
            return
        loop = self.model._core.fit
        if self.case == "no_metrics":
            loop.totals.metrics.reset()
        elif self.case == "early_stop_agreement":
            loop.stop.agreement.at_epoch_end(False)
        else:
            loop.stop.agreement._schedule.interval = 1  # due at once
            loop.stop.agreement.at_step_boundary()
for case in {list(MISMATCHES)!r} + ["uncaught"]:
    model = fitkit.Model(net(), device="cpu", timeout=600)
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    try:
        # a checkpoint on the exception would run collectives that the ranks do not reach alike
        saves = fitkit.callbacks.ModelCheckpoint(str(OUT / case / "e{{epoch}}.pt"), save_on_exception=True)
        astray = Astray(case.replace("uncaught", "no_metrics"))
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[astray, saves])
        error = None
    except RuntimeError as e:
        error = str(e)
    json.dump({{"error": error, "step": model.global_step}}, open(OUT / f"{{case}}{{rank()}}.json", "w"))
    if case == "uncaught" and error is not None:
        raise RuntimeError(error)
""",
        tmp_path,
        check=False,
        timeout=240,
    )
    assert proc.returncode != 0  # the job ended with the error
    # all-reduces from one batch's end to the next: DDP's gradients (1 per step); the signal
    # agreement after step 1 (+1, as before its header); epoch 0's end before step 5: the metric
    # sync's header (the one collective this check adds), the loss totals and the stop agreement
    # (its header in the same all-reduce as before)
    for r in (0, 1):
        counted = json.loads((tmp_path / f"counted{r}.json").read_text())
        assert [c.get("allreduce_", 0) for c in counted] == [1, 2, 1, 1, 4, 1, 1, 1], r
    for case, (at0, at1) in [*MISMATCHES.items(), ("uncaught", MISMATCHES["no_metrics"])]:
        r0, r1 = (json.loads((tmp_path / f"{case}{r}.json").read_text()) for r in (0, 1))
        assert r0["error"] == r1["error"], case  # every rank raises the same error
        assert r0["step"] == r1["step"] == 4, case  # at epoch 0's end: nothing after it ran
        assert not (tmp_path / case / "on_exception.pt").exists(), case  # nor a save on the exception
        assert "fitkit: the ranks reached different collectives" in r0["error"], case
        assert "Expected every rank at the same one. Received: rank 0: " in r0["error"], case
        assert "Rank(s) 1 differ from rank 0; every rank raises this error. Fix: " in r0["error"], case
        assert f"rank 0: {at0}, after 4 batches; rank 1: {at1}, after 4 batches." in r0["error"], case
    assert "Rank(s) 1 differ from rank 0;" in proc.stderr  # the uncaught one, in the job's output
