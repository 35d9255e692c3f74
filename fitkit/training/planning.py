"""Planning a call before its first step: arguments, data, preflight, the callback list.

``fit``, ``evaluate`` and ``predict`` check everything they can here, before anything
changes: the arguments (:func:`call_args`, :func:`plan_fit`), the data and its first batch
(:func:`check_data`, through :mod:`fitkit.training.preflight`), the schedules, and the epoch-log keys
callbacks are told about (``params["metrics"]``). What a plan learns (the loaders, the
validation schedule, the example input for ``summary``) comes back in a :class:`FitPlan`; the
model stores what outlives the call.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, RandomSampler

from fitkit import data as _data
from fitkit import distributed as _distributed
from fitkit.callbacks.base import Callback, CallbackList, History
from fitkit.callbacks.progress import ProgressBar, resolve_verbose
from fitkit.callbacks.swap_ema import with_compiled_ema
from fitkit.callbacks.swapping import check_weight_swaps
from fitkit.checks import FitkitWarning, check_bool, check_callbacks, check_int, check_number
from fitkit.training import bounds as _bounds
from fitkit.training import budget as _budget
from fitkit.training import reach as _reach
from fitkit.training.lr_logs import lr_keys
from fitkit.training.micro_batches import check_micro_batches
from fitkit.training.optim import check_plateau_mode
from fitkit.training.preflight import first_batch_check, in_memory_check, leaves_no_trace
from fitkit.training.quick import QuickRun, check_quick
from fitkit.training.resume import check_resume_mode
from fitkit.training.step_validation import ValidationInterval, ValidationSchedule
from fitkit.training.token_budget import check_data_budgets, token_budget
from fitkit.training.validation_sets import ValidationSets, named_sets, prefixed_keys

if TYPE_CHECKING:
    from fitkit.data import DeviceLoader
    from fitkit.model import Model
    from fitkit.training.stepper import Stepper

__all__ = ["FitPlan", "call_args", "plan_fit", "check_data", "planned_keys", "callback_list"]


def call_args(
    batch_size: int | None, steps: int | None, verbose: object, callbacks: object, steps_name: str = "steps"
) -> tuple[int, int, list[Callback]]:
    """The arguments ``fit``, ``evaluate`` and ``predict`` share, checked.

    Returns:
        ``(batch_size, verbose, callbacks)``: ``None`` is a batch size of 32 (Keras), the
        verbosity resolved, the callbacks as a list.

    Example:
        >>> call_args(None, None, 0, None)
        (32, 0, [])
    """
    batch_size = 32 if batch_size is None else batch_size
    check_int("batch_size", batch_size, 1)
    check_int(steps_name, steps, 1, allow_none=True, fix=_WHOLE_BATCHES)
    return batch_size, resolve_verbose(verbose), check_callbacks(callbacks, Callback)


#: The fix for a float step count (Keras documents them as ints: whole batches).
_WHOLE_BATCHES = (
    "steps count whole batches (as in Keras); for a fraction of the data pass "
    "limit_train_batches= / limit_val_batches= a float, or epochs= a float."
)


@dataclass(frozen=True)
class FitPlan:
    """One ``fit`` call, resolved before step 1: every argument read, checked and turned into what
    the loop, the stepper, validation and the callbacks' params read (built by :func:`plan_fit`
    only, and never changed afterwards).

    Attributes:
        train: the training :class:`~fitkit.data.DeviceLoader` (this rank's share).
        val: the validation loader, :class:`ValidationSets` of named sets, or ``None``.
        schedule: the epochs that validate (``validation_freq``).
        interval: validation inside epochs (``validation_interval``), or ``None``.
        verbose: 0, 1 or 2, resolved.
        callbacks: the user's callbacks, with ``max_time``'s Timer and compile's EMA, less those a
            ``fast_dev_run`` leaves out.
        params: the callbacks' params (Keras' ``params``) beyond verbose / epochs / steps.
        example: the last first batch checked (``summary``'s input), or ``None``.
        initial_epoch: the first epoch (0-based).
        epochs: the last-epoch bound (``None``: unbounded, the step budget ends the fit).
        shown_epochs: ``params["epochs"]``: the bound, or the epochs the step budget takes.
        total_steps: the optimizer steps the fit plans (``None``: unknown).
        max_steps: the step budget (``None``: none); ``epochs=2.5`` becomes one.
        accumulation: a ``GradientAccumulationScheduler``'s schedule for this fit, or ``None``.
        validation_steps: batches per validation (``None``: all).
        validate_at_end: validate at the run's last step too (with ``interval``).
        min_epochs, min_steps: no stop request is heard before them.
        sanity_steps: validation batches run before step 1 (``num_sanity_val_steps``).
        resume: ``fit(resume=...)``: how a loaded checkpoint's position is taken.
    """

    train: Any
    val: Any
    schedule: ValidationSchedule
    interval: ValidationInterval | None
    verbose: int
    callbacks: tuple[Callback, ...]
    params: Mapping[str, Any]
    example: Any
    initial_epoch: int
    epochs: int | None
    shown_epochs: int | None
    total_steps: int | None
    max_steps: int | None
    accumulation: Any
    validation_steps: int | None
    validate_at_end: bool
    min_epochs: int | None
    min_steps: int | None
    sanity_steps: int
    resume: str | None


def plan_fit(model: Model, x: object, y: object, options: Mapping[str, Any]) -> FitPlan:
    """Read, check and resolve every argument of ``fit`` (``options``: its keywords by name), build
    its loaders and check its data; nothing changes before this returns.

    Raises:
        TypeError, ValueError: an argument or data that ``fit`` cannot run (see ``Model.fit``).
    """
    o = dict(options)
    _check_stop_options(o)
    quick = check_quick(
        o["fast_dev_run"],
        o["overfit_batches"],
        o["limit_train_batches"],
        o["limit_val_batches"],
        o["num_sanity_val_steps"],
        x=x,
        steps_per_epoch=o["steps_per_epoch"],
        validation_steps=o["validation_steps"],
    )
    callbacks = with_compiled_ema(model.compiled_ema, _with_time_budget(o["max_time"], o["callbacks"]))
    _check_batches_itself(x, o["batch_size"], "x", "batch_size")
    _check_batches_itself(o["validation_data"], o["validation_batch_size"], "validation_data", "validation_batch_size")
    _warn_shuffle_not_applied(x, o["shuffle"])
    o["batch_size"], o["verbose"], o["callbacks"] = call_args(
        o["batch_size"], o["steps_per_epoch"], o["verbose"], callbacks, "steps_per_epoch"
    )
    _apply_quick(o, quick)
    o["epochs"], fraction = _budget.fractional_epochs(o["epochs"])  # epochs=2.5: a step budget, below
    check_data_budgets(o["max_samples"], o["max_tokens"])
    # the sample or token budget ends the fit
    unbounded = (o["max_samples"] is not None or o["max_tokens"] is not None) and o["epochs"] is None
    o["epochs"] = None if unbounded else _budget.check_max_steps(o["max_steps"], o["epochs"])
    _check_scalars(o, x)
    schedule = ValidationSchedule(o["validation_freq"])
    interval = _check_interval(
        o["validation_interval"], o["validation_freq"], o["validation_data"], o["validation_split"]
    )
    _check_callbacks(model, o["callbacks"], o["validation_data"] is not None or bool(o["validation_split"]))
    _bounds.check_fit_bounds(x, o, quick, schedule, interval)  # before a batch is drawn (invariant 2)
    train, val, example = _loaders(model, x, y, o)
    if quick.active:
        val = quick.limit(train, val)  # the loaders capped; limit_val_batches=0: no validation
        interval = interval if val is not None else None
    _warn_nothing_to_train(model, o["initial_epoch"], o["epochs"])
    return _planned(model, o, x, train, val, example, schedule, interval, fraction, quick)


def _check_stop_options(o: dict[str, Any]) -> None:
    """``validate_at_end``, ``min_epochs`` and ``min_steps`` against the bounds they cannot pass."""
    check_bool("validate_at_end", o["validate_at_end"])
    check_resume_mode(o["resume"])
    for name, bound_name in (("min_epochs", "epochs"), ("min_steps", "max_steps")):
        value, bound = o[name], o[bound_name]
        check_int(name, value, 0, allow_none=True)
        if value is not None and isinstance(bound, int) and not isinstance(bound, bool) and value > bound:
            raise ValueError(
                f"{name}={value} asks for more than {bound_name}={bound}, which ends training first. "
                f"Fix: lower {name}, or raise {bound_name}."
            )
    if o["validate_at_end"] and o["validation_interval"] is None:
        raise ValueError(
            "validate_at_end=True adds a validation at the last step to those of `validation_interval`, "
            "but validation_interval is None (validations then run at epoch ends, the last one included). "
            "Fix: pass validation_interval=N, or drop validate_at_end."
        )


def _with_time_budget(max_time: object, callbacks: Iterable[Callback] | None) -> Any:
    """``callbacks`` with a :class:`~fitkit.callbacks.Timer` for ``fit(max_time=...)``."""
    if max_time is None:
        return callbacks
    from fitkit.callbacks.timer import Timer

    timer = Timer(max_time)  # checks the duration
    listed = list(callbacks or [])
    if any(isinstance(cb, Timer) for cb in listed):
        raise ValueError(
            "fit(max_time=...) adds a Timer, and the callbacks hold one already: two time budgets. "
            "Fix: pass one of them (max_time=, or Timer(duration=...))."
        )
    return [*listed, timer]


def _apply_quick(o: dict[str, Any], quick: QuickRun) -> None:
    """What ``fast_dev_run`` / ``overfit_batches`` replace of fit's arguments (:mod:`fitkit.training.quick`)."""
    if not quick.active:
        return
    for key, value in quick.overrides(o["initial_epoch"]).items():
        o[key] = value
    if quick.fast_dev_run:  # no files, no tuning: the callbacks that write or tune stay out
        o["callbacks"] = [cb for cb in o["callbacks"] if not cb.skip_in_fast_dev_run]


def _check_scalars(o: dict[str, Any], x: object) -> None:
    check_int("initial_epoch", o["initial_epoch"], 0)
    check_int("validation_steps", o["validation_steps"], 1, allow_none=True, fix=_WHOLE_BATCHES)
    check_int("validation_batch_size", o["validation_batch_size"], 1, allow_none=True)
    _check_shuffle(o["shuffle"], x)
    check_number("validation_split", o["validation_split"])
    if not 0 <= o["validation_split"] < 1:
        raise ValueError(
            f"Expected `validation_split` in [0, 1). Received: validation_split={o['validation_split']!r}. "
            "Fix: pass a fraction such as 0.2."
        )


def _check_callbacks(model: Model, callbacks: list[Callback], validates: bool) -> None:
    check_schedules(model, callbacks)
    check_micro_batches(model)
    check_weight_swaps(model, callbacks, validates=validates)  # one averaged copy validated on, one swapped in
    check_process_resources(callbacks)


def _loaders(model: Model, x: object, y: object, o: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``(train, val, example)``: the loaders of the training and validation data, their data
    checked before step 1 (the last first batch checked is ``summary``'s example)."""
    if x is None:
        raise ValueError("`fit` needs data. Received x=None. Fix: pass tensors, a Dataset or a DataLoader.")
    sample_weight, validation_data = o["sample_weight"], o["validation_data"]
    if o["validation_split"]:
        if validation_data is not None:
            warnings.warn(
                "`validation_data` is given, so `validation_split` is ignored.", category=FitkitWarning, stacklevel=4
            )
        else:
            (x, y, sample_weight), validation_data = _data.split_validation(x, y, sample_weight, o["validation_split"])
    train = _distributed.sharded(
        _data.as_loader,
        x,
        y,
        sample_weight,
        batch_size=o["batch_size"],
        shuffle=o["shuffle"],
        class_weight=o["class_weight"],
        steps=o["steps_per_epoch"],
        device=model.device,
    )
    val = None
    if validation_data is not None:
        val = validation_loaders(model, validation_data, o["validation_batch_size"] or o["batch_size"])
    example = check_data(model, train, "x", training=True)
    for name, loader in _named(val, "validation_data"):
        val_example = check_data(model, loader, name, training=False, validation=True)
        example = example if val_example is None else val_example
    return train, val, example


def _step_budget(
    train: DeviceLoader,
    accumulation: Callable[[int], int],
    fraction: float | None,
    max_samples: int | None,
    max_steps: int | None,
    max_tokens: int | None,
) -> int | None:
    """``max_steps`` with the budgets that become one: ``epochs=2.5``'s fraction, ``max_samples`` and
    ``max_tokens`` (each the window that reaches it; the smallest budget wins)."""
    if fraction is not None:  # the fraction's steps, or max_steps if that comes first
        steps = _budget.fraction_budget(train.num_batches, accumulation, fraction)
        max_steps = steps if max_steps is None else min(max_steps, steps)
    if max_samples is not None:  # a step budget: the window that reaches the samples ends the fit
        steps = _budget.sample_budget(train, accumulation, max_samples)
        max_steps = steps if max_steps is None else min(max_steps, steps)
    if max_tokens is not None:  # the same in tokens, counted as TokensSeen counts them
        steps = token_budget(train, accumulation, max_tokens)
        max_steps = steps if max_steps is None else min(max_steps, steps)
    return max_steps


def _planned(
    model: Model,
    o: dict[str, Any],
    x: object,
    train: DeviceLoader,
    val: DeviceLoader | ValidationSets | None,
    example: object,
    schedule: ValidationSchedule,
    interval: ValidationInterval | None,
    fraction: float | None,
    quick: QuickRun,
) -> FitPlan:
    """The budgets and the callbacks' params of a checked fit: the :class:`FitPlan`."""
    stepper, epochs, max_steps, initial_epoch = model._core.stepper, o["epochs"], o["max_steps"], o["initial_epoch"]
    fit_accumulation = _callback_schedule(stepper, o["callbacks"])
    accumulation = _accumulation(stepper, fit_accumulation)
    max_steps = _step_budget(train, accumulation, fraction, o["max_samples"], max_steps, o["max_tokens"])
    total, shown = _plan_steps(model, train, epochs, max_steps, accumulation)
    fit_steps = _reach.fit_steps(model.global_step, train.num_batches, accumulation, initial_epoch, epochs, max_steps)
    _reach.warn_unreachable(
        model,
        max_steps=max_steps,
        interval=interval,
        validation_interval=o["validation_interval"],
        steps=fit_steps,
        initial_epoch=initial_epoch,
        epochs=epochs,
        callbacks=o["callbacks"],
    )
    if interval is not None and interval.fraction:
        interval.plan(train.num_batches)  # ValueError when the epoch's steps are unknown
    if not quick.active:  # a quick run replaces the budgets; fitkit.training.budget
        steps_of = functools.partial(_budget.planned_steps, train.num_batches, accumulation, max_steps=None)
        _budget.check_minimums(o["min_epochs"], o["min_steps"], shown, total, steps_of)
    if interval is not None:
        interval.plan_run(total)  # a RunFraction: ValueError when the run's steps are unknown
    validates = val is not None
    by_epoch = validates and shown and interval is None
    # A source that makes its own batches (a DataLoader, an iterable of batches) records its own size.
    recorded = train.batch_size if _data.batches_itself(x) else o["batch_size"]
    params = {
        "batch_size": recorded,
        "do_validation": validates,
        "metrics": planned_keys(model, validates, val),
        # the (0-based) epochs whose validation is scheduled
        "validation_epochs": schedule.epochs(initial_epoch, shown) if by_epoch and shown else [],
        "validation_interval": o["validation_interval"],
        "max_steps": max_steps,
        "total_steps": total,
    }
    return FitPlan(
        train=train,
        val=val,
        schedule=schedule,
        interval=interval,
        verbose=o["verbose"],
        callbacks=tuple(o["callbacks"]),
        params=params,
        example=example,
        initial_epoch=initial_epoch,
        epochs=epochs,
        shown_epochs=shown,
        total_steps=total,
        max_steps=max_steps,
        accumulation=fit_accumulation,
        validation_steps=o["validation_steps"],
        validate_at_end=o["validate_at_end"],
        min_epochs=o["min_epochs"],
        min_steps=o["min_steps"],
        sanity_steps=quick.sanity_steps,
        resume=o["resume"],
    )


def _check_batches_itself(source: object, size: int | None, name: str, size_name: str) -> None:
    """``ValueError`` when a batch size is passed that a DataLoader would ignore (another size than its own).

    An iterable of batches other than a DataLoader has no size to compare with: the size passed is
    not used, and ``history.params["batch_size"]`` is ``None`` for it.
    """
    if size is None or not isinstance(source, DataLoader) or size == source.batch_size:
        return
    raise ValueError(
        f"`{size_name}` applies to arrays and Datasets only: `{name}` is a DataLoader, which makes its own "
        f"batches (batch_size={source.batch_size!r}), so {size_name}={size!r} would be ignored. Fix: drop "
        f"`{size_name}=` and set the batch size on the DataLoader, or pass its Dataset instead."
    )


def _check_shuffle(shuffle: object, x: object) -> None:
    """``shuffle``: a bool, or ``"batch"`` (Keras: chunks of ``batch_size`` rows) for in-memory ``x``."""
    if shuffle == "batch" and isinstance(shuffle, str):
        if not _data.is_in_memory(x):
            raise ValueError(
                "fit(shuffle='batch') shuffles chunks of batch_size rows of in-memory arrays (Keras' rule). "
                f"Received: x of type {type(x).__name__}. Fix: pass tensors or arrays, or shuffle=True / False "
                "(a DataLoader's own sampler decides its order)."
            )
        return
    if not isinstance(shuffle, bool):
        raise TypeError(
            f"Expected `shuffle` to be a bool. Received: shuffle={shuffle!r}. Fix: pass True, False or 'batch' "
            "(Keras: shuffle chunks of batch_size rows)."
        )


def _warn_shuffle_not_applied(x: object, shuffle: object) -> None:
    """A ``FitkitWarning`` for ``shuffle=False`` beside a DataLoader that shuffles: its sampler decides."""
    if shuffle is not False or not isinstance(x, DataLoader):
        return
    sampler = getattr(x.batch_sampler, "sampler", x.sampler)  # a BatchSampler's, else the loader's own
    if isinstance(sampler, RandomSampler):
        warnings.warn(
            "fit(shuffle=False) does not apply to a DataLoader, which draws its own order: this one shuffles "
            "(its sampler is a RandomSampler). Fix: build it with `DataLoader(..., shuffle=False)`, or pass its "
            "Dataset to fit with shuffle=False.",
            category=FitkitWarning,
            stacklevel=4,
        )


def _check_interval(value: object, validation_freq: object, validation_data: object, validation_split: float) -> Any:
    """``fit``'s ``validation_interval`` checked (a :class:`ValidationInterval`, or ``None``)."""
    if value is None:
        return None
    interval = ValidationInterval(value)
    if validation_data is None and not validation_split:
        raise ValueError(
            f"validation_interval={value!r} validates inside epochs, but fit has no validation data. Fix: pass "
            "`validation_data=` or `validation_split=`, or drop `validation_interval`."
        )
    if validation_freq != 1:
        raise ValueError(
            f"validation_interval={value!r} and validation_freq={validation_freq!r} both say when to validate. "
            "Fix: pass one of them (validation_interval validates inside epochs only)."
        )
    return interval


def _accumulation(stepper: Stepper, fit_accumulation: Callable[[int], int] | None) -> Any:
    """``epoch -> gradient_accumulation_steps`` of this fit."""
    k = stepper.accumulation
    return fit_accumulation or stepper.accumulation_schedule or (lambda epoch: k)


def _plan_steps(
    model: Model, train: DeviceLoader, epochs: int | None, max_steps: int | None, accumulation: Callable[[int], int]
) -> tuple[int | None, int | None]:
    """``(total_steps, epochs shown to callbacks)``; ``ValueError`` when a scheduler factory
    asks for the step count and it cannot be known."""
    stepper = model._core.stepper
    batches = train.num_batches
    total = _budget.planned_steps(batches, accumulation, epochs, max_steps)
    planned = stepper.scheduling.planned
    if planned is not None and total is None:
        raise ValueError(
            f"compile(scheduler=...) is a factory that takes `{planned.keyword}`, but the number of "
            f"optimizer steps of this fit is unknown: the training data ({type(train.batches).__name__}) has "
            "no length. Fix: pass `max_steps=` (or `steps_per_epoch=`) to fit."
        )
    shown = epochs if epochs is not None else _budget.budget_epochs(batches, accumulation, max_steps or 1)
    return total, shown


def _callback_schedule(stepper: Stepper, callbacks: list[Callback]) -> Any:
    """A GradientAccumulationScheduler's schedule for this fit (``None``: none in the list)."""
    by_callback = [cb for cb in callbacks if cb.accumulation_for(stepper.accumulation) is not None]
    if by_callback and (len(by_callback) > 1 or stepper.accumulation_schedule is not None):
        both = "compile(gradient_accumulation_steps={...}) and a GradientAccumulationScheduler"
        n = len(by_callback)
        two = both if stepper.accumulation_schedule is not None else f"{n} GradientAccumulationScheduler callbacks"
        raise ValueError(f"Two accumulation schedules for one fit: {two}. Fix: keep one of them.")
    return by_callback[0].accumulation_for(stepper.accumulation) if by_callback else None


def _warn_nothing_to_train(model: Model, initial_epoch: int, epochs: int | None) -> None:
    if epochs is not None and initial_epoch >= epochs:
        warnings.warn(
            f"initial_epoch={initial_epoch} >= epochs={epochs}: nothing will train (`epochs` is the index "
            "of the last epoch, as in Keras). Fix: pass epochs > initial_epoch.",
            category=FitkitWarning,
            stacklevel=4,
        )
    if not any(p.requires_grad for p in model.module.parameters()):
        warnings.warn(
            "The module has no trainable parameter: fit computes and logs the loss and metrics, but "
            "no weight changes. Fix: set `requires_grad=True` on the parameters to train.",
            category=FitkitWarning,
            stacklevel=4,
        )


def check_schedules(model: Model, callbacks: list[Callback]) -> None:
    """``ValueError`` when a compiled scheduler and an LR callback would both set the LR."""
    from fitkit.callbacks.lr import LearningRateScheduler, ReduceLROnPlateau

    check_plateau_mode(model.scheduler)  # fitkit feeds it a loss: mode must be "min"
    clash = [type(cb).__name__ for cb in callbacks if isinstance(cb, (LearningRateScheduler, ReduceLROnPlateau))]
    if model.scheduler is not None and clash:
        raise ValueError(
            f"compile(scheduler={type(model.scheduler).__name__}) and a {clash[0]} callback would both "
            "set the learning rate of the same optimizer, and their changes would multiply. Fix: "
            "use one of them: drop `scheduler=` from compile, or the callback."
        )


def check_data(model: Model, loader: _data.DeviceLoader, name: str, training: bool, validation: bool = False) -> Any:
    """The data checks before step 1 (:mod:`fitkit.training.preflight`); returns the first batch's ``x``
    when one was run (``summary``'s example), else ``None``."""
    src = loader.batches
    if not isinstance(src, _data.TensorBatches):
        if getattr(src, "num_batches", None) == 0:  # a DataLoader over an empty Dataset: known before step 1
            raise ValueError(
                f"`{name}` ({_data.loaders.source_name(src)}) has 0 batches. Fix: pass data "
                "with at least one sample (an empty Dataset or filter?)."
            )
        if validation:  # fit's validation runs after epoch 1: check its first batch now
            return _check_first_validation_batch(model, loader)
        return None
    if src.n == 0:
        raise ValueError(f"`{name}` has 0 samples. Fix: pass at least one sample (an empty split or filter?).")
    return in_memory_check(model, src, training=training and type(src) is _data.TensorBatches)


def _check_first_validation_batch(model: Model, loader: _data.DeviceLoader) -> Any:
    """A re-iterable validation source (a DataLoader, a list) gets its first batch checked
    before step 1, as training data does; the RNGs, the loader's own generators and the
    module's buffers are put back, so shuffling and training are unchanged."""
    source = getattr(loader.batches, "source", None)
    empty = getattr(loader.batches, "is_empty_iterator", None)
    if isinstance(source, Iterator) and empty is not None and empty():  # named now, not after epoch 1
        raise ValueError(
            f"`validation_data` ({type(source).__name__}) yields no batch, so the first validation, after the "
            "first epoch's training, would fail. Fix: pass data with at least one sample; a generator is used "
            "up after one pass, so pass a re-iterable such as a DataLoader or a list for validation in every epoch."
        )
    if source is None or isinstance(source, Iterator) or getattr(loader, "sharded", False):
        return None  # a one-shot iterator would lose its batch; under torchrun each rank has its own
    with leaves_no_trace(model.module, loader):
        batch = next(iter(loader), None)
        if batch is None:
            return None
        return first_batch_check(model, batch, label="first validation batch", training=False)


def validation_loaders(model: Model, data: object, batch_size: int | None, argument: str = "validation_data") -> Any:
    """The loader of one validation source, or :class:`ValidationSets` of a dict of named sets."""
    sets = named_sets(data, argument)

    def build(source: object) -> Any:
        return _distributed.sharded(_data.validation_loader, source, batch_size=batch_size, device=model.device)

    if sets is None:
        return build(data)
    prefixed_keys(list(sets), ["loss", *model.metrics.keys], argument)  # names that would overwrite a key
    return ValidationSets({name: build(source) for name, source in sets.items()})


def _named(val: DeviceLoader | ValidationSets | None, argument: str) -> list[tuple[str, Any]]:
    """``(how errors name it, loader)`` of each validation set (none for ``None``)."""
    if val is None:
        return []
    if isinstance(val, ValidationSets):
        return [(f"{argument}[{name!r}]", loader) for name, loader in val.items()]
    return [(argument, val)]


def planned_keys(model: Model, validates: bool, val: DeviceLoader | ValidationSets | None = None) -> list[str]:
    """Epoch-log keys fit will write, in order (``params["metrics"]``, as Keras has it)."""
    keys = ["loss", *model.metrics.keys]
    per_group = lr_keys(model.optimizer, model.scheduler) if model.optimizer is not None else []
    lr_names = ["learning_rate"] + [key for _, key in per_group]
    names = val.names if isinstance(val, ValidationSets) else []
    val_keys = [f"val_{k}" for k in prefixed_keys(names, ["loss", *model.metrics.keys])] if validates else []
    return keys + lr_names + val_keys


def callback_list(
    model: Model,
    callbacks: list[Callback],
    verbose: int,
    epochs: int | None,
    steps: int | None,
    history: History | None = None,
    **params: object,
) -> CallbackList:
    """The call's :class:`CallbackList`: the user's callbacks, then ``history`` and the bar."""
    verbose = verbose if _distributed.is_rank_zero() else 0  # torchrun: rank 0 prints
    cbs = list(callbacks)
    all_params = {"verbose": verbose, "epochs": epochs, "steps": steps, **params}
    if history is not None:
        cbs.append(history)  # its params: the shared dict, set by CallbackList
    if verbose and not any(isinstance(c, ProgressBar) for c in cbs):
        cbs.append(ProgressBar(verbose))
    return CallbackList(cbs, model, all_params)


def check_process_resources(callbacks: Sequence[Callback]) -> None:
    """Refuse two callbacks that hold the same process-wide resource (``Callback.process_resource``).

    Raises:
        ValueError: naming both callbacks, the resource and the fix.
        RuntimeError: a callback's resource is in use already (``resource_in_use()``: another
            torch profiler runs), naming it and the fix.

    Example:
        >>> from fitkit.callbacks import Profiler
        >>> check_process_resources([Profiler(verbose=0), Profiler(verbose=0)])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Expected one callback per process-wide resource. Received 2 holding torch.profiler ...
    """
    held: dict[str, list[str]] = {}
    for cb in callbacks or ():
        resource = cb.process_resource
        if resource:
            held.setdefault(resource, []).append(type(cb).__name__)
            why = cb.resource_in_use()
            if why:
                raise RuntimeError(f"{type(cb).__name__} cannot start: {why}")
    for resource, names in held.items():
        if len(names) > 1:
            raise ValueError(
                f"Expected one callback per process-wide resource. Received {len(names)} holding {resource}: "
                f"{', '.join(names)}. Fix: pass one of them (one Profiler can record several cycles: repeat=)."
            )
