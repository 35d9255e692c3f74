"""A :class:`~fitkit.metrics.MetricSet`'s running states in a checkpoint taken inside an epoch.

Metrics given by name are built from the first batch (their task and class count come from its
shapes), so a resumed epoch may hold a saved state before its metrics exist. The state then
waits in the set (``MetricSet.pending``) and :meth:`MetricSet.build` loads it at birth: nothing
is restored into a metric that does not exist yet, and nothing built later overwrites a
restored state.
"""

from __future__ import annotations

import warnings
from typing import Any

from fitkit.checks import FitkitWarning

__all__ = ["metric_states", "load_metric_states", "metric_state_problems"]


def _in_layout(e: Any, saved: Any) -> Any:
    """A saved state in the layout of the built metric ``e.metric`` (one that reads an earlier
    layout says how, through its ``from_saved``; see :class:`fitkit.metrics.counted.CountedAccuracy`)."""
    convert = getattr(e.metric, "from_saved", None)
    return convert(saved) if convert is not None and isinstance(saved, dict) else saved


def metric_states(entries: list[Any], sync: bool) -> dict[str, dict[str, Any]]:
    """``{log key: {state name: tensor(s), "_update_count": int}}`` of built metrics.

    ``sync``: the states summed over ranks (a collective: every rank calls it), so a checkpoint
    resumes at any world size.
    """
    out: dict[str, dict[str, Any]] = {}
    for e in entries:
        with e.metric.sync_context(should_sync=sync, should_unsync=True):
            state = {
                k: ([t.clone() for t in v] if isinstance(v, list) else v.clone())
                for k, v in e.metric.metric_state.items()
            }
        state["_update_count"] = e.metric._update_count
        out[e.key] = state
    return out


def metric_state_problems(entries: list[Any], states: Any) -> list[str]:
    """What in saved :func:`metric_states` does not fit the built metrics: each saved metric's
    state names and, for tensor states, their shapes (a list state grows: any length)."""
    out = []
    for e in entries:
        saved = _in_layout(e, states.get(e.key)) if isinstance(states, dict) else None
        if not isinstance(saved, dict):
            continue
        mine = e.metric.metric_state
        names, known = set(saved) - {"_update_count"}, set(mine)
        if names != known:
            out.append(
                f"metric {e.key!r}: the checkpoint holds the states {sorted(names)}, the metric "
                f"{type(e.metric).__name__} {sorted(known)}"
            )
            continue
        for k, v in saved.items():
            now = mine.get(k)
            if isinstance(now, list) != isinstance(v, list):
                out.append(
                    f"metric {e.key!r}: state {k!r} is a {type(v).__name__} in the checkpoint, a "
                    f"{type(now).__name__} in the metric"
                )
            elif hasattr(now, "shape") and hasattr(v, "shape") and tuple(v.shape) != tuple(now.shape):
                out.append(
                    f"metric {e.key!r}: state {k!r} has the shape {tuple(v.shape)} in the checkpoint, "
                    f"{tuple(now.shape)} in the metric"
                )
    return out


def load_metric_states(entries: list[Any], states: dict[str, dict[str, Any]], owner: bool = True) -> None:
    """Load :func:`metric_states` into built metrics (a metric the states lack: a warning).

    ``owner=False`` (a rank other than the one that takes the sums over ranks): the same checks,
    then each metric's own empty state with the saved update count, so every rank computes (and
    syncs) the same metrics at the epoch's end.

    Raises:
        ValueError: states that do not fit the metrics (:func:`metric_state_problems`), before
            any metric changes.
    """
    problems = metric_state_problems(entries, states)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            f"The checkpoint's running metric states do not fit this fit's metrics, so none was loaded:\n{lines}\n"
            "Fix: resume with the metrics compiled as when the checkpoint was taken (same metrics, tasks and "
            "class counts), or resume from a checkpoint taken at an epoch end."
        )
    missing = [e.key for e in entries if e.key not in states]
    if missing:
        warnings.warn(
            f"The checkpoint holds no running totals for {', '.join(missing)} (compiled since?): in the "
            "resumed epoch they count the remaining batches only. Fix: resume with the same metrics.",
            category=FitkitWarning,
            stacklevel=6,
        )
    for e in entries:
        saved = _in_layout(e, states.get(e.key)) or {}
        if not owner:
            e.metric.reset()  # the metric's own neutral states (a sum's 0, a max's -inf, an empty list)
            e.metric._update_count = saved.get("_update_count", 0)
            continue
        for k, v in saved.items():
            if k == "_update_count":
                e.metric._update_count = v
            else:
                setattr(e.metric, k, v.to(e.metric.device) if hasattr(v, "to") else v)
