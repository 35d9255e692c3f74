"""The loss's denominator: what one batch's mean loss divides by, so that means can be summed.

Every batch's loss is ``sum(w_i * l_i) / sum(w_i)`` over its loss terms ``i``, and the batch
reports that denominator ``sum(w_i)`` next to the mean. The accumulation window
(:class:`fitkit.training.stepper.Stepper`), the ranks under torchrun and the epoch totals
(:class:`fitkit.training.tracking.RunningTotals`) then combine batches as ``sum / sum``, so a step
equals one step on the whole window and an epoch's loss is the mean over all its terms,
however the data is cut. The terms are:

- **tokens** for ``"cross_entropy"`` / ``"nll"`` (and ``nn.CrossEntropyLoss`` /
  ``nn.NLLLoss``) with integer class targets, in every layout (``(B, C)`` with ``(B,)``,
  ``(B, C, T)`` or ``(B, T, C)`` with ``(B, T)``): each target position that is not
  ``ignore_index``, weighted by the module's class ``weight`` if it has one;
- **rows** for every other loss (a ``(B, T)`` regression target has ``T`` values per row in
  every row, so its mean over rows is its mean over values).

Sample weights multiply the terms: a ``(B,)`` weight weighs each term of its row (every token
of a sequence), a weight shaped like the targets (``(B, T)``: per token, or per value of a
multi-task regression / binary target) weighs each term alone. ``class_weight`` with integer
``(B, T)`` targets is such a per-position weight (see :mod:`fitkit.data.weights`). A batch, a
window or an epoch whose denominator is 0 contributes nothing (a 0 loss, not 0/0).

Losses fitkit does not know the terms of (callables, several losses, a module's own loss that
takes no ``num_items_in_batch``) count rows; a module's own loss that takes it counts the
batch's label tokens (:func:`fitkit.losses.outputs.label_items`). Nothing here reads a device value on the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from fitkit import nest
from fitkit.losses import Loss

__all__ = ["denominator", "objective", "counts_tokens", "counted", "none_ignored", "targets_count"]


def counts_tokens(loss: Any, y: Any) -> bool:
    """Whether ``loss`` on targets ``y`` has tokens as terms: a class-index loss, integer ``y``.

    Example:
        >>> from fitkit.losses import resolve_loss
        >>> ce = resolve_loss("cross_entropy")
        >>> counts_tokens(ce, torch.tensor([[0, 1]])), counts_tokens(ce, torch.zeros(2, 3))
        (True, False)
    """
    return (
        isinstance(loss, Loss)
        and loss.kind == "class_index"
        and isinstance(y, torch.Tensor)
        and not y.is_floating_point()
        and y.dtype != torch.bool
    )


#: Class-index target tensors scanned for an ignore index: ``{y: (y._version, ignore_index, none
#: found)}`` (weak keys: nothing is kept alive; a write in place since changes the version).
_SCANNED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def none_ignored(loss: Any, y: torch.Tensor) -> bool:
    """Whether no entry of the integer targets ``y`` equals ``loss``'s ignore index (torch's
    ``-100`` when it has none), so every entry is a term of the loss.

    One host read, once per tensor: a tensor is not scanned again for the same ignore index
    while its version counter is unchanged (a script calling ``fit`` in chunks, or a fit of many
    epochs, on the same data pays it once). A write that bypasses the version counter (through
    ``.data``, or a NumPy array sharing the memory) is not seen, as for the finite scan
    (:mod:`fitkit.training.finite`): write targets through torch, or pass a new tensor.

    Example:
        >>> from fitkit.losses import resolve_loss
        >>> ce = resolve_loss("cross_entropy")
        >>> none_ignored(ce, torch.tensor([0, 2, 1])), none_ignored(ce, torch.tensor([0, -100]))
        (True, False)
    """
    ignore = -100 if loss.ignore_index is None else loss.ignore_index
    seen = _SCANNED.get(y)
    if seen is not None and seen[:2] == (y._version, ignore):
        return seen[2]
    free = not bool((y == ignore).any())  # the host read
    _SCANNED[y] = (y._version, ignore, free)
    return free


#: ``(loss, y, y._version)``: the loss whose running phase feeds it rows of the class-index
#: targets ``y``, found to hold no ignored entry at that version (:func:`targets_count`): its
#: batches' counts are their sizes, never 0, so its mean needs no guard against 0 / 0 while
#: ``y`` is unchanged (a write in place mid-pass, by a callback, falls back to the guarded mean).
#: ``None``: not known.
_every_target_counts: tuple[Any, torch.Tensor, int] | None = None


@contextlib.contextmanager
def targets_count(loss: Any, y: Any) -> Iterator[None]:
    """Within: the batches given to ``loss`` come from the targets ``y`` (in-memory data, a
    ``TensorDataset``'s, or a dataset's ``targets`` tensor: :func:`fitkit.data.loaders.known_targets`)
    and, when :func:`none_ignored` finds every entry of them counts, the
    cross-entropy / NLL mean runs as ``F.cross_entropy`` does (one kernel for the mean and its
    count, no guard for a batch where nothing counts, which cannot occur; class weights must all
    be above 0 for that, one host read of them) while ``y`` is not
    written in place. ``y`` ``None`` (a source whose targets are not known up front, or a single
    batch: ``train_on_batch`` / ``test_on_batch``, also when a callback calls them mid-``fit``):
    the guarded mean. Phases nest: each sets its own and the outer one's comes back on exit.

    Example:
        >>> from fitkit.losses import resolve_loss
        >>> ce = resolve_loss("cross_entropy")
        >>> y = torch.tensor([0, 2, 1])
        >>> with targets_count(ce, y):
        ...     objective(ce, torch.zeros(3, 3), y, None)
        tensor(1.0986)
    """
    global _every_target_counts
    outer = _every_target_counts
    cw = getattr(loss, "class_weights", None)  # all > 0: every batch's weight is > 0 too (one host read)
    known = counts_tokens(loss, y) and (cw is None or bool((cw > 0).all())) and none_ignored(loss, y)
    _every_target_counts = (loss, y, y._version) if known else None
    try:
        yield
    finally:
        _every_target_counts = outer


def _rows(y: Any, x: Any = None) -> int:
    ts = nest.leaves(y if y is not None else x)
    return int(ts[0].shape[0]) if ts and ts[0].dim() > 0 else 1


def _spread(w: torch.Tensor, like: torch.Tensor, what: str) -> torch.Tensor:
    """Sample weights ``(B,)`` spread over the positions of ``like``, or per-position as given."""
    if w.shape == like.shape:
        return w
    if w.dim() == 1 and like.dim() >= 1 and w.shape[0] == like.shape[0]:
        return w.reshape(w.shape + (1,) * (like.dim() - 1))
    raise ValueError(
        f"Expected `sample_weight` of shape ({like.shape[0]},) (one per sample) or {tuple(like.shape)} "
        f"(one per {what}). Received shape {tuple(w.shape)}. Fix: pass one weight per sample or per {what}."
    )


def _token_weights(loss: Loss, y: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor | None:
    """Each target position's weight (0 where ignored), or ``None`` when all weigh 1."""
    out: torch.Tensor | None = None
    ignore = loss.ignore_index
    if ignore is not None:
        out = y != ignore
    cw = loss.class_weights
    if cw is not None:
        safe = y if out is None else y.masked_fill(~out, 0)
        picked = cw.to(y.device)[safe]
        out = picked if out is None else picked * out
    if w is not None:
        spread = _spread(w, y, "target position")
        out = spread if out is None else out * spread
    return out


