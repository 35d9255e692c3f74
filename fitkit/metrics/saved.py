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

__all__ = ["metric_states", "load_metric_states"]


def metric_states(entries: list[Any], sync: bool) -> dict[str, dict[str, Any]]:
    """``{log key: {state name: tensor(s), "_update_count": int}}`` of built metrics.

    ``sync``: the states summed over ranks (a collective: every rank calls it), so a checkpoint
    resumes at any world size.
    """
    out: dict[str, dict[str, Any]] = {}
    for e in entries:
        with e.metric.sync_context(should_sync=sync, should_unsync=True):
            state = {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone())
                     for k, v in e.metric.metric_state.items()}  # fmt: skip
        state["_update_count"] = e.metric._update_count
        out[e.key] = state
    return out


def load_metric_states(entries: list[Any], states: dict[str, dict[str, Any]]) -> None:
    """Load :func:`metric_states` into built metrics (a metric the states lack: a warning)."""
    missing = [e.key for e in entries if e.key not in states]
    if missing:
        warnings.warn(
            f"The checkpoint holds no running totals for {', '.join(missing)} (compiled since?): in the "
            "resumed epoch they count the remaining batches only. Fix: resume with the same metrics.",
            category=FitkitWarning, stacklevel=6,
        )
    for e in entries:
        for k, v in (states.get(e.key) or {}).items():
            if k == "_update_count":
                e.metric._update_count = v
            else:
                setattr(e.metric, k, v.to(e.metric.device) if hasattr(v, "to") else v)
