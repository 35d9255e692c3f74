"""Every spelling of a loss fitkit knows (the name, the functional, torch's module with its own
options) is one loss: the same form, and an epoch equal to a hand loop calling the functional
with the same options, on every source (in-memory tensors, a ``TensorDataset`` loader, a
map-style dataset with a ``targets`` tensor, and one without).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import fitkit
from fitkit.losses import resolve_loss
from fitkit.losses.denominators import objective

N, BATCH, C = 37, 8, 4  # 5 batches, the last of 5 rows
WEIGHTS = torch.tensor([1.0, 3.0, 0.5, 2.0])
POS_WEIGHT = torch.tensor([2.5])


class Pairs(Dataset):
    """A map-style dataset in torchvision's layout (``data``, ``targets``)."""

    def __init__(self, data, targets):
        self.data, self.targets = data, targets

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], self.targets[i]


class Opaque(Pairs):
    """The same samples, with no ``targets`` attribute fitkit could scan."""

    def __init__(self, data, targets):
        super().__init__(data, targets)
        self._y = self.__dict__.pop("targets")

    def __getitem__(self, i):
        return self.data[i], self._y[i]


def _data(kind: str, ignore: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 3, generator=g)
    if kind == "regression":
        return x, x @ torch.tensor([[1.0], [-2.0], [0.5]])
    if kind == "binary":
        return x, (x[:, :1] > 0).float()
    if kind == "probs":
        return x, torch.softmax(torch.randn(N, C, generator=g), 1)
    y = torch.randint(0, C, (N,), generator=g)
    if kind == "ignored":  # one in the first batch, and the whole last batch: it adds nothing
        y[[5, 32, 33, 34, 35, 36]] = ignore
    return x, y


def _module(out: int, head: nn.Module | None) -> nn.Module:
    g = torch.Generator().manual_seed(7)
    module = nn.Sequential(nn.Linear(3, out), *([head] if head is not None else []))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


#: name -> (the loss as compiled, the hand loop's functional with the same options, targets,
#: the module's head, the ignore index of the targets, the class weights of the count)
_CE, _NLL = ("index", None), ("index", nn.LogSoftmax(1))
SPELLINGS = {
    "'cross_entropy'": ("cross_entropy", F.cross_entropy, *_CE),
    "F.cross_entropy": (F.cross_entropy, F.cross_entropy, *_CE),
    "CrossEntropyLoss()": (nn.CrossEntropyLoss(), F.cross_entropy, *_CE),
    "CrossEntropyLoss(), ignored": (nn.CrossEntropyLoss(), F.cross_entropy, "ignored", None),
    "CrossEntropyLoss(label_smoothing)": (
        nn.CrossEntropyLoss(label_smoothing=0.1),
        functools.partial(F.cross_entropy, label_smoothing=0.1),
        *_CE,
    ),
    "CrossEntropyLoss(label_smoothing), ignored": (
        nn.CrossEntropyLoss(label_smoothing=0.1),
        functools.partial(F.cross_entropy, label_smoothing=0.1),
        "ignored",
        None,
    ),
    "CrossEntropyLoss(weight)": (
        nn.CrossEntropyLoss(weight=WEIGHTS),
        functools.partial(F.cross_entropy, weight=WEIGHTS),
        *_CE,
    ),
    "CrossEntropyLoss(weight, ignore_index, label_smoothing), ignored": (
        nn.CrossEntropyLoss(weight=WEIGHTS, ignore_index=7, label_smoothing=0.2),
        functools.partial(F.cross_entropy, weight=WEIGHTS, ignore_index=7, label_smoothing=0.2),
        "ignored7",
        None,
    ),
    "CrossEntropyLoss(weight), ignored": (
        nn.CrossEntropyLoss(weight=WEIGHTS),
        functools.partial(F.cross_entropy, weight=WEIGHTS),
        "ignored",
        None,
    ),
    "'nll'": ("nll", F.nll_loss, *_NLL),
    "F.nll_loss": (F.nll_loss, F.nll_loss, *_NLL),
    "NLLLoss(weight, ignore_index), ignored": (
        nn.NLLLoss(weight=WEIGHTS, ignore_index=7),
        functools.partial(F.nll_loss, weight=WEIGHTS, ignore_index=7),
        "ignored7",
        nn.LogSoftmax(1),
    ),
    "'bce_with_logits'": ("bce_with_logits", F.binary_cross_entropy_with_logits, "binary", None),
    "BCEWithLogitsLoss(pos_weight)": (
        nn.BCEWithLogitsLoss(pos_weight=POS_WEIGHT),
        functools.partial(F.binary_cross_entropy_with_logits, pos_weight=POS_WEIGHT),
        "binary",
        None,
    ),
    "F.binary_cross_entropy": (F.binary_cross_entropy, F.binary_cross_entropy, "binary", nn.Sigmoid()),
    "BCELoss()": (nn.BCELoss(), F.binary_cross_entropy, "binary", nn.Sigmoid()),
    "'mse'": ("mse", F.mse_loss, "regression", None),
    "F.mse_loss": (F.mse_loss, F.mse_loss, "regression", None),
    "MSELoss()": (nn.MSELoss(), F.mse_loss, "regression", None),
    "L1Loss()": (nn.L1Loss(), F.l1_loss, "regression", None),
    "SmoothL1Loss(beta)": (
        nn.SmoothL1Loss(beta=0.5),
        functools.partial(F.smooth_l1_loss, beta=0.5),
        "regression",
        None,
    ),
    "HuberLoss(delta)": (nn.HuberLoss(delta=0.5), functools.partial(F.huber_loss, delta=0.5), "regression", None),
    "KLDivLoss(batchmean)": (
        nn.KLDivLoss(reduction="batchmean"),
        functools.partial(F.kl_div, reduction="batchmean"),
        "probs",
        nn.LogSoftmax(1),
    ),
    "KLDivLoss(batchmean, log_target)": (
        nn.KLDivLoss(reduction="batchmean", log_target=True),
        functools.partial(F.kl_div, reduction="batchmean", log_target=True),
        "log_probs",
        nn.LogSoftmax(1),
    ),
}


