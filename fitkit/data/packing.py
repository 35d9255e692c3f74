"""``PackedDataset``: documents packed into fixed-length sequences, with document boundaries.

LLM pretraining recipes (torchtune's ``PackedDataset``, the Transformers
``DataCollatorWithFlattening``, Megatron's packed samples) concatenate tokenized documents and
cut the stream into sequences of one length, so no token is padding. The boundaries go with each
sequence: ``position_ids`` that restart at 0 where a document starts (what flash-attention's
variable-length kernels and Hugging Face models read to keep documents apart), or a block-causal
``attention_mask`` ``(T, T)`` where a token sees only the earlier tokens of its own document.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from fitkit.checks import check_choice, check_int

__all__ = ["PackedDataset"]


def _as_tokens(doc: Any, i: int) -> torch.Tensor:
    t = torch.as_tensor(doc)
    if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(
            f"Expected each document to be a 1-D sequence of integer token ids. Received: documents[{i}] of "
            f"dtype {t.dtype} and shape {tuple(t.shape)}. Fix: pass token id lists or 1-D int64 tensors."
        )
    return t.long()


class PackedDataset(Dataset):
    """Documents packed into sequences of ``seq_len`` tokens, with their boundaries.

    The documents (each followed by ``eos_token_id`` if given) are concatenated in order and
    cut into ``len(tokens) // seq_len`` sequences; the tokens after the last full sequence are
    dropped. A document may run across two sequences; each sequence's ``position_ids`` start at
    0. Item ``i`` is a dict of ``(T,)`` int64 tensors, ``T = seq_len``:

    - ``input_ids``: the tokens;
    - ``labels``: the tokens, with ``-100`` at each document start after position 0 (a model
      that shifts its labels, as Hugging Face causal LMs do, never predicts a document's first
      token from the one before it);
    - ``position_ids`` (``boundaries="position_ids"``): the position inside the document,
      0 where one starts;
    - ``attention_mask`` (``boundaries="attention_mask"``): a ``(T, T)`` bool mask, ``True``
      where row ``i`` may attend to column ``j``: the same document and ``j <= i``.

    Items are a function of their index, so ``fit`` resumes inside an epoch by sample (the
    sampler's order is replayed and the done samples skipped), as for any map-style Dataset.

    Args:
        documents: token id sequences (lists, numpy arrays or 1-D integer tensors).
        seq_len: tokens per sequence (an int >= 1).
        eos_token_id: appended after each document (``None``: nothing).
        boundaries: ``"position_ids"`` (default) or ``"attention_mask"``.

    Raises:
        TypeError: ``seq_len`` / ``eos_token_id`` not an int.
        ValueError: no document, a document that is not 1-D integers, ``seq_len < 1``, fewer
            tokens than one sequence, an unknown ``boundaries``.

    Example:
        >>> ds = PackedDataset([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=4, eos_token_id=0)
        >>> len(ds), ds[1]["input_ids"].tolist(), ds[1]["position_ids"].tolist(), ds[1]["labels"].tolist()
        (3, [4, 5, 0, 6], [0, 1, 2, 0], [4, 5, 0, -100])
    """

    def __init__(
        self,
        documents: Sequence[Any],
        seq_len: int,
        *,
        eos_token_id: int | None = None,
        boundaries: str = "position_ids",
    ):
        check_int("seq_len", seq_len, 1)
        check_int("eos_token_id", eos_token_id, 0, allow_none=True)
        check_choice("boundaries", boundaries, ("position_ids", "attention_mask"))
        docs = [_as_tokens(d, i) for i, d in enumerate(documents)]
        if not docs:
            raise ValueError("Expected at least one document. Received: documents=[]. Fix: pass token id lists.")
        if eos_token_id is not None:
            docs = [torch.cat([d, torch.tensor([eos_token_id])]) for d in docs]
        self.tokens = torch.cat(docs)  # (N,)
        self.document_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])  # (N,)
        if len(self.tokens) < seq_len:
            raise ValueError(
                f"The documents hold {len(self.tokens)} tokens, fewer than one sequence of seq_len={seq_len}. "
                "Fix: pass more documents or a smaller seq_len."
            )
        self.seq_len, self.boundaries = seq_len, boundaries

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"PackedDataset index {index} out of range for {len(self)} sequences.")
        index %= len(self)
        t = self.seq_len
        ids = self.tokens[index * t : (index + 1) * t]
        docs = self.document_ids[index * t : (index + 1) * t]
        starts = torch.ones(t, dtype=torch.bool)
        starts[1:] = docs[1:] != docs[:-1]  # where a document starts (position 0: the sequence does)
        labels = ids.masked_fill(starts & (torch.arange(t) > 0), -100)
        item = {"input_ids": ids.clone(), "labels": labels}
        if self.boundaries == "position_ids":
            steps = torch.arange(t)
            item["position_ids"] = steps - torch.cummax(torch.where(starts, steps, 0), 0).values
        else:
            item["attention_mask"] = (docs[:, None] == docs[None, :]).tril()  # (T, T), block-causal
        return item
