"""Under torchrun (2 gloo ranks): every built-in loss by name, with each target kind it takes, on
in-memory data and on a DataLoader, runs no collective per step beyond DDP's own gradient
all-reduce (counted with torch's profiler, DDP's C++ collectives included, against a hand-written
DDP loop), and trains exactly as one process with the same global batches. Where only the device
knows a step's loss denominator (ignored targets, tokens, sample weights, a DataLoader's labels)
its sum over the ranks rides in that all-reduce (fitkit.distributed.counted)."""

from __future__ import annotations

import pytest
import torch
from _loss_cases import CASES, SOURCES, run_case
from _torchrun import run_torchrun

JOB = """
import os, torch
os.environ["FITKIT_SIGNAL_SECONDS"] = "1000"  # the signal agreement by steps only: after step 1, then every 8
from _loss_cases import CASES, SOURCES, hand_ddp_per_step, run_case
from fitkit.distributed import rank
res = {(loss, kind, source): run_case(loss, kind, source, count=True) for loss, kind in CASES for source in SOURCES}
res["hand"] = hand_ddp_per_step()
torch.save(res, OUT / f"rank{rank()}.pt")
"""

ALL = [(loss, kind, source) for loss, kind in CASES for source in SOURCES]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives")
    run_torchrun(JOB, out, nproc=2, timeout=180)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", ALL, ids=["-".join(c) for c in ALL])
def test_collectives_per_step_equal_a_hand_ddp_loops(ranks, case):
    for r in ranks:
        hand, ours = r["hand"], r[case]["per_step"]
        assert len(ours) == 5 and hand[2:] == [1, 1, 1]  # 37 rows, global batches of 8; DDP's all-reduce
        # step 2: DDP rebuilds its buckets (broadcasts) in both; fitkit adds the signal agreement
        # after step 1 (fitkit.distributed.agreement), the only collective of its own
        assert ours[0] == hand[0] and ours[1] == hand[1] + 1 and ours[2:] == hand[2:5]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", ALL, ids=["-".join(c) for c in ALL])
def test_two_ranks_train_as_one_process(ranks, case):
    """The same parameters on both ranks and as one process (the last global batch: 4 rows on
    rank 0, 1 on rank 1), and the same epoch loss."""
    r0, r1 = (r[case] for r in ranks)
    one = run_case(*case)
    for k, v in one["params"].items():
        assert torch.equal(r0["params"][k], r1["params"][k])
        torch.testing.assert_close(r0["params"][k], v, rtol=0, atol=1e-6)
    assert r0["loss"] == r1["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert not any(torch.equal(one["init"][k], v) for k, v in one["params"].items())  # it trained
