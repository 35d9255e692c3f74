"""``Model(strategy=FSDP(...))``: the units a wrap policy creates (module classes, a function,
a Hugging Face model's ``_no_split_modules``), mixed precision (the bf16 shorthand with a root
that holds a layer too), activation checkpointing and CPU offload under torchrun (2 CPU ranks,
gloo); a counted fit followed by a module's own loss on the same Model (FSDP and DDP); and, in
the same launch, what ``TerminateOnNaN`` costs per DDP step (collectives and host reads) and
that a NaN on one rank skips and stops both."""

from __future__ import annotations

import math

import pytest
import torch
from _torchrun import run_torchrun
from torch import nn

import fitkit
from fitkit.distributed import FSDP

JOB = """
import functools, os, torch, fitkit
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from fitkit.distributed import FSDP, already_sharded, rank
from fitkit.callbacks import LambdaCallback, TerminateOnNaN
from _syncs import count_syncs
import transformers

res = {}
sgd = functools.partial(torch.optim.SGD, lr=0.1)

# -- first, in a fresh process: a GPT built on the meta device is sharded, and only this rank's
# shards are allocated (the peak resident memory grows by about half the full model)
import resource
from fitkit.layers import GPT
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
torch.manual_seed(0)
with torch.device("meta"):
    big = GPT(vocab_size=256, block_size=16, n_layer=6, n_head=8, n_embd=768)
numel = sum(p.numel() for p in big.parameters())
before = peak()
mm = fitkit.Model(big, device="cpu", strategy="fsdp")
mm.compile(optimizer=sgd, loss="cross_entropy")
grew = peak() - before
local = {n: p.to_local().detach().clone() for n, p in big.named_parameters()}
head = big.lm_head.weight.to_local().detach()[:2].clone()
head_std = float(big.lm_head.weight.detach().full_tensor().std())
proj_std = float(big.blocks[0].attn.proj.weight.detach().full_tensor().std())
torch.manual_seed(3)
ids = torch.randint(0, 256, (8, 16))
h = mm.fit(ids, ids, batch_size=2, epochs=1, verbose=0, shuffle=False)
res["meta"] = {"full_bytes": 4 * numel, "grew": grew, "local_numel": sum(v.numel() for v in local.values()),
               "numel": numel, "head": head, "head_std": head_std, "proj_std": proj_std,
               "tied": big.embed.wte.weight is big.lm_head.weight, "loss": h.history["loss"][0],
               "steps": mm.global_step}
del mm, big, local

# -- a Hugging Face model from its config on the meta device: its own init_weights() fills the shards
transformers.logging.set_verbosity_error()
cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
torch.manual_seed(0)
with torch.device("meta"):
    hf = transformers.GPT2LMHeadModel(cfg)
hm = fitkit.Model(hf, device="cpu", strategy="fsdp")
hm.compile(optimizer="adamw", loss=None)
wte = hf.transformer.wte.weight
init = {"std": float(wte.detach().full_tensor().std()),  # as init_weights left them
        "ln": float(hf.transformer.h[0].ln_1.weight.detach().full_tensor().mean())}
torch.manual_seed(1)
ids = torch.randint(0, 64, (8, 16))
start = hm.evaluate({"input_ids": ids, "labels": ids}, batch_size=4, verbose=0)["loss"]
hh = hm.fit({"input_ids": ids, "labels": ids}, batch_size=2, epochs=3, verbose=0, shuffle=False)
res["hf_meta"] = {**init, "tied": hf.lm_head.weight is wte, "start": start,
                  "losses": hh.history["loss"], "local": sum(p.to_local().numel() for p in hf.parameters()),
                  "numel": sum(p.numel() for p in hf.parameters())}
del hm, hf

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

def full(module):  # every parameter's full value (a collective per DTensor), by state-dict name
    return {n.replace("_checkpoint_wrapped_module.", ""): (p.full_tensor() if hasattr(p, "full_tensor") else p)
            .detach().clone() for n, p in module.named_parameters()}

torch.manual_seed(1)
x, y = torch.randn(16, 3), torch.randn(16, 1)

def fsdp_fit(strategy, net=None, callbacks=()):
    net = mlp() if net is None else net
    m = fitkit.Model(net, device="cpu", strategy=strategy)
    m.compile(optimizer=sgd, loss="mse")
    units = sum(isinstance(s, FSDPModule) for s in net.modules())
    h = m.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks))
    return {"units": units, "loss": h.history["loss"], "params": full(net), "net": net}

def first_grads(store):  # this rank's gradient shards at the first step, before the optimizer
    def hook(batch):
        if not store:
            store.extend(p.grad.to_local().clone() for p in cb.model.module.parameters())
    cb = LambdaCallback(on_backward_end=hook)
    return cb

# -- wrap policies ----------------------------------------------------------------------------
out = fsdp_fit(FSDP(wrap=[nn.Linear]))
res["list"] = {k: v for k, v in out.items() if k != "net"}
res["plain"] = {k: v for k, v in fsdp_fit("fsdp").items() if k != "net"}
for name in ("sgd", "adam"):  # a named optimizer on FSDP's DTensor shards: not torch's fused kernels
    m = fitkit.Model(mlp(), device="cpu", strategy="fsdp")
    m.compile(optimizer=name, loss="mse")
    h = m.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    res[f"named_{name}"] = {"fused": m.optimizer.defaults.get("fused"), "steps": m.global_step}
out = fsdp_fit(FSDP(wrap=lambda mod: isinstance(mod, nn.Linear) and mod.in_features == mod.out_features == 8))
res["callable"] = {"units": out["units"],
                   "unit_names": [n for n, s in out["net"].named_modules() if isinstance(s, FSDPModule)]}

# -- a Hugging Face GPT-2 (from a config) inside a module of ours: units from _no_split_modules
class LM(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                                      bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        self.gpt = transformers.GPT2LMHeadModel(cfg)
    def forward(self, ids):
        return self.gpt(ids).logits.flatten(0, 1)
lm = LM()
m = fitkit.Model(lm, device="cpu", strategy="fsdp")
m.compile(optimizer=sgd, loss=lambda pred, t: F.cross_entropy(pred, t.flatten()))
res["gpt2_units"] = sorted(type(s).__name__ for s in lm.modules() if isinstance(s, FSDPModule))
torch.manual_seed(2)
ids = torch.randint(0, 32, (8, 8))
m.fit(ids, ids, batch_size=2, epochs=1, verbose=0, shuffle=False)
res["gpt2_steps"], res["gpt2_params"] = m.global_step, full(lm)

# -- mixed precision: the dtype a unit computes in, and the dtype the shards stay in
seen = []
net = mlp()
net[2].register_forward_hook(lambda mod, inp, out: seen.append((mod.weight.dtype, inp[0].dtype, out.dtype)))
out = fsdp_fit(FSDP(wrap=[nn.Linear], mixed_precision=torch.bfloat16), net=net)
res["bf16"] = {"seen": seen[:1], "shard_dtype": net[2].weight.dtype, "loss": out["loss"], "params": out["params"]}

# -- the bf16 shorthand with a root that holds a layer: only the first Linear is a unit
import _dist_scenarios as sc
from torch.distributed.fsdp import MixedPrecisionPolicy
res["bf16_root"] = sc.bf16_root()
given = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
res["bf16_given"] = sc.bf16_root(given, wrap=[nn.Linear])  # a policy given: every unit's as given

# -- a counted fit (its count in the reduce-scatter / DDP hook), then a module's own loss
res["counted_then_own"] = {s: sc.counted_then_own(s) for s in ("fsdp", "auto")}

# -- activation checkpointing: wrapped units, recomputed forwards, the same gradients
calls, grads_ac, grads_plain = [], [], []
net = mlp()
net[2].register_forward_pre_hook(lambda mod, inp: calls.append(1))  # also at each recomputation
ac = fsdp_fit(FSDP(wrap=[nn.Linear], activation_checkpointing=True), net=net, callbacks=[first_grads(grads_ac)])
base_calls = []
net = mlp()
net[2].register_forward_pre_hook(lambda mod, inp: base_calls.append(1))
base = fsdp_fit(FSDP(wrap=[nn.Linear]), net=net, callbacks=[first_grads(grads_plain)])
res["ac"] = {
    "wrappers": [n for n, s in ac["net"].named_modules() if isinstance(s, CheckpointWrapper)],
    "fsdp_wrappers": sum(isinstance(s, CheckpointWrapper) and isinstance(s, FSDPModule) for s in ac["net"].modules()),
    "forwards": len(calls), "base_forwards": len(base_calls),
    "keys": list(ac["net"].state_dict()),
    "loss": ac["loss"], "params": ac["params"], "base_loss": base["loss"], "base_params": base["params"],
    "grads_equal": len(grads_ac) == 6 and all(torch.equal(a, b) for a, b in zip(grads_ac, grads_plain)),
}

# -- CPU offload: the shards and their gradients on the CPU, the policy applied
net = mlp()
off = fsdp_fit(FSDP(wrap=[nn.Linear], cpu_offload=True), net=net)
res["offload"] = {
    "devices": sorted({p.to_local().device.type for p in net.parameters()}),
    "offload": sorted({type(s._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                       for s in net.modules() if isinstance(s, FSDPModule) and s._get_fsdp_state()._fsdp_param_group}),
    "grad_devices": sorted({p.grad.to_local().device.type for p in net.parameters() if p.grad is not None}),
    "loss": off["loss"], "params": off["params"],
}

# -- bad values, before anything changes
errors = {}
for bad in ({"wrap": 3}, {"wrap": [nn.Linear, 3]}, {"mixed_precision": "bf16"}, {"cpu_offload": 1}):
    try:
        FSDP(**bad)
    except TypeError as e:
        errors[str(bad)] = str(e)
net = nn.Sequential(nn.Linear(2, 2))
before = [p.detach().clone() for p in net.parameters()]
m = fitkit.Model(net, device="cpu", strategy=FSDP(wrap=[nn.Conv1d], activation_checkpointing=True))
try:
    m.compile(optimizer=sgd, loss="mse")
except ValueError as e:
    errors["no_units"] = str(e)
errors["untouched"] = (not any(isinstance(s, FSDPModule) for s in net.modules())
                       and all(torch.equal(a, b) for a, b in zip(before, net.parameters())))
res["errors"] = errors

# -- TerminateOnNaN under DDP: the collectives and host reads of each step
calls = []
for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object", "barrier", "broadcast_object_list"):
    def counted(*a, _f=getattr(dist, name), _n=name, **k):
        calls.append(_n)
        return _f(*a, **k)
    setattr(dist, name, counted)
os.environ["FITKIT_SIGNAL_SECONDS"] = "1000"  # the signal agreement by steps only: after steps 1, 9, ...

def ddp(net=None):
    torch.manual_seed(0)
    m = fitkit.Model(mlp() if net is None else net, device="cpu")
    m.compile(optimizer="sgd", loss="mse")  # by name: fused, takes found_inf (a device veto)
    return m

marks = []
def mark(b, logs):
    marks.append(len(calls))
torch.manual_seed(3)
x, y = torch.randn(80, 3), torch.randn(80, 1)
counter = count_syncs(lambda sm: ddp().fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False,
                                         callbacks=[sm, LambdaCallback(on_train_batch_end=mark), TerminateOnNaN()]))
res["nan_collectives"] = [b - a for a, b in zip(marks, marks[1:])]
res["nan_host_reads"] = counter.per_step()

# -- a NaN on rank 1 only, at its batch 3 of epoch 0 (global step 4): skipped on both, both stop
def nan_run(check_every):
    torch.manual_seed(4)
    xs, ys = torch.randn(6, 2, 3), torch.randn(6, 2, 1)
    if rank() == 1:
        xs[3, 0, 0] = float("nan")
    batches = [(xs[i], ys[i]) for i in range(6)]
    m = ddp()
    after, ran = [], []
    cb = LambdaCallback(on_train_batch_end=lambda b, logs: (ran.append((m.epoch, b)),
                        after.append([p.detach().clone() for p in m.module.parameters()])))
    h = m.fit(already_sharded(batches), epochs=3, verbose=0, callbacks=[TerminateOnNaN(check_every=check_every), cb])
    return {"epochs": h.epoch, "steps": m.global_step, "ran": ran, "after": after,
            "params": [p.detach().clone() for p in m.module.parameters()]}
os.environ["FITKIT_SIGNAL_STEPS"] = "2"  # agreements after steps 1, 3, 5, ...
res["nan_epoch_end"] = nan_run(100)  # the verdict read at the epoch end
res["nan_mid_epoch"] = nan_run(1)  # read every step: the stop agreed at the next agreement point

# -- a callback declaring device_veto_only that vetoes on the host: refused (ranks would differ)
class HostVeto(fitkit.callbacks.Callback):
    device_veto_only = True
    def on_backward_end(self, batch):
        self.model.skip_optimizer_step()
m = ddp()
before = [p.detach().clone() for p in m.module.parameters()]
try:
    m.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[HostVeto()])
except RuntimeError as e:
    res["host_veto"] = (str(e), all(torch.equal(a, b) for a, b in zip(before, m.module.parameters())))
torch.save(res, OUT / f"rank{rank()}.pt")
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    run_torchrun(JOB, out, nproc=2, timeout=150)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _torchrun_test(f):
    return pytest.mark.distributed(pytest.mark.slow(f))


def _equal(a, b):
    return (
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        if isinstance(a, dict)
        else len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    )


@_torchrun_test
def test_a_class_list_shards_every_instance_and_trains_as_the_default(job):
    for r in job:
        assert r["list"]["units"] == 4  # 3 Linear + the root
        assert r["plain"]["units"] == 1  # "fsdp" on an MLP: the root alone, as before
        # same math as one root unit: the loss of the epoch and the weights
        assert r["list"]["loss"] == pytest.approx(r["plain"]["loss"], abs=1e-6)
    assert _equal(job[0]["list"]["params"], job[1]["list"]["params"])


@_torchrun_test
def test_a_named_optimizer_trains_fsdp_shards_without_fused_kernels(job):
    for r in job:
        assert r["named_sgd"] == r["named_adam"] == {"fused": None, "steps": 2}  # 16 rows, 2 x 4 a step


@_torchrun_test
def test_a_function_picks_the_units(job):
    for r in job:
        assert r["callable"]["units"] == 2  # the 8 -> 8 Linear + the root
        assert r["callable"]["unit_names"] == ["", "2"]


@_torchrun_test
def test_a_hugging_face_model_is_sharded_by_its_no_split_modules(job):
    for r in job:
        assert r["gpt2_units"] == ["FSDPGPT2Block", "FSDPGPT2Block", "FSDPLM"]  # 2 blocks + the root
        assert r["gpt2_steps"] == 2  # 8 rows, 2 per rank
    assert _equal(job[0]["gpt2_params"], job[1]["gpt2_params"])


@_torchrun_test
def test_mixed_precision_computes_in_bf16_and_keeps_float32_shards(job):
    for r in job:
        # the gathered weight and the unit's input and output inside the forward
        assert r["bf16"]["seen"] == [(torch.bfloat16, torch.bfloat16, torch.bfloat16)]
        assert r["bf16"]["shard_dtype"] == torch.float32
        assert r["bf16"]["loss"] != r["list"]["loss"]  # bf16 rounding shows in the loss
        assert r["bf16"]["loss"][0] == pytest.approx(r["list"]["loss"][0], rel=1e-2)
    assert _equal(job[0]["bf16"]["params"], job[1]["bf16"]["params"])


@_torchrun_test
def test_the_bf16_shorthand_computes_in_bf16_up_to_the_roots_float32_output(job):
    """``FSDP(mixed_precision=torch.bfloat16)`` with the first Linear a unit and the root holding
    the last one: the unit hands its output on in bf16, the root's Linear computes in bf16 with
    its gathered bf16 weights, and only the module's output is float32. It trains as one process
    in float32 within bf16's rounding: its unit roundoff is 2**-8 (3.9e-3), and a forward rounds
    the inputs, weights and activations once each, so the epoch losses agree within rel 1e-2
    (5.3e-4 and 4.7e-4 measured) and the parameters after 4 SGD steps within 5e-3 (1.3e-3
    measured). A ``MixedPrecisionPolicy`` given is every unit's as given: with
    ``output_dtype=torch.float32`` each unit's output is float32."""
    import _dist_scenarios as sc

    one = sc.bf16_root()  # one process: plain float32
    assert one["dtypes"] == {"unit_out": torch.float32, "head": (torch.float32,) * 3, "out": torch.float32}
    for r in job:
        root = r["bf16_root"]
        assert root["dtypes"] == {"unit_out": torch.bfloat16, "head": (torch.bfloat16,) * 3, "out": torch.float32}
        assert root["loss"] == pytest.approx(one["loss"], rel=1e-2)
        assert root["loss"] != one["loss"]  # bf16 rounding shows
        for k, v in one["params"].items():
            torch.testing.assert_close(root["params"][k], v, rtol=0, atol=5e-3)
        given = r["bf16_given"]["dtypes"]
        assert (given["unit_out"], given["out"]) == (torch.float32, torch.float32)
        assert r["bf16_given"]["loss"] == pytest.approx(one["loss"], rel=1e-2)
    assert job[0]["bf16_root"]["loss"] == job[1]["bf16_root"]["loss"]
    assert _equal(job[0]["bf16_root"]["params"], job[1]["bf16_root"]["params"])
    assert _equal(job[0]["bf16_given"]["params"], job[1]["bf16_given"]["params"])


