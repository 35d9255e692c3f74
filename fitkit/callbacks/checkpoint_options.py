"""``ModelCheckpoint``'s run-relative and safety options, checked and computed here.

- ``save_freq=f``, a float in ``(0, 1]``: a save each time the run passes another fraction ``f``
  of its planned optimizer steps (Composer's ``save_interval="0.25dur"``), the last at the end.
  The run's time is ``model.global_step`` against ``params["total_steps"]``, the planned steps
  on that same axis (:mod:`fitkit.training.budget`), whether the plan came from ``epochs``,
  ``max_steps`` or another budget, so a resumed run saves at the same steps as the
  uninterrupted one.
- ``keep_last=0``: the newest file is kept while the run goes on (a crash leaves one to resume
  from), and deleted when it ends, so only the best file and ``save_last``'s remain.
- ``save_overwrite=False``: a file that was on disk when the fit began is never replaced.
- ``save_on_exception``: a checkpoint when ``fit`` raises after a step (Lightning's
  ``save_on_exception`` / ``OnExceptionCheckpoint``); a kill (SIGKILL, out of memory) runs no
  Python, and ``KeyboardInterrupt`` / ``SystemExit`` are stops, not crashes.
- ``save_first_step``: a file after the first optimizer step of a fit (as the Transformers
  Trainer's ``logging_first_step`` logs it), so a broken save path fails in seconds.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction
from typing import Any

__all__ = ["check_fraction", "fraction_steps", "exception_path", "check_retention", "refuse_overwrite"]


def fraction_steps(fraction: Fraction, total: int) -> frozenset[int]:
    """The values of ``global_step`` after which a run of ``total`` planned steps acts at each
    ``fraction`` of it (Composer's ``"0.25dur"``): the first step at or past each multiple of
    ``fraction * total``, and the last step.

    Example:
        >>> sorted(fraction_steps(Fraction(1, 4), 10))  # 2.5, 5, 7.5, 10 rounded up
        [3, 5, 8, 10]
        >>> sorted(fraction_steps(Fraction(3, 10), 7))  # 2.1, 4.2, 6.3, then the end
        [3, 5, 7]
    """
    k = math.floor(1 / fraction)
    return frozenset(max(1, math.ceil(i * fraction * total)) for i in range(1, k + 1)) | {total}


def check_fraction(save_freq: Any) -> Fraction | None:
    """The fraction of the run of a float ``save_freq`` (``None`` for ``"epoch"`` or an int).

    Raises:
        ValueError: a float outside ``(0, 1]``.

    Example:
        >>> check_fraction(0.25), check_fraction("epoch"), check_fraction(100)
        (Fraction(1, 4), None, None)
        >>> check_fraction(1.5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Expected a float `save_freq` in (0, 1] (a fraction of the run). Received: save_freq=1.5. ...
    """
    if not isinstance(save_freq, float):
        return None
    if not math.isfinite(save_freq) or not 0 < save_freq <= 1:
        raise ValueError(
            f"Expected a float `save_freq` in (0, 1] (a fraction of the run). Received: save_freq={save_freq!r}. "
            "Fix: pass e.g. save_freq=0.25 for 4 saves over the run, an int for every that many batches, "
            "or 'epoch'."
        )
    return Fraction(str(save_freq))  # 0.1 is one tenth, not the nearest binary float


def exception_path(filepath: str, save_on_exception: Any) -> str | None:
    """Where ``save_on_exception`` writes: ``on_exception.pt`` beside ``filepath``'s files, or the path given.

    Raises:
        TypeError: neither a bool nor a path.
        ValueError: ``True`` with a folder that changes per save.
    """
    if save_on_exception is False:
        return None
    if save_on_exception is True:
        folder = os.path.dirname(filepath)
        if "{" in folder:
            raise ValueError(
                f"`save_on_exception=True` writes 'on_exception.pt' next to the checkpoints, but the folder of "
                f"{filepath!r} changes per save. Fix: pass `save_on_exception` as a path."
            )
        return os.path.join(folder, "on_exception.pt")
    if isinstance(save_on_exception, (str, os.PathLike)) and os.fspath(save_on_exception):
        return os.fspath(save_on_exception)
    raise TypeError(
        f"Expected `save_on_exception` to be a bool or a path. Received: save_on_exception={save_on_exception!r}. "
        "Fix: pass True (on_exception.pt beside the checkpoints) or a file name."
    )


def check_retention(keep_last: int, ranked_best: bool, last_path: str | None) -> None:
    """``keep_last=0`` deletes its files when the run ends: something else must remain.

    Raises:
        ValueError: ``keep_last=0`` with neither ``save_best_only`` nor ``save_last``.
    """
    if keep_last == 0 and not ranked_best and last_path is None:
        raise ValueError(
            "`keep_last=0` deletes the files of `filepath` when the run ends, keeping only the best file "
            "(save_best_only=True) or the final state (save_last=True), but neither is set, so no file would "
            "remain. Fix: pass save_best_only=True or save_last=True, or keep_last >= 1."
        )


def refuse_overwrite(path: str, existing: set[str], own: set[str]) -> None:
    """``save_overwrite=False``: ``FileExistsError`` for a file that was on disk when the fit began
    (``existing``) and that the callback's own records (``own``) do not name; nothing is written."""
    key = os.path.abspath(path)
    if key in existing and key not in own:
        raise FileExistsError(
            f"ModelCheckpoint(save_overwrite=False) would replace {path!r}, which existed before this fit "
            "began, so nothing was written. Fix: move that file away, pick another `filepath`, or pass "
            "save_overwrite=True."
        )
