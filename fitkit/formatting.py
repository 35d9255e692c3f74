"""Numbers as fitkit prints them: one format for losses and metrics, one for learning rates.

What is *returned* keeps every digit (``History``, ``evaluate``, the epoch logs hold Python
floats); only what is *printed* (the progress bar, the epoch lines, callback messages) is
rounded, the same way everywhere.
"""

from __future__ import annotations

import math

__all__ = ["format_number", "format_lr", "is_lr_key", "format_value"]


def format_number(value: float) -> str:
    """A loss or metric as printed: 4 decimals; 4 significant digits when below 1e-3 or from 1e4.

    Example:
        >>> [format_number(v) for v in (0.30000001192092896, 2.5, 0.0, 1.5e-5, 123456.0, float("nan"))]
        ['0.3000', '2.5000', '0.0000', '1.5e-05', '1.235e+05', 'nan']
    """
    value = float(value)
    if math.isfinite(value) and value != 0 and (abs(value) >= 1e4 or abs(value) < 1e-3):
        return f"{value:.4g}"
    return f"{value:.4f}"


def format_lr(lr: float) -> str:
    """A learning rate as printed everywhere (the bar, the epoch lines, the LR callbacks and the LR
    finder): 4 significant digits, no trailing zeros.

    Example:
        >>> [format_lr(v) for v in (1e-3, 3e-4, 0.1, 2.5e-5, 0.00031622776601683794)]
        ['0.001', '0.0003', '0.1', '2.5e-05', '0.0003162']
    """
    return f"{float(lr):.4g}"


def is_lr_key(key: str) -> bool:
    """Whether a log key is a learning rate: ``learning_rate``, ``learning_rate/<group>``."""
    return key == "learning_rate" or key.startswith("learning_rate/")


def format_value(key: str, value: float) -> str:
    """``value`` of the log key ``key`` as printed: :func:`format_lr` for learning rates, else
    :func:`format_number`.

    Example:
        >>> format_value("learning_rate", 0.001), format_value("loss", 0.001)
        ('0.001', '0.0010')
    """
    return format_lr(value) if is_lr_key(key) else format_number(value)
