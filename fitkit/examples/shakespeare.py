"""Train a character-level GPT on tiny Shakespeare: ``python -m fitkit.examples.shakespeare``.

Tiny Shakespeare (Karpathy's ``char-rnn`` data set, 1.1 MB of public-domain text) ships inside
the package, as scikit-learn ships digits, so the command runs after a plain install; pass
the path of another UTF-8 text file to train on it instead (:func:`default_text_path`).

The recipe is nanoGPT's Shakespeare-char run on a CPU (Karpathy, ``README.md``, "I only have a
macbook"): block 64, batch 12, 4 layers, 4 heads, 128 dims, dropout 0, no biases, AdamW(lr
1e-3, betas (0.9, 0.99), weight decay 0.1 on 2-D parameters only), 100 warmup steps then cosine
decay to 1e-4 at step 2000, gradient clipping at norm 1.0, 2000 steps, a 90/10 split of the
text. nanoGPT's ``train.py`` reports a validation loss of about 1.88 with it (20 random
batches); this example reaches 1.91 on tinyshakespeare.txt over 200 fixed batches, and a plain
PyTorch loop on the same batches ends with the same weights (``benchmarks/gpt.py``).

Training batches are random windows of the training tokens, drawn as nanoGPT's ``get_batch``
does; the validation loss is the mean over a fixed set of windows of the validation tokens
(``eval_batches`` batches drawn with a generator seeded 1337), so runs compare exactly.
Each epoch is ``--eval-interval`` steps; after each, the model is validated and
:class:`~fitkit.callbacks.ModelCheckpoint` writes ``best.pt`` (weights with the lowest
validation loss) and ``last.pt`` (the full training state) to ``--out``.

Example::

    python -m fitkit.examples.shakespeare                       # the shipped tiny Shakespeare
    python -m fitkit.examples.shakespeare my_corpus.txt         # any UTF-8 text file
    python -m fitkit.examples.shakespeare input.txt --steps 50 --eval-batches 5  # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import math
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import fitkit
from fitkit.callbacks import ModelCheckpoint
from fitkit.layers import GPT, param_groups_weight_decay
from fitkit.text import CharTokenizer

__all__ = [
    "default_text_path",
    "Recipe",
    "RandomWindows",
    "fixed_windows",
    "load_text",
    "build_gpt",
    "build_optimizer",
    "build_scheduler",
    "lr_multiplier",
    "checkpoint_callbacks",
    "main",
]


def default_text_path() -> Path:
    """The tiny Shakespeare text that ships in the package (1,115,394 characters, UTF-8).

    The file is ``fitkit/examples/data/tinyshakespeare.txt``, found with
    ``importlib.resources``, so it is there after a plain ``pip install .`` (Karpathy's
    ``char-rnn`` data set; the works of Shakespeare are in the public domain).

    Returns:
        The path of the file.

    Example:
        >>> default_text_path().name, default_text_path().stat().st_size
        ('tinyshakespeare.txt', 1115394)
    """
    resource = importlib.resources.files("fitkit.examples") / "data" / "tinyshakespeare.txt"
    return Path(str(resource))  # the package is installed as files (not zipped), as pip does


#: Seed of the validation windows; fixed so that every run is scored on the same windows.
VAL_SEED = 1337


@dataclasses.dataclass(frozen=True)
class Recipe:
    """nanoGPT's Shakespeare-char CPU recipe; ``steps`` are optimizer steps.

    Example:
        >>> Recipe().n_embd, Recipe(steps=50).decay_steps
        (128, 50)
    """

    block_size: int = 64
    batch_size: int = 12
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    lr: float = 1e-3
    min_lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1
    warmup_steps: int = 100
    steps: int = 2000
    clip_grad_norm: float = 1.0
    eval_batches: int = 200

    @property
    def decay_steps(self) -> int:
        """Step at which the cosine reaches ``min_lr`` (nanoGPT sets it to ``max_iters``)."""
        return self.steps


class RandomWindows:
    """Endless ``(x, y)`` batches of windows at random offsets (nanoGPT's ``get_batch``).

    Each batch draws ``batch_size`` offsets uniformly from ``[0, N - T)`` with ``generator``;
    ``y`` is ``x`` shifted by one token. Iterating again continues the same random stream, so
    several ``fit`` calls (or a plain loop given a generator with the same seed) see the same
    batches. It has no length: pass ``steps_per_epoch`` to ``fit``.

    Args:
        tokens: Token ids of shape ``(N,)``, int64.
        block_size: Window length ``T``.
        batch_size: Windows per batch ``B``.
        generator: Random generator for the offsets (CPU); torch's global one if None, as
            in nanoGPT.

    Raises:
        ValueError: ``tokens`` is not 1-D or holds fewer than ``block_size + 1`` tokens, or a
            size below 1.

    Example:
        >>> windows = RandomWindows(torch.arange(100), block_size=8, batch_size=4,
        ...                         generator=torch.Generator().manual_seed(0))
        >>> x, y = next(iter(windows))
        >>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
        (torch.Size([4, 8]), True)
    """

    def __init__(
        self, tokens: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator | None = None
    ) -> None:
        _check_windows(tokens, block_size, batch_size)
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.generator = generator
        # Offsets 0..T-1 added to each start: one gather per batch instead of B slices + stack.
        self._arange = torch.arange(block_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            start = torch.randint(
                len(self.tokens) - self.block_size, (self.batch_size,), generator=self.generator
            )  # (B,)
            idx = start[:, None] + self._arange  # (B, T)
            yield self.tokens[idx], self.tokens[idx + 1]  # (B, T), (B, T)


def fixed_windows(
    tokens: torch.Tensor, block_size: int, num_windows: int, seed: int = VAL_SEED
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed, seeded set of windows: the validation set.

    Args:
        tokens: Token ids of shape ``(N,)``, int64.
        block_size: Window length ``T``.
        num_windows: Number of windows ``W``.
        seed: Seed of the generator that draws the offsets.

    Returns:
        ``(x, y)``, both of shape ``(W, T)``, int64; ``y`` is ``x`` shifted by one token.

    Raises:
        ValueError: ``tokens`` is not 1-D or holds fewer than ``block_size + 1`` tokens, or a
            size below 1.

    Example:
        >>> x, y = fixed_windows(torch.arange(50), block_size=4, num_windows=3)
        >>> x.shape, bool((x + 1 == y).all())
        (torch.Size([3, 4]), True)
    """
    if not isinstance(num_windows, int) or isinstance(num_windows, bool) or num_windows < 1:
        raise ValueError(f"Expected `num_windows` to be an int >= 1. Received: num_windows={num_windows!r}.")
    windows = RandomWindows(tokens, block_size, num_windows, torch.Generator().manual_seed(seed))
    return next(iter(windows))


def _check_windows(tokens: torch.Tensor, block_size: int, batch_size: int) -> None:
    for name, value in (("block_size", block_size), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Expected `{name}` to be an int >= 1. Received: {name}={value!r}.")
    if tokens.dim() != 1 or len(tokens) < block_size + 1:
        raise ValueError(
            f"Expected `tokens` of shape (N,) with N >= block_size + 1 = "
            f"{block_size + 1}. Received: shape {tuple(tokens.shape)}. Use a longer "
            "text or a smaller block_size."
        )


def load_text(path: str | Path, val_fraction: float = 0.1) -> tuple[CharTokenizer, torch.Tensor, torch.Tensor]:
    """Read a text file, build its character vocabulary and split its tokens.

    Args:
        path: A UTF-8 text file.
        val_fraction: The last fraction of the tokens held out for validation (nanoGPT: 0.1).

    Returns:
        ``(tokenizer, train_tokens, val_tokens)``; the token tensors have shapes ``(N_train,)``
        and ``(N_val,)``, int64.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"No text file at {str(path)!r}. Pass the path of a UTF-8 text file, e.g. tinyshakespeare.txt."
        )
    text = path.read_text(encoding="utf-8")
    tokenizer = CharTokenizer(text)
    tokens = tokenizer.encode(text)  # (N,)
    n_train = int(len(tokens) * (1 - val_fraction))
    return tokenizer, tokens[:n_train], tokens[n_train:]


def build_gpt(vocab_size: int, recipe: Recipe) -> GPT:
    """The recipe's GPT (initialised from the global RNG: seed it first)."""
    return GPT(
        vocab_size,
        recipe.block_size,
        recipe.n_layer,
        recipe.n_head,
        recipe.n_embd,
        dropout=recipe.dropout,
        bias=recipe.bias,
    )


def build_optimizer(module: torch.nn.Module, recipe: Recipe) -> torch.optim.AdamW:
    """AdamW with weight decay on 2-D parameters only (nanoGPT's ``configure_optimizers``).

    Build it after the module is on its device (``fitkit.Model`` moves it).
    """
    return torch.optim.AdamW(param_groups_weight_decay(module, recipe.weight_decay), lr=recipe.lr, betas=recipe.betas)


def lr_multiplier(step: int, recipe: Recipe) -> float:
    """Learning rate at optimizer step ``step`` as a multiple of ``recipe.lr`` (for LambdaLR).

    nanoGPT's ``get_lr``: linear warmup over ``warmup_steps``, then a cosine from ``lr`` down
    to ``min_lr`` at ``decay_steps``, then ``min_lr``.

    Example:
        >>> [round(lr_multiplier(s, Recipe()), 3) for s in (0, 99, 100, 1050, 2000, 5000)]
        [0.01, 0.99, 1.0, 0.55, 0.1, 0.1]
    """
    if step < recipe.warmup_steps:
        return (step + 1) / (recipe.warmup_steps + 1)
    floor = recipe.min_lr / recipe.lr
    if step > recipe.decay_steps:
        return floor
    # max(1, ...): a run no longer than its warmup has no decay phase to divide by.
    ratio = (step - recipe.warmup_steps) / max(1, recipe.decay_steps - recipe.warmup_steps)
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - floor)


def build_scheduler(optimizer: torch.optim.Optimizer, recipe: Recipe) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over :func:`lr_multiplier`; step it once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, recipe))


