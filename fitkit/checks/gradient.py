"""Is there a gradient to train on? A loss that none flows through would run its steps with the
weights unchanged and no word: refused on the first batch, before step 1."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fitkit.model import Model

__all__ = ["check_loss_has_grad", "check_every_parameter_reached", "wants_grad_check"]


def wants_grad_check(model: Model, training: bool) -> bool:
    """Whether the first-batch check of ``model`` builds the graph to look at the loss: for
    training batches of the default ``train_step``, when the module has trainable parameters."""
    return training and model.default_train_step and any(p.requires_grad for p in model.module.parameters())


def check_loss_has_grad(loss: Any, label: str = "first batch") -> None:
    """A loss that no gradient flows through would train nothing: refuse it before step 1.

    Raises:
        ValueError: the loss is not a tensor that requires grad (``.detach()``, ``.item()``,
            an int tensor, a constant), while the module has trainable parameters.

    Example:
        >>> check_loss_has_grad(torch.tensor(1.0))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: The loss of the first batch has no gradient (a float32 tensor with requires_grad=False)...
    """
    if loss is None:
        return
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        if _reaches_no_parameter(loss):
            raise ValueError(
                f"The loss of the {label} requires grad, but its gradient reaches no parameter: it flows only "
                "into tensors that are not nn.Parameters of the module (the module's output was detached, or "
                "the loss adds a tensor created with requires_grad=True), so every step would leave the weights "
                "unchanged. Fix: compute the loss from the module's output without .detach(), and register "
                "trainable tensors as nn.Parameter on the module."
            )
        return
    if isinstance(loss, torch.Tensor):
        what = f"a {str(loss.dtype).removeprefix('torch.')} tensor with requires_grad=False"
    else:
        what = f"a {type(loss).__name__}"
    raise ValueError(
        f"The loss of the {label} has no gradient ({what}), though the module has trainable parameters: "
        "every step would leave the weights unchanged. Fix: compute the loss from the module's output with "
        "torch operations, without .detach(), .item(), .numpy() or integer casts, and return it as a float "
        "tensor."
    )


def _reaches_no_parameter(loss: torch.Tensor) -> bool:
    """Whether the autograd graph of ``loss`` has leaves, none of them an ``nn.Parameter``.

    A walk over the graph's nodes (no computation), once before step 1. A custom autograd
    Function (reentrant checkpointing, FSDP's hooks) may hold parameters the walk cannot see:
    then the answer is ``False`` (not known to be unreachable).
    """
    seen: set[int] = set()
    todo = [loss.grad_fn]
    leaves = 0
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return False
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf tensor
        if variable is not None:
            if isinstance(variable, torch.nn.Parameter):
                return False
            leaves += 1
        todo.extend(next_node for next_node, _ in node.next_functions)
    return leaves > 0


def check_every_parameter_reached(module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Under DDP without ``find_unused_parameters`` / ``static_graph``: refuse, before the fit's
    first optimizer step, a trainable parameter that the window's losses gave no gradient.

    DDP's all-reduce waits for a gradient of every parameter it registered: a bucket holding one
    that gets none is never reduced, so each rank would apply its own gradients (the ranks' weights
    differ from step 1 on) and torch raises at step 2. The gradients are dropped; no weight moved.

    Raises:
        RuntimeError: naming the parameters and the fixes.
    """
    unused = [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None]
    if not unused:
        return
    opt.zero_grad(set_to_none=True)
    shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
    raise RuntimeError(
        f"Under DDP the first training step gave no gradient to the trainable parameter(s) {shown}: DDP's "
        "all-reduce would skip their buckets, so every rank would step with its own gradients and the ranks' "
        "weights would drift apart. Nothing was applied. Fix: pass strategy=fitkit.distributed.DDP("
        "find_unused_parameters=True) (parameters unused in some steps), strategy=fitkit.distributed.DDP("
        "static_graph=True) (the same ones unused at every step), or freeze them with requires_grad_(False)."
    )
