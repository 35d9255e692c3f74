"""``Model.compile``'s work: every argument checked first, then the loss, metrics, optimizer,
scheduler and :class:`~fitkit.training.stepper.Stepper` built (nothing changes on a bad argument)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from fitkit.callbacks.accumulation import AccumulationSchedule
from fitkit.callbacks.swap_ema import compiled_ema
from fitkit.checks import check_bool, check_int, check_number
from fitkit.compile import resolve_jit_compile
from fitkit.devices import PRECISIONS
from fitkit.losses import resolve_loss
from fitkit.losses.labels import resolve_label_names
from fitkit.metrics import MetricSet
from fitkit.training.optim import check_plateau_mode, resolve_optimizer, resolve_scheduler
from fitkit.training.stepper import Stepper
from fitkit.training.steps import batch_denominator

if TYPE_CHECKING:
    from fitkit.model import Model

__all__ = ["Compiled", "compile_model"]


def _accumulation(steps: int | dict[int, int]) -> AccumulationSchedule | int:
    """``gradient_accumulation_steps`` checked: an int >= 1, or a schedule from a dict."""
    if isinstance(steps, dict):
        return AccumulationSchedule(steps, name="gradient_accumulation_steps")
    check_int(
        "gradient_accumulation_steps",
        steps,
        1,
        fix="pass an int >= 1, or a dict {first_epoch: micro-batches} such as {0: 8, 4: 4}.",
    )
    return int(steps)


def _check_precision(precision: str, device: torch.device) -> None:
    if precision not in PRECISIONS:
        raise ValueError(
            f"Unknown precision {precision!r}. Valid values: {', '.join(PRECISIONS)}. "
            "Fix: pass one of them, e.g. precision='bf16-mixed'."
        )
    if precision == "16-mixed" and device.type not in ("cuda", "cpu", "mps"):
        raise ValueError(f"precision='16-mixed' is not supported on {device.type}. Fix: use 'bf16-mixed' or '32'.")


class Compiled(NamedTuple):
    """What ``compile`` built: the model's public fields, and the core's stepper and forward."""

    loss: object
    ema: Any
    label_names: tuple[str, ...]
    stepper: Stepper
    metrics: object
    jit: object


def compile_model(model: Model, optimizer: object, loss: object, metrics: object, o: dict[str, Any]) -> Compiled:
    """Check compile's arguments (``o``: its keywords by name), then build what it sets; only the
    optimizer's construction (and FSDP's sharding before it) changes anything, after every check."""
    core, device = model._core, model.device
    _check_precision(o["precision"], device)
    accumulation = _accumulation(o["gradient_accumulation_steps"])
    check_bool("loss_scale", o["loss_scale"])
    check_int("micro_batch_size", o["micro_batch_size"], 1, allow_none=True)
    check_number("clip_grad_norm", o["clip_grad_norm"], positive=True, allow_none=True)
    check_number("clip_grad_value", o["clip_grad_value"], positive=True, allow_none=True)
    jit = resolve_jit_compile(o["jit_compile"], device)
    loss_fn = resolve_loss(loss, o["loss_weights"])
    metric_set = MetricSet(metrics)
    ema = compiled_ema(o["use_ema"], o["ema_momentum"], o["ema_overwrite_frequency"])
    labels = resolve_label_names(
        o["label_names"],
        model.module,
        o["shift_labels"],
        compiled=loss_fn is not None,
        pad=getattr(loss_fn, "ignore_index", None),
    )
    # Everything that can be checked is checked: only now does anything change.
    if core.parallel is not None:
        core.parallel.prepare(model.module, optimizer)  # FSDP shards before the optimizer exists
    opt = resolve_optimizer(optimizer, model.module, device)
    sched = resolve_scheduler(o["scheduler"], opt, o["scheduler_interval"])
    check_plateau_mode(sched)
    stepper = Stepper(
        opt,
        sched,
        o["scheduler_interval"],
        o["precision"],
        device,
        accumulation,
        o["clip_grad_norm"],
        o["clip_grad_value"],
        core.parallel,
        weigh=functools.partial(batch_denominator, model),
        sums=getattr(loss_fn, "reduction", "mean") == "sum",
        loss_scale=o["loss_scale"],
        micro_batch_size=o["micro_batch_size"],
    )
    return Compiled(loss_fn, ema, labels, stepper, metric_set.configure(loss_fn, device), jit)
