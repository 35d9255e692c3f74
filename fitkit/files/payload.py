"""What goes into a file: Python log values, ``weights_only``-loadable types, a payload checksum."""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = [
    "CHECKSUM_KEY",
    "payload_checksum",
    "check_weights_only",
    "to_python",
    "with_weights_checksum",
    "pop_weights_checksum",
]

CHECKSUM_KEY = "fitkit_checksum"


def payload_checksum(obj: Any) -> str:
    """``"sha256:<hex>"`` over a canonical walk of ``obj``: keys, types, Python values, and each
    tensor's dtype, shape and raw bytes (from the CPU; a device tensor is copied there).

    Equal for a payload and what ``torch.load`` returns for it, so it verifies a loaded file.

    Example:
        >>> payload_checksum({"a": torch.zeros(2)}) == payload_checksum({"a": torch.zeros(2)})
        True
        >>> payload_checksum({"a": torch.zeros(2)}) == payload_checksum({"a": torch.zeros(2).double()})
        False
    """
    h = hashlib.sha256()
    _feed(h, obj)
    return "sha256:" + h.hexdigest()


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        _feed_tensor(h, obj)
    elif isinstance(obj, (Mapping, list, tuple, set, frozenset)):
        _feed_container(h, obj)
    elif isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
        h.update(b"s%d;" % len(data) + data)
    elif isinstance(obj, (bytes, bytearray)):
        h.update(b"b%d;" % len(obj) + bytes(obj))
    elif isinstance(obj, float):
        h.update(b"f" + obj.hex().encode() + b";")
    else:  # None, bool, int, complex, torch.dtype / device / layout
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def _feed_tensor(h: Any, obj: torch.Tensor) -> None:
    t = obj.detach()
    t = t.to_dense() if t.layout != torch.strided else t
    h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
    if t.numel() and t.device.type != "meta":
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _feed_container(h: Any, obj: Any) -> None:
    if isinstance(obj, Mapping):
        h.update(b"D%d;" % len(obj))
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(b"%s%d;" % (b"L" if isinstance(obj, list) else b"U", len(obj)))
        for v in obj:
            _feed(h, v)
    else:  # a set: no order, so the sorted element digests
        h.update(b"S%d;" % len(obj) + b"".join(sorted(bytes.fromhex(payload_checksum(v)[7:]) for v in obj)))


def with_weights_checksum(state: Mapping[str, Any]) -> OrderedDict:
    """A copy of a module state dict that carries ``"fitkit_checksum"`` in its ``_metadata``.

    ``nn.Module.state_dict()`` keeps per-module metadata (versions) in the attribute
    ``_metadata``, which ``torch.save`` stores and ``torch.load(weights_only=True)`` restores,
    in the zip and the legacy format alike; ``load_state_dict`` ignores keys it does not know.
    So the file stays a plain state dict for every torch tool, and a flipped byte is caught.

    Example:
        >>> sd = with_weights_checksum(torch.nn.Linear(1, 1).state_dict())
        >>> sorted(sd), sd._metadata[""][CHECKSUM_KEY].startswith("sha256:")
        (['bias', 'weight'], True)
    """
    out: OrderedDict = OrderedDict(state)
    meta = getattr(state, "_metadata", None)
    copied = OrderedDict((k, dict(v)) for k, v in meta.items()) if isinstance(meta, Mapping) else OrderedDict()
    copied.setdefault("", {})[CHECKSUM_KEY] = payload_checksum(dict(out))
    out._metadata = copied  # type: ignore[attr-defined]
    return out


def pop_weights_checksum(state: Any) -> str | None:
    """Remove and return the checksum :func:`with_weights_checksum` put into a loaded state dict."""
    meta = getattr(state, "_metadata", None)
    root = meta.get("") if isinstance(meta, Mapping) else None
    if isinstance(root, dict):
        value = root.pop(CHECKSUM_KEY, None)
        return value if isinstance(value, str) else None
    return None


_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.layout)


def check_weights_only(obj: Any, path: str | os.PathLike, root: str = "checkpoint") -> None:
    """Check that ``obj`` holds only types ``torch.load(path, weights_only=True)`` accepts.

    Accepted: dicts and OrderedDicts, lists, tuples, sets, ``torch.Size``, tensors and
    parameters, str, bytes, int, float, complex, bool, None, ``torch.dtype`` / ``device`` /
    ``layout``, and classes registered with ``torch.serialization.add_safe_globals``.

    Raises:
        TypeError: naming the key path and the type, e.g.
            ``checkpoint['callbacks']['MyCb']['x'] is a numpy.ndarray``, and the fix.

    Example:
        >>> import numpy as np
        >>> check_weights_only({"a": [1, 2.0, torch.ones(1)]}, "c.pt")
        >>> check_weights_only({"cb": {"x": np.zeros(2)}}, "c.pt")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: checkpoint['cb']['x'] is a numpy.ndarray, which torch.load(weights_only=True) refuses...
    """
    safe = {g[0] if isinstance(g, tuple) else g for g in torch.serialization.get_safe_globals()}
    _check(obj, root, path, safe)


def _check(obj: Any, where: str, path: Any, safe: set) -> None:
    kind = type(obj)
    if kind in (dict, OrderedDict):
        for k, v in obj.items():
            _check(k, f"a key of {where}", path, safe)
            _check(v, f"{where}[{k!r}]", path, safe)
    elif kind in (list, tuple, set, torch.Size):
        for i, v in enumerate(obj):
            _check(v, f"{where}[{i}]", path, safe)
    elif kind in _LEAVES or kind in (torch.Tensor, torch.nn.Parameter) or kind in safe:
        return
    else:
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(
            f"{where} is a {name}, which torch.load(weights_only=True) refuses, so {str(path)!r} "
            "would not load back; nothing was written. Fix: store Python numbers, strings, lists, "
            "dicts or tensors (float(x), x.tolist(), torch.as_tensor(x)); a callback's "
            "state_dict() must return only these."
        )


def to_python(value: Any) -> Any:
    """Log values as Python numbers: numpy scalars and 0-dim tensors become ``float`` / ``int`` /
    ``bool``, numpy arrays and other tensors lists; dicts, lists and tuples are converted inside.

    Example:
        >>> import numpy as np
        >>> to_python({"f1": np.float64(0.5), "n": torch.tensor(3), "v": np.arange(2)})
        {'f1': 0.5, 'n': 3, 'v': [0, 1]}
    """
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value.item() if value.dim() == 0 else value.tolist()  # syncs with the device
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(to_python(v) for v in value)
    return value
