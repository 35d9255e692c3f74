from __future__ import annotations

import math

import pytest
import torch
from conftest import Bias
from torch import nn

import fitkit
from fitkit.checks import FitkitWarning
from fitkit.losses import resolve_loss
from fitkit.losses.denominators import denominator

B0 = torch.tensor([1.0, 0.5, 0.0])
Y = torch.tensor([[0, 1, 2, 1], [2, -100, -100, -100]])  # 4 real tokens and 1
X = torch.zeros(2, 4)


class BiasLM(nn.Module):
    """Logits ``b`` at every position: ``(B, T, 3)``, or ``(B, 3, T)`` with ``channels_first``."""

    def __init__(self, channels_first: bool = False):
        super().__init__()
        self.b = nn.Parameter(B0.clone())
        self.channels_first = channels_first

    def forward(self, x):
        out = self.b.expand(x.shape[0], x.shape[1], 3)
        return out.transpose(1, 2) if self.channels_first else out


def _hand_gradient(weights: torch.Tensor | None = None) -> list[float]:
    """d/db of sum_t w_t * CE_t / sum_t w_t over the real tokens: softmax(b) - weighted one-hot mean."""
    p = torch.softmax(B0.double(), 0)
    tokens = Y[Y != -100]
    w = torch.ones(len(tokens), dtype=torch.float64) if weights is None else weights.double()
    onehot = torch.nn.functional.one_hot(tokens, 3).double()
    return (p - (w[:, None] * onehot).sum(0) / w.sum()).tolist()


def _trained(loss="cross_entropy", channels_first=False, batch_size=2, accumulation=1, **fit_kw):
    model = fitkit.Model(BiasLM(channels_first), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss=loss, gradient_accumulation_steps=accumulation)
    model.fit(X, Y, batch_size=batch_size, shuffle=False, verbose=0, **fit_kw)
    return (B0 - model.module.b.detach()).tolist()  # the gradient of the one step


def test_the_full_batch_gradient_is_the_mean_over_the_real_tokens():
    assert _hand_gradient() == pytest.approx([0.3065, -0.0928, -0.2137], abs=5e-5)
    assert _trained() == pytest.approx(_hand_gradient(), abs=1e-6)


@pytest.mark.parametrize("channels_first", [False, True])
@pytest.mark.parametrize("loss", ["cross_entropy", nn.CrossEntropyLoss()])
def test_accumulated_micro_batches_weigh_by_their_tokens(loss, channels_first):
    # Two micro-batches of one row (4 tokens and 1): one step on the whole window.
    grad = _trained(loss, channels_first, batch_size=1, accumulation=2)
    assert grad == pytest.approx([0.3065, -0.0928, -0.2137], abs=5e-5)
    assert grad == pytest.approx(_hand_gradient(), abs=1e-6)


def test_nll_with_its_own_ignore_index_counts_its_tokens():
    class LogSoftmaxLM(BiasLM):
        def forward(self, x):
            return torch.log_softmax(super().forward(x), -1)

    model = fitkit.Model(LogSoftmaxLM(), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss=nn.NLLLoss(ignore_index=7), gradient_accumulation_steps=2
    )
    model.fit(X, Y.masked_fill(Y == -100, 7), batch_size=1, shuffle=False, verbose=0)
    assert (B0 - model.module.b.detach()).tolist() == pytest.approx(_hand_gradient(), abs=1e-6)


def test_sample_weights_of_one_give_the_token_mean():
    assert _trained(sample_weight=torch.ones(2)) == pytest.approx(_hand_gradient(), abs=1e-6)
    grad = _trained(batch_size=1, accumulation=2, sample_weight=torch.ones(2))
    assert grad == pytest.approx(_hand_gradient(), abs=1e-6)


