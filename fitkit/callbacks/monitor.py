"""Callbacks that watch a logged value: ``EarlyStopping`` and ``ReduceLROnPlateau``.

Also the pieces every monitoring callback shares: which direction is better
(:func:`resolve_mode`), the reset-unless-restored state protocol (:class:`StatefulCallback`),
and, re-exported from :mod:`fitkit.callbacks.logkeys`, reading the value
(:func:`monitor_value`) and checking a key before step 1 (:func:`check_log_key`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fitkit.callbacks.base import Callback
from fitkit.callbacks.logkeys import (
    check_log_key,
    check_validation_monitor,
    is_term_key,
    may_add_keys,
    monitor_value,
    per_validation,
)
from fitkit.callbacks.scoring import scored_weights
from fitkit.checks import check_bool, check_int, check_mode, check_number
from fitkit.checks.declared import Option, declare, declared, mode_option, verbose_option
from fitkit.distributed import say
from fitkit.formatting import format_value

__all__ = [
    "EarlyStopping",
    "StatefulCallback",
    "resolve_mode",
    "monitor_value",
    "is_improvement",
    "check_log_key",
    "may_add_keys",
    "per_validation",
]

# Keys (without ``val_``) whose smaller values are better, besides anything ending in
# "loss" or "error".
_MIN_KEYS = {"mae", "mse", "rmse", "msle", "mape", "smape", "wmape", "perplexity", "huber", "hinge"}


def resolve_mode(monitor: str, mode: str, model: Any = None, who: str = "The callback") -> str:
    """``"min"`` or ``"max"`` for ``monitor``; ``mode="auto"`` infers it.

    ``auto`` is ``min`` for loss / error keys (``loss``, ``val_loss``, ``mae``, ``rmse``, any
    key ending in ``loss`` or ``error``, a loss term's ``loss_<name>``), follows the compiled torchmetrics metric's
    ``higher_is_better`` otherwise (``val_auroc`` -> ``max``), and refuses to guess the rest.

    Raises:
        ValueError: ``mode`` is not ``"auto"``, ``"min"`` or ``"max"``, or ``auto`` cannot tell.

    Example:
        >>> resolve_mode("val_loss", "auto"), resolve_mode("val_rmse", "auto"), resolve_mode("f1", "max")
        ('min', 'min', 'max')
    """
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"Expected `mode` to be 'auto', 'min' or 'max'. Received: mode={mode!r}.")
    if mode != "auto":
        return mode
    key = monitor[4:] if monitor.startswith("val_") else monitor
    if key in _MIN_KEYS or key.endswith("loss") or key.endswith("error") or is_term_key(key):
        return "min"  # a loss term (loss_<name>) is minimised with its loss
    metrics = getattr(model, "metrics", None)
    higher = metrics.higher_is_better(key) if metrics is not None else None
    if higher is not None:
        return "max" if higher else "min"
    raise ValueError(
        f"{who} cannot tell whether a larger or smaller {monitor!r} is better. Fix: pass mode='min' or mode='max'."
    )


def is_improvement(
    current: float, reference: float, mode: str, min_delta: float = 0.0, threshold_mode: str = "abs"
) -> bool:
    """Whether ``current`` beats ``reference`` by more than ``min_delta`` (NaN never does).

    ``threshold_mode="rel"`` counts ``min_delta`` as a fraction of ``reference``, as torch's
    ``ReduceLROnPlateau`` and skorch do: better than ``reference * (1 - min_delta)`` for
    ``min``, than ``reference * (1 + min_delta)`` for ``max``.

    Example:
        >>> is_improvement(0.5, 1.0, "min"), is_improvement(0.95, 1.0, "min", min_delta=0.1)
        (True, False)
        >>> is_improvement(9.0, 10.0, "min", 0.05, "rel"), is_improvement(9.6, 10.0, "min", 0.05, "rel")
        (True, False)
    """
    if math.isnan(current):
        return False
    delta = abs(min_delta)
    if threshold_mode == "rel":
        return current < reference * (1 - delta) if mode == "min" else current > reference * (1 + delta)
    if mode == "min":
        return current + delta < reference
    return current - delta > reference


class StatefulCallback(Callback):
    """A callback whose state resets at ``on_train_begin`` unless a checkpoint restored it.

    Subclasses implement ``_reset()``, ``_get_state()`` and ``_set_state(state)``; an instance
    can then be reused across ``fit`` calls, and ``load_state_dict`` before ``fit`` (or a
    checkpoint fit resumes from) carries the state into the next fit.

    Example:
        >>> class Count(StatefulCallback):
        ...     def _reset(self): self.n = 0
        ...     def _get_state(self): return {"n": self.n}
        ...     def _set_state(self, state): self.n = state["n"]
        >>> c = Count(); c.load_state_dict({"n": 3}); c.on_train_begin(); c.n
        3
        >>> c.on_train_begin(); c.n
        0
    """

    _restored = False

    def _reset(self) -> None: ...

    def _get_state(self) -> dict[str, Any]:
        return {}

    def _set_state(self, state: dict[str, Any]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return self._get_state()

    def loaded_by_fit(self) -> None:
        """The fit loaded this state itself (after ``on_train_begin``): nothing left to keep."""
        self._restored = False

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._set_state(state)
        self._restored = True  # consumed by the next on_train_begin

    def on_train_begin(self, logs=None):
        if self._restored:
            self._restored = False
        else:
            self._reset()


_EARLY_STOPPING_OPTIONS = declare(
    "EarlyStopping",
    Option("monitor", "text"),
    Option("min_delta", "number"),
    Option("patience", "int", minimum=0),
    mode_option(),
    Option("baseline", "number", allow_none=True),
    Option("restore_best_weights", "bool"),
    Option("start_from_epoch", "int", minimum=0),
    verbose_option(),
    Option("stopping_threshold", "number", allow_none=True),
    Option("divergence_threshold", "number", allow_none=True),
    Option("check_finite", "bool"),
    Option("threshold_mode", "choice", choices=("abs", "rel")),
)


class EarlyStopping(StatefulCallback):
    """Stop training when ``monitor`` has stopped improving (Keras semantics).

    Each epoch from ``start_from_epoch`` on, a value better than the best by more than
    ``min_delta`` becomes the best; training stops once ``patience`` epochs in a row brought
    none. With a ``baseline``, the wait only restarts on values that also beat the baseline,
    so a baseline never beaten stops training after ``patience`` epochs. With
    ``restore_best_weights``, the weights of the best epoch (a deep copy, taken when it ended)
    are put back when training ends, whatever ended it. With ``fit(validation_interval=...)``
    and a ``val_`` monitor it decides at each validation (``on_validation_end``) instead of at
    epoch ends, and ``patience`` counts validations (:mod:`fitkit.training.step_validation`).

    Three more criteria stop at once, checked in this order before the patience rule
    (Lightning's ``EarlyStopping``): ``check_finite`` stops on a NaN or infinite value,
    ``stopping_threshold`` on a value strictly better than it (that epoch still counts as
    the best when it is), ``divergence_threshold`` on a value strictly worse than it. Like the
    patience rule they apply from ``start_from_epoch`` on. ``stop_reason`` then says why
    training stopped (``None`` while it has not), and ``verbose=1`` prints it.

    A NaN value is never the best, not even the first one: it counts as an epoch without
    improvement (as in Keras, where NaN compares false), and ``restore_best_weights`` never
    restores the weights of a NaN epoch. On epochs that ``validation_freq`` leaves out, a
    ``val_`` monitor has no value and the epoch is skipped (it does not count towards
    ``patience``); whether an epoch validated is :attr:`fitkit.Model.validated`. A ``val_`` key
    that a callback earlier in the list adds (a score on a held-out set of its own) works
    without ``validation_data``.

    Args:
        monitor: the epoch log key to watch, e.g. ``"val_loss"``.
        min_delta: the smallest change that counts as an improvement.
        threshold_mode: ``"abs"`` (Keras): better than the best by more than ``min_delta``;
            ``"rel"`` (torch's plateau scheduler, skorch): better than ``best * (1 -
            min_delta)`` for ``min``, ``best * (1 + min_delta)`` for ``max``. Also for
            ``baseline``.
        patience: epochs without improvement before stopping.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (see :func:`resolve_mode`).
        baseline: a value the monitor must beat for the wait to restart.
        restore_best_weights: restore the best epoch's weights at the end of training (this
            wins over an averaging callback's swap at the end, in either list order).
        start_from_epoch: epochs to ignore at the start (warm-up).
        verbose: 1 prints a line when it stops or restores.
        stopping_threshold: stop as soon as the monitor is better than this (e.g. a target
            loss reached).
        divergence_threshold: stop as soon as the monitor is worse than this (e.g. a loss
            that blew up).
        check_finite: stop as soon as the monitor is NaN or infinite. Off by default (Keras
            counts a NaN as an epoch without improvement); Lightning's default is on.

    Attributes:
        stopped_epoch: the 0-based epoch at which training was stopped (0 if it was not).
        stop_reason: why it stopped, one sentence starting with ``"patience"``,
            ``"stopping_threshold"``, ``"divergence_threshold"`` or ``"not finite"`` (see
            the example); ``None`` if it did not stop.

    Raises:
        ValueError: bad arguments (a NaN threshold too); at ``on_train_begin``, a direction
            ``auto`` cannot infer, or a monitor the epoch logs will not hold
            (``params["metrics"]``, e.g. a ``val_`` key without validation data) while no
            callback that may add keys is in the list; at an epoch end, a monitor key the logs
            do not hold (the message lists them).

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1, bias=False), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x = torch.zeros(4, 1)  # the loss stays 0: no improvement after epoch 0
        >>> stop = EarlyStopping(monitor="loss", patience=1)
        >>> history = model.fit(x, x, epochs=10, callbacks=[stop], verbose=0)
        >>> stop.stopped_epoch, len(history.epoch)
        (1, 2)
        >>> stop.stop_reason
        'patience: loss did not improve for 1 epoch(s); best 0.0000 at epoch 1.'
    """

    @declared(_EARLY_STOPPING_OPTIONS)
    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
        verbose: int = 0,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_finite: bool = False,
        threshold_mode: str = "abs",
    ):
        super().__init__()
        check_bool("restore_best_weights", restore_best_weights)
        if not isinstance(monitor, str):
            raise TypeError(f"Expected `monitor` to be a log key (str). Received: monitor={monitor!r}.")
        check_number("min_delta", min_delta, minimum=-math.inf)
        if threshold_mode not in ("abs", "rel"):
            raise ValueError(
                f"Expected `threshold_mode` to be 'abs' or 'rel'. Received: threshold_mode={threshold_mode!r}."
            )
        self.threshold_mode = threshold_mode
        check_int("patience", patience, 0)
        check_mode(mode)
        for name, value in (
            ("baseline", baseline),
            ("stopping_threshold", stopping_threshold),
            ("divergence_threshold", divergence_threshold),
        ):
            if value is not None:
                check_number(name, value, minimum=-math.inf)
        check_int("start_from_epoch", start_from_epoch, 0)
        if not isinstance(check_finite, bool):
            raise TypeError(f"Expected `check_finite` to be a bool. Received: check_finite={check_finite!r}.")
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.check_finite = check_finite
        self.monitor, self.min_delta, self.patience = monitor, abs(min_delta), patience
        self.mode, self.baseline, self.verbose = mode, baseline, verbose
        self.restore_best_weights, self.start_from_epoch = restore_best_weights, start_from_epoch
        self._mode = mode if mode != "auto" else None
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.stopped_epoch = 0
        self.best: float | None = None
        self.best_epoch = 0
        self.best_weights: dict[str, torch.Tensor] | None = None
        self.stop_reason: str | None = None

    def _get_state(self) -> dict[str, Any]:
        return {
            "wait": self.wait,
            "stopped_epoch": self.stopped_epoch,
            "best": self.best,
            "best_epoch": self.best_epoch,
            "best_weights": self.best_weights,
            "stop_reason": self.stop_reason,
        }

    def _set_state(self, state: dict[str, Any]) -> None:
        self.wait, self.stopped_epoch = state["wait"], state["stopped_epoch"]
        self.best, self.best_epoch = state["best"], state["best_epoch"]
        self.best_weights = state["best_weights"]
        self.stop_reason = state.get("stop_reason")

    def _state_problems(self, state: Any) -> list[str]:
        from fitkit.files import state_dict_differences
        from fitkit.files.content import is_count, is_score, typed_problems

        weights = (lambda v: v is None or isinstance(v, dict), "None or a dict {name: tensor}")
        spec = {
            "wait": (is_count, "an int >= 0"),
            "stopped_epoch": (is_count, "an int >= 0"),
            "best": (lambda v: v is None or is_score(v), "a number or None (not NaN)"),
            "best_epoch": (is_count, "an int >= 0"),
            "best_weights": weights,
            "stop_reason": (lambda v: v is None or isinstance(v, str), "a str or None"),
        }
        out = typed_problems(state, spec, "its state", optional=frozenset({"stop_reason"}))
        if not out and state["best_weights"] is not None:
            out = [
                f"its state['best_weights'][{k!r}] is {v!r:.60}, expected a tensor"
                for k, v in state["best_weights"].items()
                if not isinstance(v, torch.Tensor)
            ]
        model = getattr(self, "model", None)
        if not out and state["best_weights"] is not None and model is not None:
            out = [
                f"its state['best_weights']: {d}"
                for d in state_dict_differences(model.state_dict(), state["best_weights"])
            ]
        return out

    def on_train_begin(self, logs=None):
        check_validation_monitor(self.monitor, self.params, "EarlyStopping", self.model)
        self._mode = resolve_mode(self.monitor, self.mode, self.model, "EarlyStopping")
        super().on_train_begin(logs)

    def _snapshot(self) -> dict[str, torch.Tensor]:
        # A deep copy of the weights that scored the monitor (an EMA's when validation ran on
        # them): the live parameters keep changing after this epoch.
        with scored_weights(self.model, self.monitor):
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def on_epoch_end(self, epoch, logs=None):
        if not per_validation(self):  # else decided at each validation
            self._decide(epoch, logs, later=epoch > 0)

    def on_validation_end(self, logs=None):
        if per_validation(self):
            history = getattr(self.model, "history", None)
            self._decide(self.model.epoch, logs, later=len(getattr(history, "validations", ())) > 1)

    def _decide(self, epoch: int, logs: Any, later: bool) -> None:
        current = monitor_value(logs, self.monitor, "EarlyStopping", self.params, self.model)
        if current is None or epoch < self.start_from_epoch:
            return
        if self._mode is None:  # hooks called directly, without on_train_begin
            self._mode = resolve_mode(self.monitor, self.mode, self.model, "EarlyStopping")
        if self.restore_best_weights and self.best_weights is None and not math.isnan(current):
            self.best_weights, self.best_epoch = self._snapshot(), epoch  # nothing better yet
        # Lightning's order: not finite, stopping threshold, divergence threshold, patience.
        mode = self._mode
        reason = self._threshold_stop(current, mode, before_patience=True)
        if reason is not None:
            return self._stop(epoch, reason)
        self.wait += 1
        improved = self._note(current, epoch, mode)
        reason = self._threshold_stop(current, mode, before_patience=False)
        if reason is not None:
            return self._stop(epoch, reason)
        if not improved and self.wait >= self.patience and later:
            what = "validation(s)" if per_validation(self) else "epoch(s)"
            self._stop(epoch, f"patience: {self.monitor} did not improve for {self.wait} {what}{self._best_text()}.")

    def _threshold_stop(self, current: float, mode: str, before_patience: bool) -> str | None:
        """Why ``current`` stops training at once (a value not finite or past the divergence
        threshold, checked before patience counts; the stopping threshold, after), else ``None``."""
        if not before_patience:
            if self.stopping_threshold is not None and is_improvement(current, self.stopping_threshold, mode):
                better = "<" if mode == "min" else ">"
                return (
                    f"stopping_threshold: {self.monitor} = {format_value(self.monitor, current)} {better} "
                    f"{format_value(self.monitor, self.stopping_threshold)}."
                )
            return None
        if self.check_finite and not math.isfinite(current):
            return f"not finite: {self.monitor} = {current}{self._best_text()}."
        if self.divergence_threshold is not None and is_improvement(self.divergence_threshold, current, mode):
            worse = ">" if mode == "min" else "<"
            return (
                f"divergence_threshold: {self.monitor} = {format_value(self.monitor, current)} {worse} "
                f"{format_value(self.monitor, self.divergence_threshold)}."
            )
        return None

    def _note(self, current: float, epoch: int, mode: str) -> bool:
        """Keep ``current`` if it improves on the best (and its weights); whether it did."""
        improved = not math.isnan(current) and (
            self.best is None or is_improvement(current, self.best, mode, self.min_delta, self.threshold_mode)
        )
        if improved:
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = self._snapshot()
            # The wait restarts only on a value that beats the baseline too.
            if self.baseline is None or is_improvement(
                current, self.baseline, mode, self.min_delta, self.threshold_mode
            ):
                self.wait = 0
        return improved

    def _best_text(self) -> str:
        # No best yet when every value so far was NaN.
        if self.best is None:
            return ""
        return f"; best {format_value(self.monitor, self.best)} at epoch {self.best_epoch + 1}"

    def _stop(self, epoch: int, reason: str) -> None:
        self.stopped_epoch, self.stop_reason = epoch, reason
        self.model.stop_training = True

    @property
    def restores_weights_at_end(self) -> bool:
        """Whether ``on_train_end`` puts the best epoch's weights back (``restore_best_weights``
        and a best epoch seen). An averaging callback's swap at the end yields to it, in either
        list order (:func:`fitkit.callbacks.swapping.restorer`)."""
        return self.restore_best_weights and self.best_weights is not None

    def on_train_end(self, logs=None):
        if self.stop_reason is not None:
            say(self.verbose, f"Epoch {self.stopped_epoch + 1}: early stopping ({self.stop_reason})")
        if self.restore_best_weights and self.best_weights is not None:
            say(self.verbose, f"Restoring the weights of epoch {self.best_epoch + 1}, the best one.")
            self.model.load_state_dict(self.best_weights)
