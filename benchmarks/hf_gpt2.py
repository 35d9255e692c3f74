"""Hugging Face's GPT-2 and fitkit's ``GPT`` preset, trained by ``fit`` with one recipe.

Both models train with nanoGPT's Shakespeare-char CPU recipe (:mod:`fitkit.examples.shakespeare`):
the shipped tiny Shakespeare, a 90/10 split, random windows of 64 characters, batch 12, AdamW
(lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on 2-D parameters), 100 warmup steps then cosine
to 1e-4, gradient clipping at norm 1.0, 2000 steps, the same random batches (generators seeded
alike). GPT-2 is ``GPT2LMHeadModel(GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=65,
n_positions=64))`` with the recipe's dropout (0; GPT2Config's own default is 0.1, see
``--gpt2-dropout``); it trains on dict batches ``{"input_ids": x, "labels": x}`` with
``compile(loss=None)``, so its own loss (labels shifted inside the model: 63 targets per window)
is the objective. fitkit's GPT trains on ``(x, y)`` with ``loss="cross_entropy"`` (64 targets).

What differs is the architecture alone: GPT-2 has biases, GELU (tanh), and 128 more parameters
per LayerNorm; the preset has no biases. Both tie the LM head to the token embedding.

Both are scored the same way: the mean next-token cross entropy over all 64 positions of the
example's fixed validation windows (``eval_batches`` batches of 12, seed 1337), through
``evaluate`` with ``loss="cross_entropy"`` (GPT-2's ``logits`` are picked out of its output).

Run: ``python benchmarks/hf_gpt2.py [--steps 2000] [--eval-batches 200]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator

import torch

import fitkit
from fitkit.examples.shakespeare import (
    RandomWindows,
    Recipe,
    build_gpt,
    build_optimizer,
    build_scheduler,
    default_text_path,
    fixed_windows,
    load_text,
)


class DictWindows:
    """The recipe's random windows as Hugging Face batches: ``{"input_ids": x, "labels": x}``."""

    def __init__(self, windows: RandomWindows):
        self.windows = windows

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for x, _ in self.windows:  # (B, T): a causal LM shifts its labels itself
            yield {"input_ids": x, "labels": x}


def train(module: torch.nn.Module, batches, recipe: Recipe, steps: int, chunk: int, loss) -> tuple[fitkit.Model, float]:
    """``fit`` for ``steps`` optimizer steps, in epochs of ``chunk`` steps; returns the seconds."""
    model = fitkit.Model(module, device="cpu")
    model.compile(
        optimizer=build_optimizer(model.module, recipe),
        loss=loss,
        scheduler=lambda opt: build_scheduler(opt, recipe),
        scheduler_interval="step",
        clip_grad_norm=recipe.clip_grad_norm,
    )
    start = time.perf_counter()
    for epoch in range(steps // chunk):
        logs = model.fit(batches, initial_epoch=epoch, epochs=epoch + 1, steps_per_epoch=chunk, verbose=0)
        print(f"  step {(epoch + 1) * chunk}: loss {logs.history['loss'][-1]:.4f}", file=sys.stderr, flush=True)
    return model, time.perf_counter() - start


def val_loss(module: torch.nn.Module, x_val, y_val, batch_size: int, dict_input: bool) -> float:
    """Next-token cross entropy over every position of the validation windows."""
    scorer = fitkit.Model(module, device="cpu")
    scorer.compile(loss="cross_entropy")  # the prediction of a ModelOutput is its logits
    x = {"input_ids": x_val} if dict_input else x_val
    return scorer.evaluate(x, y_val, batch_size=batch_size, verbose=0)["loss"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument("--chunk", type=int, default=250, help="steps per fit epoch")
    parser.add_argument("--eval-batches", type=int, default=Recipe.eval_batches)
    parser.add_argument("--gpt2-dropout", type=float, default=Recipe.dropout)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps % args.chunk:
        parser.error(f"--steps ({args.steps}) must be a multiple of --chunk ({args.chunk})")
    import transformers

    transformers.logging.set_verbosity_error()  # a 65-character vocabulary has no GPT-2 BOS/EOS ids
    recipe = Recipe(steps=args.steps, eval_batches=args.eval_batches)
    tokenizer, train_tokens, val_tokens = load_text(default_text_path())
    x_val, y_val = fixed_windows(val_tokens, recipe.block_size, recipe.eval_batches * recipe.batch_size)

    def windows() -> RandomWindows:
        return RandomWindows(
            train_tokens, recipe.block_size, recipe.batch_size, torch.Generator().manual_seed(args.seed)
        )

    p = args.gpt2_dropout
    config = transformers.GPT2Config(
        n_layer=recipe.n_layer,
        n_head=recipe.n_head,
        n_embd=recipe.n_embd,
        vocab_size=tokenizer.vocab_size,
        n_positions=recipe.block_size,
        resid_pdrop=p,
        embd_pdrop=p,
        attn_pdrop=p,
        use_cache=False,
    )
    torch.manual_seed(args.seed)
    gpt2 = transformers.GPT2LMHeadModel(config)
    torch.manual_seed(args.seed)
    gpt = build_gpt(tokenizer.vocab_size, recipe)

    print("GPT-2 (transformers)", file=sys.stderr)
    hf_model, hf_time = train(gpt2, DictWindows(windows()), recipe, args.steps, args.chunk, loss=None)
    print("fitkit GPT", file=sys.stderr)
    fk_model, fk_time = train(gpt, windows(), recipe, args.steps, args.chunk, loss="cross_entropy")

    hf_val = val_loss(hf_model.module, x_val, y_val, recipe.batch_size, dict_input=True)
    hf_own = hf_model.evaluate({"input_ids": x_val, "labels": x_val}, batch_size=recipe.batch_size, verbose=0)["loss"]
    fk_val = val_loss(fk_model.module, x_val, y_val, recipe.batch_size, dict_input=False)
    n_hf = sum(p.numel() for p in gpt2.parameters())
    n_fk = gpt.num_parameters()
    print(
        f"Shakespeare-char recipe: {args.steps} steps, batch {recipe.batch_size}, block {recipe.block_size}, "
        f"{recipe.n_layer} layers, {recipe.n_embd} dims, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"val loss ({recipe.eval_batches} batches of fixed windows, 64 positions each):")
    print(
        f"  GPT-2 (transformers)  {hf_val:.4f}  ({n_hf:,} parameters, {hf_time:.0f}s, "
        f"{1e3 * hf_time / args.steps:.1f} ms/step; its own loss over 63 positions: {hf_own:.4f})"
    )
    print(
        f"  fitkit GPT            {fk_val:.4f}  ({n_fk:,} parameters, {fk_time:.0f}s, "
        f"{1e3 * fk_time / args.steps:.1f} ms/step)"
    )
    return {"gpt2": hf_val, "gpt2_own": hf_own, "gpt": fk_val, "gpt2_s": hf_time, "gpt_s": fk_time}


if __name__ == "__main__":
    main()
