"""Under torchrun: iterables split by rank x DataLoader worker (each sample once per epoch),
uneven per-rank lengths ending every rank's epoch together, and the collectives each training
step runs beyond DDP's own (none for fitkit's own shards)."""

from __future__ import annotations

import shutil

import pytest
import torch
from _dist_scenarios import OPTIMIZERS, IdRecorder, ce_case, data, net, resume_case
from _torchrun import run_torchrun

import fitkit
from fitkit.distributed import RankWorkerSplit, split_by_rank_and_worker

JOB = """
import os, warnings, torch, fitkit
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from fitkit.distributed import already_sharded, split_by_rank_and_worker, rank
from _dist_scenarios import data, net, OPTIMIZERS

class Ids(IterableDataset):  # sample i has x = (i, 0, 0)
    def __iter__(self):
        for i in range(40):
            yield torch.tensor([float(i), 0.0, 0.0]), torch.zeros(1)

class Recorder(torch.nn.Module):  # the ids of every training forward, per epoch
    def __init__(self):
        super().__init__()
        self.lin, self.seen = torch.nn.Linear(3, 1), []
    def forward(self, x):
        if self.training:
            self.seen[-1] += x[:, 0].long().tolist()
        return self.lin(x)

def model_of(module):
    torch.manual_seed(0)
    m = fitkit.Model(module, device="cpu")
    m.compile(optimizer=OPTIMIZERS["sgd"], loss="mse")
    return m

res = {}
rec = Recorder()
m = model_of(rec)
loader = DataLoader(split_by_rank_and_worker(Ids()), batch_size=5, num_workers=2)
m.fit(already_sharded(loader), epochs=2, verbose=0,
      callbacks=[fitkit.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: rec.seen.append([]))])
res["worker_ids"], res["worker_steps"] = rec.seen, m.global_step

class RankOnly(IterableDataset):  # split by rank, not by worker: each worker yields the rank's half
    def __iter__(self):
        for i in range(rank(), 40, 2):
            yield torch.tensor([float(i), 0.0, 0.0]), torch.zeros(1)

class Ids50(IterableDataset):  # 50 items: shards of 13, 13, 12, 12 over 2 ranks x 2 workers
    def __iter__(self):
        for i in range(50):
            yield torch.tensor([float(i), 0.0, 0.0]), torch.zeros(1)

for name, ds in (("rank_only", RankOnly()), ("helper_uneven", split_by_rank_and_worker(Ids50()))):
    rec = Recorder()
    begin = fitkit.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: rec.seen.append([]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model_of(rec).fit(already_sharded(DataLoader(ds, batch_size=4, num_workers=2)), epochs=4, verbose=0,
                          callbacks=[begin])
    res[name] = [str(w.message) for w in caught if issubclass(w.category, fitkit.checks.FitkitWarning)]
    res[name + "_ids"] = rec.seen

x, y, _ = data(40)
def uneven(kind):
    n = 10 if rank() == 0 else 9  # batches of 2 rows on this rank
    batches = [(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]) for i in range(n)]
    class NoLen:  # re-iterable, without a length
        def __iter__(self):
            return iter(batches)
    m = model_of(net())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = m.fit(already_sharded(batches if kind == "sized" else NoLen()), epochs=2, verbose=0)
    params = [p.detach().clone() for p in m.module.parameters()]
    return {"steps": m.global_step, "loss": h.history["loss"], "params": params,
            "warnings": [str(w.message) for w in caught if "Uneven" in str(w.message)]}
res["sized"], res["unsized"] = uneven("sized"), uneven("unsized")

# Collectives run by Python code (fitkit's; DDP's gradient all-reduce runs in C++), per step.
calls = []
for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object", "barrier", "broadcast_object_list"):
    def counted(*a, _f=getattr(dist, name), _n=name, **k):
        calls.append(_n)
        return _f(*a, **k)
    setattr(dist, name, counted)
def per_step(fit_kwargs, callbacks=()):
    marks = []
    cb = fitkit.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: marks.append(len(calls)))
    m = model_of(net())
    m.fit(**fit_kwargs, epochs=1, verbose=0, callbacks=[cb, *callbacks])
    return [b - a for a, b in zip(marks, marks[1:])]
os.environ["FITKIT_SIGNAL_SECONDS"] = "1000"  # the signal agreement by steps only: after steps 1, 9, ...
x, y, w = data(37)
res["count_tensors"] = per_step({"x": x, "y": y, "batch_size": 4})
res["count_loader"] = per_step({"x": DataLoader(TensorDataset(x, y), batch_size=4)})
res["count_weighted"] = per_step({"x": x, "y": y, "sample_weight": w, "batch_size": 4})
# Cross-entropy: class indices (none ignored), probabilities, and one index ignored (-100).
from _dist_scenarios import ce_case
for kind in ("index", "probabilities", "ignored"):
    marks = []
    cb = fitkit.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: marks.append(len(calls)))
    res[f"ce_{kind}"] = ce_case(kind, callbacks=[cb])
    res[f"count_ce_{kind}"] = [b - a for a, b in zip(marks, marks[1:])]

# A mid-epoch backup of one process (batch 8, 24 samples of epoch 1 done) resumed on 2 ranks.
os.environ.pop("FITKIT_SIGNAL_SECONDS")
from _dist_scenarios import IdRecorder
for per_rank in (4, 5):  # global batches of 8 (as the backup's) and of 10
    torch.manual_seed(0)
    x, y, _ = data(37)
    rec = IdRecorder(net())
    m = fitkit.Model(rec, device="cpu")
    m.compile(optimizer=OPTIMIZERS["adam"], loss="mse")
    m.fit(x, y, batch_size=per_rank, epochs=3, shuffle=True, verbose=0,
          callbacks=[fitkit.callbacks.BackupAndRestore(OUT / f"bk{per_rank}", delete_checkpoint=False), rec.epochs()])
    res[f"resume_{per_rank}"] = {"ids": rec.seen, "params": [p.detach().clone() for p in rec.net.parameters()]}

# The resume matrix's 2-rank part: backups of a crash at step 7 (after the step-6 backup), and 1 -> 2.
from _dist_scenarios import resume_case
for kind in ("tensors", "loader"):
    res[f"crash_{kind}"] = resume_case(kind, OUT / f"bk2_{kind}", crash=True)
res["1to2_loader"] = resume_case("loader", OUT / "bk1_loader")
# steps_per_epoch: a crash inside a pass carried over from epoch 0, resumed on the same 2 ranks.
for kind in ("tensors", "loader"):
    resume_case(kind, OUT / f"spe_{kind}", crash=True, steps_per_epoch=2)
    res[f"spe_{kind}"] = resume_case(kind, OUT / f"spe_{kind}", steps_per_epoch=2)
torch.save(res, OUT / f"rank{rank()}.pt")
"""

