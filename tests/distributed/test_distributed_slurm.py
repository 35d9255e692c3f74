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
from pathlib import Path

import pytest
from _requeue import assert_resumed_like_uninterrupted, assert_stopped_at_step_3, job_env, wait_at_step_3, write_train
from _torchrun import TESTS_DIR, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DOCS = TESTS_DIR.parent / "docs" / "tutorials" / "07_scaling_out.rst"


def _batch_script(port: int) -> str:
    """The tutorial's SLURM batch script, for one node of 2 CPU processes on a free port."""
    text = DOCS.read_text()
    block = re.search(r"\.\. code-block:: bash\n\n((?:   .*\n|\n)*?   #!/bin/bash\n(?:   .*\n)+)", text)
    assert block is not None, "the tutorial's SLURM script is gone"
    script = "\n".join(line[3:] for line in block.group(1).splitlines() if line.startswith("   "))
    script = script[script.index("#!/bin/bash") :]
    assert "--nproc_per_node=8" in script and ":29500" in script and "train.py" in script
    lead = int(re.search(r"--signal=TERM@(\d+)", script)[1])  # torchrun's wait for its workers fits in the lead
    assert int(re.search(r"^export PET_SHUTDOWN_TIMEOUT=(\d+)", script, flags=re.M)[1]) < lead == 120
    return script.replace("--nproc_per_node=8", "--nproc_per_node=2").replace(":29500", f":{port}")


def _stand_ins(folder: Path) -> Path:
    """``srun`` (one node, one task: it runs its command) and ``scontrol show hostnames``."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nexec "$@"\n')
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nif [ "$1 $2" = \'show hostnames\' ]; then echo "$3"; else exit 1; fi\n'
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
    write_train(tmp_path)
    (tmp_path / "job.sh").write_text(_batch_script(free_port()))
    env = job_env(
        PATH=f"{_stand_ins(tmp_path)}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_NTASKS="1",
        SLURM_STEP_NUM_TASKS="1",
    )
    job = subprocess.Popen(
        ["bash", "job.sh"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_at_step_3(tmp_path, lambda: job.poll() is None, lambda: job.communicate(timeout=30)[0][-3000:])
        for pid in _descendants(job.pid):  # --signal=TERM: every process of the step, not the batch shell
            os.kill(pid, signal.SIGTERM)
        (tmp_path / "go").touch()
        out = job.communicate(timeout=120)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0, out[-3000:]  # stopped, not finished: SLURM requeues it
    assert_stopped_at_step_3(tmp_path, out)

    (tmp_path / "requeued").touch()  # the requeued job: the same script from the top
    again = subprocess.run(["bash", "job.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert_resumed_like_uninterrupted(tmp_path)
