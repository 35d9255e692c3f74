"""Under torchrun: ``jit_compile`` under DDP compiles the module inside DDP's wrapper (one graph,
inductor on the CPU) and trains as the eager run does; under FSDP it compiles no graph (dynamo
leaves FSDP2's sharded root module to run eagerly; the speed tutorial says so)."""

from __future__ import annotations

import pytest
import torch
from _torchrun import run_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

JOB = """
import torch, fitkit
from torch._inductor.compile_fx import compile_fx
from fitkit.distributed import rank, world_size
from _dist_scenarios import data, net, full_params

graphs = []
def counting_inductor(gm, example_inputs):  # inductor, counting the graphs dynamo hands it
    graphs.append(len(gm.graph.nodes))
    return compile_fx(gm, example_inputs)

def run(strategy, jit):
    torch.manual_seed(0)
    x, y, _ = data(32)
    model = fitkit.Model(net(), device="cpu", strategy=strategy)
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit)
    h = model.fit(x, y, batch_size=8 // world_size(), epochs=2, shuffle=False, verbose=0)
    return {"params": full_params(model), "loss": h.history["loss"]}

res = {}
for strategy in ("auto", "fsdp"):
    graphs.clear()
    res[strategy] = {"compiled": run(strategy, {"backend": counting_inductor}), "graphs": list(graphs),
                     "eager": run(strategy, False)}
torch.save(res, OUT / f"rank{rank()}.pt")
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile")
    run_torchrun(JOB, out, timeout=400)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_jit_compile_under_torchrun_compiles_the_module_and_trains_as_eager(job, strategy):
    for res in job:
        got = res[strategy]
        # DDP: the module's forward inside the wrapper, one graph with no break (was 0: the wrapper
        # was compiled, and dynamo ran it eagerly); FSDP: none, as documented
        assert len(got["graphs"]) == (1 if strategy == "auto" else 0)
        assert got["compiled"]["loss"] == pytest.approx(got["eager"]["loss"], rel=1e-5)
        for name, p in got["eager"]["params"].items():
            torch.testing.assert_close(got["compiled"]["params"][name], p, rtol=1e-5, atol=1e-6)