def test_a_row_weight_weighs_each_of_its_tokens_across_micro_batches():
    # Row 0 (4 tokens) weight 1, row 1 (1 token) weight 3.
    hand = _hand_gradient(torch.tensor([1.0, 1.0, 1.0, 1.0, 3.0]))
    assert _trained(sample_weight=torch.tensor([1.0, 3.0])) == pytest.approx(hand, abs=1e-6)
    grad = _trained(batch_size=1, accumulation=2, sample_weight=torch.tensor([1.0, 3.0]))
    assert grad == pytest.approx(hand, abs=1e-6)


def test_per_token_sample_weights_weigh_each_token():
    w = torch.tensor([[1.0, 2.0, 0.0, 1.0], [4.0, 9.0, 9.0, 9.0]])  # the 9s sit on ignored positions
    hand = _hand_gradient(torch.tensor([1.0, 2.0, 0.0, 1.0, 4.0]))
    assert _trained(sample_weight=w) == pytest.approx(hand, abs=1e-6)
    assert _trained(batch_size=1, accumulation=2, sample_weight=w) == pytest.approx(hand, abs=1e-6)


def test_a_module_class_weight_is_the_denominator_across_micro_batches():
    weight = torch.tensor([1.0, 2.0, 5.0])
    hand = _hand_gradient(weight[Y[Y != -100]])
    full = _trained(nn.CrossEntropyLoss(weight=weight))
    assert full == pytest.approx(hand, abs=1e-6)
    assert _trained(nn.CrossEntropyLoss(weight=weight), batch_size=1, accumulation=2) == pytest.approx(hand, abs=1e-6)


def _token_ce() -> float:
    nll = -torch.log_softmax(B0.double(), 0)
    return float(nll[Y[Y != -100]].mean())


def test_evaluate_and_the_epoch_loss_are_token_means_however_the_data_is_cut():
    assert _token_ce() == pytest.approx(1.2803, abs=5e-5)
    model = fitkit.Model(BiasLM(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="cross_entropy")
    for bs in (1, 2):
        assert model.evaluate(X, Y, batch_size=bs, verbose=0)["loss"] == pytest.approx(_token_ce(), rel=1e-6)
        h = model.fit(X, Y, batch_size=bs, shuffle=False, verbose=0)  # lr 0: the weights stay
        assert h.history["loss"] == [pytest.approx(_token_ce(), rel=1e-6)]
    ones = model.evaluate(X, Y, batch_size=1, sample_weight=torch.ones(2), verbose=0)["loss"]
    assert ones == pytest.approx(_token_ce(), rel=1e-6)


def test_denominators_of_the_known_losses():
    ce = resolve_loss("cross_entropy")
    assert denominator(ce, Y, None).item() == 5
    assert denominator(ce, Y, torch.tensor([2.0, 1.0])).item() == 9
    assert denominator(resolve_loss(nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 5.0]))), Y, None).item() == 15
    assert denominator(resolve_loss(nn.CrossEntropyLoss(ignore_index=1)), Y, None).item() == 6
    assert denominator(resolve_loss("mse"), torch.zeros(3, 4), None) == 3  # rows: a host int, no sync
    assert denominator(resolve_loss("mse"), torch.zeros(3, 4), torch.tensor([0.5, 1.0, 0.0])).item() == 1.5
    assert denominator(resolve_loss("cross_entropy"), torch.zeros(3, 4), None) == 3  # class probabilities: rows
    with pytest.raises(ValueError, match=r"Expected `sample_weight` of shape \(2,\) .*or \(2, 4\)"):
        denominator(ce, Y, torch.ones(3))


# -- zero denominators ---------------------------------------------------------------------------


def test_a_window_whose_weights_are_all_zero_adds_nothing():
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse", gradient_accumulation_steps=2)
    y = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    h = model.fit(
        torch.zeros(4, 1), y, batch_size=1, sample_weight=torch.tensor([0.0, 0.0, 1.0, 1.0]), shuffle=False, verbose=0
    )
    # Window 1 weighs 0; window 2 at b = 0: loss (9 + 16) / 2, gradient 2 * (0 - 3.5), b = 0.7.
    assert model.module.b.item() == pytest.approx(0.7)
    assert h.history["loss"] == [12.5]


