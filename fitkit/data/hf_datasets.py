"""Hugging Face ``datasets.Dataset`` objects as fit / evaluate / predict inputs.

A ``datasets.Dataset`` is indexable and has a length, but is no ``torch.utils.data.Dataset``;
fitkit batches it as a map-style dataset (a ``DataLoader`` with ``batch_size`` and
``shuffle``, sharded per rank under torchrun, resumable mid-epoch), each row a dict such as
``{"input_ids", "attention_mask", "labels"}`` that reaches the module as ``forward(**batch)``.

Rows must be tensors: ``dataset.with_format("torch")`` (or ``set_format("torch")``); a dataset
without that format is refused with that fix. Rows of different lengths are not padded by
fitkit: the pad id, the side and the label padding (-100) are the tokenizer's and the
collator's to decide, so such a batch raises a ``ValueError`` that says to pass
``DataLoader(dataset, batch_size=..., shuffle=True, collate_fn=DataCollatorWithPadding(tokenizer))``
(or ``DataCollatorForLanguageModeling``). Nothing here imports ``datasets``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["is_hf_dataset", "check_hf_dataset", "padding_error"]

_PAD_FIX = (
    "Fix: pad each batch with a collator, e.g. DataLoader(dataset, batch_size=32, shuffle=True, "
    "collate_fn=transformers.DataCollatorWithPadding(tokenizer)) (DataCollatorForLanguageModeling for "
    "language models), and pass that DataLoader; or pad every row to one length when tokenizing "
    "(tokenizer(..., padding='max_length', max_length=...))."
)


def is_hf_dataset(x: Any) -> bool:
    """Whether ``x`` is a (map-style) Hugging Face ``datasets.Dataset``, without importing ``datasets``."""
    module = type(x).__module__ or ""
    return (
        module.startswith("datasets.")
        and hasattr(x, "column_names")
        and hasattr(x, "__len__")
        and hasattr(x, "__getitem__")
        and hasattr(x, "with_format")
    )


def check_hf_dataset(x: Any, name: str = "x") -> None:
    """Require a ``datasets.Dataset`` formatted as torch tensors.

    Raises:
        ValueError: the dataset's rows are Python lists (no ``"torch"`` format).
    """
    fmt = getattr(x, "format", None)
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind != "torch":
        raise ValueError(
            f"`{name}` is a datasets.Dataset whose rows are {'Python objects' if kind is None else repr(kind)} "
            f"(format type {kind!r}), not tensors. Received columns: {list(x.column_names)}. Fix: pass "
            f"`{name}.with_format('torch')` (columns=[...] keeps only the model's inputs and labels), or a "
            "DataLoader whose collate_fn (e.g. DataCollatorWithPadding) returns tensors."
        )


def padding_error(rows: list[Any]) -> ValueError | None:
    """The error for dict rows whose tensors differ in length (token ids), naming the collators.

    ``None`` when the rows are not dicts of tensors of different lengths (the caller's own
    error applies). :class:`fitkit.data.collate.NamingCollate` raises it.

    Example:
        >>> print(padding_error([{"ids": torch.tensor([1, 2])}, {"ids": torch.tensor([3])}]).args[0].split(". ")[0])
        Rows of different lengths cannot be stacked into a batch: 'ids' has lengths [1, 2]
    """
    lengths = _lengths(rows)
    if not lengths:
        return None
    return ValueError(
        f"Rows of different lengths cannot be stacked into a batch: {lengths}. fitkit does not pad "
        f"(the pad id and the label padding are the tokenizer's and collator's to choose). {_PAD_FIX}"
    )


def _lengths(rows: list[Any]) -> str:
    """``'input_ids' has lengths [3, 5]`` for the entries whose shapes differ between rows."""
    if not rows or not all(isinstance(r, Mapping) for r in rows):
        return ""
    parts = []
    for key in rows[0]:
        shapes = [tuple(r[key].shape) for r in rows if isinstance(r.get(key), torch.Tensor)]
        if len(set(shapes)) > 1:
            sizes = sorted({s[0] if len(s) == 1 else s for s in shapes})
            parts.append(f"{key!r} has lengths {sizes[:8]}")
    return "; ".join(parts)
