"""NaN / inf in in-memory data: found without copying the data, refused only where they would hurt.

:func:`scan` walks a tensor in chunks of rows (about a million values each), so the check adds
a few MB at most, not a copy of the data (``torch.isfinite`` on a whole array allocates more
than the array itself). :func:`check_in_memory` decides what a non-finite value means:

- in ``sample_weight``: always an error;
- in ``x`` or ``y`` of in-memory data: the rows that hold them are run through the module and the loss (in eval
  mode, changing nothing). A loss or module that handles them (a loss that masks missing
  labels, as multi-task benchmarks such as Tox21 need; a module that imputes its inputs) gives
  a finite loss and, when training, finite gradients: the data trains. A NaN loss or a NaN
  gradient (the ``torch.where`` pitfall: a masked forward whose backward still multiplies NaN
  by 0) is an error before step 1, naming the rows.

The scan reads the host once per call, whatever the size of the data, and a tensor found finite
is not scanned again while it is the same tensor object with the same version counter (no
in-place write since): a script that calls ``fit`` in chunks on the same tensors pays the scan
once. (A write that bypasses the version counter, through ``.data`` or a NumPy array sharing the
memory, is not seen.)

Other sources are checked on their first batch (:func:`check_batch_loss`): non-finite values
in it whose loss is not finite are an error before step 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from fitkit import nest
from fitkit.compile import call
from fitkit.data import device_batch
from fitkit.modes import modes

if TYPE_CHECKING:
    from fitkit.data import TensorBatches
    from fitkit.model import Model

__all__ = ["scan", "check_in_memory", "check_batch_loss"]

_CHUNK = 1 << 18  # values per chunk: a 256 KB boolean mask at most


def scan(t: torch.Tensor, keep: int = 0) -> tuple[int, list[int]]:
    """``(number of NaN / inf values, the first ``keep`` rows that hold one)`` of ``t``.

    Reads ``t`` in chunks of rows; only a chunk's mask is allocated. Integer tensors are finite.

    Example:
        >>> scan(torch.tensor([[1.0, float("nan")], [2.0, 3.0], [float("inf"), 0.0]]), keep=4)
        (2, [0, 2])
        >>> scan(torch.arange(3))
        (0, [])
    """
    if not t.is_floating_point() and not t.is_complex() or t.numel() == 0:
        return 0, []
    rows = t.reshape(1) if t.dim() == 0 else t
    per_row = max(1, rows[0].numel())
    step = max(1, _CHUNK // per_row)
    count = 0
    first: list[int] = []
    for start in range(0, rows.shape[0], step):
        ok = torch.isfinite(rows[start : start + step])
        if bool(ok.all()):
            continue
        bad = ~ok
        count += int(bad.sum())
        if len(first) < keep:
            hit = bad.reshape(bad.shape[0], -1).any(1).nonzero()[: keep - len(first), 0]
            first.extend(int(i) + start for i in hit)
    return count, first


# Tensors found finite by an earlier call, with their version counter then: a tensor that has
# not been written to since (same object, same ``_version``) is not scanned again, so a script
# that calls ``fit`` in chunks on the same data pays the scan once. Weak keys: nothing is kept alive.
_FINITE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _chunk_counts(t: torch.Tensor) -> list[torch.Tensor]:
    """The NaN / inf count of each chunk of rows of ``t``, as 0-dim device tensors (no host read)."""
    rows = t.reshape(1) if t.dim() == 0 else t
    step = max(1, _CHUNK // max(1, rows[0].numel()))
    return [(~torch.isfinite(rows[i : i + step])).sum() for i in range(0, rows.shape[0], step)]


def _nonfinite(tensors: list[torch.Tensor]) -> list[int]:
    """How many NaN / inf values each tensor holds: one host read for all of them (none when every
    float tensor was found finite before and not written since)."""
    out = [0] * len(tensors)
    todo = [
        i
        for i, t in enumerate(tensors)
        if (t.is_floating_point() or t.is_complex()) and t.numel() and _FINITE.get(t) != t._version
    ]
    if not todo:
        return out
    device = tensors[todo[0]].device
    parts = [torch.stack(_chunk_counts(tensors[i])).sum().reshape(1).to(device) for i in todo]
    for i, count in zip(todo, torch.cat(parts).tolist(), strict=True):  # the one host read
        out[i] = int(count)
        if not count:
            _FINITE[tensors[i]] = tensors[i]._version
    return out


def _scan_parts(parts: dict[str, Any], keep: int) -> dict[str, tuple[int, list[int]]]:
    """``{name: (NaN / inf count, first rows)}`` of the parts that hold some: one host read when
    none does; where some do, more reads find the rows (before an error or a trial)."""
    leaves = {
        name: [t for t in nest.leaves(part) if isinstance(t, torch.Tensor)]
        for name, part in parts.items()
        if part is not None
    }
    flat = [t for ts in leaves.values() for t in ts]
    counts = iter(_nonfinite(flat))
    found = {}
    for name, ts in leaves.items():
        count, rows = 0, set()
        for t in ts:
            if next(counts):
                n, r = scan(t, keep)
                count += n
                rows.update(r)
        if count:
            found[name] = (count, sorted(rows)[:keep])
    return found


def _scan_part(part: object, keep: int) -> tuple[int, list[int]]:
    return _scan_parts({"part": part}, keep).get("part", (0, []))


def check_in_memory(model: Model | None, source: TensorBatches, training: bool) -> None:
    """Refuse non-finite in-memory values that would reach the loss or the weights (``ValueError``).

    Args:
        model: the :class:`fitkit.Model` (``None``: any non-finite ``x`` / ``y`` is refused).
        source: the :class:`fitkit.data.TensorBatches`.
        training: whether the data trains (the gradients must then be finite too).
    """
    keep = max(1, min(source.batch_size, 64))
    bad = _scan_parts({"sample_weight": source.w, "x": source.x, "y": source.y}, keep)  # one host read
    if "sample_weight" in bad:
        count, first_w = bad.pop("sample_weight")
        raise ValueError(
            f"`sample_weight` holds {count} NaN or infinite values (first at row {first_w[0]}). Fix: weights "
            "scale each sample's loss; use 0 to leave a sample out."
        )
    if not bad:
        return
    rows = sorted({r for _, rs in bad.values() for r in rs})[:keep]
    problem = _trial(model, source, rows, training) if model is not None else "no model to try them on"
    if problem is None:
        return  # the user's loss / module handles them
    name, (count, first) = next(iter(bad.items()))
    message = (
        f"`{name}` holds {count} NaN or infinite values (first at row {first[0]}). Fix: clean or impute "
        f"`{name}` before fit; a NaN input turns every weight NaN."
    )
    if not _builtin(model):
        message += (
            f" Here {problem}. A loss that handles missing values trains: mask them in the loss (its backward "
            "too), or replace them and pass a `sample_weight` of 0 there (shaped like y)."
        )
    raise ValueError(message)


def _builtin(model: Model | None) -> bool:
    """Whether the loss is one of fitkit's own (they never handle NaN), under the default compute_loss."""
    loss = None if model is None else model.loss
    return (
        loss is not None
        and getattr(loss, "kind", "custom") != "custom"
        and model is not None
        and model.default_compute_loss
    )