def test_a_micro_batch_of_ignored_tokens_adds_nothing():
    y = torch.tensor([[0, 1, 2, 1], [-100, -100, -100, -100], [2, -100, -100, -100]])
    model = fitkit.Model(BiasLM(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss="cross_entropy", gradient_accumulation_steps=3)
    h = model.fit(torch.zeros(3, 4), y, batch_size=1, shuffle=False, verbose=0)
    assert (B0 - model.module.b.detach()).tolist() == pytest.approx(_hand_gradient(), abs=1e-6)
    assert h.history["loss"] == [pytest.approx(_token_ce(), rel=1e-6)]
    with pytest.raises(ValueError, match=r"`evaluate` has no loss to report: .*ignore_index"):
        model.evaluate(torch.zeros(1, 4), y[1:2], verbose=0)


def test_evaluate_with_every_weight_zero_is_an_error_and_an_epoch_a_warning():
    model = fitkit.Model(Bias(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
    x, y = torch.zeros(3, 1), torch.ones(3, 1)
    with pytest.raises(ValueError, match=r"`evaluate` has no loss to report: every sample weight was 0.*Fix"):
        model.evaluate(x, y, sample_weight=torch.zeros(3), verbose=0)
    with pytest.raises(ValueError, match="`evaluate` has no loss to report"):
        model.evaluate(x, y, sample_weight=torch.zeros(3), batch_size=1, verbose=0)
    with pytest.warns(FitkitWarning, match="counted nothing.*logged as NaN"):
        h = model.fit(x, y, sample_weight=torch.zeros(3), verbose=0)
    assert math.isnan(h.history["loss"][0]) and model.module.b.item() == 0.0


def _host_reads(fn) -> int:
    """How many times ``fn`` reads a device value on the host (``.item()``, ``bool()``, ``.tolist()``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in ("aten._local_scalar_dense.default", "aten.nonzero.default", "aten.unique.default"):
                Count.reads += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.reads


@pytest.mark.parametrize("weights", [None, "rows", "tokens"])
def test_token_denominators_read_nothing_back_per_step(weights):
    def fit(rows: int) -> None:
        y = Y.repeat(rows // 2, 1)
        kw = {"rows": {"sample_weight": torch.rand(rows) + 0.5}, "tokens": {"sample_weight": torch.rand(rows, 4)}}.get(
            weights, {}
        )
        batches = [
            (X[:1].expand(2, 4), y[i : i + 2], *([kw["sample_weight"][i : i + 2]] if kw else []))
            for i in range(0, rows, 2)
        ]
        model = fitkit.Model(BiasLM(), device="cpu")
        model.compile(optimizer="sgd", loss="cross_entropy", gradient_accumulation_steps=2)
        model.fit(batches, verbose=0)

    # 4 more windows of 2 micro-batches add no host read: the counts stay on the device (the
    # reads counted are the epoch's end and the first-batch checks).
    base = _host_reads(lambda: fit(16))
    assert base > 0 and _host_reads(lambda: fit(32)) == base


class FixedLogits(nn.Module):
    """Returns the stored logits of row ``x[:, 0]`` (one trainable scalar so fit can run)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits
        self.p = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.logits[x[:, 0].long()] + 0 * self.p


def test_a_sample_weight_weighs_each_of_its_real_tokens():
    class0 = torch.tensor([5.0, 0.0, 0.0])
    logits = torch.stack([class0.expand(4, 3), class0.expand(4, 3)])  # (B, T, C), always class 0
    targets = torch.tensor([[0, 0, -100, -100], [1, 1, 1, -100]])
    model = fitkit.Model(FixedLogits(logits), device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy")
    right, wrong = math.log(1 + 2 * math.exp(-5)), math.log(math.exp(5) + 2)  # CE of class 0 / 1
    idx = torch.tensor([[0.0], [1.0]])
    weighted = model.evaluate(idx, targets, sample_weight=torch.tensor([1.0, 3.0]), verbose=0)["loss"]
    # Row 0 has 2 real tokens of weight 1, row 1 has 3 of weight 3: sum(w * l) / sum(w) over tokens.
    assert weighted == pytest.approx((2 * 1 * right + 3 * 3 * wrong) / (2 * 1 + 3 * 3), rel=1e-6)
    # A weight of one for every sample is the unweighted mean over the real tokens.
    ones = model.evaluate(idx, targets, sample_weight=torch.ones(2), verbose=0)["loss"]
    assert ones == pytest.approx(model.evaluate(idx, targets, verbose=0)["loss"], rel=1e-12)
    assert ones == pytest.approx((2 * right + 3 * wrong) / 5, rel=1e-6)


def test_the_count_shared_by_the_loss_and_the_totals_follows_a_target_tensor_refilled_in_place():
    """The objective's count of the targets that count is reused by the running totals only for
    the very tensor it counted, at the same version: a loader that refills one target buffer in
    place (different targets ignored in each batch) still gets each batch's own count. The
    epoch loss is the mean over every counted target, by hand."""
    import torch.nn.functional as F
    from torch import nn

    import fitkit

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, generator=g) for _ in range(3)]
    ys = [torch.tensor([0, 1, -100, 2]), torch.tensor([-100, -100, -100, 1]), torch.tensor([2, 2, 1, 0])]
    buffer = torch.zeros(4, dtype=torch.long)

    class Refilled:
        def __iter__(self):
            for x, y in zip(xs, ys, strict=True):
                buffer.copy_(y)  # the same tensor object, its version bumped
                yield x, buffer

        def __len__(self):
            return 3

    torch.manual_seed(0)
    net = nn.Linear(3, 3)
    hand = nn.Linear(3, 3)
    hand.load_state_dict(net.state_dict())
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="cross_entropy")  # lr 0: fixed weights
    history = model.fit(Refilled(), epochs=1, verbose=0)
    with torch.no_grad():
        total = sum(F.cross_entropy(hand(x), y, reduction="sum") for x, y in zip(xs, ys, strict=True))
    assert history.history["loss"][0] == pytest.approx(float(total / 8), rel=1e-6)  # 3 + 1 + 4 targets count


def test_step_loss_is_detached_and_equals_the_batch_loss():
    """The window keeps the loss attached (no detach per step); step_loss detaches it when read."""
    from torch import nn

    import fitkit

    seen = []
    model = fitkit.Model(nn.Linear(3, 3), device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy")
    cb = fitkit.callbacks.LambdaCallback(on_backward_end=lambda batch: seen.append(model.step_loss))
    x, y = torch.randn(8, 3), torch.tensor([0, 1, 2, 0, 1, 2, -100, 1])
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    assert len(seen) == 1 and not seen[0].requires_grad
    assert seen[0].item() == pytest.approx(history.history["loss"][0], rel=1e-6)


def test_a_target_changed_in_place_after_its_loss_is_counted_again():
    from fitkit.losses.denominators import objective

    ce = resolve_loss("cross_entropy")
    y = torch.tensor([0, 1, 2, 1])
    objective(ce, torch.zeros(4, 3), y, None)
    assert denominator(ce, y, None).item() == 4  # the objective's own count
    y[0] = -100  # the same tensor, refilled (a loader's reused buffer)
    assert denominator(ce, y, None).item() == 3


class _NllReductions(torch.utils._python_dispatch.TorchDispatchMode):
    """The ``reduction`` argument of every NLL kernel call: 1 the kernel's own mean, 2 its sum
    (fitkit's guarded mean, 0 where nothing counts)."""

    def __init__(self):
        super().__init__()
        self.seen: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.nll_loss_forward.default:
            self.seen.append(args[3])
        return func(*args, **(kwargs or {}))


def _classifier_fit(x, y=None, **fit_kwargs):
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(4, 3), device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy", jit_compile=False)
    with _NllReductions() as mode:
        history = model.fit(x, y, epochs=1, verbose=0, shuffle=False, **fit_kwargs)
    return mode.seen[1:], history, model  # [0]: the first-batch check before step 1 (its own guard)


def test_targets_known_to_hold_no_ignored_entry_take_the_kernels_own_mean():
    # Every batch's mean divides by its size (nothing can be ignored): the kernel's mean, as a
    # hand F.cross_entropy; any other source (or a target equal to -100) keeps the guarded sum.
    x, y = torch.randn(12, 4), torch.tensor([0, 1, 2] * 4)
    assert _classifier_fit(x, y, batch_size=4)[0] == [1, 1, 1]
    ds = torch.utils.data.TensorDataset(x, y)
    assert _classifier_fit(torch.utils.data.DataLoader(ds, batch_size=4))[0] == [1, 1, 1]
    sub = torch.utils.data.Subset(ds, range(8))
    assert _classifier_fit(torch.utils.data.DataLoader(sub, batch_size=4))[0] == [1, 1]
    custom = torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=lambda s: torch.utils.data.default_collate(s))
    assert _classifier_fit(custom)[0] == [2, 2, 2]  # a user's collate may change the targets
    assert _classifier_fit(iter([(x[:4], y[:4]), (x[4:], y[4:])]))[0] == [2, 2]  # a generator: not known
    y_ignored = y.clone()
    y_ignored[5] = -100
    assert _classifier_fit(x, y_ignored, batch_size=4)[0] == [2, 2, 2]


def test_a_batch_whose_every_target_is_ignored_is_0_after_the_targets_change_in_place():
    # The scan's verdict is kept per tensor and version: an in-place write is seen by the next fit.
    x, y = torch.randn(8, 4), torch.tensor([0, 1, 2, 1, 0, 2, 1, 0])
    assert _classifier_fit(x, y, batch_size=4)[0] == [1, 1]
    y[:4] = -100  # the first batch now counts nothing
    losses: list[float] = []

    class StepLoss(fitkit.callbacks.Callback):
        def on_backward_end(self, batch):
            losses.append(float(self.model.step_loss))

    seen, history, _ = _classifier_fit(x, y, batch_size=4, callbacks=[StepLoss()])
    assert seen == [2, 2]
    assert losses[0] == 0.0 and math.isfinite(losses[1])  # 0, not 0 / 0
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    with torch.no_grad():  # the first step leaves the weights as they were (a zero gradient)
        expected = nn.functional.cross_entropy(net(x[4:]), y[4:]).item()
    assert history.history["loss"] == [pytest.approx(expected, rel=1e-6)]


def test_targets_written_in_place_mid_epoch_by_a_callback_take_the_guarded_mean():
    # The scan vouches for the targets as they were when the epoch began: a callback that marks
    # the next batch's targets ignored mid-epoch gets the mean over what counts (was NaN: the
    # kernel's mean of a batch that counts nothing, and its size as its count; accuracy too).
    from torchmetrics.classification import MulticlassAccuracy

    x, y = torch.randn(12, 4), torch.tensor([0, 1, 2, 1, 0, 2, 1, 0, 2, 2, 1, 0])

    class Relabel(fitkit.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                y[4:8] = -100  # every target of the second batch

    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=torch.optim.SGD(net.parameters(), lr=0.0), loss="cross_entropy", metrics=["accuracy"])
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[Relabel()])
    with torch.no_grad():
        logits = net(x)
    expected = nn.functional.cross_entropy(logits, y).item()  # the 8 targets that count
    assert history.history["loss"] == [pytest.approx(expected, rel=1e-6)]
    accuracy = MulticlassAccuracy(3, average="micro", ignore_index=-100)(logits.argmax(1), y).item()
    assert history.history["accuracy"] == [accuracy]
    assert torch.isfinite(net.weight).all()