def _case(spelling: str):
    loss, hand, kind, head = SPELLINGS[spelling]
    ignore = 7 if kind == "ignored7" else -100
    x, y = _data("ignored" if kind.startswith("ignored") else "probs" if kind == "log_probs" else kind, ignore)
    if kind == "log_probs":
        y = y.log()
    out = C if kind in ("index", "ignored", "ignored7", "probs", "log_probs") else 1
    return loss, hand, x, y, out, head, ignore


def _count(y: torch.Tensor, ignore: int, hand) -> torch.Tensor:
    """What the hand loop's batch mean divides by: the targets that count (weighted), or rows."""
    if y.is_floating_point():
        return torch.tensor(float(len(y)))
    weight = hand.keywords.get("weight") if isinstance(hand, functools.partial) else None
    keep = y != ignore
    return (weight[y.clamp(min=0) % C] * keep).sum() if weight is not None else keep.sum().float()


def _hand(spelling: str) -> tuple[list[torch.Tensor], float]:
    """One epoch of SGD in order: the functional's mean per batch, a batch where nothing counts
    skipped; the epoch loss the mean over every term (sum of batch means times counts)."""
    _, hand, x, y, out, head, ignore = _case(spelling)
    net = _module(out, head)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    total, count = torch.zeros(()), torch.zeros(())
    for i in range(0, N, BATCH):
        xb, yb = x[i : i + BATCH], y[i : i + BATCH]
        c = _count(yb, ignore, hand)
        if c == 0:
            continue
        loss = hand(net(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total, count = total + loss.detach() * c, count + c
    return [p.detach() for p in net.parameters()], float(total / count)


def _fit(spelling: str, source: str) -> tuple[list[torch.Tensor], float]:
    loss, _, x, y, out, head, _ = _case(spelling)
    net = _module(out, head)
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.1), loss=loss)
    if source == "tensors":
        h = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    else:
        dataset = {"TensorDataset": TensorDataset, "Pairs": Pairs, "Opaque": Opaque}[source](x, y)
        h = model.fit(DataLoader(dataset, batch_size=BATCH), epochs=1, verbose=0)
    return [p.detach() for p in net.parameters()], h.history["loss"][0]


#: Every spelling on tensors and on a dataset with ``targets``; the class-index ones whose path
#: depends on what fitkit knows of the targets on every source (``Opaque``: the guarded mean).
_ALL_SOURCES = (
    "CrossEntropyLoss()",
    "CrossEntropyLoss(), ignored",
    "CrossEntropyLoss(label_smoothing)",
    "CrossEntropyLoss(label_smoothing), ignored",
    "CrossEntropyLoss(weight)",
)
RUNS = [
    (spelling, source)
    for spelling in SPELLINGS
    for source in (
        ("tensors", "TensorDataset", "Pairs", "Opaque") if spelling in _ALL_SOURCES else ("tensors", "Pairs")
    )
]