# 4 ranks: backups of the same crash, and 2 -> 4 (from copies of the 2-rank backups).
FOUR = """
import torch
from _dist_scenarios import resume_case
from fitkit.distributed import rank
res = {}
for kind in ("tensors", "loader"):
    res[f"crash_{kind}"] = resume_case(kind, OUT / f"bk4_{kind}", crash=True)
    res[f"2to4_{kind}"] = resume_case(kind, OUT / f"bk2to4_{kind}")
torch.save(res, OUT / f"four{rank()}.pt")
"""

# 2 ranks again: 4 -> 2.
FOUR_TO_TWO = """
import torch
from _dist_scenarios import resume_case
from fitkit.distributed import rank
torch.save({f"4to2_{k}": resume_case(k, OUT / f"bk4_{k}") for k in ("tensors", "loader")}, OUT / f"two{rank()}.pt")
"""


def _one_process(backup=None, stop_after=None):
    """Adam, 37 samples, batch 8, 3 epochs; ``stop_after``: a crash after that many batches of
    epoch 1 (the backup, every 4 batches: at batch 8 of 10, holds 24 samples of epoch 1).
    Returns the ids per epoch and the parameters."""
    torch.manual_seed(0)
    x, y, _ = data(37)
    rec = IdRecorder(net())
    model = fitkit.Model(rec, device="cpu")
    model.compile(optimizer=OPTIMIZERS["adam"], loss="mse")
    callbacks = [rec.epochs()]
    if backup is not None:
        callbacks.append(fitkit.callbacks.BackupAndRestore(backup, save_freq=4, delete_checkpoint=False))
    if stop_after is not None:
        callbacks.append(
            fitkit.callbacks.LambdaCallback(
                on_train_batch_end=lambda b, logs: (
                    model.epoch == 1 and b == stop_after - 1 and setattr(model, "stop_training", True)
                )
            )
        )
    model.fit(x, y, batch_size=8, epochs=3, shuffle=True, verbose=0, callbacks=callbacks)
    return rec.seen, [p.detach().clone() for p in rec.net.parameters()]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("split")
    for per_rank in (4, 5):
        _one_process(out / f"bk{per_rank}", stop_after=4)
    crash1 = resume_case("loader", out / "bk1_loader", crash=True)  # the 1 -> 2 case's backup
    run_torchrun(JOB, out, nproc=2, timeout=150)
    return [{**torch.load(out / f"rank{r}.pt", weights_only=False), "dir": out, "crash1": crash1} for r in (0, 1)]


