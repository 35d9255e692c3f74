"""The built-in multi-class accuracy (:class:`fitkit.metrics.counted.CountedAccuracy`): torchmetrics'
micro accuracy from two counts, the loss's count of the targets shared, and checkpoints written in
torchmetrics' four-state layout still resuming. The same for ``"precision"``, ``"recall"`` and
``"f1"`` (:class:`fitkit.metrics.counted.CountedStatScores`): torchmetrics' values to the bit from
per-class counts."""

from __future__ import annotations

import functools

import pytest
import torch
from _dist_scenarios import ce_case
from _torchrun import run_torchrun
from torch import nn
from torchmetrics import classification as tmc
from torchmetrics.classification import MulticlassAccuracy

import fitkit
from fitkit.callbacks import LambdaCallback
from fitkit.losses import resolve_loss
from fitkit.losses.denominators import objective
from fitkit.metrics import MetricSet
from fitkit.metrics.counted import CountedAccuracy, CountedStatScores

C = 4


def _batches(ignore_index, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (7, 1, 12, 5):
        preds, target = torch.randint(0, C, (n,), generator=g), torch.randint(0, C, (n,), generator=g)
        if ignore_index is not None and not 0 <= ignore_index < C:
            target[torch.rand(n, generator=g) < 0.3] = ignore_index
        out.append((preds, target))
    return out


@pytest.mark.parametrize("ignore_index", [None, -100, 0, 2])
@pytest.mark.parametrize("given_count", [False, True])
def test_the_value_is_torchmetrics_micro_accuracy_to_the_bit(ignore_index, given_count):
    ours = CountedAccuracy(C, ignore_index)
    theirs = MulticlassAccuracy(C, average="micro", ignore_index=ignore_index)
    for preds, target in _batches(ignore_index):
        count = None
        if given_count:  # as the cross-entropy kernel gives it: a float count of the targets that count
            count = (
                (target != ignore_index).sum().float()
                if ignore_index is not None
                else torch.tensor(float(target.numel()))
            )
        ours.update(preds, target, count)
        theirs.update(preds, target)
        assert torch.equal(ours.compute(), theirs.compute())
    assert ours.compute().dtype == torch.float32
    assert ours.update_count == theirs.update_count == 4


def test_a_copy_counts_for_itself():
    """``MetricSet.clone`` deep-copies the metric: its update must count into the copy alone."""
    ms = MetricSet(["accuracy"]).configure("cross_entropy")
    ms.update(torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    other = ms.clone()
    other.update(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([1, 1]))
    assert ms.compute()["accuracy"].item() == 1.0 and other.compute()["accuracy"].item() == 0.0
    assert ms.entries is not None and other.entries is not None
    assert (ms.entries[0].metric.update_count, other.entries[0].metric.update_count) == (1, 1)


def test_nothing_counted_is_0_as_in_torchmetrics():
    ours, theirs = CountedAccuracy(C, -100), MulticlassAccuracy(C, average="micro", ignore_index=-100)
    ours.update(torch.tensor([1, 2]), torch.tensor([-100, -100]))
    theirs.update(torch.tensor([1, 2]), torch.tensor([-100, -100]))
    assert ours.compute().item() == theirs.compute().item() == 0.0


def test_a_fit_and_an_evaluate_report_torchmetrics_accuracy():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(30, 3, generator=g), torch.randint(0, C, (30,), generator=g)
    y[::4] = -100
    model = fitkit.Model(nn.Linear(3, C), device="cpu")
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), "cross_entropy", metrics=["accuracy"])
    with torch.no_grad():
        preds = model.module(x).argmax(1)
    expected = MulticlassAccuracy(C, average="micro", ignore_index=-100)(preds, y).item()
    assert model.fit(x, y, batch_size=8, verbose=0).history["accuracy"] == [expected]
    assert model.evaluate(x, y, batch_size=7, verbose=0)["accuracy"] == expected
    assert model.metrics.entries is not None and isinstance(model.metrics.entries[0].metric, CountedAccuracy)


def test_targets_changed_in_place_after_the_loss_are_counted_again():
    ms = MetricSet(["accuracy"]).configure("cross_entropy")
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    y = torch.tensor([0, 1, 0])
    objective(resolve_loss("cross_entropy"), logits, y, None)  # counts 3 targets
    y[2] = -100  # the loss's count no longer holds
    ms.update(logits, y)
    assert ms.compute()["accuracy"].item() == 1.0  # 2 of 2, not 2 of 3


