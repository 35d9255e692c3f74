"""The loss denominator summed over the ranks inside DDP's own gradient all-reduce.

A step's exact loss is ``sum(w_i * l_i) / sum(w_i)`` over the terms of every rank's batch (see
:mod:`fitkit.losses.denominators`). When every rank's host knows the global denominator (the
rows of fitkit's own shards, with rows as the loss's terms) each rank scales its loss by it and
DDP's average is the exact mean with no collective of fitkit's. When only the device knows it
(class-index targets with ``ignore_index`` or several per row, class weights, sample weights, a
DataLoader's class-index batches, data marked ``already_sharded``) the sum over the ranks rides
in the gradient all-reduce DDP runs anyway: a DDP communication hook appends this rank's
denominator to each gradient bucket (two values: a multiple of 4096 and the rest, so the sums
stay exact integers in float32 up to 2**36 terms over fewer than 4096 ranks), all-reduces the
bucket with the sum instead of the mean, and divides the gradients by the summed denominator.
Each rank backpropagates its own window's mean loss, which the hook turns into its sum first.

Costs: two more values per bucket and one multiplication and one division of the bucket, no
collective and no host read. Not used (the denominator is all-reduced on its own, one small
collective per step, as :func:`~fitkit.distributed.group.global_share` does) under FSDP
(its reduce-scatter takes no hook), or with gradients in a 16-bit type (too few digits for the
count).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CountState", "count_hook", "can_carry"]

_SPLIT = 4096.0  # the count travels as (multiple of 4096) / 4096 and the rest: both exact in float32


class CountState:
    """The hook's state: this rank's denominator of the coming all-reduce (``None``: DDP's own mean)."""

    __slots__ = ("count", "world")

    def __init__(self, world: int):
        self.count: Any = None
        self.world = world

    def carry(self, count: Any) -> None:
        """Set the denominator the coming all-reduce carries (a device tensor or a number; ``None``: none)."""
        self.count = count


def can_carry(module: torch.nn.Module) -> bool:
    """Whether every trainable parameter is float32 or float64 (buckets that hold the count exactly).

    Example:
        >>> can_carry(torch.nn.Linear(2, 1)), can_carry(torch.nn.Linear(2, 1).half())
        (True, False)
    """
    return all(p.dtype in (torch.float32, torch.float64) for p in module.parameters() if p.requires_grad)


def count_hook(state: CountState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients summed over the ranks and divided by the
    summed denominator (``state.count``), or averaged as DDP does when ``state.count`` is ``None``."""
    buf: torch.Tensor = bucket.buffer()
    count = state.count
    if count is None:  # DDP's own mean
        fut = dist.all_reduce(buf.div_(state.world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    c = count.detach().to(buf.device, torch.float64) if isinstance(count, torch.Tensor) \
        else torch.tensor(float(count), dtype=torch.float64, device=buf.device)  # fmt: skip
    hi = torch.floor(c / _SPLIT)
    flat = torch.cat([buf * c.to(buf.dtype), torch.stack([hi, c - hi * _SPLIT]).to(buf.dtype)])  # (n + 2,)
    fut = dist.all_reduce(flat, async_op=True).get_future()

    def divide(f: torch.futures.Future[Any]) -> torch.Tensor:
        out = f.value()[0]
        total = out[-2].double() * _SPLIT + out[-1].double()
        total = torch.where(total == 0, torch.ones_like(total), total)  # nothing counts: 0, not 0/0
        return out[:-2].div_(total.to(out.dtype))

    return fut.then(divide)
