"""Which log keys a callback can read, and when: checked before step 1, read at each decision.

``params["metrics"]`` is the plan of the epoch logs; ``model.validated`` says whether the
running epoch's validation ran. :func:`check_log_key` refuses, in ``on_train_begin``, a key no
log will hold; :func:`monitor_value` reads a key at a decision, ``None`` for a ``val_`` key on
an epoch that ``validation_freq`` left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "monitor_value",
    "check_log_key",
    "check_validation_monitor",
    "may_add_keys",
    "may_be_a_term",
    "is_term_key",
    "per_validation",
]


def monitor_value(
    logs: Mapping[str, Any] | None,
    monitor: str,
    who: str,
    params: Mapping[str, Any] | None = None,
    model: Any = None,
) -> float | None:
    """The monitored value as a float; ``None`` for a ``val_`` key on an epoch without validation.

    Whether this epoch validated is the fit loop's explicit state, never guessed from the
    keys: with ``params["do_validation"]`` (fit validates) and ``model.validated`` false
    (``validation_freq`` left this epoch out), a missing ``val_`` key means "no value this
    epoch". Any other missing key is an error. A key that is present is used whatever its
    prefix, so a ``val_f1`` that a callback earlier in the list computes works without
    ``validation_data``.

    Args:
        logs: the epoch (or batch) logs.
        monitor: the key to read.
        who: the callback's name, for the message.
        params: the callbacks' ``params`` (``do_validation``).
        model: the :class:`fitkit.Model` (its ``validated`` property).

    Raises:
        ValueError: ``monitor`` is not in ``logs`` (the message lists the keys there are).

    Example:
        >>> monitor_value({"loss": 0.5, "val_loss": torch.tensor(0.25)}, "val_loss", "EarlyStopping")
        0.25
        >>> monitor_value({"loss": 0.5}, "val_acc", "EarlyStopping")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: EarlyStopping monitors 'val_acc', which the logs do not hold. Available keys: loss. ...
    """
    logs = logs or {}
    if monitor not in logs:
        validates = bool((params or {}).get("do_validation", False))
        if monitor.startswith("val_") and validates and not getattr(model, "validated", False):
            return None  # validation_freq left this epoch out
        raise ValueError(
            f"{who} monitors {monitor!r}, which the logs do not hold. Available keys: "
            f"{', '.join(sorted(logs)) or '(none)'}. Fix: set `monitor` to one of them, or add the key "
            "from a callback earlier in the list."
        )
    value = logs[monitor]
    return float(value.item() if isinstance(value, torch.Tensor) else value)  # a batch log: syncs


def per_validation(callback: Any) -> bool:
    """Whether a monitoring callback acts at each validation (``on_validation_end``) instead
    of at epoch ends: the fit validates inside epochs (``validation_interval``) and the
    callback's ``monitor`` is a ``val_`` key (:mod:`fitkit.training.step_validation`).

    Example:
        >>> class Watch:
        ...     monitor, params = "val_loss", {"validation_interval": 10}
        >>> per_validation(Watch())
        True
    """
    params = getattr(callback, "params", None) or {}
    return bool(params.get("validation_interval")) and str(getattr(callback, "monitor", "")).startswith("val_")


def may_add_keys(model: Any) -> bool:
    """Whether a callback of the running fit may add log keys: one that is not fitkit's own.

    fitkit's stock callbacks add no key; a user's class (a subclass of a stock one included)
    or a ``LambdaCallback`` may. Unknown (no running fit) counts as "may".

    Example:
        >>> may_add_keys(None)
        True
    """
    callbacks = getattr(model, "callbacks", None)
    if not callbacks:
        return True
    return any(_user_code(type(cb)) for cb in callbacks)


def _user_code(cls: type) -> bool:
    # A LambdaCallback runs the user's functions; named here, not imported (no import cycle).
    return not cls.__module__.startswith("fitkit.") or (cls.__module__, cls.__qualname__) == (
        "fitkit.callbacks.misc",
        "LambdaCallback",
    )


def may_be_a_term(key: str, model: Any) -> bool:
    """Whether ``key`` may be a loss term's log (``loss_<name>``, ``val_loss_<name>``,
    ``val_<set>_loss_<name>``) of the compiled loss: a callable, which may return terms
    (:mod:`fitkit.losses.terms`) that are known only once it runs. The first decision then
    checks the key, as for a key that a callback may add.

    Example:
        >>> from fitkit.losses import Loss
        >>> class Compiled:
        ...     loss = Loss(lambda y_pred, y: {"kl": y_pred.mean()})
        >>> may_be_a_term("val_loss_kl", Compiled()), may_be_a_term("val_loss_kl", None)
        (True, False)
    """
    loss = getattr(model, "loss", None)
    return getattr(loss, "kind", None) == "custom" and is_term_key(key)


def is_term_key(key: str) -> bool:
    """Whether ``key`` names a loss term's log: ``loss_<name>`` after nothing or an ``_``.

    Example:
        >>> is_term_key("loss_kl"), is_term_key("val_noisy_loss_kl"), is_term_key("val_loss"), is_term_key("closs_x")
        (True, True, False, False)
    """
    return key.startswith("loss_") or "_loss_" in key


def _is_lr_key(key: str) -> bool:
    return key == "learning_rate" or key.startswith("learning_rate/")


def check_log_key(
    key: str,
    params: Mapping[str, Any],
    model: Any,
    who: str,
    *,
    subject: str | None = None,
    batch_level: Any = None,
) -> None:
    """Before step 1: ``key`` can hold a value when the callback decides, or ``ValueError``.

    ``params["metrics"]`` is the plan of the epoch logs (loss, metrics, learning rates, then
    ``val_`` keys when fit validates). A key outside the plan is an error unless a callback
    that may add keys (see :func:`may_add_keys`) is in the list; then the first decision
    checks it. At batch level (``batch_level`` is the ``save_freq``) the logs hold only the
    running loss and metrics: a ``val_`` or learning-rate key there is always an error.

    Args:
        key: the log key (a monitor, or a ``{key}`` field of a file name).
        params: the callbacks' ``params``; without ``"metrics"`` (no fit) nothing is checked.
        model: the :class:`fitkit.Model` (its ``callbacks``).
        who: the callback's name, for the message.
        subject: how the message names the use (default ``"<who> monitors '<key>'"``).
        batch_level: the ``save_freq`` of a batch-level decision, else ``None``.

    Raises:
        ValueError: a key no log will hold when the callback decides.

    Example:
        >>> params = {"do_validation": False, "metrics": ["loss", "learning_rate"]}
        >>> check_log_key("loss", params, None, "EarlyStopping")
        >>> check_log_key("val_loss", params, None, "ModelCheckpoint", batch_level=5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: ModelCheckpoint monitors 'val_loss' every 5 batches, but batch logs hold only ...
    """
    planned = params.get("metrics")
    if planned is None:
        return
    subject = subject or f"{who} monitors {key!r}"
    if batch_level is not None:
        planned = [k for k in planned if not k.startswith("val_") and not _is_lr_key(k)]
        if key.startswith("val_") or _is_lr_key(key):
            raise ValueError(
                f"{subject} every {batch_level} batches, but batch logs hold only the running training "
                f"values ({', '.join(planned)}); {key!r} exists at epoch ends only. Fix: pass "
                "save_freq='epoch', or use one of those keys."
            )
    if key in planned or may_add_keys(model) or may_be_a_term(key, model):
        return
    if key.startswith("val_") and not params.get("do_validation"):
        raise ValueError(
            f"{subject}, but fit has no validation data (and no callback in the list adds keys; the "
            f"logs will hold {', '.join(sorted(planned))}). Fix: pass `validation_data=` or "
            "`validation_split=` to fit, or use a training key such as 'loss'."
        )
    raise ValueError(
        f"{subject}, which the logs will not hold. Available keys: {', '.join(sorted(planned))} "
        "(params['metrics']; no callback in the list adds keys). Fix: use one of them, or compile "
        "the metric (model.compile(metrics=[...]))."
    )


def check_validation_monitor(monitor: str, params: Mapping[str, Any], who: str, model: Any = None) -> None:
    """Before the first step: :func:`check_log_key` for an epoch-level ``monitor``."""
    check_log_key(monitor, params, model, who)
