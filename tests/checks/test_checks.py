"""Bad input: a clear TypeError / ValueError / RuntimeError before the first step, nothing changed."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torchmetrics
from conftest import params_of, same_params
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit

X = torch.randn(10, 4)
Y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _model(loss="cross_entropy", metrics=None, compile=True) -> fitkit.Model:
    model = fitkit.Model(_net(), device="cpu")
    if compile:
        model.compile("adam", loss, metrics=metrics)
    return model


def _other_scheduler():
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1)


# (id, exception, match, call(model)); `model` is compiled with adam + cross_entropy.
CASES = [
    (
        "fit-before-compile",
        RuntimeError,
        r"`fit` needs a compiled model\. Call `model\.compile\(",
        lambda m: _model(compile=False).fit(X, Y, verbose=0),
    ),
    (
        "evaluate-before-compile",
        RuntimeError,
        r"`evaluate` needs a compiled model",
        lambda m: _model(compile=False).evaluate(X, Y, verbose=0),
    ),
    (
        "unknown-optimizer",
        ValueError,
        r"Unknown optimizer 'adamm'\. Valid names: adam, adamw, sgd, rmsprop",
        lambda m: m.compile("adamm", "mse"),
    ),
    (
        "unknown-loss",
        ValueError,
        r"Unknown loss 'crossentropy'\. Did you mean 'cross_entropy'\? Valid names: mse, .*cross_entropy, nll",
        lambda m: m.compile("adam", "crossentropy"),
    ),
    (
        "unknown-metric",
        ValueError,
        r"Unknown metric 'f2'\. Valid names: accuracy, precision, recall, f1",
        lambda m: m.compile("adam", "mse", metrics=["f2"]),
    ),
    (
        "optimizer-type",
        TypeError,
        r"Expected `optimizer` to be a name, a torch\.optim\.Optimizer or a factory",
        lambda m: m.compile(3, "mse"),
    ),
    (
        "optimizer-on-other-params",
        ValueError,
        r"holds none of the module's parameters",
        lambda m: m.compile(torch.optim.SGD(nn.Linear(2, 2).parameters()), "mse"),
    ),
    (
        "loss-type",
        TypeError,
        r"Expected `loss` to be a name, an nn\.Module or a callable",
        lambda m: m.compile("adam", 3),
    ),
    (
        "scheduler-on-another-optimizer",
        ValueError,
        r"scheduler was built on another optimizer",
        lambda m: m.compile("adam", "mse", scheduler=_other_scheduler()),
    ),
    (
        "scheduler-interval",
        ValueError,
        r"Expected `scheduler_interval` to be 'epoch' or 'step'\. Received: 'batch'",
        lambda m: m.compile("adam", "mse", scheduler_interval="batch"),
    ),
    (
        "module-type",
        TypeError,
        r"Expected `module` to be a torch\.nn\.Module\. Received: str",
        lambda m: fitkit.Model("net", device="cpu"),
    ),
    (
        "device-name",
        ValueError,
        r"Expected `device` to be 'auto' or a torch device name",
        lambda m: fitkit.Model(_net(), device="gpu"),
    ),
    ("xy-length", ValueError, r"same number of samples\. Received x: 10, y: 9", lambda m: m.fit(X, Y[:9], verbose=0)),
    (
        "sample-weight-length",
        ValueError,
        r"Received x: 10, y: 10, sample_weight: 9",
        lambda m: m.fit(X, Y, sample_weight=torch.ones(9), verbose=0),
    ),
    (
        "sample-weight-2d",
        ValueError,
        r"Expected `sample_weight` to be a 1-D array",
        lambda m: m.fit(X, Y, sample_weight=torch.ones(10, 1), verbose=0),
    ),
    (
        "class-weight-unknown-class",
        ValueError,
        r"`class_weight` has no entry for class 2",
        lambda m: m.fit(X, Y, class_weight={0: 1.0, 1: 1.0}, verbose=0),
    ),
    (
        "class-weight-type",
        TypeError,
        r"Expected `class_weight` to be a non-empty dict",
        lambda m: m.fit(X, Y, class_weight=[1.0, 2.0, 3.0], verbose=0),
    ),
    (
        "negative-epochs",
        ValueError,
        r"Expected `epochs` >= 0\. Received: epochs=-1",
        lambda m: m.fit(X, Y, epochs=-1, verbose=0),
    ),
    (
        "string-epochs",
        TypeError,
        r"Expected `epochs` to be an int\. Received: epochs='2'",
        lambda m: m.fit(X, Y, epochs="2", verbose=0),
    ),  # a float is a fraction of an epoch (the Trainer's)
    (
        "nan-epochs",
        ValueError,
        r"Expected `epochs` to be an int >= 0 or a float > 0.*Received: epochs=nan",
        lambda m: m.fit(X, Y, epochs=float("nan"), verbose=0),
    ),
    (
        "negative-initial-epoch",
        ValueError,
        r"Expected `initial_epoch` >= 0",
        lambda m: m.fit(X, Y, initial_epoch=-1, verbose=0),
    ),
    (
        "validation-split-too-big",
        ValueError,
        r"Expected `validation_split` in \[0, 1\)\. Received:"
        r" validation_split=1\.5",
        lambda m: m.fit(X, Y, validation_split=1.5, verbose=0),
    ),
    (
        "validation-split-negative",
        ValueError,
        r"Expected `validation_split` in \[0, 1\)",
        lambda m: m.fit(X, Y, validation_split=-0.1, verbose=0),
    ),
    (
        "validation-split-no-training-data",
        ValueError,
        r"leaves 0 for training and 10 for validation",
        lambda m: m.fit(X, Y, validation_split=0.95, verbose=0),
    ),
    (
        "validation-split-with-dataloader",
        ValueError,
        r"`validation_split` works with tensors, numpy arrays and"
        r" map-style",
        lambda m: m.fit(DataLoader(TensorDataset(X, Y)), validation_split=0.2, verbose=0),
    ),
    (
        "validation-freq",
        ValueError,
        r"Expected `validation_freq` >= 1",
        lambda m: m.fit(X, Y, validation_freq=0, verbose=0),
    ),
    (
        "callbacks-element-type",
        TypeError,
        r"Expected every callback to subclass fitkit\.callbacks\.Callback",
        lambda m: m.fit(X, Y, callbacks=[lambda *a: None], verbose=0),
    ),
    (
        "callbacks-not-a-list",
        TypeError,
        r"Expected `callbacks` to be a list of Callback objects\. Received: History",
        lambda m: m.fit(X, Y, callbacks=fitkit.History(), verbose=0),
    ),
    (
        "batch-size-str",
        TypeError,
        r"Expected `batch_size` to be an int\. Received: batch_size='32'",
        lambda m: m.fit(X, Y, batch_size="32", verbose=0),
    ),
    (
        "batch-size-zero",
        ValueError,
        r"Expected `batch_size` >= 1\. Received: batch_size=0",
        lambda m: m.fit(X, Y, batch_size=0, verbose=0),
    ),
    (
        "shuffle-not-bool",
        TypeError,
        r"Expected `shuffle` to be a bool\. Received: shuffle=1",
        lambda m: m.fit(X, Y, shuffle=1, verbose=0),
    ),
    (
        "verbose-invalid",
        ValueError,
        r"Expected `verbose` to be 0, 1, 2 or 'auto'\. Received: verbose=3",
        lambda m: m.fit(X, Y, verbose=3),
    ),
    (
        "verbose-invalid-evaluate",
        ValueError,
        r"Expected `verbose` to be 0, 1, 2 or 'auto'\. Received: verbose='yes'",
        lambda m: m.evaluate(X, Y, verbose="yes"),
    ),
    ("x-none", ValueError, r"`fit` needs data\. Received x=None", lambda m: m.fit(None, verbose=0)),
    (
        "x-type",
        TypeError,
        r"Expected `x` to be tensors, numpy arrays .* Received: str",
        lambda m: m.fit("data.csv", verbose=0),
    ),
    (
        "y-list-of-numbers",
        TypeError,
        r"Expected `y` to be a tensor or numpy array .* Received: y of type list",
        lambda m: m.fit(X, Y.tolist(), verbose=0),
    ),
    (
        "y-with-dataloader",
        ValueError,
        r"`y` must be None when `x` is a DataLoader",
        lambda m: m.fit(DataLoader(TensorDataset(X, Y)), Y, verbose=0),
    ),
    (
        "y-with-dataset-and-split",
        ValueError,
        r"`y` must be None when `x` is a TensorDataset",
        lambda m: m.fit(TensorDataset(X, Y), Y, validation_split=0.2, verbose=0),
    ),
    (
        "float-targets-cross-entropy",
        ValueError,
        r"Loss 'cross_entropy' expects integer class indices\. Received y of"
        r" dtype torch\.float32",
        lambda m: m.fit(X, Y.float(), verbose=0),
    ),
    (
        "float-targets-in-validation-data",
        ValueError,
        r"expects integer class indices",
        lambda m: m.fit(X, Y, validation_data=(X, Y.float()), verbose=0),
    ),
    (
        "shape-mismatch-mse",
        ValueError,
        r"Loss 'mse' needs `y` shaped like the prediction\. Received y_pred"
        r" \(10, 3\) and y \(10, 2\)",
        lambda m: (m.compile("adam", "mse"), m.fit(X, torch.randn(10, 2), verbose=0)),
    ),
    (
        "logits-vs-labels-shape",
        ValueError,
        r"got logits \(10, 3\) and class indices \(10, 2\)",
        lambda m: m.fit(X, torch.zeros(10, 2, dtype=torch.long), verbose=0),
    ),
    (
        "labels-out-of-range",
        ValueError,
        r"Class labels must lie in \[0, 2\] for a module with 3 outputs\."
        r" Received labels from 0 to 3",
        lambda m: m.fit(X, torch.cat([Y[:-1], torch.tensor([3])]), verbose=0),
    ),
    (
        "negative-labels",
        ValueError,
        r"Class labels must lie in \[0, 2\] .* Received labels from -1 to 1",
        lambda m: m.fit(X, Y - 1, verbose=0),
    ),
    (
        "classification-metric-on-regression",
        ValueError,
        r"Metric 'accuracy' needs class targets",
        lambda m: (m.compile("adam", "mse", metrics=["accuracy"]), m.fit(X, torch.randn(10, 3), verbose=0)),
    ),
    (
        "fit-without-targets",
        ValueError,
        r"The loss needs targets, but the batch has no `y`",
        lambda m: m.fit(X, verbose=0),
    ),
    (
        "evaluate-without-targets",
        ValueError,
        r"The loss needs targets, but the batch has no `y`",
        lambda m: m.evaluate(X, verbose=0),
    ),
    (
        "validation-data-four-arrays",
        ValueError,
        r"Expected `validation_data` to be `\(x_val, y_val\)`.* Received a"
        r" tuple of 4 elements",
        lambda m: m.fit(X, Y, validation_data=(X, Y, torch.ones(10), Y), verbose=0),
    ),
    (
        "validation-data-y-list",
        ValueError,
        r"Expected `validation_data` to be .* Received a tuple of 2 elements",
        lambda m: m.fit(X, Y, validation_data=(X, Y.tolist()), verbose=0),
    ),
    (
        "validation-data-without-targets",
        ValueError,
        r"The loss needs targets",
        lambda m: m.fit(X, Y, validation_data=(X,), verbose=0),
    ),
]


@pytest.mark.parametrize("exc, match, call", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_before_anything_changes(exc, match, call):
    model = _model()
    before = params_of(model.module)
    optimizer = model.optimizer
    with pytest.raises(exc, match=match):
        call(model)
    assert same_params(model.module, before)
    assert model.optimizer is optimizer or model.optimizer.state_dict()["state"] == {}
    assert optimizer.state_dict()["state"] == {}  # Adam never stepped
    assert all(p.grad is None for p in model.module.parameters())
    assert model.module.training  # modes restored
    assert torch.is_grad_enabled()


def test_failed_compile_keeps_the_previous_compile():
    model = _model(metrics=["accuracy"])
    optimizer, loss = model.optimizer, model.loss
    with pytest.raises(ValueError, match="Unknown metric"):
        model.compile("sgd", "mse", metrics=["nope"])
    assert model.optimizer is optimizer and model.loss is loss
    assert set(model.evaluate(X, Y, verbose=0)) == {"loss", "accuracy"}


class RejectingMetric(torchmetrics.Metric):
    def __init__(self):
        super().__init__()
        self.add_state("n", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds, target):
        raise ValueError("RejectingMetric refuses every batch")

    def compute(self):
        return self.n


def _loader(y, batch_size=4):
    return DataLoader(TensorDataset(X, y), batch_size=batch_size)


# Errors that iterables can only show at their first batch: still before any optimizer step.
FIRST_BATCH_CASES = [
    ("float-targets", ValueError, r"expects integer class indices", lambda m: m.fit(_loader(Y.float()), verbose=0)),
    (
        "labels-out-of-range",
        ValueError,
        r"Loss 'cross_entropy' got a class label outside \[0, 2\]",
        lambda m: m.fit(_loader(Y + 1), verbose=0),
    ),
    (
        "shape-mismatch",
        ValueError,
        r"Received y_pred \(4, 3\) and y \(4, 2\)",
        lambda m: (m.compile("adam", "mse"), m.fit(_loader(torch.randn(10, 2)), verbose=0)),
    ),
    (
        "class-weight-unknown-class",
        ValueError,
        r"`class_weight` has no entry for class 1",
        lambda m: m.fit(_loader(Y), class_weight={0: 1.0, 2: 1.0}, verbose=0),
    ),
    (
        "generator-without-targets",
        ValueError,
        r"The loss needs targets",
        lambda m: m.fit((X[i : i + 4] for i in range(0, 10, 4)), verbose=0),
    ),
    (
        "metric-rejects-batch",
        ValueError,
        r"RejectingMetric refuses every batch",
        lambda m: (m.compile("adam", "cross_entropy", metrics=[RejectingMetric()]), m.fit(_loader(Y), verbose=0)),
    ),
    (
        "batch-of-four",
        ValueError,
        r"Expected each batch to be `x`, `\(x,\)`, `\(x, y\)` or `\(x, y, sample_weight\)`",
        lambda m: m.fit([(X, Y, None, None)], verbose=0),
    ),
]


@pytest.mark.parametrize("exc, match, call", [c[1:] for c in FIRST_BATCH_CASES], ids=[c[0] for c in FIRST_BATCH_CASES])
def test_first_batch_errors_leave_weights_and_optimizer_state_unchanged(exc, match, call):
    model = _model()
    before = params_of(model.module)
    with pytest.raises(exc, match=match):
        call(model)
    assert same_params(model.module, before)
    assert model.optimizer.state_dict()["state"] == {}
    assert model.global_step == 0
    assert model.module.training and torch.is_grad_enabled()


def test_labels_out_of_range_in_memory_checks_every_label_not_just_the_first_batch():
    y = Y.clone()
    y[-1] = 7  # in the last batch only
    model = _model()
    with pytest.raises(ValueError, match=r"Received labels from 0 to 7"):
        model.fit(X, y, batch_size=4, verbose=0)
    assert model.global_step == 0


def test_regression_metrics_accept_b1_predictions_with_b_targets():
    # regression: a torchmetrics object got (B, 1) predictions with (B,) targets and raised
    # after the optimizer step
    model = fitkit.Model(nn.Linear(4, 1), device="cpu")
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), "mse", metrics=[torchmetrics.MeanAbsoluteError()])
    result = model.evaluate(X, torch.zeros(10), verbose=0)
    with torch.no_grad():
        expected = model.module(X).abs().mean().item()
    assert result["mean_absolute_error"] == pytest.approx(expected, rel=1e-6)


# -- the habits users bring: unknown keywords, classes instead of instances ------------------------
def _linear_model() -> fitkit.Model:
    return fitkit.Model(nn.Linear(2, 1), device="cpu")


@pytest.mark.parametrize("keyword", ["lr", "learning_rate"])
def test_compile_with_a_learning_rate_names_the_ways_to_set_one(keyword):
    model = _linear_model()
    with pytest.raises(TypeError) as info:
        model.compile("adam", "mse", **{keyword: 1e-3})
    msg = str(info.value)
    assert msg.startswith(
        f"Model.compile() got an unexpected keyword argument '{keyword}'. Fix: set the learning rate on the optimizer"
    )
    assert "torch.optim.AdamW(model.module.parameters(), lr=1e-3)" in msg
    assert "functools.partial(torch.optim.AdamW, lr=1e-3)" in msg
    assert "LearningRateScheduler" in msg and "compile(scheduler=...)" in msg
    valid = [n for n in inspect.signature(fitkit.Model.compile).parameters if n != "self"]
    assert valid[:4] == ["optimizer", "loss", "metrics", "loss_weights"] and "jit_compile" in valid
    assert msg.endswith(f"Valid keywords: {', '.join(valid)}.")
    assert model.optimizer is None  # nothing was compiled


def test_misspelt_keywords_of_fit_evaluate_predict_get_close_matches():
    model = _linear_model()
    model.compile("sgd", "mse")
    x, y = torch.zeros(4, 2), torch.zeros(4, 1)
    before = model.module.weight.clone()
    with pytest.raises(
        TypeError,
        match=r"^Model\.fit\(\) got an unexpected keyword argument 'epoch'\. Fix: did you "
        r"mean 'epochs'\? Valid keywords: x, y, batch_size, epochs,",
    ):
        model.fit(x, y, epoch=2, verbose=0)
    assert torch.equal(model.module.weight, before)
    with pytest.raises(TypeError, match=r"'batchsize'\. Fix: did you mean 'batch_size'\?"):
        model.evaluate(x, y, batchsize=2)
    with pytest.raises(
        TypeError,
        match=r"^Model\.predict\(\) got an unexpected keyword argument 'zzz'\. Fix: use "
        r"one of the valid keywords\. Valid keywords: x, batch_size, verbose, steps",
    ):
        model.predict(x, zzz=1)


def test_the_documented_signatures_are_the_methods_own():
    assert "**" not in str(inspect.signature(fitkit.Model.fit))
    assert list(inspect.signature(fitkit.Model.compile).parameters)[:4] == ["self", "optimizer", "loss", "metrics"]


def test_a_loss_class_asks_for_an_instance():
    with pytest.raises(TypeError) as info:
        _linear_model().compile("sgd", nn.CrossEntropyLoss)
    assert str(info.value) == (
        "Expected `loss` to be an instance, not a class. Received: loss=nn.CrossEntropyLoss "
        "(the class). Fix: pass an instance, loss=nn.CrossEntropyLoss()."
    )


def test_a_metric_class_asks_for_an_instance():
    with pytest.raises(
        TypeError,
        match=r"^Expected `metrics` to be an instance, not a class\. Received: "
        r"metrics=torchmetrics\.classification\.accuracy\.MulticlassAccuracy "
        r"\(the class\)\. Fix: pass an instance",
    ):
        _linear_model().compile("sgd", "mse", metrics=[torchmetrics.classification.MulticlassAccuracy])


def test_an_optimizer_class_is_a_factory():
    model = _linear_model()
    model.compile(torch.optim.SGD, "mse")  # SGD(params): torch's default lr
    assert type(model.optimizer) is torch.optim.SGD and model.optimizer.param_groups[0]["lr"] == 1e-3
    model.fit(torch.ones(2, 2), torch.zeros(2, 1), batch_size=2, verbose=0)
    assert model.global_step == 1
