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
targets that are already shifted).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["prediction_of", "require_prediction", "own_loss", "targets_of", "module_inputs"]


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


def module_inputs(x: Any, y: Any, compiled_loss: bool) -> Any:
    """The module's inputs for a batch ``(x, y)``: a dict ``x``'s ``"labels"`` are left out when they
    are the target of a compiled loss (``compiled_loss``: a loss is compiled and ``compute_loss`` is
    fitkit's own), as the Transformers Trainer pops them for a custom loss; else ``x`` itself.

    Example:
        >>> sorted(module_inputs({"input_ids": torch.zeros(2), "labels": torch.ones(2)}, None, True))
        ['input_ids']
        >>> sorted(module_inputs({"input_ids": torch.zeros(2), "labels": torch.ones(2)}, None, False))
        ['input_ids', 'labels']
    """
    if compiled_loss and y is None and isinstance(x, Mapping) and "labels" in x:
        return {k: v for k, v in x.items() if k != "labels"}
    return x


def targets_of(x: Any, y: Any) -> Any:
    """``y``, or ``x["labels"]`` for a dict input without ``y`` (Hugging Face batches).

    Example:
        >>> targets_of({"input_ids": torch.zeros(2), "labels": torch.ones(2)}, None)
        tensor([1., 1.])
    """
    if y is None and isinstance(x, Mapping):
        return x.get("labels")
    return y
