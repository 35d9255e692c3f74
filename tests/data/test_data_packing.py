"""PackedDataset: documents packed into fixed-length sequences, each item against a hand-built one."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import fitkit
from fitkit.data import PackedDataset

DOCS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15], [16, 17, 18, 19]]


def _hand(docs, seq_len, eos):
    """The reference with Python lists: (tokens, document of each token) cut into sequences."""
    stream = [(tok, d) for d, doc in enumerate(docs) for tok in [*doc, *([eos] if eos is not None else [])]]
    out = []
    for s in range(len(stream) // seq_len):
        part = stream[s * seq_len : (s + 1) * seq_len]
        ids, owner = [t for t, _ in part], [d for _, d in part]
        pos, labels, mask = [], [], []
        for i in range(seq_len):
            start = i == 0 or owner[i] != owner[i - 1]
            pos.append(0 if start else pos[-1] + 1)
            labels.append(-100 if start and i > 0 else ids[i])
            mask.append([owner[j] == owner[i] and j <= i for j in range(seq_len)])
        out.append((ids, labels, pos, mask))
    return out


@pytest.mark.parametrize("seq_len", [1, 3, 4, 7, 15])
@pytest.mark.parametrize("eos", [None, 0])
@pytest.mark.parametrize("boundaries", ["position_ids", "attention_mask"])
def test_every_item_is_the_hand_packed_sequence(seq_len, eos, boundaries):
    ds = PackedDataset([torch.tensor(d) for d in DOCS], seq_len, eos_token_id=eos, boundaries=boundaries)
    hand = _hand(DOCS, seq_len, eos)
    assert len(ds) == len(hand) == (sum(map(len, DOCS)) + (len(DOCS) if eos is not None else 0)) // seq_len
    for i, (ids, labels, pos, mask) in enumerate(hand):
        item = ds[i]
        assert item["input_ids"].tolist() == ids and item["labels"].tolist() == labels
        if boundaries == "position_ids":
            assert sorted(item) == ["input_ids", "labels", "position_ids"]
            assert item["position_ids"].tolist() == pos
        else:
            assert sorted(item) == ["attention_mask", "input_ids", "labels"]
            assert item["attention_mask"].tolist() == mask
    assert ds[-1]["input_ids"].tolist() == hand[-1][0]
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]


class PackedLM(nn.Module):
    """(B, T) ids and positions -> (B, T, V) logits."""

    def __init__(self, vocab=20, seq_len=4):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(vocab, 8), nn.Embedding(seq_len, 8), nn.Linear(8, vocab)

    def forward(self, input_ids, position_ids):
        return self.head(self.tok(input_ids) + self.pos(position_ids))


def test_fit_trains_on_packed_sequences_and_ignores_the_boundary_labels():
    ds = PackedDataset(DOCS, 4, eos_token_id=0)
    torch.manual_seed(0)
    model = fitkit.Model(PackedLM(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="cross_entropy")
    loss = model.evaluate(DataLoader(ds, batch_size=2), verbose=0)["loss"]
    batch = next(iter(DataLoader(ds, batch_size=len(ds))))
    with torch.no_grad():
        logits = model.module(batch["input_ids"], batch["position_ids"])
    hand = nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], ignore_index=-100)
    assert loss == pytest.approx(hand.item(), rel=1e-6)  # the mean over the labels that count


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (([],), {"seq_len": 2}, ValueError, r"Expected at least one document\. Received: documents=\[\]"),
        (([[1.5, 2.0]],), {"seq_len": 2}, ValueError, r"1-D sequence of integer token ids\. Received: documents\[0\]"),
        ((DOCS,), {"seq_len": 0}, ValueError, r"Expected `seq_len` >= 1\. Received: seq_len=0\."),
        ((DOCS,), {"seq_len": 100}, ValueError, r"hold 15 tokens, fewer than one sequence of seq_len=100\. Fix:"),
        ((DOCS,), {"seq_len": 4, "boundaries": "mask"}, ValueError, r"Expected `boundaries` to be one of"),
        ((DOCS,), {"seq_len": 4, "eos_token_id": "eos"}, TypeError, r"Expected `eos_token_id` to be an int"),
    ],
)
def test_packed_dataset_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        PackedDataset(*args, **kwargs)
