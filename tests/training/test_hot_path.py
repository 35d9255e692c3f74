"""The Python and the aten ops a steady training step runs: ``fit(tensors)`` against a hand loop.

Counted (not timed) by ``benchmarks/hot_path.py``: ``sys.setprofile`` call events from one
loss call to the next, and the aten ops of the same steps. Deterministic on any machine (torch
is pinned). Each configuration's limit is what it measures today: a change that adds work to
the step fails here.

- ``mse``: one op fewer than the hand loop (the running total adds the loss with ``alpha``).
- ``cross_entropy``: one op fewer than the hand loop. In-memory targets (and a
  ``TensorDataset``'s) are scanned once for ``ignore_index``; none there, every batch's count is
  its size (a host ``int``), so the mean is the NLL kernel's own, as ``F.cross_entropy`` computes
  it, and the running loss total adds it with ``alpha`` = the count, as for ``mse``. Targets that
  may hold ignored entries (a DataLoader of other samples, a generator) cost 3 more: a clamp and
  a division forward and the division's backward, so a batch where nothing counts is 0, not
  0/0. Before: +3 here too, +4 before that, and +14 before that (the targets counted twice, a
  safe division of where / ones_like / eq, a cast).
- ``cross_entropy+accuracy``: the hand loop counts its accuracy with detach / argmax / eq / sum /
  add_; fitkit's accuracy (``fitkit.metrics.counted.CountedAccuracy``: torchmetrics' micro value
  from a count of correct labels and a count of targets) with argmax / eq / sum and two adds, its
  count of targets the host count the loss's batch had, and no detach (integer ops record no
  graph): the cross-entropy's -1 (before: +3, +14 with torchmetrics' four stat scores, +19
  before that). Its Python: accuracy alone on ``(B, C)`` scores and ``(B,)`` labels is one call
  into the metric set; no ``no_grad`` context around label-only metrics, and the metric's update
  wrapper without torchmetrics' grad-mode context and module attribute sets.
- ``cross_entropy+f1``: the hand loop counts per class with detach / argmax / eq / a cast to long
  and three ``index_add_`` (true positives, predictions, targets); fitkit's F1
  (``fitkit.metrics.counted.CountedStatScores``: torchmetrics' macro value from per-class counts)
  with argmax, the loss's ``ignore_index`` sent to an extra class (eq and two masked_fill), eq, add,
  a view of a 1 (expand) and two ``index_add_``: 1 over the hand loop (before: +32 with
  torchmetrics' ``MulticlassF1Score`` states fed by fitkit's masked counts, Python +44).
- ``bf16``: one op fewer than a hand autocast loop.
- Every spelling of the losses fitkit knows (``F.cross_entropy``, ``nn.CrossEntropyLoss()`` and
  the modules of NLL, BCE-with-logits, BCE, MSE, L1, smooth L1, Huber and KL, with their own
  options) resolves to the functional and its options, and takes the path of the name: the same
  ops as the name against a hand loop calling the functional with the same options (before:
  ``nn.CrossEntropyLoss()`` +10 ops, +14 with accuracy, label smoothing +6). Label smoothing
  runs ``F.cross_entropy`` itself (-1); class weights run the NLL kernel with the weights, its
  total weight the batch's count (+0: the count is a tensor the running total multiplies by);
  an ``ignore_index`` that occurs in the targets (``ignore_index=0`` on classes 0..3) keeps the
  guarded mean (+3, as for a source whose targets are unknown).
- ``CrossEntropyLoss(), Pairs DataLoader``: a ``DataLoader`` over a map-style dataset that is not
  a ``TensorDataset`` but has a ``targets`` tensor (torchvision's convention) is scanned once, as a
  ``TensorDataset`` is (before: +3 ops, the guarded mean). Its Python against a hand loop over
  the same ``DataLoader`` (+27) is the batch's way through ``DeviceLoader`` (unpacking, moving),
  the same for every loss.
- ``loss terms``: a callable returning ``{"mse": ..., "l2": ...}`` (:mod:`fitkit.losses.terms`)
  against a hand loop that sums the terms, steps on the sum and keeps each term's running sum on
  the device (a stack and a multiply-add per step): two ops fewer (the terms' running sums take
  the rows with ``alpha``, one kernel). Its Python: the callable's path through ``Loss`` as any
  callable's (``prepare``), one pass over the terms (``split_terms``), one call to take them from
  the loss (``take_terms``) and one to add them (``_add_terms``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

#: case -> (most extra aten ops, most extra Python functions) per steady step against the hand loop
LIMITS = {
    "mse": (-1, 15),
    "cross_entropy": (-1, 9),
    "cross_entropy+accuracy": (-1, 13),
    "cross_entropy+f1": (1, 16),
    "bf16": (-1, 25),
    "F.cross_entropy": (-1, 9),
    "CrossEntropyLoss()": (-1, 9),
    "CrossEntropyLoss()+accuracy": (-1, 13),
    "CrossEntropyLoss(label_smoothing)": (-1, 10),
    "CrossEntropyLoss(weight)": (0, 9),
    "CrossEntropyLoss(ignore_index)": (3, 9),
    "CrossEntropyLoss(), Pairs DataLoader": (-1, 27),
    "nll": (-1, 8),
    "NLLLoss()": (-1, 8),
    "bce_with_logits": (-1, 7),
    "BCEWithLogitsLoss(pos_weight)": (-1, 7),
    "bce": (-1, 7),
    "BCELoss()": (-1, 7),
    "F.mse_loss": (-1, 7),
    "MSELoss()": (-1, 7),
    "l1": (-1, 7),
    "L1Loss()": (-1, 7),
    "SmoothL1Loss(beta)": (-1, 7),
    "HuberLoss(delta)": (-1, 7),
    "KLDivLoss(batchmean)": (-1, 7),
    "loss terms": (-2, 12),
}


@pytest.fixture(scope="module")
def hot_path():
    path = Path(__file__).parents[2] / "benchmarks" / "hot_path.py"
    spec = importlib.util.spec_from_file_location("hot_path", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LIMITS))
def test_fit_adds_at_most_its_measured_ops_and_calls_to_the_hand_loop(hot_path, case):
    fit, hand = hot_path.counts(case)
    ops, functions = LIMITS[case]
    assert hand["aten"] > 0 and fit["aten"] - hand["aten"] <= ops, (fit["aten"], hand["aten"])
    extra = fit["python_functions"] - hand["python_functions"]
    assert 0 < extra <= functions, dict(fit["fitkit_by_function"])


@pytest.mark.slow
def test_the_plain_regression_step_calls_at_most_15_fitkit_functions(hot_path):
    fit, _ = hot_path.counts("mse")
    assert fit["fitkit_functions"] <= 15
