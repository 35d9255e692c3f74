"""Activation checkpointing on any strategy: ``Model(net, activation_checkpointing=...)``.

The picked submodules run their forward under :func:`torch.utils.checkpoint.checkpoint`
(non-reentrant, the RNG state preserved): their activations are dropped after the forward and
recomputed in the backward, trading one more forward per unit for memory. Values and gradients
are those of the plain run, bit for bit (dropout draws the same masks again). The units follow
``FSDP(wrap=...)``'s spec (:class:`fitkit.distributed.FSDP`): ``True`` is its default units
(fitkit's and torch's transformer blocks, a Hugging Face model's ``_no_split_modules``), or a
class, a class name, a list of them, or a function ``module -> bool``. The module keeps its
classes and state-dict keys: only the units' ``forward`` is replaced, on the instances.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint, noop_context_fn

__all__ = ["checkpoint_activations", "checkpointed_units", "check_recompute"]


def check_recompute(spec: object, strategy: object) -> None:
    """``Model``'s ``activation_checkpointing`` checked against its strategy.

    Raises:
        TypeError: not a bool nor a ``FSDP(wrap=...)`` spec (checked by :func:`checkpointed_units`).
        ValueError: with an FSDP strategy, which checkpoints its own units.
    """
    if spec is None or spec is False:
        return
    from fitkit.distributed.fsdp import FSDP

    if strategy == "fsdp" or isinstance(strategy, FSDP):
        raise ValueError(
            f"Model(activation_checkpointing={spec!r}) with strategy={strategy!r}: FSDP checkpoints its own units. "
            "Fix: pass strategy=fitkit.distributed.FSDP(wrap=<the same units>, activation_checkpointing=True)."
        )


def checkpointed_units(module: nn.Module, spec: object) -> list[nn.Module]:
    """The outermost submodules ``spec`` picks (one inside another is checkpointed with it).

    Raises:
        TypeError: a ``spec`` that ``FSDP(wrap=...)`` refuses.
        ValueError: a spec that picks no submodule.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2)))
        >>> [type(m).__name__ for m in checkpointed_units(net, [nn.Linear])]
        ['Linear', 'Linear']
        >>> [type(m).__name__ for m in checkpointed_units(net, lambda m: isinstance(m, nn.Sequential))]
        ['Sequential']
    """
    from fitkit.distributed.fsdp import FSDP

    if spec is True:
        spec = None  # FSDP's default units
    try:
        policy = FSDP(wrap=spec)
    except TypeError as e:
        said = str(e).replace("`wrap`", "`activation_checkpointing`").replace("wrap=", "activation_checkpointing=")
        raise TypeError(said + " (or True: the transformer blocks)") from None
    units = policy.units(module)
    picked = {id(u) for u in units}
    outer = []
    for name, sub in module.named_modules():
        if id(sub) not in picked or not name:
            continue
        parts = name.split(".")
        if not any(id(module.get_submodule(".".join(parts[:i]))) in picked for i in range(1, len(parts))):
            outer.append(sub)
    if not outer:
        raise ValueError(
            f"activation_checkpointing={spec!r} picks no submodule of {type(module).__name__} (the root is never "
            "checkpointed). Fix: name the block class, e.g. activation_checkpointing=[MyBlock], or a function "
            "of the module."
        )
    return outer


def checkpoint_activations(module: nn.Module, spec: object) -> list[nn.Module]:
    """Make the units ``spec`` picks recompute their activations in the backward.

    Returns:
        The units (their ``forward`` replaced on the instance; nothing else changes).
    """
    units = checkpointed_units(module, spec)
    for unit in units:
        if not isinstance(unit.forward, _Checkpointed):
            unit.forward = _Checkpointed(unit)
    return units


class _Checkpointed:
    """A unit's forward under ``checkpoint`` when it trains with autograd on, else plain.

    Every training forward counts once (the loop's invariant 4): the recomputation in the
    backward leaves the running statistics of the unit's norm layers (BatchNorm, InstanceNorm
    with ``track_running_stats``: ``running_mean``, ``running_var``, ``num_batches_tracked``) as
    the forward left them, so they move once per step, as in the plain run. The values do not
    change: a norm layer in training mode normalizes by the batch's own statistics.
    """

    def __init__(self, unit: nn.Module):
        self.unit = unit
        self.plain = unit.forward
        self.norms = [m for m in unit.modules() if isinstance(m, _NormBase)]
        functools.update_wrapper(self, type(unit).forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.unit.training and torch.is_grad_enabled():
            context = self._contexts if self.norms else noop_context_fn
            return checkpoint(self.plain, *args, use_reentrant=False, context_fn=context, **kwargs)
        return self.plain(*args, **kwargs)

    def _contexts(self) -> tuple[Any, Any]:
        """``checkpoint``'s (forward, recomputation) contexts: the statistics stay still in the second."""
        return contextlib.nullcontext(), _stats_still(self.norms)


@contextlib.contextmanager
def _stats_still(norms: list[_NormBase]) -> Iterator[None]:
    """The norm layers' running statistics as before the body (a recomputed forward): copied
    (a few vectors per layer, once per step) and written back through ``.data``, so the graph the
    recomputation saved sees no in-place change."""
    saved = [[b.detach().clone() for b in _stats(m)] for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, values in zip(norms, saved, strict=True):
                for b, v in zip(_stats(m), values, strict=True):
                    b.data.copy_(v)


def _stats(norm: _NormBase) -> list[torch.Tensor]:
    return [b for b in (norm.running_mean, norm.running_var, norm.num_batches_tracked) if b is not None]
