from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fitkit
from fitkit.data.weights import ClassWeights, class_weights


def _bias_classifier() -> fitkit.Model:
    net = nn.Linear(1, 2)
    nn.init.zeros_(net.weight)
    nn.init.zeros_(net.bias)
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss="cross_entropy")
    return model


def test_an_empty_class_weight_weighs_every_class_one():
    x, y = torch.zeros(4, 1), torch.tensor([0, 1, 1, 1])
    a, b = _bias_classifier(), _bias_classifier()
    a.fit(x, y, batch_size=4, class_weight={}, shuffle=False, verbose=0)
    b.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    # One SGD step on the mean cross-entropy: the gradient of the bias is softmax - onehot.
    assert a.module.bias.tolist() == pytest.approx([-0.25, 0.25])
    assert torch.equal(a.module.bias, b.module.bias)
    assert class_weights({}) is None and class_weights(None) is None


@pytest.mark.parametrize("keys", [("0", "1"), (0.0, 1.0), (np.int64(0), np.float32(1.0)), (0, "1")])
def test_class_weight_keys_as_strings_and_integral_floats_are_class_indices(keys):
    cw = ClassWeights({keys[0]: 1.0, keys[1]: 3.0})
    assert cw.keys == [0, 1]
    assert cw(torch.tensor([1, 0, 1])).tolist() == [3.0, 1.0, 3.0]


def test_keras_string_keys_weigh_the_loss_as_int_keys_do():
    x, y = torch.zeros(4, 1), torch.tensor([0, 1, 1, 0])
    a, b = _bias_classifier(), _bias_classifier()
    a.fit(x, y, batch_size=4, class_weight={"0": 1, "1": 3}, shuffle=False, verbose=0)
    b.fit(x, y, batch_size=4, class_weight={0: 1, 1: 3}, shuffle=False, verbose=0)
    # sum(w * (softmax - onehot)) / sum(w) with w = 1, 3, 3, 1: class 1 gets (2*1*0.5 - 2*3*0.5) / 8
    assert b.module.bias.tolist() == pytest.approx([-0.25, 0.25])
    assert torch.equal(a.module.bias, b.module.bias)


@pytest.mark.parametrize("key", [0.5, "a", "1.5", -1, "-1", True, None, float("nan")])
def test_class_weight_keys_that_are_no_class_index_are_refused(key):
    with pytest.raises(ValueError, match=r"keys to be class indices .*Received key"):
        ClassWeights({key: 1.0})


def test_a_class_given_twice_is_refused():
    with pytest.raises(ValueError, match=r"gives class 1 twice .*Fix: one key per class"):
        ClassWeights({1: 1.0, "1": 2.0})


def test_class_weight_must_still_be_a_dict():
    with pytest.raises(TypeError, match="Expected `class_weight` to be a non-empty dict"):
        class_weights([1.0, 2.0])


class BiasTokens(nn.Module):
    """Logits ``b`` (2 classes, 0 at start) at every position: ``(B, T, 2)``."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        return self.b.expand(x.shape[0], x.shape[1], 2)


def _one_step(loss, y, **fit_kw) -> list[float]:
    model = fitkit.Model(BiasTokens(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss=loss)
    model.fit(torch.zeros(*y.shape), y, batch_size=len(y), shuffle=False, verbose=0, **fit_kw)
    return (-model.module.b.detach()).tolist()  # the gradient of the one step


def test_class_weight_with_per_position_targets_weighs_each_token():
    y = torch.tensor([[0, 0, 1], [1, 1, 0]])
    # CrossEntropyLoss(weight=[1, 3]): sum_t w_t (softmax(0) - onehot_t) / sum_t w_t = [0.25, -0.25].
    hand = [(3 * -0.5 + 9 * 0.5) / 12, (3 * 0.5 + 9 * -0.5) / 12]
    assert hand == [0.25, -0.25]
    assert _one_step("cross_entropy", y, class_weight={0: 1, 1: 3}) == pytest.approx(hand)
    assert _one_step(nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0])), y) == pytest.approx(hand)


def test_class_weight_per_token_skips_ignored_positions_and_meets_sample_weights():
    y = torch.tensor([[0, 1, -100], [1, -100, -100]])
    # Tokens: (class 0, w 1 * 2), (class 1, w 3 * 2), (class 1, w 3 * 1); ignored ones weigh 0.
    w = torch.tensor([2.0, 6.0, 3.0])
    onehot1 = torch.tensor([0.0, 1.0, 1.0])
    g1 = float((w * (0.5 - onehot1)).sum() / w.sum())
    got = _one_step("cross_entropy", y, class_weight={0: 1, 1: 3}, sample_weight=torch.tensor([2.0, 1.0]))
    assert got == pytest.approx([-g1, g1])
    # From a DataLoader (weights folded per batch) the same.
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(2, 3), y), batch_size=2)
    model = fitkit.Model(BiasTokens(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss="cross_entropy")
    model.fit(loader, class_weight={0: 1, 1: 3}, verbose=0)
    unweighted = float(((0.5 - onehot1) * torch.tensor([1.0, 3.0, 3.0])).sum() / 7)
    assert (-model.module.b.detach()).tolist() == pytest.approx([-unweighted, unweighted])


def test_per_position_class_weights_with_a_per_sample_loss_are_refused_before_step_1():
    def per_sample(y_pred, y):  # one value per row: it cannot take a weight per token
        return torch.nn.functional.cross_entropy(y_pred.transpose(1, 2), y, reduction="none").mean(1)

    model = fitkit.Model(BiasTokens(), device="cpu")
    model.compile(optimizer="sgd", loss=per_sample)
    y = torch.tensor([[0, 0, 1], [1, 1, 0]])
    with pytest.raises(ValueError, match=r"`sample_weight` of shape \(2,\) .*Received shape \(2, 3\)"):
        model.fit(torch.zeros(2, 3), y, class_weight={0: 1, 1: 3}, verbose=0)
    assert model.module.b.tolist() == [0.0, 0.0]
