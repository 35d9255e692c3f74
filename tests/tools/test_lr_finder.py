"""find_lr: the sweep's exact values, the suggestion rule, and a model left exactly as it was."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import random
import sys

import numpy as np
import pytest
import torch
from torch import nn

import fitkit
from fitkit.tools.lr_finder import LRFinderResult, find_lr


def _scalar_model(lr: float = 0.1) -> fitkit.Model:
    """y_pred = w * x with w = 1: on x = 1, y = 0 the loss is w**2 and SGD does w <- w (1 - 2 lr)."""
    module = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        module.weight.fill_(1.0)
    model = fitkit.Model(module, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=lr), loss="mse")
    return model


def _schedule(start, end, n):
    return [start * (end / start) ** (i / (n - 1)) for i in range(n)]


def test_lrs_losses_and_smoothing_are_exact():
    model = _scalar_model()
    ones = torch.ones(8, 1)
    result = find_lr(
        model,
        ones,
        torch.zeros(8, 1),
        batch_size=4,
        start_lr=1e-3,
        end_lr=0.3,
        num_steps=7,
        smooth=0.9,
        diverge_threshold=None,
    )
    assert result.lrs == _schedule(1e-3, 0.3, 7)  # 2 batches: the data is cycled
    w, raw = 1.0, []
    for lr in result.lrs:
        raw.append(w * w)
        w *= 1 - 2 * lr
    assert result.raw_losses == pytest.approx(raw, rel=1e-6)
    avg, smoothed = 0.0, []
    for i, loss in enumerate(result.raw_losses):
        avg = 0.9 * avg + (1 - 0.9) * loss
        smoothed.append(avg / (1 - 0.9 ** (i + 1)))
    assert result.losses == smoothed


def test_the_sweep_stops_when_the_smoothed_loss_diverges():
    model = _scalar_model()
    lrs = _schedule(1e-2, 100.0, 30)
    # By hand: w <- w (1 - 2 lr) grows once lr > 1; stop when smoothed > 4 * best (from step 1 on).
    w, avg, best, stop = 1.0, 0.0, math.inf, None
    for i, lr in enumerate(lrs):
        avg = 0.5 * avg + 0.5 * w * w
        s = avg / (1 - 0.5 ** (i + 1))
        w *= 1 - 2 * lr
        if i > 0 and s > 4 * best:
            stop = i
            break
        best = min(best, s)
    assert stop is not None and stop < 29
    result = find_lr(model, torch.ones(4, 1), torch.zeros(4, 1), start_lr=1e-2, end_lr=100.0, num_steps=30, smooth=0.5)
    assert len(result.lrs) == stop + 1  # the step that diverged is recorded
    assert result.losses[-1] > 4 * min(result.losses[:-1])


def test_a_non_finite_loss_stops_the_sweep():
    model = _scalar_model()
    result = find_lr(
        model, torch.ones(4, 1), torch.zeros(4, 1), start_lr=1e10, end_lr=1e300, num_steps=50, diverge_threshold=None
    )
    assert len(result.lrs) < 50 and not math.isfinite(result.losses[-1])


def _state(model: fitkit.Model):
    opt = model.optimizer
    return {
        "module": {k: v.clone() for k, v in model.module.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in model.module.parameters()],
        "optimizer": copy.deepcopy(opt.state_dict()),  # the live state is updated in place
        "scheduler": copy.deepcopy(model.scheduler.state_dict()),
        "global_step": model.global_step,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "flags": [m.training for m in model.module.modules()],
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_the_model_is_left_exactly_as_it_was():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3))
    module[1].eval()  # a frozen submodule stays frozen
    model = fitkit.Model(module, device="cpu")
    model.compile(
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1),
        loss="cross_entropy",
        scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=20),
        scheduler_interval="step",
    )
    x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # optimizer state, scheduler at step 5
    model.module(x).sum().backward()  # gradients the user left there
    scheduler = model.scheduler
    before = _state(model)
    # 60 steps: OneCycleLR would refuse to step past 20; the sweep does not step it.
    result = model.find_lr(x, y, batch_size=8, num_steps=60, diverge_threshold=None)
    assert len(result.lrs) == 60
    assert model.scheduler is scheduler
    assert _same(_state(model), before)
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # and training carries on
    assert model.global_step == 10 and len(history.history["loss"]) == 1


def test_the_model_is_restored_when_the_sweep_raises():
    model = _scalar_model()
    before = [p.clone() for p in model.module.parameters()]

    def bad_loss(y_pred, y):
        if model.global_step >= 2:
            raise RuntimeError("boom")
        return ((y_pred - y) ** 2).mean()

    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=bad_loss)
    with pytest.raises(RuntimeError, match="boom"):
        find_lr(model, torch.ones(4, 1), torch.zeros(4, 1), num_steps=10)
    assert model.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(model.module.parameters(), before, strict=True))


def test_suggestion_is_the_steepest_descent_before_the_minimum():
    lrs = [10.0 ** (i / 4 - 6) for i in range(20)]  # log(lr) evenly spaced: slopes are central differences
    losses = [2.0] * 10 + [1.9, 1.6, 1.0, 0.8, 0.7, 0.6, 0.55, 3.0, 0.1, 9.0]
    r = LRFinderResult(lrs=lrs, losses=losses, raw_losses=[])
    # Candidates: indices 10..17 (skip_begin=10; the lowest loss, 0.1, is at 18). Slopes per
    # step: 10: (1.6 - 2.0) / 2 = -0.2, 11: (1.0 - 1.9) / 2 = -0.45, 12: (0.8 - 1.6) / 2 = -0.4,
    # ..., 16: (3.0 - 0.55) / 2 > 0, 17: (0.1 - 0.55) / 2 = -0.225.
    assert r.suggest() == lrs[11]
    losses[10:13] = [1.9, 1.8, 1.0]  # 11: -0.45, 12: (0.8 - 1.8) / 2 = -0.5
    assert r.suggest() == lrs[12]
    assert r.suggest(skip_begin=13) == lrs[17]  # 13: -0.15, 14: -0.1, 15: -0.075, 16: > 0, 17: -0.225
    # The lowest loss at the end: the candidates stop before it.
    r2 = LRFinderResult(lrs=lrs[:5], losses=[3.0, 2.9, 2.0, 0.5, 0.4], raw_losses=[])
    # 0: -0.1 (one-sided), 1: (2.0 - 3.0) / 2 = -0.5, 2: (0.5 - 2.9) / 2 = -1.2, 3: (0.4 - 2.0) / 2 = -0.8
    assert r2.suggest(skip_begin=0, skip_end=1) == lrs[2]


def test_suggestion_needs_a_candidate():
    r = LRFinderResult(lrs=[1e-3, 1e-2, 1e-1], losses=[1.0, 0.5, 2.0], raw_losses=[])
    assert r.suggest() is None  # everything is skipped
    assert r.suggest(skip_begin=0) == 1e-3  # the only point before the lowest
    assert LRFinderResult(lrs=[1e-3, 1e-2], losses=[0.5, 1.0], raw_losses=[]).suggest(skip_begin=0) is None
    assert LRFinderResult(lrs=[1e-3], losses=[math.nan], raw_losses=[]).suggest(skip_begin=0) is None


def test_result_carries_the_default_suggestion():
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    model = fitkit.Model(nn.Linear(4, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    result = find_lr(model, x, x @ torch.ones(4, 1), batch_size=16, start_lr=1e-4, end_lr=10.0, num_steps=40)
    assert result.suggestion == result.suggest() and result.suggestion in result.lrs


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    model = _scalar_model()
    path = tmp_path / "lr.png"
    result = find_lr(model, torch.ones(4, 1), torch.zeros(4, 1), start_lr=1e-3, end_lr=0.4, num_steps=20, path=path)
    assert path.stat().st_size > 0
    fig = result.plot()
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and list(ax.lines[0].get_xdata()) == result.lrs


def _png_bytes(path) -> bytes:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"  # a whole PNG: its signature ...
    assert data[-12:-4] == b"\x00\x00\x00\x00IEND"  # ... and its end chunk
    return data


def test_a_plot_that_cannot_be_written_leaves_the_older_plot_whole(tmp_path, monkeypatch):
    # Runs everywhere: savefig writes half a file, then the disk is full (the test below, root only).
    import errno

    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    model, path = _scalar_model(), tmp_path / "lr.png"
    find_lr(model, torch.ones(4, 1), torch.zeros(4, 1), start_lr=1e-3, end_lr=0.4, num_steps=20, path=path)
    older = _png_bytes(path)

    def full(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(older[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    with pytest.raises(
        OSError,
        match=r"No space left on device while writing '.*lr\.png'; the older file, if any, "
        r"is unchanged\. Fix",
    ):
        find_lr(model, torch.ones(4, 1), torch.zeros(4, 1), start_lr=1e-3, end_lr=0.4, num_steps=20, path=path)
    assert _png_bytes(path) == older and sorted(p.name for p in tmp_path.iterdir()) == ["lr.png"]  # no temp left


def test_a_plot_on_a_full_disk_leaves_no_empty_png(tmp_path):
    pytest.importorskip("matplotlib")
    from _tmpfs import tmpfs

    with tmpfs(tmp_path / "small", "64k") as folder:
        with open(folder / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        with pytest.raises(OSError, match=r"while writing '.*lr\.png'; the older file, if any, is unchanged"):
            find_lr(_scalar_model(), torch.ones(4, 1), torch.zeros(4, 1), num_steps=20, path=folder / "lr.png")
        assert sorted(p.name for p in folder.iterdir()) == ["filler"]  # no 0-byte PNG, no temp file


def test_plot_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = LRFinderResult(lrs=[1e-3, 1e-2], losses=[1.0, 0.5], raw_losses=[1.0, 0.5])
    expected = (
        r"Install the `plot` extra: "
        r"`pip install '\.\[plot\]'` from a checkout \(`pip install 'torch-fitkit\[plot\]'`"
    )
    with pytest.raises(ImportError, match=expected):
        r.plot()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"start_lr": 0.0}, ValueError, r"Expected `start_lr` > 0\. Received: start_lr=0\.0\."),
        ({"end_lr": 1e-8}, ValueError, r"Expected `end_lr` > start_lr=1e-07\. Received: end_lr=1e-08\."),
        ({"num_steps": 1}, ValueError, r"Expected `num_steps` >= 2\. Received: num_steps=1\."),
        ({"num_steps": 2.0}, TypeError, r"Expected `num_steps` to be an int"),
        ({"smooth": 1.0}, ValueError, r"Expected `smooth` in \[0, 1\)"),
        ({"diverge_threshold": 1}, ValueError, r"Expected `diverge_threshold` > 1 or None"),
        ({"start_lr": "1e-3"}, TypeError, r"Expected `start_lr` to be a number"),
    ],
)
def test_errors_change_nothing(kwargs, error, match):
    model = _scalar_model()
    with pytest.raises(error, match=match):
        find_lr(model, torch.ones(4, 1), torch.zeros(4, 1), **kwargs)
    assert model.module.weight.item() == 1.0


def test_needs_a_compiled_model():
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    with pytest.raises(RuntimeError, match="`find_lr` needs a compiled model"):
        find_lr(model, torch.ones(4, 1), torch.zeros(4, 1))


def test_empty_data_is_an_error():
    model = _scalar_model()
    with pytest.raises(ValueError, match="yields no batch"):
        find_lr(model, iter([]))


@pytest.mark.slow
def test_digits_suggestion_trains_the_cnn_to_097():
    pytest.importorskip("sklearn")
    from fitkit.examples.digits import build_net, load_digits_split

    x_train, y_train, x_test, y_test = load_digits_split(0)
    torch.manual_seed(0)
    model = fitkit.Model(build_net(), device="cpu")
    model.compile(optimizer="adam", loss="cross_entropy", metrics=["accuracy"])
    suggestion = model.find_lr(x_train, y_train).suggestion
    assert 1e-4 < suggestion < 1e-1
    # A third of the suggestion, well within a factor of 10 of it, trains to >= 0.97.
    lr = suggestion / 3
    torch.manual_seed(0)
    model = fitkit.Model(build_net(), device="cpu")
    model.compile(optimizer=functools.partial(torch.optim.Adam, lr=lr), loss="cross_entropy", metrics=["accuracy"])
    model.fit(x_train, y_train, epochs=10, verbose=0)
    accuracy = model.evaluate(x_test, y_test, verbose=0)["accuracy"]
    print(f"digits CNN: suggestion {suggestion:.3g}, trained at {lr:.3g}: test accuracy {accuracy:.4f}")
    assert accuracy >= 0.97


# -- mode="linear" and apply=True --------------------------------------------------------------
def test_linear_mode_sweeps_evenly_and_suggests_on_the_linear_axis():
    model = _scalar_model()
    result = find_lr(
        model,
        torch.ones(8, 1),
        torch.zeros(8, 1),
        batch_size=4,
        start_lr=0.01,
        end_lr=0.1,
        num_steps=10,
        diverge_threshold=None,
        mode="linear",
    )
    assert result.lrs == [0.01 + (0.1 - 0.01) * (i / 9) for i in range(10)]
    assert result.mode == "linear"
    lrs, losses = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [4.0, 3.0, 2.6, 2.2, 1.6, 3.0]
    r = LRFinderResult(lrs=lrs, losses=losses, raw_losses=[], mode="linear")
    # even spacing: slopes -1 (edge), -0.7, -0.4, -0.5 (central differences): steepest at lr 1
    assert r.suggest(skip_begin=0, skip_end=1) == 1.0
    r.mode = "exponential"  # per log unit the last drop is the steepest: about -1.44, -1.16, -1.22, -2.12
    assert r.suggest(skip_begin=0, skip_end=1) == 4.0


def _two_groups(scheduler=None) -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(2, 1), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD([{"params": [p[0]], "lr": 0.1}, {"params": [p[1]], "lr": 0.02}]),
        loss="mse",
        scheduler=scheduler,
    )
    return model


def test_apply_sets_the_suggestion_on_every_group_keeping_their_ratios():
    x = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
    y = x @ torch.tensor([[1.0], [-2.0]])
    model = _two_groups()
    before = [p.detach().clone() for p in model.module.parameters()]
    result = find_lr(model, x, y, batch_size=8, start_lr=1e-4, end_lr=1.0, num_steps=30, apply=True)
    s = result.suggestion
    assert s is not None
    assert [g["lr"] for g in model.optimizer.param_groups] == [s, s * (0.02 / 0.1)]
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))


def test_apply_updates_the_scheduler_base_lrs_and_its_shape():
    x = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
    y = x @ torch.tensor([[1.0], [-2.0]])
    model = _two_groups(scheduler=lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=4))
    result = find_lr(model, x, y, batch_size=8, start_lr=1e-4, end_lr=1.0, num_steps=30, apply=True)
    s, groups = result.suggestion, model.optimizer.param_groups
    assert model.scheduler.base_lrs == [s, 0.02 * (s / 0.1)]
    assert groups[0]["initial_lr"] == s
    assert groups[0]["lr"] == pytest.approx(0.5 * s, rel=1e-12)  # the warm-up still starts at half
    assert groups[1]["lr"] == pytest.approx(0.5 * 0.02 * s / 0.1, rel=1e-12)


def test_apply_without_a_suggestion_warns_and_changes_nothing():
    model = _scalar_model()
    with pytest.warns(fitkit.checks.FitkitWarning, match="no suggestion"):
        find_lr(model, torch.ones(4, 1), torch.zeros(4, 1), num_steps=2, apply=True)
    assert model.optimizer.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"mode": "cubic"}, ValueError, "'exponential' or 'linear'"), ({"apply": 1}, TypeError, "apply")],
)
def test_mode_and_apply_errors(kwargs, error, match):
    model = _scalar_model()
    with pytest.raises(error, match=match):
        find_lr(model, torch.ones(4, 1), torch.zeros(4, 1), **kwargs)
    assert model.optimizer.param_groups[0]["lr"] == 0.1 and model.global_step == 0


def test_find_lr_restores_the_last_steps_gradient_norm():
    torch.manual_seed(0)
    x, y = torch.randn(16, 2), torch.randn(16, 1)
    model = fitkit.Model(nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="adam", loss="mse", clip_grad_norm=1.0)
    model.fit(x, y, epochs=1, batch_size=4, verbose=0)
    before = model.grad_norm.clone()
    model.find_lr(x, y, batch_size=4, num_steps=10)
    assert torch.equal(model.grad_norm, before)
