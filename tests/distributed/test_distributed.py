"""torchrun on 2 gloo processes (CPU): DDP / FSDP2 parity, exact metrics, predict, resume.

One torchrun launch runs every scenario of ``tests/_dist_scenarios.py`` (a launch costs ~5-10
s of startup); each test below checks one acceptance criterion of its results. The
single-process references run in the test process itself, with the global batch size.
"""

from __future__ import annotations

import _dist_scenarios as sc
import pytest
import torch
from _torchrun import run_torchrun
from torch import nn

import fitkit
from fitkit import distributed
from fitkit.files import consolidate_weights

JOB = """
import torch
import fitkit
import _dist_scenarios as sc
from fitkit import distributed

no_sync_calls = []
plain_no_sync = distributed.Parallel.no_sync
def counting_no_sync(self, module):
    no_sync_calls.append(1)
    return plain_no_sync(self, module)
distributed.Parallel.no_sync = counting_no_sync

res = {}
res["sgd"] = sc.parity("sgd", 33)  # 33 = 4 global batches of 8 + 1: rank 1's last share is empty
res["adam_weighted"] = sc.parity("adam", 37, weighted=True)  # last global batch: 3 + 2 samples
res["accumulation"] = sc.parity("sgd", 37, accumulation=2)
res["loader"] = sc.parity_loader()
res["no_sync_calls"] = len(no_sync_calls)
res["evaluate"] = sc.exact_evaluate()
res["predict"] = sc.exact_predict()
res["stop"] = sc.stop_on_one_rank()
res["unshardable"] = sc.unshardable_error()
res["checkpoint"] = sc.checkpoint_epochs(OUT / "ddp.pt", ckpt_dir=OUT)
for case in ("plain", "weighted", "per_token", "class_weight", "channels_first", "zero_window"):
    res[f"tokens_{case}"] = sc.tokens(case)
res["fsdp_sgd"] = sc.parity("sgd", 33, strategy="fsdp")
res["fsdp_adam_weighted"] = sc.parity("adam", 37, weighted=True, strategy="fsdp")
res["fsdp_evaluate"] = sc.exact_evaluate("fsdp")
res["fsdp_predict"] = sc.exact_predict("fsdp")
res["fsdp_checkpoint"] = sc.checkpoint_epochs(OUT / "fsdp.pt", strategy="fsdp")
res["resume_ddp_file_with_fsdp"] = sc.resume(OUT / "ddp.pt", strategy="fsdp")
res["resume_fsdp_file_with_ddp"] = sc.resume(OUT / "fsdp.pt")
res["lifetime"] = sc.lifetime()
res["batch_sampler_epochs"] = sc.batch_sampler_epochs()
res["sum_reduction"] = sc.sum_reduction()
for case in ("unfreeze", "unfreeze_mid_epoch", "find_unused", "static_graph", "bucket_view"):
    res[f"ddp_{case}"] = sc.ddp_options(case)
for case in ("unfreeze", "unfreeze_mid_epoch"):
    res[f"fsdp_{case}"] = sc.ddp_options(case, fsdp=True)
res["unused_refused"] = sc.unused_refused()
res["unused_refused_bucket_view"] = sc.unused_refused(bucket_view=True)
res["bn_validation"] = sc.bn_validation()
res["time_budget"] = sc.time_budget()
res["time_validation"] = sc.time_validation(OUT / "timed")
res["own_items"] = sc.own_items()
res["own_items_compiled"] = sc.own_items("cross_entropy")
res["tokens_seen"] = sc.tokens_seen()
res["token_budget"] = sc.token_budget()
res["data_budget_errors"] = sc.data_budget_errors()
res["loss_terms"] = sc.loss_terms(checkpoint=OUT / "terms.pt")

# Console output: rank 0 only (verbose=2 prints one line per epoch).
x, y, _ = sc.data(16)
model = fitkit.Model(sc.net(), device="cpu")
model.compile(optimizer="sgd", loss="mse")
model.fit(x, y, batch_size=4, epochs=2, verbose=2)
res["world_size"] = distributed.world_size()
res["is_ddp"] = type(model._core.training_forward.eager).__name__
torch.save(res, OUT / f"rank{distributed.rank()}.pt")
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Run the job once; return ``(results of rank 0, results of rank 1, stdout, folder)``."""
    out = tmp_path_factory.mktemp("torchrun")
    proc = run_torchrun(JOB, out, nproc=2, timeout=150)
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    return r0, r1, proc.stdout, out


