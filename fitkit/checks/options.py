"""Type checks of the text options of loggers: names, URIs and tag maps, at construction."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["check_text", "check_tags"]


def check_text(name: str, value: Any, fix: str, paths: bool = False) -> None:
    """Require a str or ``None`` (a path too if ``paths``).

    Example:
        >>> check_text("run_name", "baseline", "pass a name.")
        >>> check_text("tracking_uri", 5, "pass e.g. 'sqlite:///mlflow.db'.")
        Traceback (most recent call last):
        ...
        TypeError: Expected `tracking_uri` to be a str or None. Received: tracking_uri=5 (int). Fix: pass e.g. 'sqlite:///mlflow.db'.
    """  # noqa: E501
    kinds = (str, os.PathLike) if paths else (str,)
    if value is not None and not isinstance(value, kinds):
        expected = "a str, a path or None" if paths else "a str or None"
        raise TypeError(
            f"Expected `{name}` to be {expected}. Received: {name}={value!r} ({type(value).__name__}). Fix: {fix}"
        )


def check_tags(name: str, value: Any, example: str) -> None:
    """Require a mapping with str keys, or ``None`` (values are written as text).

    Example:
        >>> check_tags("tags", {"team": "vision"}, "tags={'team': 'vision'}")
        >>> check_tags("tags", ["a", "b"], "tags={'team': 'vision'}")
        Traceback (most recent call last):
        ...
        TypeError: Expected `tags` to be a dict of {name: value} with str names, or None. Received: tags=['a', 'b'] (list). Fix: pass e.g. tags={'team': 'vision'}; for bare labels use {label: ''}.
    """  # noqa: E501
    if value is None:
        return
    keys = list(value) if isinstance(value, dict) else None
    if keys is None or not all(isinstance(k, str) for k in keys):
        got = (
            f"{value!r} ({type(value).__name__})"
            if keys is None
            else (f"{value!r} (a key of type {next(type(k).__name__ for k in keys if not isinstance(k, str))})")
        )
        raise TypeError(
            f"Expected `{name}` to be a dict of {{name: value}} with str names, or None. Received: {name}={got}. "
            f"Fix: pass e.g. {example}; for bare labels use {{label: ''}}."
        )
