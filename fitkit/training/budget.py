"""Step budgets: ``fit(max_steps=...)`` and the number of optimizer steps a fit plans.

A fit counts optimizer steps in ``global_step`` (one per accumulation window, a short last
window included), from the model's first fit on; a resumed fit continues that count from the
checkpoint. ``max_steps=N`` stops training once ``global_step`` reaches ``N`` (a window is
never cut: the check runs after a step). The epoch that the budget cuts still ends as any
epoch does (its logs, its validation, ``on_epoch_end`` and ``History``), as Lightning's
``max_steps`` does, and the next epoch does not start.

The planned count (:func:`planned_steps`) is ``max_steps`` when given, else ``epochs`` times
the optimizer steps per epoch (``ceil(batches / gradient_accumulation_steps)`` per epoch, each
epoch at its own accumulation), counted from epoch 0 as ``global_step`` is, so a resumed fit
plans the same number. A scheduler factory that takes ``total_steps`` (or Transformers'
``num_training_steps``) is built with it at the start of the first fit (:class:`PlannedScheduler`).

``max_samples=N`` (Composer's ``max_duration`` in samples) is a step budget too: before step 1,
:func:`sample_budget` walks the epochs' windows from epoch 0 (batch sizes known: in-memory data,
or a sized Dataset / DataLoader on one process) and takes the first step at whose window's end
the samples trained on, over all ranks, reach ``N``. The rule is the step budget's: a window is
never cut, so a budget that falls inside a window ends at that window's end (up to a window's
samples more). As ``max_steps`` it fills ``total_steps`` and resumes exactly; with both, the
smaller wins. ``max_tokens=N`` (Composer's ``max_duration`` in tokens) is the same rule in the
tokens ``TokensSeen`` counts (:mod:`fitkit.training.token_budget`); one of the two per fit.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from fitkit.callbacks.checkpoint_options import fraction_steps
from fitkit.checks import check_bool, check_int

if TYPE_CHECKING:
    import torch

    import fitkit.training.stepper  # named in full: the reference resolves it
    from fitkit.data import DeviceLoader

__all__ = [
    "PlannedScheduler",
    "planned_scheduler",
    "planned_steps",
    "budget_epochs",
    "check_max_steps",
    "fresh_run",
    "RunFraction",
    "check_minimums",
    "sample_budget",
    "window_budget",
]

#: The names under which a scheduler factory asks for the planned number of optimizer steps.
STEP_KEYWORDS = ("total_steps", "num_training_steps")


def check_max_steps(max_steps: object, epochs: int | None) -> int | None:
    """Check ``fit``'s ``max_steps`` and ``epochs``; returns the last-epoch bound.

    ``epochs=None`` is 1 without ``max_steps`` (Keras' default), and unbounded with it (the
    budget ends training, as Lightning's ``max_epochs`` is unlimited when ``max_steps`` is set).

    Raises:
        TypeError, ValueError: ``max_steps`` not an int >= 1, ``epochs`` not an int >= 0.

    Example:
        >>> check_max_steps(None, None), check_max_steps(100, None), check_max_steps(100, 3)
        (1, None, 3)
    """
    check_int(
        "max_steps",
        max_steps,
        1,
        allow_none=True,
        fix="pass the number of optimizer steps to train for, e.g. max_steps=1000, or None.",
    )
    if epochs is None:
        return 1 if max_steps is None else None
    check_int("epochs", epochs, 0)
    return int(epochs)


class RunFraction:
    """A fraction of the run's planned optimizer steps: ``fit(validation_interval=RunFraction(0.25))``
    validates after steps ``ceil(0.25 * T)``, ``ceil(0.5 * T)``, ``ceil(0.75 * T)`` and ``T`` of a
    run planned at ``T = params["total_steps"]`` steps (Composer's ``eval_interval="0.25dur"``),
    counted in ``global_step`` as the plan is, so a resumed run validates where the
    uninterrupted one does. (A plain float ``validation_interval`` is a fraction of each epoch,
    as Lightning's ``val_check_interval``; ``ModelCheckpoint(save_freq=0.25)`` takes the
    fraction of the run as a float, its ints being batches.)

    Args:
        value: the fraction, in ``(0, 1]``.

    Raises:
        TypeError: not a number. ValueError: outside ``(0, 1]``.

    Example:
        >>> sorted(RunFraction(0.25).steps(10)), RunFraction(0.5)
        ([3, 5, 8, 10], RunFraction(0.5))
    """

    def __init__(self, value: float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"Expected a number in (0, 1] for RunFraction. Received: {value!r}. Fix: e.g. RunFraction(0.25)."
            )
        if not math.isfinite(value) or not 0 < value <= 1:
            raise ValueError(
                f"Expected RunFraction's value in (0, 1] (a fraction of the run). Received: {value!r}. "
                "Fix: e.g. RunFraction(0.25) for four times over the run."
            )
        self.value = value
        self.fraction = Fraction(str(value))  # 0.1 is one tenth, not the nearest binary float

    def steps(self, total: int) -> frozenset[int]:
        """The ``global_step`` values of a run of ``total`` planned steps that it picks."""
        return fraction_steps(self.fraction, total)

    def __repr__(self) -> str:
        return f"RunFraction({self.value!r})"


@contextmanager
def fresh_run(stepper: fitkit.training.stepper.Stepper, reset_time: object) -> Iterator[None]:
    """``fit(reset_time=True)`` (Composer's ``reset_time``): the fit starts a fresh run, its
    time at 0. ``global_step`` restarts at 0, so ``max_steps``, the planned ``total_steps``, a
    ``save_freq`` fraction, ``validation_interval`` and ``{step}`` names count from this fit's
    first step, and a scheduler factory with a ``total_steps`` parameter is built again with
    this fit's plan (a scheduler object keeps its own count). The weights and the optimizer's
    state are kept: a fine-tune after pre-training. Without it (the default) ``epochs`` counts
    from ``initial_epoch`` in each call, as in Keras, and ``max_steps`` and the other step
    counts go on from the steps the model has taken, as in Lightning's ``max_steps``.

    Entered around the planning of ``fit``: if planning raises, ``global_step`` and the
    scheduler are put back as they were.

    Raises:
        TypeError: ``reset_time`` is not a bool.
    """
    check_bool("reset_time", reset_time)
    if not reset_time:
        yield
        return
    before = stepper.scheduling.rearm()
    step = stepper.restart_count(0)
    try:
        yield
    except BaseException:
        stepper.restart_count(step)
        stepper.scheduling.disarm(before)
        raise


def fractional_epochs(epochs: object) -> tuple[Any, float | None]:
    """``(epochs bound, fraction)`` of ``fit``'s ``epochs``: a float with a fractional part (the
    Trainer's ``num_train_epochs=2.5``) trains up to the next whole epoch under a step budget
    (:func:`fraction_budget`); a whole float is that int; anything else passes unchanged.

    Raises:
        ValueError: a float that is not finite or not > 0.

    Example:
        >>> fractional_epochs(2.5), fractional_epochs(3.0), fractional_epochs(4)
        ((3, 2.5), (3, None), (4, None))
    """
    if not isinstance(epochs, float):
        return epochs, None
    if not math.isfinite(epochs) or epochs <= 0:
        raise ValueError(
            f"Expected `epochs` to be an int >= 0 or a float > 0 (a fraction of an epoch, as the Trainer's "
            f"num_train_epochs). Received: epochs={epochs!r}. Fix: pass e.g. epochs=3 or epochs=2.5."
        )
    if epochs.is_integer():
        return int(epochs), None
    return math.ceil(epochs), epochs


def fraction_budget(batches: int | None, accumulation: Callable[[int], int], epochs: float) -> int:
    """The optimizer steps of ``epochs`` (a float) epochs from epoch 0: the whole epochs' steps,
    then the fraction of the next epoch's steps, rounded up (the Trainer's
    ``ceil(num_train_epochs * steps per epoch)``).

    Raises:
        ValueError: the batches per epoch are unknown (an iterable without a length).

    Example:
        >>> fraction_budget(10, lambda e: 1, 2.5), fraction_budget(10, lambda e: 4, 1.5)  # 20 + 5, 3 + 2
        (25, 5)
    """
    if not batches:
        raise ValueError(
            f"epochs={epochs!r} trains a fraction of an epoch, but the training data has no length, so the "
            "fraction has no step count. Fix: pass `steps_per_epoch=`, `max_steps=`, or a whole number of epochs."
        )
    whole = int(epochs)
    steps = sum(math.ceil(batches / accumulation(e)) for e in range(whole))
    return steps + math.ceil((epochs - whole) * math.ceil(batches / accumulation(whole)))


def planned_steps(
    batches: int | None, accumulation: Callable[[int], int], epochs: int | None, max_steps: int | None
) -> int | None:
    """The optimizer steps a fit plans: ``max_steps``, else the steps of epochs ``0 .. epochs - 1``.

    Args:
        batches: training batches per epoch (per process), ``None`` when unknown.
        accumulation: ``epoch -> gradient_accumulation_steps`` of that epoch.
        epochs: the last-epoch bound (``None``: unbounded).
        max_steps: the step budget, or ``None``.

    Returns:
        The count, or ``None`` when it cannot be known before the fit runs.

    Example:
        >>> planned_steps(10, lambda e: 4, 3, None)  # ceil(10 / 4) = 3 steps per epoch
        9
        >>> planned_steps(10, lambda e: 4 if e < 1 else 1, 3, None), planned_steps(None, lambda e: 1, 3, 50)
        (23, 50)
    """
    if max_steps is not None:
        return max_steps
    if batches is None or epochs is None:
        return None
    return sum(math.ceil(batches / accumulation(e)) for e in range(epochs))


def budget_epochs(batches: int | None, accumulation: Callable[[int], int], max_steps: int) -> int | None:
    """The epochs that ``max_steps`` optimizer steps take from epoch 0 (``params["epochs"]``
    when ``epochs`` is unbounded), ``None`` when the batches per epoch are unknown.

    Example:
        >>> budget_epochs(10, lambda e: 4, 7), budget_epochs(None, lambda e: 1, 7)
        (3, None)
    """
    if not batches:
        return None
    epoch, steps = 0, 0
    while steps < max_steps:
        steps += math.ceil(batches / accumulation(epoch))
        epoch += 1
    return epoch


def check_minimums(
    min_epochs: int | None,
    min_steps: int | None,
    epochs: int | None,
    total: int | None,
    steps_of: Callable[[int], int | None],
) -> None:
    """Refuse ``min_epochs`` / ``min_steps`` that the fit cannot reach before it ends.

    Args:
        min_epochs, min_steps: ``fit``'s minimums (counted from epoch 0 and step 0).
        epochs: the epochs the fit runs to (the bound, or those its step budget takes; ``None``: unknown).
        total: the optimizer steps it plans (``max_steps``, else the epochs' steps; ``None``: unknown).
        steps_of: ``epochs -> optimizer steps`` of that many epochs from epoch 0 (``None``: unknown).

    Raises:
        ValueError: a minimum beyond the end of the fit (``epochs=None`` runs 1 epoch without ``max_steps``).

    Example:
        >>> check_minimums(2, None, epochs=1, total=4, steps_of=lambda e: 4 * e)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: min_epochs=2 asks for more epochs than this fit runs (1; epochs=None runs 1 without max_steps). ...
        >>> check_minimums(None, 9, epochs=2, total=8, steps_of=lambda e: 4 * e)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: min_steps=9 asks for more optimizer steps than this fit plans (8). Fix: ...
    """
    fix = "Fix: lower {0}, or {1} epochs= (or max_steps=){2}."
    needed = steps_of(min_epochs) if min_epochs is not None else None
    if min_epochs is not None and (
        epochs is not None and min_epochs > epochs or needed is not None and total is not None and needed > total
    ):
        runs = f"{epochs}; epochs=None runs 1 without max_steps" if epochs == 1 else f"{epochs}"
        if epochs is not None and min_epochs <= epochs:
            runs = f"its step budget, {total} steps, ends it before {min_epochs} epochs, which take {needed}"
        raise ValueError(
            f"min_epochs={min_epochs} asks for more epochs than this fit runs ({runs}). "
            + fix.format("min_epochs", "pass", " to train that long")
        )
    if min_steps is not None and total is not None and min_steps > total:
        raise ValueError(
            f"min_steps={min_steps} asks for more optimizer steps than this fit plans ({total}). "
            + fix.format("min_steps", "raise", "")
        )


def epoch_sizes(loader: DeviceLoader) -> list[int] | None:
    """The samples of each global batch of an epoch of ``loader`` (over all ranks), ``None`` when
    unknown: in-memory data (any world size; under torchrun data that fitkit shards, not data
    marked ``already_sharded``, whose other shards this rank does not know), or on one process a
    DataLoader / Dataset with a length, a batch size and every batch kept; no ``steps_per_epoch``
    nor batch limit.

    Example:
        >>> from fitkit.data import as_loader
        >>> import torch
        >>> epoch_sizes(as_loader(torch.zeros(10, 2), batch_size=4))
        [4, 4, 2]
    """
    from fitkit.data import TensorBatches
    from fitkit.distributed.group import world_size

    if loader.steps is not None or loader.limit is not None:
        return None
    if loader.sharded == "user" and world_size() > 1:  # this rank's share: the global sizes are unknown
        return None
    src = loader.batches
    if isinstance(src, TensorBatches):
        n, size = src.n_used, src.batch_size * getattr(src, "world", 1)
    else:
        source = getattr(src, "source", None)
        dataset = getattr(source, "dataset", None)
        if world_size() > 1 or loader.batch_size is None or getattr(source, "drop_last", False) or dataset is None:
            return None
        try:
            n, size = len(dataset), int(loader.batch_size)
        except TypeError:
            return None
    return [min(size, n - start) for start in range(0, n, size)]


def sample_budget(loader: DeviceLoader, accumulation: Callable[[int], int], max_samples: int) -> int:
    """The optimizer steps of ``fit(max_samples=N)``: from epoch 0, the step whose window brings
    the samples trained on (over all ranks) to ``N`` or more. A window is never cut: the budget
    ends at the end of the window in which it is reached (the last window of an epoch may be short).

    Raises:
        ValueError: the sizes of the batches are not known before the fit (see :func:`epoch_sizes`).

    Example:
        >>> from fitkit.data import as_loader
        >>> import torch
        >>> loader = as_loader(torch.zeros(10, 2), batch_size=4)  # batches of 4, 4, 2
        >>> sample_budget(loader, lambda e: 1, 9), sample_budget(loader, lambda e: 2, 9)  # 4+4+2; 8+2
        (3, 2)
        >>> sample_budget(loader, lambda e: 2, 12)  # 10 in epoch 0 (2 steps), 8 more in the first step of epoch 1
        3
    """
    sizes = epoch_sizes(loader)
    if not sizes:
        raise ValueError(
            f"fit(max_samples={max_samples}) needs the size of every training batch before the fit: in-memory data "
            "(under torchrun not already_sharded), or on one process a Dataset or DataLoader with a length (no "
            "drop_last), without steps_per_epoch or batch limits. Fix: pass max_steps= (optimizer steps) instead, "
            "or such data."
        )
    return window_budget(sizes, accumulation, max_samples)


def window_budget(counts: list[int], accumulation: Callable[[int], int], budget: int) -> int:
    """The optimizer steps, from epoch 0, up to the end of the window whose ``counts`` (one per
    batch of every epoch, e.g. its samples or tokens) bring the total to ``budget`` or more; the
    budget of :func:`sample_budget` and :func:`fitkit.training.token_budget.token_budget`.

    Whole epochs are added at once (their total does not depend on the accumulation), then the
    windows of the epoch that reaches the budget are walked.

    Example:
        >>> window_budget([4, 4, 2], lambda e: 2, 5), window_budget([4, 4, 2], lambda e: 2, 21)  # 8; 10+10+8
        (1, 5)
    """
    per_epoch = sum(counts)
    if per_epoch <= 0:
        raise ValueError(f"An epoch counts {per_epoch} towards the budget of {budget}: it is never reached.")
    seen, steps, epoch = 0, 0, 0
    while seen + per_epoch < budget:  # the whole epoch stays below the budget
        seen += per_epoch
        steps += math.ceil(len(counts) / accumulation(epoch))
        epoch += 1
    k = accumulation(epoch)
    for start in range(0, len(counts), k):
        seen += sum(counts[start : start + k])
        steps += 1
        if seen >= budget:
            break
    return steps


class PlannedScheduler:
    """A scheduler factory that asks for the planned step count; built at the first fit.

    Args:
        factory: ``(optimizer, <keyword>=steps) -> scheduler``.
        keyword: ``"total_steps"`` or ``"num_training_steps"``.

    A checkpoint loaded before the first fit keeps its scheduler state here (:attr:`state`),
    loaded into the scheduler once it is built.
    """

    def __init__(self, factory: Callable[..., Any], keyword: str):
        self.factory, self.keyword = factory, keyword
        self.state: dict[str, Any] | None = None

    def keep(self, state: dict[str, Any] | None) -> None:
        """Keep a checkpoint's scheduler state until the scheduler is built."""
        self.state = state

    def build(self, optimizer: torch.optim.Optimizer, total: int) -> Any:
        """Call the factory with ``total`` optimizer steps."""
        return self.factory(optimizer, **{self.keyword: total})


def planned_scheduler(scheduler: object) -> PlannedScheduler | None:
    """A :class:`PlannedScheduler` when ``scheduler`` is a factory (a function or a
    ``functools.partial``, not a class) with a ``total_steps`` or ``num_training_steps``
    parameter left to fill, else ``None``.

    Example:
        >>> import functools, torch
        >>> def warmup_decay(opt, warmup, total_steps): ...
        >>> planned_scheduler(functools.partial(warmup_decay, warmup=2)).keyword
        'total_steps'
        >>> planned_scheduler(lambda opt: None) is None, planned_scheduler(torch.optim.lr_scheduler.OneCycleLR)
        (True, None)
    """
    if isinstance(scheduler, type) or not callable(scheduler):
        return None
    try:
        parameters = inspect.signature(scheduler).parameters
    except (TypeError, ValueError):
        return None
    for keyword in STEP_KEYWORDS:
        p = parameters.get(keyword)
        if keyword in getattr(scheduler, "keywords", {}):  # a functools.partial that fills it
            continue
        if p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            return PlannedScheduler(scheduler, keyword)
    return None
