"""Devices: the only module of fitkit that knows about cuda, mps and autocast.

Everything that picks a device, moves a (nested) batch onto it, or moves an
optimizer's state lives here, so the rest of the package never branches on the
device type.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from fitkit import nest

__all__ = [
    "resolve_device",
    "move_to_device",
    "optimizer_to",
    "autocast",
    "PRECISIONS",
    "accelerator_rng_state",
    "set_accelerator_rng_state",
]

#: Precision names accepted by ``Model.compile(precision=...)`` and the autocast dtype of each.
#: A reusable no-op context (``autocast`` at ``"32"``, a window's last micro-batch without
#: ``no_sync``): nothing is built per step.
NO_CONTEXT = contextlib.nullcontext()

PRECISIONS: dict[str, torch.dtype | None] = {
    "32": None,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Turn a device request into a ``torch.device``.

    ``"auto"`` picks, in order: the ``FITKIT_DEVICE`` environment variable, CUDA, MPS, CPU.
    A bare ``"cuda"`` becomes the current CUDA device (``cuda:LOCAL_RANK`` under torchrun).

    Args:
        device: ``"auto"``, a device string such as ``"cpu"`` or ``"cuda:1"``, or a
            ``torch.device``.

    Returns:
        The resolved device, with an index for CUDA.

    Raises:
        TypeError: ``device`` is neither a string nor a ``torch.device``.
        ValueError: the string is not a device name, or names a device this machine lacks.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            "Expected `device` to be 'auto', a device string or a torch.device. "
            f"Received: device={device!r} of type {type(device).__name__}. Fix: pass device='auto', 'cpu' or 'cuda:0'."
        )
    if isinstance(device, str) and device == "auto":
        device = os.environ.get("FITKIT_DEVICE") or _best_available()
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(
            f"Expected `device` to be 'auto' or a torch device name such as 'cpu' or 'cuda:0'. "
            f"Received: device={device!r} ({e}). Fix: pass device='auto' to pick the best one there is."
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "Expected `device` to name a device this machine has. "
                f"Received: device={str(device)!r}, but CUDA is not available on this machine. "
                "Fix: pass device='auto' or 'cpu'."
            )
        if dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(
            "Expected `device` to name a device this machine has. "
            f"Received: device={str(device)!r}, but MPS is not available on this machine. "
            "Fix: pass device='auto' or 'cpu'."
        )
    return dev


def _best_available() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def move_to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor inside a nested tuple / list / dict structure to ``device``.

    Host-to-CUDA copies are ``non_blocking`` (they overlap with compute when the source is in
    pinned memory); other objects pass through unchanged. Tensors already on ``device`` are
    returned as they are, without a copy.

    Args:
        obj: a tensor, or tuples / lists / dicts of them (any depth); other leaves are kept.
        device: the target device.

    Returns:
        The same structure with tensors on ``device``.

    Example:
        >>> batch = {"x": torch.zeros(2, 3), "meta": ("id", torch.ones(2))}
        >>> moved = move_to_device(batch, torch.device("cpu"))
        >>> moved["x"].device, moved["meta"][0]
        (device(type='cpu'), 'id')
    """
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):  # the common case, without the walk
        return obj if obj.device == device else obj.to(device, non_blocking=device.type == "cuda")
    non_blocking = device.type == "cuda"
    return nest.map_structure(lambda t: t if t.device == device else t.to(device, non_blocking=non_blocking), obj)


def optimizer_to(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move an optimizer's state tensors (e.g. Adam's moments) to ``device`` in place.

    The ``step`` counters stay where torch keeps them (on the CPU unless the optimizer is
    ``capturable`` or ``fused``), since torch's non-capturable kernels expect them there.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        device: the target device.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.Adam([p])
        >>> optimizer_to(opt, torch.device("cpu"))
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device)


def autocast(device: torch.device, precision: str):
    """Return the autocast context manager for ``precision`` on ``device``'s type.

    Args:
        device: the model's device.
        precision: a key of :data:`PRECISIONS`.

    Returns:
        ``torch.autocast`` for the mixed precisions; a disabled one for ``"32"``.

    Example:
        >>> with autocast(torch.device("cpu"), "bf16-mixed"):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
    """
    dtype = PRECISIONS[precision]
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def accelerator_rng_state() -> tuple[Any, Any]:
    """The accelerators' RNG states ``(cuda, mps)``, for :func:`set_accelerator_rng_state`.

    CUDA's are read only once CUDA is initialized (``None`` before): reading them would
    initialize it, with a context on the device, for a run that may never use CUDA.

    Example:
        >>> set_accelerator_rng_state(accelerator_rng_state())  # a round trip changes nothing
    """
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    mps = torch.mps.get_rng_state() if torch.backends.mps.is_available() else None
    return cuda, mps


def set_accelerator_rng_state(state: tuple[Any, Any]) -> None:
    """Put back what :func:`accelerator_rng_state` returned.

    CUDA initialized since (by the code in between) is put back in the state it had when it
    started: each device's generator at its seed, nothing drawn yet.
    """
    cuda, mps = state
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    elif torch.cuda.is_initialized():
        for generator in torch.cuda.default_generators:
            generator.manual_seed(generator.initial_seed())
    if mps is not None:
        torch.mps.set_rng_state(mps)
