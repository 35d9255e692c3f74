"""Loss terms: a loss callable that returns a dict or a tuple of 0-dim terms.

The total (the dict's ``"loss"``, else the sum of the terms) is optimised; every term is logged as
``loss_<name>`` (``val_loss_<name>``, ``evaluate``'s ``loss_<name>``), its epoch mean weighted as
the loss's. Every value here is checked against a hand-written torch loop.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import fitkit
from fitkit import callbacks as cb
from fitkit.callbacks.monitor import resolve_mode

ROWS, VAL_ROWS, BATCH, LR = 11, 5, 3, 0.1


def _data():
    g = torch.Generator().manual_seed(3)
    x, xv = torch.randn(ROWS, 3, generator=g), torch.randn(VAL_ROWS, 3, generator=g)
    w = torch.tensor([[1.0], [-2.0], [0.5]])
    return x, x @ w + 0.3, xv, xv @ w - 0.2


def _net() -> nn.Linear:
    g = torch.Generator().manual_seed(7)
    net = nn.Linear(3, 1)
    with torch.no_grad():
        net.weight.copy_(torch.randn(1, 3, generator=g))
        net.bias.copy_(torch.randn(1, generator=g))
    return net


def _terms(form: str, out: torch.Tensor, y: torch.Tensor, weight: torch.Tensor):
    """What the loss callable of ``form`` returns: an MSE and an L1 penalty on the weights."""
    mse, l1 = F.mse_loss(out, y), weight.abs().sum()
    if form == "sum":
        return {"mse": mse, "l1": 0.1 * l1}
    if form == "total key":  # the total is given; the terms are logged as returned (l1 unscaled)
        return {"loss": mse + 0.1 * l1, "mse": mse, "l1": l1}
    return (mse, 0.1 * l1)


#: form -> (the logged term keys, the total the hand loop optimises from the returned value)
FORMS = {
    "sum": (["loss_mse", "loss_l1"], lambda t: t["mse"] + t["l1"]),
    "total key": (["loss_mse", "loss_l1"], lambda t: t["loss"]),
    "tuple": (["loss_0", "loss_1"], lambda t: t[0] + t[1]),
}


def _values(form: str, returned) -> list[torch.Tensor]:
    """The logged terms' values in their order."""
    if form == "tuple":
        return list(returned)
    return [returned[k] for k in ("mse", "l1")]


def _batches(n: int) -> list[slice]:
    return [slice(i, min(i + BATCH, n)) for i in range(0, n, BATCH)]


