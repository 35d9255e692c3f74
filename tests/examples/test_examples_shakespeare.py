"""Tests for fitkit.examples.shakespeare: a short run on real text, the recipe's parts, parity."""

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import fitkit
from fitkit.examples import shakespeare
from fitkit.examples.shakespeare import (
    RandomWindows,
    Recipe,
    build_gpt,
    build_optimizer,
    build_scheduler,
    fixed_windows,
    lr_multiplier,
)

# The text that ships inside the package, so this runs in any checkout or install.
SHAKESPEARE = shakespeare.default_text_path()


def test_short_run_on_tinyshakespeare(tmp_path, capsys):
    result = shakespeare.main(
        [
            str(SHAKESPEARE),
            "--steps",
            "50",
            "--eval-interval",
            "25",
            "--eval-batches",
            "5",
            "--sample-tokens",
            "40",
            "--out",
            str(tmp_path),
            "--verbose",
            "0",
        ]
    )
    # 50 steps take the loss well below the uniform guess ln(65) = 4.17 (about 2.9 here).
    assert 2.0 < result["val_loss"] < 3.5
    assert len(result["sample"]) == 40
    assert set(result["sample"]) <= set(SHAKESPEARE.read_text(encoding="utf-8"))
    best = torch.load(tmp_path / "best.pt", weights_only=True)  # weights only
    assert best["lm_head.weight"].shape == (65, 128)
    last = torch.load(tmp_path / "last.pt", weights_only=True)  # the full training state
    assert last["global_step"] == 50 and last["module"].keys() == best.keys()
    out = capsys.readouterr().out
    assert f"val loss {result['val_loss']:.4f}" in out


def test_bad_arguments_exit_with_a_message(tmp_path, capsys):
    with pytest.raises(SystemExit):
        shakespeare.main([str(tmp_path / "none.txt"), "--steps", "30", "--eval-interval", "20"])
    assert "must be a multiple of --eval-interval" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="No text file at"):
        shakespeare.main([str(tmp_path / "none.txt"), "--steps", "1"])


def test_lr_schedule_is_nanogpts():
    recipe = Recipe()
    lrs = [recipe.lr * lr_multiplier(step, recipe) for step in range(2001)]
    assert lrs[0] == pytest.approx(1e-3 / 101)  # (it + 1) / (warmup + 1)
    assert lrs[100] == pytest.approx(1e-3)  # peak at the end of warmup
    assert lrs[2000] == pytest.approx(1e-4)  # min_lr at lr_decay_iters
    assert all(a >= b for a, b in itertools.pairwise(lrs[100:]))  # monotone cosine decay
    mid = 100 + (2000 - 100) // 2
    assert lrs[mid] == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))
    assert lr_multiplier(10, Recipe(steps=5, warmup_steps=5)) == pytest.approx(0.1)


def test_random_windows_follow_the_generator():
    tokens = torch.arange(1000)
    a = iter(RandomWindows(tokens, 16, 4, torch.Generator().manual_seed(3)))
    b = iter(RandomWindows(tokens, 16, 4, torch.Generator().manual_seed(3)))
    for _ in range(3):
        (xa, ya), (xb, yb) = next(a), next(b)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.shape == (4, 16) and torch.equal(ya, xa + 1)
    x, y = fixed_windows(tokens, 16, 10)
    assert torch.equal(x, fixed_windows(tokens, 16, 10)[0])  # fixed: same seed, same windows
    with pytest.raises(ValueError, match="N >= block_size \\+ 1"):
        RandomWindows(torch.arange(16), 16, 4)


def test_fit_matches_a_plain_loop_step_for_step():
    # The recipe's moving parts (param groups, LambdaLR per step, clipping) through fit give
    # the same weights as nanoGPT's loop, bit for bit on the CPU.
    recipe = Recipe(block_size=8, batch_size=4, n_layer=1, n_head=2, n_embd=16, steps=6, warmup_steps=2)
    tokens = torch.randint(0, 11, (300,), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    initial = build_gpt(11, recipe)

    model = fitkit.Model(copy.deepcopy(initial), device="cpu")
    model.compile(
        optimizer=build_optimizer(model.module, recipe),
        loss="cross_entropy",
        scheduler=lambda opt: build_scheduler(opt, recipe),
        scheduler_interval="step",
        clip_grad_norm=1.0,
    )
    windows = RandomWindows(tokens, 8, 4, torch.Generator().manual_seed(1))
    history = model.fit(windows, epochs=2, steps_per_epoch=3, verbose=0)

    plain = copy.deepcopy(initial)
    opt = build_optimizer(plain, recipe)
    sched = build_scheduler(opt, recipe)
    batches = iter(RandomWindows(tokens, 8, 4, torch.Generator().manual_seed(1)))
    for _ in range(6):
        x, y = next(batches)
        loss = F.cross_entropy(plain(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

    for (name, a), b in zip(model.module.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert model.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert all(math.isfinite(v) for v in history.history["loss"])
