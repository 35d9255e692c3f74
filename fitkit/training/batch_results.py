"""What ``train_on_batch`` / ``test_on_batch`` return: a dict (fitkit's default) or Keras' list / scalar.

Keras 3 returns the loss alone (a scalar) when no metric is compiled, else a list ``[loss,
*metrics]`` in the logs' order, unless ``return_dict=True``. fitkit has always returned the
dict, so ``return_dict=True`` stays the default; ``return_dict=False`` gives Keras' forms.
"""

from __future__ import annotations

from typing import Any

from fitkit.checks import check_bool

__all__ = ["batch_result"]


def batch_result(logs: dict[str, float], return_dict: Any) -> dict[str, float] | list[float] | float:
    """The logs of one batch as ``train_on_batch(return_dict=...)`` returns them.

    Args:
        logs: ``{"loss": float, <metric>: float, ...}`` in the order the logs hold them.
        return_dict: ``True``: the dict; ``False``: the loss alone when it is the only value,
            else the list of the values in the logs' order (Keras' ``return_dict=False``).

    Raises:
        TypeError: ``return_dict`` is not a bool.

    Example:
        >>> batch_result({"loss": 0.5}, False), batch_result({"loss": 0.5, "accuracy": 1.0}, False)
        (0.5, [0.5, 1.0])
        >>> batch_result({"loss": 0.5}, True)
        {'loss': 0.5}
    """
    check_bool("return_dict", return_dict)
    if return_dict:
        return logs
    values = list(logs.values())
    return values[0] if len(values) == 1 else values
