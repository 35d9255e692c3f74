"""Hugging Face ``datasets`` scenarios shared by one process and torchrun (tests/data/test_data_hf_datasets.py).

The data is built in memory (``Dataset.from_dict``) and tokenized by a word-level tokenizer
built here (``tokenizers`` + ``PreTrainedTokenizerFast``): nothing is downloaded.
"""

from __future__ import annotations

import datasets
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn
from torch.utils.data import DataLoader

import fitkit

datasets.disable_progress_bars()
transformers.logging.set_verbosity_error()

WORDS = ["[PAD]", "[UNK]", "[MASK]", "good", "bad", "movie", "plot", "very", "not", "the", "a", "fun", "dull", "is"]
TEXTS = [
    "good movie",
    "bad plot",
    "very good fun movie",
    "the plot is dull",
    "not good",
    "a fun plot",
    "very bad",
    "good",
    "dull movie",
    "the movie is fun",
    "a bad plot",
    "very very good",
    "not fun",
    "good plot",
    "the dull plot",
    "fun",
]
LABELS = [1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1]


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]"
    )


def dataset(max_length: int | None = 5) -> datasets.Dataset:
    """16 rows of ``input_ids``, ``attention_mask``, ``labels`` as torch tensors.

    ``max_length``: pad every row to that length; ``None`` leaves the rows their own lengths.
    """
    tok = tokenizer()
    padding = {"padding": "max_length", "max_length": max_length} if max_length else {}
    ds = datasets.Dataset.from_dict({"text": TEXTS, "labels": LABELS})
    ds = ds.map(lambda rows: tok(rows["text"], **padding), batched=True, remove_columns=["text"])
    return ds.with_format("torch")


class BagOfWords(nn.Module):
    """A Hugging Face-style classifier: ``forward(input_ids, attention_mask, labels=None)`` returns
    ``{"loss", "logits"}``; the logits are a masked mean of token embeddings through a linear head."""

    def __init__(self, vocab: int = len(WORDS), classes: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, classes)

    def forward(self, input_ids, attention_mask, labels=None):
        mask = attention_mask.unsqueeze(-1).float()
        logits = self.head((self.emb(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def model(seed: int = 0, metrics: list | None = None) -> fitkit.Model:
    """``metrics``: default ``["accuracy"]`` (torchrun leaves them out: torchmetrics' import is slow)."""
    torch.manual_seed(seed)
    m = fitkit.Model(BagOfWords(), device="cpu")
    m.compile(lambda p: torch.optim.SGD(p, lr=0.5), loss=None, metrics=["accuracy"] if metrics is None else metrics)
    return m


def params(m: fitkit.Model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.module.state_dict().items()}


def collated_loader(batch_size: int, shuffle: bool = False) -> DataLoader:
    """Rows of their own lengths, padded per batch by ``DataCollatorWithPadding``."""
    return DataLoader(
        dataset(None),
        batch_size=batch_size,
        shuffle=shuffle,
        collate_fn=transformers.DataCollatorWithPadding(tokenizer()),
    )


def distributed_checks(batch_size: int) -> dict:
    """What the torchrun test compares with one process: fit on the dataset itself (unshuffled,
    then shuffled), a collator's DataLoader as validation data, evaluate and predict."""
    m = model(metrics=[])
    history = m.fit(
        dataset(),
        batch_size=batch_size,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=collated_loader(batch_size),
    )
    out = {"params": params(m), "history": history.history}
    out["evaluate"] = m.evaluate(dataset(), batch_size=batch_size, verbose=0)
    out["predict"] = m.predict(collated_loader(batch_size), verbose=0)
    m.fit(dataset(), batch_size=batch_size, epochs=1, shuffle=True, verbose=0)
    out["shuffled_params"] = params(m)
    return out
