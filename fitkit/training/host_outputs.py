"""``predict``'s outputs, moved off the device as they come: the device holds one batch's.

Keeping every batch's output on the device until the end, and concatenating there, needs twice
the outputs in device memory: a GPU ``predict`` over a language model's logits runs out of it.
:class:`HostOutputs` takes each batch's output as the batch ends:

- on CUDA into pinned host memory with a non-blocking copy (no host sync per batch; one
  stream sync at the end, before the values are read);
- on the CPU the output is already on the host and is kept as it is (no copy);
- on other devices (MPS) with ``Tensor.cpu()``.

When the number of rows is known (in-memory data), each output tensor gets one host buffer of
all the rows, filled batch by batch, so the host holds the outputs once (no list of parts and
its concatenation, which would hold them twice). Otherwise the parts are concatenated on the
host at the end.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fitkit import nest

__all__ = ["HostOutputs", "to_host"]


def to_host(out: object, pinned: bool) -> Any:
    """``out`` with every tensor on the CPU: pinned and non-blocking when ``pinned`` (CUDA).

    The values of a non-blocking copy are there once the device's stream has reached it
    (:meth:`HostOutputs.result` waits for that).

    Example:
        >>> t = torch.ones(2)
        >>> to_host({"a": t}, pinned=False)["a"] is t  # already on the host: kept as it is
        True
    """

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        if not pinned:
            return t.cpu()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    return nest.map_structure(move, out)


class HostOutputs:
    """The outputs of a ``predict`` call, on the host, in input order.

    Args:
        device: the model's device (CUDA: pinned, non-blocking copies).
        rows: the number of input rows, if known: preallocated host buffers are filled then.

    Example:
        >>> outs = HostOutputs(torch.device("cpu"), rows=5)
        >>> for n in (2, 2, 1):
        ...     outs.add({"logits": torch.full((n, 3), float(n))})
        >>> outs.result()["logits"][:, 0]
        tensor([2., 2., 2., 2., 1.])
    """

    def __init__(self, device: torch.device, rows: int | None = None):
        self.pinned = device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self.rows = rows
        self.filled = 0
        self.buffers: Any = None  # the preallocated structure, while every batch fits it
        self.parts: list[Any] = []  # host outputs of each batch, when there are no buffers

    def add(self, out: object) -> None:
        """Take one batch's output (``(B, ...)`` tensors) off the device."""
        ts = nest.leaves(out)
        n = int(ts[0].shape[0]) if ts and ts[0].dim() else 0
        fits = self.rows is not None and bool(ts) and all(t.dim() and t.shape[0] == n for t in ts)
        if fits and self.buffers is None and not self.parts and self._all_tensors(out):
            self.buffers = nest.map_structure(self._buffer, out)
        if fits and self.buffers is not None and self.rows is not None and self.filled + n <= self.rows:
            targets = nest.leaves(self.buffers)
            if [t.shape[1:] for t in targets] == [t.shape[1:] for t in ts]:
                for dst, src in zip(targets, ts, strict=True):
                    dst[self.filled : self.filled + n].copy_(src, non_blocking=self.pinned)
                self.filled += n
                return
        if self.buffers is not None:  # a batch that does not fit: the rest goes as parts
            self.parts.append(self._filled())
            self.buffers = None
        self.parts.append(to_host(out, self.pinned))
        self.filled += n

    def result(self) -> Any:
        """The outputs concatenated on dim 0, on the CPU (one stream sync on CUDA)."""
        if self.pinned:
            torch.cuda.current_stream(self.device).synchronize()  # the non-blocking copies have landed
        if self.buffers is not None:
            return self._filled()
        return nest.concat(self.parts)

    def _filled(self) -> Any:
        return nest.map_structure(lambda t: t[: self.filled], self.buffers)

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        rows = self.rows if self.rows is not None else 0
        return torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=self.pinned)

    @staticmethod
    def _all_tensors(out: object) -> bool:
        """A structure whose every leaf is a tensor (other leaves keep per-batch lists)."""
        if isinstance(out, torch.Tensor):
            return True
        if isinstance(out, (tuple, list)):
            return all(HostOutputs._all_tensors(o) for o in out)
        if isinstance(out, Mapping):
            return all(HostOutputs._all_tensors(v) for v in out.values())
        return False
