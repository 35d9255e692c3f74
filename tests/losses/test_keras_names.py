"""Keras' loss and metric names: aliases where the meaning is the same, a refusal that says why where not."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fitkit
from fitkit.losses import resolve_loss
from fitkit.metrics import MetricSpec


def test_binary_crossentropy_is_bce_on_probabilities():
    # Keras' binary_crossentropy defaults to from_logits=False: probabilities, as fitkit's "bce".
    loss = resolve_loss("binary_crossentropy")
    assert (loss.name, loss.output) == ("bce", "probs")
    value = loss(torch.tensor([[0.5], [0.8]]), torch.tensor([1.0, 0.0]))
    assert value.item() == pytest.approx(-(math.log(0.5) + math.log(0.2)) / 2, rel=1e-6)


@pytest.mark.parametrize(
    ("keras", "fitkit_name"),
    [("mean_squared_error", "mse"), ("mean_absolute_error", "mae"), ("huber_loss", "huber"), ("mse", "mse")],
)
def test_regression_loss_aliases_compute_fitkits_loss(keras, fitkit_name):
    y_pred, y = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([1.0, 3.0, 0.5])
    expected = {"mse": (1 + 9 + 0.25) / 3, "mae": (1 + 3 + 0.5) / 3, "huber": (0.5 + 2.5 + 0.125) / 3}[fitkit_name]
    assert resolve_loss(keras)(y_pred, y).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("name", ["sparse_categorical_crossentropy", "categorical_crossentropy"])
def test_keras_cross_entropies_on_probabilities_are_refused_with_the_logits_rule(name):
    with pytest.raises(ValueError) as info:
        resolve_loss(name)
    msg = str(info.value)
    assert f"Keras' '{name}'" in msg and "from_logits=False" in msg
    assert "fitkit's 'cross_entropy' takes logits" in msg
    assert "Fix: if the module's last layer gives logits (no softmax), use loss='cross_entropy'" in msg
    assert "loss='nll'" in msg


@pytest.mark.parametrize("name", ["kl_divergence", "kld", "kullback_leibler_divergence"])
def test_kl_divergence_names_the_callable_to_write(name):
    with pytest.raises(ValueError, match=r"sum\(y_true \* log\(y_true / y_pred\)\)") as info:
        resolve_loss(name)
    assert "kl_div(y_pred.log(), y, reduction='batchmean')" in str(info.value)
    # The callable given in the message is Keras' value: sum(p log(p / q)) per sample, mean over the batch.
    p, q = torch.tensor([[0.4, 0.6], [0.9, 0.1]]), torch.tensor([[0.5, 0.5], [0.8, 0.2]])
    given = torch.nn.functional.kl_div(q.log(), p, reduction="batchmean")
    assert given.item() == pytest.approx((p * (p / q).log()).sum(1).mean().item(), rel=1e-6)


def test_unknown_loss_suggests_the_close_name():
    with pytest.raises(ValueError, match=r"Unknown loss 'cross_entropi'\. Did you mean 'cross_entropy'\? Valid names"):
        resolve_loss("cross_entropi")


@pytest.mark.parametrize("name", ["acc", "categorical_accuracy", "sparse_categorical_accuracy"])
def test_keras_accuracy_names_are_accuracy_logged_as_written(name):
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(3, 3), device="cpu")
    with torch.no_grad():
        model.module.weight.copy_(torch.eye(3))
        model.module.bias.zero_()
    x = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0]])
    y = torch.tensor([0, 1, 0, 0])  # the third is wrong: 3 of 4
    model.compile("sgd", "cross_entropy", metrics=[name])
    targets = nn.functional.one_hot(y, 3).float() if name == "categorical_accuracy" else y  # Keras' one-hot
    assert model.evaluate(x, targets, verbose=0)[name] == 0.75


def test_binary_accuracy_and_auc_follow_the_loss():
    model = fitkit.Model(nn.Identity(), device="cpu")
    model.compile("sgd", "binary_crossentropy", metrics=["binary_accuracy", "AUC"])
    probs, y = torch.tensor([[0.9], [0.4], [0.6], [0.2]]), torch.tensor([1.0, 1.0, 0.0, 0.0])
    logs = model.evaluate(probs, y, verbose=0)
    assert logs["binary_accuracy"] == 0.5  # 0.9 -> 1 right, 0.4 -> 0 wrong, 0.6 -> 1 wrong, 0.2 -> 0 right
    assert logs["AUC"] == pytest.approx(0.75)  # pairs (pos, neg): (.9,.6) (.9,.2) (.4,.2) right, (.4,.6) wrong


def test_top_k_metric_names_the_torchmetrics_object():
    with pytest.raises(ValueError, match=r"top_k=5"):
        MetricSpec("top_k_categorical_accuracy")
    with pytest.raises(ValueError, match=r"Unknown metric 'acuracy'\. Did you mean 'accuracy'\?"):
        MetricSpec("acuracy")
