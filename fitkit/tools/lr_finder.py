"""The learning-rate range test: :func:`find_lr` (fastai's ``lr_find``, Lightning's ``Tuner.lr_find``).

The sweep trains for real (one optimizer step per batch, the learning rate growing
exponentially from step to step) and then puts everything back: weights, buffers, gradients,
optimizer state and learning rates, scheduler, grad scaler, step count and the RNG states of
python, numpy, torch and CUDA. Only the two functions at the bottom (:func:`snapshot`,
:func:`restore`, which :mod:`fitkit.tools.batch_size_finder` uses too) know the model's
internal state.
"""

from __future__ import annotations

import copy
import math
import os
import random
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fitkit import data as _data
from fitkit.checks import FitkitWarning, check_bool, check_int, check_that, known_keywords
from fitkit.checks.declared import Option, declare, declared
from fitkit.formatting import format_lr

__all__ = ["find_lr", "LRFinderResult", "apply_lr"]


@dataclass
class LRFinderResult:
    """What :func:`find_lr` measured.

    Attributes:
        lrs: the learning rate of each step taken (ascending).
        losses: the smoothed training loss after each step (bias-corrected exponential
            moving average of ``raw_losses``).
        raw_losses: the loss of each step's batch, as ``train_on_batch`` returned it.
        suggestion: the learning rate of the steepest descent of ``losses`` before their
            minimum (:meth:`suggest` with its defaults); ``None`` when no point qualifies.
        mode: the sweep, ``"exponential"`` or ``"linear"`` (the axis :meth:`suggest` uses).

    Example:
        >>> r = LRFinderResult(lrs=[10.0**-i for i in range(6, 0, -1)], losses=[], raw_losses=[])
        >>> r.losses = [2.0, 2.0, 2.0, 1.0, 0.9, 3.0]  # flat, falling, diverged
        >>> r.suggest(skip_begin=1, skip_end=1)
        0.001
    """

    lrs: list[float]
    losses: list[float]
    raw_losses: list[float]
    suggestion: float | None = field(default=None)
    mode: str = field(default="exponential")

    def suggest(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The learning rate where the smoothed loss falls fastest, on the log-LR axis.

        Lightning's rule, with two changes that keep noise from deciding. Each point's slope
        is ``torch.gradient``'s over all finite points, taken against ``log(lr)`` (``lr`` for
        a linear sweep), the axis of the plot (fastai's "steep", and Lightning's per-step gradient before 2025): against
        ``lr`` itself, on an exponential sweep, the tiny spacing of the first points turns
        their noise into the steepest slopes. And the candidates end before the lowest
        smoothed loss: past it the loss is diverging, and its wiggles there are no descent.
        As in Lightning, the first ``skip_begin`` and last ``skip_end`` points are never
        suggested, and non-finite losses are dropped.

        Args:
            skip_begin: points never suggested at the start (too early to say anything).
            skip_end: points never suggested at the end (the divergence), at least 1.

        Returns:
            The learning rate from ``lrs`` with the most negative slope, or ``None`` if no
            point is left to suggest.
        """
        finite = [i for i, v in enumerate(self.losses) if math.isfinite(v)]
        if len(finite) < 2:
            return None
        lowest = min(finite, key=lambda i: self.losses[i])
        end = min(len(self.losses) - max(skip_end, 1), lowest)
        losses = torch.tensor([self.losses[i] for i in finite], dtype=torch.float64)
        axis = (lambda v: v) if self.mode == "linear" else math.log  # the sweep's own spacing
        log_lrs = torch.tensor([axis(self.lrs[i]) for i in finite], dtype=torch.float64)
        slope = torch.gradient(losses, spacing=[log_lrs])[0]
        candidates = [k for k, i in enumerate(finite) if skip_begin <= i < end]
        if not candidates:
            return None
        best = min(candidates, key=lambda k: float(slope[k]))
        return self.lrs[finite[best]]

    def plot(self, path: str | None = None):
        """Draw the smoothed loss against the learning rate (log scale), suggestion marked.

        Needs matplotlib (``pip install ".[plot]"`` from a checkout), as :meth:`fitkit.History.plot`.

        Args:
            path: if given, the figure is saved there as a PNG.

        Returns:
            The matplotlib ``Figure``.

        Raises:
            ImportError: matplotlib is not installed.
        """
        try:
            import matplotlib

            if path is not None or matplotlib.get_backend().lower() == "agg":
                matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                "find_lr's plot needs matplotlib. Install the `plot` extra: "
                "`pip install '.[plot]'` from a checkout (`pip install 'torch-fitkit[plot]'` once released)."
            ) from None
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(self.lrs, self.losses, label="smoothed loss")
        if self.suggestion is not None:
            i = self.lrs.index(self.suggestion)
            label = f"suggestion {format_lr(self.suggestion)}"
            ax.plot([self.suggestion], [self.losses[i]], "o", color="red", label=label)
        if self.mode != "linear":
            ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("loss")
        ax.legend()
        fig.tight_layout()
        if path is not None:  # whole or not at all: a full disk leaves no 0-byte PNG, an older plot stays
            from fitkit.files.writing import _atomic_write

            _atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
        return fig


_FIND_LR_OPTIONS = declare(
    "find_lr",
    Option("x", "custom", checked_in="fitkit.data.as_loader", bad=("data", 5)),
    Option("y", "custom", checked_in="fitkit.data.as_loader", bad=("labels",)),
    Option("batch_size", "int", minimum=1, fix="pass the samples per sweep step, e.g. batch_size=32."),
    Option("start_lr", "custom", checked_in="check_sweep", bad=(0, -1e-3, "1e-7", float("nan"))),
    Option("end_lr", "custom", checked_in="check_sweep", bad=(1e-8, "10", float("nan"))),
    Option("num_steps", "int", minimum=2),
    Option("smooth", "custom", checked_in="check_sweep", bad=(1.0, -0.1, "0.9")),
    Option("diverge_threshold", "custom", checked_in="check_sweep", bad=(1, 0.5, "4")),
    Option("plot", "bool"),
    Option("path", "custom", checked_in="_check_output", bad=(5, "missing/folder/lr.png")),
    Option("mode", "choice", choices=("exponential", "linear")),
    Option("apply", "bool"),
)


@known_keywords
@declared(_FIND_LR_OPTIONS)
def find_lr(
    model: Any,
    x: Any,
    y: Any = None,
    *,
    batch_size: int = 32,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    num_steps: int = 100,
    smooth: float = 0.98,
    diverge_threshold: float | None = 4.0,
    plot: bool = False,
    path: str | None = None,
    mode: str = "exponential",
    apply: bool = False,
) -> LRFinderResult:
    """Sweep the learning rate and suggest one (the LR range test, Smith 2017).

    Step ``i`` (0-based) trains one batch with every parameter group's learning rate set to
    ``start_lr * (end_lr / start_lr) ** (i / (num_steps - 1))`` (``mode="exponential"``) or
    ``start_lr + (end_lr - start_lr) * i / (num_steps - 1)`` (``mode="linear"``), cycling
    over the data as often as needed. The loss is smoothed as fastai and Lightning do:
    ``avg = smooth * avg + (1 - smooth) * loss`` and ``smoothed = avg / (1 - smooth ** (i + 1))``.
    The sweep stops early once the smoothed loss exceeds ``diverge_threshold`` times the best
    so far (or is not finite). The suggestion is the steepest descent of the smoothed loss
    (:meth:`LRFinderResult.suggest`, Lightning's rule). Afterwards the model, its optimizer
    (state and learning rates), scheduler, gradients and step count, and the RNG states
    (python, numpy, torch, CUDA) are exactly as before; the compiled scheduler does not step
    during the sweep. With ``apply`` the suggestion then becomes the learning rate
    (Lightning's ``update_attr``, see :func:`apply_lr`).

    Args:
        model: a compiled :class:`fitkit.Model`.
        x: inputs, as for :meth:`fitkit.Model.fit` (arrays, a Dataset, a DataLoader, ...).
        y: targets for in-memory ``x``.
        batch_size: samples per step (in-memory ``x`` and Datasets).
        start_lr: the first learning rate.
        end_lr: the last learning rate (reached at step ``num_steps - 1``).
        num_steps: optimizer steps of the sweep (>= 2).
        smooth: the smoothing factor in ``[0, 1)`` (0: no smoothing).
        diverge_threshold: stop when the smoothed loss passes this multiple of the best one
            (> 1); ``None`` runs every step.
        plot: draw the curve (:meth:`LRFinderResult.plot`).
        path: save the plot there as a PNG (implies ``plot``), written whole or not at all (a
            temp file renamed over it); its folder must exist (checked before the sweep).
        mode: ``"exponential"`` or ``"linear"`` (Lightning's ``mode``).
        apply: set the suggested rate on the optimizer (and scheduler) after the sweep; no
            suggestion: a ``FitkitWarning`` and nothing changes.

    Returns:
        An :class:`LRFinderResult` with ``lrs``, ``losses``, ``raw_losses`` and ``suggestion``.

    Raises:
        RuntimeError: the model is not compiled.
        TypeError: an argument of the wrong type, or a keyword it does not take.
        ValueError: a bad value, a ``path`` in a missing folder, or data that yields no batch.
        OSError: the plot cannot be written (a full disk); an older file at ``path`` is unchanged.

    Example:
        >>> import torch, fitkit
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(64, 4); y = x @ torch.ones(4, 1)
        >>> model = fitkit.Model(torch.nn.Linear(4, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> before = model.module.weight.clone()
        >>> result = find_lr(model, x, y, batch_size=16, start_lr=1e-4, end_lr=10.0, num_steps=30)
        >>> len(result.lrs) <= 30, result.lrs[0], torch.equal(model.module.weight, before)
        (True, 0.0001, True)
        >>> result = find_lr(model, x, y, batch_size=16, end_lr=1.0, num_steps=30, mode="linear", apply=True)
        >>> model.optimizer.param_groups[0]["lr"] == result.suggestion
        True
    """
    check_sweep(model, start_lr, end_lr, num_steps, smooth, diverge_threshold, mode, apply)
    _check_output(batch_size, plot, path)  # before the sweep: a bad path would fail after it
    loader = _data.as_loader(x, y, None, batch_size=batch_size, shuffle=True, device=model.device)
    result = sweep(model, loader, start_lr, end_lr, num_steps, smooth, diverge_threshold, mode)
    if apply:
        apply_lr(model, result.suggestion)
    if plot or path is not None:
        result.plot(path)
    return result


def _check_output(batch_size: Any, plot: Any, path: Any) -> None:
    """:func:`find_lr`'s ``batch_size``, ``plot`` and ``path``, checked before the sweep."""
    from fitkit.files.preflight import check_writable_template
    from fitkit.files.writing import check_target

    check_int("batch_size", batch_size, 1, fix="pass the samples per sweep step, e.g. batch_size=32.")
    check_bool("plot", plot)
    if path is not None:
        target = check_target(path, "path", "find_lr")
        folder = os.path.dirname(os.path.abspath(target))
        if not os.path.isdir(folder):
            raise ValueError(
                f"find_lr writes its plot at `path`, but the folder {folder!r} does not exist. Received: "
                f"path={str(path)!r}. Fix: create the folder first (os.makedirs), or pass a path in an existing one."
            )
        check_writable_template(target, None, "find_lr", "path")


def check_sweep(
    model: Any,
    start_lr: float,
    end_lr: float,
    num_steps: int,
    smooth: float,
    diverge_threshold: float | None,
    mode: str,
    apply: bool,
) -> None:
    """The checks of :func:`find_lr`'s arguments (also ``LearningRateFinder``'s, at construction).

    Raises:
        RuntimeError: the model is not compiled (``model=None`` skips that check).
        TypeError, ValueError: as :func:`find_lr` documents.
    """
    if model is not None and getattr(model, "optimizer", None) is None:
        raise RuntimeError("`find_lr` needs a compiled model. Call `model.compile(optimizer=..., loss=...)` first.")
    check_that("start_lr", start_lr, lambda v: v > 0, "> 0")
    check_that("end_lr", end_lr, lambda v: v > start_lr, f"> start_lr={start_lr!r}")
    check_that("smooth", smooth, lambda v: 0 <= v < 1, "in [0, 1)")
    if isinstance(num_steps, bool) or not isinstance(num_steps, int):
        raise TypeError(f"Expected `num_steps` to be an int. Received: num_steps={num_steps!r}.")
    if num_steps < 2:
        raise ValueError(f"Expected `num_steps` >= 2. Received: num_steps={num_steps!r}.")
    if diverge_threshold is not None:
        check_that("diverge_threshold", diverge_threshold, lambda v: v > 1, "> 1 or None")
    if mode not in ("exponential", "linear"):
        raise ValueError(f"Expected `mode` to be 'exponential' or 'linear'. Received: mode={mode!r}.")
    check_bool("apply", apply)


def sweep(
    model: Any,
    loader: Any,
    start_lr: float,
    end_lr: float,
    num_steps: int,
    smooth: float,
    diverge_threshold: float | None,
    mode: str = "exponential",
) -> LRFinderResult:
    """Run the sweep over ``loader`` (batches ``(x, y, sample_weight)``), then restore everything.

    Returns:
        The :class:`LRFinderResult`, its ``suggestion`` set.
    """
    snap = snapshot(model)
    try:
        result = _sweep(model, loader, start_lr, end_lr, num_steps, smooth, diverge_threshold, mode)
    finally:
        restore(model, snap)
    result.suggestion = result.suggest()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [result.suggestion]  # every rank applies rank 0's suggestion
        torch.distributed.broadcast_object_list(box, src=0)
        result.suggestion = box[0]
    return result


def apply_lr(model: Any, lr: float | None) -> bool:
    """Make ``lr`` the learning rate of the first parameter group, keeping the others' ratios.

    Every group's ``lr`` (and ``initial_lr``, ``max_lr``, ``min_lr`` where present) is
    multiplied by ``lr / reference``, where the reference is the compiled scheduler's first
    ``base_lrs`` if it has them (so a warm-up or decay keeps its shape), else the first
    group's ``lr``; the scheduler's ``base_lrs`` and last LRs follow. Tensor learning rates
    are filled in place.

    Args:
        model: a compiled :class:`fitkit.Model`.
        lr: the rate; ``None`` (no suggestion) warns and changes nothing.

    Returns:
        Whether it applied a rate.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> model.compile(optimizer=lambda p: torch.optim.SGD(
        ...     [{"params": [p[0]], "lr": 0.1}, {"params": [p[1]], "lr": 0.01}]), loss="mse")
        >>> apply_lr(model, 0.5), [g["lr"] for g in model.optimizer.param_groups]
        (True, [0.5, 0.05])
    """
    if lr is None:
        warnings.warn(
            "The LR finder made no suggestion (too few steps, or a flat loss): the learning rate "
            "is left as it was. Fix: widen [start_lr, end_lr] or take more steps.",
            category=FitkitWarning,
            stacklevel=2,
        )
        return False
    scheduler = model.scheduler
    base = getattr(scheduler, "base_lrs", None) or None
    groups = model.optimizer.param_groups
    factor = lr / float(base[0] if base else groups[0]["lr"])

    def scaled(value: Any, exact: bool) -> Any:
        new = lr if exact else value * factor  # the first group's reference gets `lr` exactly
        return value.fill_(new) if isinstance(value, torch.Tensor) else new

    for i, g in enumerate(groups):
        for key in ("lr", "initial_lr", "max_lr", "min_lr"):
            if key in g:
                g[key] = scaled(g[key], i == 0 and key == ("initial_lr" if base else "lr"))
    if base:
        scheduler.base_lrs = [lr] + [b * factor for b in base[1:]]
        if getattr(scheduler, "_last_lr", None) is not None:
            scheduler._last_lr = [float(g["lr"]) for g in groups]
    return True


def _sweep(model, loader, start_lr, end_lr, num_steps, smooth, diverge_threshold, mode) -> LRFinderResult:
    result = LRFinderResult(lrs=[], losses=[], raw_losses=[], mode=mode)
    groups = model.optimizer.param_groups
    epoch = 0
    it, avg, best = loader.epoch_batches(epoch), 0.0, math.inf
    for i in range(num_steps):
        batch = next(it, None)
        if batch is None:  # the data ran out: start another pass
            epoch += 1
            it = loader.epoch_batches(epoch)
            batch = next(it, None)
            if batch is None:
                if i == 0:
                    raise ValueError("`find_lr` got data that yields no batch. Fix: pass at least one sample.")
                break  # a one-shot iterable: the sweep ends with the data
        t = i / (num_steps - 1)
        lr = start_lr + (end_lr - start_lr) * t if mode == "linear" else start_lr * (end_lr / start_lr) ** t
        for g in groups:
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        loss = model.train_on_batch(*batch)["loss"]  # a host sync per step: the stop rule needs it
        avg = smooth * avg + (1 - smooth) * loss
        smoothed = avg / (1 - smooth ** (i + 1))
        result.lrs.append(lr)
        result.raw_losses.append(loss)
        result.losses.append(smoothed)
        if not math.isfinite(smoothed) or (
            diverge_threshold is not None and i > 0 and smoothed > diverge_threshold * best
        ):
            break
        best = min(best, smoothed)
    return result


# -- the model's state (the only code that reads private attributes) -----------------------------
def _clone(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def snapshot(model: Any) -> dict[str, Any]:
    """Everything a sweep (or a batch-size trial) changes, copied; the compiled scheduler is set
    aside until :func:`restore`."""
    opt = model.optimizer
    params = list(model.module.parameters())
    scaler = model.grad_scaler
    snap = {
        "module": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
        "opt_state": {p: {k: _clone(v) for k, v in s.items()} for p, s in opt.state.items()},
        "groups": [{k: _clone(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "opt_called": getattr(opt, "_opt_called", None),
        "scheduler": model.scheduler,
        "scheduler_state": None if model.scheduler is None else copy.deepcopy(model.scheduler.state_dict()),
        "scaler": None if scaler is None else copy.deepcopy(scaler.state_dict()),
        # The step count and the per-step record a sweep's steps overwrite (grad_norm, LRs used).
        "stepper": _clone(model._core.stepper.state_dict(record=True)),
        "stop_training": model.stop_training,
        "rng": (
            random.getstate(),
            np.random.get_state(),
            torch.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        ),
    }
    # Set aside: train_on_batch steps a per-step scheduler, and some (OneCycleLR) refuse to
    # step past their planned length.
    model.scheduler = None
    return snap


def restore(model: Any, snap: dict[str, Any]) -> None:
    """Put back what :func:`snapshot` copied: weights, gradients, optimizer, scheduler, grad
    scaler, step count, ``stop_training`` and the RNG states, bit for bit."""
    opt = model.optimizer
    with torch.no_grad():
        model.module.load_state_dict(snap["module"])  # copies in place: same tensors as before
        for p, g in zip(model.module.parameters(), snap["grads"], strict=True):
            p.grad = g
    opt.state.clear()
    opt.state.update(snap["opt_state"])
    for group, saved in zip(opt.param_groups, snap["groups"], strict=True):
        for k in [k for k in group if k != "params" and k not in saved]:
            del group[k]
        group.update(saved)
    if snap["opt_called"] is not None:
        opt._opt_called = snap["opt_called"]  # torch's "scheduler.step() before optimizer.step()" check
    elif hasattr(opt, "_opt_called"):
        del opt._opt_called
    model.scheduler = snap["scheduler"]
    if model.scheduler is not None:
        model.scheduler.load_state_dict(snap["scheduler_state"])
    if snap["scaler"] is not None:
        model.grad_scaler.load_state_dict(snap["scaler"])
    model._core.stepper.load_state_dict(snap["stepper"])
    model.stop_training = snap["stop_training"]
    py, np_state, torch_state, cuda = snap["rng"]
    random.setstate(py)
    np.random.set_state(np_state)
    torch.set_rng_state(torch_state)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
