"""The loops that run in eval mode: ``EvalLoop`` (``evaluate``, and validation inside ``fit``)
and ``PredictLoop`` (``predict``). Each owns its call's totals or outputs and its stop flag.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fitkit import distributed as _distributed
from fitkit.callbacks.base import BatchLogs, CallbackList
from fitkit.data.loaders import known_targets, source_name
from fitkit.losses.denominators import targets_count
from fitkit.modes import modes
from fitkit.training import steps as _steps
from fitkit.training.host_outputs import HostOutputs
from fitkit.training.preflight import wrap

if TYPE_CHECKING:
    from fitkit.data import DeviceLoader
    from fitkit.model import Model

__all__ = ["EvalLoop", "PredictLoop", "signal_held"]


def _name(source: DeviceLoader) -> str:
    return source_name(source)


def signal_held(model: Model) -> bool:
    """Whether the running fit holds a SIGTERM / SIGINT (:func:`fitkit.training.signals.deferred`):
    an eval phase inside the fit (validation, a callback's ``evaluate`` / ``predict``) ends after
    its batch, so the fit stops within one batch (the loop's invariant 2). On one process only:
    under torchrun the ranks validate on and agree at the epoch end (every rank runs the same
    collectives). One attribute read per batch, no device sync.

    Example:
        >>> import torch, fitkit
        >>> signal_held(fitkit.Model(torch.nn.Linear(1, 1), device="cpu"))  # no fit running
        False
    """
    fit = model._core.running_fit() if model._core.parallel is None else None
    interrupt = getattr(fit, "interrupt", None)
    return interrupt is not None and interrupt.signum is not None


class EvalLoop:
    """One evaluation pass (``evaluate``, or the validation of a fit epoch).

    Args:
        model: the :class:`fitkit.Model`.
        loader: a :class:`fitkit.data.DeviceLoader`.
        callbacks: the call's :class:`CallbackList` (``on_test_*`` hooks).
        steps: stop after this many batches (``None``: the whole source).
        what: how errors name the source (``"evaluate"`` or ``"validation_data"``).
    """

    def __init__(
        self, model: Model, loader: DeviceLoader, callbacks: CallbackList, steps: int | None, what: str = "evaluate"
    ):
        self.model, self.loader, self.callbacks, self.steps, self.what = model, loader, callbacks, steps, what
        self.totals = model._core.phases.new_totals()
        self.batches = 0

    def run(self) -> dict[str, float]:
        """Loss and metrics over the source: exact per-sample means (Python floats)."""
        model, cbs = self.model, self.callbacks
        want = cbs.wants("on_test_batch_end")
        outer, model.stop_evaluating = model.stop_evaluating, False  # a nested evaluate's flag stays its own
        try:
            return self._run(model, cbs, want)
        finally:
            model.stop_evaluating = outer

    def _run(self, model: Model, cbs: CallbackList, want: bool) -> dict[str, float]:
        # an overridden step or compute_loss may make targets of its own from y (-100 where masked)
        known = known_targets(self.loader) if model.default_compute_loss and model.default_test_step else None
        with (
            modes(model.module, training=False, grad=False),
            model._core.phases.running(self.totals),
            targets_count(model.loss, known),
        ):
            cbs.on_test_begin({})
            for step, batch in enumerate(self.loader):
                cbs.on_test_batch_begin(step, {})
                model.test_step(batch)
                self.batches = step + 1
                if want:
                    cbs.on_test_batch_end(step, BatchLogs(self.totals.running))
                if model.stop_evaluating or self.steps is not None and step + 1 >= self.steps or signal_held(model):
                    break
            if not self.batches:
                raise ValueError(
                    f"`{self.what}` ({_name(self.loader)}) yielded no batch. Fix: pass data with at "
                    "least one sample; a generator is used up after one pass, so pass a re-iterable "
                    "such as a DataLoader or a list for validation in every epoch."
                )
            logs = self.totals.result(self.what if self.what == "evaluate" else None)
            if not logs and model.loss is None and model.default_test_step:
                raise ValueError(
                    f"Expected `{self.what}` to compute a loss or a metric. Received batches whose module output "
                    "holds no 'loss', with compile(loss=None) and no metric that had targets, so there is no "
                    "value to return. Fix: compile a loss (compile(loss=...)), return {'loss': ...} from forward "
                    "(pass the labels in the batch), or compile metrics and give the batches targets."
                )
            cbs.on_test_end(logs)
        model._core.phases.adopt(self.totals)
        return logs


class PredictLoop:
    """One ``predict`` call: outputs of every batch, concatenated in input order."""

    def __init__(self, model: Model, loader: DeviceLoader, callbacks: CallbackList, steps: int | None):
        self.model, self.loader, self.callbacks, self.steps = model, loader, callbacks, steps

    def run(self) -> Any:
        model, cbs = self.model, self.callbacks
        outputs = HostOutputs(model.device, _known_rows(self.loader))  # off the device as they come
        outer, model.stop_predicting = model.stop_predicting, False  # a nested predict's flag stays its own
        try:
            return self._run(model, cbs, outputs)
        finally:
            model.stop_predicting = outer

    def _run(self, model: Model, cbs: CallbackList, outputs: HostOutputs) -> Any:
        with modes(model.module, training=False, grad=False):
            cbs.on_predict_begin({})
            for step, batch in enumerate(self.loader):
                cbs.on_predict_batch_begin(step, {})
                if step:
                    out = model.predict_step(batch)
                else:  # shape and dtype errors of the first batch: what was fed, and a fix
                    try:
                        out = model.predict_step(batch)
                    except Exception as e:
                        custom = type(model).predict_step is not _steps.predict_step
                        raise wrap("predict_step" if custom else "module's forward", batch, e, model.module) from e
                cbs.on_predict_batch_end(step, {"outputs": out})
                outputs.add(out)
                del out  # the device holds this batch's output only until the next one
                if model.stop_predicting or self.steps is not None and step + 1 >= self.steps or signal_held(model):
                    break
            cbs.on_predict_end({})
        return _distributed.gather_predictions(outputs.result(), self.loader)  # torchrun: all rows


def _known_rows(loader: DeviceLoader) -> int | None:
    """The rows in-memory data will yield on this process (``None`` for other sources)."""
    from fitkit.data import TensorBatches

    src = getattr(loader, "batches", None)
    if type(src) is not TensorBatches or getattr(loader, "sharded", False):
        return None
    return int(src.n_used)
