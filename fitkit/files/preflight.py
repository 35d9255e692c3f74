"""Checks, before step 1, that a callback can write where it is told to.

A read-only folder, a path template that cannot format the values it will get
(``{epoch:s}``: the epoch is an int) or a name past the file system's limits would otherwise
fail after training started, at the first save, with a raw error. These checks run in the
callbacks' ``on_train_begin``, before anything is written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

__all__ = ["check_writable", "check_writable_template", "format_with_dummies"]

# What a temp file adds to a name: "." + name + ".<pid>-<8 random>.tmp" (pid up to 7 digits).
_TEMP_EXTRA = len("..4194304-abcdefgh.tmp")


def _existing_ancestor(path: str) -> str:
    current = os.path.abspath(path)
    while not os.path.exists(current):
        up = os.path.dirname(current)
        if up == current:
            break
        current = up
    return current


def _limit(folder: str, name: str, default: int) -> int:
    try:
        return int(os.pathconf(folder, name))
    except (OSError, ValueError, AttributeError):
        return default


def check_writable(folder: str | os.PathLike, who: str, argument: str) -> None:
    """Raise unless files can be created in ``folder`` (or, when it is missing, in the nearest
    existing folder above it, where it will be made).

    Raises:
        PermissionError: the folder (or the one above it) is not writable, or is read-only.

    Example:
        >>> import tempfile
        >>> check_writable(os.path.join(tempfile.mkdtemp(), "runs", "a"), "CSVLogger", "filename")
    """
    where = _existing_ancestor(os.fspath(folder))
    if os.path.isdir(where) and not os.access(where, os.W_OK | os.X_OK):
        missing = "" if where == os.path.abspath(folder) else f" (where {str(folder)!r} would be made)"
        raise PermissionError(
            f"{who} writes under `{argument}`, but the folder {where!r}{missing} is not writable, so the first "
            "save would fail after training started. Fix: choose a folder you can write to, or change its "
            "permissions."
        )


def format_with_dummies(template: str, fields: Iterable[str], who: str, argument: str) -> str:
    """``template`` formatted with values of the types fit gives: ``epoch``, ``batch`` and
    ``step`` are ints, every log key a float. A spec that cannot format them (``{epoch:s}``) raises now.

    Raises:
        ValueError: the template cannot format those values.

    Example:
        >>> format_with_dummies("ep{epoch:02d}-{val_loss:.2f}.pt", {"epoch", "val_loss"}, "ModelCheckpoint", "filepath")
        'ep01-0.50.pt'
        >>> format_with_dummies("ep{epoch:s}.pt", {"epoch"}, "ModelCheckpoint", "filepath")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: ModelCheckpoint's `filepath` 'ep{epoch:s}.pt' cannot format the values it will get ...
    """
    values: dict[str, Any] = {name: 0.5 for name in fields}
    values.update({k: 1 for k in ("epoch", "batch", "step") if k in values or k in fields})
    try:
        return template.format(**values)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ValueError(
            f"{who}'s `{argument}` {template!r} cannot format the values it will get ({{epoch}} and {{batch}} "
            f"are ints, log keys floats): {type(e).__name__}: {str(e).rstrip('.')}. Fix: use specs such as "
            "'{epoch:02d}' or '{val_loss:.4f}'."
        ) from None


def check_name_lengths(path: str, who: str, argument: str) -> None:
    """Raise when a name in ``path`` (with the temp file's extra characters) or the whole
    path exceeds the file system's ``NAME_MAX`` / ``PATH_MAX``.

    Raises:
        ValueError: naming the part that is too long and the limit.
    """
    folder = _existing_ancestor(os.path.dirname(os.path.abspath(path)) or os.curdir)
    name_max = _limit(folder, "PC_NAME_MAX", 255)
    path_max = _limit(folder, "PC_PATH_MAX", 4096)
    parts = [p for p in os.path.abspath(path).split(os.sep) if p]
    for i, part in enumerate(parts):
        size = len(part.encode("utf-8", "surrogateescape")) + (_TEMP_EXTRA if i == len(parts) - 1 else 0)
        if size > name_max:
            raise ValueError(
                f"{who}'s `{argument}` makes the name {part[:40] + '...'!r} of {size} bytes (with the temp "
                f"file's {_TEMP_EXTRA} extra characters), past this file system's limit of {name_max}. "
                "Fix: use a shorter file name."
            )
    total = len(os.path.abspath(path).encode("utf-8", "surrogateescape")) + _TEMP_EXTRA
    if total >= path_max:
        raise ValueError(
            f"{who}'s `{argument}` makes a path of {total} bytes (with the temp file's extra characters), past "
            f"this file system's limit of {path_max}. Fix: use a shorter path."
        )


def check_writable_template(template: str, fields: Iterable[str] | None, who: str, argument: str) -> None:
    """All the checks above for a path template (or a plain path: ``fields=None``).

    Raises:
        ValueError: the template cannot format its values, or a name is too long.
        PermissionError: its folder is not writable.
    """
    path = template if fields is None else format_with_dummies(template, set(fields), who, argument)
    check_name_lengths(path, who, argument)
    check_writable(os.path.dirname(os.path.abspath(path)), who, argument)
