"""The largest batch that fits: :func:`find_batch_size` (Lightning's ``BatchSizeFinder`` /
``Tuner.scale_batch_size`` in its ``"power"`` mode).

Each trial trains ``steps_per_trial`` real optimizer steps at one batch size; a trial that runs
out of memory ends the search. Before every trial and at the end, everything a trial changes is
put back (:func:`fitkit.tools.lr_finder.snapshot` / :func:`~fitkit.tools.lr_finder.restore`:
weights, gradients, optimizer state and learning rates, scheduler, grad scaler, step count, RNG
states), so the model is bit for bit as before. Why no callback: ``fit`` plans its batches,
steps and schedule from ``batch_size`` before ``on_train_begin``; find the size first, then fit
with it.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import torch

from fitkit import data as _data
from fitkit.checks import check_int, known_keywords
from fitkit.checks.declared import Option, declare, declared
from fitkit.tools.lr_finder import restore, snapshot

__all__ = ["find_batch_size", "BatchSizeResult", "is_out_of_memory"]

#: What the allocators say when memory runs out (CUDA, cuDNN, the CPU allocator), as Lightning reads them.
_OOM_MESSAGES = ("out of memory", "can't allocate memory", "CUDNN_STATUS_NOT_SUPPORTED")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator running out of memory (``torch.OutOfMemoryError``, or a
    ``RuntimeError`` whose message says so).

    Example:
        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory")), is_out_of_memory(ValueError("x"))
        (True, False)
    """
    seen: BaseException | None = error
    while seen is not None:  # fitkit's first-batch checks chain the original error
        if isinstance(seen, torch.OutOfMemoryError):
            return True
        if isinstance(seen, RuntimeError) and any(m in str(seen) for m in _OOM_MESSAGES):
            return True
        seen = seen.__cause__
    return False


@dataclass
class BatchSizeResult:
    """What :func:`find_batch_size` measured.

    Attributes:
        batch_size: the largest size whose trial ran (samples per batch), ``None`` if none did.
        trials: ``(batch_size, fits)`` for every trial, in order.
    """

    batch_size: int | None
    trials: list[tuple[int, bool]] = field(default_factory=list)


_FIND_BATCH_SIZE_OPTIONS = declare(
    "find_batch_size",
    Option("x", "custom", checked_in="fitkit.data.as_loader", bad=("data", 5)),
    Option("y", "custom", checked_in="fitkit.data.as_loader", bad=("labels",)),
    Option("init_val", "int", minimum=1),
    Option("max_trials", "int", minimum=1),
    Option("steps_per_trial", "int", minimum=1),
    Option("max_val", "int", minimum=1, allow_none=True),
)