def test_the_loss_count_of_another_ignore_index_is_not_taken():
    ms = MetricSet(["accuracy"]).configure(nn.CrossEntropyLoss(ignore_index=0))
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    y = torch.tensor([0, 1, 2, 2])
    objective(resolve_loss("cross_entropy"), logits, y, None)  # ignore_index -100: counts 4
    ms.update(logits, y)
    assert ms.compute()["accuracy"].item() == torch.tensor(2 / 3).item()  # targets 1, 2, 2: the 0 skipped


def _fit_saving_at_batch_2(path=None):
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(24, 3, generator=g), torch.randint(0, C, (24,), generator=g)
    y[::5] = -100
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(3, C), device="cpu")
    model.compile(functools.partial(torch.optim.SGD, lr=0.5), "cross_entropy", metrics=["accuracy"])
    save = LambdaCallback(
        on_train_batch_end=lambda b, logs: path and model.epoch == 1 and b == 2 and model.save_checkpoint(path)
    )
    return model, x, y, save


def test_a_checkpoint_with_torchmetrics_stat_scores_resumes_the_epoch_exactly(tmp_path):
    """A mid-epoch checkpoint as fitkit wrote it when the accuracy was torchmetrics' four stat
    scores (micro: fp = fn = the misses, tn = tp + (C - 2) * targets) resumes with the same logs."""
    path = tmp_path / "mid.pt"
    ref, x, y, save = _fit_saving_at_batch_2(path)
    ref.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[save])
    state = torch.load(path, weights_only=True)
    new = state["trackers"]["metrics"]["accuracy"]
    correct, total = new["correct"], new["total"].long()
    assert 0 < correct < total
    state["trackers"]["metrics"]["accuracy"] = {
        "tp": correct,
        "fp": total - correct,
        "tn": correct + (C - 2) * total,
        "fn": total - correct,
        "_update_count": new["_update_count"],
    }
    del state["fitkit_checksum"]  # as the earlier fitkit wrote it: no checksum of this content
    torch.save(state, tmp_path / "old.pt")

    resumed, x, y, _ = _fit_saving_at_batch_2()
    initial_epoch = resumed.load_checkpoint(tmp_path / "old.pt")
    resumed.fit(x, y, batch_size=4, epochs=3, initial_epoch=initial_epoch, verbose=0)
    assert initial_epoch == 1
    assert resumed.history.history["accuracy"] == ref.history.history["accuracy"]
    assert resumed.history.history["loss"] == pytest.approx(ref.history.history["loss"], rel=1e-12)


def test_per_class_stat_scores_do_not_load_into_the_accuracy():
    ms = MetricSet(["accuracy"]).configure("cross_entropy")
    ms.update(torch.zeros(2, C), torch.tensor([0, 1]))
    per_class = {k: torch.zeros(C, dtype=torch.long) for k in ("tp", "fp", "tn", "fn")}
    with pytest.raises(ValueError, match="do not fit"):
        ms.load_state_dict({"accuracy": {**per_class, "_update_count": 1}})
    assert ms.compute()["accuracy"].item() == 0.5  # nothing loaded


# -- precision, recall, F1 -----------------------------------------------------------------------

STATS = {"precision": "MulticlassPrecision", "recall": "MulticlassRecall", "f1": "MulticlassF1Score"}
K = 5  # classes of the stat-score checks


