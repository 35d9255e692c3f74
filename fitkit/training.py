"""The step: ``train_step`` / ``test_step`` / ``predict_step`` and what they share.

Nothing here reads a device value on the host during a step: the loss and the metric states
accumulate on the device and are read at the end of an epoch, or when a callback reads a
batch log. Gradient accumulation groups ``k`` micro-batches and weights each by its share of
the group's samples (or sample weights), so the step equals one step on the whole group.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fitkit import compile as _compile
from fitkit import data as _data
from fitkit import distributed as _distributed
from fitkit.devices import autocast, move_to_device
from fitkit.tracking import TrackerMixin

__all__ = ["StepMixin"]


def _to_float32(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
    if isinstance(out, (tuple, list)):
        return type(out)(_to_float32(o) for o in out)
    if isinstance(out, dict):
        return {k: _to_float32(v) for k, v in out.items()}
    return out


def _call(module: nn.Module, x: Any) -> Any:
    # A tuple x is several positional inputs, a dict x keyword inputs (API.md).
    if isinstance(x, tuple):
        return module(*x)
    if isinstance(x, dict):
        return module(**x)
    return module(x)


class StepMixin(TrackerMixin):
    """Steps and trackers of :class:`fitkit.Model` (a mixin; see the Model for the API)."""

    _parallel: Any = None  # a fitkit.distributed.Parallel under torchrun (set by the Model)
    _stop_agreed = False  # under torchrun: a stop every rank agreed on during this epoch

    # -- state -----------------------------------------------------------------------------
    def _init_step_state(self) -> None:
        self.precision = "32"
        self.gradient_accumulation_steps = 1
        self.clip_grad_norm = self.clip_grad_value = None
        self.scheduler_interval = "epoch"
        self.grad_norm: torch.Tensor | None = None
        self._scaler: torch.amp.GradScaler | None = None
        self._jit: Any = False
        self._forward_module: nn.Module | None = None
        self._micro_last, self._micro_scale = True, None
        self._step_index = 0
        self._stepped = True
        self._skip_step = False
        self._step_hook = None
        self._epoch = 0
        self._lr_used: Any = None
        self._example_x: Any = None
        self._reset_trackers()

    # -- the forward -----------------------------------------------------------------------
    def _wrap_forward(self) -> nn.Module | None:
        eager = self._eager_forward()
        compiled = _compile.maybe_compile(self.module if eager is None else eager, self._jit)
        return eager if compiled is None else compiled

    def _eager_forward(self) -> nn.Module | None:
        # Under torchrun the training forward is DDP's (built once the optimizer exists);
        # None means the module itself (also an FSDP-sharded one).
        if self._parallel is None or self.optimizer is None:
            return None
        return self._parallel.wrap(self.module)

    def _call_module(self, x: Any) -> Any:
        m = self._forward_module
        if m is None:
            return _call(self.module, x)
        try:
            return _call(m, x)
        except Exception as e:
            if not _compile.is_compile_error(e):
                raise
            _compile.warn_fallback(e)  # once: the eager module is used from now on
            self._forward_module = self._eager_forward()
            return _call(self.module if self._forward_module is None else self._forward_module, x)

    def _call_module_eager(self, x: Any) -> Any:
        return _call(self.module, x)

    def _autocast(self):
        if self.precision == "32":
            return contextlib.nullcontext()
        return autocast(self.device, self.precision)

    # -- override points -------------------------------------------------------------------
    def compute_loss(self, x: Any, y: Any, y_pred: Any, sample_weight: torch.Tensor | None) -> torch.Tensor:
        """The batch's training objective: ``sum(w * l) / sum(w)``, or the plain mean.

        Override it to add terms (e.g. a regularizer); ``x`` is there for losses that need it.

        Args:
            x: the batch's inputs.
            y: its targets (``None`` if the batches have none).
            y_pred: the module's output.
            sample_weight: ``(B,)`` weights or ``None``.

        Returns:
            A 0-dim tensor.

        Raises:
            RuntimeError: no loss was compiled.
            ValueError: no targets, or targets that do not fit the prediction.
        """
        if self.loss is None:
            raise RuntimeError(
                "No loss to compute. Fix: `model.compile(loss=...)`, or override `compute_loss`."
            )
        if y is None:
            raise ValueError(
                "The loss needs targets, but the batch has no `y`. Fix: pass `y=` or yield "
                "`(x, y)` batches, or override `compute_loss`."
            )
        if sample_weight is None:
            return self.loss(y_pred, y)
        per_sample = self.loss(y_pred, y, per_sample=True)
        w = sample_weight.to(per_sample.dtype)
        if w.shape != per_sample.shape:
            raise ValueError(
                f"Expected `sample_weight` of shape {tuple(per_sample.shape)} (one per sample). "
                f"Received shape {tuple(w.shape)}."
            )
        total = w.sum()
        # A batch whose weights are all zero contributes a zero loss, not 0/0.
        return (per_sample * w).sum() / torch.where(total == 0, torch.ones_like(total), total)

    def train_step(self, batch: tuple[Any, Any, Any]) -> None:
        """One (micro-)batch of training: forward, loss, backward, and the optimizer step.

        ``batch`` is ``(x, y, sample_weight)`` on the device (``y`` / ``sample_weight`` may be
        ``None``). With gradient accumulation the optimizer steps on the last micro-batch of
        each group only. Override for custom training (call :meth:`update_metrics`).
        """
        x, y, sample_weight = batch
        with self._no_sync():
            with self._autocast():
                y_pred = self._call_module(x)
                loss = self.compute_loss(x, y, y_pred, sample_weight)
            if self._parallel is not None and _data.batch_size_of(y if y is not None else x) == 0:
                loss = loss.nan_to_num(0.0)  # a rank's empty share of a short last batch: 0, not 0/0
            self._step_loss = loss.detach()  # detached: a past step's graph is never kept alive
            self._backward(loss)
        # Metrics first: a metric that rejects the batch then fails before the weights change.
        self.update_metrics(loss, y_pred, y, sample_weight)
        self._optimizer_step()

    def test_step(self, batch: tuple[Any, Any, Any]) -> None:
        """One batch of evaluation (eval mode, no grad): loss and metrics."""
        x, y, sample_weight = batch
        with self._autocast():
            y_pred = self._call_module(x)
            has_loss = self.loss is not None or type(self).compute_loss is not StepMixin.compute_loss
            # y=None still reaches compute_loss: an override may not need targets (autoencoders),
            # and the default one says that a compiled loss does.
            loss = self.compute_loss(x, y, y_pred, sample_weight) if has_loss else None
        self.update_metrics(loss, y_pred, y, sample_weight)

    def predict_step(self, batch: tuple[Any, Any, Any]) -> Any:
        """One batch of prediction: the module's output for ``x`` (``y`` is ignored).

        Under mixed precision the module runs under autocast, and float16 / bfloat16 outputs
        come back as float32, as a user of ``predict`` expects (Keras returns float32 too).
        """
        with self._autocast():
            out = self._call_module(batch[0])
        return out if self.precision == "32" else _to_float32(out)

    # -- backward and step -----------------------------------------------------------------
    def _no_sync(self):
        # Non-final accumulation micro-steps skip DDP's / FSDP's gradient all-reduce.
        if self._parallel is None or self._micro_last:
            return contextlib.nullcontext()
        return self._parallel.no_sync(self.module)

    def _backward(self, loss: torch.Tensor) -> None:
        if self._micro_scale is not None:  # share of the accumulation group
            loss = loss * self._micro_scale
        if self._scaler is not None:
            self._scaler.scale(loss).backward()
        else:
            loss.backward()

    def _watch_optimizer_steps(self) -> None:
        # GradScaler skips optimizer.step() on inf/NaN gradients; a post-hook tells us whether
        # it ran, so a skipped step does not advance the scheduler (no extra host sync).
        if self._step_hook is not None:
            self._step_hook.remove()

        def mark(*_: Any) -> None:
            self._stepped = True

        self._step_hook = self.optimizer.register_step_post_hook(mark)

    def _optimizer_step(self) -> None:
        if not self._micro_last:
            return
        opt = self.optimizer
        if self._scaler is not None:
            self._scaler.unscale_(opt)
        self._callbacks.on_backward_end(self._step_index)
        if self._parallel is not None and self._callbacks.wants("on_backward_end"):
            # A veto or a stop on one rank holds for all: the ranks step and stop together.
            # (Such callbacks read the loss on the host anyway; this adds one tiny all-reduce.)
            self._skip_step, self._stop_agreed = _distributed.any_rank(self._skip_step, self.stop_training)
            self.stop_training = self.stop_training or self._stop_agreed
        if self._skip_step:  # a callback (e.g. TerminateOnNaN) vetoed this step
            self._skip_step = False
            opt.zero_grad(set_to_none=True)
            if self._scaler is not None:
                self._scaler.update()
            return
        if self.clip_grad_norm is not None:
            self.grad_norm = nn.utils.clip_grad_norm_(self.module.parameters(), self.clip_grad_norm)
        if self.clip_grad_value is not None:
            nn.utils.clip_grad_value_(self.module.parameters(), self.clip_grad_value)
        if self._scaler is not None:
            self._stepped = False
            self._scaler.step(opt)
            self._scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        self._global_step += 1
        if self.scheduler is not None and self.scheduler_interval == "step" and self._stepped:
            self._lr_used = opt.param_groups[0]["lr"]
            self.scheduler.step()

    def _stop_now(self, epoch_end: bool = False) -> bool:
        """Whether training stops here (``model.stop_training``).

        Under torchrun every rank must run the same steps, so a stop set on some ranks takes
        effect where the ranks agree: after ``on_backward_end`` when a callback uses that hook,
        and at the end of the epoch (one all-reduce: any rank's stop stops all).
        """
        if self._parallel is None:
            return self.stop_training
        if epoch_end:
            self.stop_training = _distributed.any_rank(self.stop_training)
            return self.stop_training
        return self._stop_agreed

    def _step_scheduler_epoch(self, logs: dict[str, float]) -> None:
        if self.scheduler is None or self.scheduler_interval != "epoch":
            return
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            key = "val_loss" if "val_loss" in logs else "loss"
            self.scheduler.step(logs[key])
        else:
            self.scheduler.step()

    # -- batches of an epoch ---------------------------------------------------------------
    def _batch_weight(self, batch: tuple[Any, Any, Any]) -> Any:
        x, y, w = batch
        if w is not None:
            return w.sum()
        return _data.batch_size_of(y if y is not None else x)

    def _micro_batches(self, loader: _data.DeviceLoader) -> Iterator[tuple[int, Any]]:
        """Yield ``(batch_index, batch)``, setting the micro-step flags of each batch."""
        resume = self._take_resume_point()
        it, start = resume(loader) if resume is not None else (iter(loader), 0)
        k = self.gradient_accumulation_steps
        if k == 1 and self._parallel is None:
            self._micro_last, self._micro_scale = True, None
            for step, batch in enumerate(it, start):
                self._step_index = step
                yield step, batch
            return
        step = start
        while True:
            group = list(itertools.islice(it, k))
            if not group:
                return
            sizes = [self._batch_weight(b) for b in group]
            # Under torchrun: (global weight of the group) / W, all-reduced on the device, so
            # each rank's share makes DDP's gradient average the exact global mean.
            total = sum(sizes) if self._parallel is None else _distributed.global_share(sizes)
            for i, batch in enumerate(group):
                self._micro_scale = sizes[i] / total
                self._micro_last = i == len(group) - 1
                self._step_index = step
                yield step, batch
                step += 1
                if self._stop_now():
                    return

    # -- checks before the first step ------------------------------------------------------
    def _preflight(self, loader: _data.DeviceLoader) -> None:
        """Run the first batch of in-memory data through module and loss, changing nothing.

        Shape, dtype and class-range errors then surface before any callback or step.
        """
        src = loader.batches
        if not isinstance(src, _data.TensorBatches) or src.n == 0:
            return
        sl = slice(0, min(src.batch_size, src.n))
        x, y = _data._index(src.x, sl), _data._index(src.y, sl)
        w = None if src.w is None else src.w[sl]
        x, y, w = (move_to_device(a, self.device) for a in (x, y, w))
        self._example_x = x
        if y is None:
            if self.loss is not None and type(self).compute_loss is StepMixin.compute_loss:
                self.compute_loss(x, y, None, w)  # raises: a compiled loss needs targets
            return
        flags = [(m, m.training) for m in self.module.modules()]
        try:
            self.module.eval()
            with torch.no_grad(), self._autocast():
                y_pred = self._call_module(x)
                if self.loss is not None:
                    if getattr(self.loss, "kind", None) == "class_index" and isinstance(y_pred, torch.Tensor):
                        # Before the loss: torch's own out-of-range error names no fix.
                        self.loss.prepare(y_pred, y)  # dtype / shape errors; sets the class layout
                        self._check_class_range(y_pred, src.y)
                    self.compute_loss(x, y, y_pred, w)
                if self.metrics.entries is None:
                    self.metrics.build(y_pred, y)
        finally:
            for m, flag in flags:
                m.training = flag

    def _check_class_range(self, y_pred: Any, y_all: Any) -> None:
        loss = self.loss
        if getattr(loss, "kind", None) != "class_index" or not isinstance(y_all, torch.Tensor):
            return
        if y_all.is_floating_point() or y_all.numel() == 0:
            return
        n_classes = y_pred.shape[-1] if loss.class_last else y_pred.shape[1]
        lo, hi = int(y_all.min()), int(y_all.max())
        if lo < 0 and lo != -100 or hi >= n_classes:
            raise ValueError(
                f"Class labels must lie in [0, {n_classes - 1}] for a module with {n_classes} "
                f"outputs. Received labels from {lo} to {hi}. Fix: remap the labels, or give the "
                "module one output per class."
            )

    # -- single batches --------------------------------------------------------------------
    def _as_batch(self, x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        conv = [(_data._to_tensor(a) if _data.is_in_memory(a) else a) for a in (x, y, sample_weight)]
        return tuple(move_to_device(a, self.device) for a in conv)  # type: ignore[return-value]

    def train_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None) -> dict[str, float]:
        """One optimizer step on one batch; returns that batch's loss and metrics.

        Args:
            x: the batch's inputs ``(B, ...)`` (tensors or numpy arrays, or a tuple / dict).
            y: its targets ``(B, ...)``.
            sample_weight: ``(B,)`` weights for the loss.

        Returns:
            ``{"loss": float, <metric>: float, ...}`` for this batch alone.

        Raises:
            RuntimeError: ``compile`` was not called.

        Example:
            >>> import fitkit
            >>> model = fitkit.Model(nn.Linear(1, 1, bias=False), device="cpu")
            >>> _ = nn.init.ones_(model.module.weight)
            >>> model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
            >>> model.train_on_batch(torch.ones(2, 1), torch.zeros(2, 1))
            {'loss': 1.0}
            >>> round(model.module.weight.item(), 6)  # w - lr * 2 * w * x^2
            0.8
        """
        self._require_compiled("train_on_batch")
        from fitkit.evaluation import _modes

        self._reset_trackers()
        self._micro_last, self._micro_scale = True, None
        with _modes(self.module, training=None, grad=True):
            self.train_step(self._as_batch(x, y, sample_weight))
        return self._epoch_logs()
