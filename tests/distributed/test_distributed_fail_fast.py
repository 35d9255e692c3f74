"""Under torchrun: an exception on a rank other than 0 ends the whole job, not after the
process group's timeout (30 minutes on gloo), with that rank's error in torchrun's summary."""

from __future__ import annotations

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
