"""What a module's output means: the prediction, and a loss the module computed itself.

Hugging Face models (and others) return a structured output (a ``ModelOutput``, a dict, a
namedtuple) and, when called with ``labels``, their own loss. One rule picks the prediction
that metrics and ``predict_step`` use:

1. a tensor is the prediction;
2. a mapping (``ModelOutput`` is one) gives its ``"logits"`` entry, else its only tensor entry
   that is not ``"loss"``;
3. a namedtuple gives its ``logits`` field, else its first field;
4. anything else has no single prediction: a compiled loss or compiled metrics then raise a
   ``ValueError`` (:func:`require_prediction`) that states this rule and the fix (return a
   tensor, or put the prediction under ``"logits"``; for several outputs, one loss per output
   and metrics in a custom ``test_step``). A plain callable loss gets the whole output.

``predict`` returns the ``"logits"`` entry of a mapping that has one, else the whole output.

With ``compile(loss=None)``, an output that holds a ``"loss"`` entry supplies the loss, and
targets for metrics come from ``y`` or, for dict inputs, from ``x["labels"]`` (Hugging Face's
convention; a causal LM shifts its ``labels`` inside, so per-token metrics there need ``y=``
targets that are already shifted). With a compiled loss, a causal LM's ``labels`` are shifted
for the loss and the metrics alike (``compile(shift_labels=)``, :class:`fitkit.losses.labels.LabelNames`).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from fitkit.losses.labels import LABELS, shifted

__all__ = ["prediction_of", "require_prediction", "own_loss", "own_objective", "targets_of", "module_inputs"]


def prediction_of(output: Any) -> Any:
    """The prediction inside ``output`` by the rule above, or ``None`` if there is none.

    Example:
        >>> prediction_of({"loss": torch.tensor(1.0), "logits": torch.zeros(2, 3)}).shape
        torch.Size([2, 3])
        >>> prediction_of(torch.ones(2)).shape
        torch.Size([2])
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        if "logits" in output:
            return output["logits"]
        rest = [v for k, v in output.items() if k != "loss" and isinstance(v, torch.Tensor)]
        return rest[0] if len(rest) == 1 else None
    if isinstance(output, tuple) and hasattr(output, "_fields"):
        return getattr(output, "logits", output[0])
    return None


def _describe(output: Any) -> str:
    if isinstance(output, Mapping):
        keys = [repr(k) for k, v in output.items() if isinstance(v, torch.Tensor)]
        kind = type(output).__name__
        return f"a {kind} with tensor entries {', '.join(keys)}" if keys else f"a {kind} with no tensor entry"
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of {len(output)} items"
    return f"a {type(output).__name__}"


def require_prediction(output: Any, needed_by: str) -> torch.Tensor:
    """The prediction inside ``output`` (see the rule above), or a ``ValueError`` naming the fix.

    Args:
        output: the module's output.
        needed_by: what asks for it, for the message (``"the loss 'cross_entropy'"``).

    Raises:
        ValueError: the rule picks no prediction out of ``output``.

    Example:
        >>> require_prediction({"loss": torch.tensor(0.0), "logits": torch.zeros(2, 3)}, "the metrics").shape
        torch.Size([2, 3])
        >>> require_prediction({"start": torch.zeros(2), "end": torch.zeros(2)}, "the metrics")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: fitkit cannot pick one prediction tensor for the metrics out of the module's output: ...
    """
    pred = prediction_of(output)
    if isinstance(pred, torch.Tensor):
        return pred
    raise ValueError(
        f"fitkit cannot pick one prediction tensor for {needed_by} out of the module's output: "
        f"{_describe(output)}. The rule (fitkit.losses.outputs): a tensor is the prediction; a dict or "
        "ModelOutput gives its 'logits' entry, else its only tensor entry other than 'loss'; a "
        "namedtuple its 'logits' field, else its first field. Fix: return a tensor, or put the "
        "prediction under 'logits'; for several outputs, compile one loss per output (a list or "
        "dict of losses) and compute metrics in a custom test_step."
    )


def own_loss(output: Any) -> torch.Tensor | None:
    """The loss a module computed itself (``output["loss"]`` / ``output.loss``), else ``None``.

    Example:
        >>> own_loss({"loss": torch.tensor(0.5)}), own_loss(torch.zeros(1))
        (tensor(0.5000), None)
    """
    if isinstance(output, Mapping):
        loss = output.get("loss")
    else:
        loss = getattr(output, "loss", None) if hasattr(output, "_fields") else None
    return loss if isinstance(loss, torch.Tensor) else None


