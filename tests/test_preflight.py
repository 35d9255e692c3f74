"""The first-batch check: a dict batch whose keys do not fit ``forward``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import fitkit


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 3)

    def forward(self, input_ids, attention_mask=None):
        return self.emb(input_ids).mean(1)


def _rows(**extra):
    row = {"input_ids": torch.tensor([1, 2, 3]), "attention_mask": torch.tensor([1, 1, 1]), **extra}
    return [dict(row) for _ in range(4)]


def test_dict_batch_with_keys_forward_does_not_take_lists_keys_and_parameters():
    model = fitkit.Model(TokenNet(), device="cpu")
    model.compile("sgd", "cross_entropy")
    before = model.module.emb.weight.clone()
    with pytest.raises(ValueError) as info:
        model.fit(DataLoader(_rows(labels=torch.tensor(1)), batch_size=2), verbose=0)
    msg = str(info.value)
    assert msg.startswith("The first training batch failed in the module's forward: TypeError:")
    assert ("Fix: a dict batch is passed as `forward(**batch)`, so its keys must be forward's parameters. "
            "Batch keys: ['input_ids', 'attention_mask', 'labels']; forward's parameters: "
            "(input_ids, attention_mask=None); not taken by forward: ['labels'].") in msg
    assert "a collate_fn that returns (batch, batch.pop('labels'))" in msg
    assert torch.equal(model.module.emb.weight, before) and model.global_step == 0


def test_dict_batch_missing_a_required_parameter_is_named():
    model = fitkit.Model(TokenNet(), device="cpu")
    model.compile("sgd", "cross_entropy")
    rows = [({"ids": torch.tensor([1, 2])}, torch.tensor(0)) for _ in range(2)]
    with pytest.raises(ValueError) as info:
        model.fit(DataLoader(rows, batch_size=2), verbose=0)
    msg = str(info.value)
    assert "Batch keys: ['ids']; forward's parameters: (input_ids, attention_mask=None); not taken by forward: " \
           "['ids']; required by forward but not in the batch: ['input_ids']." in msg
    assert "pop('labels')" not in msg
