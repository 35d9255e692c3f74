"""Train a small CNN on scikit-learn's handwritten digits: ``python -m fitkit.examples.digits``.

The same command runs data-parallel under ``torchrun --nproc_per_node=2 -m fitkit.examples.digits``
(``--batch-size`` is then per process).

The data (1,797 8x8 images, 10 classes) ships inside scikit-learn, so nothing is downloaded.
A stratified 80/20 split holds out a test set; 10% of the training part validates each epoch.
Needs ``pip install ".[examples]"`` from a checkout.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import torch
from torch import nn

import fitkit
from fitkit import distributed


def load_digits_split(seed: int = 0):
    """Return ``(x_train, y_train, x_test, y_test)``: float32 ``(N, 64)`` scaled to [0, 1], int64 labels."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        sys.exit("This example needs scikit-learn: pip install '.[examples]' from a checkout of fitkit")
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)

    def to_x(a):
        return torch.tensor(a / 16.0, dtype=torch.float32)  # pixel values are 0..16

    def to_y(a):
        return torch.tensor(a, dtype=torch.long)

    return to_x(x_train), to_y(y_train), to_x(x_test), to_y(y_test)


def build_net() -> nn.Module:
    """A two-layer CNN: (B, 64) pixels -> (B, 10) logits."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),  # (B, 1, 8, 8)
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # (B, 64, 4, 4)
        nn.Flatten(),
        nn.Dropout(0.25),
        nn.Linear(64 * 16, 128),
        nn.ReLU(),
        nn.Dropout(0.25),
        nn.Linear(128, 10),
    )


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", default="auto", help="0, 1, 2 or auto")
    args = parser.parse_args(argv)
    verbose = args.verbose if args.verbose == "auto" else int(args.verbose)

    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    model = fitkit.Model(build_net())
    model.compile(
        optimizer=functools.partial(torch.optim.Adam, lr=1e-3),
        loss="cross_entropy",
        metrics=["accuracy"],
        scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs),
    )
    if verbose:
        model.summary(input_shape=(64,))  # real output shapes: one (1, 64) batch of zeros
    start = time.perf_counter()
    model.fit(x_train, y_train, epochs=args.epochs, batch_size=args.batch_size, validation_split=0.1, verbose=verbose)
    seconds = time.perf_counter() - start
    result = model.evaluate(x_test, y_test, verbose=0)  # under torchrun: over the whole test set
    procs = distributed.world_size()
    where = f"{model.device}" + (f" x {procs} processes" if procs > 1 else "")
    if distributed.is_rank_zero():  # under torchrun every rank has the result; rank 0 prints it
        print(
            f"test accuracy {result['accuracy']:.4f} - test loss {result['loss']:.4f} - "
            f"trained in {seconds:.1f}s on {where}"
        )
    return result["accuracy"]


if __name__ == "__main__":
    main()
