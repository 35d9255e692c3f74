"""The built-in multi-class accuracy (:class:`fitkit.metrics.counted.CountedAccuracy`): torchmetrics'
micro accuracy from two counts, the loss's count of the targets shared, and checkpoints written in
torchmetrics' four-state layout still resuming."""

from __future__ import annotations

import functools

import pytest
import torch
from _dist_scenarios import ce_case
from _torchrun import run_torchrun
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import fitkit
from fitkit.callbacks import LambdaCallback
from fitkit.losses import resolve_loss
from fitkit.losses.denominators import objective
from fitkit.metrics import MetricSet
from fitkit.metrics.counted import CountedAccuracy

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
            count = (target != ignore_index).sum().float() if ignore_index is not None else torch.tensor(
                float(target.numel()))
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
    save = LambdaCallback(on_train_batch_end=lambda b, logs: path and model.epoch == 1 and b == 2
                          and model.save_checkpoint(path))  # fmt: skip
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
        "tp": correct, "fp": total - correct, "tn": correct + (C - 2) * total, "fn": total - correct,
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


JOB = """
import torch
from torchmetrics.classification import MulticlassAccuracy
from _dist_scenarios import ce_case
from fitkit.distributed import rank
metrics = {"accuracy": "accuracy", "tm": MulticlassAccuracy(4, average="micro", ignore_index=-100)}
torch.save(ce_case("ignored", metrics=metrics)["logs"], OUT / f"rank{rank()}.pt")
"""


@pytest.mark.slow
def test_two_ranks_report_the_accuracy_of_every_row_as_torchmetrics(tmp_path):
    run_torchrun(JOB, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    metrics = {"accuracy": "accuracy", "tm": MulticlassAccuracy(4, average="micro", ignore_index=-100)}
    one = ce_case("ignored", metrics=metrics)["logs"]
    assert one["accuracy"] == one["tm"]
    for logs in ranks:
        assert logs["accuracy"] == logs["tm"] == one["accuracy"]