def _stat_batches(ignore_index, seed: int):
    """Batches where class 3 is never a target (only predicted), class 4 never predicted (only a
    target), class 1 is absent from some batches, one batch has one row and, with an
    ``ignore_index``, one batch is ignored throughout."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (9, 1, 14, 6, 4):
        target = torch.tensor([0, 1, 2, 4])[torch.randint(0, 4, (n,), generator=g)]  # never 3
        guess = torch.randint(0, 4, (n,), generator=g)
        preds = torch.where((torch.rand(n, generator=g) < 0.5) & (target < 4), target, guess)  # never 4
        if n == 6:
            target[target == 1], preds[preds == 1] = 2, 0  # class 1 absent
        if ignore_index is not None:
            target[torch.rand(n, generator=g) < 0.3] = ignore_index
            if n == 4:
                target[:] = ignore_index
        out.append((preds, target))
    return out


def _theirs(stat, ignore_index, average="macro", num_classes=K):
    return getattr(tmc, STATS[stat])(num_classes, average=average, ignore_index=ignore_index)


@pytest.mark.parametrize("ignore_index", [None, -100, 0])
@pytest.mark.parametrize("stat", list(STATS))
def test_precision_recall_f1_are_torchmetrics_macro_values_to_the_bit(stat, ignore_index):
    """After every batch and at the end, over several seeds: the same float32 bits."""
    for seed in range(4):
        ours, theirs = CountedStatScores(K, stat, ignore_index), _theirs(stat, ignore_index)
        for preds, target in _stat_batches(ignore_index, seed):
            ours.update(preds, target)
            theirs.update(preds, target)
            value = ours.compute()
            assert value.dtype == torch.float32 and torch.equal(value, theirs.compute()), (seed, value)
        assert 0 < ours.compute().item() < 1
        assert ours.update_count == theirs.update_count == 5


@pytest.mark.parametrize("average", ["micro", "weighted", "none"])
@pytest.mark.parametrize("stat", list(STATS))
def test_the_other_averages_are_torchmetrics_too(stat, average):
    ours, theirs = CountedStatScores(K, stat, -100, average=average), _theirs(stat, -100, average)
    for preds, target in _stat_batches(-100, seed=7):
        ours.update(preds, target)
        theirs.update(preds, target)
        assert torch.equal(ours.compute(), theirs.compute())


def test_the_stat_scores_are_torchmetrics_and_any_shape_is_flattened():
    g = torch.Generator().manual_seed(3)
    preds, target = torch.randint(0, K, (4, 6), generator=g), torch.randint(0, K, (4, 6), generator=g)
    target[0, :3] = 0
    ours, theirs = CountedStatScores(K, "f1", 0), tmc.MulticlassStatScores(K, average=None, ignore_index=0)
    ours.update(preds, target)  # (B, T) labels
    theirs.update(preds, target)
    tp, fp, tn, fn = ours.stat_scores()
    assert torch.equal(torch.stack([tp, fp, tn, fn, tp + fn], 1), theirs.compute())


def test_nothing_counted_is_torchmetrics_zero():
    for stat in STATS:
        ours, theirs = CountedStatScores(K, stat, -100), _theirs(stat, -100)
        ours.update(torch.tensor([1, 2]), torch.tensor([-100, -100]))
        theirs.update(torch.tensor([1, 2]), torch.tensor([-100, -100]))
        assert torch.equal(ours.compute(), theirs.compute()) and ours.compute().item() == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stat": "f2"}, "Expected `stat` to be one of precision, recall, f1. Received: stat='f2'"),
        ({"average": "samples"}, "Expected `average` to be one of 'micro', .* Received: average='samples'"),
        ({"num_classes": 1}, "Expected `num_classes` to be an int of at least 2. Received: num_classes=1"),
    ],
)
def test_bad_arguments_name_what_was_expected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CountedStatScores(**{"num_classes": K, **kwargs})


def test_a_fit_and_an_evaluate_report_torchmetrics_precision_recall_f1():
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(40, 3, generator=g), torch.randint(0, C, (40,), generator=g)
    y[::6] = -100
    model = fitkit.Model(nn.Linear(3, C), device="cpu")
    by_name = {name: name for name in STATS}
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), "cross_entropy", metrics=by_name)
    with torch.no_grad():
        preds = model.module(x).argmax(1)
    expected = {name: _theirs(name, -100, num_classes=C)(preds, y).item() for name in STATS}
    history = model.fit(x, y, batch_size=8, verbose=0).history
    assert {name: history[name] for name in STATS} == {name: [v] for name, v in expected.items()}
    logs = model.evaluate(x, y, batch_size=7, verbose=0)
    assert {name: logs[name] for name in STATS} == expected
    assert model.metrics.entries is not None
    assert all(type(e.metric) is CountedStatScores for e in model.metrics.entries)


def test_a_copy_of_the_stat_scores_counts_for_itself():
    ms = MetricSet(["f1"]).configure("cross_entropy")
    ms.update(torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    other = ms.clone()
    other.update(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([1, 1]))
    assert ms.compute()["f1"].item() == 1.0 and other.compute()["f1"].item() == 0.0


def _fit_with(metrics, path=None):
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(28, 3, generator=g), torch.randint(0, C, (28,), generator=g)
    y[::5] = -100
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(3, C), device="cpu")
    model.compile(functools.partial(torch.optim.SGD, lr=0.5), "cross_entropy", metrics=metrics)
    save = LambdaCallback(
        on_train_batch_end=lambda b, logs: path and model.epoch == 1 and b == 2 and model.save_checkpoint(path)
    )
    return model, x, y, save


def test_a_checkpoint_with_torchmetrics_per_class_stat_scores_resumes_the_epoch_exactly(tmp_path):
    """A mid-epoch checkpoint whose running precision / recall / F1 are torchmetrics' own states
    (``tp``, ``fp``, ``tn``, ``fn`` per class, as fitkit saved them before it counted them itself)
    resumes into the counted metrics with the history of an uninterrupted run."""
    torchmetrics_objects = {name: _theirs(name, -100, num_classes=C) for name in STATS}
    old, x, y, save = _fit_with(torchmetrics_objects, tmp_path / "old.pt")
    old.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[save])
    saved = torch.load(tmp_path / "old.pt", weights_only=True)["trackers"]["metrics"]
    assert set(saved["f1"]) == {"tp", "fp", "tn", "fn", "_update_count"} and saved["f1"]["tp"].shape == (C,)

    ref, x, y, _ = _fit_with(list(STATS))
    ref.fit(x, y, batch_size=4, epochs=3, verbose=0)
    resumed, x, y, _ = _fit_with(list(STATS))
    initial_epoch = resumed.load_checkpoint(tmp_path / "old.pt")
    resumed.fit(x, y, batch_size=4, epochs=3, initial_epoch=initial_epoch, verbose=0)
    assert initial_epoch == 1
    for name in STATS:
        assert resumed.history.history[name] == ref.history.history[name] == old.history.history[name]
    assert resumed.history.history["loss"] == pytest.approx(ref.history.history["loss"], rel=1e-12)


def test_stat_scores_of_another_class_count_do_not_load():
    ms = MetricSet(["f1"]).configure("cross_entropy")
    ms.update(torch.zeros(2, C), torch.tensor([0, 1]))
    for shape in ((C + 1,), ()):  # another class count, a micro average's totals
        old = {k: torch.zeros(shape, dtype=torch.long) for k in ("tp", "fp", "tn", "fn")}
        with pytest.raises(ValueError, match="do not fit"):
            ms.load_state_dict({"f1": {**old, "_update_count": 1}})
    assert torch.equal(ms.compute()["f1"], _theirs("f1", -100, num_classes=C)(torch.zeros(2), torch.tensor([0, 1])))


JOB = """
import torch
from torchmetrics import classification as tmc
from _dist_scenarios import ce_case
from fitkit.distributed import rank
metrics = {"accuracy": "accuracy", "tm": tmc.MulticlassAccuracy(4, average="micro", ignore_index=-100),
           "precision": "precision", "recall": "recall", "f1": "f1",
           "tm_precision": tmc.MulticlassPrecision(4, ignore_index=-100),
           "tm_recall": tmc.MulticlassRecall(4, ignore_index=-100),
           "tm_f1": tmc.MulticlassF1Score(4, ignore_index=-100)}
