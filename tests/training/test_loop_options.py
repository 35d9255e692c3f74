"""Keras' evaluate / predict ``steps`` and ``stop_evaluating`` / ``stop_predicting``,
``train_on_batch(class_weight=)``, and the learning rate of every parameter group in the logs."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import Bias
from torch import nn

import fitkit
from fitkit.callbacks import Callback, CSVLogger


def _model(**compile_kwargs):
    model = fitkit.Model(Bias(), device="cpu")
    compile_kwargs.setdefault("optimizer", lambda p: torch.optim.SGD(p, lr=0.0))
    model.compile(loss="mse", metrics=["mae"], **compile_kwargs)
    return model


def _endless():
    """An infinite generator: batch k holds two targets equal to k."""
    for k in itertools.count():
        yield torch.zeros(2, 1), torch.full((2, 1), float(k))


def test_evaluate_steps_on_an_infinite_generator():
    # Batches 0, 1, 2 with b = 0: loss (0 + 1 + 4) / 3, mae (0 + 1 + 2) / 3.
    logs = _model().evaluate(_endless(), steps=3, verbose=0)
    assert logs == {"loss": 5 / 3, "mae": pytest.approx(1.0, abs=0)}


def test_predict_steps_on_an_infinite_generator():
    out = _model().predict(_endless(), steps=4, verbose=0)
    assert out.shape == (8, 1)


class StopAfter(Callback):
    def __init__(self, n: int, flag: str):
        super().__init__()
        self.n, self.flag, self.seen = n, flag, 0

    def on_test_batch_end(self, batch, logs=None):
        self.seen += 1
        if batch + 1 == self.n:
            self.model.stop_evaluating = True

    def on_predict_batch_end(self, batch, logs=None):
        self.seen += 1
        if batch + 1 == self.n:
            self.model.stop_predicting = True


def test_stop_evaluating_ends_an_infinite_evaluate_after_that_batch():
    model = _model()
    stop = StopAfter(2, "evaluate")
    assert model.evaluate(_endless(), callbacks=[stop], verbose=0) == {"loss": 0.5, "mae": 0.5}
    assert stop.seen == 2
    # The flag is per call: the next evaluate runs its own steps.
    assert model.evaluate(_endless(), steps=3, verbose=0)["loss"] == 5 / 3


def test_stop_predicting_ends_an_infinite_predict_after_that_batch():
    model = _model()
    out = model.predict(_endless(), callbacks=[StopAfter(3, "predict")], verbose=0)
    assert out.shape == (6, 1)


def test_train_on_batch_takes_class_weight():
    model = _model(optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    # b = 0, y = [0, 1] with weights [1, 3]: loss (1 * 0 + 3 * 1) / 4 = 0.75;
    # gradient d/db = (1 * 2 * (0 - 0) + 3 * 2 * (0 - 1)) / 4 = -1.5 -> b = 0.75.
    logs = model.train_on_batch(torch.zeros(2, 1), torch.tensor([[0.0], [1.0]]), class_weight={0: 1.0, 1: 3.0})
    assert logs["loss"] == 0.75
    assert model.module.b.item() == 0.75


def test_train_on_batch_class_weight_names_a_missing_class():
    model = _model()
    with pytest.raises(ValueError, match="no entry for class 1"):
        model.train_on_batch(torch.zeros(2, 1), torch.tensor([[0.0], [1.0]]), class_weight={0: 1.0})
    assert model.module.b.item() == 0.0


class TwoGroups(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone, self.head = nn.Linear(2, 2), nn.Linear(2, 1)

    def forward(self, x):
        return self.head(self.backbone(x))


def _fine_tune(scheduler=None):
    net = TwoGroups()
    model = fitkit.Model(net, device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(
            [{"params": net.backbone.parameters(), "lr": 0.01}, {"params": net.head.parameters()}], lr=0.1
        ),
        loss="mse",
        scheduler=scheduler,
    )
    return model


def test_every_parameter_group_learning_rate_is_logged_when_they_differ(tmp_path, capsys):
    model = _fine_tune(scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    csv = tmp_path / "log.csv"
    h = model.fit(torch.zeros(4, 2), torch.zeros(4, 1), epochs=2, verbose=2, callbacks=[CSVLogger(csv)])
    assert h.history["learning_rate"] == [0.01, 0.005]  # the first group
    assert h.history["learning_rate/pg1"] == [0.1, 0.05]
    assert "learning_rate/pg1: 0.1" in capsys.readouterr().out
    assert "learning_rate/pg1" in csv.read_text().splitlines()[0].split(",")


def test_groups_with_one_learning_rate_log_one_key():
    from fitkit.layers import GPT, param_groups_weight_decay

    net = GPT(vocab_size=11, block_size=4, n_layer=1, n_head=1, n_embd=8)
    model = fitkit.Model(net, device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.AdamW(param_groups_weight_decay(net, 0.1), lr=1e-3), loss="cross_entropy"
    )
    x = torch.randint(0, 11, (4, 4))
    h = model.fit(x, x, epochs=1, verbose=0)
    assert [k for k in h.history if k.startswith("learning_rate")] == ["learning_rate"]


# -- fit(shuffle="batch") (Keras) -------------------------------------------------------------
@pytest.mark.parametrize(("n", "batch_size", "weighted"), [(12, 4, False), (11, 4, True), (9, 3, False), (5, 8, False)])
def test_fit_shuffle_batch_trains_the_hand_loops_chunks(n, batch_size, weighted):
    """Each epoch the chunks of batch_size consecutive rows come in a randperm order (a short last one last),
    rows, targets and sample weights together; the weights equal a hand loop's, bit for bit."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)
    w = torch.rand(n, generator=g) + 0.5 if weighted else None
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    hand = nn.Linear(3, 1)
    hand.load_state_dict(net.state_dict())
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
    torch.manual_seed(7)
    model.fit(x, y, sample_weight=w, batch_size=batch_size, epochs=3, shuffle="batch", verbose=0)
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    torch.manual_seed(7)
    full = n // batch_size
    for _ in range(3):
        order = torch.randperm(full).tolist()
        chunks = [range(c * batch_size, (c + 1) * batch_size) for c in order]
        if n % batch_size:
            chunks.append(range(full * batch_size, n))
        for rows in chunks:
            idx = torch.tensor(list(rows))
            loss = (hand(x[idx]) - y[idx]).pow(2).mean(1)
            loss = loss.mean() if w is None else (w[idx] * loss).sum() / w[idx].sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert torch.equal(net.weight, hand.weight) and torch.equal(net.bias, hand.bias)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"shuffle": "batches"},
            TypeError,
            r"Expected `shuffle` to be a bool\. Received: shuffle='batches'\. Fix: "
            r"pass True, False or 'batch'",
        ),
        (
            {"shuffle": "batch", "dataset": True},
            ValueError,
            r"fit\(shuffle='batch'\) shuffles chunks of batch_size rows of in-memory arrays.*Received: x of type "
            r"TensorDataset\. Fix:",
        ),
    ],
)
def test_fit_shuffle_batch_errors_before_step_1(kwargs, error, match):
    from torch.utils.data import TensorDataset

    model = _model(optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    x, y = torch.zeros(4, 1), torch.ones(4, 1)
    data = (TensorDataset(x, y),) if kwargs.pop("dataset", False) else (x, y)
    with pytest.raises(error, match=match):
        model.fit(*data, verbose=0, **kwargs)
    assert model.module.b.item() == 0.0 and model.global_step == 0