def own_objective(own: torch.Tensor, sample_weight: torch.Tensor | None) -> torch.Tensor:
    """The objective of a module's own loss ``own`` with ``sample_weight``.

    A 0-dim loss (a mean the module took itself, as Hugging Face models do) is the objective;
    sample weights cannot reach it. A ``(B,)`` loss (one value per sample: the module computed
    its loss with ``reduction="none"``) gives the mean, or with ``(B,)`` weights
    ``sum(w * l) / sum(w)``, as a compiled loss does (0 where the weights sum to 0).

    Args:
        own: the output's ``"loss"``: 0-dim, or ``(B,)``.
        sample_weight: ``(B,)`` weights (``sample_weight=`` and ``class_weight=`` folded), or ``None``.

    Raises:
        ValueError: weights with a 0-dim loss (the cause and the fix are named), weights of
            another shape than ``(B,)``, or a loss of more than one dimension.

    Example:
        >>> own_objective(torch.tensor([1.0, 3.0]), torch.tensor([3.0, 1.0]))  # (3 + 3) / 4
        tensor(1.5000)
        >>> own_objective(torch.tensor(2.0), torch.ones(2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Sample weights (sample_weight= or class_weight=) cannot reach the module's own loss: ...
    """
    if own.dim() == 0 and sample_weight is None:
        return own
    if own.dim() == 0:
        raise ValueError(
            "Sample weights (sample_weight= or class_weight=) cannot reach the module's own loss: with "
            "compile(loss=None) the loss is the module's, and it returned one number for the batch (a mean it "
            "took itself), so fitkit cannot weigh its samples. Fix: compile a loss (e.g. loss='cross_entropy', "
            "whose targets are then `y` or the batch's 'labels'), or return one loss per sample (shape (B,), "
            "e.g. reduction='none'), which fitkit weighs as sum(w * l) / sum(w)."
        )
    if own.dim() != 1:
        raise ValueError(
            f"Expected the module's own loss to be 0-dim (a batch mean) or (B,) (one per sample). Received shape "
            f"{tuple(own.shape)}. Fix: reduce it to one value per sample, or to the batch mean."
        )
    if sample_weight is None:
        return own.mean()
    if sample_weight.shape != own.shape:
        raise ValueError(
            f"Expected `sample_weight` of shape {tuple(own.shape)}, one weight per value of the module's own "
            f"per-sample loss. Received shape {tuple(sample_weight.shape)}. Fix: pass one weight per sample."
        )
    w = sample_weight.to(own.dtype)
    total = w.sum()
    return (own * w).sum() / torch.where(total == 0, torch.ones_like(total), total)


def module_inputs(x: Any, y: Any, compiled_loss: bool, names: tuple[str, ...] = LABELS) -> Any:
    """The module's inputs for a batch ``(x, y)``: a dict ``x``'s label entries (``names``: the
    compiled ``label_names``, see :mod:`fitkit.losses.labels`) are left out when they are the target
    of a compiled loss (``compiled_loss``: a loss is compiled and ``compute_loss`` is fitkit's own),
    as the Transformers Trainer pops them for a custom loss; else ``x`` itself.

    Example:
        >>> sorted(module_inputs({"input_ids": torch.zeros(2), "labels": torch.ones(2)}, None, True))
        ['input_ids']
        >>> sorted(module_inputs({"input_ids": torch.zeros(2), "labels": torch.ones(2)}, None, False))
        ['input_ids', 'labels']
    """
    if compiled_loss and y is None and isinstance(x, Mapping) and any(n in x for n in names):
        return {k: v for k, v in x.items() if k not in names}
    return x


# (a weak reference to the labels, their version and the pad, the shifted labels): one shift per
# batch; weak, so that the batch (a view of in-memory data) is not kept alive after the fit
_last_shift: list[Any] = [None, None, None]


def _shifted_once(labels: torch.Tensor, pad: int) -> torch.Tensor:
    """:func:`fitkit.losses.labels.shifted`, kept for the batch: the loss, its denominator and the
    metrics read the same shifted labels (one new tensor per batch, no host read)."""
    last = _last_shift
    if last[0] is not None and last[0]() is labels and last[1] == (labels._version, pad):
        return last[2]
    out = shifted(labels, pad)
    last[:] = [weakref.ref(labels), (labels._version, pad), out]
    return out


