"""ModelCheckpoint's run-relative and safety options: save_freq as a fraction of the planned
steps (Composer's "0.25dur"), keep_last=0, save_overwrite=False, save_on_exception (Lightning),
save_first_step. Which files exist is asserted exactly, and the saved weights against a
hand-written SGD loop."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import LambdaCallback, ModelCheckpoint

LR = 0.1
X = torch.linspace(-1, 1, 20).reshape(20, 1)
Y = 3 * X + 1


def _model(accumulation: int = 1) -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss="mse", gradient_accumulation_steps=accumulation)
    return model


def _hand_weights(steps: int, batch_size: int, accumulation: int = 1) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` optimizer steps of plain SGD over X, Y in order (sample-exact
    accumulation: each window's summed squared errors over its rows)."""
    torch.manual_seed(0)
    layer = nn.Linear(1, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=LR)
    batches = [(X[i : i + batch_size], Y[i : i + batch_size]) for i in range(0, len(X), batch_size)]
    windows = [batches[i : i + accumulation] for i in range(0, len(batches), accumulation)]
    for step in range(steps):
        window = windows[step % len(windows)]
        rows = sum(len(x) for x, _ in window)
        opt.zero_grad()
        for x, y in window:
            (((layer(x) - y) ** 2).sum() / rows).backward()
        opt.step()
    return layer.state_dict()


def _files(folder) -> list[str]:
    return sorted(p for p in os.listdir(folder) if p.endswith(".pt")) if os.path.isdir(folder) else []


@pytest.mark.parametrize(
    "fraction, fit_kwargs, accumulation, steps",
    [
        (0.25, {"epochs": 2}, 1, [3, 5, 8, 10]),  # 10 planned steps: 2.5, 5, 7.5, 10 rounded up
        (0.3, {"epochs": 2}, 1, [3, 6, 9, 10]),  # 3, 6, 9, then the end
        (0.25, {"max_steps": 7}, 1, [2, 4, 6, 7]),  # planned by max_steps: 1.75, 3.5, 5.25, 7
        (0.5, {"epochs": 1.5}, 1, [4, 8]),  # planned by a float epochs: ceil(1.5 * 5) = 8 steps
        (0.5, {"epochs": 2}, 2, [3, 6]),  # accumulation 2: 3 optimizer steps per epoch, 6 planned
        (1.0, {"epochs": 2}, 1, [10]),  # once, at the end
    ],
)
def test_a_fraction_of_the_run_saves_at_those_planned_steps(tmp_path, fraction, fit_kwargs, accumulation, steps):
    model = _model(accumulation)
    planned = _Planned()
    model.fit(
        X,
        Y,
        batch_size=4,
        shuffle=False,
        verbose=0,
        **fit_kwargs,
        callbacks=[planned, ModelCheckpoint(tmp_path / "s{step:02d}.pt", save_freq=fraction, save_weights_only=True)],
    )
    assert _files(tmp_path) == [f"s{s:02d}.pt" for s in steps]
    assert planned.total == steps[-1]  # the last save is the planned end
    for s in steps:  # each file holds the weights of that step, as a hand-written loop has them
        saved = torch.load(tmp_path / f"s{s:02d}.pt", weights_only=True)
        torch.testing.assert_close(saved, _hand_weights(s, 4, accumulation), rtol=1e-6, atol=1e-7)


def test_a_resumed_run_saves_where_the_uninterrupted_one_does(tmp_path):
    full = _model()
    full.fit(
        X,
        Y,
        batch_size=4,
        shuffle=False,
        epochs=2,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path / "a" / "s{step:02d}.pt", save_freq=0.25)],
    )
    resumed = _model()
    epoch = resumed.load_checkpoint(tmp_path / "a" / "s05.pt")  # the end of epoch 1 (5 steps)
    resumed.fit(
        X,
        Y,
        batch_size=4,
        shuffle=False,
        epochs=2,
        initial_epoch=epoch,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path / "b" / "s{step:02d}.pt", save_freq=0.25)],
    )
    assert _files(tmp_path / "b") == ["s08.pt", "s10.pt"]
    torch.testing.assert_close(resumed.module.state_dict(), full.module.state_dict(), rtol=0, atol=0)


