"""A user's averaging function, tried once on copies before step 1.

``WeightAveraging(avg_fn=...)`` / ``multi_avg_fn=...`` are first called at the second update,
after training steps ran. A function that raises, takes the wrong arguments or returns a tensor
of the wrong shape is found here instead, at ``on_train_begin``, on clones of one weight: the
module and the average are not touched, and it costs one call on one tensor per fit.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["try_average_fn"]


def try_average_fn(
    who: str,
    avg_fn: Callable[..., Any] | None,
    multi_avg_fn: Callable[..., Any] | None,
    averaged: torch.Tensor,
    current: torch.Tensor,
) -> None:
    """Call the averaging function on clones of ``averaged`` and ``current`` (one weight).

    Raises:
        ValueError: it raised, or ``avg_fn`` returned no tensor of ``averaged``'s shape.

    Example:
        >>> w = torch.zeros(2)
        >>> try_average_fn("EMA", lambda a, c, n: a + c, None, w, w)
        >>> try_average_fn("WeightAveraging", lambda a, c: a, None, w, w)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: WeightAveraging's `avg_fn` failed when tried before training ...
    """
    if avg_fn is None and multi_avg_fn is None:
        return
    name = "avg_fn" if avg_fn is not None else "multi_avg_fn"
    signature = (
        "avg_fn(averaged, current, num_averaged) -> a tensor of averaged's shape"
        if avg_fn is not None
        else "multi_avg_fn(averaged_list, current_list, num_averaged) -> None, updating averaged_list in place"
    )
    a, c = averaged.detach().clone(), current.detach().clone()
    n = torch.tensor(1, device=a.device)
    shape = tuple(a.shape)
    try:
        with torch.no_grad():
            out = avg_fn(a, c, n) if avg_fn is not None else multi_avg_fn([a], [c], n)  # type: ignore[misc]
    except Exception as e:
        raise ValueError(
            f"{who}'s `{name}` failed when tried before training on a copy of one weight (shape {shape}): "
            f"{type(e).__name__}: {e}. Expected `{signature}`. Fix: correct the function (it is called with "
            "these three arguments at every update), or drop it for the default equal-weight mean."
        ) from e
    if avg_fn is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape):
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"{who}'s `avg_fn` returned {got} when tried before training on a weight of shape {shape}. Expected "
            f"`{signature}`. Fix: return the new average element-wise, e.g. `a + (c - a) / (n + 1)`."
        )
