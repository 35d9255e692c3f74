"""Which weights a logged value scored: the hook that best-weights callbacks read.

Validation inside ``fit`` may run on other weights than the module's own: an ``EMA`` (or
``SwapEMAWeights``) swaps the averaged weights in for it. A callback that keeps or writes
"the best weights" by a monitored value must then keep the weights that were scored, not the
training weights of that epoch. A callback that swaps weights for scoring says so with a
``scored_weights(monitor)`` method: a context manager inside which ``model.module`` holds
the weights that scored ``monitor`` (and after which the module's own are back, bit for
bit). :func:`scored_weights` enters every such hook of the running ``fit``;
``EarlyStopping(restore_best_weights=True)`` and ``ModelCheckpoint(save_best_only=True)`` /
``save_top_k`` take their snapshot or write their file inside it. The hooks swap through the
module's one :class:`~fitkit.callbacks.swapping.WeightSwap`, and ``fit`` allows one average to
validate on (:func:`~fitkit.callbacks.swapping.check_weight_swaps`), so the block holds that
one average and the training weights are set aside once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fitkit.model import Model

__all__ = ["scored_weights"]


@contextmanager
def scored_weights(model: Model, monitor: str) -> Iterator[None]:
    """Inside the block, ``model.module`` holds the weights that scored ``monitor``.

    Args:
        model: the :class:`fitkit.Model`; its running ``fit``'s callbacks are asked
            (``model.callbacks``; none outside ``fit``, where the block changes nothing).
        monitor: the log key, e.g. ``"val_loss"``; training keys were scored on the training
            weights, so for them the block changes nothing.

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> with scored_weights(model, "val_loss"):  # outside fit: the module's own weights
        ...     model.module.weight.shape
        torch.Size([1, 1])
    """
    with ExitStack() as stack:
        for cb in model.callbacks:
            hook = getattr(cb, "scored_weights", None)
            if hook is not None:
                stack.enter_context(hook(monitor))
        yield
