"""``Model.summary()``: a rich table of layers, output shapes and parameter counts."""

from __future__ import annotations

from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from fitkit.compile import call
from fitkit.distributed.group import is_rank_zero

__all__ = ["summary_table"]


def _shape(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        return str(tuple(out.shape))
    if isinstance(out, (tuple, list)):
        return ", ".join(_shape(o) for o in out)
    if isinstance(out, dict):
        return ", ".join(f"{k}: {_shape(v)}" for k, v in out.items())
    return "?"


def _output_shapes(model: Any) -> dict[str, str]:
    """Run the example batch the model kept (eval mode, no grad) and record each layer's shape."""
    x = model._example_x
    if x is None:
        return {}
    shapes: dict[str, str] = {}
    handles = []
    for name, m in model.module.named_modules():
        def hook(_m, _inp, out, name=name):
            shapes[name] = _shape(out)

        handles.append(m.register_forward_hook(hook))
    flags = [(m, m.training) for m in model.module.modules()]
    try:
        model.module.eval()
        with torch.no_grad():
            call(model.module, x)
    finally:
        for h in handles:
            h.remove()
        for m, flag in flags:
            m.training = flag
    return shapes


def summary_table(model: Any, print_fn: Any = None) -> Table:
    """Build and print the summary of ``model`` (a :class:`fitkit.Model`).

    Rows are the module's children, depth-first, down to leaf layers; a parameter counts
    where it is registered. Output shapes come from the last in-memory batch fit / evaluate
    saw (``?`` before). Shared parameters count once in the totals.

    Args:
        model: the :class:`fitkit.Model`.
        print_fn: called with the table; default: print to the terminal with rich.

    Returns:
        The ``rich.table.Table``.

    Example:
        >>> import fitkit
        >>> m = fitkit.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), device="cpu")
        >>> t = m.summary(print_fn=lambda table: None)
        >>> t.row_count, list(t.columns[3].cells)
        (4, ['40', '0', '18', '58'])
    """
    shapes = _output_shapes(model)
    table = Table(title=f"Model: {type(model.module).__name__}")
    for col in ("Layer", "Type", "Output shape", "Params", "Trainable"):
        table.add_column(col, justify="right" if col in ("Params", "Trainable") else "left")
    for name, m in model.module.named_modules():
        if not name:
            continue
        own = list(m.parameters(recurse=False))
        n = sum(p.numel() for p in own)
        trainable = sum(p.numel() for p in own if p.requires_grad)
        depth = name.count(".")
        table.add_row("  " * depth + name, type(m).__name__, shapes.get(name, "?"), f"{n:,}", f"{trainable:,}")
    params = {id(p): p for p in model.module.parameters()}.values()
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