def _trial(model: Model, source: TensorBatches, rows: list[int], training: bool) -> str | None:
    """Run the rows holding non-finite values through the module and the loss; ``None`` if all is finite."""
    index = torch.tensor(rows, device=nest.leaves(source.x)[0].device)
    x = nest.map_structure(lambda t: t.index_select(0, index), source.x)
    y = None if source.y is None else nest.map_structure(lambda t: t.index_select(0, index), source.y)
    w = None if source.w is None else source.w.index_select(0, index.to(source.w.device))
    batch = device_batch(x, y, w, device=model.device)
    params = [p for p in model.module.parameters() if p.requires_grad]
    with modes(model.module, training=False, grad=training), model.autocast():
        try:
            y_pred = call(model.module, batch[0])
            loss = model.compute_loss(batch[0], batch[1], y_pred, batch[2])
        except Exception as e:  # the first-batch check names failures of other kinds
            return f"the rows holding them fail in the module or the loss ({type(e).__name__}: {e})"
    if not isinstance(loss, torch.Tensor) or not bool(torch.isfinite(loss.detach()).all()):
        return f"the loss of the rows holding them ({rows[:5]}...) is not finite, so it would reach the weights"
    if training and loss.requires_grad and params:
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        if not all(bool(torch.isfinite(g).all()) for g in grads if g is not None):
            return (
                f"the loss of the rows holding them ({rows[:5]}...) is finite but its gradient is not "
                "(a masked forward, such as torch.where, still multiplies NaN by 0 in the backward)"
            )
    return None


def check_batch_loss(batch: tuple[Any, Any, Any], loss: torch.Tensor, label: str = "first batch") -> None:
    """Refuse a batch holding NaN / inf whose loss is not finite (``ValueError``; one sync).

    A batch without non-finite values passes whatever its loss (a diverging model is
    ``TerminateOnNaN``'s business), and so does one whose loss handles them.

    Example:
        >>> check_batch_loss((torch.tensor([[float("nan")]]), torch.zeros(1), None), torch.tensor(0.5))
        >>> check_batch_loss((torch.tensor([[float("nan")]]), torch.zeros(1), None), torch.tensor(float("nan")))
        Traceback (most recent call last):
        ...
        ValueError: The first batch's `x` holds 1 NaN or infinite values (first at row 0), and its loss is not ...
    """
    if not isinstance(loss, torch.Tensor) or bool(torch.isfinite(loss.detach()).all()):
        return
    for name, part in zip(("x", "y", "sample_weight"), batch, strict=False):
        count, rows = _scan_part(part, 1) if part is not None else (0, [])
        if count:
            raise ValueError(
                f"The {label}'s `{name}` holds {count} NaN or infinite values (first at row {rows[0]}), and its loss "
                "is not finite, so it would reach the weights. Fix: clean or impute the data, or mask the "
                "missing values in your loss (its backward too)."
            )