@pytest.fixture(scope="module")
def reference():
    """The same scenarios on this one process (batch size 8 = 2 ranks x 4)."""
    return {
        "sgd": sc.parity("sgd", 33),
        "adam_weighted": sc.parity("adam", 37, weighted=True),
        "accumulation": sc.parity("sgd", 37, accumulation=2),
        "adam_3_epochs": sc.parity("adam", 37),
        "loader": sc.parity_loader(),
    }


def _assert_close(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def _assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "the ranks' parameters differ"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", ["sgd", "adam_weighted"])
def test_parity_with_one_process(job, reference, strategy, case):
    """After fit on 2 ranks both hold bitwise-identical parameters, equal to one process
    within 1e-6.

    Conditions: the same seed on every rank and in the reference (fitkit draws each epoch's
    permutation on rank 0 from the global generator, as one process does); per-rank
    batch_size 4 against the reference's 8, so both see the same global batches; no dropout
    (each rank draws its own masks); float32 on the CPU (the all-reduce sums in another order
    than one process, so equality is within 1e-6, not bitwise). ``sgd`` uses 33 samples: the
    last global batch holds 1 sample, so rank 1 runs a step on an empty share;
    ``adam_weighted`` uses 37 samples (last shares 3 and 2) and per-sample weights.
    """
    r0, r1, _, _ = job
    key = case if strategy == "ddp" else f"fsdp_{case}"
    _assert_identical(r0[key]["params"], r1[key]["params"])
    _assert_close(r0[key]["params"], reference[case]["params"])
    # Every rank's History is the same, and the single process's within float tolerance.
    assert r0[key]["history"] == r1[key]["history"]
    ref = reference[case]["history"]
    assert r0[key]["history"].keys() == ref.keys()
    for k, values in ref.items():
        assert r0[key]["history"][k] == pytest.approx(values, rel=1e-5, abs=1e-6), k


@pytest.mark.distributed
@pytest.mark.slow
def test_dataloader_parity_with_one_process(job, reference):
    """A DataLoader gets fitkit's rank shares of one process's order (shuffled too); the padded
    sample never counts (see parity_loader)."""
    r0, r1, _, _ = job
    _assert_identical(r0["loader"]["params"], r1["loader"]["params"])
    _assert_close(r0["loader"]["params"], reference["loader"]["params"])
    assert r0["loader"]["history"] == r1["loader"]["history"]
    for k, values in reference["loader"]["history"].items():
        assert r0["loader"]["history"][k] == pytest.approx(values, rel=1e-5, abs=1e-6), k
    _assert_identical(r0["loader"]["shuffled_params"], r1["loader"]["shuffled_params"])
    _assert_close(r0["loader"]["shuffled_params"], reference["loader"]["shuffled_params"])


@pytest.mark.distributed
@pytest.mark.slow
def test_gradient_accumulation_under_ddp(job, reference):
    """Accumulation over 2 micro-batches on 2 ranks equals it on one process (no_sync used)."""
    r0, r1, _, _ = job
    assert r0["no_sync_calls"] > 0
    _assert_identical(r0["accumulation"]["params"], r1["accumulation"]["params"])
    _assert_close(r0["accumulation"]["params"], reference["accumulation"]["params"])


TOKEN_CASES = ["plain", "weighted", "per_token", "class_weight", "channels_first", "zero_window"]


@pytest.fixture(scope="module")
def token_reference():
    """One process, global batch 8 with accumulation 2, and one window as one batch of 16."""
    return {case: (sc.tokens(case), sc.tokens(case, batch_size=16, accumulation=1)) for case in TOKEN_CASES}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", TOKEN_CASES)
def test_token_denominators_are_global_under_ddp(job, token_reference, case):
    """Token-level cross-entropy (rows of 0..5 real tokens) with accumulation on 2 ranks: each
    rank's micro-batch weighs by its tokens (times its sample / class weights) over the global
    window's, so the steps, the epoch losses and evaluate equal one process's."""
    r0, r1, _, _ = job
    ref, _ = token_reference[case]
    got = r0[f"tokens_{case}"]
    _assert_identical(got["params"], r1[f"tokens_{case}"]["params"])
    _assert_close(got["params"], ref["params"], atol=1e-5)
    assert got["history"] == r1[f"tokens_{case}"]["history"]
    assert got["history"]["loss"] == pytest.approx(ref["history"]["loss"], rel=1e-5)
    assert got["evaluate"]["loss"] == pytest.approx(ref["evaluate"]["loss"], rel=1e-6)
    assert all(v == v for v in got["history"]["loss"])  # no NaN, the zero window included


def test_token_accumulation_equals_one_batch_of_the_window(token_reference):
    """One process: 2 micro-batches of 8 rows are one step on the 16 rows (the first epoch's
    first step; shuffling makes later windows differ from the big batches only in grouping)."""
    for case in TOKEN_CASES:
        accumulated, whole = token_reference[case]
        assert accumulated["evaluate"]["loss"] == accumulated["evaluate"]["loss"]
        assert whole["history"]["loss"] == pytest.approx(accumulated["history"]["loss"], rel=1e-5), case
        _assert_close(accumulated["params"], whole["params"], atol=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_evaluate_is_exact_over_all_ranks(job, strategy):
    """x = [0..4], y_pred = x, targets 0, MAE, batch 2: 2.0 on both ranks, padding never counted."""
    r0, r1, _, _ = job
    key = "evaluate" if strategy == "ddp" else "fsdp_evaluate"
    for results in (r0, r1):
        for kind, logs in results[key].items():
            assert logs == {"loss": 2.0, "mae": 2.0}, kind


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_predict_returns_every_row_once_in_order(job, strategy):
    r0, r1, _, _ = job
    key = "predict" if strategy == "ddp" else "fsdp_predict"
    x = torch.arange(5.0).unsqueeze(1)
    for results in (r0, r1):
        for kind in ("tensors", "dataloader", "xy_batches"):
            assert torch.equal(results[key][kind], x), kind
        heads = results[key]["dict_outputs"]
        assert torch.equal(heads["same"], x) and torch.equal(heads["double"], 2 * x)
        named = results[key]["namedtuple_outputs"]  # the gather over ranks keeps the namedtuple
        assert type(named).__name__ == "Heads" and torch.equal(named.same, x) and torch.equal(named.double, 2 * x)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpoint_from_2_ranks_resumes_on_1(job, reference, strategy):
    """Written at world size 2 (DDP: rank 0 writes one file; FSDP: each rank its shards, a folder;
    unwrapped state either way), resumed here at world size 1.

    The loaded weights are the saved ones, and the resumed run ends where an uninterrupted
    one-process run ends (same global batches; rank 0's RNG state is in the file).
    """
    r0, r1, _, out = job
    key, path = ("checkpoint", out / "ddp.pt") if strategy == "ddp" else ("fsdp_checkpoint", out / "fsdp.pt")
    if strategy == "ddp":  # one file, written by rank 0
        keys = list(torch.load(path, weights_only=True)["module"])
    else:  # a folder of both ranks' shards
        keys = consolidate_weights(path, out / "fsdp_weights.pt")
    assert keys and not any(k.startswith(("module.", "_orig_mod.")) for k in keys)
    _assert_identical(r0[key]["params"], r1[key]["params"])
    resumed = sc.resume(path)
    assert resumed["start"] == 2
    _assert_identical(resumed["loaded"], r0[key]["params"])
    _assert_close(resumed["params"], reference["adam_3_epochs"]["params"])
    assert len(resumed["history"]["loss"]) == 3
    if strategy == "ddp":  # ModelCheckpoint wrote its files (rank 0 only)
        assert (out / "ck-1.pt").is_file() and (out / "ck-2.pt").is_file()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", ["resume_ddp_file_with_fsdp", "resume_fsdp_file_with_ddp"])
def test_checkpoint_resumes_across_strategies_at_world_size_2(job, reference, case):
    """A DDP file resumes under FSDP and an FSDP file under DDP (2 ranks), exactly."""
    r0, r1, _, _ = job
    source = "checkpoint" if case == "resume_ddp_file_with_fsdp" else "fsdp_checkpoint"
    assert r0[case]["start"] == 2
    _assert_identical(r0[case]["loaded"], r0[source]["params"])
    _assert_identical(r0[case]["params"], r1[case]["params"])
    _assert_close(r0[case]["params"], reference["adam_3_epochs"]["params"])


@pytest.mark.distributed
@pytest.mark.slow
def test_stop_training_on_one_rank_stops_every_rank(job):
    r0, r1, _, _ = job
    for results in (r0, r1):
        assert results["stop"]["epoch_end"] == [0]
        assert results["stop"]["mid_epoch"] == [0, 1]  # honoured at the end of that epoch


@pytest.mark.distributed
@pytest.mark.slow
def test_iterable_of_batches_cannot_be_sharded(job):
    r0, _, _, _ = job
    assert "already_sharded" in r0["unshardable"]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_finished_fit_lets_go_of_its_data_shards_and_callbacks_under_torchrun(job):
    """After a fit that returned and one that raised, nothing of them stays reachable on any rank:
    the training DeviceLoader, the rank's shards (which the stepper's host row counts are bound
    to), the float32 copy of float64 inputs, and the callback (see sc.lifetime)."""
    r0, r1, _, _ = job
    for results in (r0, r1):
        assert results["lifetime"] == {
            "tensors": {"loader": False, "shards": False, "x": False, "y": False, "callback": False},
            "tensors_raised": {"loader": False, "shards": False, "x": False, "y": False, "callback": False},
            "dataloader": {"loader": False, "shards": False, "callback": False},
        }


@pytest.mark.distributed
@pytest.mark.slow
def test_an_already_sharded_batch_sampler_is_told_each_epoch_under_torchrun(job):
    r0, r1, _, _ = job
    for results in (r0, r1):
        assert results["batch_sampler_epochs"] == {"fit": [0, 1, 2], "initial_epoch_2": [2]}


@pytest.mark.distributed
@pytest.mark.slow
def test_console_output_from_rank_0_only(job):
    r0, r1, stdout, _ = job
    assert r0["world_size"] == r1["world_size"] == 2
    assert r0["is_ddp"] == "DistributedDataParallel"
    assert stdout.count("Epoch 1/2") == 1 and stdout.count("Epoch 2/2") == 1


# -- one process: the same script runs without torchrun ----------------------------------
def test_strategy_is_validated():
    with pytest.raises(ValueError, match="Unknown strategy 'zero3'. Valid values: auto, ddp, fsdp"):
        fitkit.Model(nn.Linear(1, 1), device="cpu", strategy="zero3")
    with pytest.raises(TypeError, match="Expected `strategy`"):
        fitkit.Model(nn.Linear(1, 1), device="cpu", strategy=None)


@pytest.mark.parametrize("strategy", ["auto", "ddp", "fsdp"])
def test_one_process_ignores_the_strategy(strategy):
    model = fitkit.Model(nn.Linear(1, 1), device="cpu", strategy=strategy)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(torch.zeros(4, 1), torch.zeros(4, 1), epochs=1, verbose=0)
    assert model._core.parallel is None and model._core.training_forward.eager is model.module
    assert not distributed.is_distributed() and distributed.is_rank_zero()


def test_already_sharded_on_one_process_is_the_data_itself():
    model = sc.identity_model()
    x, y = torch.arange(5.0).unsqueeze(1), torch.zeros(5, 1)
    batches = [(x[:2], y[:2]), (x[2:], y[2:])]
    assert model.evaluate(distributed.already_sharded(batches), verbose=0) == {"loss": 2.0, "mae": 2.0}
    assert torch.equal(model.predict(distributed.already_sharded(x), batch_size=2, verbose=0), x)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_sum_loss_sums_over_the_ranks(job):
    """reduction="sum" on 2 ranks: each step's gradient is the sum over the global window, as
    on one process (and as a hand sum over the 16 rows of each step)."""
    r0, r1, _, _ = job
    one = sc.sum_reduction()
    _assert_identical(r0["sum_reduction"]["params"], r1["sum_reduction"]["params"])
    _assert_close(r0["sum_reduction"]["params"], one["params"], atol=1e-5)
    assert r0["sum_reduction"]["steps"] == one["steps"] == 2
    # the hand computation: SGD on the sum of squared errors of each 16 rows
    x, y, _ = sc.data(32)
    hand = sc.net()
    opt = torch.optim.SGD(hand.parameters(), lr=0.001)
    for i in (0, 16):
        opt.zero_grad()
        ((hand(x[i : i + 16]) - y[i : i + 16]) ** 2).sum().backward()
        opt.step()
    _assert_close(one["params"], {n: p.detach() for n, p in hand.named_parameters()}, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", ["unfreeze", "unfreeze_mid_epoch", "find_unused", "static_graph", "bucket_view"])
def test_ddp_follows_the_trainable_set_and_takes_its_options(job, case):
    """A layer unfrozen at epoch 2, or after a step in the epoch, is all-reduced from the next
    step on (the wrapper is rebuilt), and a
    parameter without a gradient trains with DDP(find_unused_parameters=True) or
    DDP(static_graph=True): both ranks hold the same weights, those of one process (1e-6)."""
    r0, r1, _, _ = job
    _assert_identical(r0[f"ddp_{case}"]["params"], r1[f"ddp_{case}"]["params"])
    one = sc.ddp_options(case)
    _assert_close(r0[f"ddp_{case}"]["params"], one["params"])
    if case.startswith("unfreeze"):  # the unfrozen layer did train
        assert not torch.equal(one["params"]["0.weight"], sc.net()[0].weight.detach())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", ["unfreeze", "unfreeze_mid_epoch"])
def test_fsdp_follows_a_layer_unfrozen_at_an_epoch_start_or_after_a_step(job, case):
    """FSDP all-reduces (reduce-scatters) whatever requires a gradient at each backward: the same
    unfreezing as above leaves both ranks with the weights of one process (1e-6)."""
    r0, r1, _, _ = job
    _assert_identical(r0[f"fsdp_{case}"]["params"], r1[f"fsdp_{case}"]["params"])
    one = sc.ddp_options(case)
    _assert_close(r0[f"fsdp_{case}"]["params"], one["params"])
    assert not torch.equal(one["params"]["0.weight"], sc.net()[0].weight.detach())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("key", ["unused_refused", "unused_refused_bucket_view"])
def test_a_parameter_without_a_gradient_under_plain_ddp_is_refused_at_the_first_step(job, key):
    """Without find_unused_parameters / static_graph the first step names the parameter and the
    fix on every rank, and applies nothing (before, step 1 stepped each rank's own gradients)."""
    r0, r1, _, _ = job
    for r in (r0, r1):
        assert "spare.weight, spare.bias" in r[key]["error"]
        assert "DDP(find_unused_parameters=True)" in r[key]["error"]
        assert r[key]["unchanged"] and r[key]["step"] == 0


@pytest.mark.distributed
@pytest.mark.slow
def test_every_rank_validates_with_the_same_batchnorm_statistics_inside_the_epoch(job):
    """validation_interval=2 under DDP: before each validation rank 0's BatchNorm buffers are
    every rank's (rank 1 trained on data of another scale: its own statistics differ), so both
    ranks validate the same model and log the same numbers, those of one process evaluating
    that state."""
    r0, r1, _, _ = job
    v0, v1 = r0["bn_validation"], r1["bn_validation"]
    assert [v["step"] for v in v0["validations"]] == [2, 4, 6]
    assert v0["validations"] == v1["validations"]
    for s0, s1 in zip(v0["states"], v1["states"], strict=True):
        assert all(torch.equal(s0[k], s1[k]) for k in s0)
    for record, state in zip(v0["validations"], v0["states"], strict=True):
        one = sc.bn_reference(state)
        assert record["val_loss"] == pytest.approx(one["loss"], abs=1e-6)
        assert record["val_mae"] == pytest.approx(one["mae"], abs=1e-6)


def test_sync_batchnorm_converts_in_place_and_is_refused_off_cuda():
    """DDP(sync_batchnorm=True): the BatchNorm layers become SyncBatchNorm with the same tensors
    (torch's converter per child); on CPU, where torch has no SyncBatchNorm, compile says so."""
    from fitkit.distributed import DDP
    from fitkit.distributed.ddp import convert_sync_batchnorm

    net = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.BatchNorm1d(4), nn.ReLU()), nn.BatchNorm1d(4))
    weight, mean = net[1][0].weight, net[2].running_mean
    assert convert_sync_batchnorm(net) == 2
    assert type(net[1][0]) is nn.SyncBatchNorm and type(net[2]) is nn.SyncBatchNorm
    assert net[1][0].weight is weight and net[2].running_mean is mean
    with pytest.raises(ValueError, match="the model is one"):
        convert_sync_batchnorm(nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match=r"sync_batchnorm=True\) needs CUDA.*'cpu'"):
        DDP(sync_batchnorm=True).convert(nn.Sequential(nn.BatchNorm1d(3)), torch.device("cpu"))
    with pytest.raises(TypeError, match="`sync_batchnorm`"):
        DDP(sync_batchnorm="yes")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_time_budget_stops_every_rank_at_one_step(job):
    """Each rank's clock is its own: rank 0 spends a 3 s budget at step 3, rank 1 (a slower
    clock) would not until step 12; both stop at the next agreement point, step 9."""
    r0, r1, _, _ = job
    assert r0["time_budget"] == {"step": 9, "spent": True, "elapsed": 9.0}
    assert r1["time_budget"] == {"step": 9, "spent": False, "elapsed": 2.25}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_timedelta_validation_interval_validates_every_rank_at_one_step(job):
    """Rank 0's clock says 2.5 s have passed after step 3, rank 1's only after step 25: the
    ranks agree at the signal agreement points (steps 1, 9, 17, 25) and validate (and save, for
    ModelCheckpoint(train_time_interval=)) after the next step, together, with the same numbers."""
    r0, r1, _, folder = job
    assert [s for s, _ in r0["time_validation"]["validations"]] == [10, 18, 26]
    assert r0["time_validation"] == r1["time_validation"]
    # ModelCheckpoint(train_time_interval=) on the same clocks: saved at the same steps (rank 0 wrote)
    assert r0["time_validation"]["saved"] == ["m-10.pt", "m-18.pt", "m-26.pt"]
    assert sorted(p.name for p in (folder / "timed").iterdir() if p.suffix == ".pt") == r0["time_validation"]["saved"]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_models_own_token_loss_is_exact_across_ranks(job):
    """GPT-2's own loss with num_items_in_batch on 2 ranks (1 sequence each per step, 4 + 1 and
    3 + 2 counted tokens): each step is the mean over the step's 5 tokens, as on one process with
    both sequences in one batch (its own mean); the epoch loss is the mean over all 10 tokens."""
    r0, r1, _, _ = job
    _assert_identical(r0["own_items"]["params"], r1["own_items"]["params"])
    one = sc.own_items()
    _assert_close(r0["own_items"]["params"], one["params"], atol=1e-6)
    assert r0["own_items"]["loss"] == pytest.approx(one["loss"], rel=1e-5)
    # a compiled cross-entropy on the same labels shifts them as the model's own loss: the same steps
    _assert_identical(r0["own_items_compiled"]["params"], r1["own_items_compiled"]["params"])
    _assert_close(r0["own_items_compiled"]["params"], one["params"], atol=1e-6)
    assert r0["own_items_compiled"]["loss"] == pytest.approx(one["loss"], rel=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_tokens_seen_counts_every_rank(job):
    """TokensSeen on 2 ranks logs the tokens of every rank's batches (99 per epoch), as one process."""
    r0, r1, _, _ = job
    assert r0["tokens_seen"] == r1["tokens_seen"] == sc.tokens_seen() == {"seen": [99, 198]}


@pytest.mark.distributed
@pytest.mark.slow
def test_the_token_budget_counts_every_ranks_tokens(job):
    """fit(max_tokens=150) on 2 ranks counts global tokens: 99 in epoch 0 (3 steps), then windows of
    48 in epoch 1: 147, 195. It stops at step 5 on every rank with the weights of one process (one
    rank's own tokens, 12 a batch, would reach 150 steps later)."""
    r0, r1, _, _ = job
    one = sc.token_budget()
    for run in (r0["token_budget"], r1["token_budget"], one):
        assert (run["steps"], run["total_steps"], run["epochs"], run["seen"]) == (5, 5, [0, 1], [99, 195])
    _assert_identical(r0["token_budget"]["params"], r1["token_budget"]["params"])
    _assert_close(r0["token_budget"]["params"], one["params"], atol=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
def test_budgets_in_data_refuse_already_sharded_data(job):
    """A rank's own share (already_sharded) does not tell the global samples or tokens: both budgets
    are refused before step 1 on every rank (they counted the rank's share before)."""
    r0, r1, _, _ = job
    for errors in (r0["data_budget_errors"], r1["data_budget_errors"]):
        tokens, samples = errors
        assert tokens.startswith("fit(max_tokens=12) needs the tokens of every training batch before the fit")
        assert "Received: x of kind in-memory tensors, already_sharded. Fix: " in tokens
        assert samples.startswith("fit(max_samples=4) needs the size of every training batch before the fit")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_loss_of_terms_logs_the_global_epoch_means_of_every_term(job):
    """A dict loss (MSE + an L1 penalty) under accumulation 3 on 2 ranks: the same weights on both
    ranks and as one process on the global batches, and every term's epoch means (training,
    validation, evaluate) over all ranks, as one process's; a checkpoint inside an epoch keeps them."""
    r0, r1, _, _ = job
    one = sc.loss_terms()
    assert r0["loss_terms"]["steps"] == one["steps"] == 4  # 2 epochs of windows of 3 + 2 global batches
    _assert_identical(r0["loss_terms"]["params"], r1["loss_terms"]["params"])
    _assert_close(r0["loss_terms"]["params"], one["params"])
    keys = ["loss", "loss_mse", "loss_l1", "learning_rate", "val_loss", "val_loss_mse", "val_loss_l1"]
    for results in (r0, r1):
        history, evaluated = results["loss_terms"]["history"], results["loss_terms"]["evaluate"]
        assert list(history) == list(one["history"]) == keys
        _assert_close(_tensors(history), _tensors(one["history"]))
        _assert_close(_tensors(evaluated), _tensors(one["evaluate"]))
    # the checkpoint the 2 ranks took inside epoch 0 holds the terms' sums over both: one process
    # resumes it and ends with the uninterrupted run's weights and History
    resumed = sc.loss_terms_resumed(job[3] / "terms.pt")
    _assert_close(resumed["params"], one["params"])
    assert list(resumed["history"]) == keys
    _assert_close(_tensors(resumed["history"]), _tensors(one["history"]))


def _tensors(logs: dict) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in logs.items()}
