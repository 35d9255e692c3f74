"""The Kubernetes recipe of the scaling-out tutorial, run as the Kubeflow training operator and
the kubelet run it, on one machine: the ``PyTorchJob`` is taken from the docs as written, and each
of its pods (the Master and the Worker replica) is a process group of its container's command,
in the shared working folder (the volume), with the variables the operator sets in a pod. The
job is scaled to one process per pod (``nprocPerNode: "1"``: 2 ranks, gloo on the CPU), with
the master's address 127.0.0.1 and a free port.

Stopping a pod (a deletion, a drain, a preemption) sends SIGTERM to the main process of its
container, torchrun here, which forwards it to its workers; both pods are stopped at step 3 and
must be gone within ``terminationGracePeriodSeconds`` (the kubelet's SIGKILL comes then), each
worker's ``fit`` ending with status 143 after the backup and each container with torchrun's 1
(a failure: ``OnFailure`` restarts it). torchrun's own wait for its workers, set by the
container's ``PET_SHUTDOWN_TIMEOUT``, must fit in that grace period. The pods then start again
with the same command (the operator recreates them): the run resumes at step 3, redoes no step
and ends with the weights of an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from _requeue import assert_resumed_like_uninterrupted, assert_stopped_at_step_3, job_env, wait_at_step_3, write_train
from _torchrun import TESTS_DIR, free_port
from torch.distributed.run import parse_args

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DOCS = TESTS_DIR.parent / "docs" / "tutorials" / "07_scaling_out.rst"


def _pytorchjob() -> dict:
    """The tutorial's ``PyTorchJob``: the YAML block of its Kubernetes section, parsed."""
    text = DOCS.read_text()
    assert "\nKubernetes\n----------\n" in text, "the tutorial's Kubernetes section is gone"
    section = text.split("\nKubernetes\n----------\n", 1)[1]
    block = re.search(r"\.\. code-block:: yaml\n\n((?:   .*\n|\n)+?)(?=\S)", section)
    assert block is not None, "the tutorial's PyTorchJob is gone"
    return yaml.safe_load(textwrap.dedent(block.group(1)))


def _operator_env(job: dict, replica: str, index: int, port: int) -> dict[str, str]:
    """The variables the Kubeflow training operator (v1) adds to the container of one pod.

    For a job with a Master replica: the master's address and port, as ``MASTER_*`` and as
    torchrun's ``PET_MASTER_*``; ``WORLD_SIZE`` (all replicas times ``nprocPerNode``) and
    ``RANK`` = ``PET_NODE_RANK`` (the Master is 0, Worker ``i`` is ``i + 1``); ``PET_NNODES``
    (all replicas; an ``elasticPolicy`` sets a range instead), ``PET_NPROC_PER_NODE`` and
    ``PYTHONUNBUFFERED``. The address would be the master pod's Service name; here it is
    127.0.0.1, and the port (23456 unless the container names one) a free one.
    """
    spec = job["spec"]
    replicas = sum(r.get("replicas", 1) for r in spec["pytorchReplicaSpecs"].values())
    node = index + (1 if replica == "Worker" else 0)
    nproc = spec["nprocPerNode"]
    return {
        "PYTHONUNBUFFERED": "1",
        "MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PET_MASTER_PORT": str(port),
        "WORLD_SIZE": str(replicas * int(nproc)),
        "RANK": str(node),
        "PET_NODE_RANK": str(node),
        "PET_NNODES": str(replicas),
        "PET_NPROC_PER_NODE": nproc,
    }


def _container(job: dict, replica: str) -> dict:
    spec = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == "pytorch"]  # the one the operator sets up
    return container


def _start_pods(job: dict, folder: Path, port: int) -> dict[str, subprocess.Popen]:
    """One process group per pod: its container's command and args, its env and the operator's."""
    pods = {}
    for replica, spec in job["spec"]["pytorchReplicaSpecs"].items():
        container = _container(job, replica)
        for index in range(spec.get("replicas", 1)):
            env = job_env(
                PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                **{e["name"]: str(e["value"]) for e in container.get("env", [])},
                **_operator_env(job, replica, index, port),
            )
            pods[f"{replica}-{index}"] = subprocess.Popen(
                [*container["command"], *container.get("args", [])],
                cwd=folder,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
    return pods


def _wait_all(pods: dict[str, subprocess.Popen], timeout: float, what: str) -> str:
    """The pods' output once all have exited; ``timeout`` seconds after the call the rest are
    killed (SIGKILL to every process of the pod, as the kubelet does after the grace period)
    and the test fails, naming ``what`` the pods had that long for."""
    deadline, out = time.monotonic() + timeout, []
    for name, pod in pods.items():
        try:
            out.append(f"--- pod {name}\n" + pod.communicate(timeout=max(0.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            _kill(pods)
            raise AssertionError(f"pod {name} still running {timeout} s after {what}") from None
    return "\n".join(out)


def _kill(pods: dict[str, subprocess.Popen]) -> None:
    for pod in pods.values():
        if pod.poll() is None:
            os.killpg(pod.pid, signal.SIGKILL)
            pod.wait()


def test_the_tutorials_pytorchjob_stops_with_a_backup_within_the_grace_period_and_resumes_redoing_no_step(tmp_path):
    job = _pytorchjob()
    spec = job["spec"]
    assert job["kind"] == "PyTorchJob" and spec["nprocPerNode"] == "8"
    assert sorted(spec["pytorchReplicaSpecs"]) == ["Master", "Worker"]
    for replica in spec["pytorchReplicaSpecs"].values():
        assert replica["replicas"] == 1 and replica["restartPolicy"] == "OnFailure"
    grace = spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["terminationGracePeriodSeconds"]
    container = _container(job, "Master")
    assert container["command"][-1] == "train.py"
    env = {e["name"]: str(e["value"]) for e in container.get("env", [])}
    with pytest.MonkeyPatch.context() as mp:  # torchrun, as the pod's env configures it
        for key, value in env.items():
            mp.setenv(key, value)
        launch = parse_args(container["command"][1:])
    assert launch.shutdown_timeout == 110 < grace == 120  # its workers' stop fits in the pod's grace period
    spec["nprocPerNode"] = "1"  # 2 pods of 1 CPU process: 2 ranks
    write_train(tmp_path)
    port = free_port()

    pods = _start_pods(job, tmp_path, port)
    try:
        wait_at_step_3(
            tmp_path,
            lambda: all(p.poll() is None for p in pods.values()),
            lambda: (_kill(pods), _wait_all(pods, 30, "a pod ended"))[1][-3000:],
        )
        for pod in pods.values():  # the kubelet stops each container: SIGTERM to its main process
            os.kill(pod.pid, signal.SIGTERM)
        (tmp_path / "go").touch()
        out = _wait_all(pods, grace, "SIGTERM (terminationGracePeriodSeconds)")
    finally:
        _kill(pods)
    # The containers' status is torchrun's, 1 after a forwarded SIGTERM: failed, so restarted (OnFailure).
    assert [p.returncode for p in pods.values()] == [1, 1], out[-3000:]
    assert_stopped_at_step_3(tmp_path, out)

    (tmp_path / "requeued").touch()  # the recreated pods: the same command, the same variables
    pods = _start_pods(job, tmp_path, port)
    try:
        out = _wait_all(pods, 180, "they started")
    finally:
        _kill(pods)
    assert all(p.returncode == 0 for p in pods.values()), out[-3000:]
    r0, r1 = assert_resumed_like_uninterrupted(tmp_path)
    assert (r0["node"], r1["node"]) == (0, 1)  # rank 0 in the Master pod, rank 1 in the Worker pod
