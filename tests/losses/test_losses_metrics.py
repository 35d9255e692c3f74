"""Golden values: exact per-sample means, weighted losses, class weights, metric resets."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_model, fixed_linear
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import fitkit
from fitkit.losses import resolve_loss
from fitkit.metrics import MetricSet

Y5 = torch.tensor([1.0, 1.0, 1.0, 1.0, 4.0])  # zero model: squared errors 1, 1, 1, 1, 16
F32_1_6 = torch.tensor(1.6).item()  # 1.6 as float32 holds it (torchmetrics keeps float32 states)


def zero_model(metrics=("mae",), lr=0.0) -> fitkit.Model:
    model = cpu_model(fixed_linear(1, 1))
    model.compile(functools.partial(torch.optim.SGD, lr=lr), "mse", metrics=list(metrics))
    return model


# -- exact per-sample means -------------------------------------------------------------------


def test_evaluate_is_a_per_sample_mean_not_a_mean_of_batch_means():
    result = zero_model().evaluate(torch.zeros(5, 1), Y5, batch_size=2, verbose=0)
    # batch means would be (1 + 1 + 16) / 3 = 6.0 and (1 + 1 + 4) / 3 = 2.0
    assert result == {"loss": 4.0, "mae": F32_1_6}


@pytest.mark.parametrize("shuffle", [False, True])
def test_training_epoch_loss_is_a_per_sample_mean(shuffle):
    model = zero_model()
    history = model.fit(torch.zeros(5, 1), Y5, batch_size=2, epochs=2, shuffle=shuffle, verbose=0)
    assert history.history["loss"] == [4.0, 4.0]
    assert history.history["mae"] == [F32_1_6, F32_1_6]


@pytest.mark.parametrize(
    "make",
    [
        lambda x, y: {"x": DataLoader(TensorDataset(x, y), batch_size=2)},
        lambda x, y: {"x": TensorDataset(x, y), "batch_size": 2},
        lambda x, y: {"x": [(x[:2], y[:2]), (x[2:4], y[2:4]), (x[4:], y[4:])]},
    ],
    ids=["DataLoader", "Dataset", "list-of-batches"],
)
def test_per_sample_means_for_every_input_kind(make):
    model = zero_model()
    assert model.evaluate(**make(torch.zeros(5, 1), Y5), verbose=0) == {"loss": 4.0, "mae": F32_1_6}
    assert model.fit(**make(torch.zeros(5, 1), Y5), verbose=0).history["loss"] == [4.0]


# -- sample weights ---------------------------------------------------------------------------

W5 = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
WEIGHTED = (1 * 1 + 2 * 1 + 3 * 1 + 4 * 1 + 5 * 16) / 15  # sum(w * l) / sum(w) = 6.0


def test_sample_weight_gives_sum_wl_over_sum_w():
    model = zero_model()
    assert model.evaluate(torch.zeros(5, 1), Y5, sample_weight=W5, batch_size=2, verbose=0)["loss"] == WEIGHTED
    history = model.fit(torch.zeros(5, 1), Y5, sample_weight=W5, batch_size=2, shuffle=False, verbose=0)
    assert history.history["loss"] == [WEIGHTED]
    # metrics are per-sample means, unweighted (Keras' `metrics=`)
    assert history.history["mae"] == [F32_1_6]


def test_sample_weight_for_a_dataset_and_from_batches():
    model = zero_model(metrics=())
    x = torch.zeros(5, 1)
    assert model.evaluate(TensorDataset(x, Y5), sample_weight=W5, batch_size=2, verbose=0)["loss"] == WEIGHTED
    batches = [(x[:2], Y5[:2], W5[:2]), (x[2:], Y5[2:], W5[2:])]
    assert model.evaluate(batches, verbose=0)["loss"] == WEIGHTED


def test_batch_with_all_zero_weights_adds_nothing():
    model = zero_model(metrics=())
    w = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0])
    assert model.evaluate(torch.zeros(5, 1), Y5, sample_weight=w, batch_size=2, verbose=0)["loss"] == 6.0


def test_weighted_training_step_matches_the_weighted_hand_gradient():
    x = torch.tensor([[1.0], [2.0], [3.0]])
    y = torch.tensor([1.0, 0.0, 2.0])
    w = torch.tensor([1.0, 0.0, 3.0])
    model = cpu_model(fixed_linear(1, 1))
    model.compile(functools.partial(torch.optim.SGD, lr=0.1), "mse")
    model.fit(x, y, sample_weight=w, batch_size=3, verbose=0)

    ref = fixed_linear(1, 1)
    loss = ((ref(x).squeeze(1) - y) ** 2 * w).sum() / w.sum()
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    assert torch.allclose(model.module.weight, ref.weight) and torch.allclose(model.module.bias, ref.bias)


# -- class weights ----------------------------------------------------------------------------

CLASS_WEIGHT = {0: 1.0, 1: 3.0, 2: 0.5}


def _classification():
    g = torch.Generator().manual_seed(0)
    return torch.randn(9, 4, generator=g), torch.tensor([0, 1, 2, 0, 1, 2, 0, 0, 1])


def _expected_class_weighted_loss(net, x, y):
    with torch.no_grad():
        per_sample = F.cross_entropy(net(x), y, reduction="none")
    w = torch.tensor([CLASS_WEIGHT[int(c)] for c in y])
    return ((per_sample * w).sum() / w.sum()).item()


class ItemsDataset(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


@pytest.mark.parametrize(
    "make",
    [
        lambda x, y: {"x": x, "y": y},
        lambda x, y: {"x": x.numpy(), "y": y.int().numpy()},
        lambda x, y: {"x": ItemsDataset(x, y)},
        lambda x, y: {"x": DataLoader(TensorDataset(x, y), batch_size=4)},
        lambda x, y: {"x": ((x[i : i + 4], y[i : i + 4]) for i in range(0, 9, 4))},
    ],
    ids=["tensors", "numpy", "Dataset", "DataLoader", "generator"],
)
def test_class_weight_for_every_input_kind(make):
    x, y = _classification()
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    expected = _expected_class_weighted_loss(net, x, y)
    model = cpu_model(net)
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), "cross_entropy")
    history = model.fit(**make(x, y), batch_size=4, shuffle=False, class_weight=CLASS_WEIGHT, verbose=0)
    assert history.history["loss"][0] == pytest.approx(expected, rel=1e-6)


def test_class_weight_times_sample_weight():
    x, y = _classification()
    sw = torch.arange(1.0, 10.0)
    net = nn.Linear(4, 3)
    with torch.no_grad():
        per_sample = F.cross_entropy(net(x), y, reduction="none")
    w = torch.tensor([CLASS_WEIGHT[int(c)] for c in y]) * sw
    expected = ((per_sample * w).sum() / w.sum()).item()
    model = cpu_model(net)
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), "cross_entropy")
    history = model.fit(x, y, sample_weight=sw, class_weight=CLASS_WEIGHT, batch_size=4, verbose=0)
    assert history.history["loss"][0] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda x, y: {"x": x, "y": y},
        lambda x, y: {"x": ItemsDataset(x, y)},
        lambda x, y: {"x": DataLoader(TensorDataset(x, y), batch_size=4)},
    ],
    ids=["tensors", "Dataset", "DataLoader"],
)
def test_class_weight_with_an_unknown_class_raises(make):
    x, y = _classification()
    model = cpu_model(nn.Linear(4, 3))
    model.compile("adam", "cross_entropy")
    before = [p.detach().clone() for p in model.module.parameters()]
    with pytest.raises(ValueError, match=r"`class_weight` has no entry for class 2 .* Received keys: \[0, 1\]"):
        model.fit(**make(x, y), class_weight={0: 1.0, 1: 2.0}, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))
    assert model.optimizer.state_dict()["state"] == {}


# -- metrics ----------------------------------------------------------------------------------


def test_accuracy_is_micro_averaged():
    # 3 of 6 right: 0.5; torchmetrics' multiclass default (macro) would give (1/3 + 1/2 + 1) / 3
    logits = torch.eye(3)[[0, 1, 1, 2, 2, 2]] * 5
    y = torch.tensor([0, 1, 0, 2, 0, 1])
    ms = MetricSet(["accuracy"])
    ms.update(logits[:4], y[:4])
    ms.update(logits[4:], y[4:])
    assert ms.compute()["accuracy"].item() == 0.5
    identity = nn.Linear(3, 3)
    with torch.no_grad():
        identity.weight.copy_(torch.eye(3))
        identity.bias.zero_()
    model = cpu_model(identity)
    model.compile("sgd", "cross_entropy", metrics=["accuracy"])
    assert model.evaluate(logits, y, batch_size=4, verbose=0)["accuracy"] == 0.5


def test_metrics_reset_every_epoch_and_phase():
    # fixed model predicting class 0: train accuracy 2/4, validation accuracy 1/4
    net = fixed_linear(1, 2)
    with torch.no_grad():
        net.bias.copy_(torch.tensor([1.0, 0.0]))
    model = cpu_model(net)
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), "cross_entropy", metrics=["accuracy"])
    x = torch.zeros(4, 1)
    y, y_val = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 1, 1])
    history = model.fit(x, y, validation_data=(x, y_val), epochs=3, batch_size=3, verbose=0)
    assert history.history["accuracy"] == [0.5, 0.5, 0.5]
    assert history.history["val_accuracy"] == [0.25, 0.25, 0.25]
    assert model.evaluate(x, torch.tensor([1, 1, 1, 1]), verbose=0)["accuracy"] == 0.0


def test_metric_objects_and_log_names():
    import torchmetrics

    model = cpu_model(fixed_linear(1, 1))
    model.compile(
        functools.partial(torch.optim.SGD, lr=0.0),
        "mse",
        metrics={"err": "mae", "mse_tm": torchmetrics.MeanSquaredError()},
    )
    result = model.evaluate(torch.zeros(5, 1), Y5, batch_size=2, verbose=0)
    assert result == {"loss": 4.0, "err": F32_1_6, "mse_tm": 4.0}
    model.compile("sgd", "mse", metrics=[torchmetrics.MeanAbsoluteError()])
    assert set(model.evaluate(torch.zeros(5, 1), Y5, verbose=0)) == {"loss", "mean_absolute_error"}


def test_binary_metrics_from_one_logit():
    logits = torch.tensor([[2.0], [-1.0], [0.5], [-3.0]])
    y = torch.tensor([1.0, 0.0, 0.0, 0.0])
    model = cpu_model(fixed_linear(1, 1, weight=1.0))  # the identity on one feature
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), "bce_with_logits", metrics=["accuracy"])
    result = model.evaluate(logits, y, verbose=0)
    assert result["accuracy"] == 0.75
    assert result["loss"] == pytest.approx(F.binary_cross_entropy_with_logits(logits.squeeze(1), y).item(), rel=1e-6)


# -- losses -----------------------------------------------------------------------------------


def test_loss_order_is_pytorch_y_pred_then_y():
    calls = []

    def my_loss(y_pred, y):
        calls.append((y_pred.shape, y.dtype))
        return ((y_pred.squeeze(1) - y) ** 2).mean()

    model = zero_model(metrics=())
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), my_loss)
    assert model.evaluate(torch.zeros(5, 1), Y5, batch_size=5, verbose=0) == {"loss": 4.0}
    assert calls[-1] == (torch.Size([5, 1]), torch.float32)


def test_loss_module_and_per_sample_values():
    loss = resolve_loss(nn.MSELoss())
    assert loss(torch.zeros(5, 1), Y5).item() == 4.0
    assert loss(torch.zeros(5, 1), Y5, per_sample=True).tolist() == [1.0, 1.0, 1.0, 1.0, 16.0]
    ce = resolve_loss("cross_entropy")
    logits = torch.zeros(2, 3, 4)  # language-model layout (B, T, V)
    assert ce(logits, torch.zeros(2, 3, dtype=torch.int32)).item() == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert ce.class_last


def test_b1_predictions_meet_b_targets_without_broadcasting():
    y_pred, y = torch.arange(5.0).unsqueeze(1), torch.arange(5.0)
    with pytest.warns(UserWarning):  # PyTorch alone broadcasts (5, 1) with (5,) to (5, 5): 4.0
        assert F.mse_loss(y_pred, y).item() == 4.0
    assert resolve_loss("mse")(y_pred, y).item() == 0.0


class AutoEncoder(fitkit.Model):
    """A custom objective without targets: reconstruct x."""

    def compute_loss(self, x, y, y_pred, sample_weight):
        return F.mse_loss(y_pred, x)


def test_custom_compute_loss_without_targets_in_fit_and_evaluate():
    # regression: evaluate skipped an overridden compute_loss when batches had no y
    model = AutoEncoder(fixed_linear(2, 2), device="cpu")  # outputs zeros
    model.compile(functools.partial(torch.optim.SGD, lr=0.0))
    x = torch.tensor([[1.0, 1.0], [3.0, 3.0]])
    assert model.evaluate(x, verbose=0) == {"loss": 5.0}
    assert model.evaluate([(x,)], verbose=0) == {"loss": 5.0}
    assert model.fit(x, epochs=1, validation_data=[(x,)], verbose=0).history["val_loss"] == [5.0]


def test_evaluate_batches_without_targets_raises_for_a_compiled_loss():
    # regression: this returned {} silently
    model = zero_model()
    with pytest.raises(ValueError, match="The loss needs targets, but the batch has no `y`"):
        model.evaluate([(torch.zeros(2, 1),)], verbose=0)
