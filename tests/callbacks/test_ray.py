"""fitkit as a Ray Train worker (``fitkit.callbacks.RayReport``), on a local Ray cluster of 2
CPU workers: Ray's process group, ``Model(timeout=)`` refused there, fitkit's checkpoints
reported to Ray, and a restart after a worker dies resuming from the one Ray gives back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray Train is not installed (pip install '.[ray]' from a checkout)")

from _ray_scenario import EPOCHS, reference  # noqa: E402

import fitkit  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ray")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "FITKIT_DEVICE": "cpu",
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(TESTS / "_ray_scenario.py"), str(out)],
        env=env,
        cwd=out,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-10000:]}"
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return {
        "ranks": ranks,
        "result": torch.load(out / "result.pt", weights_only=False),
        "dir": out,
        "partial": [torch.load(out / f"partial{r}.pt", weights_only=False) for r in (0, 1)],
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_a_restart_resumes_from_the_checkpoint_ray_gives_back(run):
    ref = reference()
    assert (run["dir"] / "crashed").exists()  # the first attempt lost rank 1 at epoch 2
    for r in run["ranks"]:  # what the second attempt's workers saw
        assert r["world"] == 2
        assert r["epochs_run"] == [2, 3]  # epochs 0 and 1 came from Ray's checkpoint
        assert r["given"] is not None
        assert r["loss"] == pytest.approx(ref["loss"], abs=1e-6)  # History continued, as one process
        for p, q in zip(r["params"], ref["params"], strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert all(torch.equal(p, q) for p, q in zip(*(r["params"] for r in run["ranks"]), strict=True))
    given = [m for path, m in run["result"]["reports"] if path == run["ranks"][0]["given"]]
    assert [(m["epoch"], m["global_step"]) for m in given] == [(1, 10)]  # 37 rows, 5 steps an epoch


@pytest.mark.slow
@pytest.mark.distributed
def test_every_epoch_is_reported_with_fitkits_checkpoint(run):
    result = run["result"]
    assert result["files"] == [fitkit.callbacks.RayReport.checkpoint_name]
    assert result["metrics"]["epoch"] == EPOCHS - 1 and result["metrics"]["global_step"] == 5 * EPOCHS
    assert result["metrics"]["loss"] == pytest.approx(run["ranks"][0]["loss"][-1])
    # every epoch's report kept: 0 and 1 from the first attempt, 2 and 3 from the second
    assert sorted(m["epoch"] for _, m in result["reports"]) == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.distributed
def test_every_save_freq_report_and_the_last_step_that_save_freq_does_not_divide(run):
    # 3 epochs of 5 steps, save_freq=4: the run's step 15 is reported at its end (was: 12 last)
    for reported in run["partial"]:  # every worker reports the same steps
        assert reported == [(0, 4), (1, 8), (2, 12), (2, 15)]


@pytest.mark.slow
@pytest.mark.distributed
def test_model_timeout_is_refused_in_rays_process_group(run):
    for r in run["ranks"]:
        assert "TorchConfig(timeout_s=5)" in r["refused"] and "drop `timeout=`" in r["refused"]


def test_ray_report_outside_a_ray_worker_says_so():
    model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    before = [p.detach().clone() for p in model.module.parameters()]
    with pytest.raises(RuntimeError, match="does not run in a Ray Train worker"):
        model.fit(torch.zeros(4, 1), torch.zeros(4, 1), epochs=1, verbose=0, callbacks=[fitkit.callbacks.RayReport()])
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))


def test_ray_report_checks_its_arguments():
    with pytest.raises(ValueError, match="save_freq"):
        fitkit.callbacks.RayReport(save_freq=0)
    with pytest.raises(TypeError, match="checkpoint"):
        fitkit.callbacks.RayReport(checkpoint="yes")
