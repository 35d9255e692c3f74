"""``Model(strategy=DDP(...))``: options of torch's ``DistributedDataParallel``.

``strategy="ddp"`` (and ``"auto"`` under torchrun) is ``DDP()``. Whatever the options, the
wrapper follows the module's trainable set: DDP registers the parameters that require a
gradient when it is built, so one unfrozen later (the fine-tuning recipe: a callback calls
``backbone.requires_grad_(True)`` at an epoch start) would never be all-reduced and the ranks
would drift apart. At every epoch start (after ``on_epoch_begin``) fitkit compares the
``requires_grad`` flags with those the wrapper was built for and, when they changed, builds a
new wrapper (rank 0's weights broadcast again; the optimizer and its state untouched).
"""

from __future__ import annotations

from typing import Any

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

    Raises:
        TypeError: an option that is not a bool.

    Example:
        >>> DDP(find_unused_parameters=True).kwargs()
        {'find_unused_parameters': True}
    """

    def __init__(self, find_unused_parameters: bool = False, static_graph: bool = False):
        check_bool("find_unused_parameters", find_unused_parameters)
        check_bool("static_graph", static_graph)
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``DistributedDataParallel`` (only those set)."""
        out: dict[str, Any] = {}
        if self.find_unused_parameters:
            out["find_unused_parameters"] = True
        if self.static_graph:
            out["static_graph"] = True
        return out

    def __repr__(self) -> str:
        return f"DDP({', '.join(f'{k}={v!r}' for k, v in self.kwargs().items())})"
