"""Under torchrun: a relaunch from any backup point resumes on every rank and ends as the
uninterrupted run, bitwise on the same world size (one launch for every boundary kind; see
``tests/_relaunch.py``), and within float tolerance on another (2 -> 1)."""

from __future__ import annotations

import pytest
import torch
from _relaunch import CASES, CROSS_SIZE, EPOCHS, ROWS, fit
from _torchrun import run_torchrun

from fitkit.callbacks import BackupAndRestore

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = EPOCHS * ROWS // 8  # 6 steps an epoch
#: where each case stops: the optimizer steps done (and the first step of its relaunch)
STOPPED_AT = {
    "ddp_mid_epoch": 3,
    "ddp_after_last_step": 6,
    "ddp_epoch_end": 6,
    "ddp_validation_term": 6,
    "ddp_term_last_step": 6,
    "fsdp_term_mid_epoch": 3,
    "fsdp_after_last_step": 6,
    "fsdp_term_last_step": 6,
}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("relaunch")
    run_torchrun(
        """
import torch, _relaunch
from fitkit.distributed import rank
torch.save(_relaunch.run_all(OUT), OUT / f"rank{rank()}.pt")
torch.distributed.barrier()
""",
        out,
        timeout=400,
    )
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("case", list(CASES))
def test_a_relaunch_from_every_boundary_kind_equals_the_uninterrupted_run_bitwise(launch, case):
    _, ranks = launch
    strategy = CASES[case][0]
    for res in ranks:
        ref, got = res[f"reference_{strategy}"], res[case]
        assert got["stopped_at"] == STOPPED_AT[case]
        assert got["begun"] == list(range(STOPPED_AT[case], STEPS))  # resumed there: nothing redone, nothing skipped
        assert got["history"] == ref["history"]  # every epoch's loss, mae, val_loss, val_mae, bitwise
        assert got["params"].keys() == ref["params"].keys()
        for name, p in ref["params"].items():
            assert torch.equal(got["params"][name], p), (case, name)


def test_a_backup_from_2_ranks_after_an_epochs_last_step_resumes_on_1(launch):
    out, ranks = launch
    ref = ranks[0][f"reference_{CASES[CROSS_SIZE][0]}"]
    model, begun, history = fit("auto", [BackupAndRestore(out / "cross_size")])
    assert begun == list(range(STOPPED_AT[CROSS_SIZE], STEPS))
    # epoch 1's training totals come from the backup alone (summed over both ranks): exact
    assert history["loss"][0] == ref["history"]["loss"][0] and history["mae"][0] == ref["history"]["mae"][0]
    for key, values in ref["history"].items():
        assert history[key] == pytest.approx(values, rel=1e-6), key
    for name, p in model.module.named_parameters():
        torch.testing.assert_close(p.detach(), ref["params"][name], rtol=0, atol=1e-6)
