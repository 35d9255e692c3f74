"""Scale-out under ``torchrun``: process group, DDP / FSDP2, data shards, exact reductions.

Launched by ``torchrun`` (``WORLD_SIZE`` > 1), the same script trains data-parallel with no
code change: :class:`fitkit.Model` starts the process group (nccl on CUDA, gloo on CPU) on
its ``LOCAL_RANK`` device, wraps the module at ``compile()`` (DDP, or FSDP2 ``fully_shard``
with ``strategy="fsdp"``) and shards every input per rank. fitkit launches nothing itself.

What makes the numbers exact, not approximately right:

- **No duplicates.** In-memory tensors: one global permutation per epoch (drawn on rank 0 from
  the global torch generator, exactly as one process draws it, then broadcast), cut into global
  batches of ``batch_size * world_size`` samples; rank ``r`` gets the ``r``-th contiguous
  share of each. A one-process run with ``batch_size * world_size`` sees the same global
  batches. A ``DataLoader`` gets a ``DistributedSampler`` (same shuffle and batch size); the
  samples it repeats to even out the shards are cut off on the host, where their positions
  are known (local position ``j`` on rank ``r`` is global position ``r + j * W``).
- **Same steps on every rank.** A rank whose share of the short last batch is empty still runs
  the step (forward and backward on an empty batch, zero contribution), so DDP's all-reduce
  never waits for a rank that is not coming.
- **Exact gradients.** Each rank backpropagates ``sum(w * l) * W / global_weight``, with
  ``global_weight`` all-reduced on the device (no host sync), so DDP's gradient average is the
  single-process mean over the global batch, short last batches included.
- **Exact logs.** Epoch loss totals and counts are summed over ranks before the division;
  torchmetrics metrics sync their states in ``compute()``. Every rank gets the same History.

What a script should know:

- ``batch_size`` is per process; the global batch is ``batch_size * world_size``.
- Every rank runs the same calls (``fit``, ``evaluate``, ``predict``, ``save_checkpoint``):
  they contain collectives. Inputs fitkit cannot shard (iterables of batches,
  ``IterableDataset``) raise ``ValueError`` unless wrapped in :func:`already_sharded`.
- ``model.stop_training`` set on some ranks only stops every rank where the ranks agree: after
  ``on_backward_end`` when a callback uses that hook (``TerminateOnNaN``), else at the end of
  the epoch. A step vetoed on one rank (``TerminateOnNaN``) is skipped on all.
- Rank 0 prints and writes files; ``save_weights`` / ``save_checkpoint`` write on rank 0 only
  and hold the plain module's state. Under ``strategy="fsdp"`` gathering that state is a
  collective, so those two must be called on every rank.
- A process group you start yourself is used as it is; create the ``Model`` after it.

Example:
    >>> world_size(), rank(), is_distributed(), is_rank_zero()
    (1, 0, False, True)
    >>> check_strategy("fsdp")
    'fsdp'
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from fitkit.checkpoint import is_rank_zero
from fitkit.data import DeviceLoader, TensorBatches, _IterableBatches, _index, _leaves, batch_size_of

__all__ = [
    "STRATEGIES",
    "launched_by_torchrun",
    "init_if_needed",
    "is_distributed",
    "is_rank_zero",
    "rank",
    "world_size",
    "all_reduce_sum",
    "any_rank",
    "all_gather_object",
    "already_sharded",
    "check_strategy",
    "Parallel",
    "shard",
]

#: Values of ``Model(strategy=...)``: "auto" is DDP under torchrun, nothing on one process.
STRATEGIES = ("auto", "ddp", "fsdp")

_started_here = False  # whether fitkit started the process group (and so tears it down)


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


def is_distributed() -> bool:
    """Whether a default process group of more than one process is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank in the default group (0 when not distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Processes in the default group (1 when not distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def init_if_needed(device: torch.device) -> bool:
    """Start the default process group when launched by torchrun and none is running yet.

    nccl for a CUDA ``device`` (made the current device first), gloo otherwise. A group that
    fitkit starts is destroyed at interpreter exit; a group the user started is left alone.

    Args:
        device: this rank's device (``cuda:LOCAL_RANK`` under torchrun on GPUs).

    Returns:
        Whether this call started the group.
    """
    global _started_here
    if not launched_by_torchrun() or not dist.is_available() or dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    _started_here = True
    atexit.register(_teardown)
    return True


def _teardown() -> None:
    if _started_here and dist.is_available() and dist.is_initialized():
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


def _draw_seed(generator: torch.Generator | None = None) -> int:
    """A seed drawn on rank 0 (as ``RandomSampler`` draws one) and shared with every rank."""
    seed = torch.zeros((), dtype=torch.int64)
    if rank() == 0:
        seed = torch.empty((), dtype=torch.int64).random_(generator=generator)
    return int(_broadcast_from_zero(seed).item())  # one host sync per epoch


# -- strategy ----------------------------------------------------------------------------
def check_strategy(strategy: Any) -> str:
    """Validate ``Model(strategy=...)``.

    Raises:
        TypeError: not a string.
        ValueError: not one of :data:`STRATEGIES`.
    """
    if not isinstance(strategy, str):
        raise TypeError(
            f"Expected `strategy` to be one of {', '.join(map(repr, STRATEGIES))}. "
            f"Received: strategy={strategy!r} of type {type(strategy).__name__}."
        )
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown strategy {strategy!r}. Valid values: {', '.join(STRATEGIES)}.")
    return strategy


# Submodules that FSDP shards as units of their own (their parameters are gathered one unit at
# a time in forward and backward); the root module is always a unit too.
def _fsdp_units() -> tuple[type, ...]:
    from fitkit.layers import TransformerBlock

    return (TransformerBlock, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


class Parallel:
    """The data-parallel side of a :class:`fitkit.Model` under torchrun (DDP or FSDP2).

    ``model.module`` stays the user's module: DDP wraps it in a separate forward module, and
    FSDP2 shards it in place (its class and state-dict keys keep their names), so state dicts
    and checkpoints never carry ``module.`` prefixes.

    Args:
        strategy: ``"auto"`` / ``"ddp"`` or ``"fsdp"``.
        device: this rank's device.
    """

    def __init__(self, strategy: str, device: torch.device):
        self.kind = "fsdp" if strategy == "fsdp" else "ddp"
        self.device = device
        self.ddp: nn.Module | None = None

    def __repr__(self) -> str:
        return f"Parallel({self.kind!r}, rank={rank()}, world_size={world_size()})"

    @property
    def fsdp(self) -> bool:
        return self.kind == "fsdp"

    # -- wrapping ------------------------------------------------------------------------
    def prepare(self, module: nn.Module, optimizer: Any) -> None:
        """At ``compile()``, before the optimizer is built: shard the module for FSDP.

        ``fully_shard`` replaces the parameters with sharded ``DTensor`` parameters, so the
        optimizer must be built afterwards, from a name or a factory.

        Raises:
            ValueError: an ``Optimizer`` instance with ``strategy="fsdp"``.
        """
        if not self.fsdp:
            return
        if isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "strategy='fsdp' replaces the module's parameters with sharded ones, so an "
                "optimizer built before compile() would update nothing. Fix: pass a name "
                "(optimizer='adamw') or a factory such as functools.partial(torch.optim.AdamW, lr=3e-4)."
            )
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(module, FSDPModule):
            return  # compiled before: already sharded
        # fully_shard keeps each rank's own values: start every rank from rank 0's, as DDP does.
        _broadcast_states([*module.parameters(), *module.buffers()])
        units = _fsdp_units()
        for sub in list(module.modules())[1:]:
            if isinstance(sub, units) and not isinstance(sub, FSDPModule):
                fully_shard(sub)
        fully_shard(module)

    def wrap(self, module: nn.Module) -> nn.Module | None:
        """The eager training forward module: the DDP wrapper (built once), ``None`` for FSDP.

        DDP's constructor broadcasts rank 0's parameters and buffers. Buffers are not synced
        before every forward (``forward_sync_buffers=False``): a forward without grad
        (evaluate, predict) then runs no collective, so ranks may run different numbers of
        such forwards. Rank 0's buffers are broadcast at the end of every epoch instead
        (:meth:`sync_buffers`); BatchNorm trains on batch statistics, so the training math is
        DDP's default.
        """
        if self.fsdp or not any(p.requires_grad for p in module.parameters()):
            return None  # FSDP's forward is the module itself; nothing to train: no DDP
        if self.ddp is not None and self.ddp.module is module and _same_device(self.ddp, module):
            return self.ddp
        import inspect

        from torch.nn.parallel import DistributedDataParallel as DDP

        device = next(module.parameters()).device
        kwargs: dict[str, Any] = {"device_ids": [device.index]} if device.type == "cuda" else {}
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
            kwargs["forward_sync_buffers"] = False
        else:  # older torch: also skips the buffer sync at init, done below
            kwargs["broadcast_buffers"] = False
        self.ddp = DDP(module, **kwargs)
        _broadcast_states(module.buffers())
        return self.ddp

    def sync_buffers(self, module: nn.Module) -> None:
        """Give every rank rank 0's buffers (BatchNorm statistics); called at each epoch end."""
        buffers = list(module.buffers())
        if buffers:
            _broadcast_states(buffers)

    def no_sync(self, module: nn.Module):
        """Skip the gradient all-reduce of a non-final accumulation micro-step."""
        if self.fsdp:
            return _fsdp_no_sync(module)
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    # -- state dicts (FSDP gathers the shards; DDP's module holds full tensors already) ---
    def state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full, unsharded state dict (a collective under FSDP: call it on every rank).

        Under FSDP the tensors come back on the CPU on rank 0 and as an empty dict elsewhere,
        so no rank holds a second full copy on its device.
        """
        if not self.fsdp:
            return module.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state_dict(self, module: nn.Module, state: Mapping[str, Any], strict: bool = True) -> Any:
        """Load a full state dict (every rank reads the same file)."""
        if not self.fsdp:
            return module.load_state_dict(state, strict=strict)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, strict=strict)
        return set_model_state_dict(module, dict(state), options=options)

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state in ``Optimizer.state_dict()``'s own format (integer ids).

        Under FSDP the full state is gathered (a collective) and its parameter names are turned
        back into the positions a plain optimizer uses, so the file loads at any world size.
        """
        if not self.fsdp:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(
            module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if not full:  # not rank 0: nothing to write
            return {}
        names = [n for g in full["param_groups"] for n in g["params"]]
        index = {n: i for i, n in enumerate(names)}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]]
        return {"state": {index[n]: s for n, s in full["state"].items()}, "param_groups": groups}

    def load_optimizer_state_dict(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> None:
        """Load what :meth:`optimizer_state_dict` returned (integer ids, any world size)."""
        if not self.fsdp:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        fqn = {id(p): n for n, p in module.named_parameters()}
        names = [fqn[id(p)] for g in optimizer.param_groups for p in g["params"]]
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
        full = {"state": {names[int(i)]: s for i, s in state["state"].items()}, "param_groups": groups}
        set_optimizer_state_dict(module, optimizer, full, options=StateDictOptions(full_state_dict=True))


def _same_device(ddp: nn.Module, module: nn.Module) -> bool:
    p = next(module.parameters(), None)
    return p is None or getattr(ddp, "device", p.device) == p.device


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def global_share(sizes: list[Any]) -> torch.Tensor:
    """``total / W`` with ``total`` the sum of ``sizes`` over all ranks, as a device tensor.

    ``size / global_share(sizes)`` is then a micro-batch's share ``size * W / total`` of the
    global group: DDP divides the summed gradients by ``W``, so scaling each rank's mean loss by
    it gives the single-process mean over the global group. A group whose weights are all zero
    gets a share of 0, not 0/0. Host sizes are filled into the device tensor (a kernel
    argument, no copy), so nothing waits for the device.
    """
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


# -- data --------------------------------------------------------------------------------
class _AlreadySharded:
    def __init__(self, data: Any):
        self.data = data


def already_sharded(data: Any) -> Any:
    """Mark ``data`` as this rank's own share, so fitkit does not shard it again.

    Use it for inputs fitkit cannot shard (generators, ``IterableDataset``, a ``DataLoader``
    with a custom batch sampler), or for per-rank tensors. Every rank must then yield the
    same number of batches per epoch (or pass ``steps_per_epoch`` / ``steps``), since DDP
    steps all ranks together. Epoch logs are still exact means over all ranks' samples;
    ``predict`` returns rank 0's rows, then rank 1's, and so on.

    Example:
        >>> rank_batches = [(torch.zeros(2, 1), torch.zeros(2, 1))]
        >>> type(already_sharded(rank_batches)).__name__
        '_AlreadySharded'
    """
    return data if isinstance(data, _AlreadySharded) else _AlreadySharded(data)


def unwrap(data: Any) -> tuple[Any, bool]:
    """``(data, True)`` for :func:`already_sharded` data, else ``(data, False)``."""
    if isinstance(data, _AlreadySharded):
        return data.data, True
    return data, False


def _share(lo: int, m: int, r: int, w: int) -> tuple[int, int]:
    """Rank ``r``'s contiguous share ``[a, b)`` of the ``m`` samples that start at ``lo``.

    Shares differ by at most one sample; a global batch of full size gives each rank exactly
    ``batch_size`` samples.
    """
    base, extra = divmod(m, w)
    a = lo + r * base + min(r, extra)
    return a, a + base + (r < extra)


class ShardedTensorBatches(TensorBatches):
    """:class:`~fitkit.data.TensorBatches` split over ranks, sample-exact.

    Each epoch uses one permutation of all ``N`` samples, identical on every rank (rank 0
    draws ``torch.randperm(N)`` from the global generator, as one process would, and
    broadcasts it), cut into global batches of ``batch_size * world_size``; rank ``r`` takes
    the ``r``-th contiguous share of each global batch. Every rank runs
    ``ceil(N / (batch_size * world_size))`` batches; a share of a short last batch may be empty.
    """

    def __init__(self, src: TensorBatches):
        super().__init__(src.x, src.y, src.w, src.batch_size, src.shuffle)
        self.rank, self.world = rank(), world_size()

    @property
    def num_batches(self) -> int:
        return math.ceil(self.n / (self.batch_size * self.world))

    def _bounds(self) -> Iterator[tuple[int, int]]:
        g = self.batch_size * self.world
        for lo in range(0, self.n, g):
            yield _share(lo, min(g, self.n - lo), self.rank, self.world)

    def iterate(self, epoch: int, skip: int = 0) -> Iterator[Any]:
        x, y, w = self.x, self.y, self.w
        perm = None
        if self.shuffle:
            perm = torch.randperm(self.n) if self.rank == 0 else torch.empty(self.n, dtype=torch.int64)
            perm = _broadcast_from_zero(perm)  # one broadcast of N indices per epoch
            leaves = _leaves(x)
            if leaves and leaves[0].device != perm.device:
                perm = perm.to(leaves[0].device)
        for s, (a, b) in enumerate(self._bounds()):
            if s < skip:
                continue
            idx = slice(a, b) if perm is None else perm[a:b]
            yield _index(x, idx), _index(y, idx), None if w is None else w[idx]

    def positions(self) -> torch.Tensor:
        """Global positions (in epoch order) of the rows this rank yields, in yield order."""
        return torch.cat([torch.arange(a, b) for a, b in self._bounds()] or [torch.zeros(0, dtype=torch.int64)])


class ShardedLoaderBatches(_IterableBatches):
    """A ``DataLoader`` rebuilt on a ``DistributedSampler``, without its padded duplicates.

    ``DistributedSampler`` repeats up to ``W - 1`` samples so that every rank gets the same
    count; local position ``j`` on rank ``r`` is global position ``r + j * W``, padding when
    it is ``>= N``. That is known on the host, so the padded rows are cut off the last batch
    there (the batch may become empty; the step still runs).
    """

    def __init__(self, loader: DataLoader, shuffle: bool, generator: torch.Generator | None):
        super().__init__(loader)
        self.shuffle, self.generator = shuffle, generator
        self.rank, self.world = rank(), world_size()
        n = len(loader.dataset)  # type: ignore[arg-type]
        self.n = n
        self.real = max(0, -(-(n - self.rank) // self.world))  # positions r + j*W < n

    def iterate(self, epoch: int, skip: int = 0) -> Iterator[Any]:
        sampler = self.source.sampler
        if self.shuffle:
            sampler.seed = _draw_seed(self.generator)  # rank 0's RNG, as RandomSampler uses it
        sampler.set_epoch(epoch)
        return self._truncate(iter(self.source), skip)

    def _truncate(self, it: Iterator[Any], skip: int) -> Iterator[Any]:
        seen = 0
        for s, batch in enumerate(it):
            m = batch_size_of(batch)
            keep = max(0, min(m, self.real - seen))
            seen += m
            if s < skip:
                continue
            yield batch if keep == m else _index(batch, slice(0, keep))

    def positions(self) -> torch.Tensor:
        return self.rank + self.world * torch.arange(self.real)


def _shard_dataloader(dl: DataLoader) -> ShardedLoaderBatches:
    from torch.utils.data.distributed import DistributedSampler

    fix = (
        "Fix: pass tensors, a map-style Dataset or a plain DataLoader(dataset, batch_size=..., "
        "shuffle=...), or shard the data per rank yourself and pass "
        "fitkit.distributed.already_sharded(data)."
    )
    if isinstance(dl.dataset, IterableDataset):
        raise ValueError(
            f"Under torchrun fitkit shards the data per rank, but an IterableDataset "
            f"({type(dl.dataset).__name__}) cannot be split by index. {fix}"
        )
    sampler = dl.sampler
    if isinstance(sampler, DistributedSampler):
        if sampler.num_replicas != world_size() or sampler.rank != rank():
            raise ValueError(
                f"The DataLoader's DistributedSampler has num_replicas={sampler.num_replicas}, "
                f"rank={sampler.rank}, but this process is rank {rank()} of {world_size()}. "
                "Fix: build it with the defaults, or let fitkit shard a plain DataLoader."
            )
        return ShardedLoaderBatches(dl, shuffle=False, generator=None)  # the user's seed and shuffle
    if type(dl) is not DataLoader or dl.batch_size is None or type(dl.batch_sampler) is not BatchSampler:
        raise ValueError(
            "Under torchrun fitkit replaces a DataLoader's sampler with a DistributedSampler, "
            f"which needs a plain DataLoader with a batch_size; received a {type(dl).__name__} "
            f"with batch_sampler={type(dl.batch_sampler).__name__}. {fix}"
        )
    if type(sampler) is SequentialSampler:
        shuffle = False
    elif type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        shuffle = True
    else:
        raise ValueError(
            f"Under torchrun fitkit cannot shard a DataLoader whose sampler is a "
            f"{type(sampler).__name__}: a DistributedSampler only reproduces sequential or "
            f"shuffled order. {fix}"
        )
    new_sampler = DistributedSampler(
        dl.dataset, num_replicas=world_size(), rank=rank(), shuffle=shuffle, drop_last=False
    )
    rebuilt = DataLoader(
        dl.dataset, batch_size=dl.batch_size, sampler=new_sampler, num_workers=dl.num_workers,
        collate_fn=dl.collate_fn, pin_memory=dl.pin_memory, drop_last=dl.drop_last,
        timeout=dl.timeout, worker_init_fn=dl.worker_init_fn,
        multiprocessing_context=dl.multiprocessing_context, generator=dl.generator,
        prefetch_factor=dl.prefetch_factor, persistent_workers=dl.persistent_workers,
        pin_memory_device=dl.pin_memory_device,
    )  # fmt: skip
    return ShardedLoaderBatches(rebuilt, shuffle=shuffle, generator=dl.generator)


def shard(loader: DeviceLoader, already: bool = False) -> DeviceLoader:
    """Split ``loader``'s batches over the ranks (a no-op on one process).

    Args:
        loader: what :func:`fitkit.data.as_loader` built.
        already: the data was marked with :func:`already_sharded`: keep it as it is.

    Raises:
        ValueError: an input that cannot be sharded (an iterable of batches, an
            ``IterableDataset``, a DataLoader with a custom sampler or batch sampler).
    """
    loader.sharded = "user" if already else False
    if already or not is_distributed():
        return loader
    src = loader.batches
    if isinstance(src, TensorBatches):
        loader.batches = ShardedTensorBatches(src)
    elif isinstance(src, _IterableBatches) and isinstance(src.source, DataLoader):
        loader.batches = _shard_dataloader(src.source)
    else:
        raise ValueError(
            f"Under torchrun fitkit shards the data per rank, but an iterable of batches "
            f"({type(getattr(src, 'source', src)).__name__}) cannot be split without "
            "duplicates. Fix: pass tensors, a Dataset or a DataLoader, or shard the batches "
            "per rank yourself and pass fitkit.distributed.already_sharded(batches)."
        )
    loader.sharded = True
    return loader


# -- predict -----------------------------------------------------------------------------
def gather_predictions(out: Any, loader: DeviceLoader) -> Any:
    """Every rank's predictions, every row once, in input order, on every rank (CPU).

    Fitkit-sharded inputs are put back by the global position of each row; inputs marked
    :func:`already_sharded` are concatenated in rank order.
    """
    sharded = getattr(loader, "sharded", False)
    if not sharded or not is_distributed():
        return out
    rows = _rows(out)
    pos = loader.batches.positions()[:rows] if sharded is True else None
    parts = all_gather_object((pos, out))
    if pos is None:
        return _merge([p for _, p in parts], None, 0)
    total = sum(len(p) for p, _ in parts)
    return _merge([o for _, o in parts], [p for p, _ in parts], total)


def _rows(out: Any) -> int:
    leaves = _leaves(out)
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() > 0 else 0


def _merge(parts: list[Any], positions: list[torch.Tensor] | None, total: int) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if positions is None:
            return torch.cat(parts)
        merged = first.new_empty((total, *first.shape[1:]))
        for pos, part in zip(positions, parts):
            merged[pos] = part
        return merged
    if isinstance(first, (tuple, list)):
        return type(first)(_merge([p[i] for p in parts], positions, total) for i in range(len(first)))
    if isinstance(first, Mapping):
        return {k: _merge([p[k] for p in parts], positions, total) for k in first}
    return [o for p in parts for o in p]  # non-tensor outputs: a list of batch outputs per rank
