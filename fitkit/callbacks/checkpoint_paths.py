"""What ``ModelCheckpoint`` reads from its ``filepath``: the fields, the glob of its files, the
path of ``last.pt``, and the types its saved state must have."""

from __future__ import annotations

import fnmatch
import glob
import os
import string
from typing import Any

from fitkit.files.content import is_count, is_score

__all__ = ["field_names", "glob_of", "last_path", "STATE", "OPTIONAL_STATE"]


def field_names(template: str) -> set[str]:
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(f"`filepath` is not a valid format string: {e}. Received: {template!r}.") from None
    names = set()
    for f in fields:
        name = f.split(".")[0].split("[")[0]
        if not name or name.isdigit():
            raise ValueError(
                f"`filepath` fields need names, e.g. '{{epoch:02d}}' or '{{val_loss:.2f}}'. Received: {template!r}."
            )
        names.add(name)
    return names


def glob_of(template: str) -> str:
    """The glob pattern of the paths a ``filepath`` template formats to: each field is ``*``."""
    parts = string.Formatter().parse(template)
    return "".join(glob.escape(text) + ("*" if field is not None else "") for text, field, _, _ in parts)


def last_path(filepath: str, save_last: Any) -> str | None:
    """The path ``save_last`` writes, or ``None``; refused where it is one of ``filepath``'s own files."""
    if save_last is False or save_last is None:
        return None
    if save_last is True:
        folder = os.path.dirname(filepath)
        if "{" in folder:
            raise ValueError(
                f"`save_last=True` writes 'last.pt' next to the checkpoints, but the folder of "
                f"{filepath!r} changes per save. Fix: pass `save_last` as a path."
            )
        last = os.path.join(folder, "last.pt")
    elif isinstance(save_last, (str, os.PathLike)):
        last = os.fspath(save_last)
    else:
        raise TypeError(f"Expected `save_last` to be a bool or a path. Received: save_last={save_last!r}.")
    if fnmatch.fnmatchcase(os.path.abspath(last), os.path.abspath(glob_of(filepath))):
        raise ValueError(
            f"Expected `save_last` to be a file of its own, but {last!r} is a file of `filepath` "
            f"({filepath!r}): the two writes would overwrite each other, and save_top_k could delete the last "
            f"state. Received: save_last={save_last!r}. Fix: pass a path that `filepath` never formats to, e.g. "
            "filepath='ep{epoch}.pt' with save_last='last.pt'."
        )
    return last


def _pairs(kept: Any) -> bool:
    return isinstance(kept, list) and all(
        isinstance(vp, (list, tuple)) and len(vp) == 2 and is_score(vp[0]) and isinstance(vp[1], str) for vp in kept
    )


STATE = {
    "best": (lambda v: v is None or is_score(v), "a number or None (not NaN)"),
    "best_path": (lambda v: v is None or isinstance(v, str), "a file name or None"),
    "kept": (_pairs, "a list of [value, file name] pairs (values not NaN)"),
    "batches_seen": (is_count, "an int >= 0"),
    "recent": (lambda v: isinstance(v, list) and all(isinstance(p, str) for p in v), "a list of file names"),
}
#: keys a state saved before they existed may lack
OPTIONAL_STATE = frozenset({"recent"})
