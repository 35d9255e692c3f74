"""Under torchrun (2 gloo ranks): every built-in loss by name, with each target kind it takes, on
in-memory data and on a DataLoader, runs no collective per step beyond DDP's own gradient
all-reduce (counted with torch's profiler, DDP's C++ collectives included, against a hand-written
DDP loop), and trains exactly as one process with the same global batches. Where only the device
knows a step's loss denominator (ignored targets, tokens, sample weights, a DataLoader's labels)
its sum over the ranks rides in that all-reduce (fitkit.distributed.counted). The same under
FSDP2, in the same launch: the denominator rides in the units' reduce-scatters, and each step's
collectives, by name, are a hand-written FSDP2 loop's (with accumulation and bf16 compute too)."""

from __future__ import annotations

import collections

import pytest
import torch
from _loss_cases import CASES, FSDP_CASES, SOURCES, run_case
from _torchrun import run_torchrun

JOB = """
import os, torch
os.environ["FITKIT_SIGNAL_SECONDS"] = "1000"  # the signal agreement by steps only: after step 1, then every 8
from _loss_cases import CASES, FSDP_CASES, SOURCES, hand_ddp_per_step, hand_fsdp_per_step, run_case
from fitkit.distributed import rank
res = {(loss, kind, source): run_case(loss, kind, source, count=True) for loss, kind in CASES for source in SOURCES}
res["hand"] = hand_ddp_per_step()
for name, (loss, kind, source, options) in FSDP_CASES.items():
    res["fsdp", name] = run_case(loss, kind, source, count=True, fsdp=options)
res["hand_fsdp"] = {"plain": hand_fsdp_per_step(), "accumulate": hand_fsdp_per_step(accumulate=2),
                    "bf16": hand_fsdp_per_step(bf16=True)}
torch.save(res, OUT / f"rank{rank()}.pt")
"""

ALL = [(loss, kind, source) for loss, kind in CASES for source in SOURCES]
AGREEMENT = collections.Counter({"allreduce_": 1})  # fitkit's signal agreement after the first optimizer step


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


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(FSDP_CASES))
def test_fsdp_steps_run_a_hand_fsdp_loops_collectives(ranks, name):
    """Ignored targets, class weights, sample weights and a DataLoader's labels (the denominator
    known on the device only) and a plain MSE: every step's collectives, by name, are a hand
    FSDP2 loop's (3 all-gathers: the root's own layer stays gathered between forward and
    backward, and 2 reduce-scatters, one per unit; bf16: both layers are units, 4 all-gathers).
    No all-reduce of the denominator: without the units' counted reduce-scatter it would add
    an ``allreduce_`` to every step (to the first micro-batch of every window)."""
    options = FSDP_CASES[name][3]
    kind = "bf16" if options.get("bf16") else "accumulate" if options.get("accumulate") else "plain"
    for r in ranks:
        hand, ours = r["hand_fsdp"][kind], r["fsdp", name]["names"]
        gathers = 4 if kind == "bf16" else 3
        if kind == "accumulate":  # 5 micro-batches, 3 steps (the last window has one)
            assert hand[:4] == [{"_allgather_base_": 3}, {"_allgather_base_": 3, "_reduce_scatter_base_": 2}] * 2
            assert ours[1] == hand[1] and ours[2] == hand[2] + AGREEMENT and ours[3] == hand[3]
            assert ours[4] == hand[1]  # a window of one micro-batch: its gradients reduced at once
        else:
            assert hand == [{"_allgather_base_": gathers, "_reduce_scatter_base_": 2}] * 5
            assert ours[1] == hand[1] + AGREEMENT and ours[2:] == hand[2:5]
        # the first step: other all-gathers (fitkit's first-batch check, a forward without
        # gradients, runs before it on tensors, inside it on a DataLoader, and leaves the root's
        # own layer gathered), the same reduce-scatters, no all-reduce
        assert "allreduce_" not in ours[0] and ours[0]["_reduce_scatter_base_"] == (0 if kind == "accumulate" else 2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(FSDP_CASES))
def test_fsdp_trains_as_one_process(ranks, name):
    """The same full parameters on both ranks and as one process (atol 1e-6; bf16 compute:
    within 1e-3 of one process in float32), and the same epoch loss."""
    r0, r1 = (r["fsdp", name] for r in ranks)
    one = run_case(*FSDP_CASES[name][:3], fsdp=FSDP_CASES[name][3])
    tol = 1e-3 if FSDP_CASES[name][3].get("bf16") else 1e-6
    for k, v in one["params"].items():
        assert torch.equal(r0["params"][k], r1["params"][k])
        torch.testing.assert_close(r0["params"][k], v, rtol=0, atol=tol)
    assert r0["loss"] == r1["loss"] == pytest.approx(one["loss"], abs=tol)
    assert not any(torch.equal(one["init"][k], v) for k, v in one["params"].items())  # it trained
