"""``Model(strategy=DDP(...))``: options of torch's ``DistributedDataParallel``.

``strategy="ddp"`` (and ``"auto"`` under torchrun) is ``DDP()``. Whatever the options, the
wrapper follows the module's trainable set: DDP registers the parameters that require a
gradient when it is built, so one unfrozen later (the fine-tuning recipe: a callback calls
``backbone.requires_grad_(True)`` at an epoch start) would never be all-reduced and the ranks
would drift apart. Before each optimizer step's first micro-batch (after ``on_epoch_begin`` and
``on_train_batch_begin``, so a change made in any epoch or batch hook counts from the next step)
fitkit compares the ``requires_grad`` flags with those the wrapper was built for and, when they
changed, builds a new wrapper (rank 0's weights broadcast again; the optimizer and its state
untouched). A change between the micro-batches of one accumulation window counts from the next
window.

Buffers (BatchNorm's running statistics) are rank 0's on every rank before each validation,
in an epoch (``validation_interval``) and at its end, so every rank validates the same model;
between those points each rank's training forwards update their own (DDP's
``broadcast_buffers`` per forward is not used: a forward without gradients would then be a
collective). ``sync_batchnorm=True`` goes further and trains with statistics over the global
batch (``torch.nn.SyncBatchNorm``, CUDA only: torch has no CPU implementation).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fitkit.checks import check_bool

__all__ = ["DDP"]


class DDP:
    """The DDP strategy with options: ``Model(net, strategy=DDP(find_unused_parameters=True))``.

    On one process the strategy trains plainly, as every strategy does.

    Args:
        find_unused_parameters: DDP's option: after each forward, parameters the loss does not
            reach are marked ready, so a parameter without a gradient (an unused head, a
            skipped branch) does not stall the all-reduce. Costs a walk of the graph per step.
        static_graph: DDP's option: the same parameters are used (or unused) at every step;
            DDP learns which in the first step.
        gradient_as_bucket_view: DDP's option: the gradients are views into the all-reduce
            buckets (one copy and its memory saved per step).
        sync_batchnorm: convert every ``BatchNorm*d`` of the module to ``torch.nn.SyncBatchNorm``
            at ``compile`` (the same parameters and buffers), so training normalises with the
            statistics of the global batch (Lightning's ``sync_batchnorm=True``). CUDA only.

    Raises:
        TypeError: an option that is not a bool.
        ValueError: (at ``compile``) ``sync_batchnorm=True`` on a device other than CUDA, or a
            module that is itself a BatchNorm layer.

    Example:
        >>> DDP(find_unused_parameters=True).kwargs()
        {'find_unused_parameters': True}
        >>> DDP(gradient_as_bucket_view=True, sync_batchnorm=True)
        DDP(gradient_as_bucket_view=True, sync_batchnorm=True)
    """

    def __init__(
        self,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        sync_batchnorm: bool = False,
    ):
        for name, value in (
            ("find_unused_parameters", find_unused_parameters),
            ("static_graph", static_graph),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("sync_batchnorm", sync_batchnorm),
        ):
            check_bool(name, value)
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph
        self.gradient_as_bucket_view, self.sync_batchnorm = gradient_as_bucket_view, sync_batchnorm

    @property
    def tolerates_unused(self) -> bool:
        """Whether DDP copes with a parameter that gets no gradient (either option)."""
        return self.find_unused_parameters or self.static_graph

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``DistributedDataParallel`` (only those set)."""
        names = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")
        return {name: True for name in names if getattr(self, name)}

    def convert(self, module: nn.Module, device: torch.device) -> None:
        """With ``sync_batchnorm``: replace the module's BatchNorm layers by ``SyncBatchNorm``
        in place (each keeps its parameters and buffers; the optimizer is built afterwards)."""
        if not self.sync_batchnorm:
            return
        if device.type != "cuda":
            raise ValueError(
                f"DDP(sync_batchnorm=True) needs CUDA: torch's SyncBatchNorm has no implementation for "
                f"{device.type!r} tensors. Fix: drop sync_batchnorm on this device (fitkit still gives every "
                "rank rank 0's BatchNorm statistics before each validation), or train on CUDA."
            )
        convert_sync_batchnorm(module)

    def __repr__(self) -> str:
        set_ = {k: v for k, v in vars(self).items() if v}
        return f"DDP({', '.join(f'{k}={v!r}' for k, v in set_.items())})"


def convert_sync_batchnorm(module: nn.Module) -> int:
    """Replace every ``BatchNorm*d`` below ``module`` by ``torch.nn.SyncBatchNorm`` in place
    (torch's ``convert_sync_batchnorm`` per child: the same parameter and buffer tensors).

    Returns:
        How many layers were converted.

    Raises:
        ValueError: ``module`` is itself a BatchNorm layer (it cannot be replaced in place).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
        >>> weight = net[1].weight
        >>> convert_sync_batchnorm(net), type(net[1]).__name__, net[1].weight is weight
        (1, 'SyncBatchNorm', True)
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        raise ValueError(
            f"DDP(sync_batchnorm=True) converts the BatchNorm layers inside the model, but the model is one "
            f"({type(module).__name__}). Fix: wrap it, e.g. nn.Sequential(layer)."
        )
    count = sum(
        isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm) for m in module.modules()
    )
    for name, child in module.named_children():
        converted = nn.SyncBatchNorm.convert_sync_batchnorm(child)
        if converted is not child:
            setattr(module, name, converted)
    return count
