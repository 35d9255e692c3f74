"""OptunaPruning in a real Optuna study (SQLite storage): reports per epoch, a bad trial is pruned."""

import csv
import importlib.util

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import CSVLogger, LambdaCallback, OptunaPruning

optuna = pytest.importorskip("optuna")


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def _net():
    torch.manual_seed(0)  # every trial starts from the same weights
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.0), nn.Linear(8, 1))


def test_a_study_prunes_the_trial_with_a_bad_learning_rate(tmp_path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    x, y = _data()
    seen = {}

    def objective(trial):
        lr = trial.suggest_float("lr", 1e-5, 1.0, log=True)
        net = _net()
        net[1].eval()  # a submodule the user froze: it must stay in eval after a prune
        model = fitkit.Model(net, device="cpu")
        model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=lr), loss="mse")
        log = tmp_path / f"trial{trial.number}.csv"
        seen[trial.number] = (net, log)
        history = model.fit(
            x,
            y,
            epochs=4,
            batch_size=16,
            validation_split=0.25,
            verbose=0,
            callbacks=[CSVLogger(log), OptunaPruning(trial, monitor="val_loss")],
        )
        return history.history["val_loss"][-1]

    # The median pruner compares each epoch's value with the median of the earlier trials at
    # that epoch: two good learning rates first, then one so small that the loss barely moves.
    study = optuna.create_study(
        storage=f"sqlite:///{tmp_path}/study.db",
        study_name="lr",
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
    )
    for lr in (0.05, 0.03, 1e-5):
        study.enqueue_trial({"lr": lr})
    study.optimize(objective, n_trials=3)

    loaded = optuna.load_study(study_name="lr", storage=f"sqlite:///{tmp_path}/study.db")
    states = [t.state for t in loaded.trials]
    assert states == [optuna.trial.TrialState.COMPLETE] * 2 + [optuna.trial.TrialState.PRUNED]
    assert [sorted(t.intermediate_values) for t in loaded.trials[:2]] == [[0, 1, 2, 3]] * 2
    pruned = loaded.trials[2]
    assert sorted(pruned.intermediate_values) == [0]  # pruned after its first epoch
    good = loaded.trials[0]
    assert pruned.intermediate_values[0] > good.intermediate_values[0]
    # The pruned fit ended cleanly: flags as the user left them, grad mode on, and the logger
    # placed before the pruning callback has the pruned epoch's row.
    net, log = seen[2]
    assert [m.training for m in net.modules()] == [True, True, False, True]
    assert torch.is_grad_enabled()
    with open(log, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["0"]
    assert float(rows[0]["val_loss"]) == pytest.approx(pruned.intermediate_values[0], rel=1e-12)


class FakeTrial:
    def __init__(self, prune_at=None):
        self.reports, self.prune_at = [], prune_at

    def report(self, value, step):
        self.reports.append((step, value))

    def should_prune(self):
        return self.reports[-1][0] == self.prune_at


def test_reports_only_epochs_that_validate_and_the_exact_values():
    x, y = _data()
    model = fitkit.Model(_net(), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    trial = FakeTrial()
    history = model.fit(
        x,
        y,
        epochs=4,
        batch_size=16,
        validation_split=0.25,
        validation_freq=2,
        verbose=0,
        callbacks=[OptunaPruning(trial)],
    )
    assert trial.reports == [(1, history.history["val_loss"][0]), (3, history.history["val_loss"][1])]


def test_prune_raises_trial_pruned_from_fit():
    x, y = _data()
    model = fitkit.Model(_net(), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    trial = FakeTrial(prune_at=1)
    with pytest.raises(optuna.TrialPruned, match=r"Trial pruned at epoch 1 \(loss="):
        model.fit(x, y, epochs=5, batch_size=16, verbose=0, callbacks=[OptunaPruning(trial, "loss")])
    assert [s for s, _ in trial.reports] == [0, 1] and model.module.training


def test_bad_arguments(monkeypatch):
    x, y = _data()
    model = fitkit.Model(_net(), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    before = [p.clone() for p in model.module.parameters()]
    with pytest.raises(ValueError, match="OptunaPruning monitors 'val_loss', but fit has no validation data"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[OptunaPruning(FakeTrial())])
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))
    with pytest.raises(TypeError, match="Expected `trial` to be an optuna Trial"):
        OptunaPruning(object())
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "optuna" else real(n, *a))
    expected = (
        r"needs optuna\. Install the `optuna` extra: "
        r"`pip install '\.\[optuna\]'` from a checkout \(`pip install 'torch-fitkit\[optuna\]'`"
    )
    with pytest.raises(ImportError, match=expected):
        OptunaPruning(FakeTrial())


def test_interval_reports_and_prunes_every_n_th_epoch_only():
    x, y = _data()
    model = fitkit.Model(_net(), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    trial, losses = FakeTrial(prune_at=5), []
    record = LambdaCallback(on_epoch_end=lambda epoch, logs: losses.append(logs["loss"]))
    with pytest.raises(optuna.TrialPruned, match="epoch 5"):
        model.fit(
            x, y, epochs=9, batch_size=16, verbose=0, callbacks=[record, OptunaPruning(trial, "loss", interval=3)]
        )
    assert len(losses) == 6 and trial.reports == [(2, losses[2]), (5, losses[5])]  # epochs 3 and 6 (1-based)


@pytest.mark.parametrize(("interval", "error"), [(0, ValueError), (1.5, TypeError), (True, TypeError)])
def test_interval_errors(interval, error):
    with pytest.raises(error, match="interval"):
        OptunaPruning(FakeTrial(), "loss", interval=interval)