@_torchrun_test
@pytest.mark.parametrize("strategy", ["fsdp", "auto"])
def test_a_counted_fits_count_does_not_scale_a_later_own_loss_fit(job, strategy):
    """Fit 1's compiled cross-entropy leaves unequal counts on the ranks (1 and 2 at its last
    step) in FSDP's counted reduce-scatter (``"auto"``: DDP's count hook); fit 2, a module's own
    loss taking ``num_items_in_batch`` after ``compile(loss=None)``, reduces with the strategy's
    own mean: its parameters and epoch loss are one process's. (A stale count weighs the ranks'
    gradients 1 : 2 instead: 0.107 off in the weights, epoch loss 1.9955 for 2.0289.)"""
    import _dist_scenarios as sc

    one = sc.counted_then_own()
    r0, r1 = (r["counted_then_own"][strategy] for r in job)
    assert r0["counted"] and r1["counted"] and not one["counted"]
    assert _equal(r0["params"], r1["params"]) and r0["loss"] == r1["loss"]
    for k, v in one["params"].items():
        torch.testing.assert_close(r0["params"][k], v, rtol=0, atol=1e-6)
    assert r0["first"] == pytest.approx(one["first"], abs=1e-6)
    assert r0["loss"] == pytest.approx(one["loss"], abs=1e-6)


