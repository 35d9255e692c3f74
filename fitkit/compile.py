"""``torch.compile`` policy: when to compile, and falling back to eager when it fails.

``jit_compile="auto"`` compiles on CUDA, where it pays off, and stays eager elsewhere (on the
CPU the compile time rarely comes back within a typical run). The compiled module shares the
parameters of the user's module; fitkit always saves and loads through the user's module, so
no file ever carries the ``_orig_mod.`` prefix.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

__all__ = ["resolve_jit_compile", "maybe_compile", "is_compile_error"]


def resolve_jit_compile(jit_compile: Any, device: torch.device) -> dict[str, Any] | bool:
    """Turn ``compile(jit_compile=...)`` into ``False`` (eager) or ``torch.compile`` kwargs.

    Args:
        jit_compile: ``"auto"`` (compile on CUDA only), ``True``, ``False``, or a dict of
            ``torch.compile`` keyword arguments (e.g. ``{"backend": "aot_eager"}``).
        device: the model's device.

    Raises:
        TypeError: any other value.

    Example:
        >>> resolve_jit_compile("auto", torch.device("cpu")), resolve_jit_compile(True, torch.device("cpu"))
        (False, {})
    """
    if isinstance(jit_compile, dict):
        return dict(jit_compile)
    if jit_compile == "auto":
        return {} if device.type == "cuda" else False
    if isinstance(jit_compile, bool):
        return {} if jit_compile else False
    raise TypeError(
        "Expected `jit_compile` to be 'auto', True, False or a dict of torch.compile kwargs. "
        f"Received: jit_compile={jit_compile!r}."
    )


def maybe_compile(module: nn.Module, jit: dict[str, Any] | bool) -> nn.Module | None:
    """``torch.compile(module, **jit)``, or ``None`` for eager (also when compile is refused)."""
    if jit is False:
        return None
    try:
        return torch.compile(module, **jit)  # type: ignore[arg-type]
    except Exception as e:  # bad kwargs or an unsupported platform: run eager, say so once
        warn_fallback(e)
        return None


def is_compile_error(e: BaseException) -> bool:
    """Whether an exception came from torch.compile's machinery rather than the model."""
    mod = type(e).__module__ or ""
    return mod.startswith(("torch._dynamo", "torch._inductor", "torch.fx"))


def warn_fallback(e: BaseException) -> None:
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    warnings.warn(
        f"torch.compile failed ({type(e).__name__}: {first_line}); fitkit runs this model eagerly. "
        "Fix: set `jit_compile=False` to silence this, or pass torch.compile kwargs as a dict.",
        stacklevel=4,
    )