@known_keywords
@declared(_FIND_BATCH_SIZE_OPTIONS)
def find_batch_size(
    model: Any,
    x: Any,
    y: Any = None,
    *,
    init_val: int = 2,
    max_trials: int = 25,
    steps_per_trial: int = 3,
    max_val: int | None = None,
) -> BatchSizeResult:
    """Double the batch size from ``init_val`` until a trial runs out of memory; keep the last that fit.

    A trial at size ``b`` trains ``steps_per_trial`` batches of ``b`` samples (shuffled, as
    ``fit`` draws them; fewer when the data has fewer). The search stops at the first trial that
    runs out of memory (:func:`is_out_of_memory`), after ``max_trials`` trials, at ``max_val``,
    or once one batch holds every sample (a larger one would be the same batch). Any other
    error is raised. On the CPU "fits" means the trial raised no out-of-memory error. The
    model, its optimizer, scheduler, step count and the RNG states are then as before, bit for
    bit. Source: Lightning's ``BatchSizeFinder(mode="power")`` (its defaults: ``init_val=2``,
    ``max_trials=25``, ``steps_per_trial=3``).

    Args:
        model: a compiled :class:`fitkit.Model`.
        x: inputs as for ``fit``: tensors, arrays or a Dataset (a DataLoader has its own batch
            size, which fitkit cannot change).
        y: targets for in-memory ``x``.
        init_val: the first size tried (samples).
        max_trials: trials at most (>= 1).
        steps_per_trial: optimizer steps per trial (>= 1).
        max_val: no size above this is tried (``None``: no bound).

    Returns:
        A :class:`BatchSizeResult`: ``batch_size`` (``None`` when even ``init_val`` ran out of
        memory) and the ``trials``.

    Raises:
        RuntimeError: the model is not compiled, or it runs under torchrun (find the size on
            one process, then launch with it: an out-of-memory error on one rank inside a
            collective would leave the others waiting).
        TypeError: an argument of the wrong type, or a DataLoader as ``x``.
        ValueError: a bad value.

    Example:
        >>> import torch, fitkit
        >>> class Big(torch.nn.Linear):
        ...     def forward(self, x):  # stands in for a GPU that holds 24 samples
        ...         if len(x) > 24:
        ...             raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        ...         return super().forward(x)
        >>> model = fitkit.Model(Big(4, 1), device="cpu")
        >>> model.compile(optimizer="adam", loss="mse")
        >>> result = find_batch_size(model, torch.randn(100, 4), torch.randn(100, 1))
        >>> result.batch_size, result.trials
        (16, [(2, True), (4, True), (8, True), (16, True), (32, False)])
        >>> model.global_step
        0
    """
    if getattr(model, "optimizer", None) is None:
        raise RuntimeError("`find_batch_size` needs a compiled model. Call `model.compile(...)` first.")
    if model._core.parallel is not None:
        raise RuntimeError(
            "`find_batch_size` runs on one process: under torchrun an out-of-memory error on one rank would "
            "leave the others waiting in a collective. Fix: find the batch size on one process (per device), "
            "then launch with `fit(batch_size=...)`."
        )
    check_int("init_val", init_val, 1)
    check_int("max_trials", max_trials, 1)
    check_int("steps_per_trial", steps_per_trial, 1)
    check_int("max_val", max_val, init_val, allow_none=True)
    if isinstance(x, torch.utils.data.DataLoader):
        raise TypeError(
            "`find_batch_size` re-batches the data at every size, but a DataLoader has its own batch_size. "
            "Fix: pass its dataset (`loader.dataset`) or tensors."
        )
    result = BatchSizeResult(None)
    snap = snapshot(model)
    try:
        size, n = init_val, None
        for _ in range(max_trials):
            loader = _data.as_loader(x, y, None, batch_size=size, shuffle=True, device=model.device)
            n = _samples(loader, x)
            fits = _trial(model, loader, steps_per_trial)
            restore(model, snap)
            snap = snapshot(model)  # the next trial starts from the same state
            result.trials.append((size, fits))
            if not fits:
                break
            result.batch_size = size if n is None else min(size, n)
            if n is not None and size >= n or max_val is not None and size >= max_val:
                break
            size = size * 2 if max_val is None else min(size * 2, max_val)
    finally:
        restore(model, snap)
    return result


def _samples(loader: Any, x: Any) -> int | None:
    """The samples of the data, ``None`` when unknown."""
    src = loader.batches
    if isinstance(src, _data.TensorBatches):
        return int(src.n)
    return len(x) if isinstance(x, torch.utils.data.Dataset) and hasattr(x, "__len__") else None


def _trial(model: Any, loader: Any, steps: int) -> bool:
    """Train ``steps`` batches at this size; ``False`` if memory ran out."""
    try:
        for i, (bx, by, bw) in enumerate(loader):
            model.train_on_batch(bx, by, bw)
            if i + 1 >= steps:
                break
        return True
    except Exception as e:
        if not is_out_of_memory(e):
            raise
    model.optimizer.zero_grad(set_to_none=True)  # let the failed trial's tensors go
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return False