@_torchrun_test
def test_activation_checkpointing_wraps_the_units_and_keeps_the_values(job):
    for r in job:
        ac = r["ac"]
        assert ac["wrappers"] == ["0", "2", "4"] and ac["fsdp_wrappers"] == 3
        # 2 steps (16 rows, 8 per step): each unit's forward runs once more, in the backward
        assert ac["forwards"] - ac["base_forwards"] == 2
        assert ac["keys"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
        assert ac["grads_equal"]
        assert ac["loss"] == ac["base_loss"]
        assert _equal(ac["params"], ac["base_params"])
    assert _equal(job[0]["ac"]["params"], job[1]["ac"]["params"])


@_torchrun_test
def test_cpu_offload_keeps_the_shards_on_the_cpu(job):
    # On a CPU-only machine the shards are on the CPU anyway: this proves the policy is applied
    # to every unit and trains to the same values, not that memory leaves an accelerator.
    for r in job:
        off = r["offload"]
        assert off["devices"] == ["cpu"]
        assert off["offload"] == ["CPUOffloadPolicy"]
        assert off["loss"] == r["list"]["loss"]
        assert _equal(off["params"], r["list"]["params"])
    assert _equal(job[0]["offload"]["params"], job[1]["offload"]["params"])


@_torchrun_test
def test_bad_fsdp_options_are_refused_before_anything_changes(job):
    errors = job[0]["errors"]
    assert "Expected `wrap` to be None, an nn.Module subclass" in errors["{'wrap': 3}"]
    assert "Received: 3 of type int" in errors["{'wrap': [<class 'torch.nn.modules.linear.Linear'>, 3]}"]
    assert "Expected `mixed_precision`" in errors["{'mixed_precision': 'bf16'}"]
    assert "Expected `cpu_offload` to be a bool" in errors["{'cpu_offload': 1}"]
    assert "picks none in Sequential" in errors["no_units"] and "Fix:" in errors["no_units"]
    assert errors["untouched"] is True


@_torchrun_test
def test_terminate_on_nan_adds_no_host_read_and_only_its_device_veto_per_step(job):
    for r in job:
        # 10 steps, 9 gaps between batch ends: the device veto's all-reduce of each step (no
        # host agreement after on_backward_end), + 1 at the signal agreements after steps 1
        # and 9 (they run after that batch's end: in the gap that follows it)
        assert r["nan_collectives"] == [2, 1, 1, 1, 1, 1, 1, 1, 2]
        # the steady batches 1..8 of 10: none, but the signal agreement's read after step 9
        assert r["nan_host_reads"] == [0, 0, 0, 0, 0, 0, 0, 1]


@_torchrun_test
@pytest.mark.parametrize("when", ["nan_epoch_end", "nan_mid_epoch"])
def test_a_nan_on_one_rank_skips_the_step_on_both_and_stops_both_together(job, when):
    r0, r1 = (r[when] for r in job)
    assert r0["epochs"] == r1["epochs"] == [0]
    assert r0["steps"] == r1["steps"] == 3  # steps 1-3; step 4 (the NaN) and later skipped
    assert r0["ran"] == r1["ran"]
    # epoch end: all 6 batches of epoch 0; every step: stopped at the agreement after step 5
    assert len(r0["ran"]) == (6 if when == "nan_epoch_end" else 5)
    assert _equal(r0["params"], r1["params"])
    assert _equal(r0["params"], r0["after"][2])  # the weights of the last finite step
    assert not _equal(r0["after"][1], r0["after"][2])  # which did move the weights


def test_one_process_trains_the_fsdp_object_as_the_string():
    def run(strategy):
        torch.manual_seed(0)
        model = fitkit.Model(nn.Linear(2, 1), device="cpu", strategy=strategy)
        model.compile(optimizer="sgd", loss="mse")
        model.fit(torch.ones(8, 2), torch.arange(8.0).unsqueeze(1), batch_size=4, epochs=2, verbose=0)
        return [p.detach() for p in model.module.parameters()]

    assert _equal(
        run(FSDP(wrap=[nn.Linear], mixed_precision=torch.bfloat16, activation_checkpointing=True)), run("fsdp")
    )


def test_fsdp_options_are_checked_at_construction():
    with pytest.raises(TypeError, match="Expected `activation_checkpointing` to be a bool"):
        FSDP(activation_checkpointing="yes")
    fix = r"strategy=FSDP\(wrap=\[MyBlock\]\) or strategy=DDP\(find_unused_parameters=True\)"
    with pytest.raises(TypeError, match=fix):
        fitkit.Model(nn.Linear(1, 1), device="cpu", strategy=3)
    assert FSDP(wrap="GPT2Block").units(nn.Sequential(nn.Linear(1, 1))) == []


@_torchrun_test
def test_a_device_veto_only_callback_that_vetoes_on_the_host_is_refused(job):
    for r in job:
        message, untouched = r["host_veto"]
        assert "declaring `device_veto_only = True` vetoed an optimizer step on the host" in message
        assert "Fix: pass the decision as a device tensor" in message
        assert untouched  # that step never happened


def test_ddp_options_are_checked_at_construction_and_train_plainly_on_one_process():
    from fitkit.distributed import DDP

    with pytest.raises(TypeError, match="find_unused_parameters"):
        DDP(find_unused_parameters="yes")
    assert DDP(static_graph=True).kwargs() == {"static_graph": True}
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(2, 1), device="cpu", strategy=DDP(find_unused_parameters=True))
    model.compile(optimizer="sgd", loss="mse")
    assert model.fit(torch.zeros(4, 2), torch.zeros(4, 1), verbose=0).epoch == [0]


