"""Fit planning (``fitkit.training.planning``): what is checked before step 1, and that the checks change nothing."""

from __future__ import annotations

import pytest
import torch
from conftest import class_data, params_of, same_params, small_classifier
from torch.utils.data import DataLoader, TensorDataset

import fitkit

X, Y = class_data()


def test_a_bad_validation_dataloader_fails_before_step_1(tmp_path):
    model = small_classifier()
    before = params_of(model.module)
    bad = DataLoader(TensorDataset(torch.randn(8, 5), Y[:8]), batch_size=8)
    with pytest.raises(ValueError, match="first validation batch failed in the module's forward.*mat1 and mat2"):
        model.fit(X, Y, epochs=2, batch_size=8, verbose=0, validation_data=bad)
    assert same_params(model.module, before) and model.global_step == 0


def test_the_validation_check_leaves_a_shuffled_fit_unchanged(monkeypatch):
    val = DataLoader(TensorDataset(X[:8], Y[:8]), batch_size=4, shuffle=True)
    checked = small_classifier()
    torch.manual_seed(1)
    checked.fit(X, Y, epochs=2, batch_size=8, verbose=0, validation_data=val)
    monkeypatch.setattr(fitkit.training.planning, "_check_first_validation_batch", lambda model, loader: None)
    unchecked = small_classifier()
    torch.manual_seed(1)
    unchecked.fit(X, Y, epochs=2, batch_size=8, verbose=0, validation_data=val)
    assert torch.equal(checked.module.weight, unchecked.module.weight)  # the peek put the RNG back
