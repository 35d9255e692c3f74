"""Python calls and aten ops of one steady-state training step: ``fit(tensors)`` against a hand loop.

Deterministic where timings are not: on a fast GPU the Python that runs per step is the step's
cost, and the count of calls does not depend on the load of the machine.

Method: a tiny MLP (16 -> 32 -> 1, MSE, ``torch.optim.Adam``) trains on in-memory tensors,
batch 32, in ``fit(x, y, verbose=0)`` and in the hand loop of ``benchmarks/overhead.py``
(one ``randperm`` per epoch, index slicing, the epoch loss summed on the device).
``sys.setprofile`` counts the ``call`` (Python functions, generator resumptions included) and
``c_call`` (builtins such as ``isinstance``) events from one call of ``F.mse_loss`` (once per
step in both) to the next, in the middle of the epoch, median over 4 such steps; nothing is
added to the runs (no callback, no marker). A ``TorchDispatchMode`` counts the aten ops of the
same steps in a separate run (it adds calls of its own). The goal: at most 15 Python functions
per step more than the hand loop, on the same aten ops.

Run: ``python benchmarks/hot_path.py [--top 15]``: prints both counts, their difference, and
fitkit's functions that run per step.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fitkit

FITKIT = os.path.dirname(fitkit.__file__)
N, FEATURES, BATCH = 384, 16, 32  # 12 batches per epoch
MEASURED = range(5, 9)  # the steps counted: from the loss of batch 5 to that of batch 9
#: One loss call per step in each loop (fit computes cross-entropy from F.log_softmax and the
#: NLL kernel, a hand loop calls F.cross_entropy).
#: Each case's losses call exactly one of these once per step, in fit and in its hand loop (NLL
#: and KL take a ``log_softmax`` head, BCE a sigmoid head, so that the functional is the boundary).
_BOUNDARIES = {
    f.__code__
    for f in (
        F.mse_loss,
        F.cross_entropy,
        F.log_softmax,
        F.l1_loss,
        F.smooth_l1_loss,
        F.huber_loss,
        F.binary_cross_entropy_with_logits,
        F.binary_cross_entropy,
    )
}
_WEIGHTS = torch.tensor([1.0, 2.0, 0.5, 1.5])  # class weights of the weighted cross-entropy cases
_POS_WEIGHT = torch.tensor([3.0])


#: The configurations counted: (compile options, classes; 1 = a regression), and whether the
#: hand loop counts its accuracy / its per-class counts on the device / runs under bf16 autocast.
CASES: dict[str, dict[str, Any]] = {
    "mse": {"compile": {"loss": "mse"}, "classes": 1},
    "cross_entropy": {"compile": {"loss": "cross_entropy"}, "classes": 4},
    "cross_entropy+accuracy": {
        "compile": {"loss": "cross_entropy", "metrics": ["accuracy"]},
        "classes": 4,
        "accuracy": True,
    },
    "cross_entropy+f1": {"compile": {"loss": "cross_entropy", "metrics": ["f1"]}, "classes": 4, "stat_scores": True},
    "bf16": {"compile": {"loss": "mse"}, "classes": 1, "precision": "bf16-mixed"},
}
_CE = {"classes": 4, "hand": F.cross_entropy}
#: Every spelling of the losses fitkit knows, each against the hand loop that calls its functional
#: with the same options: ``hand(out, yb)`` is the hand loop's loss, ``head`` a last layer of the
#: net, ``targets`` what ``y`` holds (default: class indices for ``classes`` > 1, else regression).
CASES.update(
    {
        "F.cross_entropy": {**_CE, "compile": {"loss": F.cross_entropy}},
        "CrossEntropyLoss()": {**_CE, "compile": {"loss": nn.CrossEntropyLoss()}},
        "CrossEntropyLoss()+accuracy": {
            **_CE,
            "compile": {"loss": nn.CrossEntropyLoss(), "metrics": ["accuracy"]},
            "accuracy": True,
        },
        "CrossEntropyLoss(label_smoothing)": {
            **_CE,
            "compile": {"loss": nn.CrossEntropyLoss(label_smoothing=0.1)},
            "hand": partial(F.cross_entropy, label_smoothing=0.1),
        },
        "CrossEntropyLoss(weight)": {
            **_CE,
            "compile": {"loss": nn.CrossEntropyLoss(weight=_WEIGHTS)},
            "hand": partial(F.cross_entropy, weight=_WEIGHTS),
        },
        "CrossEntropyLoss(ignore_index)": {
            **_CE,
            "compile": {"loss": nn.CrossEntropyLoss(ignore_index=0)},
            "hand": partial(F.cross_entropy, ignore_index=0),
        },
        "CrossEntropyLoss(), Pairs DataLoader": {**_CE, "compile": {"loss": nn.CrossEntropyLoss()}, "source": "pairs"},
        "nll": {"compile": {"loss": "nll"}, "classes": 4, "head": nn.LogSoftmax(1), "hand": F.nll_loss},
        "NLLLoss()": {"compile": {"loss": nn.NLLLoss()}, "classes": 4, "head": nn.LogSoftmax(1), "hand": F.nll_loss},
        "bce_with_logits": {
            "compile": {"loss": "bce_with_logits"},
            "classes": 1,
            "targets": "binary",
            "hand": F.binary_cross_entropy_with_logits,
        },
        "BCEWithLogitsLoss(pos_weight)": {
            "compile": {"loss": nn.BCEWithLogitsLoss(pos_weight=_POS_WEIGHT)},
            "classes": 1,
            "targets": "binary",
            "hand": partial(F.binary_cross_entropy_with_logits, pos_weight=_POS_WEIGHT),
        },
        "bce": {
            "compile": {"loss": "bce"},
            "classes": 1,
            "targets": "binary",
            "head": nn.Sigmoid(),
            "hand": F.binary_cross_entropy,
        },
        "BCELoss()": {
            "compile": {"loss": nn.BCELoss()},
            "classes": 1,
            "targets": "binary",
            "head": nn.Sigmoid(),
            "hand": F.binary_cross_entropy,
        },
        "F.mse_loss": {"compile": {"loss": F.mse_loss}, "classes": 1},
        "MSELoss()": {"compile": {"loss": nn.MSELoss()}, "classes": 1},
        "l1": {"compile": {"loss": "l1"}, "classes": 1, "hand": F.l1_loss},
        "L1Loss()": {"compile": {"loss": nn.L1Loss()}, "classes": 1, "hand": F.l1_loss},
        "SmoothL1Loss(beta)": {
            "compile": {"loss": nn.SmoothL1Loss(beta=0.5)},
            "classes": 1,
            "hand": partial(F.smooth_l1_loss, beta=0.5),
        },
        "HuberLoss(delta)": {
            "compile": {"loss": nn.HuberLoss(delta=0.5)},
            "classes": 1,
            "hand": partial(F.huber_loss, delta=0.5),
        },
        "KLDivLoss(batchmean)": {
            "compile": {"loss": nn.KLDivLoss(reduction="batchmean")},
            "classes": 4,
            "targets": "probs",
            "head": nn.LogSoftmax(1),
            "hand": partial(F.kl_div, reduction="batchmean"),
        },
    }
)


def _mse_terms(out: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """A loss of two terms (:mod:`fitkit.losses.terms`): the total optimised, each term logged."""
    return {"mse": F.mse_loss(out, y), "l2": 0.01 * out.square().mean()}


CASES["loss terms"] = {"compile": {"loss": _mse_terms}, "classes": 1, "hand": _mse_terms}


def _data(classes: int = 1, targets: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, FEATURES, generator=g)
    y = x[:, :1] * 2 - x[:, 1:2]
    if targets == "binary":  # (B, 1) labels 0. / 1.
        return x, (y > 0).float()
    if targets == "probs":  # (B, C) probabilities
        return x, torch.softmax(x[:, :classes], 1)
    if classes > 1:  # four classes by the quadrant of two features
        return x, (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()
    return x, y


def _net(classes: int = 1, head: nn.Module | None = None) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, classes)]
    return nn.Sequential(*layers, *([head] if head is not None else []))


class Pairs(torch.utils.data.Dataset):
    """A map-style dataset that is not a ``TensorDataset``: torchvision's ``data`` / ``targets``."""

    def __init__(self, data: torch.Tensor, targets: torch.Tensor):
        self.data, self.targets = data, targets

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i], self.targets[i]


