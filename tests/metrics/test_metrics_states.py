"""fitkit's sync-free updates of torchmetrics' multi-class stat-score metrics: same numbers, no host read."""

from __future__ import annotations

import copy

import pytest
import torch
from torchmetrics import classification as tmc

import fitkit
from fitkit.metrics.states import sync_free_update
from tests._syncs import SyncCounter

CLASSES = 4


def _batches(ignore_index):
    g = torch.Generator().manual_seed(3)
    out = []
    for n in (7, 5, 9):
        logits = torch.randn(n, CLASSES, generator=g)
        target = torch.randint(0, CLASSES, (n,), generator=g)
        if ignore_index is not None:
            target[::3] = ignore_index
        out.append((logits, target))
    return out


METRICS = [
    lambda **kw: tmc.MulticlassAccuracy(CLASSES, **kw),
    lambda **kw: tmc.MulticlassPrecision(CLASSES, **kw),
    lambda **kw: tmc.MulticlassRecall(CLASSES, **kw),
    lambda **kw: tmc.MulticlassF1Score(CLASSES, **kw),
    lambda **kw: tmc.MulticlassFBetaScore(2.0, CLASSES, **kw),
    lambda **kw: tmc.MulticlassSpecificity(CLASSES, **kw),
    lambda **kw: tmc.MulticlassStatScores(CLASSES, **kw),
]


@pytest.mark.parametrize("ignore_index", [None, 1, -100])
def test_the_sync_free_update_gives_torchmetrics_numbers(ignore_index):
    for make in METRICS:
        for average in ("micro", "macro", "weighted", "none"):
            theirs, ours = (make(average=average, ignore_index=ignore_index) for _ in range(2))
            update = sync_free_update(ours)
            assert update is not None
            for logits, target in _batches(ignore_index):
                theirs.update(logits, target)
                update(logits, target)
            assert ours.update_count == theirs.update_count == 3
            torch.testing.assert_close(ours.compute(), theirs.compute(), rtol=0, atol=0)


def test_the_sync_free_update_reads_nothing_on_the_host_and_torchmetrics_does():
    (logits, target), *_ = _batches(None)
    theirs, ours = tmc.MulticlassF1Score(CLASSES), tmc.MulticlassF1Score(CLASSES)
    update = sync_free_update(ours)
    counter = SyncCounter()
    with counter:
        theirs.update(logits, target)
    assert "aten.bincount.default" in [e.what for e in counter.events]
    counter = SyncCounter()
    with counter:
        update(logits, target)
    assert counter.events == []


def test_other_metrics_and_overridden_updates_are_updated_as_given():
    class Mine(tmc.MulticlassF1Score):
        def update(self, preds, target):
            super().update(preds, target)

    assert sync_free_update(Mine(CLASSES)) is None
    assert sync_free_update(tmc.MulticlassF1Score(CLASSES, top_k=2)) is None
    assert sync_free_update(tmc.MulticlassAccuracy(CLASSES, multidim_average="samplewise")) is None
    assert sync_free_update(tmc.BinaryF1Score()) is None


def test_a_copy_gets_an_update_of_its_own():
    a = tmc.MulticlassAccuracy(CLASSES, average="micro")
    sync_free_update(a)  # cached for a
    b = copy.deepcopy(a)
    sync_free_update(b)(torch.eye(CLASSES), torch.arange(CLASSES))
    assert b.update_count == 1 and a.update_count == 0


def test_fit_logs_a_users_f1_as_torchmetrics_computes_it():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 3, generator=g), torch.randint(0, CLASSES, (40,), generator=g)
    model = fitkit.Model(torch.nn.Linear(3, CLASSES), device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy", metrics={"f1": tmc.MulticlassF1Score(CLASSES)})
    logs = model.evaluate(x, y, batch_size=8, verbose=0)
    reference = tmc.MulticlassF1Score(CLASSES)
    reference.update(model.predict(x, verbose=0), y)
    assert logs["f1"] == reference.compute().item()