def test_test_on_batch_called_by_a_callback_during_a_fit_on_known_targets_counts_its_own_targets():
    # A fit on targets free of -100 does not vouch for the batch a callback evaluates: its
    # accuracy counts the targets that are not ignored (was: every target, 0.375 for 0.45 here).
    from torchmetrics.classification import MulticlassAccuracy

    torch.manual_seed(0)
    x, y = torch.randn(24, 6), torch.randint(0, 4, (24,))
    dirty = y.clone()
    dirty[[0, 3, 7, 20]] = -100
    seen: dict[str, dict[str, float]] = {}

    class Probe(fitkit.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                seen["test"] = self.model.test_on_batch(x, dirty)
                seen["train"] = self.model.train_on_batch(x, dirty)

    torch.manual_seed(1)
    net = nn.Linear(6, 4)
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=torch.optim.SGD(net.parameters(), lr=0.0), loss="cross_entropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0, callbacks=[Probe()])
    with torch.no_grad():
        logits = net(x)
    accuracy = MulticlassAccuracy(4, average="micro", ignore_index=-100)(logits.argmax(1), dirty).item()
    loss = nn.functional.cross_entropy(logits, dirty).item()
    for what in ("test", "train"):
        assert seen[what]["accuracy"] == accuracy
        assert seen[what]["loss"] == pytest.approx(loss, rel=1e-6)


def test_validation_inside_a_fit_on_known_targets_keeps_its_own_guard():
    # Training data free of ignored targets does not vouch for other data: validation batches
    # (a list) of which one ignores every target still report the loss over the batch that counts.
    x, y = torch.randn(8, 4), torch.tensor([0, 1, 2, 1, 0, 2, 1, 0])
    vy = torch.tensor([-100, -100, 1, 2])
    seen, history, model = _classifier_fit(
        x, y, batch_size=4, validation_data=[(x[:2], vy[:2]), (x[2:4], vy[2:])], validation_interval=1
    )
    # the validation data's first-batch check; then each of the 2 steps and the 2 validation batches after it
    assert seen == [2, 1, 2, 2, 1, 2, 2]
    with torch.no_grad():
        expected = nn.functional.cross_entropy(model.module(x[2:4]), vy[2:]).item()
    assert history.history["val_loss"] == [pytest.approx(expected, rel=1e-6)]


def test_the_ignore_index_scan_reads_the_host_once_per_tensor_and_version():
    from fitkit.losses.denominators import none_ignored
    from tests._syncs import SyncCounter

    ce = resolve_loss("cross_entropy")
    y = torch.tensor([0, 1, 2] * 1000)

    def reads(loss=ce) -> tuple[bool, int]:
        counter = SyncCounter()
        with counter:
            free = none_ignored(loss, y)
        return free, len(counter.events)

    assert reads() == (True, 1)
    assert reads() == (True, 0)  # the same tensor, not written since: not scanned again
    assert reads(resolve_loss(nn.CrossEntropyLoss(ignore_index=2))) == (False, 1)  # another ignore index
    y[7] = -100  # an in-place write moves the version counter: scanned again, and found
    assert reads() == (False, 1)
    assert reads() == (False, 0)  # each epoch and each fit asks: the verdict is kept either way


class _OwnTokenLoss(nn.Module):
    """Linear(3, 4) logits and, given ``labels``, its own cross-entropy over the labels that are not
    -100: summed over ``num_items_in_batch`` when given (the Transformers convention), else its mean."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.linear = nn.Linear(3, 4)

    def forward(self, x, labels=None, num_items_in_batch=None):
        logits = self.linear(x)
        if num_items_in_batch is None:
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}
        return {
            "loss": nn.functional.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch,
            "logits": logits,
        }


def _own_token_loss_fits(labels: torch.Tensor):
    """A hand loop and ``fit`` on 6 rows in batches of 2, SGD: ``(hand module, fitted module,
    the hand's epoch loss weighed by label tokens, fit's History)``. A batch without a counted
    label adds nothing to the hand's mean."""
    x = torch.randn(6, 3)
    hand = _OwnTokenLoss()
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    total, tokens = 0.0, 0
    for i in range(0, 6, 2):
        out = hand(x[i : i + 2], labels[i : i + 2])
        n = int((labels[i : i + 2] != -100).sum())
        if n:
            total, tokens = total + out["loss"].item() * n, tokens + n
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    net = _OwnTokenLoss()
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=None)
    history = model.fit({"x": x, "labels": labels}, batch_size=2, epochs=1, shuffle=False, verbose=0)
    return hand, net, total / tokens, history


