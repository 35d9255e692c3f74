"""Which keys of a dict batch are the targets: the Transformers Trainer's ``label_names``.

A dict batch (Hugging Face style) carries its targets among the inputs. With a compiled loss,
the entries named by ``compile(label_names=...)`` are taken out of the batch before ``forward``
and become the loss's and the metrics' targets: one name gives that tensor, several give a
tuple in their order (a custom loss then reads ``y_true[0]``, ``y_true[1]``, ...).

The default follows the Trainer's rule for a Transformers model (its ``find_labels``): the
``forward`` parameters whose name holds ``"label"``, and for a question-answering model also
``start_positions`` / ``end_positions``; a ``PeftModel`` is asked for its base model's. Any
other module: ``("labels",)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

__all__ = ["LABELS", "default_label_names", "resolve_label_names", "check_label_keys"]

LABELS: tuple[str, ...] = ("labels",)
_SPANS = ("start_positions", "end_positions")


def _is_transformers_model(module: Any) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(module).__mro__)


def default_label_names(module: nn.Module) -> tuple[str, ...]:
    """The Trainer's default ``label_names`` for ``module`` (see the module docstring).

    Example:
        >>> class QA(nn.Module):
        ...     def forward(self, input_ids, start_positions=None, end_positions=None): ...
        >>> default_label_names(QA())  # not a Transformers model: the plain convention
        ('labels',)
    """
    get_base = getattr(module, "get_base_model", None)  # peft.PeftModel
    base = get_base() if callable(get_base) else module
    if not _is_transformers_model(base):
        return LABELS
    try:
        params = list(inspect.signature(base.forward).parameters)
    except (TypeError, ValueError):
        return LABELS
    spans = "QuestionAnswering" in type(base).__name__
    names = tuple(p for p in params if "label" in p or (spans and p in _SPANS))
    return names or LABELS


def resolve_label_names(label_names: Any, module: nn.Module) -> tuple[str, ...]:
    """``compile(label_names=...)`` checked: ``None`` (the default above), a key, or keys.

    Raises:
        TypeError: not ``None``, a ``str`` or a sequence of ``str``.
        ValueError: an empty sequence, or a key named twice.

    Example:
        >>> resolve_label_names(["start_positions", "end_positions"], nn.Linear(1, 1))
        ('start_positions', 'end_positions')
        >>> resolve_label_names("target", nn.Linear(1, 1))
        ('target',)
    """
    if label_names is None:
        return default_label_names(module)
    names = (label_names,) if isinstance(label_names, str) else label_names
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"compile(label_names=) takes the dict batch's target keys: a str or a list of str; "
            f"received {label_names!r} ({type(label_names).__name__}). Fix: e.g. label_names=['labels'] "
            "or label_names=['start_positions', 'end_positions']."
        )
    if not names or len(set(names)) != len(names):
        raise ValueError(
            f"compile(label_names=) needs at least one key, each named once; received {list(names)!r}. "
            "Fix: e.g. label_names=['labels'], or leave it None for the model's default."
        )
    return tuple(names)


def check_label_keys(names: tuple[str, ...], module: nn.Module, x: Any) -> None:
    """Refuse ``label_names`` set in ``compile`` that match no key of a (first) batch ``x``: they
    would be ignored, and the targets would be missing or be ``y``. The default names are not
    checked (a module computing its own loss from other keys needs none).

    Raises:
        ValueError: none of ``names`` is a key of ``x`` (or ``x`` is no dict).

    Example:
        >>> check_label_keys(("target",), nn.Linear(1, 1), {"input_ids": 0, "target": 1})
        >>> check_label_keys(("target",), nn.Linear(1, 1), {"input_ids": 0, "label": 1})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: compile(label_names=['target']) names no key of the batch (keys: ['input_ids', 'label']), ...
    """
    default = default_label_names(module)
    if names == default or (isinstance(x, Mapping) and any(n in x for n in names)):
        return
    keys = list(x) if isinstance(x, Mapping) else None
    close = [k for k in keys or [] if "label" in str(k) or "target" in str(k)]
    example = f"e.g. label_names={close[:1]}, " if close else ""
    where = f"the batch (keys: {keys})" if keys is not None else f"the batch, whose x is a {type(x).__name__} (no dict)"
    raise ValueError(
        f"compile(label_names={list(names)}) names no key of {where}, so the targets would not be found there. "
        f"Fix: pass the batch's target keys, {example}or leave label_names None for the default {default}."
    )
