"""Run a Python script under ``torchrun --nproc_per_node=N`` (gloo on CPU) from a test.

The launched script writes its results to files (one per rank) in a folder the test owns;
:func:`run_torchrun` checks the exit status and shows the workers' output when it fails.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent


def free_port() -> int:
    """A TCP port that was free a moment ago (for ``--master_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(
    body: str,
    workdir: Path,
    nproc: int = 2,
    timeout: float = 120,
    check: bool = True,
    args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Write ``body`` to ``workdir/job.py`` and run it on ``nproc`` CPU processes.

    The script runs with ``tests/`` on ``sys.path`` (so it can import the test helpers),
    ``OMP_NUM_THREADS=1`` and ``FITKIT_DEVICE=cpu``; ``OUT`` in its globals is ``workdir``.

    Returns:
        The finished process (stdout and stderr of all ranks, interleaved).

    ``check=False`` leaves the exit status to the caller, for scripts that record their results
    in files before the processes end (gloo's teardown after a signal may abort a process that
    has finished its work). ``args``: more torchrun options (``--max-restarts=1``).

    Raises:
        AssertionError: a non-zero exit status (with ``check``) or a timeout, with the output shown.
    """
    script = workdir / "job.py"
    header = (
        f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r})\nfrom pathlib import Path\nOUT = Path({str(workdir)!r})\n"
    )
    script.write_text(header + textwrap.dedent(body))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FITKIT_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *args,
        str(script),
    ]
    try:
        proc = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(
            f"torchrun timed out after {timeout}s.\nstdout:\n{out[-5000:]}\nstderr:\n{err[-10000:]}"
        ) from None
    assert proc.returncode == 0 or not check, (
        f"torchrun exited with {proc.returncode}.\nstdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-10000:]}"
    )
    return proc
