"""The process group, this process's rank, and the collectives fitkit runs on it.

Every function works on one process too (no group: rank 0 of 1, collectives return their
input), so callers need no ``if is_distributed()`` of their own.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

_started_here = False  # whether fitkit started the process group (and so tears it down)
_failing = False  # an uncaught exception is ending this process (no exit barrier then)


# -- where am I --------------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    """Whether ``torchrun`` (or an equivalent launcher) started this process in a group of > 1.

    Reads ``WORLD_SIZE``, ``RANK`` and ``MASTER_ADDR``, which torchrun sets for every worker.
    """
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return size > 1 and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def check_not_bare_srun(environ: Any = None) -> None:
    """Refuse a process that SLURM's ``srun`` started as one of several tasks without torchrun.

    ``srun --ntasks=4 python train.py`` starts four copies; without torchrun's variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``) each would train alone on all the data and write
    the same files. A job step's task has a step variable (``SLURM_STEP_ID``, ``SLURM_STEPID``
    or ``SLURM_STEP_NUM_TASKS``; the batch script itself has none, though it has the job's
    ``SLURM_NTASKS``) and its task count in the first of ``SLURM_STEP_NUM_TASKS``,
    ``SLURM_NTASKS`` and ``SLURM_NPROCS`` that is set (older ``srun`` and other launchers set
    only the last two). A process group started by the user is accepted as it is.

    Raises:
        RuntimeError: a job step's task count > 1 and no torchrun variables, naming the fix.

    Example:
        >>> check_not_bare_srun({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"})  # one task: fine
        >>> check_not_bare_srun({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"})  # the batch script: fine
        >>> check_not_bare_srun({"SLURM_STEP_ID": "0", "SLURM_NPROCS": "4", "SLURM_PROCID": "2"})
        Traceback (most recent call last):
        ...
        RuntimeError: This process is task 2 of 4 that srun started without torchrun...
    """
    env = os.environ if environ is None else environ
    if not any(k in env for k in ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS")):
        return  # not a job step's task (the batch script, or no SLURM)
    given = [env[k] for k in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if env.get(k)]
    try:
        tasks = int(given[0]) if given else 1
    except ValueError:
        return
    if tasks <= 1:
        return
    raise RuntimeError(
        f"This process is task {env.get('SLURM_PROCID', '?')} of {tasks} that srun started without torchrun: "
        "each task would train alone on all the data and write the same files. Fix: start one task per node "
        "and let torchrun start the processes (srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES "
        "--nproc_per_node=N --rdzv_endpoint=HEAD:29500 train.py; see the scaling-out guide), or start "
        "torch.distributed's process group yourself before fitkit.Model()."
    )


def is_distributed() -> bool:
    """Whether a default process group of more than one process is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_rank_zero() -> bool:
    """Whether this process writes files: rank 0 of ``torch.distributed``, or not distributed.

    Callbacks that write files or print check it, so a ``torchrun`` job writes each file once.

    Example:
        >>> is_rank_zero()
        True
    """
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def say(verbose: Any, message: str) -> None:
    """Print ``message`` when ``verbose`` is truthy, on rank 0 only (callbacks' messages).

    Example:
        >>> say(1, "Epoch 3: early stopping"); say(0, "not printed")
        Epoch 3: early stopping
    """
    if verbose and is_rank_zero():
        print(message)


def rank() -> int:
    """This process's rank in the default group (0 when not distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Processes in the default group (1 when not distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def check_timeout(timeout: Any) -> float | None:
    """``Model(timeout=...)``, else ``FITKIT_DIST_TIMEOUT``: seconds, or ``None`` (torch's default).

    Example:
        >>> check_timeout(30), check_timeout(None)
        (30.0, None)
        >>> check_timeout(0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Expected `timeout` to be a positive number of seconds. Received: timeout=0. Fix: ...
    """
    where = "timeout"
    if timeout is None and os.environ.get("FITKIT_DIST_TIMEOUT"):
        where, timeout = "FITKIT_DIST_TIMEOUT", os.environ["FITKIT_DIST_TIMEOUT"]
        try:
            timeout = float(timeout)
        except ValueError:
            pass
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"Expected `{where}` to be a number of seconds. Received: {where}={timeout!r} "
            f"({type(timeout).__name__}). Fix: pass e.g. timeout=600."
        )
    if not timeout > 0:
        raise ValueError(
            f"Expected `{where}` to be a positive number of seconds. Received: {where}={timeout!r}. "
            "Fix: pass e.g. timeout=600 (10 minutes), or None for torch's default."
        )
    if not math.isfinite(timeout) or timeout > _MAX_TIMEOUT:  # torch keeps it as a timedelta
        raise ValueError(
            f"Expected `{where}` to be a finite number of seconds (at most {_MAX_TIMEOUT:.0f}, a timedelta's "
            f"limit). Received: {where}={timeout!r}. Fix: pass a long but finite wait, e.g. timeout=7 * 24 * 3600 "
            "(a week), or None for torch's default."
        )
    return float(timeout)


_MAX_TIMEOUT = float(999_999_999 * 86_400)  # datetime.timedelta.max, in whole days


def check_timeout_applies(timeout: Any) -> None:
    """Refuse ``Model(timeout=...)`` when a process group that fitkit did not start is running.

    Ray Train's ``TorchTrainer`` starts the group before the training function runs (and a
    script may start its own): its timeout was fixed then, and fitkit cannot change it, so the
    argument would be silently ignored. (``FITKIT_DIST_TIMEOUT`` applies only to a group fitkit
    starts.)

    Raises:
        ValueError: ``timeout`` given and such a group running, naming where to set it.

    Example:
        >>> check_timeout_applies(30)  # no group running: fitkit will start it with this timeout
    """
    if timeout is None or _started_here or not (dist.is_available() and dist.is_initialized()):
        return
    raise ValueError(
        f"Model(timeout={timeout!r}) cannot apply: the process group was started before fitkit (by Ray Train's "
        "TorchTrainer, or by the script), with its own timeout. Fix: drop `timeout=` and set it where the group "
        f"starts: TorchTrainer(..., torch_config=ray.train.torch.TorchConfig(timeout_s={timeout!r})), or "
        f"torch.distributed.init_process_group(..., timeout=datetime.timedelta(seconds={timeout!r}))."
    )


def init_if_needed(device: torch.device, timeout: float | None = None) -> bool:
    """Start the default process group when launched by torchrun and none is running yet.

    nccl for a CUDA ``device`` (made the current device first), gloo otherwise. A group that
    fitkit starts is destroyed at interpreter exit; a group the user started is left alone.
    An exception that ends the script is also written to torchrun's error file (as torch's
    ``@record`` does), so torchrun's failure summary shows the failing rank's traceback.

    Args:
        device: this rank's device (``cuda:LOCAL_RANK`` under torchrun on GPUs).
        timeout: seconds a collective waits for the other ranks; ``None``: torch's default.

    Returns:
        Whether this call started the group.
    """
    global _started_here
    if not dist.is_available() or dist.is_initialized():
        return False
    if not launched_by_torchrun():
        check_not_bare_srun()
        return False
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    kwargs.update(_restart_store(timeout))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)
    _started_here = True
    atexit.register(_teardown)
    _record_uncaught()
    return True


def _restart_store(timeout: float | None) -> dict[str, Any]:
    """A restarted torchrun attempt: the agent's store under a prefix of this attempt's own.

    torchrun keeps its store across restarts, so the keys of the attempt before (each rank's
    gloo address) are still there and a restarted rank may connect to a process that is gone.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt in ("", "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    wait = datetime.timedelta(seconds=timeout or 300)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=wait,
    )
    return {
        "store": dist.PrefixStore(f"fitkit/attempt{attempt}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


def _record_uncaught() -> None:
    """Write an uncaught exception to ``TORCHELASTIC_ERROR_FILE`` before the usual traceback."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE") or getattr(sys.excepthook, "_fitkit", False):
        return
    previous = sys.excepthook

    def hook(kind: Any, value: Any, tb: Any) -> None:
        global _failing
        _failing = True
        from fitkit.distributed import progress

        where = progress.where_ranks_were()  # the ranks behind this one: hung or slow there
        progress.mark_failed(kind.__name__)  # a peer's SIGTERM then exits at once
        message = f"{kind.__name__}: {value}" + (f"\n{where}" if where else "")
        try:  # the format of torch's ErrorHandler.record_exception, with this exception's stack
            data = {
                "message": {
                    "message": message,
                    "extraInfo": {
                        "py_callstack": "".join(traceback.format_exception(kind, value, tb))
                        + (f"{where}\n" if where else ""),
                        "timestamp": str(int(time.time())),
                    },
                }
            }
            # whole or not at all: torchrun's agent SIGTERMs this process when another rank died
            # first, and a half-written file makes the agent itself fail to parse it (seen on a
            # loaded machine: the job then ends without its restart)
            path = os.environ["TORCHELASTIC_ERROR_FILE"]
            with open(f"{path}.{os.getpid()}.tmp", "w") as f:
                json.dump(data, f)
            os.replace(f"{path}.{os.getpid()}.tmp", path)
        except OSError:
            pass
        finally:
            previous(kind, value, tb)
            if where:
                print(where, file=sys.stderr, flush=True)

    hook._fitkit = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def exiting_on_error() -> bool:
    """Whether an uncaught exception is ending this process (read at interpreter exit)."""
    return _failing or getattr(sys, "last_value", None) is not None


def _teardown() -> None:
    if _started_here and dist.is_available() and dist.is_initialized():
        if exiting_on_error():
            # A failing rank leaves at once: the other ranks wait in a collective for this one
            # (DDP's all-reduce, an agreement), which fails as soon as this process is gone and
            # its connections close. Waiting in the exit barrier instead would hold them for the
            # group's timeout (30 minutes on gloo): the barrier's timeout applies on rank 0 only.
            # Nor is the group destroyed: that may wait for the peers' pending work.
            return
        if dist.get_backend() == "gloo":
            # Every rank reaches its exit before any destroys the group: a gloo group destroyed
            # while a peer still tears down its own can abort that peer's exit (SIGABRT, seen
            # on a loaded 2-core machine). A peer that died instead is waited for 10 s at most.
            with contextlib.suppress(Exception):  # teardown never raises
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))
        dist.destroy_process_group()


def _comm_device() -> torch.device:
    """Where collectives want their tensors: the current CUDA device for nccl, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- collectives -------------------------------------------------------------------------
def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` over ranks, on ``t``'s device (a device op: no host sync on nccl).

    Example:
        >>> all_reduce_sum(torch.tensor([1.0, 2.0]))  # one process: unchanged
        tensor([1., 2.])
    """
    if not is_distributed():
        return t
    dev = _comm_device()
    buf = t.detach().to(dev, copy=True)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf.to(t.device)


def any_rank(*flags: bool) -> tuple[bool, ...] | bool:
    """For each flag: whether it is set on any rank (one all-reduce and one host read).

    Example:
        >>> any_rank(True), any_rank(False, True)
        (True, (False, True))
    """
    if is_distributed():
        t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32).to(_comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flags = tuple(bool(v) for v in t.tolist())
    return bool(flags[0]) if len(flags) == 1 else tuple(bool(f) for f in flags)


def any_rank_on_device(flag: torch.Tensor) -> torch.Tensor:
    """A device bool set where ``flag`` is set on any rank: one all-reduce, no host read.

    Example:
        >>> any_rank_on_device(torch.tensor(True))
        tensor(True)
    """
    if not is_distributed():
        return flag
    t = flag.to(_comm_device(), torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.to(flag.device).bool()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (pickled: for small or CPU-side objects only)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast_from_zero(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``t`` on every rank (same shape and dtype on all ranks), on ``t``'s device."""
    buf = t.to(_comm_device(), copy=True)
    dist.broadcast(buf, src=0)
    return buf.to(t.device)


def _broadcast_states(tensors: Iterable[torch.Tensor]) -> None:
    """Overwrite every tensor in place with rank 0's values (parameters, buffers)."""
    with torch.no_grad():
        for t in tensors:
            t.copy_(_broadcast_from_zero(t.detach()))


# -- exact reductions of the loss --------------------------------------------------------
def known_rows(host_rows: Any, sizes: list[Any], step: int) -> int | None:
    """The rows of global batches ``step, step + 1, ...`` (one per size) summed, when known on the
    host: plain row counts (no sample weights) and ``host_rows`` given (fitkit's own shards)."""
    tensors = any(isinstance(s, torch.Tensor) for s in sizes)
    if host_rows is None or (tensors and not getattr(host_rows, "exact", False)):
        return None
    return sum(host_rows(step + i) for i in range(len(sizes)))


def global_share(sizes: list[Any], host_total: int | None = None) -> torch.Tensor | float:
    """``total / W`` with ``total`` the sum of ``sizes`` over all ranks, as a device tensor.

    ``host_total``: that total, known on the host (every rank's rows of the global batch, from
    fitkit's own sharding): the share is then a Python float and no collective runs.

    ``size / global_share(sizes)`` is then a micro-batch's share ``size * W / total`` of the
    global group: DDP divides the summed gradients by ``W``, so scaling each rank's mean loss by
    it gives the single-process mean over the global group. A group whose weights are all zero
    gets a share of 0, not 0/0. Host sizes are filled into the device tensor (a kernel
    argument, no copy), so nothing waits for the device.
    """
    if host_total is not None:
        return (host_total or 1) / dist.get_world_size()
    total = sum(sizes)
    dev = _comm_device()
    dtype = torch.float64 if dev.type != "mps" else torch.float32
    if isinstance(total, torch.Tensor):
        t = total.detach().to(dev, dtype).reshape(1)
    else:
        t = torch.full((1,), float(total), dtype=dtype, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    t = torch.where(t == 0, torch.ones_like(t), t)[0] / dist.get_world_size()
    device = sizes[0].device if isinstance(sizes[0], torch.Tensor) else None
    return t if device is None or device == t.device else t.to(device)


def reduce_loss_totals(total: torch.Tensor, count: float, wsum: torch.Tensor | None):
    """Sum an epoch's loss total, sample count and weight sum over ranks (one all-reduce).

    Returns:
        ``(total, count, wsum)`` over all ranks: a device tensor, a float, a device tensor or
        ``None`` when no rank had sample weights.
    """
    vec = torch.zeros(4, dtype=total.dtype, device=total.device)
    vec[0] = total
    vec[1] = float(count)  # a host number: filled by a kernel, no copy
    if wsum is not None:
        vec[2] = wsum
        vec[3] = 1.0
    vec = all_reduce_sum(vec)
    count, has_w = vec[1::2].tolist()  # one host sync, once per epoch
    return vec[0], count, (vec[2] if has_w else None)