@pytest.fixture(scope="module")
def matrix(job, tmp_path_factory):
    """Per case ``"S_to_R_kind"``: the saving run's ranks' results (the crash) and the resumed
    run's ranks' results, with the uninterrupted one-process reference of that kind."""
    out = job[0]["dir"]
    for kind in ("tensors", "loader"):
        for copy in ("bk2to4", "bk2to1"):
            shutil.copytree(out / f"bk2_{kind}", out / f"{copy}_{kind}")
    run_torchrun(FOUR, out, nproc=4, timeout=150)
    run_torchrun(FOUR_TO_TWO, out, nproc=2, timeout=120)
    four = [torch.load(out / f"four{r}.pt", weights_only=False) for r in range(4)]
    two = [torch.load(out / f"two{r}.pt", weights_only=False) for r in range(2)]
    cases, refs = {}, {}
    for kind in ("tensors", "loader"):
        ref = refs[kind] = resume_case(kind)
        one = [resume_case(kind, out / f"bk2to1_{kind}")]
        cases[f"2to4_{kind}"] = ([j[f"crash_{kind}"] for j in job], [f[f"2to4_{kind}"] for f in four], ref)
        cases[f"4to2_{kind}"] = ([f[f"crash_{kind}"] for f in four], [t[f"4to2_{kind}"] for t in two], ref)
        cases[f"2to1_{kind}"] = ([j[f"crash_{kind}"] for j in job], one, ref)
    cases["1to2_loader"] = ([job[0]["crash1"]], [j["1to2_loader"] for j in job], refs["loader"])
    return cases


def _torchrun_test(f):
    return pytest.mark.distributed(pytest.mark.slow(f))


@_torchrun_test
def test_two_ranks_by_two_workers_train_each_sample_once_per_epoch(job):
    r0, r1 = job
    for epoch in range(2):
        assert sorted(r0["worker_ids"][epoch] + r1["worker_ids"][epoch]) == list(range(40))
        # epoch e: item k goes to shard (k + e) mod 4; rank 0's workers hold shards 0 and 1
        assert sorted(r0["worker_ids"][epoch]) == sorted(i for i in range(40) if (i + epoch) % 4 in (0, 1))
    assert r0["worker_steps"] == r1["worker_steps"] == 8  # 2 workers x 2 batches of 5, 2 epochs


@_torchrun_test
def test_a_rank_only_split_with_workers_is_caught_and_the_helpers_tail_names_its_own_fix(job):
    """An IterableDataset split by rank only, with num_workers=2, trains each sample twice: a
    warning (once per fit) names split_by_rank_and_worker. The helper itself, on 50 items,
    leaves rank 0 more batches: the warning then names drop_last / steps_per_epoch, not the
    helper already in use."""
    r0, r1 = job
    for r in (r0, r1):
        copies = [m for m in r["rank_only"] if "first two batches are equal" in m]
        assert len(copies) == 1 and "split_by_rank_and_worker(dataset)" in copies[0]
    uneven = [m for m in r0["helper_uneven"] if "Uneven data over the ranks" in m]
    assert uneven and all("drop_last=True" in m and "split_by_rank_and_worker" not in m for m in uneven)
    assert not any("first two batches" in m for m in r0["helper_uneven"])
    # the deal turns each epoch: the items left out (the longer rank's last batches) are not the
    # same every epoch (before: 48 and 49 in every epoch), and no item trains twice in an epoch
    dropped = []
    for epoch in range(4):
        trained = r0["helper_uneven_ids"][epoch] + r1["helper_uneven_ids"][epoch]
        assert len(trained) == len(set(trained))
        dropped.append(sorted(set(range(50)) - set(trained)))
    assert dropped == [[48, 49], [], [48, 49], []]


