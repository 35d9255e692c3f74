"""The loss denominator summed over the ranks inside DDP's / FSDP's own gradient reduction.

A step's exact loss is ``sum(w_i * l_i) / sum(w_i)`` over the terms of every rank's batch (see
:mod:`fitkit.losses.denominators`). When every rank's host knows the global denominator (the
rows of fitkit's own shards, with rows as the loss's terms) each rank scales its loss by it and
DDP's / FSDP's average is the exact mean with no collective of fitkit's. When only the device
knows it (class-index targets with ``ignore_index`` or several per row, class weights, sample
weights, a DataLoader's class-index batches, data marked ``already_sharded``) the sum over the
ranks rides in the gradient reduction the strategy runs anyway. Each rank backpropagates its
own window's mean loss; the reduction multiplies the gradient by this rank's denominator (the
mean turned into the sum), appends the denominator as two values (a multiple of 4096 and the
rest, so the sums stay exact integers in float32 up to 2**36 terms over fewer than 4096 ranks),
reduces with the sum instead of the mean and divides the gradients by the summed denominator:

- DDP: a communication hook (:func:`count_hook`) on each gradient bucket's all-reduce.
- FSDP2: a custom reduce-scatter (:class:`CountedReduceScatter`, installed on every unit with
  ``FSDPModule.set_custom_reduce_scatter``): each rank's chunk of the unit's flat gradient gets
  the two values, so every rank's output chunk holds the summed denominator. FSDP's own
  division is turned off on those units (``set_gradient_divide_factor(1.0)`` and
  ``set_force_sum_reduction_for_comms(True)``): without a count the reduce-scatter sums and
  divides by the number of ranks itself, the mean FSDP computes.

Costs: two more values per bucket (per rank's chunk), one multiplication and one division of the
gradients and, under FSDP, one copy of the unit's reduce-scatter input; no collective and no host
read. Not used (the denominator is all-reduced on its own, one small collective per step, as
:func:`~fitkit.distributed.group.global_share` does) when the gradients are reduced in a 16-bit
type (too few digits for the count): DDP with 16-bit parameters, FSDP with a
``MixedPrecisionPolicy`` that reduces in ``float16`` / ``bfloat16`` (the shorthand
``FSDP(mixed_precision=torch.bfloat16)`` reduces in float32: it carries the count), or a module
sharded before it was given to :class:`fitkit.Model`.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CountState", "count_hook", "can_carry", "CountedReduceScatter", "reduces_exactly"]

_SPLIT = 4096.0  # the count travels as (multiple of 4096) / 4096 and the rest: both exact in float32
_EXACT = (torch.float32, torch.float64)  # reduce dtypes that hold the count exactly


class CountState:
    """The hook's state: this rank's denominator of the coming reduction (``None``: the strategy's own mean)."""

    __slots__ = ("count", "world")

    def __init__(self, world: int):
        self.count: Any = None
        self.world = world

    def carry(self, count: Any) -> None:
        """Set the denominator the coming reduction carries (a device tensor or a number; ``None``: none)."""
        self.count = count


def can_carry(module: torch.nn.Module) -> bool:
    """Whether every trainable parameter is float32 or float64 (buckets that hold the count exactly).

    Example:
        >>> can_carry(torch.nn.Linear(2, 1)), can_carry(torch.nn.Linear(2, 1).half())
        (True, False)
    """
    return all(p.dtype in _EXACT for p in module.parameters() if p.requires_grad)


def reduces_exactly(module: torch.nn.Module, policy: Any) -> bool:
    """Whether FSDP2 reduces every floating parameter's gradient in float32 or float64 under
    ``policy`` (a ``MixedPrecisionPolicy``): its ``reduce_dtype``, else its ``param_dtype``
    (the gradients' own), else the parameter's dtype, as ``fully_shard`` picks it.

    Example:
        >>> from torch.distributed.fsdp import MixedPrecisionPolicy
        >>> net = torch.nn.Linear(2, 1)
        >>> reduces_exactly(net, MixedPrecisionPolicy())
        True
        >>> reduces_exactly(net, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        True
        >>> reduces_exactly(net, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        False
    """
    fixed = policy.reduce_dtype or policy.param_dtype
    return all((fixed or p.dtype) in _EXACT for p in module.parameters() if p.is_floating_point())


def _as_float64(count: Any, device: torch.device) -> torch.Tensor:
    if isinstance(count, torch.Tensor):
        return count.detach().to(device, torch.float64).reshape(())
    return torch.tensor(float(count), dtype=torch.float64, device=device)


def _two_values(c: torch.Tensor) -> torch.Tensor:
    """``(2,)`` float64: ``c`` as a multiple of 4096 (divided by it) and the rest."""
    hi = torch.floor(c / _SPLIT)
    return torch.stack([hi, c - hi * _SPLIT])


def _summed(pair: torch.Tensor) -> torch.Tensor:
    """The denominator back from its two summed values; 1 where it is 0 (nothing counts: 0, not 0/0)."""
    total = pair[0].double() * _SPLIT + pair[1].double()
    return torch.where(total == 0, torch.ones_like(total), total)


def count_hook(state: CountState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients summed over the ranks and divided by the
    summed denominator (``state.count``), or averaged as DDP does when ``state.count`` is ``None``."""
    buf: torch.Tensor = bucket.buffer()
    count = state.count
    if count is None:  # DDP's own mean
        fut = dist.all_reduce(buf.div_(state.world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    c = _as_float64(count, buf.device)
    flat = torch.cat([buf * c.to(buf.dtype), _two_values(c).to(buf.dtype)])  # (n + 2,)
    fut = dist.all_reduce(flat, async_op=True).get_future()

    def divide(f: torch.futures.Future[Any]) -> torch.Tensor:
        out = f.value()[0]
        return out[:-2].div_(_summed(out[-2:]).to(out.dtype))

    return fut.then(divide)


class CountedReduceScatter:
    """FSDP2's reduce-scatter of a unit's gradients (torch's ``ReduceScatter`` comm interface:
    ``allocate`` and ``__call__``), carrying ``state.count`` as :func:`count_hook` does.

    FSDP calls it with the unit's flat gradient ``input_tensor`` of shape ``(W * n,)`` (rank
    ``r``'s chunk at ``[r * n, (r + 1) * n)``) and this rank's ``output_tensor`` of shape
    ``(n,)``, on its reduce-scatter stream. The unit's own division must be off (a divide factor
    of 1 and sum-only reductions, see :meth:`install`): this object writes the mean.

    - ``state.count is None``: the sum over the ranks divided by ``W`` (FSDP's mean).
    - otherwise: each chunk times this rank's count, with the count's two values appended
      (``(W, n + 2)``, one copy of the input), reduce-scattered with the sum: ``(n + 2,)`` per
      rank, the gradients divided by the summed count. Used only where the reduce dtype is
      float32 or float64 (:func:`reduces_exactly`).

    Args:
        state: the shared :class:`CountState` (one for every unit of the module).

    Example:
        >>> comm = CountedReduceScatter(CountState(world=2))
        >>> comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu")).shape
        torch.Size([6])
    """

    def __init__(self, state: CountState):
        self.state = state

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain buffer (torch's default comm allocates the same way)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> None:
        """Reduce-scatter ``input_tensor`` into ``output_tensor`` (synchronously, on the caller's
        stream); ``op`` is not read: the reduction is always a sum, divided here."""
        world = dist.get_world_size(group)
        count = self.state.count
        if count is None:  # FSDP's mean
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)
            output_tensor.div_(world)
            return None
        dtype = input_tensor.dtype
        c = _as_float64(count, input_tensor.device)
        flat = torch.empty(world, input_tensor.numel() // world + 2, dtype=dtype, device=input_tensor.device)
        torch.mul(input_tensor.view(world, -1), c.to(dtype), out=flat[:, :-2])  # each chunk's sum, not mean
        flat[:, -2:] = _two_values(c).to(dtype)
        out = torch.empty(flat.shape[1], dtype=dtype, device=flat.device)  # (n + 2,): this rank's chunk
        dist.reduce_scatter_tensor(out, flat.view(-1), op=dist.ReduceOp.SUM, group=group)
        torch.div(out[:-2], _summed(out[-2:]).to(dtype), out=output_tensor)
        return None

    def install(self, module: torch.nn.Module) -> None:
        """Set this reduce-scatter on every FSDP unit of ``module`` (the root included), with
        FSDP's own division off (it divides itself)."""
        from torch.distributed.fsdp import FSDPModule

        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)
                unit.set_custom_reduce_scatter(self)  # type: ignore[arg-type]
