"""``Model(strategy=FSDP(...))``: which submodules FSDP2 shards as units, and how.

``fully_shard`` gathers a unit's parameters before its forward and frees them after, one unit
at a time; a module with no unit but the root is gathered whole at every forward. The wrap
policy names the units: module classes (or their names), or a function of the module. By
default they are fitkit's ``TransformerBlock``, torch's ``TransformerEncoderLayer`` /
``TransformerDecoderLayer`` and, in a Hugging Face model, the classes its ``_no_split_modules``
names (``GPT2Block``, ``LlamaDecoderLayer``, ...), as Accelerate and torchtitan do. The same
options carry FSDP2's mixed precision (``MixedPrecisionPolicy``), activation checkpointing of
the units (``checkpoint_wrapper``) and CPU offload (``CPUOffloadPolicy``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["FSDP", "default_units"]


def default_units(module: nn.Module) -> tuple[type | str, ...]:
    """The unit classes of ``wrap=None``: fitkit's and torch's blocks and ``_no_split_modules``.

    Args:
        module: the root module (its submodules' ``_no_split_modules`` are read too).

    Returns:
        Classes, and class names (the Hugging Face ones).

    Example:
        >>> [c.__name__ for c in default_units(nn.Linear(1, 1))]
        ['TransformerBlock', 'TransformerEncoderLayer', 'TransformerDecoderLayer']
    """
    from fitkit.layers import TransformerBlock

    names: list[str] = []
    for sub in module.modules():
        for name in getattr(sub, "_no_split_modules", None) or ():
            if isinstance(name, str) and name not in names:
                names.append(name)
    return (TransformerBlock, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, *names)


class FSDP:
    """The FSDP2 strategy with options: ``Model(net, strategy=FSDP(...))``.

    ``strategy="fsdp"`` is ``FSDP()``. Under torchrun, ``compile()`` shards the module in place:
    every unit the wrap policy picks, innermost first, then the root (always a unit). On one
    process the strategy trains plainly, as every strategy does.

    Args:
        wrap: the units. ``None``: :func:`default_units` (fitkit's and torch's transformer
            blocks, and a Hugging Face model's ``_no_split_modules`` classes). A module class,
            a class name (``"GPT2Block"``), or a list of them: every submodule of one of those
            classes. A function ``module -> bool``: every submodule (not the root) for which it
            returns ``True``. ``[]``: the root only.
        mixed_precision: ``None`` (parameters, gradients and their reduction in their own
            dtype), a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (every unit's, the root's
            included, as given), or a floating dtype (``torch.bfloat16``) as a shorthand for
            ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)`` on the units
            and the same with ``output_dtype=torch.float32`` on the root: the forward and
            backward compute in ``dtype`` from the gathered parameters (a unit hands its output
            on in ``dtype``, so a layer the root holds itself computes in it too) and only the
            module's output is float32; gradients are reduced in float32, the sharded
            parameters and the optimizer stay float32. A policy that reduces in a 16-bit type
            costs one small all-reduce per step where the loss denominator is known on the
            device only (:mod:`~fitkit.distributed.counted`).
        activation_checkpointing: wrap every outermost unit in ``checkpoint_wrapper``
            (``torch.utils.checkpoint``, non-reentrant): its activations are recomputed in the
            backward instead of kept. The values are the same; state-dict keys keep their names.
        cpu_offload: keep the sharded parameters, their gradients and the optimizer step on the
            CPU (``torch.distributed.fsdp.CPUOffloadPolicy``); each unit is copied to the device
            for its forward and backward.

    Raises:
        TypeError: ``wrap`` is neither ``None``, a module class, a name, a list of those, nor a
            function; ``mixed_precision`` is neither ``None``, a ``MixedPrecisionPolicy`` nor a
            floating dtype; the flags are not bools.
        ValueError: ``activation_checkpointing=True`` on a module with no unit but the root
            (raised at ``compile()``, before anything is sharded).

    Example:
        >>> import torch, fitkit
        >>> from fitkit.distributed import FSDP
        >>> strategy = FSDP(wrap=[torch.nn.Linear], mixed_precision=torch.bfloat16)
        >>> strategy
        FSDP(wrap=[Linear], mixed_precision=torch.bfloat16, activation_checkpointing=False, cpu_offload=False)
        >>> model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu", strategy=strategy)
        >>> model.compile(optimizer="sgd", loss="mse")  # one process: trains plainly
        >>> model.fit(torch.ones(4, 2), torch.ones(4, 1), epochs=1, verbose=0).epoch
        [0]
        >>> [type(m).__name__ for m in strategy.units(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))]
        ['Linear']
    """

    def __init__(
        self,
        wrap: Any = None,
        mixed_precision: Any = None,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
    ):
        self.wrap = _check_wrap(wrap)
        self.mixed_precision = _check_precision(mixed_precision)
        for name, value in (("activation_checkpointing", activation_checkpointing), ("cpu_offload", cpu_offload)):
            if not isinstance(value, bool):
                raise TypeError(
                    f"Expected `{name}` to be a bool. Received: {name}={value!r} of type "
                    f"{type(value).__name__}. Fix: pass True or False."
                )
        self.activation_checkpointing = activation_checkpointing
        self.cpu_offload = cpu_offload

    def __repr__(self) -> str:
        if self.wrap is None or callable(self.wrap):
            wrap = repr(self.wrap) if self.wrap is None else _callable_name(self.wrap)
        else:
            wrap = "[" + ", ".join(w if isinstance(w, str) else w.__name__ for w in self.wrap) + "]"
        return (
            f"FSDP(wrap={wrap}, mixed_precision={self._precision_repr()}, "
            f"activation_checkpointing={self.activation_checkpointing}, cpu_offload={self.cpu_offload})"
        )

    def _precision_repr(self) -> str:
        mp = self.mixed_precision
        if isinstance(mp, torch.dtype):
            return str(mp)
        return repr(mp)

    # -- the units -----------------------------------------------------------------------
    def units(self, module: nn.Module) -> list[nn.Module]:
        """The submodules the wrap policy picks (the root excluded), outermost first."""
        policy = self.wrap
        if policy is not None and not isinstance(policy, tuple):
            return [sub for sub in list(module.modules())[1:] if policy(sub)]
        kinds = default_units(module) if policy is None else policy
        classes = tuple(k for k in kinds if isinstance(k, type))
        names = {k for k in kinds if isinstance(k, str)}
        return [sub for sub in list(module.modules())[1:] if isinstance(sub, classes) or type(sub).__name__ in names]

    def check_names(self, module: nn.Module) -> None:
        """Every class name given in ``wrap`` names a submodule class of ``module``.

        Raises:
            ValueError: a name that matches no submodule (a typo would wrap nothing, silently),
                with the close class names of the model.

        Example:
            >>> try:
            ...     FSDP(wrap=["Lineer"]).check_names(nn.Sequential(nn.Linear(1, 1)))
            ... except ValueError as e:
            ...     print(str(e).split(", but")[0])
            FSDP(wrap=...) names 'Lineer'
        """
        if not isinstance(self.wrap, tuple):
            return
        present = sorted({type(sub).__name__ for sub in module.modules()})
        for name in (w for w in self.wrap if isinstance(w, str)):
            if name not in present:
                import difflib

                close = difflib.get_close_matches(name, present, n=3)
                hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
                raise ValueError(
                    f"FSDP(wrap=...) names {name!r}, but no submodule of {type(module).__name__} has that class, "
                    f"so nothing would be wrapped.{hint} Classes in the model: {', '.join(present)}. Fix: pass "
                    "the block's class (or its exact name)."
                )

    def policy(self, root: bool = True) -> Any:
        """The ``MixedPrecisionPolicy`` the root (``root=False``: every other unit) is sharded
        with. A policy given is used as given, for every unit. The dtype shorthand computes in
        ``dtype`` and reduces in float32 everywhere, and only the root casts its output to
        float32: a unit hands its output on in ``dtype``, so a layer the root holds itself
        (a head after the blocks) gets its input in the dtype of its gathered weights.

        Example:
            >>> p = FSDP(mixed_precision=torch.bfloat16).policy()
            >>> p.param_dtype, p.reduce_dtype, p.output_dtype, FSDP().policy().reduce_dtype
            (torch.bfloat16, torch.float32, torch.float32, None)
            >>> FSDP(mixed_precision=torch.bfloat16).policy(root=False).output_dtype is None
            True
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = self.mixed_precision
        if isinstance(mp, torch.dtype):
            return MixedPrecisionPolicy(
                param_dtype=mp, reduce_dtype=torch.float32, output_dtype=torch.float32 if root else None
            )
        return mp if mp is not None else MixedPrecisionPolicy()

    def shard(self, module: nn.Module) -> None:
        """``fully_shard`` the units (checkpoint-wrapped first if asked), then the root."""
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            OffloadPolicy,
            fully_shard,
        )

        units = [u for u in self.units(module) if not isinstance(u, FSDPModule)]
        if self.activation_checkpointing:
            if not units:
                raise ValueError(
                    f"FSDP(activation_checkpointing=True) checkpoints the FSDP units, and the wrap policy "
                    f"picks none in {type(module).__name__} (the root is not checkpointed). Fix: pass "
                    "wrap=[the block class] (or a function), or activation_checkpointing=False."
                )
            units = _checkpoint_outermost(module, units)
        offload = CPUOffloadPolicy(pin_memory=_pinnable(module)) if self.cpu_offload else OffloadPolicy()
        for unit in reversed(units):  # innermost first: fully_shard goes bottom-up
            fully_shard(unit, mp_policy=self.policy(root=False), offload_policy=offload)
        fully_shard(module, mp_policy=self.policy(), offload_policy=offload)