@pytest.mark.parametrize(("spelling", "source"), RUNS)
def test_every_spelling_trains_as_its_hand_loop_on_every_source(spelling, source):
    params, loss = _fit(spelling, source)
    hand_params, hand_loss = _hand(spelling)
    assert all(torch.equal(a, b) for a, b in zip(params, hand_params, strict=True)), (params, hand_params)
    assert loss == pytest.approx(hand_loss, rel=1e-6)


def test_a_module_resolves_to_its_functional_and_options():
    ce = resolve_loss(nn.CrossEntropyLoss(weight=WEIGHTS, ignore_index=7, label_smoothing=0.2, reduction="sum"))
    assert (ce.fn, ce.kind, ce.name, ce.ignore_index, ce.reduction, ce.output) == (
        F.cross_entropy,
        "class_index",
        "CrossEntropyLoss",
        7,
        "sum",
        "logits",
    )
    assert ce.options == {"weight": WEIGHTS, "ignore_index": 7, "label_smoothing": 0.2} and ce.class_weights is WEIGHTS
    default = resolve_loss(nn.CrossEntropyLoss())
    named, functional = resolve_loss("cross_entropy"), resolve_loss(F.cross_entropy)
    for loss in (default, functional):
        assert (loss.fn, loss.kind, loss.options, loss.ignore_index, loss.reduction, loss.class_weights) == (
            named.fn,
            named.kind,
            {},
            -100,
            "mean",
            None,
        )
    bce = resolve_loss(nn.BCEWithLogitsLoss(pos_weight=POS_WEIGHT))
    assert (bce.fn, bce.options, bce.output) == (
        F.binary_cross_entropy_with_logits,
        {"pos_weight": POS_WEIGHT},
        "logits",
    )
    huber = resolve_loss(nn.HuberLoss(delta=0.5, reduction="none"))
    assert (huber.fn, huber.options, huber.reduction) == (F.huber_loss, {"delta": 0.5}, "mean")
    kl = resolve_loss(nn.KLDivLoss(reduction="batchmean", log_target=True))
    assert (kl.fn, kl.kind, kl.options, kl.reduction) == (F.kl_div, "regression", {"log_target": True}, "batchmean")


def test_a_subclass_of_a_loss_module_stays_a_callable():
    class Doubled(nn.MSELoss):
        def forward(self, y_pred, y):
            return 2 * super().forward(y_pred, y)

    loss = resolve_loss(Doubled())
    assert loss.kind == "custom" and loss(torch.zeros(2, 1), torch.ones(2, 1)).item() == 2.0


def test_kl_batchmean_per_sample_losses_are_row_sums():
    kl = resolve_loss(nn.KLDivLoss(reduction="batchmean"))
    y_pred = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.75]]))
    y = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    rows = F.kl_div(y_pred, y, reduction="none").sum(1)
    assert torch.equal(kl(y_pred, y, per_sample=True), rows)
    assert torch.equal(objective(kl, y_pred, y, torch.tensor([1.0, 3.0])), (rows[0] + 3 * rows[1]) / 4)


def test_label_smoothing_where_nothing_counts_is_0_not_nan():
    ce = resolve_loss(nn.CrossEntropyLoss(label_smoothing=0.1))
    logits = torch.randn(3, 4, requires_grad=True)
    out = objective(ce, logits, torch.full((3,), -100), None)
    out.backward()
    assert out.item() == 0.0 and torch.equal(logits.grad, torch.zeros(3, 4))


def test_a_datasets_targets_tensor_is_known_unless_a_transform_may_change_it():
    from fitkit.data.loaders import DeviceLoader, known_targets

    x, y = _data("index")
    pairs = Pairs(x, y)
    assert known_targets(DeviceLoader(DataLoader(pairs, batch_size=BATCH), torch.device("cpu"))) is y
    pairs.target_transform = lambda t: t
    assert known_targets(DeviceLoader(DataLoader(pairs, batch_size=BATCH), torch.device("cpu"))) is None
    assert known_targets(DeviceLoader(DataLoader(Opaque(x, y), batch_size=BATCH), torch.device("cpu"))) is None
    listed = Pairs(x, y.tolist())  # a list (CIFAR's): not scanned, the guarded mean
    assert known_targets(DeviceLoader(DataLoader(listed, batch_size=BATCH), torch.device("cpu"))) is None