@_torchrun_test
@pytest.mark.parametrize("kind", ["sized", "unsized"])
def test_uneven_lengths_end_every_rank_at_the_shortest(job, kind):
    r0, r1 = job
    assert r0[kind]["steps"] == r1[kind]["steps"] == 18  # 9 of rank 0's 10 batches, 2 epochs
    assert r0[kind]["loss"] == r1[kind]["loss"]
    assert all(torch.equal(a, b) for a, b in zip(r0[kind]["params"], r1[kind]["params"], strict=True))
    expected = "the ranks have 10, 9 batches" if kind == "sized" else "another rank ran out of batches after 9"
    assert len(r0[kind]["warnings"]) == 2 and expected in r0[kind]["warnings"][0]
    assert "ends the epoch after 9 batches" in r0[kind]["warnings"][0]
    assert r1[kind]["warnings"] == ([] if kind == "unsized" else r0[kind]["warnings"])


@_torchrun_test
def test_no_collective_per_step_beyond_ddps_for_fitkits_own_shards(job):
    r0, r1 = job
    for r in (r0, r1):
        # 5 steps, 4 gaps between batch ends; the 1 after step 1 is the signal agreement
        # (fitkit.distributed.agreement: after step 1, then at most every 8 steps)
        assert r["count_tensors"] == [1, 0, 0, 0]
        assert r["count_loader"] == [1, 0, 0, 0]
        # Sample weights, or a target equal to ignore_index: the global denominator rides in DDP's
        # gradient all-reduce, which fitkit's count hook then issues from Python (counted here; the
        # C++ reducer's is not). Every collective, DDP's included: tests/distributed/test_distributed_collectives.py
        assert r["count_weighted"] == [2, 1, 1, 1]
        assert r["count_ce_index"] == r["count_ce_probabilities"] == [1, 0, 0, 0]
        assert r["count_ce_ignored"] == [2, 1, 1, 1]


@_torchrun_test
@pytest.mark.parametrize("kind", ["index", "probabilities", "ignored"])
def test_cross_entropy_on_two_ranks_equals_one_process(job, kind):
    """Without the collective the step is still the exact global mean (the last global batch
    has 5 rows: 4 on rank 0, 1 on rank 1), as one process with batches of 8."""
    r0, r1 = job
    one = ce_case(kind)
    assert all(torch.equal(r0[f"ce_{kind}"]["params"][k], r1[f"ce_{kind}"]["params"][k]) for k in one["params"])
    for k, v in one["params"].items():
        torch.testing.assert_close(r0[f"ce_{kind}"]["params"][k], v, rtol=0, atol=1e-6)
    assert r0[f"ce_{kind}"]["loss"] == pytest.approx(one["loss"], abs=1e-6)


def test_split_covers_every_item_once_over_ranks_and_workers(monkeypatch):
    class FakeInfo:
        def __init__(self, i):
            self.id, self.num_workers = i, 3

    parts = []
    for r in range(2):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", "2")
        for i in range(3):
            monkeypatch.setattr("fitkit.distributed.split.get_worker_info", lambda i=i: FakeInfo(i))
            parts.append(list(split_by_rank_and_worker(range(20))))
    assert parts[0] == [0, 6, 12, 18] and parts[5] == [5, 11, 17]
    assert sorted(sum(parts, [])) == list(range(20))


def test_split_refuses_a_non_iterable():
    with pytest.raises(TypeError, match="Expected `source` to be an iterable of samples. Received: a int"):
        RankWorkerSplit(3)  # type: ignore[arg-type]


