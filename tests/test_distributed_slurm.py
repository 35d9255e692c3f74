"""The SLURM requeue recipe of the scaling-out tutorial, run as SLURM runs it: the batch script is
taken from the docs as written, with stand-ins for ``srun`` (one node: it runs its command) and
``scontrol`` on ``PATH`` and SLURM's variables set. SIGTERM goes to every process of the job step
(``--signal=TERM@120``: torchrun and each worker, which torchrun then signals again); the job
stops at one step with a backup, and the requeued job (the same script again) resumes there,
redoing no step, and ends with the weights of an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from _dist_scenarios import data, net
from _torchrun import TESTS_DIR, free_port

import fitkit

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DOCS = TESTS_DIR.parent / "docs" / "tutorials" / "07_scaling_out.rst"

TRAIN = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
import torch, fitkit
from fitkit.distributed import rank
from _dist_scenarios import data, net

class WaitAtStep3(fitkit.callbacks.Callback):  # first job only: the test signals while every rank is here
    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == 3 and not os.path.exists("requeued"):
            open(f"at3-{{rank()}}", "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists("go") and time.monotonic() < deadline:
                time.sleep(0.01)

torch.manual_seed(0)
x, y, w = data(40)
model = fitkit.Model(net(), device="cpu")
model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss="mse", metrics=["mae"])
begun = []
seen = fitkit.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: begun.append(model.global_step))
model.fit(x, y, sample_weight=w, batch_size=4, epochs=3, shuffle=True, verbose=0,
          callbacks=[fitkit.callbacks.BackupAndRestore("runs/backup"), WaitAtStep3(), seen])
params = {{k: v.detach().clone() for k, v in model.module.named_parameters()}}
torch.save({{"first": begun[0], "steps": model.global_step, "params": params}}, f"done-{{rank()}}.pt")
"""


def _batch_script(port: int) -> str:
    """The tutorial's SLURM batch script, for one node of 2 CPU processes on a free port."""
    text = DOCS.read_text()
    block = re.search(r"\.\. code-block:: bash\n\n((?:   .*\n|\n)*?   #!/bin/bash\n(?:   .*\n)+)", text)
    assert block is not None, "the tutorial's SLURM script is gone"
    script = "\n".join(line[3:] for line in block.group(1).splitlines() if line.startswith("   "))
    script = script[script.index("#!/bin/bash"):]
    assert "--nproc_per_node=8" in script and ":29500" in script and "train.py" in script
    return script.replace("--nproc_per_node=8", "--nproc_per_node=2").replace(":29500", f":{port}")


def _stand_ins(folder: Path) -> Path:
    """``srun`` (one node, one task: it runs its command) and ``scontrol show hostnames``."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\nexec \"$@\"\n")
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\nif [ \"$1 $2\" = 'show hostnames' ]; then echo \"$3\"; else exit 1; fi\n"
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (as SLURM finds a step's processes in its cgroup)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def test_the_tutorials_slurm_requeue_recipe_stops_with_a_backup_and_the_requeued_job_redoes_no_step(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN.format(tests=str(TESTS_DIR)))
    (tmp_path / "job.sh").write_text(_batch_script(free_port()))
    env = {**os.environ, "PATH": f"{_stand_ins(tmp_path)}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "FITKIT_DEVICE": "cpu", "FITKIT_SIGNAL_SECONDS": "1e-9",
           "PYTHONPATH": os.pathsep.join([str(TESTS_DIR.parent), os.environ.get("PYTHONPATH", "")]),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
           "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"}  # fmt: skip
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    job = subprocess.Popen(["bash", "job.sh"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 150
        while not all((tmp_path / f"at3-{r}").exists() for r in (0, 1)):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=30)[0][-3000:]
            time.sleep(0.05)
        for pid in _descendants(job.pid):  # --signal=TERM: every process of the step, not the batch shell
            os.kill(pid, signal.SIGTERM)
        (tmp_path / "go").touch()
        out = job.communicate(timeout=120)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0, out[-3000:]  # stopped, not finished: SLURM requeues it
    assert "fitkit: SIGTERM received: stopping after optimizer step 3" in out, out[-3000:]
    assert torch.load(tmp_path / "runs" / "backup" / "backup.pt", weights_only=True)["global_step"] == 3
    assert not list(tmp_path.glob("done-*.pt"))

    (tmp_path / "requeued").touch()  # the requeued job: the same script from the top
    again = subprocess.run(["bash", "job.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    r0, r1 = (torch.load(tmp_path / f"done-{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["first"] == r1["first"] == 3 and r0["steps"] == r1["steps"] == 15  # 40 rows / (2 x 4): 5 per epoch

    torch.manual_seed(0)  # the uninterrupted run, on one process (batch 8 = 2 ranks x 4)
    x, y, w = data(40)
    ref = fitkit.Model(net(), device="cpu")
    ref.compile(optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss="mse", metrics=["mae"])
    ref.fit(x, y, sample_weight=w, batch_size=8, epochs=3, shuffle=True, verbose=0)
    for name, p in ref.module.named_parameters():
        assert torch.equal(r0["params"][name], r1["params"][name]), name
        torch.testing.assert_close(r0["params"][name], p.detach(), rtol=0, atol=1e-6)
