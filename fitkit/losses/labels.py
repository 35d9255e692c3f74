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
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LABELS",
    "LabelNames",
    "default_label_names",
    "resolve_label_names",
    "check_label_keys",
    "causal_shift",
    "shifted",
]

LABELS: tuple[str, ...] = ("labels",)
_SPANS = ("start_positions", "end_positions")


def _is_transformers_model(module: Any) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(module).__mro__)


class LabelNames(tuple):
    """``label_names`` with what a compiled loss does with them: ``shift`` (``compile(shift_labels=)``:
    ``True`` scores position ``t`` against label ``t + 1``, as a causal LM's own loss does; ``None``:
    not known yet, decided at the first batch) and ``pad`` (the ignored label that fills the last
    position, the loss's ``ignore_index``).

    Example:
        >>> names = LabelNames(("labels",), shift=True)
        >>> names == ("labels",), names.shift, names.pad
        (True, True, -100)
    """

    shift: bool | None
    pad: int

    def __new__(cls, names: tuple[str, ...], shift: bool | None = False, pad: int = -100) -> LabelNames:
        self = super().__new__(cls, names)
        self.shift, self.pad = shift, pad
        return self


def shifted(labels: torch.Tensor, pad: int = -100) -> torch.Tensor:
    """``labels`` moved one position left, ``pad`` at the end: position ``t`` holds label ``t + 1``
    (Hugging Face's ``ForCausalLMLoss``, which pads and shifts its labels the same way).

    Args:
        labels: ``(B, T)`` integer labels (``(B, T, ...)`` shifts on dim 1).
        pad: the ignored label for the last position.

    Returns:
        ``(B, T)``, a new tensor.

    Example:
        >>> shifted(torch.tensor([[5, 6, 7], [8, -100, 9]]))
        tensor([[   6,    7, -100],
                [-100,    9, -100]])
    """
    if labels.dim() < 2:
        raise ValueError(
            f"shift_labels=True needs labels of shape (B, T) (one per position). Received shape {tuple(labels.shape)}. "
            "Fix: pass shift_labels=False for one label per row."
        )
    moved = labels.narrow(1, 1, labels.shape[1] - 1)
    return F.pad(moved.movedim(1, -1), (0, 1), value=pad).movedim(-1, 1)


def causal_shift(module: Any) -> bool | None:
    """Whether a Transformers model's own loss shifts its labels (a causal LM): ``True`` / ``False``;
    ``None`` for any other module (not known from the module alone).

    The rule follows the model's loss: a model whose ``loss_type`` is ``"ForCausalLM"``, or
    whose loss is not in the Transformers loss registry and that generates text (a decoder-only
    ``...LMHeadModel``, ``can_generate()``), shifts; an encoder-decoder model or any other loss
    type (masked LM, token classification, ...) does not. A ``PeftModel`` is looked through.

    Example:
        >>> causal_shift(nn.Linear(1, 1)) is None
        True
    """
    get_base = getattr(module, "get_base_model", None)
    base = get_base() if callable(get_base) else module
    if not _is_transformers_model(base):
        return None
    if getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        return False
    loss_type = getattr(base, "loss_type", None)
    if loss_type is not None:
        return str(loss_type) == "ForCausalLM"
    can_generate = getattr(base, "can_generate", None)
    return bool(can_generate()) if callable(can_generate) else False


def _causal_output(output: Any) -> bool:
    """A Transformers output class the docs name as a causal LM's (``CausalLMOutput...``)."""
    return re.match(r"CausalLMOutput", type(output).__name__) is not None


def decide_shift(names: LabelNames, output: Any, x: Any) -> None:
    """At the first batch, ``shift`` not known from the module (``None``): ``True`` for an output
    named as a causal LM's; ``False`` unless the batch's labels repeat its ``input_ids`` (a language
    model's batch), where fitkit cannot tell whether the module's logits at ``t`` predict token
    ``t`` or ``t + 1``: a ``ValueError`` naming ``shift_labels=``. One host read, once.

    Raises:
        ValueError: the labels are the inputs, and nothing says whether they shift.

    Example:
        >>> names = LabelNames(("labels",), shift=None)
        >>> decide_shift(names, torch.zeros(1, 2, 3), {"input_ids": torch.tensor([[1, 2]]),
        ...                                             "labels": torch.tensor([[1, 3]])})
        >>> names.shift
        False
    """
    if names.shift is not None:
        return
    if _causal_output(output):
        names.shift = True
        return
    labels = x.get(names[0]) if isinstance(x, Mapping) and len(names) == 1 else None
    ids = x.get("input_ids") if isinstance(x, Mapping) else None
    if (
        isinstance(labels, torch.Tensor)
        and isinstance(ids, torch.Tensor)
        and labels.shape == ids.shape
        and labels.dim() >= 2
        and bool(((labels == ids) | (labels == names.pad)).all())
    ):
        raise ValueError(
            f"The batch's '{names[0]}' repeat its 'input_ids' (a language model's batch), and fitkit cannot tell "
            f"whether {type(output).__name__} outputs at position t predict token t + 1 (a causal LM: the labels "
            "must shift, as a causal LM's own loss shifts them) or token t. Fix: pass compile(shift_labels=True) "
            "for a causal LM, or shift_labels=False when the labels are already aligned with the outputs."
        )
    names.shift = False


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


def resolve_label_names(
    label_names: Any, module: nn.Module, shift_labels: Any = None, compiled: bool = True, pad: int | None = -100
) -> LabelNames:
    """``compile(label_names=..., shift_labels=...)`` checked: ``None`` (the default above), a key, or keys.

    ``shift_labels`` (a compiled loss on a dict batch's labels): ``True`` / ``False``, or ``None``
    (:func:`causal_shift` of ``module``; for a module it does not know, decided at the first batch by
    :func:`decide_shift`). Without a compiled loss (``compiled=False``) ``None`` is ``False``: the
    module's own loss shifts its labels itself. ``pad``: the compiled loss's ``ignore_index``.

    Raises:
        TypeError: not ``None``, a ``str`` or a sequence of ``str``; ``shift_labels`` not ``None`` or a bool.
        ValueError: an empty sequence, or a key named twice.

    Example:
        >>> resolve_label_names(["start_positions", "end_positions"], nn.Linear(1, 1))
        ('start_positions', 'end_positions')
        >>> resolve_label_names("target", nn.Linear(1, 1))
        ('target',)
    """
    if shift_labels is not None and not isinstance(shift_labels, bool):
        raise TypeError(
            f"Expected `shift_labels` to be True, False or None. Received: shift_labels={shift_labels!r}. Fix: "
            "True for a causal LM (position t predicts label t + 1), False for labels aligned with the outputs."
        )
    if shift_labels is None:
        shift_labels = causal_shift(module) if compiled else False
    pad = -100 if pad is None else pad
    if label_names is None:
        return LabelNames(default_label_names(module), shift_labels, pad)
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
    return LabelNames(tuple(names), shift_labels, pad)


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
