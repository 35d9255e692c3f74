"""Argument checks, one message form: the argument, what was expected, what was received, the fix.

A wrong type is a ``TypeError``, a wrong value a ``ValueError``; every public entry
point checks its arguments with these helpers before it changes anything.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import numpy as np

__all__ = [
    "check_int",
    "check_bool",
    "check_number",
    "check_choice",
    "check_callbacks",
    "check_mode",
    "check_probability",
    "check_every",
    "check_that",
    "class_not_instance",
    "unknown_keywords",
    "known_keywords",
    "FitkitWarning",
    "read_clock",
]


def _fix(fix: str | None) -> str:
    return f" Fix: {fix}" if fix else ""


def check_int(name: str, value: Any, minimum: int, allow_none: bool = False, fix: str | None = None) -> None:
    """Require an int ``>= minimum`` (``None`` too if ``allow_none``).

    Raises:
        TypeError: not an int (a bool is not an int here).
        ValueError: smaller than ``minimum``.

    Example:
        >>> check_int("epochs", 3, 0)
        >>> check_int("epochs", -1, 0)
        Traceback (most recent call last):
        ...
        ValueError: Expected `epochs` >= 0. Received: epochs=-1.
    """
    if value is None and allow_none:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"Expected `{name}` to be an int. Received: {name}={value!r}.{_fix(fix)}")
    if value < minimum:
        raise ValueError(f"Expected `{name}` >= {minimum}. Received: {name}={value}.{_fix(fix)}")


def check_bool(name: str, value: Any) -> None:
    """Require a bool.

    Example:
        >>> check_bool("shuffle", "yes")
        Traceback (most recent call last):
        ...
        TypeError: Expected `shuffle` to be a bool. Received: shuffle='yes'.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"Expected `{name}` to be a bool. Received: {name}={value!r}.")


def check_number(
    name: str,
    value: Any,
    *,
    positive: bool = False,
    minimum: float | None = None,
    allow_none: bool = False,
    fix: str | None = None,
) -> None:
    """Require a real number, not NaN (``> 0`` if ``positive``, ``>= minimum`` if given).

    Example:
        >>> check_number("clip_grad_norm", 0, positive=True)
        Traceback (most recent call last):
        ...
        ValueError: Expected `clip_grad_norm` to be a positive number. Received: clip_grad_norm=0.
        >>> check_number("patience_delta", float("nan"))
        Traceback (most recent call last):
        ...
        ValueError: Expected `patience_delta` to be a number, not NaN. Received: patience_delta=nan.
    """
    if value is None and allow_none:
        return
    what = "a positive number" if positive else "a number"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"Expected `{name}` to be {what}. Received: {name}={value!r}.{_fix(fix)}")
    if math.isnan(value):  # nothing compares with NaN: a NaN threshold would never be beaten
        raise ValueError(f"Expected `{name}` to be a number, not NaN. Received: {name}={value!r}.{_fix(fix)}")
    if positive and not value > 0:
        raise ValueError(f"Expected `{name}` to be {what}. Received: {name}={value!r}.{_fix(fix)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"Expected `{name}` >= {minimum}. Received: {name}={value!r}.{_fix(fix)}")


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    """Require one of ``choices``.

    Example:
        >>> check_choice("scheduler_interval", "batch", ("epoch", "step"))
        Traceback (most recent call last):
        ...
        ValueError: Expected `scheduler_interval` to be one of 'epoch', 'step'. Received: scheduler_interval='batch'.
    """
    if value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ValueError(f"Expected `{name}` to be one of {valid}. Received: {name}={value!r}.")


def check_mode(mode: Any) -> None:
    """Require a monitoring callback's ``mode``: ``"auto"``, ``"min"`` or ``"max"``.

    Example:
        >>> check_mode("up")
        Traceback (most recent call last):
        ...
        ValueError: Expected `mode` to be 'auto', 'min' or 'max'. Received: mode='up'.
    """
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"Expected `mode` to be 'auto', 'min' or 'max'. Received: mode={mode!r}.")


