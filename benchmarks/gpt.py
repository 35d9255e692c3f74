"""nanoGPT's Shakespeare-char CPU recipe through ``Model.fit`` and through a plain loop.

Both contenders train the same GPT (same seed, same initial weights), on the same random
batches (two generators with the same seed), with the same AdamW, LambdaLR schedule and
gradient clipping: see :mod:`fitkit.examples.shakespeare` for the recipe. The runs alternate in
chunks of ``--chunk`` steps (A B, then B A, ...) so that a load change on a shared machine hits
both; each fitkit chunk is one ``fit(..., initial_epoch=i, epochs=i + 1)`` call, so fit's
per-call setup is inside the timing. Only training is timed; the validation loss (mean over
``--eval-batches`` fixed windows of the validation split, seed 1337) is computed afterwards,
with ``model.evaluate`` for fitkit and a hand-written loop for the plain run.

Since both runs do the same arithmetic in the same order, their weights should end equal; the
maximum absolute difference is printed as a parity check.

Run: ``python benchmarks/gpt.py [PATH] [--steps 2000] [--chunk 250]``. Targets (issue 4):
fitkit validation loss <= 1.92 and time ratio fitkit / plain <= 1.05.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fitkit
from fitkit.examples.shakespeare import (
    RandomWindows,
    Recipe,
    build_gpt,
    build_optimizer,
    build_scheduler,
    fixed_windows,
    load_text,
)

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


class PlainRun:
    """The hand-written loop: nanoGPT's training step, with a running mean of the loss."""

    def __init__(self, module: torch.nn.Module, recipe: Recipe, batches: RandomWindows):
        self.module, self.recipe = module, recipe
        self.optimizer = build_optimizer(module, recipe)
        self.scheduler = build_scheduler(self.optimizer, recipe)
        self.batches = iter(batches)

    def train(self, steps: int) -> float:
        module, opt, sched = self.module, self.optimizer, self.scheduler
        module.train()
        total = torch.zeros(())
        for _ in range(steps):
            x, y = next(self.batches)
            logits = module(x)  # (B, T, V)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), self.recipe.clip_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            total += loss.detach()  # the running mean a tutorial loop reports (fitkit logs it)
        return float(total / steps)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> float:
        self.module.eval()
        losses = [
            F.cross_entropy(self.module(xb).flatten(0, 1), yb.flatten())
            for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True)
        ]
        self.module.train()
        return float(torch.stack(losses).mean())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument("--chunk", type=int, default=250, help="steps per alternation")
    parser.add_argument("--eval-batches", type=int, default=Recipe.eval_batches)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps on a copy first")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps % args.chunk:
        parser.error(f"--steps ({args.steps}) must be a multiple of --chunk ({args.chunk})")

    recipe = Recipe(steps=args.steps, eval_batches=args.eval_batches)
    tokenizer, train_tokens, val_tokens = load_text(args.path)
    x_val, y_val = fixed_windows(val_tokens, recipe.block_size, recipe.eval_batches * recipe.batch_size)

    def batches() -> RandomWindows:
        return RandomWindows(
            train_tokens, recipe.block_size, recipe.batch_size, torch.Generator().manual_seed(args.seed)
        )

    torch.manual_seed(args.seed)
    initial = build_gpt(tokenizer.vocab_size, recipe)

    # Warm-up on a throwaway copy: the first steps of a process pay for kernel and allocator
    # setup, which would otherwise land on whichever contender runs first.
    PlainRun(copy.deepcopy(initial), recipe, batches()).train(args.warmup)

    model = fitkit.Model(copy.deepcopy(initial), device="cpu")
    model.compile(
        optimizer=build_optimizer(model.module, recipe),
        loss="cross_entropy",
        scheduler=lambda opt: build_scheduler(opt, recipe),
        scheduler_interval="step",
        clip_grad_norm=recipe.clip_grad_norm,
    )
    fitkit_batches = batches()
    plain = PlainRun(copy.deepcopy(initial), recipe, batches())

    def run_fitkit(chunk: int) -> None:
        model.fit(fitkit_batches, initial_epoch=chunk, epochs=chunk + 1, steps_per_epoch=args.chunk, verbose=0)

    times: dict[str, list[float]] = {"fitkit": [], "plain": []}
    contenders = {"fitkit": run_fitkit, "plain": lambda chunk: plain.train(args.chunk)}
    load_before = os.getloadavg()[0]
    chunks = args.steps // args.chunk
    for chunk in range(chunks):
        order = ["fitkit", "plain"] if chunk % 2 == 0 else ["plain", "fitkit"]
        for name in order:
            start = time.perf_counter()
            contenders[name](chunk)
            times[name].append(time.perf_counter() - start)
        print(
            f"chunk {chunk + 1}/{chunks}: fitkit {times['fitkit'][-1]:.1f}s, plain {times['plain'][-1]:.1f}s",
            file=sys.stderr,
            flush=True,
        )  # for long runs
    load_after = os.getloadavg()[0]

    val_fitkit = model.evaluate(x_val, y_val, batch_size=recipe.batch_size, verbose=0)["loss"]
    val_plain = plain.evaluate(x_val, y_val, recipe.batch_size)
    weight_diff = max(
        (a - b).abs().max().item()
        for a, b in zip(model.module.state_dict().values(), plain.module.state_dict().values(), strict=True)
    )
    t_fitkit, t_plain = sum(times["fitkit"]), sum(times["plain"])
    chunk_ratios = [f / p for f, p in zip(times["fitkit"], times["plain"], strict=True)]

    print(
        f"nanoGPT Shakespeare-char CPU recipe: {args.steps} steps, batch {recipe.batch_size}, "
        f"block {recipe.block_size}, {recipe.n_layer} layers, {recipe.n_embd} dims, "
        f"{model.module.num_parameters():,} parameters, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average {load_before:.1f} -> "
        f"{load_after:.1f}"
    )
    print(
        f"val loss ({recipe.eval_batches} batches of fixed windows): fitkit {val_fitkit:.4f}"
        f" - plain {val_plain:.4f} - max |weight difference| {weight_diff:.2e}"
    )
    print(
        f"train time: fitkit {t_fitkit:.1f}s ({1e3 * t_fitkit / args.steps:.1f} ms/step) - "
        f"plain {t_plain:.1f}s ({1e3 * t_plain / args.steps:.1f} ms/step)"
    )
    print(
        f"time ratio fitkit/plain: {t_fitkit / t_plain:.3f} (per chunk of {args.chunk}: min "
        f"{min(chunk_ratios):.3f}, median {statistics.median(chunk_ratios):.3f}, max "
        f"{max(chunk_ratios):.3f})"
    )
    print(
        f"targets: val loss <= 1.92: {'met' if val_fitkit <= 1.92 else 'MISSED'} - "
        f"ratio <= 1.05: {'met' if t_fitkit / t_plain <= 1.05 else 'MISSED'}"
    )
    return {"val_fitkit": val_fitkit, "val_plain": val_plain, "ratio": t_fitkit / t_plain, "weight_diff": weight_diff}


if __name__ == "__main__":
    main()