def test_a_run_stopped_early_saves_its_last_step_too(tmp_path):
    stop = LambdaCallback(on_train_batch_end=lambda b, logs: setattr(model, "stop_training", model.global_step == 6))
    model = _model()
    model.fit(
        X,
        Y,
        batch_size=4,
        shuffle=False,
        epochs=2,
        verbose=0,
        callbacks=[stop, ModelCheckpoint(tmp_path / "s{step:02d}.pt", save_freq=0.25, save_weights_only=True)],
    )
    assert _files(tmp_path) == ["s03.pt", "s05.pt", "s06.pt"]


def test_a_fraction_of_an_unknown_plan_is_refused_before_step_1(tmp_path):
    model = _model()
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    batches = ((X[i : i + 4], Y[i : i + 4]) for i in range(0, 20, 4))  # a generator: no length
    with pytest.raises(ValueError, match=r"save_freq=0.25.*step count is unknown.*Fix: pass `max_steps="):
        model.fit(batches, verbose=0, callbacks=[ModelCheckpoint(tmp_path / "s{step}.pt", save_freq=0.25)])
    assert model.global_step == 0 and _files(tmp_path) == []
    torch.testing.assert_close(model.module.state_dict(), before, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"save_freq": 1.5}, ValueError, r"Expected a float `save_freq` in \(0, 1\].*save_freq=1.5"),
        ({"save_freq": 0.0}, ValueError, r"Expected a float `save_freq` in \(0, 1\].*save_freq=0.0"),
        ({"save_freq": float("nan")}, ValueError, r"Expected a float `save_freq`"),
        ({"keep_last": 0}, ValueError, r"keep_last=0.*neither is set.*Fix: pass save_best_only=True or save_last=True"),
        ({"keep_last": -1}, ValueError, r"Expected `keep_last` >= 0"),
        ({"save_overwrite": "no"}, TypeError, r"save_overwrite"),
        ({"save_on_exception": 3}, TypeError, r"Expected `save_on_exception` to be a bool or a path.*Received"),
        ({"save_first_step": True, "save_best_only": True}, ValueError, r"save_first_step=True.*Fix"),
        ({"save_first_step": 1}, TypeError, r"save_first_step"),
    ],
)
def test_bad_values_are_refused_when_the_callback_is_built(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        ModelCheckpoint(tmp_path / "s{step}.pt", **kwargs)


def test_first_step_needs_names_known_at_step_1(tmp_path):
    with pytest.raises(ValueError, match=r"save_first_step=True.*val_loss"):
        ModelCheckpoint(tmp_path / "s{val_loss:.2f}.pt", save_first_step=True)


def test_keep_last_0_keeps_only_the_best_after_the_run_and_the_newest_while_it_runs(tmp_path):
    scores = iter([1.0, 0.5, 0.9, 0.8, 0.7])  # the best at epoch 2
    score = LambdaCallback(on_epoch_end=lambda e, logs: logs.__setitem__("score", next(scores)))
    during = []
    look = LambdaCallback(on_epoch_end=lambda e, logs: during.append(_files(tmp_path)))
    _model().fit(
        X,
        Y,
        batch_size=10,
        epochs=5,
        verbose=0,
        callbacks=[
            score,
            ModelCheckpoint(tmp_path / "e{epoch}.pt", monitor="score", mode="min", save_best_only=True, keep_last=0),
            look,
        ],
    )
    # the epoch's file is written after every callback's on_epoch_end: what the next epoch sees
    assert during == [[], ["e1.pt"], ["e2.pt"], ["e2.pt"], ["e2.pt"]]
    assert _files(tmp_path) == ["e2.pt"]


def test_keep_last_0_with_save_last_leaves_only_the_final_state(tmp_path):
    model = _model()
    model.fit(
        X,
        Y,
        batch_size=10,
        epochs=3,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path / "e{epoch}.pt", keep_last=0, save_last=True)],
    )
    assert _files(tmp_path) == ["last.pt"]
    assert torch.load(tmp_path / "last.pt", weights_only=True)["global_step"] == 6


