"""``compile(micro_batch_size=...)``: each training batch split into micro-batches, accumulated.

Composer's ``device_train_microbatch_size``: the batch a fit draws (``batch_size`` rows) is the
unit of everything the loop counts (batches, optimizer steps, callbacks, checkpoints), but it
runs forward and backward in chunks of at most ``micro_batch_size`` rows, so a batch larger than
the device memory holds still trains. Each chunk's loss (its own weighted mean) is scaled by the
chunk's share of the batch's denominator, the one gradient accumulation uses (rows, the sum of
sample weights, or the target tokens that count: :mod:`fitkit.losses.denominators`), so the
step's gradient is the unsplit batch's, up to float rounding; the epoch's loss and metrics count
each chunk by its size, as they count batches. Only the optimizer step at the batch's end (or at
its accumulation window's end) runs; under torchrun the chunks before it skip the all-reduce.
What splitting changes: a module whose forward mixes rows (BatchNorm's batch statistics) sees
the chunks, as under Composer; a ``reduction="sum"`` loss logs the mean of its chunks' sums (as
it logs its micro-batches' under ``gradient_accumulation_steps``), its step being the batch's.
Only ``fit`` splits; ``train_on_batch`` runs its batch whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fitkit import nest

if TYPE_CHECKING:
    from fitkit.model import Model

__all__ = ["split_rows", "train_in_micro_batches", "check_micro_batches"]

Batch = tuple[Any, Any, Any]


def _rows_of(part: object, lo: int, hi: int, n: int) -> Any:
    """Rows ``lo:hi`` of every tensor of ``part`` with ``n`` rows (others, such as a scalar, as they are)."""
    if part is None:
        return None
    return nest.map_structure(lambda t: t[lo:hi] if t.dim() and t.shape[0] == n else t, part)


def split_rows(batch: Batch, size: int) -> list[Batch]:
    """``(x, y, sample_weight)`` cut into chunks of at most ``size`` rows, in order.

    Example:
        >>> chunks = split_rows((torch.arange(5), torch.zeros(5), None), 2)
        >>> [c[0].tolist() for c in chunks], chunks[-1][2]
        ([[0, 1], [2, 3], [4]], None)
    """
    x, y, w = batch
    n = nest.rows(x)
    if n <= size:
        return [batch]
    return [
        (_rows_of(x, lo, lo + size, n), _rows_of(y, lo, lo + size, n), _rows_of(w, lo, lo + size, n))
        for lo in range(0, n, size)
    ]


def _nonzero(total: torch.Tensor | float) -> Any:
    if isinstance(total, torch.Tensor):
        return torch.where(total == 0, torch.ones_like(total), total)
    return total or 1


def train_in_micro_batches(model: Model, batch: Batch, size: int) -> None:
    """``model.train_step`` on each chunk of ``batch``, weighted by its share of the batch.

    The running window's place (its share of an accumulation window, whether it closes it) is
    the batch's; each chunk gets ``share * weight(chunk) / weight(batch)`` and only the last one
    may close the window (a ``reduction="sum"`` loss: the share as it is, the sum needs no
    scaling). The window's place is put back after the last chunk, for the loop to read.
    """
    chunks = split_rows(batch, size)
    if len(chunks) == 1:
        model.train_step(batch)
        return
    stepper = model._core.stepper
    window = stepper.window
    base, last = window.micro_scale, window.micro_last
    if stepper.shares.sums:
        shares = [base] * len(chunks)
    else:
        weigh, scale = stepper.shares.weigh, 1.0 if base is None else base
        total = _nonzero(weigh(batch))
        shares = [scale * weigh(chunk) / total for chunk in chunks]
    try:
        for i, chunk in enumerate(chunks):
            window.place(shares[i], last and i == len(chunks) - 1)
            model.train_step(chunk)
    finally:
        window.place(base, last)


def check_micro_batches(model: Model) -> None:
    """Before step 1: ``micro_batch_size`` with a module's own loss that takes ``num_items_in_batch``
    is refused (its divisor is the batch's label tokens, which a chunk does not know).

    Raises:
        ValueError: that combination.
    """
    stepper = model._core.stepper
    if stepper is None or stepper.micro_batch_size is None:
        return
    from fitkit.losses.outputs import takes_num_items

    if (
        model.loss is None
        and model.default_compute_loss
        and model.default_train_step
        and takes_num_items(model.module)[0]
    ):
        raise ValueError(
            f"compile(micro_batch_size={stepper.micro_batch_size}) splits batches, but this module computes its own "
            "loss over `num_items_in_batch`, which a micro-batch does not know. Fix: use "
            "gradient_accumulation_steps with a smaller batch_size, or compile a loss (loss='cross_entropy')."
        )
