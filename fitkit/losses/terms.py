"""Loss terms: a loss callable that returns a dict or a tuple of scalars instead of one tensor.

A VAE's reconstruction and KL, a detector's box and class losses: the callable returns each
term, fitkit optimises their total and logs every term next to the loss (``loss_<name>`` in
training, ``val_loss_<name>`` in validation, ``loss_<name>`` in ``evaluate``), as an epoch mean
weighted exactly as the loss's (the same rows, summed the same way over accumulation windows and
ranks). The total:

- a dict with a ``"loss"`` key: that value (the Hugging Face convention); the other keys are
  the terms, logged but not added up;
- a dict without one: the sum of its values (Composer's rule for a dict loss);
- a tuple (or list): the sum of its values (Composer's rule for a tuple loss), the terms named
  by position: ``loss_0``, ``loss_1``, ...

Every term and the total are 0-dim floating tensors (a batch mean): a loss of terms gives one
value per batch, so sample weights and ``class_weight`` cannot weigh it (refused at the first
batch, before any step). The terms are logged as the callable returns them (a ``loss_weights``
factor scales the total only).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, cast

import torch

__all__ = ["split_terms", "TOTAL_KEY"]

#: The key of a dict loss that holds the total to optimise (else the terms are summed).
TOTAL_KEY = "loss"

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")  # a log key, a CSV column: the rule of validation set names


def _refuse(key: Any, value: Any, named: bool, loss_name: str) -> None:
    """Raise the error that says what is wrong with the term ``key`` (its name or its value)."""
    if named and not isinstance(key, str):
        raise TypeError(
            f"Expected the keys of the dict returned by the loss '{loss_name}' to be strings (they name the logged "
            f"terms, loss_<name>). Received: key {key!r} of type {type(key).__name__}. Fix: use string keys."
        )
    if named and not _NAME.match(key):
        raise ValueError(
            f"Expected the term names of the loss '{loss_name}' to be letters, digits, '_', '.' or '-' (they become "
            f"log keys and CSV columns, loss_<name>). Received: {key!r}. Fix: rename the term."
        )
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"Expected every term of the loss '{loss_name}' to be a 0-dim tensor. Received: {key}={value!r} of type "
            f"{type(value).__name__}. Fix: return a tensor (torch.as_tensor(value)), computed from the prediction."
        )
    raise ValueError(
        f"Expected every term of the loss '{loss_name}' to be a 0-dim floating tensor (the batch's mean). "
        f"Received: {key} of shape {tuple(value.shape)} and dtype {value.dtype}. Fix: reduce it to the "
        "batch's mean (e.g. `.mean()`)."
    )


def split_terms(out: Any, loss_name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The total to optimise and the named terms of a loss callable's dict or tuple.

    Args:
        out: what the callable returned: a dict ``{name: 0-dim tensor}`` (with ``"loss"`` as the
            total, or summed) or a tuple / list of 0-dim tensors (summed).
        loss_name: the loss's name, for messages.

    Returns:
        ``(total, terms)``: the 0-dim total, and the terms by name in the order returned (a
        tuple's by position, ``"0"``, ``"1"``, ...; a dict's without its ``"loss"`` key).

    Raises:
        TypeError: ``out`` is neither a tensor, a dict nor a tuple; a term that is not a tensor;
            a dict key that is not a string.
        ValueError: no term; a term that is not 0-dim and floating; a name that cannot be a log key.

    Example:
        >>> total, terms = split_terms({"recon": torch.tensor(2.0), "kl": torch.tensor(0.5)}, "vae")
        >>> total, list(terms)
        (tensor(2.5000), ['recon', 'kl'])
        >>> split_terms({"loss": torch.tensor(1.0), "kl": torch.tensor(0.5)}, "vae")[0]
        tensor(1.)
        >>> split_terms((torch.tensor(1.0), torch.tensor(3.0)), "pair")
        (tensor(4.), {'0': tensor(1.), '1': tensor(3.)})
    """
    named = isinstance(out, Mapping)
    if not named and not isinstance(out, (tuple, list)):
        raise TypeError(
            f"Expected the loss '{loss_name}' to return a tensor, a dict of 0-dim tensors or a tuple of them. "
            f"Received: {type(out).__name__}. Fix: return the batch's mean loss, or its terms."
        )
    # one pass, no helper call unless a term is refused: this runs at every step
    terms: dict[str, torch.Tensor] = {}
    total: torch.Tensor | None = None
    for key, value in out.items() if named else enumerate(out):
        if (
            not isinstance(value, torch.Tensor)
            or value.dim() != 0
            or not value.is_floating_point()
            or named
            and not (isinstance(key, str) and _NAME.match(key))
        ):
            _refuse(key, value, named, loss_name)
        if named and key == TOTAL_KEY:
            total = value
        else:
            terms[str(key)] = value  # a dict's key as it is, a tuple's position
    if total is not None:
        return total, terms
    if not terms:
        raise ValueError(
            f"Expected the loss '{loss_name}' to return at least one term. Received: an empty "
            f"{type(out).__name__}. Fix: return the batch's mean loss, or its terms."
        )
    for value in terms.values():
        total = value if total is None else total + value
    return cast(torch.Tensor, total), terms