def check_probability(name: str, value: Any) -> None:
    """Require a probability in ``[0, 1)`` (a dropout rate).

    Example:
        >>> check_probability("drop", 1.0)
        Traceback (most recent call last):
        ...
        ValueError: Expected `drop` to be a probability in [0, 1). Received: drop=1.0.
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
        raise ValueError(f"Expected `{name}` to be a probability in [0, 1). Received: {name}={value!r}.")


def check_every(name: str, value: Any, word: str, unit: str) -> None:
    """Require ``word`` or a positive int (a count of ``unit``), as ``save_freq="epoch"`` or ``100``.

    Example:
        >>> check_every("save_freq", 0, "epoch", "batches")
        Traceback (most recent call last):
        ...
        ValueError: Expected `save_freq` to be 'epoch' or a positive int (batches). Received: save_freq=0.
    """
    if value == word:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Expected `{name}` to be {word!r} or a positive int ({unit}). Received: {name}={value!r}.")


def check_that(name: str, value: Any, ok: Any, expected: str) -> None:
    """Require a number for which ``ok(value)`` holds; ``expected`` says what that means.

    Example:
        >>> check_that("smooth", 1.5, lambda v: 0 <= v < 1, "in [0, 1)")
        Traceback (most recent call last):
        ...
        ValueError: Expected `smooth` in [0, 1). Received: smooth=1.5.
    """
    check_number(name, value)
    if not ok(value):
        raise ValueError(f"Expected `{name}` {expected}. Received: {name}={value!r}.")


def read_clock(clock: Callable[[], Any], name: str = "clock") -> float:
    """Read a callback's ``clock`` and require seconds: a real number, not NaN.

    A clock that returns something else would fail later inside arithmetic (``'str' - 'str'``),
    mid-run; read through this, the first reading (at the fit's start) names it.

    Example:
        >>> read_clock(lambda: 2.5)
        2.5
        >>> read_clock(lambda: "now")
        Traceback (most recent call last):
        ...
        TypeError: Expected `clock` to return seconds as a number. Received: clock() returned 'now' (str). Fix: pass a function that returns float seconds, e.g. clock=time.perf_counter.
    """  # noqa: E501
    value = clock()
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, float, np.integer, np.floating))
        or math.isnan(value)
    ):
        raise TypeError(
            f"Expected `{name}` to return seconds as a number. Received: {name}() returned {value!r} "
            f"({type(value).__name__}). Fix: pass a function that returns float seconds, e.g. {name}=time.perf_counter."
        )
    return cast(float, value)  # the clock's own value, unchanged (an int clock stays exact)


def check_callbacks(callbacks: Any, base: type) -> list[Any]:
    """Require ``None`` or a list / tuple of ``base`` objects; return a list.

    ``base`` is :class:`fitkit.callbacks.Callback`, passed in: this module imports nothing
    of fitkit (the callbacks import it).

    Example:
        >>> class Callback: ...
        >>> check_callbacks(None, Callback), len(check_callbacks((Callback(),), Callback))
        ([], 1)
    """
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(
            f"Expected `callbacks` to be a list of Callback objects. Received: {type(callbacks).__name__}. "
            "Fix: pass callbacks=[...]."
        )
    for cb in callbacks:
        if not isinstance(cb, base):
            raise TypeError(
                f"Expected every callback to subclass fitkit.callbacks.Callback. Received: {cb!r}. "
                "Fix: subclass Callback, or wrap functions in LambdaCallback."
            )
    return list(callbacks)


def class_not_instance(name: str, cls: type) -> str:
    """The message for a class passed where an instance of it is meant (``loss=nn.MSELoss``).

    Example:
        >>> import torch
        >>> print(class_not_instance("loss", torch.nn.MSELoss).split(". ")[-1])
        Fix: pass an instance, loss=nn.MSELoss().
    """
    module = cls.__module__ or ""
    shown = f"nn.{cls.__qualname__}" if module.startswith("torch.nn") else f"{module}.{cls.__qualname__}"
    if module in ("builtins", "__main__", ""):
        shown = cls.__qualname__
    return (
        f"Expected `{name}` to be an instance, not a class. Received: {name}={shown} (the class). "
        f"Fix: pass an instance, {name}={shown}()."
    )


_LEARNING_RATE = (
    "Fix: set the learning rate on the optimizer, compile(optimizer=torch.optim.AdamW(model.module.parameters(), "
    "lr=1e-3)) or a factory, compile(optimizer=functools.partial(torch.optim.AdamW, lr=1e-3)) (a named "
    "optimizer such as 'adam' has torch's default); a schedule is compile(scheduler=...) or the "
    "LearningRateScheduler callback."
)


def unknown_keywords(function: str, given: Any, valid: Any) -> TypeError:
    """The error for keyword arguments that ``function`` does not take: close matches and the valid ones.

    ``lr`` / ``learning_rate`` get the ways to set a learning rate.

    Example:
        >>> print(unknown_keywords("Model.fit", ["epoch"], ["x", "epochs", "batch_size"]))
        Model.fit() got an unexpected keyword argument 'epoch'. Fix: did you mean 'epochs'? Valid keywords: x, ...
    """

    given, valid = list(given), list(valid)
    parts = []
    for name in given:
        if name in ("lr", "learning_rate"):
            hint = _LEARNING_RATE
        else:
            match = close_matches(name, valid).strip()
            hint = f"Fix: d{match[1:]}" if match else "Fix: use one of the valid keywords."
        parts.append(f"{function}() got an unexpected keyword argument {name!r}. {hint}")
    return TypeError(" ".join(parts) + f" Valid keywords: {', '.join(valid)}.")


_F = TypeVar("_F", bound=Callable[..., Any])


def known_keywords(method: _F) -> _F:
    """Refuse keyword arguments that ``method`` does not take with :func:`unknown_keywords`' error.

    Python's own error (``compile() got an unexpected keyword argument 'lr'``) names neither
    the valid keywords nor a fix. The signature stays the method's own (``inspect.signature``
    and the docs follow ``__wrapped__``); the check is one set comparison per call.

    Example:
        >>> class M:
        ...     @known_keywords
        ...     def fit(self, x=None, *, epochs=1):
        ...         return epochs
        >>> M().fit(epochs=2), str(inspect.signature(M.fit))
        (2, '(self, x=None, *, epochs=1)')
        >>> M().fit(epoch=2)
        Traceback (most recent call last):
        ...
        TypeError: M.fit() got an unexpected keyword argument 'epoch'. Fix: did you mean 'epochs'? Valid keywords: ...
    """
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    valid = [n for n, p in inspect.signature(method).parameters.items() if p.kind in kinds and n != "self"]
    accepted = frozenset(valid)
    name = method.__qualname__

    @functools.wraps(method)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if kwargs and not accepted.issuperset(kwargs):
            raise unknown_keywords(name, [k for k in kwargs if k not in accepted], valid)
        return method(*args, **kwargs)

    return cast(_F, checked)


class FitkitWarning(UserWarning):
    """The category of every warning fitkit gives (misuse that is not fatal, data that ran out).

    Filter it like any warning, e.g. ``warnings.simplefilter("error", fitkit.FitkitWarning)``
    to turn fitkit's warnings into errors (fitkit's own test suite does).
    """


def close_matches(name: str, valid: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for a misspelt name (difflib), or ``""``.

    Example:
        >>> close_matches("epoch", ["epochs", "batch_size"])
        " Did you mean 'epochs'?"
    """
    found = difflib.get_close_matches(name, list(valid), n=3, cutoff=0.75)
    return f" Did you mean {' or '.join(repr(f) for f in found)}?" if found else ""
