"""Export a trained module for serving: a ``torch.export`` program file or an ONNX file.

:func:`export` traces the module once with ``torch.export.export`` (in eval mode, under
``no_grad``, with a dynamic batch dimension), then writes the ``ExportedProgram`` with
``torch.export.save`` (``format="torch"``, a ``.pt2`` file that ``torch.export.load`` reads
back) or translates that same program to ONNX with ``torch.onnx.export`` (``format="onnx"``,
the dynamo-based exporter, which needs ``onnxscript``; ``pip install ".[onnx]"`` from a checkout).
``Model.export`` calls it with the model's module.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fitkit import nest
from fitkit.checks.declared import Option, declare, declared
from fitkit.modes import modes

__all__ = ["export", "FORMATS"]

#: The formats :func:`export` writes.
FORMATS = ("torch", "onnx")

# Weights above this size go to an external ``.onnx.data`` file: a single protobuf file
# cannot exceed 2 GiB, so only large models pay for a second file.
_ONNX_INLINE_LIMIT = 1 << 30


def _as_call(example_input: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # fitkit's calling convention (fitkit.compile.call): a tuple calls module(*x), a dict
    # module(**x); a namedtuple is one input.
    if isinstance(example_input, Mapping):
        return (), dict(example_input)
    if isinstance(example_input, tuple) and not hasattr(example_input, "_fields"):
        return tuple(example_input), {}
    return (example_input,), {}


def _batch_of_two(x: Any) -> Any:
    # torch.export specializes dimensions of size 0 and 1, so an example batch of one would
    # pin the batch to 1: repeat it to two rows (the traced graph never reads the values).
    return nest.map_structure(
        lambda t: t.expand(2, *t.shape[1:]).contiguous() if t.dim() >= 1 and t.size(0) == 1 else t, x
    )


def _batch_specs(x: Any, batch: Any) -> Any:
    # One spec per input leaf: dim 0 of every batched tensor is the shared batch dimension;
    # the specs have the inputs' structure (a namedtuple stays one).
    return nest.map_structure(lambda t: {0: batch} if t.dim() >= 1 else None, x, other=None)


def _register_namedtuples(example_input: Any) -> None:
    # torch.export.save writes a namedtuple input's class by name: each needs that name once.
    from torch.utils import _pytree

    for cls in nest.namedtuple_types(example_input):
        if cls not in _pytree.SUPPORTED_SERIALIZED_TYPES:
            _pytree._register_namedtuple(cls, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")


def _trace(module: nn.Module, example_input: Any, dynamic_batch: bool) -> Any:
    args, kwargs = _as_call(example_input)
    dynamic_shapes = None
    if dynamic_batch:
        args, kwargs = _batch_of_two(args), _batch_of_two(kwargs)
        batch = torch.export.Dim("batch")
        dynamic_shapes = _batch_specs(kwargs, batch) if kwargs else _batch_specs(args, batch)
    try:
        with modes(module, training=False, grad=False):
            return torch.export.export(module, args, kwargs or None, dynamic_shapes=dynamic_shapes)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"torch.export could not export {type(module).__name__}: {type(e).__name__}: {first} "
            "Fix: torch.export traces one path through forward, so Python control flow on a "
            "tensor's values (`if x.sum() > 0:`, `.item()`, `.tolist()`) cannot be exported; "
            "rewrite it with torch.where or torch.cond. If the error names the batch dimension "
            "(e.g. a reshape to a fixed batch size), fix that reshape or pass dynamic_batch=False."
        ) from e


def _batch_symbols(program: Any) -> set[str]:
    # The names torch.export gave the batch dimension of the user inputs (e.g. "s77").
    inputs = set(program.graph_signature.user_inputs)
    symbols: set[str] = set()
    for node in program.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and node.name in inputs and isinstance(val, torch.Tensor) and val.dim() >= 1:
            if not isinstance(val.shape[0], int):
                symbols.add(str(val.shape[0]))
    return symbols


def _name_batch_dim(onnx_program: Any, symbols: set[str]) -> None:
    # ONNX readers (onnxruntime, Netron) show a dimension's name: call the batch "batch"
    # rather than torch.export's "s77". Cosmetic, so any failure leaves the names as they are.
    try:
        import onnx_ir as ir

        graph = onnx_program.model.graph
        for value in [*graph.inputs, *graph.outputs, *(out for node in graph for out in node.outputs)]:
            if value.shape is None:
                continue
            dims = ["batch" if isinstance(d, ir.SymbolicDim) and d.value in symbols else d for d in value.shape]
            if dims != list(value.shape):
                value.shape = ir.Shape(dims)
    except Exception:
        pass


def _write_onnx(program: Any, module: nn.Module, path: Path) -> None:
    size = sum(t.numel() * t.element_size() for t in program.state_dict.values() if isinstance(t, torch.Tensor))
    try:
        onnx_program = torch.onnx.export(program, (), None, dynamo=True, verbose=False)
    except Exception as e:
        raise RuntimeError(
            f"torch.onnx.export could not translate {type(module).__name__} to ONNX: "
            f"{type(e).__name__}: {str(e).strip()[:500]} Fix: export with format='torch', or "
            "replace the operator the message names with one that ONNX supports."
        ) from e
    if onnx_program is None:  # dynamo=True returns the program; an older torch may not
        raise RuntimeError("torch.onnx.export returned no ONNX program. Fix: upgrade torch (2.5 or newer).")
    _name_batch_dim(onnx_program, _batch_symbols(program))
    onnx_program.save(str(path), external_data=size > _ONNX_INLINE_LIMIT)


def _check_example_input(example_input: Any) -> None:
    """An example batch holds at least one tensor (else the trace fails inside ``forward``)."""
    if not nest.leaves(example_input):
        raise TypeError(
            "Expected `example_input` to be one input batch: a tensor, or a tuple / dict holding tensors. "
            f"Received: example_input={example_input!r} ({type(example_input).__name__}). "
            "Fix: pass e.g. example_input=x[:2]."
        )


_EXPORT_OPTIONS = declare(
    "export",
    Option("module", "custom", checked_in="export", bad=("net", 5)),
    Option("path", "path"),
    Option("example_input", "custom", check=_check_example_input, bad=("x", None, [1, 2])),
    Option("format", "custom", checked_in="export", bad=("tflite", 5, None)),
    Option("dynamic_batch", "bool"),
)


@declared(_EXPORT_OPTIONS)
def export(
    module: nn.Module,
    path: str | os.PathLike,
    example_input: Any,
    *,
    format: str = "torch",
    dynamic_batch: bool = True,
) -> Path:
    """Export ``module`` for inference to ``path``: a ``torch.export`` program or an ONNX file.

    The module is traced once by ``torch.export.export`` in eval mode (dropout off, BatchNorm
    running statistics) under ``no_grad``; every submodule's ``training`` flag is restored
    afterwards. ``format="torch"`` saves the ``ExportedProgram`` with ``torch.export.save``
    (load it with ``torch.export.load(path).module()``); ``format="onnx"`` translates the same
    program with ``torch.onnx.export`` (the dynamo exporter) into one ``.onnx`` file (weights
    over 1 GiB go to an external ``.onnx.data`` file next to it, as protobuf caps a file at
    2 GiB). With ``dynamic_batch``, dimension 0 of every input tensor is one symbolic batch
    size (named ``batch`` in the ONNX file), so the file runs on any batch size; an example
    batch of one is repeated to two rows first, because ``torch.export`` fixes dimensions of
    size 1.

    Args:
        module: the network (e.g. ``model.module``); its device is the export device.
        path: the file to write (``.pt2`` by convention for ``"torch"``, ``.onnx`` for
            ``"onnx"``); missing parent folders are created.
        example_input: one input batch on the module's device: a tensor (``module(x)``), a
            tuple (``module(*x)``) or a dict (``module(**x)``), as ``fit`` passes batches; a
            namedtuple is one input (load its ``.pt2`` under
            ``torch.serialization.safe_globals([TheNamedTuple])``).
        format: ``"torch"`` or ``"onnx"``.
        dynamic_batch: make dimension 0 of the inputs (and outputs) symbolic.

    Returns:
        The path written.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: an unknown ``format``.
        ImportError: ``format="onnx"`` without onnx / onnxscript (``pip install ".[onnx]"`` from a checkout).
        RuntimeError: the module cannot be traced (the original error is chained as
            ``__cause__``), e.g. Python control flow on tensor values.

    Example:
        >>> import tempfile
        >>> net = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
        >>> path = export(net, tempfile.mkdtemp() + "/net.pt2", torch.randn(2, 4))
        >>> program = torch.export.load(path)
        >>> x = torch.randn(5, 4)
        >>> torch.allclose(program.module()(x), net(x))
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"Expected `module` to be a torch.nn.Module. Received: {type(module).__name__}.")
    if format not in FORMATS:
        raise ValueError(f"Unknown export format {format!r}. Valid formats: {', '.join(FORMATS)}.")
    if format == "onnx":
        for name in ("onnx", "onnxscript"):  # checked before anything is traced or written
            if importlib.util.find_spec(name) is None:
                raise ImportError(
                    f"export(format='onnx') needs {name}. Install the `onnx` extra: "
                    "`pip install '.[onnx]'` from a checkout (`pip install 'torch-fitkit[onnx]'` once released)."
                )
    path = Path(path)
    program = _trace(module, example_input, bool(dynamic_batch))
    path.parent.mkdir(parents=True, exist_ok=True)
    if format == "torch":
        _register_namedtuples(example_input)
        torch.export.save(program, path)
    else:
        _write_onnx(program, module, path)
    return path