def denominator(loss: Any, y: Any, sample_weight: torch.Tensor | None, x: Any = None) -> int | torch.Tensor:
    """The denominator of a batch's mean loss: rows, the sum of weights, or the tokens that count.

    A host ``int`` when it needs no device value (rows, or tokens with nothing ignored or
    weighted), else a 0-dim device tensor (no sync).

    Args:
        loss: the compiled loss (a :class:`~fitkit.losses.Loss`, a ``MultiLoss`` or ``None``).
        y: the batch's targets (``None``: rows of ``x``).
        sample_weight: ``(B,)`` or per-position weights, or ``None``.
        x: the batch's inputs (for the rows of a batch without targets).

    Example:
        >>> from fitkit.losses import resolve_loss
        >>> ce = resolve_loss("cross_entropy")
        >>> y = torch.tensor([[0, 1, 2, 1], [2, -100, -100, -100]])
        >>> denominator(ce, y, None), denominator(ce, y, torch.tensor([1.0, 3.0]))
        (tensor(5), tensor(7.))
        >>> denominator(resolve_loss("mse"), torch.zeros(3, 2), None)
        3
    """
    if sample_weight is None and isinstance(y, torch.Tensor) and y.is_floating_point():
        return int(y.shape[0]) if y.dim() else 1  # the common case, without the calls below (hot path)
    if counts_tokens(loss, y):
        last = _last_count
        key = None if loss.class_weights is not None else -100 if loss.ignore_index is None else loss.ignore_index
        if last is not None and last[0] is y and last[1] == y._version and sample_weight is None and last[3] == key:
            return last[2]  # counted by the objective of this batch a moment ago
        tw = _token_weights(loss, y, sample_weight)
        return y.numel() if tw is None else tw.sum()
    if sample_weight is not None:
        return sample_weight.sum()
    return _rows(y, x)