def test_a_wrap_name_that_matches_no_submodule_is_refused_at_model_construction():
    net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"names 'Lineer'.*Did you mean 'Linear'.*Classes in the model: Linear, ReLU"):
        fitkit.Model(net, device="cpu", strategy=FSDP(wrap=["Lineer"]))
    fitkit.Model(net, device="cpu", strategy=FSDP(wrap=["Linear"]))  # the exact name is fine


@_torchrun_test
def test_a_hugging_face_model_built_from_its_config_on_the_meta_device_trains_sharded(job):
    """GPT-2 from a config under ``torch.device("meta")``: each rank holds half the parameters,
    the model's own ``init_weights()`` gives them their initial values (std 0.02 =
    ``initializer_range``, LayerNorm weights 1, embeddings still tied to the head), the first
    loss is near ln(64) = 4.16 and training lowers it; both ranks agree."""
    r0, r1 = job[0]["hf_meta"], job[1]["hf_meta"]
    assert r0 == r1
    assert r0["local"] * 2 == r0["numel"] and r0["tied"] and r0["ln"] == 1.0
    assert r0["std"] == pytest.approx(0.02, rel=0.05)
    assert abs(r0["start"] - math.log(64)) < 0.1
    assert r0["losses"][2] < r0["losses"][0]


