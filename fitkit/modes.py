"""Train / eval flags and grad mode for a phase, restored exactly afterwards."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from fitkit.checks import FitkitWarning

__all__ = ["modes", "warn_if_all_eval"]


@contextlib.contextmanager
def modes(module: nn.Module, training: bool | None, grad: bool) -> Iterator[None]:
    """Set modes for a phase and restore every submodule's own flag and the grad mode.

    ``training=None`` keeps the user's flags (training runs frozen ``.eval()`` parts frozen);
    ``False`` puts every submodule in eval mode. The flags come back also when the body raises.

    Example:
        >>> net = nn.Sequential(nn.Linear(1, 1), nn.Dropout())
        >>> _ = net[1].eval()
        >>> with modes(net, training=False, grad=False):
        ...     net.training, torch.is_grad_enabled()
        (False, False)
        >>> [m.training for m in net.modules()], torch.is_grad_enabled()
        ([True, True, False], True)
    """
    flags = [(m, m.training) for m in module.modules()]
    grad_before = torch.is_grad_enabled()
    try:
        if training is False:
            module.eval()
        torch.set_grad_enabled(grad)
        yield
    finally:
        for m, flag in flags:
            m.training = flag
        torch.set_grad_enabled(grad_before)


def warn_if_all_eval(module: nn.Module) -> None:
    """Warn when ``fit`` would train a module whose every submodule is in eval mode."""
    if not any(m.training for m in module.modules()):
        warnings.warn(
            "Every submodule is in eval mode, so fit trains with dropout off and BatchNorm "
            "statistics frozen. If that is not intended, call `model.module.train()` first.",
            category=FitkitWarning,
            stacklevel=4,
        )