def targets_of(x: Any, y: Any, names: tuple[str, ...] = LABELS) -> Any:
    """``y``, or a dict input's label entries without ``y`` (Hugging Face batches): ``x[name]`` for
    one name (moved one position left when ``names.shift``: see :class:`fitkit.losses.labels.LabelNames`),
    a tuple in ``names``' order for several, ``None`` when ``x`` holds none of them.

    Raises:
        ValueError: ``x`` holds some of several label names but not all.

    Example:
        >>> targets_of({"input_ids": torch.zeros(2), "labels": torch.ones(2)}, None)
        tensor([1., 1.])
        >>> targets_of({"s": torch.zeros(1), "e": torch.ones(1)}, None, ("s", "e"))
        (tensor([0.]), tensor([1.]))
    """
    if y is None and isinstance(x, Mapping):
        if len(names) == 1:
            labels = x.get(names[0])
            if getattr(names, "shift", False) and isinstance(labels, torch.Tensor):  # a causal LM's labels
                return _shifted_once(labels, names.pad)  # type: ignore[attr-defined]
            return labels
        missing = [n for n in names if n not in x]
        if len(missing) == len(names):
            return None
        if missing:
            raise ValueError(
                f"The batch holds the label entries {[n for n in names if n in x]} but not {missing} "
                f"(label_names={list(names)}); batch keys: {list(x)}. Fix: add them to every batch, or "
                "pass compile(label_names=[...]) with the keys the batches hold."
            )
        return tuple(x[n] for n in names)
    return y


def takes_num_items(module: Any) -> tuple[bool, bool]:
    """``(accepts, shifts)`` for a module computing its own loss: whether its ``forward`` takes
    ``num_items_in_batch`` (the Transformers convention: it then divides its summed token loss
    by that count), and whether its loss shifts the labels by one (a Hugging Face causal LM:
    ``labels[..., 1:]`` are the targets that count). The rule of the Transformers Trainer: the
    model's ``accepts_loss_kwargs``, else a ``**kwargs`` in ``forward`` (a ``PreTrainedModel``), or
    an explicit ``num_items_in_batch`` parameter; a PEFT model is looked through.

    Example:
        >>> class Own(torch.nn.Module):
        ...     def forward(self, input_ids, labels=None, num_items_in_batch=None):
        ...         return input_ids
        >>> takes_num_items(Own()), takes_num_items(torch.nn.Linear(2, 2))
        ((True, False), (False, False))
    """
    import inspect

    base = module.get_base_model() if callable(getattr(module, "get_base_model", None)) else module
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False, False
    hf = any(c.__name__ == "PreTrainedModel" for c in type(base).__mro__)
    accepts = getattr(base, "accepts_loss_kwargs", None)
    if accepts is None:
        var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
        accepts = "num_items_in_batch" in params or (hf and var_kw)
    if not accepts:
        return False, False
    shifts = False
    if hf and not getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        try:
            from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

            # The loss the model's forward calls (its loss_function property, read without its
            # warning): a loss set on it, else its loss_type's, ForCausalLM's when unknown.
            own = getattr(base, "_loss_function", None)
            chosen = (
                own if own is not None else LOSS_MAPPING.get(str(getattr(base, "loss_type", None)), ForCausalLMLoss)
            )
            shifts = chosen is ForCausalLMLoss
        except ImportError:  # pragma: no cover - a transformers without the loss registry
            shifts = False
    return bool(accepts), shifts


def label_items(x: Any, shifts: bool) -> Any:
    """The count of a batch's label tokens that are not ``-100`` (a 0-dim device tensor, no
    sync): ``x["shift_labels"]`` if given, else ``x["labels"]`` (from position 1 when the loss
    ``shifts``); ``None`` without labels.

    Example:
        >>> label_items({"labels": torch.tensor([[5, 6, -100], [7, 8, 9]])}, shifts=True)
        tensor(3)
    """
    if not isinstance(x, Mapping):
        return None
    labels = x.get("shift_labels")
    if labels is None:
        labels = x.get("labels")
        if labels is None or not isinstance(labels, torch.Tensor):
            return None
        if shifts:
            labels = labels[..., 1:]
    return (labels != -100).sum()


def note_row_weighted(module: Any, x: Any) -> None:
    """Warn (a ``FitkitWarning``) that ``module``'s own loss, which takes no
    ``num_items_in_batch``, is weighed by rows when ``x["labels"]`` holds -100 (one host read);
    for a ``fit`` under accumulation or torchrun, once.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     note_row_weighted(torch.nn.Linear(1, 1), {"labels": torch.tensor([1, -100])})
        >>> "takes no `num_items_in_batch`" in str(caught[0].message)
        True
    """
    import warnings

    from fitkit.checks import FitkitWarning

    labels = x.get("labels") if isinstance(x, Mapping) else None
    if isinstance(labels, torch.Tensor) and bool((labels == -100).any()):
        warnings.warn(
            f"{type(module).__name__} computes its own loss, a mean over its label tokens, and its forward "
            "takes no `num_items_in_batch`: under gradient accumulation or torchrun each micro-batch's mean "
            "counts by its rows, so a micro-batch with few real tokens (labels of -100) weighs as much as a "
            "full one. Fix: accept `num_items_in_batch` in forward (sum the token losses and divide by it, as "
            "Hugging Face models do), or compile a loss (loss='cross_entropy', token-exact).",
            category=FitkitWarning,
            stacklevel=4,
        )
