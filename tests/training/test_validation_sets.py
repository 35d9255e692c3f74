"""Several named validation sets: ``fit(validation_data={"name": data, ...})`` and ``evaluate``
of the same dict (fitkit.training.validation_sets). Every set's values are exact means over that
set alone, equal to plain PyTorch and to ``evaluate`` on the set by itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import Callback, EarlyStopping
from fitkit.training.validation_sets import named_sets, prefixed_keys


def _data(n: int, seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return x, scale * x.sum(1, keepdim=True) + torch.randn(n, 1, generator=g)


def _model(lr: float = 0.05) -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(3, 1), device="cpu")
    model.compile(optimizer=torch.optim.SGD(model.module.parameters(), lr=lr), loss="mse", metrics=["mae"])
    return model


def _hand(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        pred = net(x)
    return float(F.mse_loss(pred, y)), float(F.l1_loss(pred, y))


class _EvaluateEachSet(Callback):
    """At each epoch's end, ``evaluate`` every set on its own (the reference values)."""

    def __init__(self, sets: dict):
        super().__init__()
        self.sets, self.seen = sets, []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(
            {name: self.model.evaluate(*data, batch_size=4, verbose=0) for name, data in self.sets.items()}
        )


def test_each_set_is_validated_alone_and_the_first_also_under_plain_keys():
    (xa, ya), (xb, yb) = _data(10, 1), _data(7, 2, scale=3.0)  # 10 and 7 rows: ragged last batches
    x, y = _data(32, 0)
    model = _model()
    ref = _EvaluateEachSet({"clean": (xa, ya), "shifted": (xb, yb)})
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=3,
        verbose=0,
        callbacks=[ref],
        validation_batch_size=4,
        validation_data={"clean": (xa, ya), "shifted": (xb, yb)},
    )
    h = history.history
    assert list(h) == [
        "loss",
        "mae",
        "learning_rate",
        "val_loss",
        "val_mae",
        "val_clean_loss",
        "val_clean_mae",
        "val_shifted_loss",
        "val_shifted_mae",
    ]
    assert history.params["metrics"] == list(h)
    for epoch, alone in enumerate(ref.seen):
        for name in ("clean", "shifted"):
            assert h[f"val_{name}_loss"][epoch] == alone[name]["loss"]
            assert h[f"val_{name}_mae"][epoch] == alone[name]["mae"]
        assert h["val_loss"][epoch] == h["val_clean_loss"][epoch]
        assert h["val_mae"][epoch] == h["val_clean_mae"][epoch]
    # ... and the values are plain PyTorch's over each whole set (the last epoch's weights).
    for name, (xs, ys) in (("clean", (xa, ya)), ("shifted", (xb, yb))):
        loss, mae = _hand(model.module, xs, ys)
        assert h[f"val_{name}_loss"][-1] == pytest.approx(loss, rel=1e-6)
        assert h[f"val_{name}_mae"][-1] == pytest.approx(mae, rel=1e-6)
    assert h["val_shifted_loss"][-1] != h["val_clean_loss"][-1]


def test_sets_of_every_kind_in_one_dict():
    """A tuple, a Dataset and a DataLoader side by side; each gives the same numbers as the tuple."""
    xa, ya = _data(12, 3)
    x, y = _data(16, 0)
    model = _model(lr=0.0)  # the weights stay: every value is a hand value of the start
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        validation_data={
            "tuple": (xa, ya),
            "dataset": TensorDataset(xa, ya),
            "loader": DataLoader(TensorDataset(xa, ya), batch_size=5),
        },
    )
    loss, mae = _hand(model.module, xa, ya)
    for name in ("tuple", "dataset", "loader"):
        assert history.history[f"val_{name}_loss"] == [pytest.approx(loss, rel=1e-6)]
        assert history.history[f"val_{name}_mae"] == [pytest.approx(mae, rel=1e-6)]


def test_a_monitor_may_name_any_set():
    """EarlyStopping on the second set: its loss never improves with lr=0, so patience=1 stops at
    epoch index 1 (Keras: the first epoch sets the best; one epoch without improvement then)."""
    x, y = _data(16, 0)
    model = _model(lr=0.0)
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=6,
        verbose=0,
        validation_data={"a": _data(8, 1), "b": _data(8, 2)},
        callbacks=[EarlyStopping(monitor="val_b_loss", patience=1)],
    )
    assert history.epoch == [0, 1]


def test_in_epoch_validations_carry_every_set():
    x, y = _data(32, 0)
    (xa, ya), (xb, yb) = _data(8, 1), _data(6, 2)
    model = _model()
    history = model.fit(
        x, y, batch_size=8, epochs=1, verbose=0, validation_interval=2, validation_data={"a": (xa, ya), "b": (xb, yb)}
    )
    records = history.validations
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert {"val_loss", "val_a_loss", "val_a_mae", "val_b_loss", "val_b_mae"} <= set(r)
        assert r["val_loss"] == r["val_a_loss"]
    loss_b, _ = _hand(model.module, xb, yb)  # the last validation ran after the last step
    assert records[-1]["val_b_loss"] == pytest.approx(loss_b, rel=1e-6)