def _hand_means(form: str, net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """The loss and each term over ``x`` in batches of 3, weighted by rows (no step)."""
    sums = [0.0, 0.0, 0.0]
    with torch.no_grad():
        for s in _batches(len(x)):
            returned = _terms(form, net(x[s]), y[s], net.weight)
            values = [FORMS[form][1](returned), *_values(form, returned)]
            sums = [acc + float(v) * len(x[s]) for acc, v in zip(sums, values, strict=True)]
    return [v / len(x) for v in sums]


def _hand_fit(form: str, accumulation: int, epochs: int = 2):
    """SGD with windows of ``accumulation`` batches of 3 rows (the last window short), each
    micro-batch's total scaled by its share of the window's rows; epoch means weighted by rows."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x, y, xv, yv = _data()
    batches = _batches(ROWS)
    keys = FORMS[form][0]
    history: dict[str, list[float]] = {k: [] for k in ["loss", *keys, "val_loss", *("val_" + k for k in keys)]}
    for _ in range(epochs):
        sums = [0.0, 0.0, 0.0]
        for w in range(0, len(batches), accumulation):
            window = batches[w : w + accumulation]
            rows = sum(len(x[s]) for s in window)
            opt.zero_grad()
            for s in window:
                returned = _terms(form, net(x[s]), y[s], net.weight)
                total = FORMS[form][1](returned)
                (total * (len(x[s]) / rows)).backward()
                values = [total, *_values(form, returned)]
                sums = [acc + float(v.detach()) * len(x[s]) for acc, v in zip(sums, values, strict=True)]
            opt.step()
        for k, v in zip(["loss", *keys], sums, strict=True):
            history[k].append(v / ROWS)
        for k, v in zip(["loss", *keys], _hand_means(form, net, xv, yv), strict=True):
            history["val_" + k].append(v)
    return net, history


def _model(form: str, accumulation: int = 1, **compile_kwargs) -> fitkit.Model:
    net = _net()
    model = fitkit.Model(net, device="cpu")
    compile_kwargs.setdefault("loss", lambda out, y: _terms(form, out, y, net.weight))
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=LR), gradient_accumulation_steps=accumulation, **compile_kwargs
    )
    return model


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("form", list(FORMS))
def test_the_total_trains_and_every_term_logs_its_epoch_mean_as_the_hand_loop(form, accumulation):
    x, y, xv, yv = _data()
    model = _model(form, accumulation)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, validation_data=(xv, yv))
    net, hand = _hand_fit(form, accumulation)
    assert model.global_step == 2 * (2 if accumulation == 3 else 4)  # windows of 9 + 2 rows, or 4 batches
    for mine, theirs in zip(model.module.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=0, atol=0)
    logged = {k: v for k, v in history.history.items() if k != "learning_rate"}
    assert list(logged) == list(hand)  # the terms right after their loss, in the order returned
    for key in hand:
        torch.testing.assert_close(logged[key], hand[key], rtol=0, atol=0, msg=key)
    # evaluate returns the terms of the trained weights, in batches of 3 as the hand means
    expected = dict(zip(["loss", *FORMS[form][0]], _hand_means(form, net, xv, yv), strict=True))
    got = model.evaluate(xv, yv, batch_size=BATCH, verbose=0)
    assert list(got) == list(expected)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_batch_calls_return_the_terms_of_their_batch():
    x, y, _, _ = _data()
    model, net = _model("sum"), _net()
    with torch.no_grad():
        mse, l1 = F.mse_loss(net(x[:3]), y[:3]), 0.1 * net.weight.abs().sum()
    expected = {"loss": float(mse + l1), "loss_mse": float(mse), "loss_l1": float(l1)}
    assert model.test_on_batch(x[:3], y[:3]) == expected
    assert model.test_on_batch(x[:3], y[:3], return_dict=False) == list(expected.values())
    assert model.train_on_batch(x[:3], y[:3]) == expected  # the values before the step
    # loss_weights scales the total alone: the terms are logged as the callable returns them
    weighted = _model("sum", loss_weights=0.5)
    assert weighted.test_on_batch(x[:3], y[:3]) == {**expected, "loss": float((mse + l1) * 0.5)}


def test_the_progress_bar_and_the_csv_log_show_every_term(tmp_path):
    x, y, xv, yv = _data()
    out = io.StringIO()
    bar = cb.ProgressBar(2, console=Console(file=out, width=300))
    model = _model("sum")
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=2,
        validation_data=(xv, yv),
        callbacks=[bar, cb.CSVLogger(tmp_path / "log.csv")],
    )
    lines = out.getvalue().splitlines()
    for epoch in range(2):
        line = next(line for line in lines if line.startswith(f"Epoch {epoch + 1}/2"))
        for key in ("loss_mse", "loss_l1", "val_loss_mse", "val_loss_l1"):
            assert f" {key}: {history.history[key][epoch]:.4f}" in line, (key, line)
    rows = (tmp_path / "log.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert {"loss_mse", "loss_l1", "val_loss_mse", "val_loss_l1"} <= set(header)
    for epoch, row in enumerate(rows[1:]):
        cells = dict(zip(header, row.split(","), strict=True))
        for key in ("loss_mse", "loss_l1", "val_loss_mse", "val_loss_l1"):
            assert float(cells[key]) == history.history[key][epoch]


def test_tensorboard_writes_every_term_of_training_and_validation(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y, xv, yv = _data()
    history = _model("tuple").fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(xv, yv),
        callbacks=[cb.TensorBoard(tmp_path / "tb")],
    )
    for run, prefix in (("train", ""), ("validation", "val_")):
        events = EventAccumulator(str(tmp_path / "tb" / run))
        events.Reload()
        for term in ("loss_0", "loss_1"):  # a tuple's terms
            stored = [e.value for e in events.Scalars(f"epoch_{term}")]
            assert stored == [float(torch.tensor(v, dtype=torch.float32)) for v in history.history[prefix + term]]


class _Crash(Exception):
    pass


def test_a_backup_inside_an_epoch_resumes_the_terms_exactly(tmp_path):
    x, y, xv, yv = _data()
    reference = _model("sum").fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, validation_data=(xv, yv))

    def run(crash: bool):
        model = _model("sum")

        def crash_at_step_2(batch, logs):
            if crash and model.global_step == 2:  # inside epoch 0 (4 batches)
                raise _Crash

        callbacks = [
            cb.BackupAndRestore(tmp_path / "backup", save_freq=1),
            cb.LambdaCallback(on_train_batch_end=crash_at_step_2),
        ]
        return model.fit(
            x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, validation_data=(xv, yv), callbacks=callbacks
        )

    with pytest.raises(_Crash):
        run(crash=True)
    backup = torch.load(tmp_path / "backup" / "backup.pt", weights_only=True)
    assert (backup["epoch"], backup["step_in_epoch"]) == (0, 1)  # a backup inside epoch 0: the resume goes on there
    assert backup["trackers"]["terms"]["names"] == ["mse", "l1"]
    resumed = run(crash=False)
    assert resumed.history == reference.history


def _bad_loss(case: str):
    def loss(out, y):
        mse = F.mse_loss(out, y)
        return {
            "python number": lambda: {"mse": mse, "l1": 0.5},
            "per-sample term": lambda: {"mse": F.mse_loss(out, y, reduction="none")},
            "integer term": lambda: {"mse": mse, "count": torch.tensor(3)},
            "key not a string": lambda: {0: mse},
            "name with a space": lambda: {"my term": mse},
            "empty dict": lambda: {},
            "empty tuple": lambda: (),
            "a string": lambda: "mse",
        }[case]()

    return loss


#: case -> (compile options, fit options, error, match)
ERRORS = {
    "python number": ({}, {}, TypeError, r"every term of the loss 'loss' to be a 0-dim tensor\. Received: l1=0\.5"),
    "per-sample term": ({}, {}, ValueError, r"0-dim floating tensor .*Received: mse of shape \(3, 1\)"),
    "integer term": (
        {},
        {},
        ValueError,
        r"0-dim floating tensor .*Received: count of shape \(\) and dtype torch\.int64",
    ),
    "key not a string": ({}, {}, TypeError, r"keys of the dict .* to be strings .*Received: key 0 of type int"),
    "name with a space": ({}, {}, ValueError, r"letters, digits, '_', '\.' or '-' .*Received: 'my term'"),
    "empty dict": ({}, {}, ValueError, r"at least one term\. Received: an empty dict"),
    "empty tuple": ({}, {}, ValueError, r"at least one term\. Received: an empty tuple"),
    "a string": ({}, {}, TypeError, r"return a tensor, a dict of 0-dim tensors or a tuple of them\. Received: str"),
    "metric name clash": (
        {"loss": "sum", "metrics": {"loss_l1": "mae"}},
        {},
        ValueError,
        r"log under different names\. Received: terms logged as \['loss_l1'\]",
    ),
    "sample weights": ({"loss": "sum"}, {"sample_weight": torch.ones(ROWS)}, ValueError, r"returned terms, one 0-dim"),
    "class weights": (
        {"loss": "sum"},
        {"y": torch.arange(ROWS).remainder(2).float().unsqueeze(1), "class_weight": {0: 1.0, 1: 2.0}},
        ValueError,
        r"returned terms, one 0-dim",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_a_loss_of_terms_that_cannot_be_logged_is_refused_before_the_first_step(case, tmp_path):
    compile_kwargs, fit_kwargs, error, match = ERRORS[case]
    compile_kwargs = dict(compile_kwargs)
    form = compile_kwargs.pop("loss", None)
    model = _model(form, **compile_kwargs) if form else _model("sum", loss=_bad_loss(case), **compile_kwargs)
    before = [p.detach().clone() for p in model.module.parameters()]
    x, y, _, _ = _data()
    y = fit_kwargs.pop("y", y) if fit_kwargs else y
    with pytest.raises(error, match=match):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, **fit_kwargs)
    assert model.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))


def test_several_losses_refuse_an_output_loss_that_returns_terms():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, x):
            out = self.net(x)
            return out, 2 * out

    model = fitkit.Model(TwoHeads(), device="cpu")
    model.compile(optimizer="sgd", loss=[lambda out, y: {"mse": F.mse_loss(out, y)}, "mse"])
    before = [p.detach().clone() for p in model.module.parameters()]
    x, y, _, _ = _data()
    with pytest.raises(ValueError, match=r"The loss of output 0 returned terms .*Fix: return one tensor"):
        model.fit(x, (y, y), batch_size=BATCH, verbose=0)
    assert model.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))


def test_terms_that_change_between_batches_are_an_error_naming_both():
    def loss(out, y):
        mse = F.mse_loss(out, y)
        return {"mse": mse} if len(out) == BATCH else {"mse": mse, "extra": mse}  # the short last batch differs

    model = _model("sum", loss=loss)
    x, y, _, _ = _data()
    with pytest.raises(ValueError, match=r"same terms at every batch\. Received: \['mse', 'extra'\] after \['mse'\]"):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


#: form of the loss -> the callable, times ``scale[0]`` (a plain tensor loss is the reference)
NAN_FORMS = {
    "tensor": lambda out, y, k: F.mse_loss(out, y) * k,
    "sum": lambda out, y, k: {"mse": F.mse_loss(out, y) * k, "mean": out.mean()},
    "total key": lambda out, y, k: {"loss": F.mse_loss(out, y) * k, "mse": F.mse_loss(out, y)},
    "tuple": lambda out, y, k: (F.mse_loss(out, y) * k, out.mean()),
}


@pytest.mark.parametrize("form", list(NAN_FORMS))
def test_non_finite_values_are_handled_as_for_a_tensor_loss(form):
    x, y, _, _ = _data()
    scale = [1.0]
    x_nan = x.clone()
    x_nan[4, 1] = float("nan")
    model = _model("sum", loss=lambda out, y: NAN_FORMS[form](out, y, scale[0]))
    before = [p.detach().clone() for p in model.module.parameters()]
    with pytest.raises(
        ValueError,
        match=r"`x` holds 1 NaN or infinite values \(first at row 4\)\. .*"
        r"the loss of the rows holding them \(\[4\]\.\.\.\) is not finite",
    ):
        model.fit(x_nan, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))

    # a total that turns infinite at the third batch: TerminateOnNaN stops before its step
    def turn_infinite(batch, logs):
        if model.global_step == 2:
            scale[0] = float("inf")

    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[cb.LambdaCallback(on_train_batch_end=turn_infinite), cb.TerminateOnNaN()],
    )
    assert model.global_step == 2
    reference = _model("sum", loss=lambda out, y: NAN_FORMS[form](out, y, 1.0))
    reference.fit(x[:6], y[:6], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # the two steps taken
    for mine, theirs in zip(model.module.parameters(), reference.module.parameters(), strict=True):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=0, atol=0)


class _TinyVAE(nn.Module):
    """A deterministic VAE-like module: ``(recon, mu, logvar)`` (a plain tuple reaches the loss whole)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.enc, self.dec = nn.Linear(3, 4), nn.Linear(2, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, dim=1)
        return self.dec(mu), mu, logvar


def _vae_terms(out, y):
    recon, mu, logvar = out
    kl = -0.5 * (1 + logvar - mu.square() - logvar.exp()).sum(1).mean()
    return {"recon": F.mse_loss(recon, y), "kl": kl}


def test_a_vae_trains_on_recon_plus_kl_and_logs_both_as_the_hand_loop():
    x, _, _, _ = _data()
    model = fitkit.Model(_TinyVAE(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.01), loss=_vae_terms, gradient_accumulation_steps=3)
    history = model.fit(x, x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    hand = _TinyVAE()
    opt = torch.optim.SGD(hand.parameters(), lr=0.01)
    sums = {"loss": 0.0, "loss_recon": 0.0, "loss_kl": 0.0}
    for window in ([slice(0, 3), slice(3, 6), slice(6, 9)], [slice(9, 11)]):
        rows = sum(len(x[s]) for s in window)
        opt.zero_grad()
        for s in window:
            terms = _vae_terms(hand(x[s]), x[s])
            total = terms["recon"] + terms["kl"]
            (total * (len(x[s]) / rows)).backward()
            for key, value in (("loss", total), ("loss_recon", terms["recon"]), ("loss_kl", terms["kl"])):
                sums[key] += float(value.detach()) * len(x[s])
        opt.step()
    assert history.history == {k: [v / ROWS] for k, v in sums.items()} | {"learning_rate": [0.01]}
    for mine, theirs in zip(model.module.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=0, atol=0)


def test_callbacks_monitor_a_term_and_the_csv_log_keeps_its_column_on_epochs_without_validation(tmp_path):
    x, y, xv, yv = _data()
    model = _model("sum")
    stop = cb.EarlyStopping(monitor="val_loss_l1", patience=0)  # mode "auto": a term is minimised
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=6,
        shuffle=False,
        verbose=0,
        validation_data=(xv, yv),
        validation_freq=2,
        callbacks=[stop, cb.CSVLogger(tmp_path / "log.csv")],
    )
    # the hand loop's penalty 0.1 * |w|_1 after each epoch: the first rise of it ends the run
    _, hand = _hand_fit("sum", 1, epochs=6)
    l1 = hand["val_loss_l1"]
    validated = [1, 3, 5]
    first_rise = next(e for a, e in zip(validated, validated[1:], strict=False) if l1[e] >= l1[a])
    assert resolve_mode("val_loss_l1", "auto") == resolve_mode("val_ones_loss_l1", "auto") == "min"
    assert history.epoch == list(range(first_rise + 1))
    assert history.history["val_loss_l1"] == [l1[e] for e in validated if e <= first_rise]
    rows = [row.split(",") for row in (tmp_path / "log.csv").read_text().splitlines()]
    column = rows[0].index("val_loss_l1")
    assert [row[column] for row in rows[1:]] == [
        "NA" if e not in validated else repr(l1[e]) for e in range(first_rise + 1)
    ]


def test_a_term_key_is_refused_before_the_first_step_unless_the_loss_is_a_callable():
    x, y, _, _ = _data()
    model = fitkit.Model(_net(), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"EarlyStopping monitors 'loss_mse', which the logs will not hold"):
        model.fit(x, y, verbose=0, callbacks=[cb.EarlyStopping(monitor="loss_mse")])
    assert model.global_step == 0
    # a callable may return terms: a key it does not return is refused at the first decision
    model = _model("sum")
    with pytest.raises(ValueError, match=r"monitors 'loss_kl', which the logs do not hold\. Available keys: .*loss_l1"):
        model.fit(x, y, verbose=0, callbacks=[cb.EarlyStopping(monitor="loss_kl")])


def test_several_validation_sets_log_each_sets_terms():
    net = nn.Linear(1, 1)
    nn.init.constant_(net.weight, 2.0), nn.init.zeros_(net.bias)  # predictions 2x; SGD at lr 0 keeps them
    model = fitkit.Model(net, device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
        loss=lambda out, y: {"mse": F.mse_loss(out, y), "pen": 0.5 * net.weight.square().sum()},
    )
    x = torch.tensor([[1.0], [2.0], [3.0]])
    sets = {"a": (x, x), "b": (x, 2 * x)}
    history = model.fit(x, torch.zeros(3, 1), verbose=0, validation_data=sets)
    mse_zero, mse_a = float(torch.tensor([4.0, 16.0, 36.0]).mean()), float(torch.tensor([1.0, 4.0, 9.0]).mean())
    a = {"loss": float(torch.tensor(mse_a) + 2.0), "loss_mse": mse_a, "loss_pen": 2.0}
    b = {"loss": 2.0, "loss_mse": 0.0, "loss_pen": 2.0}
    assert history.history == {
        "loss": [float(torch.tensor(mse_zero) + 2.0)],
        "loss_mse": [mse_zero],
        "loss_pen": [2.0],
        "learning_rate": [0.0],
        **{f"val_{k}": [v] for k, v in a.items()},  # the first set is also the plain val_ keys
        **{f"val_a_{k}": [v] for k, v in a.items()},
        **{f"val_b_{k}": [v] for k, v in b.items()},
    }
    assert model.evaluate(sets, verbose=0) == {
        **{f"a_{k}": v for k, v in a.items()},
        **{f"b_{k}": v for k, v in b.items()},
    }