def test_a_modules_own_token_loss_weighs_its_batches_by_label_tokens_on_one_process():
    # Batches of 2 rows holding 2, 1 and 0 + 2 counted labels: the epoch loss is the mean over the
    # 5 counted labels, as under accumulation or torchrun (it was the mean of the 3 batch means);
    # each step still takes the module's own mean (no num_items_in_batch passed), as a hand loop.
    hand, net, expected, history = _own_token_loss_fits(torch.tensor([1, 2, 3, -100, 0, 2]))
    for a, b in zip(net.parameters(), hand.parameters(), strict=True):
        assert torch.equal(a, b)  # the module's own mean each step: bitwise the hand loop
    assert history.history["loss"] == [pytest.approx(expected, rel=1e-6)]


def test_a_batch_of_a_modules_own_token_loss_whose_every_label_is_ignored_adds_nothing_to_the_epoch_loss():
    # The module's own mean of a batch without a label that counts is 0 / 0 (NaN); weighed by its
    # 0 label tokens it adds nothing, as under accumulation (was: a NaN epoch loss on one process).
    hand, net, expected, history = _own_token_loss_fits(torch.tensor([1, 2, -100, -100, 0, 3]))
    for a, b in zip(net.parameters(), hand.parameters(), strict=True):
        assert torch.equal(a, b)
    assert history.history["loss"] == [pytest.approx(expected, rel=1e-6)]