def test_the_progress_line_shows_each_set(capsys):
    x, y = _data(16, 0)
    _model().fit(x, y, batch_size=8, epochs=1, verbose=2, validation_data={"a": _data(8, 1), "b": _data(8, 2)})
    out = capsys.readouterr().out
    assert "val_a_loss" in out and "val_b_mae" in out


def test_evaluate_takes_the_same_dict():
    (xa, ya), (xb, yb) = _data(9, 1), _data(5, 2)
    model = _model()
    both = model.evaluate({"a": (xa, ya), "b": (xb, yb)}, batch_size=4, verbose=0)
    alone_a = model.evaluate(xa, ya, batch_size=4, verbose=0)
    alone_b = model.evaluate(xb, yb, batch_size=4, verbose=0)
    assert both == {
        "a_loss": alone_a["loss"],
        "a_mae": alone_a["mae"],
        "b_loss": alone_b["loss"],
        "b_mae": alone_b["mae"],
    }
    assert model.evaluate({"a": (xa, ya), "b": (xb, yb)}, batch_size=4, verbose=0, return_dict=False) == [
        [alone_a["loss"], alone_a["mae"]],
        [alone_b["loss"], alone_b["mae"]],
    ]


def test_quick_run_flags_apply_to_every_set():
    """limit_val_batches caps each set; the sanity check runs each set before step 1."""
    x, y = _data(16, 0)
    (xa, ya), (xb, yb) = _data(12, 1), _data(12, 2)
    model = _model(lr=0.0)
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        validation_batch_size=4,
        limit_val_batches=1,
        validation_data={"a": (xa, ya), "b": (xb, yb)},
    )
    assert history.history["val_a_loss"] == [pytest.approx(_hand(model.module, xa[:4], ya[:4])[0], rel=1e-6)]
    assert history.history["val_b_loss"] == [pytest.approx(_hand(model.module, xb[:4], yb[:4])[0], rel=1e-6)]

    class BrokenAfterFour(torch.utils.data.Dataset):
        """Rows 0-3 are fine; from row 4 on the target has the wrong width (a later batch breaks)."""

        def __len__(self):
            return 12

        def __getitem__(self, i):
            return xb[i], (yb[i] if i < 4 else torch.zeros(5))

    model = _model()
    before = [p.clone() for p in model.module.parameters()]
    with pytest.raises(ValueError, match="shaped like the prediction"):  # the second set's second batch
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=1,
            verbose=0,
            num_sanity_val_steps=-1,
            validation_batch_size=4,
            validation_data={"a": (xa, ya), "b": BrokenAfterFour()},
        )
    assert all(torch.equal(p, q) for p, q in zip(model.module.parameters(), before, strict=True))
    assert model.global_step == 0


def test_a_dict_of_tensors_stays_one_set_of_dict_inputs():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 1)

        def forward(self, a, b):
            return self.linear(a + b)

    torch.manual_seed(0)
    model = fitkit.Model(Two(), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    xa, ya = _data(8, 1)
    history = model.fit(
        {"a": xa, "b": xa}, ya, batch_size=4, epochs=1, verbose=0, validation_data=({"a": xa, "b": xa}, ya)
    )
    assert list(history.history) == ["loss", "learning_rate", "val_loss"]
    assert named_sets({"a": xa, "b": xa}) is None


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({}, "empty dict"),
        ({"a": _data(4, 1), "b": torch.zeros(4, 3)}, "mixes validation sets"),
        ({"": _data(4, 1)}, "Received: ''"),
        ({"has space": _data(4, 1)}, "Received: 'has space'"),
        ({3: _data(4, 1)}, "Received: 3"),
    ],
)
def test_bad_dicts_are_refused_before_step_one(bad, fragment):
    x, y = _data(8, 0)
    model = _model()
    before = [p.clone() for p in model.module.parameters()]
    with pytest.raises(ValueError, match="validation_data") as info:
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, validation_data=bad)
    assert fragment in str(info.value) and "Fix:" in str(info.value)
    assert all(torch.equal(p, q) for p, q in zip(model.module.parameters(), before, strict=True))
    assert model.global_step == 0


def test_a_name_whose_keys_collide_is_refused():
    assert prefixed_keys(["a"], ["loss"]) == ["loss", "a_loss"]
    with pytest.raises(ValueError, match="'top'.*top_loss.*Fix: rename the set in `validation_data`"):
        prefixed_keys(["top"], ["loss", "top_loss"])
