"""Does a user function take the arguments its hook is called with? Checked when it is given.

A ``LambdaCallback(on_epoch_end=lambda: None)`` would otherwise fail at the end of the first
epoch, after training started, with Python's raw "takes 0 positional arguments".
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["check_hook_arity"]


def _hook_arguments(hook: str) -> list[str]:
    from fitkit.callbacks.base import Callback

    params = list(inspect.signature(getattr(Callback, hook)).parameters.values())[1:]  # without self
    return [p.name for p in params]


def check_hook_arity(hook: str, fn: Callable[..., Any], given_as: str | None = None) -> None:
    """Raise unless ``fn`` can be called as the hook ``hook`` is: positionally, with its arguments.

    Args:
        hook: a hook name of :class:`fitkit.callbacks.Callback` (``"on_epoch_end"``).
        fn: the user's function.
        given_as: the keyword the user passed it as (``"on_batch_end"``), for the message.

    Raises:
        TypeError: naming the hook, the arguments it is called with and the fix.

    Example:
        >>> check_hook_arity("on_epoch_end", lambda epoch, logs: None)
        >>> check_hook_arity("on_epoch_end", lambda: None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: `on_epoch_end` is called as on_epoch_end(epoch, logs), but the function given takes ...
    """
    names = _hook_arguments(hook)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        signature.bind(*names)
    except TypeError as e:
        key = given_as or hook
        raise TypeError(
            f"`{key}` is called as {hook}({', '.join(names)}), but the function given takes {signature} "
            f"({e}). Fix: pass a function of {len(names)} argument{'s' if len(names) != 1 else ''}, e.g. "
            f"lambda {', '.join(names)}: ..."
        ) from None