class _MaskingModel(fitkit.Model):
    """A ``compute_loss`` that makes its own targets from ``y``: -100 where ``x[:, 0] > 0``."""

    def compute_loss(self, x, y, y_pred, sample_weight=None):
        return super().compute_loss(x, y.masked_fill(x[:, 0] > 0, -100), y_pred, sample_weight)


def test_an_overridden_compute_loss_that_ignores_targets_of_known_clean_data_keeps_the_guard():
    # y holds no -100, but compute_loss makes targets that do: a batch of them all ignored is 0,
    # not the kernel's 0 / 0 (was NaN in fit and evaluate: the scan vouched for y, not for these).
    torch.manual_seed(0)
    x, y = torch.randn(12, 4), torch.tensor([0, 1, 2, 1, 0, 2, 1, 0, 2, 2, 1, 0])
    x[:4, 0], x[4:, 0] = 1.0, -x[4:, 0].abs()  # the first batch: every target ignored
    x[[5, 9], 0] = 1.0
    step_losses: list[float] = []

    class StepLoss(fitkit.callbacks.Callback):
        def on_backward_end(self, batch):
            step_losses.append(float(self.model.step_loss))

    torch.manual_seed(1)
    net = nn.Linear(4, 3)
    model = _MaskingModel(net, device="cpu")
    model.compile(optimizer=torch.optim.SGD(net.parameters(), lr=0.0), loss="cross_entropy")
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[StepLoss()])
    masked = y.masked_fill(x[:, 0] > 0, -100)
    with torch.no_grad():
        logits = net(x)
        means = [0.0] + [nn.functional.cross_entropy(logits[i : i + 4], masked[i : i + 4]).item() for i in (4, 8)]
    assert step_losses == [0.0, pytest.approx(means[1], rel=1e-6), pytest.approx(means[2], rel=1e-6)]
    # the epoch and evaluate weigh each batch by the terms of its y (4 rows each, none -100)
    assert history.history["loss"] == [pytest.approx(sum(means) / 3, rel=1e-6)]
    evaluated = model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
    assert evaluated["loss"] == pytest.approx(sum(means) / 3, rel=1e-6)
