"""Metrics that follow the loss (ignore_index, logits vs probabilities), callable metrics,
``loss_weights`` for a single loss, and per-phase copies of a MetricSet."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from conftest import cpu_model, fixed_linear, params_of, same_params
from torch import nn

import fitkit
from fitkit.losses import Loss, resolve_loss
from fitkit.metrics import MetricSet, MetricSpec
from fitkit.metrics.states import masked_multiclass

SGD0 = functools.partial(torch.optim.SGD, lr=0.0)


class Tokens(nn.Module):
    """Logits ``(B, T, 3)`` that favour one class everywhere (``(B, 3, T)`` when ``dim1``)."""

    def __init__(self, favour: int = 0, dim1: bool = False):
        super().__init__()
        self.lin = fixed_linear(1, 3)
        with torch.no_grad():
            self.lin.bias[favour] = 1.0
        self.dim1 = dim1

    def forward(self, x):  # x: (B, T, 1)
        out = self.lin(x)  # (B, T, 3)
        return out.transpose(1, 2) if self.dim1 else out


X_TOK = torch.zeros(2, 4, 1)
Y_TOK = torch.tensor([[0, 0, -100, -100], [1, 0, -100, -100]])


# -- what the loss knows -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "loss, output, ignore_index",
    [
        ("cross_entropy", "logits", -100),
        ("nll", "log_probs", -100),
        ("bce_with_logits", "logits", None),
        ("bce", "probs", None),
        ("mse", None, None),
        (nn.CrossEntropyLoss(ignore_index=0), "logits", 0),
        (nn.NLLLoss(ignore_index=-1), "log_probs", -1),
        (nn.BCEWithLogitsLoss(), "logits", None),
        (nn.BCELoss(), "probs", None),
        (nn.MSELoss(), None, None),
        (lambda y_pred, y: y_pred.sum(), None, None),
        (Loss(lambda y_pred, y: y_pred.sum(), output="probs", ignore_index=7), "probs", 7),
    ],
)
def test_each_loss_says_what_its_predictions_are(loss, output, ignore_index):
    resolved = resolve_loss(loss)
    assert (resolved.output, resolved.ignore_index) == (output, ignore_index)


def test_loss_rejects_an_unknown_output():
    with pytest.raises(ValueError, match=r"Expected `output` to be one of logits, probs, log_probs or None"):
        Loss(F.mse_loss, output="logit")


# -- ignore_index ------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 2])
def test_token_accuracy_skips_the_loss_ignore_index(batch_size):
    # 3 of the 4 real tokens are class 0; counting the ignored ones would give 3/8.
    model = cpu_model(Tokens(favour=0))
    model.compile(SGD0, "cross_entropy", metrics=["accuracy"])
    assert model.evaluate(X_TOK, Y_TOK, batch_size=batch_size, verbose=0)["accuracy"] == 0.75
    history = model.fit(X_TOK, Y_TOK, batch_size=batch_size, epochs=2, validation_data=(X_TOK, Y_TOK), verbose=0)
    assert history.history["accuracy"] == [0.75, 0.75]
    assert history.history["val_accuracy"] == [0.75, 0.75]


def test_a_custom_ignore_index_of_the_loss_module():
    # class 0 is padding: real tokens 1, 2, 1, 1 against a model that always says 1
    model = cpu_model(Tokens(favour=1))
    model.compile(SGD0, nn.CrossEntropyLoss(ignore_index=0), metrics=["accuracy"])
    y = torch.tensor([[1, 2, 0, 0], [1, 1, 0, 0]])
    assert model.evaluate(X_TOK, y, batch_size=1, verbose=0)["accuracy"] == 0.75
    assert model.fit(X_TOK, y, batch_size=2, verbose=0).history["accuracy"] == [0.75]


def test_ignore_index_in_the_class_dim1_layout_and_for_macro_metrics():
    # (B, C, T) logits with (B, T) targets. Real tokens 0, 0, 1, 0, all predicted 0:
    # precision is 3/4 for class 0 and 0 for class 1 (class 2 never occurs: left out of the
    # macro average, torchmetrics' rule): 0.375; recall (1 + 0) / 2 = 0.5.
    model = cpu_model(Tokens(favour=0, dim1=True))
    model.compile(SGD0, "cross_entropy", metrics=["accuracy", "precision", "recall"])
    logs = model.evaluate(X_TOK, Y_TOK, batch_size=1, verbose=0)
    assert logs["accuracy"] == 0.75
    assert logs["precision"] == 0.375
    assert logs["recall"] == 0.5


def test_ignore_index_for_the_score_metrics():
    # NLL on log-probabilities: auroc gets exp(log_probs), and the ignored rows count for nothing.
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0], [5.0, -5.0, 0.0], [1.0, 0.0, 0.5]])
    y = torch.tensor([0, 1, 2, -1, 0])
    ms = MetricSet(["auroc", "accuracy"]).configure(nn.NLLLoss(ignore_index=-1), "cpu")
    ms.update(logits.log_softmax(1), y)
    keep = y != -1
    expected = torchmetrics.functional.auroc(logits[keep].softmax(1), y[keep], "multiclass", num_classes=3)
    result = ms.compute()
    assert torch.allclose(result["auroc"], expected)
    assert result["accuracy"].item() == 1.0


@pytest.mark.parametrize(
    "num_classes, ignore_index, average, name",
    list(
        itertools.product(
            [3, 5],
            [-100, 0, 2],
            ["micro", "macro"],
            ["MulticlassAccuracy", "MulticlassPrecision", "MulticlassRecall", "MulticlassF1Score"],
        )
    ),
)
def test_sync_free_ignore_index_matches_torchmetrics_own(num_classes, ignore_index, average, name):
    g = torch.Generator().manual_seed(num_classes + ignore_index)
    ours = masked_multiclass(name, num_classes, ignore_index, average=average)
    theirs = getattr(torchmetrics.classification, name)(num_classes, average=average, ignore_index=ignore_index)
    for _ in range(3):
        preds = torch.randint(0, num_classes, (17,), generator=g)
        target = torch.randint(0, num_classes, (17,), generator=g)
        target[torch.rand(17, generator=g) < 0.3] = ignore_index
        ours.update(preds, target)
        theirs.update(preds, target)
    assert torch.allclose(ours.compute(), theirs.compute())


def test_a_torchmetrics_object_is_used_as_given():
    # without an ignore_index of its own, the object counts the -100 targets as misses: 3/8
    model = cpu_model(Tokens(favour=0))
    acc = torchmetrics.classification.MulticlassAccuracy(3, average="micro", validate_args=False)
    model.compile(SGD0, "cross_entropy", metrics={"tm": acc, "accuracy": "accuracy"})
    logs = model.evaluate(X_TOK, Y_TOK, verbose=0)
    assert (logs["tm"], logs["accuracy"]) == (0.375, 0.75)


# -- logits vs probabilities -------------------------------------------------------------------

X_BIN = torch.tensor([[0.3], [0.4], [-2.0], [0.2]])
Y_BIN = torch.tensor([1.0, 1.0, 0.0, 1.0])


@pytest.mark.parametrize("batch_size", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "loss, sigmoid", [("bce_with_logits", False), (nn.BCEWithLogitsLoss(), False), (nn.BCELoss(), True), ("bce", True)]
)
def test_binary_accuracy_follows_the_loss_never_the_values(batch_size, loss, sigmoid):
    # the output is the logit x (or sigmoid(x)): every sample is on the right side
    net = fixed_linear(1, 1, weight=1.0)
    model = cpu_model(nn.Sequential(net, nn.Sigmoid()) if sigmoid else net)
    model.compile(SGD0, loss, metrics=["accuracy"])
    assert model.evaluate(X_BIN, Y_BIN, batch_size=batch_size, verbose=0)["accuracy"] == 1.0
    assert model.fit(X_BIN, Y_BIN, batch_size=batch_size, shuffle=False, verbose=0).history["accuracy"] == [1.0]


def test_binary_scores_are_probabilities_for_logits_and_for_probs():
    net = fixed_linear(1, 1, weight=1.0)
    logit_model, prob_model = cpu_model(net), cpu_model(nn.Sequential(net, nn.Sigmoid()))
    logit_model.compile(SGD0, "bce_with_logits", metrics=["auroc"])
    prob_model.compile(SGD0, "bce", metrics=["auroc"])
    y = torch.tensor([1.0, 0.0, 0.0, 1.0])  # positives 0.3, 0.2; negatives 0.4, -2: 2 of 4 pairs in order
    expected = 0.5
    assert logit_model.evaluate(X_BIN, y, batch_size=2, verbose=0)["auroc"] == expected
    assert prob_model.evaluate(X_BIN, y, batch_size=2, verbose=0)["auroc"] == expected


def test_cross_entropy_and_nll_agree_on_labels_and_scores():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.1, 0.0], [0.0, 0.0, 2.0], [1.0, 0.0, 0.5]])
    y = torch.tensor([0, 1, 2, 2])
    ce = MetricSet(["accuracy", "auroc"]).configure("cross_entropy")
    nll = MetricSet(["accuracy", "auroc"]).configure("nll")
    ce.update(logits, y)
    nll.update(logits.log_softmax(1), y)
    a, b = ce.compute(), nll.compute()
    assert a["accuracy"].item() == b["accuracy"].item() == 0.75
    assert torch.allclose(a["auroc"], b["auroc"])


def hinge(y_pred, y):
    return (1 - y_pred.squeeze(-1) * (2 * y.float() - 1)).clamp(min=0).mean()


def test_a_loss_that_cannot_tell_needs_an_explicit_statement():
    y = Y_BIN.long()
    model = cpu_model(fixed_linear(1, 1, weight=1.0))
    model.compile(functools.partial(torch.optim.SGD, lr=0.1), hinge, metrics=["accuracy"])
    before = params_of(model.module)
    with pytest.raises(ValueError, match=r"MetricSpec\('accuracy', output='logits'\)"):
        model.fit(X_BIN, y, batch_size=2, verbose=0)
    assert same_params(model.module, before)  # refused at the first batch, before any step
    model.compile(SGD0, hinge, metrics=[MetricSpec("accuracy", output="logits")])
    assert model.evaluate(X_BIN, y, batch_size=2, verbose=0) == {"loss": pytest.approx(0.525), "accuracy": 1.0}
    model.compile(SGD0, Loss(hinge, output="logits"), metrics=["accuracy"])
    assert model.evaluate(X_BIN, y, batch_size=3, verbose=0)["accuracy"] == 1.0
    # a torchmetrics object is accepted and follows its own rule (a sigmoid for values outside
    # [0, 1], per batch): right on the whole set, wrong on the batch [0.3, 0.4]
    model.compile(SGD0, hinge, metrics=[torchmetrics.classification.BinaryAccuracy()])
    assert model.evaluate(X_BIN, y, batch_size=4, verbose=0)["binary_accuracy"] == 1.0
    assert model.evaluate(X_BIN, y, batch_size=2, verbose=0)["binary_accuracy"] == 0.5


def test_without_a_loss_argmax_needs_nothing_but_scores_and_thresholds_do():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    ms = MetricSet(["accuracy"]).configure(None)
    ms.update(logits, torch.tensor([0, 0]))
    assert ms.compute()["accuracy"].item() == 0.5
    with pytest.raises(ValueError, match=r"'auroc' needs probabilities"):
        MetricSet(["auroc"]).configure(None).update(logits, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"'f1' needs a threshold for binary predictions"):
        MetricSet(["f1"]).configure(hinge).update(torch.zeros(2, 1), torch.tensor([0, 1]))
    ms = MetricSet([MetricSpec("auroc", output="probs")]).configure(None)
    ms.update(torch.tensor([0.9, 0.2, 0.6]), torch.tensor([1, 0, 0]))
    assert ms.compute()["auroc"].item() == 1.0


def test_metric_spec_checks_its_arguments():
    with pytest.raises(ValueError, match="Unknown metric 'f2'"):
        MetricSpec("f2")
    with pytest.raises(ValueError, match="`output` applies to the classification metric names"):
        MetricSpec("mae", output="logits")
    with pytest.raises(TypeError, match="A torchmetrics object goes to `metrics=` as it is"):
        MetricSpec(torchmetrics.MeanAbsoluteError())


# -- callables as metrics ----------------------------------------------------------------------


def abs_error(y_pred, y):
    return (y_pred.squeeze(-1) - y).abs()  # (B,): one value per sample


def mean_abs_error(y_pred, y):
    return (y_pred.squeeze(-1) - y).abs().mean()  # 0-dim: the batch mean


def test_callable_metrics_are_exact_per_sample_means():
    # batches of 2 and 1: errors [1, 1] and [4]: per-sample mean 2.0, mean of batch means 2.5
    model = cpu_model(fixed_linear(1, 1))
    model.compile(SGD0, "mse", metrics=[abs_error, mean_abs_error])
    x, y = torch.zeros(3, 1), torch.tensor([1.0, 1.0, 4.0])
    assert model.evaluate(x, y, batch_size=2, verbose=0) == {"loss": 6.0, "abs_error": 2.0, "mean_abs_error": 2.0}
    history = model.fit(x, y, batch_size=2, shuffle=False, verbose=0, validation_data=(x, y))
    assert history.history["abs_error"] == history.history["val_mean_abs_error"] == [2.0]


def test_callable_metric_names_and_directions():
    ms = MetricSet({"err": lambda y_pred, y: (y_pred - y).abs(), "up": MetricSpec(abs_error, higher_is_better=False)})
    assert ms.keys == ["err", "up"]
    assert (ms.higher_is_better("err"), ms.higher_is_better("up")) == (None, False)
    assert MetricSet([abs_error]).keys == ["abs_error"]
    with pytest.raises(ValueError, match=r"A metric callable needs a log name.*pass a dict"):
        MetricSet([lambda y_pred, y: (y_pred - y).abs()])
    with pytest.raises(ValueError, match="A metric callable needs a log name"):
        MetricSet([functools.partial(abs_error)])


def test_callable_metric_results_are_checked():
    ms = MetricSet({"bad": lambda y_pred, y: "1.0"})
    with pytest.raises(TypeError, match="Metric 'bad' must return a tensor or a number. Received str"):
        ms.update(torch.zeros(2, 1), torch.zeros(2))
    ms = MetricSet({"bad": lambda y_pred, y: torch.zeros(3)})
    with pytest.raises(ValueError, match=r"0-dim batch mean or one value per sample, \(B,\) with B=2"):
        ms.update(torch.zeros(2, 1), torch.zeros(2))


def test_callable_metrics_returning_python_numbers_are_averaged_over_samples():
    # Keras averages a plain number per batch, weighted by the batch size.
    calls = iter([1.0, 4, np.float32(2.5)])
    ms = MetricSet({"n": lambda y_pred, y: next(calls)})
    ms.update(torch.zeros(2, 1), torch.zeros(2))
    ms.update(torch.zeros(1, 1), torch.zeros(1))
    ms.update(torch.zeros(1, 1), torch.zeros(1))
    assert float(ms.compute()["n"]) == (1.0 * 2 + 4 + 2.5) / 4


def test_fit_and_evaluate_accept_a_metric_that_returns_a_float():
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")

    def zero(y_true, y_pred):
        return 0.0

    def half(y_pred, y):
        return 0.5

    model.compile(optimizer="sgd", loss="mse", metrics=[zero, half])
    x = torch.zeros(5, 1)
    h = model.fit(x, x, batch_size=2, verbose=0)
    assert h.history["zero"] == [0.0] and h.history["half"] == [0.5]
    ev = model.evaluate(x, x, batch_size=3, verbose=0)
    assert (ev["zero"], ev["half"]) == (0.0, 0.5) and list(ev) == ["loss", "zero", "half"]


def test_callable_metrics_see_the_tensors_as_the_module_gave_them():
    seen = []

    def token_count(y_pred, y):
        seen.append((tuple(y_pred.shape), tuple(y.shape)))
        return (y != -100).sum(1).float()  # (B,) real tokens per sequence

    model = cpu_model(Tokens())
    model.compile(SGD0, "cross_entropy", metrics=[token_count])
    assert model.evaluate(X_TOK, Y_TOK, batch_size=2, verbose=0)["token_count"] == 2.0
    assert seen[-1] == ((2, 4, 3), (2, 4))


# -- loss_weights for a single loss ------------------------------------------------------------


def test_loss_weights_as_a_number_multiplies_a_single_loss():
    model = cpu_model(fixed_linear(1, 1))  # outputs 0
    model.compile(functools.partial(torch.optim.SGD, lr=0.1), "mse", loss_weights=0.5)
    x, y = torch.zeros(4, 1), torch.tensor([1.0, 1.0, 1.0, 4.0])
    assert model.evaluate(x, y, verbose=0) == {"loss": 2.375}  # 0.5 * 19 / 4
    # one step on y = [1, 3]: d(0.5 * mean((b - y)^2))/db at b = 0 is -(1 + 3) / 2 = -2
    model.fit(torch.zeros(2, 1), torch.tensor([1.0, 3.0]), batch_size=2, verbose=0)
    assert model.module.bias.item() == pytest.approx(0.2)


def test_loss_weights_errors():
    with pytest.raises(TypeError, match="Expected `loss_weights` to be a number for a single loss"):
        resolve_loss("mse", loss_weights=[0.5])
    with pytest.raises(TypeError, match="Expected `loss_weights` to be a number"):
        resolve_loss("mse", loss_weights=True)
    with pytest.raises(ValueError, match="`loss_weights` needs a compiled loss"):
        resolve_loss(None, loss_weights=2.0)
    with pytest.raises(ValueError, match=r"Expected `loss_weights` to match the losses \(\[0, 1\]\)"):
        resolve_loss(["mse", "mae"], loss_weights=2.0)
    given = resolve_loss("mae")
    assert resolve_loss(given, loss_weights=3.0).weight == 3.0 and given.weight == 1.0  # a copy


# -- configuration and per-phase copies ----------------------------------------------------------


def test_configure_takes_the_loss_and_the_device():
    ms = MetricSet(["accuracy"]).configure(nn.CrossEntropyLoss(ignore_index=3), "cpu")
    assert (ms.loss_kind, ms.output, ms.ignore_index, ms.device) == ("class_index", "logits", 3, torch.device("cpu"))
    ms.update(torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    ms.configure("nll")  # a new loss: built again at the next batch
    assert ms.entries is None and (ms.output, ms.ignore_index) == ("log_probs", -100)


def test_clone_shares_no_state_with_the_original():
    ms = MetricSet({"acc": "accuracy", "err": abs_error}).configure("cross_entropy", "cpu")
    logits, y = torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
    ms.update(logits, y)  # all right; err: per-sample means 1.5 and 0.5
    twin = ms.clone()
    assert twin.compute() == {}  # a fresh copy starts empty
    twin.update(-logits, y)  # all wrong; err 1.5 and 1.5
    assert {k: v.item() for k, v in ms.compute().items()} == {"acc": 1.0, "err": 1.0}
    assert {k: v.item() for k, v in twin.compute().items()} == {"acc": 0.0, "err": 1.5}
    assert (twin.task, twin.ignore_index, twin.output, twin.device) == ("multiclass", -100, "logits", ms.device)
    ms.reset()  # resetting the original leaves the copy alone
    assert twin.compute()["acc"].item() == 0.0


def test_clone_copies_a_users_torchmetrics_object():
    user_metric = torchmetrics.MeanSquaredError()
    ms = MetricSet({"mse": user_metric})
    unbuilt = ms.clone()  # taken before the first batch: builds on its own
    ms.update(torch.zeros(2), torch.ones(2))
    built = ms.clone()
    unbuilt.update(torch.zeros(1), torch.full((1,), 2.0))
    built.update(torch.zeros(1), torch.full((1,), 3.0))
    assert [m.compute()["mse"].item() for m in (ms, unbuilt, built)] == [1.0, 4.0, 9.0]
    assert user_metric.update_count == 1


# -- no host sync in update ----------------------------------------------------------------------

# Ops whose output size or value the host must read on CUDA (a sync): boolean-mask indexing
# (`index.Tensor` with a mask), `nonzero`, `masked_select`, `.item()`.
_SYNCING = ("aten.index.Tensor", "aten.nonzero", "aten.masked_select", "aten._local_scalar_dense", "aten.unique")


def real_tokens(y_pred, y):
    return (y != -100).sum(1).float()  # (B,)


def _ops_of(fn) -> set[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    recorder = Record()
    with recorder:
        fn()
    return recorder.ops


@pytest.mark.parametrize(
    "loss, metrics, y_pred, y",
    [
        (
            "cross_entropy",
            ["accuracy", "precision", "recall", "f1", real_tokens],
            torch.randn(2, 4, 3),
            Y_TOK,
        ),  # language-model layout with ignored targets
        (nn.CrossEntropyLoss(ignore_index=0), ["accuracy", "f1"], torch.randn(2, 3, 4), Y_TOK.clamp(min=0)),
        ("bce_with_logits", ["accuracy", "precision"], torch.randn(4, 1), torch.tensor([1.0, 0.0, 1.0, 1.0])),
        ("mse", ["mae", "rmse", mean_abs_error], torch.randn(4, 1), torch.randn(4)),
    ],
)
def test_update_reads_nothing_back_from_the_device(loss, metrics, y_pred, y):
    # torchmetrics' own ignore_index is a boolean-mask index: the recorder sees it.
    theirs = torchmetrics.classification.MulticlassAccuracy(3, average="micro", ignore_index=-100)
    assert "aten.index.Tensor" in _ops_of(lambda: theirs.update(torch.zeros(8, dtype=torch.long), Y_TOK.reshape(8)))
    ms = MetricSet(metrics).configure(loss, "cpu")
    ms.update(y_pred, y)  # the first batch builds (shapes only)
    ops = _ops_of(lambda: ms.update(y_pred, y))
    assert not [op for op in ops if op.startswith(_SYNCING)], ops