class _Counter:
    """Counts profile events between marks; ``steps[i]`` holds the events of step ``i``."""

    def __init__(self) -> None:
        self.step = -1  # fit's pre-flight check computes the loss once before batch 0
        self.steps: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.fitkit: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in _BOUNDARIES:
            self.step += 1
        if self.step not in MEASURED:
            return
        if event == "call":
            code = frame.f_code
            self.steps[self.step]["call"] += 1
            if code.co_filename.startswith(FITKIT):
                self.fitkit[self.step][f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1
        elif event == "c_call":
            self.steps[self.step]["c_call"] += 1
            self.steps[self.step][f"builtin {getattr(arg, '__name__', arg)}"] += 1


class _Ops(TorchDispatchMode):
    def __init__(self, counter: _Counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counter.step in MEASURED:
            self.counter.steps[self.counter.step]["aten"] += 1
        return func(*args, **(kwargs or {}))


def _count_ops(run: Any) -> _Counter:
    # The step boundary seen by a profile function that counts nothing else.
    counter = _Counter()

    def boundary(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in _BOUNDARIES:
            counter.step += 1

    sys.setprofile(boundary)
    try:
        with _Ops(counter):
            run(counter)
    finally:
        sys.setprofile(None)
    return counter


def _fit(case: str) -> Any:
    config = CASES[case]

    def run(counter: _Counter) -> None:
        model = fitkit.Model(
            _net(config["classes"], config.get("head")),
            device="cpu",
        )
        model.compile(
            optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
            jit_compile=False,
            precision=config.get("precision", "32"),
            **config["compile"],
        )
        x, y = _data(config["classes"], config.get("targets"))
        if config.get("source") == "pairs":
            model.fit(torch.utils.data.DataLoader(Pairs(x, y), batch_size=BATCH), epochs=1, verbose=0)
        else:
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)

    return run


def _hand(case: str) -> Any:
    config = CASES[case]
    classes, bf16 = config["classes"], config.get("precision") == "bf16-mixed"

    def run(counter: _Counter) -> None:
        net, (x, y) = _net(classes, config.get("head")), _data(classes, config.get("targets"))
        hand_loss = config.get("hand", F.cross_entropy if classes > 1 else F.mse_loss)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        perm = torch.randperm(N)
        total, correct = torch.zeros(()), torch.zeros((), dtype=torch.long)
        term_total = torch.zeros(2)
        # per class: true positives, predictions, targets (F1 = 2 tp / (predictions + targets))
        tp, predicted, actual = (torch.zeros(classes, dtype=torch.long) for _ in range(3))
        ones = torch.ones(BATCH, dtype=torch.long)
        loader = iter(torch.utils.data.DataLoader(Pairs(x, y), batch_size=BATCH)) if config.get("source") else None
        for i in range(0, N, BATCH):
            if loader is None:
                idx = perm[i : i + BATCH]
                xb, yb = x[idx], y[idx]
            else:
                xb, yb = next(loader)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = net(xb)
            out = out.float() if bf16 else out
            loss = hand_loss(out, yb)
            if isinstance(loss, dict):  # a loss of terms: their sum trains, each is summed for its log
                parts = torch.stack(list(loss.values())).detach()
                loss = loss["mse"] + loss["l2"]
                term_total += parts * len(xb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach() * len(xb)
            if config.get("accuracy"):
                correct += (out.detach().argmax(1) == yb).sum()
            if config.get("stat_scores"):  # sync-free per-class counts (bincount reads its size on the host)
                pred = out.detach().argmax(1)
                tp.index_add_(0, yb, (pred == yb).long())
                predicted.index_add_(0, pred, ones)
                actual.index_add_(0, yb, ones)
        float(total / N)
        if "terms" in case:
            (term_total / N).tolist()
        if config.get("accuracy"):
            float(correct / N)
        if config.get("stat_scores"):  # macro F1 over the classes seen
            seen = (predicted + actual) > 0
            float((2 * tp / (predicted + actual).clamp(min=1))[seen].mean())

    return run


def count(run: Any) -> dict[str, Any]:
    """``{"calls", "c_calls", "aten", "fitkit"}`` per steady step (medians) of ``run(counter)``."""
    counter = _Counter()
    sys.setprofile(counter.profile)
    try:
        run(counter)
    finally:
        sys.setprofile(None)
    ops = _count_ops(run)
    steps = [counter.steps[s] for s in MEASURED]
    fitkit_calls = [sum(counter.fitkit[s].values()) for s in MEASURED]
    return {
        "calls": int(statistics.median(s["call"] + s["c_call"] for s in steps)),
        "python_functions": int(statistics.median(s["call"] for s in steps)),
        "c_calls": int(statistics.median(s["c_call"] for s in steps)),
        "aten": int(statistics.median(ops.steps[s]["aten"] for s in MEASURED)),
        "fitkit_functions": int(statistics.median(fitkit_calls)),
        "fitkit_by_function": counter.fitkit[MEASURED[0]],
        "builtins": collections.Counter({k: v for k, v in steps[0].items() if k.startswith("builtin ")}),
    }


def counts(case: str = "mse") -> tuple[dict[str, Any], dict[str, Any]]:
    """The counts of ``fit(tensors)`` and of the hand loop for ``case`` (a key of :data:`CASES`)."""
    return count(_fit(case)), count(_hand(case))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=15, help="fitkit functions and builtins to list")
    parser.add_argument("--case", choices=[*CASES, "all"], default="all", help="the configuration (default: all)")
    args = parser.parse_args()
    for case in CASES if args.case == "all" else [args.case]:
        fit, hand = counts(case)
        print(f"\n== {case}\nper steady step       {'fit(tensors)':>14} {'hand loop':>10} {'extra':>6}")
        for key in ("calls", "python_functions", "c_calls", "aten", "fitkit_functions"):
            print(f"{key:21} {fit[key]:>14} {hand[key]:>10} {fit[key] - hand[key]:>+6}")
        print("\nfitkit's functions in one step:")
        for name, n in fit["fitkit_by_function"].most_common(args.top):
            print(f"  {n:3}  {name}")
        extra = fit["builtins"] - hand["builtins"]
        print("\nbuiltins fit calls more often than the hand loop:")
        for name, n in extra.most_common(args.top):
            print(f"  {n:3}  {name}")


if __name__ == "__main__":
    main()