torch.save(ce_case("ignored", metrics=metrics)["logs"], OUT / f"rank{rank()}.pt")
"""


@pytest.mark.slow
def test_two_ranks_report_the_label_metrics_of_every_row_as_torchmetrics(tmp_path):
    run_torchrun(JOB, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    metrics = {
        "accuracy": "accuracy",
        "tm": MulticlassAccuracy(4, average="micro", ignore_index=-100),
        **{name: name for name in STATS},
        **{f"tm_{name}": _theirs(name, -100, num_classes=4) for name in STATS},
    }
    one = ce_case("ignored", metrics=metrics)["logs"]
    assert one["accuracy"] == one["tm"]
    for logs in ranks:
        assert logs["accuracy"] == logs["tm"] == one["accuracy"]
        for name in STATS:
            assert logs[name] == logs[f"tm_{name}"] == one[name] == one[f"tm_{name}"]


def test_a_target_outside_the_classes_in_a_later_batch_is_named_before_that_step():
    # The first batch's labels are in range (its check passes); the second holds a 7 for 4 classes.
    x, y = torch.randn(8, 3), torch.tensor([0, 1, 2, 3, 0, 1, 7, 2])
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(3, 4), device="cpu")
    model.compile(optimizer="sgd", loss=lambda p, t: p.logsumexp(1).mean(), metrics=["f1"])
    torch.manual_seed(0)
    first = fitkit.Model(nn.Linear(3, 4), device="cpu")
    first.compile(optimizer="sgd", loss=lambda p, t: p.logsumexp(1).mean(), metrics=["f1"])
    first.fit(x[:4], y[:4], batch_size=4, verbose=0, shuffle=False)
    with pytest.raises(ValueError, match=r"Metric 'f1' got a target label outside \[0, 3\] for 4 classes .*Fix: remap"):
        model.fit(x, y, batch_size=4, verbose=0, shuffle=False)
    for a, b in zip(model.module.parameters(), first.module.parameters(), strict=True):
        assert torch.equal(a, b)  # the failing batch's step was not taken
