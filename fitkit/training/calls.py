"""The verbs of :class:`~fitkit.Model` past their checks: ``fit`` (:func:`run_fit`),
``evaluate``, ``predict`` and the single-batch calls. ``Model``'s methods hold the public
signatures and docstrings; each hands its arguments here by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from fitkit import data as _data
from fitkit import distributed as _distributed
from fitkit import nest
from fitkit.callbacks.base import History
from fitkit.checks import check_bool
from fitkit.losses.denominators import targets_count
from fitkit.modes import modes
from fitkit.training import planning
from fitkit.training.batch_results import batch_result
from fitkit.training.bounds import check_call_bound
from fitkit.training.budget import fresh_run
from fitkit.training.loop import EvalLoop, FitLoop, PredictLoop
from fitkit.training.optim import resolve_scheduler
from fitkit.training.preflight import cast_to_module
from fitkit.training.quick import sanity_check
from fitkit.training.validation_sets import named_sets, run_validation

if TYPE_CHECKING:
    from fitkit.model import Model

__all__ = ["prepare_fit", "run_fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch"]


def prepare_fit(model: Model, x: object, y: object, options: Mapping[str, Any]) -> planning.FitPlan:
    """Everything ``fit`` does before step 1: the plan (:func:`~fitkit.training.planning.plan_fit`),
    the sanity validation and a scheduler factory's planned steps; nothing else changes."""
    core = model._core
    stepper = core.require_compiled("fit")
    with fresh_run(stepper, options["reset_time"]):  # put back if planning raises
        plan = planning.plan_fit(model, x, y, options)
        core.keep_example(plan.example)
        sanity_check(
            model, plan.val, plan.sanity_steps, plan.validation_steps
        )  # before step 1: a broken validation fails now
        stepper.scheduling.build_planned(plan.total_steps, resolve_scheduler)
    return plan


def run_fit(model: Model, plan: planning.FitPlan, history: History) -> History:
    """Run a planned fit with ``history`` (``model.history``) last but the progress bar."""
    cbs = planning.callback_list(
        model, list(plan.callbacks), plan.verbose, plan.shown_epochs, plan.train.num_batches, history, **plan.params
    )
    loop = FitLoop(model, plan, cbs)
    del plan, cbs  # the loop holds the call's data and callbacks; it lets go when it ends
    with model._core.running(loop):
        loop.run()
    return history


def _values(model: Model, logs: dict[str, float], return_dict: bool) -> Any:
    if return_dict:
        return logs
    values = [logs[k] for k in ("loss", *model.metrics.keys) if k in logs]
    return values[0] if len(values) == 1 else values


def evaluate(model: Model, x: object, y: object, o: Mapping[str, Any]) -> Any:
    """``Model.evaluate`` (``o``: its keyword arguments by name)."""
    core = model._core
    core.require_compiled("evaluate")
    check_bool("return_dict", o["return_dict"])
    steps, return_dict = o["steps"], o["return_dict"]
    batch_size, verbose, callbacks = planning.call_args(o["batch_size"], steps, o["verbose"], o["callbacks"])
    check_call_bound(x, steps, "evaluate")
    sets = named_sets(x, "x") if y is None and o["sample_weight"] is None else None
    if sets is not None:
        return _evaluate_sets(model, sets, batch_size, verbose, steps, callbacks, return_dict)
    loader = _distributed.sharded(
        _data.as_loader, x, y, o["sample_weight"], batch_size=batch_size, device=model.device, steps=steps
    )
    core.keep_example(planning.check_data(model, loader, "x", training=False))
    cbs = planning.callback_list(model, callbacks, verbose, None, loader.num_batches)
    return _values(model, EvalLoop(model, loader, cbs, steps).run(), return_dict)


def _evaluate_sets(
    model: Model,
    sets: dict[str, Any],
    batch_size: int | None,
    verbose: int,
    steps: int | None,
    callbacks: list[Any],
    return_dict: bool,
) -> Any:
    val = planning.validation_loaders(model, sets, batch_size, argument="x")
    for name, loader in val.items():
        planning.check_data(model, loader, f"x[{name!r}]", training=False)
    cbs = planning.callback_list(model, callbacks, verbose, None, None)
    logs = run_validation(model, val.map(lambda loader: loader), cbs, steps, what="evaluate")
    if return_dict:
        return logs
    keys = [k for k in ("loss", *model.metrics.keys) if f"{val.names[0]}_{k}" in logs]
    per_set = [[logs[f"{name}_{k}"] for k in keys] for name in val.names]
    return [v[0] if len(v) == 1 else v for v in per_set]


def predict(model: Model, x: object, o: Mapping[str, Any]) -> Any:
    """``Model.predict`` (``o``: its keyword arguments by name)."""
    steps = o["steps"]
    batch_size, verbose, callbacks = planning.call_args(o["batch_size"], steps, o["verbose"], o["callbacks"])
    check_call_bound(x, steps, "predict")
    loader = _distributed.sharded(_data.as_loader, x, batch_size=batch_size, device=model.device, steps=steps)
    src = loader.batches
    in_memory = isinstance(src, _data.TensorBatches)
    if isinstance(src, _data.TensorBatches):
        cast_to_module(src, model.module)  # float64 arrays into a float32 module, as fit does
        if src.n == 0 and not _distributed.is_distributed():
            return model.predict_on_batch(src.x)
    cbs = planning.callback_list(model, callbacks, verbose, None, loader.num_batches)
    out = PredictLoop(model, loader, cbs, steps).run()
    nothing = isinstance(out, torch.Tensor) and out.numel() == 0 and out.dim() == 1
    if nothing and not in_memory:
        raise ValueError(
            f"`x` ({_data.loaders.source_name(src)}) yielded no batch, so there is nothing to "
            "predict. Fix: pass data with at least one sample (a generator is used up after one pass)."
        )
    return out


def train_on_batch(
    model: Model,
    x: object,
    y: object,
    sample_weight: object,
    class_weight: Mapping[int, float] | None,
    return_dict: bool = True,
) -> Any:
    """``Model.train_on_batch``: one optimizer step on one batch, its logs."""
    core = model._core
    stepper = core.require_compiled("train_on_batch")
    check_bool("return_dict", return_dict)
    batch = _data.device_batch(x, y, sample_weight, device=model.device, class_weight=class_weight)
    phases = core.phases
    totals = phases.new_totals()
    # targets_count(.., None): one batch's targets are not the scanned ones of a fit it runs within
    with (
        stepper.step_of_its_own(),
        modes(model.module, training=None, grad=True),
        phases.running(totals),
        targets_count(model.loss, None),
    ):
        model.train_step(batch)
    phases.adopt(totals)
    return batch_result(totals.result(), return_dict)


def test_on_batch(model: Model, x: object, y: object, sample_weight: object, return_dict: bool = True) -> Any:
    """``Model.test_on_batch``: the logs of one batch in eval mode."""
    core = model._core
    core.require_compiled("test_on_batch")
    check_bool("return_dict", return_dict)
    batch = _data.device_batch(x, y, sample_weight, device=model.device)
    totals = core.phases.new_totals()
    with modes(model.module, training=False, grad=False), core.phases.running(totals), targets_count(model.loss, None):
        model.test_step(batch)
    return batch_result(totals.result(), return_dict)


def predict_on_batch(model: Model, x: object) -> Any:
    """``Model.predict_on_batch``: the outputs of one batch, on the CPU."""
    batch = _data.device_batch(x, device=model.device)
    with modes(model.module, training=False, grad=False):
        return nest.concat([model.predict_step(batch)])