@_torchrun_test
def test_a_model_built_on_the_meta_device_is_sharded_before_it_exists(job):
    """``with torch.device("meta"): GPT(...)`` then strategy="fsdp": each rank allocates only its
    shards (its peak memory grows by about half of the 170 MB model, well under the whole) and
    initialises them with the GPT's own init_weights from its own stream (the ranks' shards are
    different draws; the full weights have GPT-2's spreads); tied weights stay tied; it trains."""
    r0, r1 = job
    for r in (r0, r1):
        meta = r["meta"]
        assert meta["local_numel"] * 2 == pytest.approx(meta["numel"], rel=0.01)
        assert 0.3 * meta["full_bytes"] < meta["grew"] < 0.75 * meta["full_bytes"], meta["grew"] / meta["full_bytes"]
        assert meta["tied"] and meta["steps"] == 2
        assert meta["head_std"] == pytest.approx(0.02, rel=0.05)
        assert meta["proj_std"] == pytest.approx(0.02 / (2 * 6) ** 0.5, rel=0.05)
        assert 4.5 < meta["loss"] < 6.0  # ln(256) = 5.55 at the start: a sane init (5.0004 measured)
    assert not torch.equal(r0["meta"]["head"], r1["meta"]["head"])  # two shards, two independent draws


def test_a_model_built_on_the_meta_device_is_materialised_on_one_process():
    """One process (any strategy): the whole module is allocated on the device and initialised
    by its init_weights (GPT: N(0, 0.02), ties kept), or by each layer's reset_parameters."""
    from fitkit.layers import GPT

    torch.manual_seed(0)
    with torch.device("meta"):
        gpt = GPT(vocab_size=65, block_size=8, n_layer=2, n_head=2, n_embd=32)
    fitkit.Model(gpt, device="cpu", strategy="fsdp")
    assert gpt.lm_head.weight.device.type == "cpu" and gpt.embed.wte.weight is gpt.lm_head.weight
    with torch.no_grad():
        assert gpt.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert gpt.blocks[1].mlp.fc2.weight.std().item() == pytest.approx(0.01, rel=0.05)  # 0.02 / sqrt(2 * 2)
        assert all(b.abs().sum() == 0 for n, b in gpt.named_parameters() if n.endswith(".bias") and "ln" not in n)
        assert torch.equal(gpt.ln_f.weight, torch.ones(32))
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model = fitkit.Model(net, device="cpu")
    assert net[1].running_var.tolist() == [1.0] * 4 and net[1].num_batches_tracked.item() == 0
    model.compile(optimizer="sgd", loss="mse")
    model.fit(torch.randn(8, 3), torch.randn(8, 4), batch_size=4, verbose=0)
    assert model.global_step == 2