def checkpoint_callbacks(out: Path) -> list[fitkit.Callback]:
    """The example's checkpoints, written to the directory ``out`` after each epoch.

    Returns:
        Two :class:`~fitkit.callbacks.ModelCheckpoint` callbacks: ``best.pt`` holds the
        weights with the lowest ``val_loss`` so far (restore with ``model.load_weights``),
        ``last.pt`` the full training state of the last epoch (``model.load_checkpoint``).
    """
    return [
        ModelCheckpoint(out / "best.pt", monitor="val_loss", save_best_only=True, save_weights_only=True),
        ModelCheckpoint(out / "last.pt"),
    ]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fitkit.examples.shakespeare",
        description="Train a character-level GPT on a text file with nanoGPT's "
        "Shakespeare-char CPU recipe, then print the validation loss and a sample.",
    )
    parser.add_argument(
        "path", nargs="?", default=None, help="a UTF-8 text file (default: the tiny Shakespeare shipped in the package)"
    )
    parser.add_argument(
        "--steps", type=int, default=Recipe.steps, help="optimizer steps; the cosine ends here (default: %(default)s)"
    )
    parser.add_argument(
        "--eval-interval", type=int, default=500, help="steps per epoch: validation and checkpoint after each"
    )
    parser.add_argument(
        "--eval-batches",
        type=int,
        default=Recipe.eval_batches,
        help="validation batches of fixed windows (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the init and the batches")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="checkpoint directory for best.pt and last.pt (default: a new temporary directory)",
    )
    parser.add_argument("--sample-tokens", type=int, default=500, help="characters to generate after training")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, mps, ...")
    parser.add_argument(
        "--verbose",
        default="auto",
        choices=["auto", "0", "1", "2"],
        help="1: rich progress bar, 2: a line per epoch, auto: 1 on a terminal",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "eval_interval", "eval_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.sample_tokens < 0:
        parser.error(f"--sample-tokens must be >= 0; got {args.sample_tokens}")
    args.eval_interval = min(args.eval_interval, args.steps)
    if args.steps % args.eval_interval:
        parser.error(
            f"--steps ({args.steps}) must be a multiple of --eval-interval "
            f"({args.eval_interval}): each epoch is eval-interval steps"
        )
    if args.verbose != "auto":
        args.verbose = int(args.verbose)
    return args


def main(argv: list[str] | None = None) -> dict:
    """Train on a text file (default: tiny Shakespeare); print the validation loss and a sample.

    Args:
        argv: Command-line arguments (``sys.argv[1:]`` if None); see ``--help``.

    Returns:
        ``{"val_loss": float, "sample": str, "out": Path, "train_seconds": float}``; the
        time covers ``fit`` (training and validation), in seconds.
    """
    args = _parse(argv)
    recipe = Recipe(steps=args.steps, eval_batches=args.eval_batches)
    tokenizer, train_tokens, val_tokens = load_text(args.path or default_text_path())
    # (W, T) each, W = eval_batches * batch_size; evaluated in batches of batch_size, so the
    # sample-weighted mean that evaluate returns is the mean of the batch means (nanoGPT).
    x_val, y_val = fixed_windows(val_tokens, recipe.block_size, recipe.eval_batches * recipe.batch_size)
    train = RandomWindows(train_tokens, recipe.block_size, recipe.batch_size, torch.Generator().manual_seed(args.seed))

    torch.manual_seed(args.seed)
    net = build_gpt(tokenizer.vocab_size, recipe)
    model = fitkit.Model(net, device=args.device)
    model.compile(
        optimizer=build_optimizer(model.module, recipe),
        loss="cross_entropy",
        scheduler=lambda opt: build_scheduler(opt, recipe),
        scheduler_interval="step",
        clip_grad_norm=recipe.clip_grad_norm,
    )
    out = Path(tempfile.mkdtemp(prefix="fitkit-shakespeare-")) if args.out is None else args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.verbose:
        print(
            f"{len(train_tokens):,} training and {len(val_tokens):,} validation tokens, "
            f"vocabulary of {tokenizer.vocab_size}, {net.num_parameters():,} "
            f"parameters, on {model.device}"
        )

    start = time.perf_counter()
    model.fit(
        train,
        epochs=args.steps // args.eval_interval,
        steps_per_epoch=args.eval_interval,
        validation_data=(x_val, y_val),
        validation_batch_size=recipe.batch_size,
        callbacks=checkpoint_callbacks(out),
        verbose=args.verbose,
    )
    seconds = time.perf_counter() - start
    # The last epoch already validated on these windows; evaluating once more (one pass,
    # eval_batches forwards) gives the figure from the API a user would call after training.
    val_loss = model.evaluate(x_val, y_val, batch_size=recipe.batch_size, verbose=0)["loss"]

    sample = ""
    if args.sample_tokens:
        prompt = tokenizer.encode("\n")[None]  # (1, 1): nanoGPT's sample.py starts at a newline
        generator = torch.Generator(model.device).manual_seed(args.seed)
        ids = net.generate(
            prompt, args.sample_tokens, temperature=0.8, top_k=200, generator=generator
        )  # (1, 1 + sample_tokens)
        sample = tokenizer.decode(ids[0, 1:].cpu())
    print(f"val loss {val_loss:.4f} - {args.steps} steps in {seconds:.1f}s (with validation) - checkpoints in {out}")
    if sample:
        print("-" * 40 + "\n" + sample + "\n" + "-" * 40)
    return {"val_loss": val_loss, "sample": sample, "out": out, "train_seconds": seconds}


if __name__ == "__main__":
    main()
