"""``Model(strategy=...)``: the DDP / FSDP2 wrapping of the module and its full state dicts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fitkit.distributed.counted import CountedReduceScatter, CountState, can_carry, count_hook, reduces_exactly
from fitkit.distributed.ddp import DDP as DDPStrategy
from fitkit.distributed.fsdp import FSDP
from fitkit.distributed.group import _broadcast_states, rank, world_size
from fitkit.distributed.meta import materialize, on_meta

#: Values of ``Model(strategy=...)``: "auto" is DDP under torchrun, nothing on one process.
STRATEGIES = ("auto", "ddp", "fsdp")


# -- strategy ----------------------------------------------------------------------------
def check_strategy(strategy: Any) -> Any:
    """Validate ``Model(strategy=...)``: one of :data:`STRATEGIES`, or an :class:`FSDP`.

    Raises:
        TypeError: neither a string nor an :class:`~fitkit.distributed.fsdp.FSDP`.
        ValueError: not one of :data:`STRATEGIES`.
    """
    if isinstance(strategy, (FSDP, DDPStrategy)):
        return strategy
    if not isinstance(strategy, str):
        raise TypeError(
            f"Expected `strategy` to be one of {', '.join(map(repr, STRATEGIES))}, a "
            f"fitkit.distributed.FSDP(...) or a fitkit.distributed.DDP(...). Received: strategy={strategy!r} of "
            f"type {type(strategy).__name__}. Fix: e.g. strategy='fsdp', strategy=FSDP(wrap=[MyBlock]) or "
            "strategy=DDP(find_unused_parameters=True)."
        )
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown strategy {strategy!r}. Valid values: {', '.join(STRATEGIES)}.")
    return strategy


class Parallel:
    """The data-parallel side of a :class:`fitkit.Model` under torchrun (DDP or FSDP2).

    ``model.module`` stays the user's module: DDP wraps it in a separate forward module, and
    FSDP2 shards it in place (its class and state-dict keys keep their names), so state dicts
    and checkpoints never carry ``module.`` prefixes.

    Args:
        strategy: ``"auto"`` / ``"ddp"``, ``"fsdp"`` or an :class:`FSDP` (its options).
        device: this rank's device.
    """

    def __init__(self, strategy: Any, device: torch.device):
        self.kind = "fsdp" if strategy == "fsdp" or isinstance(strategy, FSDP) else "ddp"
        self.options = strategy if isinstance(strategy, FSDP) else FSDP()
        self.ddp_options = strategy if isinstance(strategy, DDPStrategy) else DDPStrategy()
        self.device = device
        self.ddp: nn.Module | None = None
        self._trainable: tuple[bool, ...] | None = None  # the requires_grad flags DDP was built for
        self.counted: CountState | None = None  # the wrapper's count hook (FSDP: reduce-scatter), once set
        self.sharded: nn.Module | None = None  # FSDP: the module sharded here, when its reductions hold a count

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
            self.ddp_options.convert(module, self.device)  # sync_batchnorm: SyncBatchNorm layers
            return
        if isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "strategy='fsdp' replaces the module's parameters with sharded ones, so an "
                "optimizer built before compile() would update nothing. Fix: pass a name "
                "(optimizer='adamw') or a factory such as functools.partial(torch.optim.AdamW, lr=3e-4)."
            )
        from torch.distributed.fsdp import FSDPModule

        if isinstance(module, FSDPModule):
            return  # compiled before: already sharded
        # the loss denominator can ride in the units' reduce-scatters (fitkit.distributed.counted)
        self.sharded = module if reduces_exactly(module, self.options.policy()) else None
        if on_meta(module):  # built on the meta device: shard first, then allocate this rank's shards
            self.options.shard(module)
            materialize(module, self.device, stream=rank())  # the model's own init, per-rank stream
            return
        # fully_shard keeps each rank's own values: start every rank from rank 0's, as DDP does.
        _broadcast_states([*module.parameters(), *module.buffers()])
        self.options.shard(module)  # the wrap policy's units, then the root

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
        trainable = tuple(p.requires_grad for p in module.parameters())
        if (
            self.ddp is not None
            and self.ddp.module is module
            and _same_device(self.ddp, module)
            and trainable == self._trainable
        ):
            return self.ddp
        import gc
        import inspect

        from torch.nn.parallel import DistributedDataParallel as DDP

        if self.ddp is not None:  # the trainable set changed: the old reducer's hooks go first
            self.ddp = None
            gc.collect()
        device = next(module.parameters()).device
        kwargs: dict[str, Any] = {"device_ids": [device.index]} if device.type == "cuda" else {}
        kwargs.update(self.ddp_options.kwargs())
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
            kwargs["forward_sync_buffers"] = False
        else:  # older torch: also skips the buffer sync at init, done below
            kwargs["broadcast_buffers"] = False
        self.ddp = DDP(module, **kwargs)
        self._trainable, self.counted = trainable, None
        _broadcast_states(module.buffers())
        return self.ddp

    def carries_count(self) -> bool:
        """Whether a window's loss denominator can ride in the gradient reduction
        (:mod:`~fitkit.distributed.counted`): DDP with float32 / float64 gradients, or FSDP
        sharded at ``compile()`` with a policy that reduces in float32 / float64."""
        if self.fsdp:
            return self.sharded is not None
        ddp: Any = self.ddp
        return ddp is not None and (self.counted is not None or can_carry(ddp.module))

    def set_count(self, count: Any) -> None:
        """This rank's denominator for the coming reduction (``None``: DDP's / FSDP's mean),
        before the window's last backward; the DDP hook (the FSDP units' reduce-scatter) is
        set with the first count."""
        state = self.counted
        if state is None:
            if count is None:
                return
            target: Any = self.sharded if self.fsdp else self.ddp
            if target is None:
                return
            state = self.counted = CountState(world_size())
            if self.fsdp:
                CountedReduceScatter(state).install(target)
            else:
                target.register_comm_hook(state, count_hook)
        state.carry(count)

    def sync_buffers(self, module: nn.Module) -> None:
        """Give every rank rank 0's buffers (BatchNorm statistics); called at each epoch end."""
        buffers = list(module.buffers())
        if buffers:
            _broadcast_states(buffers)

    def no_sync(self, module: Any) -> Any:
        """Skip the gradient all-reduce of a non-final accumulation micro-step."""
        if self.fsdp:
            return _fsdp_no_sync(module)
        ddp: Any = self.ddp
        return ddp.no_sync() if ddp is not None else contextlib.nullcontext()

    # -- state dicts (FSDP gathers the shards; DDP's module holds full tensors already) ---
    def state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full, unsharded state dict (a collective under FSDP: call it on every rank).

        Under FSDP the tensors come back on the CPU on rank 0 and as an empty dict elsewhere,
        so no rank holds a second full copy on its device.
        """
        if not self.fsdp:
            return module.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state_dict(self, module: nn.Module, state: Mapping[str, Any], strict: bool = True) -> Any:
        """Load a full state dict (every rank reads the same file)."""
        if not self.fsdp:
            return module.load_state_dict(state, strict=strict)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=strict)
        return set_model_state_dict(module, dict(state), options=options)

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state in ``Optimizer.state_dict()``'s own format (integer ids).

        Under FSDP the full state is gathered (a collective) and its parameter names are turned
        back into the positions a plain optimizer uses, so the file loads at any world size.
        """
        if not self.fsdp:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        full: Any = get_optimizer_state_dict(
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
            optimizer.load_state_dict(dict(state))
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        fqn = {id(p): n for n, p in module.named_parameters()}
        names = [fqn[id(p)] for g in optimizer.param_groups for p in g["params"]]
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
        full: Any = {"state": {names[int(i)]: s for i, s in state["state"].items()}, "param_groups": groups}
        set_optimizer_state_dict(module, optimizer, full, options=StateDictOptions(full_state_dict=True))


def _same_device(ddp: nn.Module, module: nn.Module) -> bool:
    p = next(module.parameters(), None)
    return p is None or getattr(ddp, "device", p.device) == p.device


@contextlib.contextmanager
def _fsdp_no_sync(module: Any) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
