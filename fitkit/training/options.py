"""The declared options of ``Model``, ``compile``, ``fit``, ``evaluate`` and ``predict``.

One module-level table per function (:mod:`fitkit.checks.declared`): kind, range, ``None``-ness,
excluded partners. ``Model``'s methods run them before their bodies; a fit plan reads
:data:`FIT` for what each option may hold. ``"custom"`` options name where their check runs
(it needs the data, the model or another option) and list values that must be refused.
"""

from __future__ import annotations

import datetime
import numbers

from fitkit.checks.declared import Option, declare

__all__ = ["MODEL", "COMPILE", "FIT", "EVALUATE", "PREDICT"]

_NAN = float("nan")
#: The fix for a float step count (as fit's own check says it: Keras documents them as ints).
_WHOLE = (
    "steps count whole batches (as in Keras); for a fraction of the data pass "
    "limit_train_batches= / limit_val_batches= a float, or epochs= a float."
)


def _check_max_time(value: object) -> None:
    """``fit(max_time=)`` is a :class:`~fitkit.callbacks.Timer`'s ``duration``, named as ``max_time``."""
    from fitkit.callbacks.timer import parse_duration

    if value is None:
        return
    try:
        parse_duration(value)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("`duration`", "`max_time`").replace("duration=", "max_time=")) from None


def _check_validation_data(value: object) -> None:
    """A str, a number or an object that is neither iterable nor indexable is no validation set
    (the loaders would name it ``x``)."""
    if value is None:
        return
    if isinstance(value, (str, bytes, numbers.Number)) or not (
        hasattr(value, "__iter__") or hasattr(value, "__getitem__")
    ):
        raise TypeError(
            f"Expected `validation_data` to be (x_val, y_val), a Dataset, a DataLoader, an iterable of batches "
            f"or a dict of named sets. Received: validation_data={value!r} ({type(value).__name__}). "
            "Fix: pass validation_data=(x_val, y_val)."
        )


MODEL = declare(
    "Model",
    Option("module", "custom", checked_in="Model.__init__", bad=("net", 5, None)),
    Option("device", "custom", checked_in="fitkit.devices.resolve_device", bad=("gpu0", 5)),
    Option("strategy", "custom", checked_in="fitkit.distributed.check_strategy", bad=("ddpp", 5)),
    Option("timeout", "custom", checked_in="fitkit.distributed.check_timeout", bad=(-1, 0, float("inf"), "60")),
    Option(
        "activation_checkpointing",
        "custom",
        checked_in="fitkit.training.recompute.check_recompute",
        bad=("all_of_them", 5),
    ),
)

COMPILE = declare(
    "Model.compile",
    Option("optimizer", "custom", checked_in="fitkit.training.optim.resolve_optimizer", bad=("adamm", 5, None)),
    Option("loss", "custom", checked_in="fitkit.losses.resolve_loss", bad=("msee", 5)),
    Option("metrics", "custom", checked_in="fitkit.metrics.MetricSet", bad=("acuracy", 5, ["acuracy"])),
    Option("loss_weights", "custom", checked_in="fitkit.losses.resolve_loss", bad=("1", _NAN)),
    Option("scheduler", "custom", checked_in="fitkit.training.optim.resolve_scheduler", bad=("cosine", 5)),
    Option(
        "scheduler_interval", "custom", checked_in="fitkit.training.optim.resolve_scheduler", bad=("batch", 1, None)
    ),
    Option("precision", "custom", checked_in="Model.compile", bad=("fp16", 16, "16")),
    Option(
        "gradient_accumulation_steps",
        "int",
        minimum=1,
        also=(dict,),
        fix="pass an int >= 1, or a dict {first_epoch: micro-batches} such as {0: 8, 4: 4}.",
    ),
    Option("clip_grad_norm", "number", positive=True, allow_none=True),
    Option("clip_grad_value", "number", positive=True, allow_none=True),
    Option("jit_compile", "custom", checked_in="fitkit.compile.resolve_jit_compile", bad=("yes", 2)),
    Option("use_ema", "bool"),
    Option("ema_momentum", "number", minimum=0.0, maximum=1.0, fix="pass the weight of the old average, e.g. 0.99."),
    Option("ema_overwrite_frequency", "int", minimum=1, allow_none=True),
    Option("label_names", "custom", checked_in="fitkit.losses.labels.resolve_label_names", bad=(5, [5])),
    Option("loss_scale", "bool"),
    Option("micro_batch_size", "int", minimum=1, allow_none=True),
    Option("shift_labels", "custom", checked_in="fitkit.losses.labels.resolve_label_names", bad=("yes", 1)),
)