def _checkpoint_outermost(module: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Replace every unit not inside another unit by its ``checkpoint_wrapper`` in its parent;
    the units to shard, the wrappers in place of the units they hold."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    picked = {id(u) for u in units}
    outer: dict[int, nn.Module] = {}
    for name, sub in module.named_modules():
        if id(sub) not in picked or not name:
            continue
        parents = name.split(".")
        if any(id(module.get_submodule(".".join(parents[:i]))) in picked for i in range(1, len(parents))):
            continue  # inside an outer unit, which is checkpointed whole
        parent = module.get_submodule(".".join(parents[:-1]))
        wrapped = checkpoint_wrapper(sub)
        setattr(parent, parents[-1], wrapped)
        outer[id(sub)] = wrapped
    return [outer.get(id(u), u) for u in units]


def _check_wrap(wrap: Any) -> Any:
    if wrap is None:
        return None
    if (isinstance(wrap, type) and issubclass(wrap, nn.Module)) or isinstance(wrap, str):
        return (wrap,)
    if isinstance(wrap, Sequence):
        items = tuple(wrap)
        for item in items:
            if not ((isinstance(item, type) and issubclass(item, nn.Module)) or isinstance(item, str)):
                raise TypeError(
                    "Expected every item of `wrap` to be an nn.Module subclass or a class name. "
                    f"Received: {item!r} of type {type(item).__name__}. Fix: e.g. wrap=[nn.Linear] or "
                    "wrap=['GPT2Block']."
                )
        return items
    if callable(wrap) and not isinstance(wrap, type):
        return wrap
    raise TypeError(
        "Expected `wrap` to be None, an nn.Module subclass, a class name, a list of those, or a "
        f"function module -> bool. Received: wrap={wrap!r} of type {type(wrap).__name__}. Fix: e.g. "
        "wrap=[MyBlock] or wrap=lambda m: isinstance(m, MyBlock)."
    )


def _check_precision(mixed_precision: Any) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision is None or isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    if isinstance(mixed_precision, torch.dtype) and mixed_precision.is_floating_point:
        return mixed_precision
    raise TypeError(
        "Expected `mixed_precision` to be None, a torch.distributed.fsdp.MixedPrecisionPolicy or a "
        f"floating dtype. Received: mixed_precision={mixed_precision!r} of type "
        f"{type(mixed_precision).__name__}. Fix: e.g. mixed_precision=torch.bfloat16."
    )


def _callable_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", repr(fn))


def _pinnable(module: nn.Module) -> bool:
    """Whether the offloaded shards can live in pinned memory (an accelerator to copy to)."""
    p = next(module.parameters(), None)
    return p is not None and p.device.type != "cpu" and torch.accelerator.is_available()
