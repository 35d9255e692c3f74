"""The learning rates an epoch logs: ``learning_rate`` and one key per parameter group that
has a name or a rate of its own (Lightning's ``learning_rate/<name>``, ``learning_rate/pg<i>``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["lr_logs", "lr_keys", "groups_differ"]


def lr_logs(groups: list[Any], keys: list[tuple[int, str]]) -> dict[str, float]:
    """The epoch's learning-rate logs: ``learning_rate`` (group 0) and each key of :func:`lr_keys`.

    Example:
        >>> lr_logs([{"lr": 0.1}, {"lr": 0.01}], [(1, "learning_rate/pg1")])
        {'learning_rate': 0.1, 'learning_rate/pg1': 0.01}
    """
    lrs = [float(g["lr"] if isinstance(g, dict) else g) for g in groups]
    logs = {"learning_rate": lrs[0]}
    logs.update({key: lrs[i] for i, key in keys})
    return logs


def lr_keys(optimizer: torch.optim.Optimizer, scheduler: object) -> list[tuple[int, str]]:
    """``(group index, log key)`` of the per-group learning rates, besides ``learning_rate``.

    A group with a ``"name"`` is logged as ``learning_rate/<name>`` (Lightning's convention);
    the others, when the rates differ (:func:`groups_differ`), as ``learning_rate/pg<i>``
    (``i >= 1``; group 0 is ``learning_rate``).

    Raises:
        ValueError: a name that is not a non-empty string, or two groups of one name.

    Example:
        >>> p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        >>> lr_keys(torch.optim.SGD([{"params": [p], "name": "body"}, {"params": [q], "lr": 0.01}], lr=0.1), None)
        [(0, 'learning_rate/body'), (1, 'learning_rate/pg1')]
    """
    groups, per_group = optimizer.param_groups, groups_differ(optimizer, scheduler)
    names = [g.get("name") for g in groups]
    for name in names:
        if name is not None and (not isinstance(name, str) or not name or names.count(name) > 1):
            raise ValueError(
                f"A parameter group's 'name' gives its log key learning_rate/<name>, so names must be distinct, "
                f"non-empty strings. Received: names {names}. Fix: name each group once, e.g. 'head', 'body'."
            )
    return [
        (i, f"learning_rate/{n}" if n is not None else f"learning_rate/pg{i}")
        for i, n in enumerate(names)
        if n is not None or (per_group and i)
    ]


def groups_differ(optimizer: torch.optim.Optimizer, scheduler: object) -> bool:
    """Whether the parameter groups' learning rates differ, now or by their schedule.

    Then every group's rate is logged (``learning_rate/pg1``, ...), decided once per fit so the
    keys stay the same every epoch: groups that differ now, that start from different rates
    (``initial_lr``, a warmup from 0 included), or that follow different ``lr_lambdas``.

    Example:
        >>> p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        >>> opt = torch.optim.SGD([{"params": [p]}, {"params": [q], "lr": 0.01}], lr=0.1)
        >>> groups_differ(opt, None), groups_differ(torch.optim.SGD([p, q], lr=0.1), None)
        (True, False)
    """
    groups = optimizer.param_groups
    if len(groups) < 2:
        return False
    now = {float(g["lr"]) for g in groups}
    start = {float(g.get("initial_lr", g["lr"])) for g in groups}
    lambdas = getattr(scheduler, "lr_lambdas", None) or []
    return len(now) > 1 or len(start) > 1 or len({id(f) for f in lambdas}) > 1
