"""Models built on the meta device: materialised where they train, initialised by their own code.

``with torch.device("meta"): net = GPT(...)`` builds a model without memory (shapes only). Under
``strategy="fsdp"`` on torchrun, ``compile`` shards it first and then allocates only this rank's
shards (``to_empty``), so the full model never exists in one process: a model larger than one
process's memory trains. Elsewhere (one process, DDP) ``fitkit.Model`` allocates the whole
module on its device. Either way the fresh memory is then initialised by :func:`initialize`:

- the module's own ``init_weights()`` when it has one (fitkit's :class:`~fitkit.layers.GPT`,
  Hugging Face's ``PreTrainedModel``, torchtitan's convention), else
- ``reset_parameters()`` of every submodule that has one (every ``torch.nn`` layer: PyTorch's
  default initialisation; BatchNorm's running statistics too).

Buffers computed in ``__init__`` (a causal mask, rotary tables) are not recomputed: give such a
module ``init_weights()`` or ``reset_parameters()`` that fills them, or build it off the meta
device. Under FSDP each rank initialises its own shards from its own random stream (the global
seed plus the rank), so the shards of one weight are independent draws, as one full draw's are.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["on_meta", "materialize", "initialize"]


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device.

    Example:
        >>> with torch.device("meta"):
        ...     net = nn.Linear(2, 3)
        >>> on_meta(net), on_meta(nn.Linear(2, 3))
        (True, False)
    """
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def initialize(module: nn.Module) -> str:
    """Initialise ``module``'s tensors in place by its own code; returns which code ran.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
        >>> with torch.no_grad():
        ...     _ = net[1].running_var.fill_(5.0)
        >>> initialize(net), net[1].running_var.tolist()
        ('reset_parameters', [1.0, 1.0, 1.0])
    """
    own = getattr(module, "init_weights", None)
    if callable(own):
        own()
        return "init_weights"
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
    return "reset_parameters"


def materialize(module: nn.Module, device: torch.device, stream: int = 0) -> str:
    """Allocate ``module``'s meta tensors on ``device`` (``to_empty``: nothing copied; each
    ``Parameter`` object kept, so tied weights stay tied) and
    initialise them (:func:`initialize`) from the global seed plus ``stream`` (the rank, under
    FSDP), leaving the global random state as it was; returns which code initialised.

    Example:
        >>> with torch.device("meta"):
        ...     net = nn.Linear(4, 2)
        >>> materialize(net, torch.device("cpu")), net.weight.device.type, bool(net.weight.abs().sum() > 0)
        ('reset_parameters', 'cpu', True)
    """
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # the same Parameter objects: ties kept
    try:
        module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.random.fork_rng(devices=[]):
        if stream:
            torch.manual_seed(torch.initial_seed() + stream)
        with torch.no_grad():
            how = initialize(module)
    return how
