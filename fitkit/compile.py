"""The training forward: ``torch.compile`` policy (when to compile, falling back to eager when it fails)
and :class:`Forward`, the callable that runs the module in a step.

``jit_compile="auto"`` compiles on CUDA, where it pays off, and stays eager elsewhere (on the
CPU the compile time rarely comes back within a typical run). The compiled module shares the
parameters of the user's module; fitkit always saves and loads through the user's module, so
no file ever carries the ``_orig_mod.`` prefix.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fitkit.checks import FitkitWarning

__all__ = ["resolve_jit_compile", "maybe_compile", "is_compile_error", "call", "Forward"]


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
        compiled: Any = torch.compile(module, **jit)  # type: ignore[arg-type]
        return compiled
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
        category=FitkitWarning,
        stacklevel=4,
    )


def call(module: Any, x: Any) -> Any:
    """Call ``module`` on a batch's inputs: a tuple is positional, a dict keyword inputs.

    Example:
        >>> call(lambda a, b: a + b, (1, 2)), call(lambda **kw: sorted(kw), {"a": 1})
        (3, ['a'])
    """
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return module(*x)
    if isinstance(x, Mapping):
        return module(**x)
    return module(x)


class Forward:
    """Which callable runs the module in a step: the module, DDP's wrapper, or a compiled one.

    The compiled forward is built at the first call; if compilation fails, fitkit warns once
    and runs the eager forward from then on. The first-batch check and ``summary`` call the
    module itself, so they never cost a compilation of their own.

    Args:
        module: the model's module (unwrapped).
        wrap: ``module -> wrapper`` for training under torchrun (DDP), or ``None``.
        jit: ``False`` or ``torch.compile`` kwargs (see :func:`resolve_jit_compile`).

    Example:
        >>> fwd = Forward(nn.Linear(2, 1))
        >>> fwd(torch.zeros(3, 2)).shape, fwd.run(torch.zeros(1, 2)).shape
        (torch.Size([3, 1]), torch.Size([1, 1]))
    """

    def __init__(self, module: nn.Module, wrap: Any = None, jit: dict[str, Any] | bool = False):
        self.module, self.wrap = module, wrap
        wrapped = wrap(module) if wrap is not None else None
        self.eager = module if wrapped is None else wrapped
        self.jit = jit
        self._fn: Any = None
        self._inner: Any = None  # under a wrapper (DDP): the module's compiled call, used inside it

    def refresh(self) -> None:
        """Ask the wrap again (DDP rebuilds its wrapper when the trainable set changed); a new
        wrapper replaces the eager forward, and a compiled one is built afresh from it."""
        if self.wrap is None:
            return
        wrapped = self.wrap(self.module)
        new = self.module if wrapped is None else wrapped
        if new is not self.eager:
            self.eager, self._fn, self._inner = new, None, None

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Call the forward with the module's own signature."""
        if self._fn is None:
            self._build()
        if self._fn is self.eager:
            return self.eager(*args, **kwargs)
        try:
            if self._inner is not None:
                return self._inside(*args, **kwargs)
            return self._fn(*args, **kwargs)
        except Exception as e:
            if not is_compile_error(e):
                raise
            warn_fallback(e)  # once: the eager module is used from now on
            self._fn, self._inner = self.eager, None
            return self.eager(*args, **kwargs)

    def _build(self) -> None:
        """The compiled forward. Under a wrapper (DDP) the module is compiled, not the wrapper:
        DDP then calls one compiled graph of the module (compiling DDP itself made dynamo break
        the graph at DDP's own forward and run it eagerly, on CPU and gloo)."""
        if self.eager is self.module or self.jit is False:
            compiled = maybe_compile(self.eager, self.jit)
            self._fn = self.eager if compiled is None else compiled
            return
        module = self.module

        def call_module(*args: Any, **kwargs: Any) -> Any:  # its hooks included; a frame of fitkit's
            return module._call_impl(*args, **kwargs)  # (dynamo skips a top-level frame of torch.nn's own)

        try:  # nn.Module.compile's recipe, kept to the training forward: the module's call, compiled
            self._inner = torch.compile(call_module, **self.jit)  # type: ignore[arg-type]
        except Exception as e:  # bad kwargs or an unsupported platform: run eager, say so once
            warn_fallback(e)
            self._inner = None
        self._fn = self.eager if self._inner is None else self._inside

    def _inside(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapper's forward, whose call of the module runs the compiled module (only while
        it runs: the module itself stays eager for everything else)."""
        module, inner = self.module, self._inner
        object.__setattr__(module, "_compiled_call_impl", inner)  # what nn.Module.__call__ runs when set
        try:
            return self.eager(*args, **kwargs)
        finally:
            object.__setattr__(module, "_compiled_call_impl", None)

    def __call__(self, x: Any) -> Any:
        """Call the forward on a batch's inputs (see :func:`call`)."""
        if self._fn is self.eager and isinstance(x, torch.Tensor):
            return self.eager(x)  # the common case: an eager module and one input tensor
        return call(self.run, x)

    @contextlib.contextmanager
    def plain(self) -> Iterator[None]:
        """While the body runs, the module itself is the forward: no wrapper, no compilation
        (the checks before step 1 run an overridden ``test_step`` this way)."""
        outer = self._fn, self.eager
        self._fn = self.eager = self.module
        try:
            yield
        finally:
            self._fn, self.eager = outer