FIT = declare(
    "Model.fit",
    Option("x", "custom", checked_in="fitkit.training.planning.check_data", bad=("data", 5)),
    Option("y", "custom", checked_in="fitkit.training.planning.check_data", bad=("labels",)),
    Option("batch_size", "int", minimum=1, allow_none=True),
    Option("epochs", "custom", checked_in="fitkit.training.budget", bad=(-1, "3", _NAN)),
    Option("verbose", "custom", checked_in="fitkit.callbacks.progress.resolve_verbose", bad=("loud", 3, -1)),
    Option("callbacks", "custom", checked_in="fitkit.checks.check_callbacks", bad=("cb", [5])),
    Option(
        "validation_split", "custom", checked_in="fitkit.training.planning.plan_fit", bad=(-0.1, 1.0, 1.5, "0.2", _NAN)
    ),
    Option("validation_data", "custom", check=_check_validation_data, bad=("val", 5)),
    Option("shuffle", "custom", checked_in="fitkit.training.planning._check_shuffle", bad=("yes", 1, None)),
    Option("class_weight", "custom", checked_in="fitkit.data.weights", bad=("balanced", [1.0, 2.0])),
    Option("sample_weight", "custom", checked_in="fitkit.data.weights", bad=("w",)),
    Option("initial_epoch", "int", minimum=0),
    Option("steps_per_epoch", "int", minimum=1, allow_none=True, fix=_WHOLE),
    Option("validation_steps", "int", minimum=1, allow_none=True, fix=_WHOLE),
    Option("validation_batch_size", "int", minimum=1, allow_none=True),
    Option("validation_freq", "custom", checked_in="fitkit.training.planning.plan_fit", bad=(0, "2", -1)),
    Option(
        "max_steps",
        "int",
        minimum=0,
        allow_none=True,
        fix="pass the number of optimizer steps to train for, e.g. max_steps=1000, or None.",
    ),
    Option(
        "validation_interval",
        "custom",
        checked_in="fitkit.training.planning.plan_fit",
        bad=(0, -1, "10", datetime.timedelta(0)),
    ),
    Option("validate_at_end", "bool"),
    Option("min_epochs", "int", minimum=0, allow_none=True),
    Option("min_steps", "int", minimum=0, allow_none=True),
    Option("max_time", "custom", check=_check_max_time, bad=(-1, "soon", 0)),
    Option("fast_dev_run", "custom", checked_in="fitkit.training.quick.check_quick", bad=(-1, "yes", 1.5)),
    Option("overfit_batches", "custom", checked_in="fitkit.training.quick.check_quick", bad=(-1, 1.5, "2")),
    Option("limit_train_batches", "custom", checked_in="fitkit.training.quick.check_quick", bad=(0, -1, 1.5, "2")),
    Option("limit_val_batches", "custom", checked_in="fitkit.training.quick.check_quick", bad=(-1, 1.5, "2")),
    Option("num_sanity_val_steps", "custom", checked_in="fitkit.training.quick.check_quick", bad=(-2, "1", 1.5)),
    Option("resume", "custom", checked_in="fitkit.training.resume.check_resume_mode", bad=("restart", 1)),
    Option("max_samples", "int", minimum=1, allow_none=True, example=10),
    Option(
        "max_tokens",
        "int",
        minimum=1,
        allow_none=True,
        excludes=("max_samples",),  # one budget in data (max_steps may cap either)
        example=100,
        fix="pass the tokens to train on, e.g. max_tokens=1_000_000.",
    ),
    Option("reset_time", "bool"),
)

EVALUATE = declare(
    "Model.evaluate",
    Option("x", "custom", checked_in="fitkit.training.planning.check_data", bad=("data", 5)),
    Option("y", "custom", checked_in="fitkit.training.planning.check_data", bad=("labels",)),
    Option("batch_size", "int", minimum=1, allow_none=True),
    Option("verbose", "custom", checked_in="fitkit.callbacks.progress.resolve_verbose", bad=("loud", 3, -1)),
    Option("sample_weight", "custom", checked_in="fitkit.data.weights", bad=("w",)),
    Option("steps", "int", minimum=1, allow_none=True, fix=_WHOLE),
    Option("callbacks", "custom", checked_in="fitkit.checks.check_callbacks", bad=("cb", [5])),
    Option("return_dict", "bool"),
)

PREDICT = declare(
    "Model.predict",
    Option("x", "custom", checked_in="fitkit.data.as_loader", bad=("data", 5)),
    Option("batch_size", "int", minimum=1, allow_none=True),
    Option("verbose", "custom", checked_in="fitkit.callbacks.progress.resolve_verbose", bad=("loud", 3, -1)),
    Option("steps", "int", minimum=1, allow_none=True, fix=_WHOLE),
    Option("callbacks", "custom", checked_in="fitkit.checks.check_callbacks", bad=("cb", [5])),
)
