"""Quick runs: ``fit``'s ``fast_dev_run``, ``overfit_batches``, ``limit_train_batches``,
``limit_val_batches`` and ``num_sanity_val_steps`` (Lightning's Trainer flags of these names).

:func:`check_quick` checks the five arguments before anything runs and says how they change
the rest of ``fit``'s arguments (:meth:`QuickRun.overrides`); :meth:`QuickRun.limit` then caps
the loaders (:attr:`fitkit.data.DeviceLoader.limit`: the first ``n`` batches of every epoch's
pass), and :func:`sanity_check` runs the validation batches before step 1. Nothing here holds
state across epochs: a resumed fit is given the same arguments again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fitkit.callbacks.base import CallbackList
from fitkit.data.loaders import source_name
from fitkit.training.eval_loop import EvalLoop
from fitkit.training.preflight import leaves_no_trace
from fitkit.training.validation_sets import ValidationSets

if TYPE_CHECKING:
    from fitkit.data import DeviceLoader
    from fitkit.model import Model

__all__ = ["QuickRun", "check_quick", "sanity_check", "batches_of"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(name: str, value: int | float | None, allow_zero: bool = True) -> None:
    """An int ``>= 0`` (a batch count) or a float in ``[0, 1]`` (a fraction of an epoch)."""
    if value is None:
        return
    if not (_is_int(value) or isinstance(value, float)):
        raise TypeError(
            f"Expected `{name}` to be an int (batches) or a float in [0, 1] (a fraction of the epoch's batches). "
            f"Received: {name}={value!r} ({type(value).__name__})."
        )
    low = 0 if allow_zero else 1
    float_ok = 0 < value <= 1 or allow_zero and value == 0
    if _is_int(value) and value < low or isinstance(value, float) and not float_ok:
        expected = "an int >= 0 or a float in [0, 1]" if allow_zero else "an int >= 1 or a float in (0, 1]"
        raise ValueError(f"Expected `{name}` to be {expected}. Received: {name}={value!r}.")


def batches_of(name: str, value: int | float | None, n: int | None) -> int | None:
    """The batches ``value`` means of a source of ``n`` batches per epoch (``None``: all).

    An int is a count (more than ``n`` is all of them); a float a fraction:
    ``int(value * n)`` (Lightning's rule), ``1.0`` is all.

    Raises:
        ValueError: a fraction of a source whose length is unknown, or one that is 0 batches.

    Example:
        >>> batches_of("limit_train_batches", 0.25, 10), batches_of("limit_train_batches", 3, 10)
        (2, 3)
    """
    if value is None or isinstance(value, float) and value == 1.0:
        return None
    if _is_int(value):
        return int(value)
    if n is None:
        raise ValueError(
            f"{name}={value!r} is a fraction of an epoch, but the data has no length (an iterable or a generator). "
            f"Fix: pass an int number of batches, e.g. {name}=10."
        )
    count = int(value * n)
    if count == 0 and value > 0:
        raise ValueError(
            f"{name}={value!r} of {n} batches is int({value!r} * {n}) = 0 batches. Fix: pass a larger fraction "
            f"(at least {1 / n:.3g}) or an int number of batches."
        )
    return count


class QuickRun:
    """The quick-run arguments of one ``fit``, checked (see :func:`check_quick`).

    Attributes:
        fast_dev_run: batches of the smoke test (0: off).
        overfit_batches: the batches (int) or fraction (float) trained on every epoch (0: off).
        limit_train, limit_val: ``limit_train_batches`` / ``limit_val_batches`` (``None``: all).
        sanity_steps: validation batches run before step 1 (-1: all, 0: none).
    """

    def __init__(
        self,
        fast_dev_run: int,
        overfit_batches: int | float,
        limit_train: int | float | None,
        limit_val: int | float | None,
        sanity_steps: int,
    ):
        self.fast_dev_run, self.overfit_batches = fast_dev_run, overfit_batches
        self.limit_train, self.limit_val, self.sanity_steps = limit_train, limit_val, sanity_steps

    @property
    def active(self) -> bool:
        """Whether any of the options changes the fit."""
        return bool(
            self.fast_dev_run
            or self.overfit_batches
            or self.limit_train is not None
            or self.limit_val is not None
            or self.sanity_steps
        )

    def overrides(self, initial_epoch: int) -> dict[str, Any]:
        """The ``fit`` arguments these options replace: ``fast_dev_run`` runs one epoch
        (``epochs=initial_epoch + 1``, no ``max_steps``) that validates at its end
        (``validation_freq=1``, no ``validation_interval``); ``overfit_batches`` turns
        shuffling off (the same batches every epoch)."""
        if self.fast_dev_run:
            return {"epochs": initial_epoch + 1, "max_steps": None, "validation_freq": 1, "validation_interval": None}
        if self.overfit_batches:
            return {"shuffle": False}
        return {}

    def limit(self, train: DeviceLoader, val: DeviceLoader | ValidationSets | None) -> Any:
        """Cap the loaders (:attr:`~fitkit.data.DeviceLoader.limit`); returns the validation
        loader, ``None`` when ``limit_val_batches=0`` turns validation off."""
        n = self.fast_dev_run or self.overfit_batches or None
        train_limit = self.limit_train if n is None else n
        val_limit = self.limit_val if n is None else n
        name = "fast_dev_run" if self.fast_dev_run else "overfit_batches" if self.overfit_batches else None
        train.limit_to(batches_of(name or "limit_train_batches", train_limit, train.num_batches))
        if val is None:
            return None
        if val_limit == 0:
            return None  # Lightning's limit_val_batches=0: no validation

        def cap(loader: DeviceLoader) -> Any:
            loader.limit_to(batches_of(name or "limit_val_batches", val_limit, loader.num_batches))
            return loader

        return val.map(cap) if isinstance(val, ValidationSets) else cap(val)  # each named set capped alike


def check_quick(
    fast_dev_run: bool | int = False,
    overfit_batches: int | float = 0,
    limit_train_batches: int | float | None = None,
    limit_val_batches: int | float | None = None,
    num_sanity_val_steps: int = 0,
    *,
    x: object = None,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
) -> QuickRun:
    """Check ``fit``'s quick-run arguments before anything runs.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a bad value, or two arguments that both say how many batches to run:
            ``fast_dev_run`` with ``overfit_batches`` / ``limit_*_batches``, ``overfit_batches``
            with ``limit_*_batches``, ``limit_train_batches`` with ``steps_per_epoch``,
            ``limit_val_batches`` with ``validation_steps``; ``overfit_batches`` with data whose
            batches change from epoch to epoch (a shuffled DataLoader, a one-shot iterator).

    Example:
        >>> check_quick(fast_dev_run=True).overrides(initial_epoch=3)["epochs"]
        4
        >>> check_quick(limit_train_batches=5, steps_per_epoch=10)
        Traceback (most recent call last):
        ...
        ValueError: limit_train_batches=5 and steps_per_epoch=10 both set the batches of an epoch. ...
    """
    if not isinstance(fast_dev_run, (bool, int)):
        raise TypeError(
            f"Expected `fast_dev_run` to be a bool or an int >= 0 (batches). Received: fast_dev_run={fast_dev_run!r}."
        )
    if not isinstance(fast_dev_run, bool) and fast_dev_run < 0:
        raise ValueError(
            f"Expected `fast_dev_run` to be a bool or an int >= 0 (batches). Received: fast_dev_run={fast_dev_run!r}."
        )
    _check_count("overfit_batches", overfit_batches)
    _check_count("limit_train_batches", limit_train_batches, allow_zero=False)
    _check_count("limit_val_batches", limit_val_batches)
    if not _is_int(num_sanity_val_steps) or num_sanity_val_steps < -1:
        kind = TypeError if not _is_int(num_sanity_val_steps) else ValueError
        raise kind(
            "Expected `num_sanity_val_steps` to be an int >= 0 (validation batches before training) or -1 (all). "
            f"Received: num_sanity_val_steps={num_sanity_val_steps!r}."
        )
    n = int(fast_dev_run)
    overfit = overfit_batches or 0
    given = {
        k: v
        for k, v in (
            ("overfit_batches", overfit),
            ("limit_train_batches", limit_train_batches),
            ("limit_val_batches", limit_val_batches),
        )
        if v not in (None, 0)
    }
    if n and given:
        k, v = next(iter(given.items()))
        raise ValueError(
            f"fast_dev_run={fast_dev_run!r} and {k}={v!r} both set the batches to run (fast_dev_run runs "
            f"{n} of training and {n} of validation). Fix: pass one of them."
        )
    if overfit and (limit_train_batches is not None or limit_val_batches is not None):
        k = "limit_train_batches" if limit_train_batches is not None else "limit_val_batches"
        raise ValueError(
            f"overfit_batches={overfit!r} and {k}={given[k]!r} both set the batches to run (overfit_batches "
            "limits training and validation alike, as in Lightning). Fix: pass one of them."
        )
    if steps_per_epoch is not None and (limit_train_batches is not None or overfit):
        k, v = (
            ("limit_train_batches", limit_train_batches)
            if limit_train_batches is not None
            else ("overfit_batches", overfit)
        )
        raise ValueError(
            f"{k}={v!r} and steps_per_epoch={steps_per_epoch!r} both set the batches of an epoch. Fix: pass "
            f"one of them ({k} takes the first batches of every epoch's pass; steps_per_epoch carries the "
            "data iterator over to the next epoch)."
        )
    if validation_steps is not None and limit_val_batches is not None:
        raise ValueError(
            f"limit_val_batches={limit_val_batches!r} and validation_steps={validation_steps!r} both set the "
            "batches of a validation. Fix: pass one of them."
        )
    if overfit:
        _check_repeatable(x, overfit)
    return QuickRun(n, overfit, limit_train_batches, limit_val_batches, 0 if n else num_sanity_val_steps)


def _check_repeatable(x: object, overfit: int | float) -> None:
    """``overfit_batches`` needs the same first batches every epoch."""
    from torch.utils.data import DataLoader, RandomSampler

    why = None
    if isinstance(x, Iterator):
        why = "a one-shot iterator (a generator) yields other batches every epoch"
    elif isinstance(x, DataLoader) and isinstance(getattr(x, "sampler", None), RandomSampler):
        why = "the DataLoader shuffles (a RandomSampler), so its first batches differ every epoch"
    if why is not None:
        raise ValueError(
            f"overfit_batches={overfit!r} trains on the same batches every epoch, but {why}. Fix: pass a "
            "DataLoader with shuffle=False, a Dataset or tensors (fit then does not shuffle them)."
        )


def sanity_check(
    model: Model, val: DeviceLoader | ValidationSets | None, steps: int, validation_steps: int | None = None
) -> None:
    """Run ``steps`` validation batches (-1: all) of every set before training, as Lightning's
    sanity check; an error in validation (the forward, ``test_step``, a metric) is raised here,
    before step 1.

    No hook is called, nothing is logged, and nothing of it stays (the loop's invariant 3, see
    :func:`fitkit.training.preflight.leaves_no_trace`): the global RNGs (python, numpy, torch, the
    accelerators'), each validation DataLoader's own generators and samplers, the module's
    buffers (BatchNorm statistics), every submodule's mode, the grad mode and the metric template
    are as before. A one-shot source (a generator, an iterator) is teed: its first ``steps``
    batches are checked, and the first validation yields them again.

    ``validation_steps`` (fit's) bounds it as it bounds each validation: ``-1`` checks that many
    batches of a source without ``len()``.

    Raises:
        ValueError: ``steps=-1`` with a one-shot source without ``len()`` and no
            ``validation_steps`` (all of it would be held in memory), before any set runs.
    """
    if val is None or not steps:
        return
    sets = (
        [(f"validation_data[{n!r}]", v) for n, v in val.items()]
        if isinstance(val, ValidationSets)
        else [("validation_data", val)]
    )  # every named set, as Lightning checks each val loader
    counts = [
        _sanity_batches(what, loader, steps, validation_steps) for what, loader in sets
    ]  # all refusals before any run
    for (what, loader), n in zip(sets, counts, strict=True):
        batches = loader.batches
        with contextlib.ExitStack() as kept:
            if getattr(batches, "one_shot", False):
                if not hasattr(batches, "teed"):
                    continue  # a rank's share of a one-shot source under torchrun: not checked
                n = kept.enter_context(batches.teed(n))
            kept.enter_context(leaves_no_trace(model.module, loader))
            kept.enter_context(model._core.phases.template_kept())
            # EvalLoop restores the modes; an empty CallbackList: no hook, no log
            EvalLoop(model, loader, CallbackList([], model, {}), n, what=what).run()


def _sanity_batches(what: str, loader: DeviceLoader, steps: int, validation_steps: int | None) -> int | None:
    """The batches the sanity check runs of ``loader`` (``None``: all of a re-iterable source)."""
    n = loader.num_batches  # a source with len() stops there (an iterator that cycles too)
    if validation_steps is not None:  # a validation's bound is its sanity check's too
        n = validation_steps if n is None else min(validation_steps, n)
    if steps > 0:
        return steps if n is None else min(steps, n)
    if not getattr(loader.batches, "one_shot", False):
        return n
    if n is None:
        raise ValueError(
            f"Expected `num_sanity_val_steps` >= 1 for `{what}` ({source_name(loader)}), a one-shot source "
            "without len(): -1 checks all of it, which would then be held in memory so that validation still "
            f"sees it. Received: num_sanity_val_steps={steps}. Fix: pass num_sanity_val_steps=N (its first N "
            "batches are checked, then validated as usual), or a re-iterable such as a DataLoader or a list."
        )
    return n
