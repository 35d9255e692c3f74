"""The default override points of :class:`~fitkit.Model`: ``compute_loss``, ``train_step``,
``test_step``, ``predict_step`` and ``update_metrics``, as functions of the model.

``Model``'s methods of these names call them, so a subclass that overrides one still finds the
others; what they read of the model is the public vocabulary plus ``model._core`` (the stepper,
the training forward, the phase stack).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from fitkit import nest
from fitkit.losses import MultiLoss
from fitkit.losses.denominators import denominator, objective
from fitkit.losses.outputs import (
    module_inputs,
    own_loss,
    own_objective,
    prediction_of,
    require_prediction,
    targets_of,
)

if TYPE_CHECKING:
    from fitkit.model import Model

__all__ = ["compute_loss", "train_step", "test_step", "predict_step", "update_metrics", "batch_denominator"]


def compute_loss(
    model: Model, x: object, y: object, y_pred: object, sample_weight: torch.Tensor | None
) -> torch.Tensor:
    """The batch's training objective: ``sum(w * l) / sum(w)`` over its loss terms.

    The terms are the tokens that count for a class-index loss (``"cross_entropy"``,
    ``"nll"``: every target position but ``ignore_index``) and the rows for the others;
    ``w`` is 1 without sample weights (see :mod:`fitkit.losses.denominators`). Override it to add
    terms (e.g. a regularizer); ``x`` is there for losses that need it. With
    ``compile(loss=None)``, a module output that carries its own ``"loss"`` (Hugging Face
    models called with ``labels``) is the objective: a 0-dim loss as it is (sample weights are
    refused: they cannot reach it), a ``(B,)`` one (per sample) as ``sum(w * l) / sum(w)``.
    With a compiled loss and no ``y``, a dict batch's ``"labels"`` are the targets (the
    Transformers Trainer's default ``label_names``), for the metrics too; the default steps
    then leave ``labels`` out of the module's inputs, as the Trainer does for a custom loss,
    so the model does not compute a loss of its own.

    Args:
        x: the batch's inputs.
        y: its targets (``None`` if the batches have none: then ``x["labels"]`` for a dict ``x``).
        y_pred: the module's output.
        sample_weight: ``(B,)`` weights, per-position weights shaped like ``y``, or ``None``.

    Returns:
        A 0-dim tensor.

    Raises:
        RuntimeError: no loss was compiled and the output carries none.
        ValueError: no targets, or targets that do not fit the prediction.
    """
    loss = model.loss
    if loss is None:
        own = own_loss(y_pred)
        if own is not None:  # a (B,) own loss takes sample weights; a 0-dim one refuses them
            return own_objective(own, sample_weight)
        raise RuntimeError(
            "No loss to compute: none was compiled and the module's output carries no 'loss' (a "
            "Hugging Face model computes one only when its inputs hold `labels`). Fix: put the "
            "targets in the input dict as 'labels', `model.compile(loss=...)`, or override `compute_loss`."
        )
    if y is None:
        y = targets_of(x, y, model.label_names)  # a dict batch's "labels" (Hugging Face's convention)
    if y is None:
        raise ValueError(
            f"The loss needs targets, but the batch has no `y` (nor a dict entry named by label_names="
            f"{list(model.label_names)}). Fix: pass `y=`, yield `(x, y)` batches, put the targets in a dict "
            "batch as 'labels' (or name their key: compile(label_names=[...])), or override `compute_loss`."
        )
    if not isinstance(loss, MultiLoss) and not isinstance(y_pred, torch.Tensor):
        # A plain callable loss may read the whole structured output; fitkit's losses need
        # the prediction picked by the rule of fitkit.losses.outputs.
        pred = prediction_of(y_pred)
        if pred is not None:
            y_pred = pred
        elif loss.kind != "custom":
            require_prediction(y_pred, f"the loss '{loss.name}'")
    if sample_weight is None and isinstance(y, torch.Tensor) and y.is_floating_point():
        return loss(y_pred, y)  # float targets count rows: objective's common case, one call less
    return objective(loss, y_pred, y, sample_weight)  # sum(w * l) / sum(w) over rows or tokens


def forward_inputs(model: Model, x: object, y: object) -> Any:
    """What the module is called with for batch ``(x, y)`` (a dict batch less its targets)."""
    return module_inputs(x, y, model.loss is not None and model.default_compute_loss, model.label_names)


def train_step(model: Model, batch: tuple[Any, Any, Any]) -> None:
    """One (micro-)batch of training: forward, loss, backward, metrics, optimizer step.

    ``batch`` is ``(x, y, sample_weight)`` on the device (``y`` / ``sample_weight`` may be
    ``None``). Override it with the public pieces: ``self(x)`` (the training forward),
    :meth:`compute_loss`, :meth:`autocast`, :meth:`backward`, :meth:`optimizer_step`
    (a no-op inside an accumulation window) and :meth:`update_metrics`; see
    "Custom training steps" in the docs for an auxiliary loss and a two-optimizer step.
    """
    x, y, sample_weight = batch
    core = model._core
    stepper = core.stepper or core.require_compiled("train_step")
    inputs = x if isinstance(x, torch.Tensor) else forward_inputs(model, x, y)
    window = stepper.window
    if window.num_items is not None and isinstance(inputs, Mapping):  # the module's own token loss
        inputs = {**inputs, "num_items_in_batch": window.num_items}
    if stepper.plain:  # one process, float32: both contexts below would do nothing
        y_pred = core.training_forward(inputs)
        loss = model.compute_loss(x, y, y_pred, sample_weight)
        model.backward(loss)
    else:
        with stepper.no_sync(model.module):
            with model.autocast():
                y_pred = core.training_forward(inputs)
                loss = model.compute_loss(x, y, y_pred, sample_weight)
            if core.parallel is not None and nest.rows(y if y is not None else x) == 0:
                loss = loss.nan_to_num(0.0)  # a rank's empty share of a short last batch: 0, not 0/0
            model.backward(loss)
    # Metrics first: a metric that rejects the batch then fails before the weights change.
    target = y if y is not None else targets_of(x, y, model.label_names)
    if window.items_here is not None and isinstance(inputs, Mapping):  # a module's own token loss:
        here = window.items_here  # the batch's mean and its count of label tokens go to the totals
        if window.num_items is None:  # its own mean: NaN where no label counts (0 / 0), weighed 0 here
            mean = loss.detach().where(here > 0, 0.0)
        else:
            mean = loss.detach() * (window.num_items / torch.clamp(here, min=1))
        _add(model, mean, y_pred, target, sample_weight, here)
    else:
        model.update_metrics(loss, y_pred, target, sample_weight)
    model.optimizer_step()


def test_step(model: Model, batch: tuple[Any, Any, Any]) -> None:
    """One batch of evaluation (eval mode, no grad): loss and metrics."""
    x, y, sample_weight = batch
    with model.autocast():
        y_pred = model._core.training_forward(x if isinstance(x, torch.Tensor) else forward_inputs(model, x, y))
        has_loss = model.loss is not None or not model.default_compute_loss or own_loss(y_pred) is not None
        # y=None still reaches compute_loss: an override may not need targets (autoencoders),
        # and the default one says that a compiled loss does.
        loss = model.compute_loss(x, y, y_pred, sample_weight) if has_loss else None
    model.update_metrics(loss, y_pred, targets_of(x, y, model.label_names), sample_weight)


def predict_step(model: Model, batch: tuple[Any, Any, Any]) -> Any:
    """One batch of prediction: the module's output for ``x`` (``y`` is ignored).

    Under mixed precision the module runs under autocast, and float16 / bfloat16 outputs
    come back as float32, as a user of ``predict`` expects (Keras returns float32 too).
    """
    with model.autocast():
        out = model._core.training_forward(batch[0])
    if isinstance(out, Mapping) and "logits" in out:
        out = out["logits"]
    if model.precision == "32":
        return out
    return nest.map_structure(lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, out)


def update_metrics(
    model: Model, loss: torch.Tensor | None, y_pred: object, y: object, sample_weight: torch.Tensor | None = None
) -> None:
    """Add a batch to the running phase's loss and metrics (on the device, no sync).

    Call it from a custom ``train_step`` / ``test_step`` so the logs see the batch. The terms
    of a compiled loss that returned a dict or tuple (:mod:`fitkit.losses.terms`), kept from its
    last call, are added with the loss (``loss_<name>``) and taken: each call adds them once.
    ``y_pred`` may be a structured output (its prediction is picked as in
    :mod:`fitkit.losses.outputs`).

    Raises:
        RuntimeError: called outside ``fit`` / ``evaluate`` / ``*_on_batch``.
    """
    stack = model._core.phases.stack
    if not stack:
        raise RuntimeError(
            "`update_metrics` adds to the running fit / evaluate; it was called outside one. "
            "Fix: call it from train_step or test_step."
        )
    totals = stack[-1]
    pred = y_pred if isinstance(y_pred, torch.Tensor) else prediction_of(y_pred)
    if pred is None and y is not None and totals.metrics.entries != []:
        require_prediction(y_pred, "the compiled metrics")  # raises, naming the rule and the fix
    count = denominator(model.loss, y, sample_weight, y_pred) if loss is not None else None
    compiled = model.loss
    # a loss of terms: taken once, by this batch (a read of one attribute for every other loss)
    terms = compiled.take_terms() if compiled is not None and compiled.terms is not None else None
    totals.update(loss, y_pred if pred is None else pred, y, sample_weight, denominator=count, terms=terms)


def _add(model: Model, loss: torch.Tensor, y_pred: object, y: object, sample_weight: object, count: object) -> None:
    """Add a batch whose loss denominator is known (a module's own token loss) to the totals."""
    totals = model._core.phases.stack[-1]
    pred = y_pred if isinstance(y_pred, torch.Tensor) else prediction_of(y_pred)
    totals.update(loss, y_pred if pred is None else pred, y, sample_weight, denominator=count)


def batch_denominator(model: Model, batch: tuple[Any, Any, Any]) -> int | torch.Tensor:
    """The loss denominator of ``batch`` (rows, label tokens or weights): the stepper's window weights."""
    x, y, w = batch
    return denominator(model.loss, y if y is not None else targets_of(x, y, model.label_names), w, x)
