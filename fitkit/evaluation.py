"""Evaluation and prediction: ``evaluate`` / ``predict`` and the mode switching they share.

Both run every submodule in eval mode with autograd off, through :func:`modes`, which restores
each submodule's own ``training`` flag and the grad mode afterwards, also when a call raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from fitkit import data as _data
from fitkit import distributed as _distributed
from fitkit.callbacks.base import BatchLogs, Callback, CallbackList
from fitkit.callbacks.progress import resolve_verbose

__all__ = ["EvaluationMixin", "modes"]


def _check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"Expected `{name}` to be an int. Received: {name}={value!r}.")
    if value < minimum:
        raise ValueError(f"Expected `{name}` >= {minimum}. Received: {name}={value}.")


@contextlib.contextmanager
def modes(module: nn.Module, training: bool | None, grad: bool) -> Iterator[None]:
    """Set modes for a phase and restore every submodule's own flag and the grad mode.

    ``training=None`` keeps the user's flags (training runs frozen ``.eval()`` parts frozen);
    ``False`` puts every submodule in eval mode.
    """
    flags = [(m, m.training) for m in module.modules()]
    grad_before = torch.is_grad_enabled()
    try:
        if training is False:
            module.eval()
        torch.set_grad_enabled(grad)
        yield
    finally:
        for m, flag in flags:
            m.training = flag
        torch.set_grad_enabled(grad_before)




_modes = modes  # the name the loop code uses


def _check_callbacks(callbacks: Any) -> list[Callback]:
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"Expected `callbacks` to be a list of Callback objects. Received: {type(callbacks).__name__}.")
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise TypeError(
                f"Expected every callback to subclass fitkit.callbacks.Callback. Received: {cb!r}."
            )
    return list(callbacks)


def _concat(outputs: list[Any]) -> Any:
    if not outputs:
        return torch.empty(0)
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs).cpu()
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([o[i] for o in outputs]) for i in range(len(first)))
    if isinstance(first, Mapping):
        return {k: _concat([o[k] for o in outputs]) for k in first}
    return outputs


class EvaluationMixin:
    """``evaluate`` and ``predict`` of :class:`fitkit.Model` (a mixin; see the Model)."""

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        *,
        batch_size: int | None = 32,
        verbose: int | str = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: list[Callback] | None = None,
    ) -> dict[str, float]:
        """Loss and metrics over the data, as exact per-sample means: ``{"loss": ..., ...}``.

        Runs every submodule in eval mode with autograd off and restores both afterwards. A
        short last batch counts by its size (not a mean of batch means); under torchrun the
        values are reduced over all ranks, every sample counted once.

        Args:
            x: inputs, as for :meth:`fit`.
            y: targets for in-memory ``x``.
            batch_size: samples per batch (in-memory ``x`` and Datasets).
            verbose: 0, 1, 2 or ``"auto"`` (see :meth:`fit`).
            sample_weight: ``(N,)`` weights for the loss.
            steps: evaluate this many batches only.
            callbacks: callbacks whose ``on_test_*`` hooks run.

        Returns:
            ``{"loss": float, <metric>: float, ...}``.

        Raises:
            RuntimeError: ``compile`` was not called.
            TypeError: an argument of the wrong type.
            ValueError: a bad value or data (lengths, shapes, labels).

        Example:
            >>> from fitkit import Model
            >>> model = Model(nn.Linear(1, 1), device="cpu")
            >>> _ = nn.init.zeros_(model.module.weight), nn.init.zeros_(model.module.bias)
            >>> model.compile(loss="mse", metrics=["mae"])
            >>> model.evaluate(torch.zeros(5, 1), torch.tensor([[1.0], [1], [1], [1], [4]]),
            ...                batch_size=2, verbose=0)
            {'loss': 4.0, 'mae': 1.600000023841858}
        """
        self._require_compiled("evaluate")
        batch_size = 32 if batch_size is None else batch_size
        _check_int("batch_size", batch_size, 1)
        _check_int("steps", steps, 1, allow_none=True)
        verbose = resolve_verbose(verbose)
        loader = _data.as_loader(x, y, sample_weight, batch_size=batch_size, device=self.device, steps=steps)
        self._preflight(loader)
        cbs = self._make_callbacks(_check_callbacks(callbacks), verbose, None, loader.num_batches, history=False)
        return self._run_eval(loader, cbs, steps)

    def _run_eval(self, loader, cbs: CallbackList, steps: int | None) -> dict[str, float]:
        self._reset_trackers()
        want = cbs.wants("on_test_batch_end")
        with _modes(self.module, training=False, grad=False):
            cbs.on_test_begin({})
            for step, batch in enumerate(loader):
                cbs.on_test_batch_begin(step, {})
                self.test_step(batch)
                if want:
                    cbs.on_test_batch_end(step, BatchLogs(self._running_logs))
                if steps is not None and step + 1 >= steps:
                    break
            logs = self._epoch_logs()
            cbs.on_test_end(logs)
        return logs

    def predict(
        self,
        x: Any,
        *,
        batch_size: int | None = 32,
        verbose: int | str = "auto",
        steps: int | None = None,
        callbacks: list[Callback] | None = None,
    ) -> Any:
        """Outputs for every input row, in input order, on the CPU.

        Runs in eval mode under ``no_grad``. ``(x, y)`` batches are accepted and ``y`` is
        ignored. Under mixed precision, outputs come back as float32. Under torchrun every
        rank gets every row once, in input order.

        Args:
            x: inputs, as for :meth:`fit` (targets, if any, are ignored).
            batch_size: samples per batch (in-memory ``x`` and Datasets).
            verbose: 0, 1, 2 or ``"auto"`` (see :meth:`fit`).
            steps: predict this many batches only.
            callbacks: callbacks whose ``on_predict_*`` hooks run.

        Returns:
            The module's output structure (a tensor ``(N, ...)``, or a tuple / list / dict of
            them) with every batch concatenated on dim 0.

        Raises:
            TypeError: an argument of the wrong type.
            ValueError: a bad value.

        Example:
            >>> from fitkit import Model
            >>> model = Model(nn.Linear(3, 2), device="cpu")
            >>> model.predict(torch.zeros(10, 3), batch_size=4, verbose=0).shape
            torch.Size([10, 2])
        """
        batch_size = 32 if batch_size is None else batch_size
        _check_int("batch_size", batch_size, 1)
        _check_int("steps", steps, 1, allow_none=True)
        verbose = resolve_verbose(verbose)
        loader = _data.as_loader(x, batch_size=batch_size, device=self.device, steps=steps)
        if self._forward_module is None:
            self._forward_module = self._wrap_forward()
        cbs = self._make_callbacks(_check_callbacks(callbacks), verbose, None, loader.num_batches, history=False)
        outputs: list[Any] = []
        with _modes(self.module, training=False, grad=False):
            cbs.on_predict_begin({})
            for step, batch in enumerate(loader):
                cbs.on_predict_batch_begin(step, {})
                out = self.predict_step(batch)
                outputs.append(out)
                cbs.on_predict_batch_end(step, {"outputs": out})
                if steps is not None and step + 1 >= steps:
                    break
            cbs.on_predict_end({})
        return _distributed.gather_predictions(_concat(outputs), loader)  # torchrun: all rows, every rank

    def test_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None) -> dict[str, float]:
        """Loss and metrics of one batch in eval mode, without training.

        Args:
            x: the batch's inputs ``(B, ...)``.
            y: its targets ``(B, ...)``.
            sample_weight: ``(B,)`` weights for the loss.

        Returns:
            ``{"loss": float, <metric>: float, ...}`` for this batch.

        Raises:
            RuntimeError: ``compile`` was not called.
        """
        self._require_compiled("test_on_batch")
        self._reset_trackers()
        with _modes(self.module, training=False, grad=False):
            self.test_step(self._as_batch(x, y, sample_weight))
        return self._epoch_logs()

    def predict_on_batch(self, x: Any) -> Any:
        """The module's output for one batch in eval mode under ``no_grad``, on the CPU.

        Args:
            x: the batch's inputs ``(B, ...)``.

        Returns:
            The module's output structure for the batch.
        """
        with _modes(self.module, training=False, grad=False):
            return _concat([self.predict_step(self._as_batch(x, None, None))])