def _safe_div(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total / count``, and 0 where nothing counts (a 0 loss, not 0/0)."""
    count = count.to(total.dtype)
    return total / torch.where(count == 0, torch.ones_like(count), count)


def objective(loss: Any, y_pred: Any, y: Any, sample_weight: torch.Tensor | None) -> torch.Tensor:
    """The batch's mean loss ``sum(w_i * l_i) / sum(w_i)`` over its terms (see the module).

    Raises:
        ValueError: sample weights of a shape that is neither ``(B,)`` nor the targets'.

    Example:
        >>> from fitkit.losses import resolve_loss
        >>> ce = resolve_loss("cross_entropy")
        >>> logits = torch.zeros(2, 4, 3)
        >>> y = torch.tensor([[0, 1, 2, 1], [2, -100, -100, -100]])
        >>> objective(ce, logits, y, None)  # the mean over the 5 real tokens: log(3)
        tensor(1.0986)
        >>> objective(ce, logits, torch.full((2, 4), -100), None)  # nothing counts: 0, not 0/0
        tensor(0.)
    """
    if (
        sample_weight is None
        and type(y) is torch.Tensor
        and y.dtype is torch.long
        and y.dim() == 1
        and type(y_pred) is torch.Tensor
        and y_pred.dim() == 2
        and y_pred.dtype is torch.float32
        and y_pred.shape[0] == y.shape[0]
        and type(loss) is Loss
        and loss.fn in _NLL
        and loss.reduction == "mean"
        and y_pred.shape[1] == loss.classes
    ):
        # (B, C) logits and (B,) class indices: the classification step, without prepare's checks
        # (the first batch ran them, and C is the width they saw: another width goes through
        # prepare, which refuses it; torch's kernel checks the class range)
        return _counted_nll(loss, y_pred, y, y, class_last=False)
    if isinstance(loss, Loss) and loss.reduction == "sum":
        return _sum_objective(loss, y_pred, y, sample_weight)
    if sample_weight is None and isinstance(y, torch.Tensor) and y.is_floating_point():
        return loss(y_pred, y)  # float targets count rows: the common case in one call (hot path)
    if counts_tokens(loss, y):
        return _token_objective(loss, y_pred, y, sample_weight)
    if sample_weight is None:
        return loss(y_pred, y)
    if isinstance(loss, Loss) and sample_weight.dim() > 1 and loss.kind != "custom":
        return _elementwise_objective(loss, y_pred, y, sample_weight)
    if isinstance(loss, Loss) and loss.kind == "custom" and sample_weight.dim() > 1:
        out = loss.fn(*loss.prepare(y_pred, y))
        if isinstance(out, torch.Tensor) and out.dim() > 1:
            w = _spread(sample_weight.to(out.dtype), out, "loss value")
            return _safe_div((out * w).sum(), w.sum()) * loss.weight
    per_sample = loss(y_pred, y, per_sample=True)
    w = sample_weight.to(per_sample.dtype)
    if w.shape != per_sample.shape:
        raise ValueError(
            f"Expected `sample_weight` of shape {tuple(per_sample.shape)} (one per sample). "
            f"Received shape {tuple(w.shape)}. Fix: pass one weight per sample."
        )
    return _safe_div((per_sample * w).sum(), w.sum())


def _sum_objective(loss: Loss, y_pred: Any, y: Any, w: torch.Tensor | None) -> torch.Tensor:
    """A ``reduction="sum"`` loss: ``sum(w * l)`` over every term of the batch (no denominator;
    ignored targets add 0), as the module computes it when ``w`` is ``None``."""
    y_pred, y = loss.prepare(y_pred, y)
    if loss.kind == "class_index" and loss.class_last:
        v = y_pred.shape[-1]
        probs = y.shape == y_pred.shape
        flat_y = y.reshape(-1, v) if probs else y.reshape(-1)
        out = loss.fn(y_pred.reshape(-1, v), flat_y, reduction="none", **loss.options)
        out = out.reshape(y.shape[:-1] if probs else y.shape)
    else:
        out = loss.fn(y_pred, y, reduction="none", **loss.options)
    if w is not None:
        out = out * _spread(w.to(out.dtype), out, "loss value")
    total = out.sum()
    return total if loss.weight == 1.0 else total * loss.weight


#: The losses whose per-target terms and count come from one ``nll_loss_forward`` call.
_NLL = {F.cross_entropy: True, F.nll_loss: False}  # fn -> it takes logits (log_softmax first)

#: ``(y, y._version, count, ignore_index)`` of the last batch whose targets the objective counted
#: (``ignore_index`` ``None``: the count is of class weights, so not the targets' number):
#: the running totals ask :func:`denominator` for the same batch right after, and the accuracy
#: :func:`counted` (one count per step, not three). The version counter tells a tensor refilled in
#: place from the one that was counted.
_last_count: tuple[Any, int, torch.Tensor | int, int | None] | None = None


def counted(y: Any, ignore_index: int | None) -> torch.Tensor | int | None:
    """The count of ``y``'s entries that are not ``ignore_index``, if the objective has just made it.

    The cross-entropy kernel counts the targets that count for the loss's mean; a metric over
    the same targets (the built-in accuracy) adds that count instead of counting again. ``None``
    when the last batch counted was another tensor, was changed in place since, or skipped
    another value.

    Example:
        >>> from fitkit.losses import resolve_loss
        >>> y = torch.tensor([0, 2, -100])
        >>> _ = objective(resolve_loss("cross_entropy"), torch.zeros(3, 3), y, None)
        >>> counted(y, -100), counted(y, 0), counted(y.clone(), -100)
        (tensor(2.), None, None)
    """
    last = _last_count
    if (
        last is not None
        and last[0] is y
        and last[1] == y._version
        and ignore_index is not None
        and last[3] == ignore_index
    ):
        return last[2]
    return None


def _counted_nll(loss: Loss, y_pred: torch.Tensor, y: torch.Tensor, given: Any, class_last: bool) -> torch.Tensor:
    """:func:`_nll_objective`'s mean; its count kept for ``given`` (the caller's targets)."""
    global _last_count
    ignore = -100 if loss.ignore_index is None else loss.ignore_index  # torch's default: the kernel's
    mean, count = _nll_objective(loss, y_pred, y, class_last, ignore)
    # a count of class weights is the denominator's, not the number of targets a metric needs
    _last_count = (given, given._version, count, ignore if loss.class_weights is None else None)
    return mean


def _nll_objective(
    loss: Loss, y_pred: torch.Tensor, y: torch.Tensor, class_last: bool, ignore: int
) -> tuple[torch.Tensor, torch.Tensor | int]:
    """Cross-entropy / NLL on class indices without weights: the sum over the targets and their
    count from the one kernel (``nll_loss_forward`` returns both), the sum divided by the count
    (at least 1: nothing counted is 0, not 0/0): the ops of a hand ``F.cross_entropy`` plus a
    clamp and a division. Where the phase's targets are known to hold no ignored entry
    (:func:`targets_count`), the kernel's own mean: a hand ``F.cross_entropy``'s ops, and the count
    is the number of targets, a host ``int``. Returns the mean and the count."""
    if class_last:
        logits, target = y_pred.reshape(-1, y_pred.shape[-1]), y.reshape(-1)
    else:
        logits, target = y_pred, y
    known = _every_target_counts  # no target is ignored (while the scanned targets are unchanged)
    plain = known is not None and known[0] is loss and known[1]._version == known[2]
    cw = loss.class_weights
    try:
        if loss.options.get("label_smoothing"):
            mean, count = _smoothed(loss, logits, target, plain, ignore)
        else:
            logp = F.log_softmax(logits, 1) if _NLL[loss.fn] else logits
            # 1: the mean, as F.cross_entropy (0 / 0 only where nothing counts); 2: the sum.
            # With class weights the count is the targets' weights, as torch's mean divides by.
            total, count = torch.ops.aten.nll_loss_forward(logp, target, cw, 1 if plain else 2, ignore)
            if plain:  # every target counts (and weighs > 0): the kernel's mean
                mean, count = total, (target.numel() if cw is None else count)
            else:
                mean = total / count.clamp_min(1) if cw is None else _safe_div(total, count)
    except IndexError as e:  # torch's CPU kernels: a class label out of range
        n = logits.shape[1]
        raise ValueError(
            f"Loss '{loss.name}' got a class label outside [0, {n - 1}] for logits {tuple(y_pred.shape)} ({e}). "
            "Fix: remap the labels, or give the module one output per class."
        ) from None
    return (mean if loss.weight == 1.0 else mean * loss.weight), count


def _smoothed(
    loss: Loss, logits: torch.Tensor, target: torch.Tensor, plain: bool, ignore: int
) -> tuple[torch.Tensor, torch.Tensor | int]:
    """Cross-entropy with label smoothing ``eps``: where every target counts and no class weighs,
    ``F.cross_entropy`` itself (a hand loop's ops; the count a host ``int``). Else torch's own
    formula, ``(1 - eps) * nll / n + smooth / n * eps / C`` with ``n`` the count (or the weight)
    of the targets that count, from the NLL kernel, at least 1 (or 1 where 0): the same values
    as ``F.cross_entropy``'s mean, and 0 where nothing counts (not 0 / 0)."""
    options, cw = loss.options, loss.class_weights
    if plain and cw is None:
        return F.cross_entropy(logits, target, reduction="mean", **options), target.numel()
    eps = options["label_smoothing"]
    logp = F.log_softmax(logits, 1)
    nll, count = torch.ops.aten.nll_loss_forward(logp, target, cw, 2, ignore)  # the sum, the count
    smooth = -(logp if cw is None else logp * cw).sum(1).masked_fill(target == ignore, 0.0).sum()
    n = count.clamp_min(1) if cw is None else torch.where(count == 0, torch.ones_like(count), count)
    return (1 - eps) * (nll / n) + smooth / n * (eps / logits.shape[1]), count


def _token_objective(loss: Loss, y_pred: Any, y: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    given = y
    y_pred, y = loss.prepare(y_pred, y)
    if (
        w is None
        and loss.fn in _NLL
        and isinstance(y_pred, torch.Tensor)
        and (y_pred.dim() == 2 and y.dim() == 1 or loss.class_last)
    ):
        return _counted_nll(loss, y_pred, y, given, loss.class_last)  # keyed by the caller's y (prepare may copy)
    tw = _token_weights(loss, y, w)
    reduction = "sum" if w is None else "none"
    try:
        if loss.class_last:
            out = loss.fn(y_pred.reshape(-1, y_pred.shape[-1]), y.reshape(-1), reduction=reduction, **loss.options)
            out = out if w is None else out.reshape(y.shape)
        else:
            out = loss.fn(y_pred, y, reduction=reduction, **loss.options)
    except IndexError as e:  # torch's CPU kernels: a class label out of range
        n = y_pred.shape[-1] if loss.class_last else y_pred.shape[1]
        raise ValueError(
            f"Loss '{loss.name}' got a class label outside [0, {n - 1}] for logits {tuple(y_pred.shape)} ({e}). "
            "Fix: remap the labels, or give the module one output per class."
        ) from None
    if w is not None:
        out = (out * _spread(w.to(out.dtype), y, "target position")).sum()
    count: Any = y.numel() if tw is None else tw.sum()
    mean = out / count if isinstance(count, int) else _safe_div(out, count)
    return mean if loss.weight == 1.0 else mean * loss.weight


def _elementwise_objective(loss: Loss, y_pred: Any, y: Any, w: torch.Tensor) -> torch.Tensor:
    """Per-value weights (a ``(B, T)`` multi-task mask) on a regression / binary loss."""
    y_pred, y = loss.prepare(y_pred, y)
    out = loss.fn(y_pred, y, reduction="none", **loss.options)
    spread = _spread(w.to(out.dtype), out, "target value")
    mean = _safe_div((out * spread).sum(), spread.sum())
    return mean if loss.weight == 1.0 else mean * loss.weight