def test_save_overwrite_false_never_replaces_a_file_that_was_there(tmp_path):
    (tmp_path / "e2.pt").write_bytes(b"an earlier run's")
    model = _model()
    with pytest.raises(FileExistsError, match=r"save_overwrite=False.*e2.pt.*existed before this fit began"):
        model.fit(
            X,
            Y,
            batch_size=10,
            epochs=3,
            verbose=0,
            callbacks=[ModelCheckpoint(tmp_path / "e{epoch}.pt", save_weights_only=True, save_overwrite=False)],
        )
    assert (tmp_path / "e2.pt").read_bytes() == b"an earlier run's"
    assert _files(tmp_path) == ["e1.pt", "e2.pt"] and model.global_step == 4
    # its own files it replaces: a fixed name rewritten every epoch
    _model().fit(
        X,
        Y,
        batch_size=10,
        epochs=3,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path / "own" / "model.pt", save_weights_only=True, save_overwrite=False)],
    )
    assert _files(tmp_path / "own") == ["model.pt"]


class _Crash(Exception):
    pass


class _CrashAt(fitkit.Callback):
    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == self.step:
            raise _Crash


class _Planned(fitkit.Callback):
    def on_train_begin(self, logs=None):
        self.total = self.params["total_steps"]


def test_save_on_exception_leaves_a_file_that_resumes_the_crashed_run(tmp_path):
    full = _model()
    full.fit(X, Y, batch_size=4, shuffle=False, epochs=2, verbose=0)
    crashed = _model()
    ckpt = ModelCheckpoint(tmp_path / "e{epoch}.pt", save_on_exception=True)
    with pytest.raises(_Crash):
        crashed.fit(X, Y, batch_size=4, shuffle=False, epochs=2, verbose=0, callbacks=[_CrashAt(7), ckpt])
    assert _files(tmp_path) == ["e1.pt", "on_exception.pt"]
    state = torch.load(tmp_path / "on_exception.pt", weights_only=True)
    assert (state["global_step"], state["epoch"], state["step_in_epoch"]) == (7, 1, 2)
    torch.testing.assert_close(state["module"], _hand_weights(7, 4), rtol=1e-6, atol=1e-7)
    resumed = _model()
    epoch = resumed.load_checkpoint(tmp_path / "on_exception.pt")
    resumed.fit(X, Y, batch_size=4, shuffle=False, epochs=2, initial_epoch=epoch, verbose=0)
    assert resumed.global_step == 10
    torch.testing.assert_close(resumed.module.state_dict(), full.module.state_dict(), rtol=0, atol=0)


def test_no_exception_file_before_step_1_nor_on_a_keyboard_interrupt(tmp_path):
    def interrupt(batch, logs):
        raise KeyboardInterrupt

    ckpt = ModelCheckpoint(tmp_path / "e{epoch}.pt", save_on_exception=tmp_path / "crash.pt")
    before_step_1 = LambdaCallback(on_train_begin=lambda logs: (_ for _ in ()).throw(_Crash()))
    with pytest.raises(_Crash):
        _model().fit(X, Y, batch_size=4, verbose=0, callbacks=[before_step_1, ckpt])
    with pytest.raises(KeyboardInterrupt):
        _model().fit(X, Y, batch_size=4, verbose=0, callbacks=[LambdaCallback(on_train_batch_end=interrupt), ckpt])
    assert _files(tmp_path) == []


def test_save_first_step_writes_a_file_after_step_1(tmp_path):
    model = _model()
    model.fit(
        X,
        Y,
        batch_size=4,
        shuffle=False,
        epochs=2,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path / "s{step:02d}.pt", save_weights_only=True, save_first_step=True)],
    )
    assert _files(tmp_path) == ["s01.pt", "s05.pt", "s10.pt"]
    torch.testing.assert_close(
        torch.load(tmp_path / "s01.pt", weights_only=True), _hand_weights(1, 4), rtol=1e-6, atol=1e-7
    )


def test_keep_last_0_keeps_the_newest_file_of_a_run_stopped_by_sigterm(tmp_path):
    import signal

    def term(epoch, logs):
        if epoch == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # held to the step boundary, then SystemExit(143)

    with pytest.raises(SystemExit) as info:
        _model().fit(
            X,
            Y,
            batch_size=10,
            epochs=4,
            verbose=0,
            callbacks=[
                LambdaCallback(on_epoch_end=term),
                ModelCheckpoint(tmp_path / "e{epoch}.pt", keep_last=0, save_last=True),
            ],
        )
    assert info.value.code == 143
    assert _files(tmp_path) == ["e2.pt", "last.pt"]  # the preempted run's newest file stays for its resume
