"""``fit(max_tokens=N)``: a budget in tokens (Composer's ``max_duration="Ntok"``), turned into a step
budget before step 1.

Tokens are counted as :class:`~fitkit.callbacks.TokensSeen` counts them by default, with the same
function (:func:`fitkit.callbacks.throughput.token_count`): a batch holds ``B * T`` tokens of its
integer ``(B, T)`` input (a dict's ``input_ids`` first), every micro-batch of an accumulation
window counts, and the count is over all ranks. Padding positions and labels set to ``-100``
count too (the input holds them, as the Trainer's ``num_input_tokens_seen`` counts them by
default), so a ``TokensSeen()`` in the same run logs the tokens the budget counted.

The rule is the one of ``max_samples`` (:func:`fitkit.training.budget.sample_budget`): from
epoch 0, the fit ends with the optimizer step whose accumulation window brings the tokens trained
on to ``N`` or more. A window is never cut, so a budget that falls inside a window ends at that
window's end (up to a window's tokens more). As a step budget it fills a scheduler's
``total_steps`` (``num_training_steps``), ``epochs=None`` runs until it is spent, ``max_steps``
given too caps it (the smaller wins), and a resumed fit stops at the step the uninterrupted one
does. ``max_samples`` and ``max_tokens`` together are refused: one run has one budget in data.

The tokens of each batch must be known before the fit: in-memory tensors (at any world size;
shuffling moves rows, not the ``B * T`` of a batch; under torchrun, data that fitkit shards, as a
rank's ``already_sharded`` share does not tell the others' tokens). A ``Dataset``, ``DataLoader`` or iterable
of batches (whose sequences a collator may pad to each batch's own length) is refused before
step 1, with the fix: ``max_steps=``, or ``max_samples=`` (for sequences of one length ``T``,
``N`` tokens are ``N / T`` samples).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING

from fitkit import nest
from fitkit.callbacks.throughput import token_count
from fitkit.checks import check_int
from fitkit.training.budget import epoch_sizes, window_budget

if TYPE_CHECKING:
    from fitkit.data import DeviceLoader

__all__ = ["check_data_budgets", "epoch_tokens", "token_budget"]


def check_data_budgets(max_samples: object, max_tokens: object) -> None:
    """Check ``fit``'s ``max_samples`` and ``max_tokens``: ints ``>= 1`` or ``None`` (``fit``'s table,
    :mod:`fitkit.training.options`, refuses the two together).

    Raises:
        TypeError: not an int. ValueError: below 1.

    Example:
        >>> check_data_budgets(None, 0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Expected `max_tokens` >= 1. Received: max_tokens=0. Fix: pass the tokens to train on, ...
    """
    check_int(
        "max_samples", max_samples, 1, allow_none=True, fix="pass the samples to train on, e.g. max_samples=10_000."
    )
    check_int(
        "max_tokens", max_tokens, 1, allow_none=True, fix="pass the tokens to train on, e.g. max_tokens=1_000_000."
    )


def epoch_tokens(loader: DeviceLoader) -> list[int] | None:
    """The tokens of each global batch of an epoch of ``loader`` (over all ranks), counted by
    :func:`~fitkit.callbacks.throughput.token_count` on the batch's inputs; ``None`` when they
    are not known before the fit (data not in memory, ``steps_per_epoch`` or batch limits).

    Raises:
        ValueError: in-memory inputs without tokens (no integer ``(N, T)`` tensor).

    Example:
        >>> import torch
        >>> from fitkit.data import as_loader
        >>> epoch_tokens(as_loader({"input_ids": torch.zeros(10, 3, dtype=torch.long)}, batch_size=4))
        [12, 12, 6]
    """
    from fitkit.data import TensorBatches

    sizes, src = epoch_sizes(loader), loader.batches
    if not sizes or not isinstance(src, TensorBatches):
        return None
    counts, start = [], 0
    for size in sizes:
        rows = operator.itemgetter(slice(start, start + size))
        n = token_count(nest.map_structure(rows, src.x))  # views: no copy, no host sync
        if n is None:
            leaves = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in nest.leaves(src.x))
            raise ValueError(
                "Expected token inputs for `max_tokens`: an integer (B, T) tensor (or a dict's 'input_ids'), "
                f"counted as TokensSeen counts them. Received: inputs {leaves}. "
                "Fix: pass the token ids as an integer tensor, or budget in max_samples= or max_steps=."
            )
        counts.append(n)
        start += size
    return counts


def token_budget(loader: DeviceLoader, accumulation: Callable[[int], int], max_tokens: int) -> int:
    """The optimizer steps of ``fit(max_tokens=N)``: from epoch 0, the step whose window brings the
    tokens trained on (over all ranks) to ``N`` or more; a window is never cut.

    Raises:
        ValueError: the tokens of the batches are not known before the fit (see :func:`epoch_tokens`),
            or an epoch holds no token.

    Example:
        >>> import torch
        >>> from fitkit.data import as_loader
        >>> loader = as_loader(torch.zeros(10, 3, dtype=torch.long), batch_size=4)  # 12, 12, 6 tokens
        >>> token_budget(loader, lambda e: 1, 13), token_budget(loader, lambda e: 2, 13)  # 12+12; 24
        (2, 1)
        >>> token_budget(loader, lambda e: 2, 31)  # 30 in epoch 0 (2 steps), 24 more in the first step of epoch 1
        3
    """
    from fitkit.data import TensorBatches
    from fitkit.data.loaders import source_name

    counts = epoch_tokens(loader)
    if counts is None:
        kind = "in-memory tensors" if isinstance(loader.batches, TensorBatches) else source_name(loader)
        raise ValueError(
            f"fit(max_tokens={max_tokens}) needs the tokens of every training batch before the fit: in-memory "
            "tensors (under torchrun not already_sharded: the other ranks' tokens are unknown), without "
            "steps_per_epoch or batch limits (a Dataset, DataLoader or iterable may pad each batch to its own "
            f"length). Received: x of kind {kind}"
            f"{', already_sharded' if loader.sharded == 'user' else ''}"
            f"{'' if loader.steps is None else f', steps_per_epoch={loader.steps}'}. Fix: pass max_steps= "
            "(optimizer steps) instead, or max_samples= (for sequences of one length T, N tokens are N / T "
            "samples), or the token ids as in-memory tensors."
        )
    if sum(counts) == 0:
        raise ValueError(
            f"Expected sequences of length T >= 1 for `max_tokens`. Received: max_tokens={max_tokens} and inputs "
            "of 0 tokens an epoch (length 0). Fix: pass sequences of at least one token."
        )
    return window_budget(counts, accumulation, max_tokens)