@_torchrun_test
@pytest.mark.parametrize("per_rank", [4, 5])
def test_a_mid_epoch_backup_of_one_process_resumes_by_sample_on_two(job, per_rank):
    """1 -> 2 ranks: the resumed epoch trains each of its untrained samples exactly once, in
    global batches of 8 (the backup's) or 10 (24 done: the first is cut at sample 24)."""
    r0, r1 = job
    ref_ids, ref_params = _one_process()
    done = ref_ids[1][:24]  # what the backup's run trained of epoch 1 (the same order)
    resumed = r0[f"resume_{per_rank}"]["ids"][0] + r1[f"resume_{per_rank}"]["ids"][0]
    assert sorted(done + resumed) == list(range(37))
    last = r0[f"resume_{per_rank}"]["ids"][1] + r1[f"resume_{per_rank}"]["ids"][1]
    assert len(r0[f"resume_{per_rank}"]["ids"]) == 2 and sorted(last) == list(range(37))  # epochs 1 and 2
    if per_rank == 4:  # the same global batches: the uninterrupted run's weights
        for a, b in zip(r0["resume_4"]["params"], ref_params, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@_torchrun_test
@pytest.mark.parametrize(
    "case", ["2to4_tensors", "2to4_loader", "4to2_tensors", "4to2_loader", "2to1_tensors", "2to1_loader", "1to2_loader"]
)
def test_a_mid_epoch_backup_resumes_by_sample_at_another_world_size(matrix, case):
    """A crash at step 7 after the step-6 backup (8 samples into epoch 1), resumed at another world
    size with the same global batch of 8: the resumed epoch trains each of the other 29 samples
    exactly once (in the order the epoch drew), the next epoch all 37, and the weights are the
    uninterrupted run's up to reduction order."""
    saving, resumed, ref = matrix[case]
    per_rank = 8 // len(saving)
    done = [i for r in saving for i in r["ids"][1][:per_rank]]  # the step before the backup, every rank
    assert sorted(done) == sorted(ref["ids"][1][:8])
    rest = [i for r in resumed for i in r["ids"][0]]
    assert sorted(rest) == sorted(ref["ids"][1][8:]) and sorted(done + rest) == list(range(37))
    assert all(len(r["ids"]) == 2 for r in resumed)  # the rest of epoch 1, then epoch 2
    assert sorted(i for r in resumed for i in r["ids"][1]) == list(range(37))
    for a, b in zip(resumed[0]["params"], ref["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for r in resumed[1:]:  # every rank holds the same weights
        assert all(torch.equal(a, b) for a, b in zip(resumed[0]["params"], r["params"], strict=True))


@_torchrun_test
@pytest.mark.parametrize("kind", ["tensors", "loader"])
def test_a_backup_inside_a_pass_carried_over_across_epochs_resumes_it_on_two_ranks(job, kind):
    """``steps_per_epoch=2`` over 5 global batches: the backup after the pass's third batch (inside
    epoch 1) resumes with its fourth (the rest of epoch 1), then its fifth (epoch 2, where the data
    runs out): the uninterrupted run's samples, and its weights up to reduction order."""
    ref = resume_case(kind, steps_per_epoch=2)  # one process, global batch 8
    assert [len(ids) for ids in ref["ids"]] == [16, 16, 5]
    resumed = [r[f"spe_{kind}"] for r in job]
    assert [sorted(resumed[0]["ids"][e] + resumed[1]["ids"][e]) for e in range(2)] == [
        sorted(ref["ids"][1][8:]),
        sorted(ref["ids"][2]),
    ]
    assert len(resumed[0]["ids"]) == 2
    for a, b in zip(resumed[0]["params"], ref["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(resumed[0]["params"], resumed[1]["params"], strict=True))


def test_workers_that_yield_the_same_samples_are_caught_on_one_process():
    """The same bug without torchrun: an IterableDataset that ignores its workers. One warning
    per fit; a dataset split by worker trains each sample once and is not warned about."""
    import warnings

    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    class Ids(IterableDataset):
        def __init__(self, by_worker):
            self.by_worker = by_worker

        def __iter__(self):
            info = get_worker_info()
            start, step = (info.id, info.num_workers) if self.by_worker else (0, 1)
            for i in range(start, 20, step):
                yield torch.tensor([float(i), 0.0, 0.0]), torch.zeros(1)

    for by_worker, steps, warned in ((False, 16, 1), (True, 8, 0)):
        model = fitkit.Model(net(), device="cpu")
        model.compile(optimizer="sgd", loss="mse")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(DataLoader(Ids(by_worker), batch_size=5, num_workers=2), epochs=2, verbose=0)
        copies = [w for w in caught if "first two batches are equal" in str(w.message)]
        assert model.global_step == steps and len(copies) == warned
        if warned:
            assert "trained 2 times per epoch" in str(copies[0].message)
