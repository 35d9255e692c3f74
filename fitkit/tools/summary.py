"""``Model.summary()``: a rich table of layers, output shapes and parameter counts."""

from __future__ import annotations

from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from fitkit.compile import call
from fitkit.distributed.group import is_rank_zero
from fitkit.modes import modes

__all__ = ["summary_table", "summary_input"]


def _shape(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        return str(tuple(out.shape))
    if isinstance(out, (tuple, list)):
        return ", ".join(_shape(o) for o in out)
    if isinstance(out, dict):
        return ", ".join(f"{k}: {_shape(v)}" for k, v in out.items())
    return "?"


def _output_shapes(module: nn.Module, example_input: Any) -> dict[str, str]:
    """Run ``example_input`` through ``module`` (eval mode, no grad) and record each layer's shape."""
    if example_input is None:
        return {}
    shapes: dict[str, str] = {}
    handles = []
    for name, m in module.named_modules():

        def hook(_m, _inp, out, name=name):
            shapes[name] = _shape(out)

        handles.append(m.register_forward_hook(hook))
    try:
        with modes(module, training=False, grad=False):
            call(module, example_input)
    except Exception as e:
        raise ValueError(
            f"summary could not run {type(module).__name__} on the example input "
            f"({_shape(example_input)}): {type(e).__name__}: {e} Fix: pass an `example_input` "
            "(or `input_shape`, without the batch dimension) that the module accepts."
        ) from e
    finally:
        for h in handles:
            h.remove()
    return shapes


def summary_table(module: nn.Module, print_fn: Any = None, example_input: Any = None) -> Table:
    """Build and print the summary of ``module``: layers, output shapes, parameter counts.

    Rows are the module's children, depth-first, down to leaf layers; a parameter counts
    where it is registered. Output shapes come from one forward pass of ``example_input``
    with forward hooks (eval mode, under ``no_grad``; every ``training`` flag is restored);
    without it, and for a layer the forward does not reach, the shape is ``?``. Shared
    parameters count once in the totals.

    Args:
        module: the network.
        print_fn: called with the table; default: print to the terminal with rich (under
            torchrun, on rank 0 only).
        example_input: one input batch on the module's device: a tensor (``module(x)``), a
            tuple (``module(*x)``) or a dict (``module(**x)``).

    Returns:
        The ``rich.table.Table``: one row per submodule, then a ``Total`` row.

    Raises:
        ValueError: the module fails on ``example_input`` (the error is chained).

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> t = summary_table(net, print_fn=lambda table: None, example_input=torch.zeros(1, 4))
        >>> list(t.columns[2].cells), list(t.columns[3].cells)
        (['(1, 8)', '(1, 8)', '(1, 2)', '(1, 2)'], ['40', '0', '18', '58'])
    """
    shapes = _output_shapes(module, example_input)
    table = Table(title=f"Model: {type(module).__name__}")
    for col in ("Layer", "Type", "Output shape", "Params", "Trainable"):
        table.add_column(col, justify="right" if col in ("Params", "Trainable") else "left")
    for name, m in module.named_modules():
        if not name:
            continue
        own = list(m.parameters(recurse=False))
        n = sum(p.numel() for p in own)
        trainable = sum(p.numel() for p in own if p.requires_grad)
        depth = name.count(".")
        table.add_row("  " * depth + name, type(m).__name__, shapes.get(name, "?"), f"{n:,}", f"{trainable:,}")
    params = {id(p): p for p in module.parameters()}.values()
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    table.add_section()
    table.add_row("Total", "", shapes.get("", "?"), f"{total:,}", f"{trainable:,}")
    table.caption = f"Frozen parameters: {total - trainable:,}"
    if print_fn is None:
        if is_rank_zero():  # under torchrun only rank 0 prints
            Console().print(table)
    else:
        print_fn(table)
    return table


def summary_input(
    module: nn.Module, device: torch.device, input_shape: Any, example_input: Any, last_example: Any
) -> Any:
    """The input ``Model.summary`` runs to find output shapes: zeros of ``(1, *input_shape)`` in the
    module's dtype, ``example_input`` on the device, else the first batch of the last data checked.

    Raises:
        TypeError: ``input_shape`` is not a tuple or list of ints.
        ValueError: both ``input_shape`` and ``example_input``, or a size < 1.

    Example:
        >>> summary_input(nn.Linear(4, 2), torch.device("cpu"), (4,), None, None).shape
        torch.Size([1, 4])
    """
    if input_shape is not None and example_input is not None:
        raise ValueError("Pass `input_shape` or `example_input` to summary, not both.")
    if input_shape is None:
        if example_input is None:
            return last_example
        from fitkit.data import device_batch

        return device_batch(example_input, device=device)[0]
    if not isinstance(input_shape, (tuple, list)) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in input_shape
    ):
        raise TypeError(
            "Expected `input_shape` to be a tuple of ints (one sample, without the batch "
            f"dimension), e.g. (64,). Received: input_shape={input_shape!r}."
        )
    if any(d < 1 for d in input_shape):
        raise ValueError(f"Expected every size in `input_shape` >= 1. Received: input_shape={input_shape!r}.")
    param = next(module.parameters(), None)
    dtype = param.dtype if param is not None else torch.get_default_dtype()
    return torch.zeros((1, *input_shape), device=device, dtype=dtype)
