"""Loading part of a checkpoint (Composer's load_weights_only / load_ignore_keys) and the
run's folder for save_checkpoint() / load_checkpoint() without a path. Every part is asserted
taken or left out; a fine-tune after a partial load matches a hand-written loop."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import EarlyStopping, ModelCheckpoint
from fitkit.training.partial import PART_NAMES

X = torch.linspace(-1, 1, 20).reshape(20, 1)
Y = 3 * X + 1


def _model(optimizer: str = "sgd") -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    opt = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "adam": lambda p: torch.optim.Adam(p, lr=0.01)}[
        optimizer
    ]
    model.compile(optimizer=opt, loss="mse", scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    return model


@pytest.fixture
def source(tmp_path):
    """A run of 2 epochs (10 steps, the LR halved twice) saved at its end by a ModelCheckpoint, so
    the file holds the EarlyStopping state too."""
    model = _model()
    path = tmp_path / "src.pt"
    model.fit(
        X,
        Y,
        batch_size=4,
        shuffle=False,
        epochs=2,
        verbose=0,
        callbacks=[EarlyStopping(monitor="loss", patience=5), ModelCheckpoint(path)],
    )
    return model, path


def _ignored_cases():
    yield {}, set(PART_NAMES)
    yield {"weights_only": True}, {"module"}
    yield {"ignore_keys": ["optimizer"]}, set(PART_NAMES) - {"optimizer"}
    yield {"ignore_keys": ["optimizer", "scheduler", "position"]}, {"module", "global_step"}
    yield {"ignore_keys": ["global_step", "history"]}, set(PART_NAMES) - {"global_step", "history"}
    yield {"ignore_keys": ["module", "callbacks"]}, set(PART_NAMES) - {"module", "callbacks"}


@pytest.mark.parametrize("kwargs, taken", list(_ignored_cases()))
def test_each_part_is_taken_or_left_as_it_was(source, kwargs, taken):
    src, path = source
    model = _model()
    fresh_w = model.module.weight.detach().clone()
    es = EarlyStopping(monitor="loss", patience=5)
    epoch = model.load_checkpoint(path, **kwargs)
    weight_loaded = torch.equal(model.module.weight, src.module.weight)
    assert weight_loaded == ("module" in taken)
    if "module" not in taken:
        assert torch.equal(model.module.weight, fresh_w)
    momentum = model.optimizer.state.get(model.module.weight, {}).get("momentum_buffer")
    assert (
        momentum is not None and torch.equal(momentum, src.optimizer.state[src.module.weight]["momentum_buffer"])
    ) == ("optimizer" in taken)
    assert model.global_step == (10 if "global_step" in taken else 0)
    assert model.scheduler.last_epoch == (2 if "scheduler" in taken else 0)
    assert epoch == (2 if "position" in taken else 0)
    # the next fit: epoch 3 of the run (history and EarlyStopping go on) or a fresh epoch 1
    history = model.fit(X, Y, batch_size=4, shuffle=False, epochs=3, initial_epoch=epoch, verbose=0, callbacks=[es])
    assert len(history.history["loss"]) == (3 if {"position", "history"} <= taken else 3 - epoch)
    # EarlyStopping's best: over the whole run (its state restored) or over this fit's epochs alone
    this_fit = history.history["loss"][epoch:] if "history" in taken else history.history["loss"]
    restored = {"position", "callbacks"} <= taken
    assert es.best == min(src.history.history["loss"] + this_fit if restored else this_fit)


def test_fine_tuning_from_weights_only_matches_a_hand_loop(source):
    src, path = source
    model = _model("adam")  # another optimizer class: no mismatch, it is not loaded
    assert model.load_checkpoint(path, weights_only=True) == 0
    model.fit(X, Y, batch_size=4, shuffle=False, epochs=1, verbose=0)
    layer = nn.Linear(1, 1)
    layer.load_state_dict(src.module.state_dict())
    opt = torch.optim.Adam(layer.parameters(), lr=0.01)
    for i in range(0, 20, 4):
        opt.zero_grad()
        nn.functional.mse_loss(layer(X[i : i + 4]), Y[i : i + 4]).backward()
        opt.step()
    torch.testing.assert_close(model.module.state_dict(), layer.state_dict(), rtol=0, atol=0)
    assert model.global_step == 5


def test_a_whole_load_still_compares_the_optimizer(source):
    _, path = source
    with pytest.raises(ValueError, match="does not fit this model"):
        _model("adam").load_checkpoint(path)


def test_what_was_taken_is_logged(source, caplog):
    _, path = source
    with caplog.at_level(logging.INFO, logger="fitkit"):
        _model().load_checkpoint(path, ignore_keys=["optimizer", "position"])
    assert (
        f"Loaded module, global_step, scheduler from {str(path)!r}; left out: optimizer, position, callbacks, "
        "history." in caplog.messages
    )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"ignore_keys": "optimizer"}, TypeError, r"Expected `ignore_keys` to be a list of part names.*Received"),
        ({"ignore_keys": ["optimiser"]}, ValueError, r"Unknown part 'optimiser' in `ignore_keys`. Valid names: module"),
        ({"weights_only": "yes"}, TypeError, r"Expected `weights_only` to be a bool"),
        ({"weights_only": True, "ignore_keys": ["optimizer"]}, ValueError, r"weights_only=True.*Fix: pass one of them"),
        ({"ignore_keys": list(PART_NAMES)}, ValueError, r"leaves out every part"),
    ],
)
def test_bad_values_are_refused_and_nothing_changes(source, kwargs, error, match):
    _, path = source
    model = _model()
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    with pytest.raises(error, match=match):
        model.load_checkpoint(path, **kwargs)
    torch.testing.assert_close(model.module.state_dict(), before, rtol=0, atol=0)
    assert model.global_step == 0


# -- the run's folder ---------------------------------------------------------------------------
def _files(folder) -> list[str]:
    return sorted(p for p in os.listdir(folder) if p.endswith(".pt"))


def test_without_a_path_the_run_folder_is_used(tmp_path):
    model = _model()
    with pytest.raises(RuntimeError, match=r"save_checkpoint\(\)` without a path.*has none. Fix: pass a path"):
        model.save_checkpoint()
    with pytest.raises(RuntimeError, match=r"load_checkpoint\(\)` without a path"):
        model.load_checkpoint()
    model.fit(X, Y, batch_size=4, epochs=2, verbose=0, callbacks=[ModelCheckpoint(tmp_path / "e{epoch}.pt")])
    model.save_checkpoint()
    assert _files(tmp_path) == ["e1.pt", "e2.pt", "last.pt"]
    assert torch.load(tmp_path / "last.pt", weights_only=True)["global_step"] == 10
    resumed = _model()
    with pytest.raises(RuntimeError):
        resumed.load_checkpoint()  # a fresh model has no run yet
    model.fit(X, Y, batch_size=4, epochs=1, verbose=0)  # a later fit without a ModelCheckpoint: the folder stays
    model.save_checkpoint()  # last.pt is now the newest, at step 15
    assert model.load_checkpoint("last") == 1 and model.global_step == 15


def test_save_last_path_and_an_empty_folder(tmp_path):
    model = _model()
    ckpt = ModelCheckpoint(tmp_path / "w{epoch}.pt", save_weights_only=True, save_last=tmp_path / "state.pt")
    model.fit(X, Y, batch_size=4, epochs=1, verbose=0, callbacks=[ckpt])
    os.remove(tmp_path / "state.pt")
    with pytest.raises(FileNotFoundError, match=r"holds none. Fix: pass a path"):
        model.load_checkpoint()  # w1.pt holds weights only: not a checkpoint
    model.save_checkpoint()
    assert _files(tmp_path) == ["state.pt", "w1.pt"]


def test_an_explicit_save_into_a_keep_last_pattern_joins_its_rotation(tmp_path):
    model = _model()
    ckpt = ModelCheckpoint(tmp_path / "e{epoch}.pt", keep_last=2)
    model.fit(X, Y, batch_size=4, epochs=3, verbose=0, callbacks=[ckpt])
    assert _files(tmp_path) == ["e2.pt", "e3.pt"]
    model.save_checkpoint(tmp_path / "e9.pt")
    assert _files(tmp_path) == ["e3.pt", "e9.pt"]
    model.save_checkpoint(tmp_path / "other.pt")  # not of the pattern: no rotation
    assert _files(tmp_path) == ["e3.pt", "e9.pt", "other.pt"]
