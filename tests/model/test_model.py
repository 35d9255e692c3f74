"""Model end to end: parity with a hand loop, seed scenarios, predict order, History, summary."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_model, fixed_linear, fixed_mlp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit

# -- parity with a hand-written loop ----------------------------------------------------------

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    "adam": functools.partial(torch.optim.Adam, lr=0.01),
}


def _hand_loop(net, make_opt, x, y, batch_size, epochs, loss_fn=F.mse_loss):
    """What a careful user writes: one randperm per epoch, slices, zero_grad/backward/step."""
    opt = make_opt(net.parameters())
    net.train()
    epoch_losses = []
    for _ in range(epochs):
        perm = torch.randperm(len(x))
        total = 0.0
        for i in range(0, len(x), batch_size):
            idx = perm[i : i + batch_size]
            loss = loss_fn(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        epoch_losses.append(total / len(x))
    return epoch_losses


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_fit_matches_hand_loop_five_steps(opt_name):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(18, 3, generator=g), torch.randn(18, 1, generator=g)  # 5 steps, last one short
    base = fixed_mlp(3, 8, 1, dropout=0.3)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)

    torch.manual_seed(7)
    model = cpu_model(ours)
    model.compile(OPTIMIZERS[opt_name], "mse")
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=True, verbose=0)

    torch.manual_seed(7)
    hand_losses = _hand_loop(theirs, OPTIMIZERS[opt_name], x, y, batch_size=4, epochs=1)

    assert model.global_step == 5
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)
    assert history.history["loss"] == pytest.approx(hand_losses, rel=1e-6)


def test_fit_matches_hand_loop_over_epochs_with_dataloader():
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(24, 3, generator=g), torch.randn(24, 1, generator=g)
    base = fixed_mlp(3, 8, 1, dropout=0.2)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    make_opt = OPTIMIZERS["adam"]

    torch.manual_seed(11)
    model = cpu_model(ours)
    model.compile(make_opt, "mse")
    model.fit(DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True), epochs=3, verbose=0)

    torch.manual_seed(11)
    opt = make_opt(theirs.parameters())
    theirs.train()
    loader = DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True)
    for _ in range(3):
        for xb, yb in loader:
            loss = F.mse_loss(theirs(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)


# -- seed scenarios ---------------------------------------------------------------------------


def test_linear_regression_recovers_weight_and_bias():
    x = torch.rand(512, 1) * 4 - 2
    y = 3 * x + 2 + 0.1 * torch.randn(512, 1)
    model = cpu_model(nn.Linear(1, 1))
    model.compile(functools.partial(torch.optim.SGD, lr=0.1), "mse")
    model.fit(x, y, batch_size=32, epochs=15, verbose=0)
    assert model.module.weight.item() == pytest.approx(3.0, abs=0.1)
    assert model.module.bias.item() == pytest.approx(2.0, abs=0.1)


def _blobs(n: int, g: torch.Generator):
    y = torch.randint(0, 2, (n,), generator=g).float()
    x = torch.randn(n, 2, generator=g) + (2 * y - 1).unsqueeze(1)  # centres (-1, -1) and (1, 1)
    return x, y


def _classifier():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))


def test_binary_classifier_matches_hand_loop_accuracy():
    g = torch.Generator().manual_seed(0)
    x_train, y_train = _blobs(400, g)
    x_test, y_test = _blobs(200, g)
    make_opt = functools.partial(torch.optim.Adam, lr=1e-2)

    torch.manual_seed(1)
    model = cpu_model(_classifier())
    model.compile(make_opt, "bce_with_logits", metrics=["accuracy"])
    model.fit(DataLoader(TensorDataset(x_train, y_train), batch_size=32, shuffle=True), epochs=5, verbose=0)
    ours = model.evaluate(x_test, y_test, verbose=0)["accuracy"]

    torch.manual_seed(1)
    net = _classifier()
    opt = make_opt(net.parameters())
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=32, shuffle=True)
    for _ in range(5):
        net.train()
        for xb, yb in loader:
            loss = F.binary_cross_entropy_with_logits(net(xb).squeeze(1), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    net.eval()
    with torch.no_grad():
        theirs = ((net(x_test).squeeze(1) > 0).float() == y_test).float().mean().item()

    assert theirs > 0.8  # the scenario is learnable at all
    assert ours == pytest.approx(theirs, abs=0.02)
    # predict gives the same decisions as evaluate counted
    decisions = (model.predict(x_test, verbose=0).squeeze(1) > 0).float()
    assert (decisions == y_test).float().mean().item() == pytest.approx(ours, abs=1e-6)


# -- class label dtypes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "convert",
    [
        lambda y: y.int(),
        lambda y: y.short(),
        lambda y: y.numpy().astype(np.int32),
        lambda y: y.numpy(),  # numpy int64
    ],
    ids=["int32", "int16", "numpy-int32", "numpy-int64"],
)
def test_integer_labels_train_exactly_like_int64(convert):
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(30, 3, generator=g), torch.randint(0, 4, (30,), generator=g)
    runs = []
    for labels in (y, convert(y)):
        torch.manual_seed(0)
        model = cpu_model(fixed_mlp(3, 8, 4, dropout=0.1))
        model.compile(functools.partial(torch.optim.SGD, lr=0.5), "cross_entropy", metrics=["accuracy"])
        history = model.fit(x, labels, batch_size=8, epochs=2, verbose=0, class_weight={0: 1, 1: 2, 2: 1, 3: 0.5})
        runs.append(([p.detach().clone() for p in model.module.parameters()], history.history))
    (w64, h64), (w, h) = runs
    assert all(torch.equal(a, b) for a, b in zip(w64, w, strict=True))
    assert h == h64


# -- predict ----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 3, 4, 10])
def test_predict_returns_every_row_in_input_order_after_shuffled_fit(batch_size):
    x = torch.arange(10.0).unsqueeze(1).repeat(1, 3)  # distinct rows
    y = torch.randn(10, 2)
    model = cpu_model(fixed_mlp(3, 8, 2, dropout=0.5))
    model.compile(functools.partial(torch.optim.SGD, lr=0.01), "mse")
    model.fit(x, y, batch_size=3, epochs=2, shuffle=True, verbose=0)
    out = model.predict(x, batch_size=batch_size, verbose=0)
    model.module.eval()
    with torch.no_grad():
        expected = model.module(x)
    assert out.shape == (10, 2)
    assert out.device.type == "cpu"
    assert torch.allclose(out, expected, atol=1e-6)


class TwoHeads(nn.Module):
    def __init__(self, as_dict: bool):
        super().__init__()
        self.lin = fixed_linear(2, 1, weight=1.0, bias=0.0)
        self.as_dict = as_dict

    def forward(self, x):
        a = self.lin(x)
        return {"sum": a, "double": 2 * a} if self.as_dict else (a, 2 * a)


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_predict_keeps_output_structure(as_dict):
    x = torch.arange(14.0).reshape(7, 2)
    out = cpu_model(TwoHeads(as_dict)).predict(x, batch_size=3, verbose=0)
    expected = x.sum(1, keepdim=True)
    if as_dict:
        assert set(out) == {"sum", "double"}
        first, second = out["sum"], out["double"]
    else:
        assert isinstance(out, tuple) and len(out) == 2
        first, second = out
    assert torch.equal(first, expected)
    assert torch.equal(second, 2 * expected)


def test_predict_accepts_x_y_batches_and_ignores_y():
    x, y = torch.arange(12.0).reshape(6, 2), torch.full((6,), 99.0)
    model = cpu_model(fixed_linear(2, 1, weight=1.0))
    expected = x.sum(1, keepdim=True)
    from_loader = model.predict(DataLoader(TensorDataset(x, y), batch_size=4), verbose=0)
    from_list = model.predict([(x[:4], y[:4]), (x[4:], y[4:])], verbose=0)
    from_dataset = model.predict(TensorDataset(x, y), batch_size=5, verbose=0)
    for out in (from_loader, from_list, from_dataset):
        assert torch.equal(out, expected)


def test_predict_needs_no_compile_and_on_batch_helpers():
    model = cpu_model(fixed_linear(2, 1, weight=1.0, bias=1.0))
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert model.predict(x, verbose=0).tolist() == [[4.0], [8.0]]
    assert model.predict_on_batch(x).tolist() == [[4.0], [8.0]]
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), "mse")
    assert model.test_on_batch(x, torch.tensor([4.0, 6.0])) == {"loss": 2.0}  # (0 + 4) / 2
    logs = model.train_on_batch(x, torch.tensor([4.0, 6.0]))
    assert logs == {"loss": 2.0} and isinstance(logs["loss"], float)


@pytest.mark.parametrize("method", ["train_on_batch", "test_on_batch"])
def test_on_batch_return_dict_false_gives_keras_scalar_or_list(method):
    """Keras' return_dict=False: the loss alone without metrics, else [loss, *metrics] in the logs' order."""
    x, y = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[4.0], [6.0]])  # predictions 4, 8
    model = cpu_model(fixed_linear(2, 1, weight=1.0, bias=1.0))
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), "mse")
    out = getattr(model, method)(x, y, return_dict=False)
    assert out == 2.0 and isinstance(out, float)  # (0 + 4) / 2
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), "mse", metrics=["mae", "rmse"])
    rmse = torch.tensor(2.0).sqrt().item()  # sqrt((0 + 4) / 2) in float32
    assert getattr(model, method)(x, y, return_dict=False) == [2.0, 1.0, rmse]
    assert getattr(model, method)(x, y) == {"loss": 2.0, "mae": 1.0, "rmse": rmse}  # the default: the dict
    before = model.module.weight.detach().clone()
    with pytest.raises(TypeError, match=r"Expected `return_dict` to be a bool\. Received: return_dict='no'\."):
        getattr(model, method)(x, y, return_dict="no")
    assert torch.equal(model.module.weight, before)


# -- History ----------------------------------------------------------------------------------


def _regression(n=12):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g)


def test_history_holds_python_floats_including_learning_rate():
    x, y = _regression()
    model = cpu_model(nn.Linear(2, 1))
    model.compile(functools.partial(torch.optim.SGD, lr=0.05), "mse", metrics=["mae"])
    history = model.fit(x, y, epochs=3, batch_size=4, validation_split=0.25, verbose=0)
    assert history is model.history
    assert set(history.history) == {"loss", "mae", "learning_rate", "val_loss", "val_mae"}
    for key, values in history.history.items():
        assert len(values) == 3, key
        assert all(type(v) is float for v in values), key
    assert history.history["learning_rate"] == [0.05, 0.05, 0.05]
    assert history.epoch == [0, 1, 2]
    assert {k: history.params[k] for k in ("verbose", "epochs", "steps")} == {"verbose": 0, "epochs": 3, "steps": 3}


def test_logged_learning_rate_is_the_one_used_that_epoch():
    x, y = _regression()
    seen = []

    class RecordLR(fitkit.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(self.model.optimizer.param_groups[0]["lr"])

    model = cpu_model(nn.Linear(2, 1))
    model.compile(
        functools.partial(torch.optim.SGD, lr=1.0),
        "mse",
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    )
    history = model.fit(x, y, epochs=3, batch_size=6, callbacks=[RecordLR()], verbose=0)
    assert seen == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    assert history.history["learning_rate"] == [1.0, 0.5, 0.25]
    assert model.optimizer.param_groups[0]["lr"] == 0.125


def test_reduce_lr_on_plateau_steps_on_val_loss():
    got = []

    class Recording(torch.optim.lr_scheduler.ReduceLROnPlateau):
        def step(self, metrics, *args, **kwargs):
            got.append(metrics)
            return super().step(metrics, *args, **kwargs)

    x, y = _regression(20)
    model = cpu_model(nn.Linear(2, 1))
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), "mse", scheduler=lambda o: Recording(o, patience=0))
    history = model.fit(x, y, epochs=3, batch_size=4, validation_split=0.2, verbose=0)
    assert got == history.history["val_loss"]
    assert got != history.history["loss"]


def test_reduce_lr_on_plateau_without_validation_steps_on_loss():
    got = []

    class Recording(torch.optim.lr_scheduler.ReduceLROnPlateau):
        def step(self, metrics, *args, **kwargs):
            got.append(metrics)
            return super().step(metrics, *args, **kwargs)

    x, y = _regression(8)
    model = cpu_model(nn.Linear(2, 1))
    model.compile(functools.partial(torch.optim.SGD, lr=1e-3), "mse", scheduler=lambda o: Recording(o, patience=0))
    history = model.fit(x, y, epochs=2, batch_size=4, verbose=0)
    assert got == history.history["loss"]


def test_step_interval_steps_once_per_optimizer_step():
    x, y = _regression(10)  # 3 batches of 4, 4, 2
    model = cpu_model(nn.Linear(2, 1))
    model.compile(
        functools.partial(torch.optim.SGD, lr=1.0),
        "mse",
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        scheduler_interval="step",
    )
    history = model.fit(x, y, epochs=2, batch_size=4, verbose=0)
    assert model.scheduler.last_epoch == 6
    assert model.optimizer.param_groups[0]["lr"] == 0.5**6
    # the LR of the epoch's last optimizer step
    assert history.history["learning_rate"] == [0.5**2, 0.5**5]


def test_epochs_is_the_last_epoch_index():
    x, y = _regression()
    seen = []

    class Epochs(fitkit.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append(epoch)

    model = cpu_model(nn.Linear(2, 1))
    model.compile("sgd", "mse")
    history = model.fit(x, y, initial_epoch=2, epochs=5, callbacks=[Epochs()], verbose=0)
    assert seen == [2, 3, 4]
    assert history.epoch == [2, 3, 4]
    assert len(history.history["loss"]) == 3
    before = [p.detach().clone() for p in model.module.parameters()]
    with pytest.warns(fitkit.FitkitWarning, match="initial_epoch=5 >= epochs=5: nothing will train"):
        history = model.fit(x, y, initial_epoch=5, epochs=5, verbose=0)
    assert history.epoch == [] and history.history == {}
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))


# -- no graph kept alive ----------------------------------------------------------------------


class BatchLogReader(fitkit.Callback):
    def __init__(self):
        super().__init__()
        self.train, self.test = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.train.append(dict(logs))

    def on_test_batch_end(self, batch, logs=None):
        self.test.append(dict(logs))


def test_batch_logs_are_detached_0dim_tensors_and_nothing_keeps_a_graph():
    x, y = _regression(12)
    reader = BatchLogReader()
    model = cpu_model(nn.Linear(2, 1))
    model.compile("sgd", "mse", metrics=["mae"])
    history = model.fit(x, y, epochs=2, batch_size=4, validation_split=0.25, callbacks=[reader], verbose=0)
    assert len(reader.train) == 6 and len(reader.test) == 2  # 9 train samples: 3 batches; 3 val: 1
    for logs in reader.train + reader.test:
        assert set(logs) == {"loss", "mae"}
        for v in logs.values():
            assert isinstance(v, torch.Tensor) and v.dim() == 0
            assert not v.requires_grad and v.grad_fn is None
    for values in history.history.values():
        assert all(type(v) is float for v in values)
    # The model itself holds no tensor of a past step's graph (regression: `_step_loss`).
    for name, value in vars(model).items():
        if isinstance(value, torch.Tensor):
            assert value.grad_fn is None and not value.requires_grad, name


def test_batch_logs_are_running_epoch_means():
    # zero model, y = [1, 1, 1, 1, 4], batch 2, lr 0: per-sample losses 1, 1, 1, 1, 16
    reader = BatchLogReader()
    model = cpu_model(fixed_linear(1, 1))
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), "mse")
    y = torch.tensor([1.0, 1, 1, 1, 4])
    model.fit(torch.zeros(5, 1), y, batch_size=2, shuffle=False, callbacks=[reader], verbose=0)
    assert [float(logs["loss"]) for logs in reader.train] == [1.0, 1.0, 4.0]


# -- summary ----------------------------------------------------------------------------------


def test_summary_rows_and_parameter_counts_with_a_frozen_layer():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    net[0].requires_grad_(False)
    model = cpu_model(net)
    printed = []
    table = model.summary(print_fn=printed.append)
    assert printed == [table]
    cells = [list(col.cells) for col in table.columns]
    assert [col.header for col in table.columns] == ["Layer", "Type", "Output shape", "Params", "Trainable"]
    assert cells[0] == ["0", "1", "2", "Total"]
    assert cells[1] == ["Linear", "ReLU", "Linear", ""]
    assert cells[2] == ["?", "?", "?", "?"]  # no batch seen yet
    assert cells[3] == ["40", "0", "18", "58"]
    assert cells[4] == ["0", "0", "18", "18"]
    assert table.caption == "Frozen parameters: 40"

    model.compile("sgd", "cross_entropy")
    model.fit(torch.randn(6, 4), torch.randint(0, 2, (6,)), batch_size=4, verbose=0)
    cells = [list(col.cells) for col in model.summary(print_fn=lambda t: None).columns]
    assert cells[2] == ["(4, 8)", "(4, 8)", "(4, 2)", "(4, 2)"]


def test_summary_counts_shared_parameters_once():
    shared = nn.Linear(3, 3)
    net = nn.Sequential(shared, nn.ReLU(), shared)
    table = cpu_model(net).summary(print_fn=lambda t: None)
    assert list(table.columns[3].cells)[-1] == "12"


# -- the callback protocol as fit drives it ---------------------------------------------------


def _recording_callback(events):
    from fitkit.callbacks.base import HOOKS

    def make(hook):
        def record(self, *args):
            events.append((hook, *(a for a in args if isinstance(a, int))))

        return record

    return type("Recording", (fitkit.Callback,), {h: make(h) for h in HOOKS})()


def test_hook_order_of_fit_evaluate_and_predict():
    events = []
    cb = _recording_callback(events)
    model = cpu_model(nn.Linear(2, 1))
    model.compile("sgd", "mse")
    x, y = torch.randn(6, 2), torch.randn(6, 1)
    model.fit(x, y, batch_size=3, epochs=2, validation_data=(x[:2], y[:2]), callbacks=[cb], verbose=0)

    def epoch(e):
        return [
            ("on_epoch_begin", e),
            ("on_train_batch_begin", 0),
            ("on_backward_end", 0),
            ("on_train_batch_end", 0),
            ("on_train_batch_begin", 1),
            ("on_backward_end", 1),
            ("on_train_batch_end", 1),
            ("on_test_begin",),
            ("on_test_batch_begin", 0),
            ("on_test_batch_end", 0),
            ("on_test_end",),
            ("on_validation_end",),
            ("on_epoch_end", e),
        ]

    assert events == [("on_train_begin",), *epoch(0), *epoch(1), ("on_train_end",)]
    events.clear()
    model.evaluate(x, y, batch_size=4, callbacks=[cb], verbose=0)
    assert events == [
        ("on_test_begin",),
        ("on_test_batch_begin", 0),
        ("on_test_batch_end", 0),
        ("on_test_batch_begin", 1),
        ("on_test_batch_end", 1),
        ("on_test_end",),
    ]
    events.clear()
    model.predict(x, batch_size=6, callbacks=[cb], verbose=0)
    assert events == [
        ("on_predict_begin",),
        ("on_predict_batch_begin", 0),
        ("on_predict_batch_end", 0),
        ("on_predict_end",),
    ]


def test_a_callback_may_add_a_key_that_history_records():
    class AddKey(fitkit.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["double_loss"] = 2 * logs["loss"]

    model = cpu_model(fixed_linear(1, 1))
    model.compile(functools.partial(torch.optim.SGD, lr=0.0), "mse")
    history = model.fit(torch.zeros(5, 1), torch.tensor([1.0, 1, 1, 1, 4]), callbacks=[AddKey()], verbose=0)
    assert history.history["double_loss"] == [8.0]


def test_stop_training_stops_after_the_current_batch():
    class Stop(fitkit.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_training = True

    model = cpu_model(nn.Linear(2, 1))
    model.compile("sgd", "mse")
    history = model.fit(torch.randn(12, 2), torch.randn(12, 1), batch_size=3, epochs=5, callbacks=[Stop()], verbose=0)
    assert model.global_step == 2
    assert history.epoch == [0]


def test_on_backward_end_sees_the_gradients_before_the_step():
    grads = []

    class Grads(fitkit.Callback):
        def on_backward_end(self, batch):
            grads.append(self.model.module.weight.grad.clone())

    x, y = torch.tensor([[1.0], [2.0]]), torch.tensor([[1.0], [2.0]])
    model = cpu_model(fixed_linear(1, 1))
    model.compile(functools.partial(torch.optim.SGD, lr=0.1), "mse")
    model.fit(x, y, batch_size=2, callbacks=[Grads()], verbose=0)
    assert grads[0].tolist() == [[-5.0]]  # d/dw mean((w x - y)^2) at w = 0: -2 * mean(x * y)
    assert model.module.weight.item() == pytest.approx(0.5)


def test_verbose_2_prints_one_line_per_epoch(capsys):
    model = cpu_model(nn.Linear(2, 1))
    model.compile("sgd", "mse", metrics=["mae"])
    model.fit(torch.randn(8, 2), torch.randn(8, 1), batch_size=4, epochs=2, validation_split=0.25, verbose=2)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("Epoch 1/2 - 2 steps - ") and " - loss: " in lines[0] and "val_mae: " in lines[0]
    model.evaluate(torch.randn(8, 2), torch.randn(8, 1), verbose=2)
    assert capsys.readouterr().out.startswith("Evaluate - 1 step - ")


@pytest.mark.requires_cuda
def test_cuda_matches_cpu_and_predict_returns_cpu_tensors():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 3, generator=g), torch.randn(20, 1, generator=g)
    results = {}
    for device in ("cpu", "cuda"):
        model = fitkit.Model(fixed_mlp(3, 8, 1), device=device)
        model.compile(functools.partial(torch.optim.SGD, lr=0.1), "mse", metrics=["mae"], jit_compile=False)
        model.fit(x, y, batch_size=4, shuffle=False, epochs=2, verbose=0)
        results[device] = (model.evaluate(x, y, verbose=0), model.predict(x, verbose=0))
    (cpu_logs, cpu_out), (cuda_logs, cuda_out) = results["cpu"], results["cuda"]
    assert cuda_out.device.type == "cpu"
    assert cuda_logs == pytest.approx(cpu_logs, abs=1e-4)
    assert torch.allclose(cpu_out, cuda_out, atol=1e-4)


def test_evaluate_return_dict_false_is_keras_scalar_or_list_in_metrics_order():
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    nn.init.zeros_(model.module.weight)
    nn.init.zeros_(model.module.bias)
    x, y = torch.zeros(4, 1), torch.tensor([[1.0], [1.0], [1.0], [5.0]])
    model.compile(loss="mse")
    assert model.evaluate(x, y, verbose=0, return_dict=False) == 7.0  # (1 + 1 + 1 + 25) / 4
    model.compile(loss="mse", metrics=["mae", "mse"])
    assert model.evaluate(x, y, verbose=0, return_dict=False) == [7.0, 2.0, 7.0]  # loss, mae, mse
    assert model.evaluate(x, y, verbose=0) == {"loss": 7.0, "mae": 2.0, "mse": 7.0}
    with pytest.raises(TypeError, match="return_dict"):
        model.evaluate(x, y, verbose=0, return_dict="no")
