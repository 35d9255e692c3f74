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
