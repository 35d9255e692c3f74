"""Nested structures of tensors: one walker for batches and outputs.

Batches and module outputs are tensors, or tuples, lists, namedtuples and dicts (any depth) of
them. :func:`map_structure` rebuilds such a structure with a function applied to each tensor;
:func:`leaves` lists the tensors; :func:`concat` joins a list of same-shaped structures along
dim 0 (``predict``'s batches), keeping namedtuples as namedtuples; :func:`rows` counts the
samples of a batch; :func:`rebuild` makes a container like another from new items.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["map_structure", "leaves", "concat", "rows", "rebuild", "namedtuple_types"]


def rebuild(like: Any, items: list[Any]) -> Any:
    """A tuple, namedtuple or list of the same type as ``like``, holding ``items``.

    Example:
        >>> from collections import namedtuple
        >>> P = namedtuple("P", "a b")
        >>> rebuild(P(1, 2), [3, 4]), rebuild((1,), [5]), rebuild([1], [6])
        (P(a=3, b=4), (5,), [6])
    """
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*items)
    if isinstance(like, tuple):
        return tuple(items)
    return list(items)


_KEEP: Any = object()


def map_structure(
    fn: Callable[[Any], Any], obj: Any, leaf: type | tuple[type, ...] = torch.Tensor, other: Any = _KEEP
) -> Any:
    """Apply ``fn`` to every leaf (a tensor, or ``leaf`` types) of a nested structure.

    Leaves of other types are kept as they are, or replaced by ``other`` when it is given.

    Example:
        >>> from collections import namedtuple
        >>> P = namedtuple("P", "a b")
        >>> map_structure(lambda t: t * 2, P(torch.ones(1), {"c": [torch.ones(1), "id"]}))
        P(a=tensor([2.]), b={'c': [tensor([2.]), 'id']})
    """
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return rebuild(obj, [map_structure(fn, o, leaf, other) for o in obj])
    if isinstance(obj, Mapping):
        return {k: map_structure(fn, v, leaf, other) for k, v in obj.items()}
    return obj if other is _KEEP else other


def leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors of a nested structure, depth first, in order.

    Example:
        >>> [t.shape[0] for t in leaves({"a": torch.zeros(2), "b": (torch.zeros(3), "x")})]
        [2, 3]
    """
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in leaves(o)]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in leaves(v)]
    return []


def namedtuple_types(obj: Any) -> list[type]:
    """The namedtuple classes in a nested structure, each once, depth first.

    Example:
        >>> from collections import namedtuple
        >>> P = namedtuple("P", "a b")
        >>> [t.__name__ for t in namedtuple_types({"x": [P(torch.ones(1), P(1, 2))]})]
        ['P']
    """
    found: list[type] = []
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        found.append(type(obj))
    children = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (tuple, list)) else ()
    for child in children:
        found += [t for t in namedtuple_types(child) if t not in found]
    return found


def concat(parts: list[Any]) -> Any:
    """Concatenate same-structured batches on dim 0 and move them to the CPU.

    A structure that holds no tensor at some position keeps the per-batch list there.

    Example:
        >>> from collections import namedtuple
        >>> Out = namedtuple("Out", "logits aux")
        >>> out = concat([Out(torch.zeros(2, 3), torch.ones(2)), Out(torch.zeros(1, 3), torch.ones(1))])
        >>> type(out).__name__, out.logits.shape, out.aux.shape
        ('Out', torch.Size([3, 3]), torch.Size([3]))
    """
    if not parts:
        return torch.empty(0)
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts).cpu()
    if isinstance(first, (tuple, list)):
        return rebuild(first, [concat([p[i] for p in parts]) for i in range(len(first))])
    if isinstance(first, Mapping):
        return {k: concat([p[k] for p in parts]) for k in first}
    return parts


def rows(obj: Any, unbatched: int = 1) -> int:
    """Samples in a batch (or a batch's part): dim 0 of its first tensor, depth first.

    The one rule of fitkit for "rows in a batch". A structure without a batch dimension (no
    tensor, or a 0-dim first tensor) is one sample by default, as a single value is for a
    loss; ``unbatched=0`` counts it as no row instead (the rows of a prediction to gather).

    Example:
        >>> rows({"a": torch.zeros(5, 2)}), rows(torch.tensor(3.0)), rows(torch.tensor(3.0), unbatched=0)
        (5, 1, 0)
    """
    if isinstance(obj, torch.Tensor):  # the common case first: one tensor, no walk
        return int(obj.shape[0]) if obj.dim() else unbatched
    ts = leaves(obj)
    return int(ts[0].shape[0]) if ts and ts[0].dim() > 0 else unbatched
