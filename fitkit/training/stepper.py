"""The optimizer step: accumulation window, GradScaler, clipping, skips, step count.

One :class:`Stepper` per compiled model. ``fit`` hands it the epoch's batches
(:meth:`Stepper.micro_batches` groups them into accumulation windows and weights each
micro-batch by its share of the window), ``train_step`` calls :meth:`Stepper.backward` and
:meth:`Stepper.step`. Gradient accumulation is exact: each micro-batch's mean loss is scaled by
``its denominator / the window's`` (rows, sum of sample weights, or tokens that count: see
:mod:`fitkit.losses.denominators`), so a step equals one step on the whole window, a short last
window included. Nothing here reads a device value on the host.

Its state, by lifetime: what lives with the compiled model is the stepper's own (the optimizer,
the GradScaler, clipping, ``global_step``), and so is the LR scheduler's driver
(:class:`~fitkit.training.scheduling.SchedulerDriver`, :attr:`Stepper.scheduling`); what one
``fit`` hands it lives in a :class:`FitHooks` (:attr:`Stepper.fit`, made by
:meth:`Stepper.fitting` and dropped when the fit ends); what one optimizer step accumulates
lives in a :class:`Window` (:attr:`Stepper.window`).

A step can be skipped on the device, with no host read: the fp16 GradScaler's ``found_inf``
and a callback's device-side veto (``model.skip_optimizer_step(when=flag)``, used by
``TerminateOnNaN``) reach optimizers whose step takes ``found_inf`` (torch's ``fused=True``
Adam, AdamW, SGD, Adagrad: ``_step_supports_amp_scaling``), which leave the weights and their
state untouched where it is set. Such steps are counted on the device and subtracted from
``global_step`` when it is read (one host read then, :attr:`Stepper.global_step`). A per-step
scheduler must know at once: with one, the verdict is read on the host each step.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fitkit import distributed as _distributed
from fitkit import nest
from fitkit.callbacks.accumulation import AccumulationSchedule
from fitkit.checks.gradient import check_every_parameter_reached
from fitkit.devices import NO_CONTEXT
from fitkit.losses.outputs import label_items
from fitkit.training.scheduling import SchedulerDriver

if TYPE_CHECKING:
    from fitkit.distributed import Parallel

__all__ = ["Stepper", "FitHooks", "Window"]

Batch = tuple[Any, Any, Any]  # (x, y, sample_weight), on the device


def _batch_weight(batch: Batch) -> Any:
    x, y, w = batch
    return w.sum() if w is not None else nest.rows(y if y is not None else x)


def _nonzero(total: Any) -> Any:
    if isinstance(total, torch.Tensor):
        return torch.where(total == 0, torch.ones_like(total), total)
    return total or 1


class Window:
    """The accumulation window of the coming optimizer step: what lives one step.

    The stepper fills it batch by batch and empties it at the step; a fit and a
    ``train_on_batch`` step each start from an empty one of their own (:meth:`Stepper.fitting`,
    :meth:`Stepper.step_of_its_own`).

    Attributes:
        micro_last: the current micro-batch closes the window (its ``optimizer_step`` steps).
        micro_scale: its share of the window's denominator (a float, or a device tensor under
            torchrun); ``None``: it is the whole window.
        loss: the window's loss so far, detached, on the device (``model.step_loss``).
        skip_requested: a host veto of the coming step (``model.skip_optimizer_step()``).
        veto: a device bool: skip the coming step where it is true (``skip_optimizer_step(when=)``).
        num_items: for a module that computes its own loss and takes ``num_items_in_batch``
            (under accumulation or torchrun): the count of label tokens of the whole window over
            all ranks, divided by the ranks (DDP averages their gradients); ``None`` otherwise.
        items_here: this micro-batch's own count of label tokens (with ``num_items``).
        count: under DDP / FSDP, when only the device knows the window's denominator: this
            rank's denominator, summed over the ranks inside the gradient reduction
            (:mod:`fitkit.distributed.counted`; ``micro_scale`` is then the share of this rank's
            window); ``None`` otherwise.

    Example:
        >>> w = Window()
        >>> w.micro_last, w.micro_scale, w.loss, w.skip_requested, w.veto, w.num_items
        (True, None, None, False, None, None)
    """

    __slots__ = ("micro_last", "micro_scale", "loss", "skip_requested", "veto", "num_items", "items_here", "count")

    def __init__(self) -> None:
        self.micro_last = True
        self.micro_scale: Any = None
        self.count: Any = None
        self.loss: torch.Tensor | None = None
        self.skip_requested = False
        self.veto: torch.Tensor | None = None
        self.num_items: Any = None
        self.items_here: Any = None

    def place(self, micro_scale: Any, micro_last: bool) -> tuple[Any, bool]:
        """Set the running micro-batch's share and whether it closes the window (a batch run in
        chunks, :mod:`fitkit.training.micro_batches`); returns the pair it replaced."""
        old = self.micro_scale, self.micro_last
        self.micro_scale, self.micro_last = micro_scale, micro_last
        return old


class FitHooks:
    """What one ``fit`` hands its stepper: made by :meth:`Stepper.fitting`, dropped at its end.

    Args:
        before_step: ``on_backward_end``, run before each of the fit's optimizer steps, or
            ``None`` (no callback listens; outside a fit).
        stop_training: under torchrun, whether this rank wants to stop: the ranks agree on it
            and on a host veto after ``before_step``; ``None``: they do not agree there.
        validates: whether the fit validates at all (the per-epoch scheduler step reads it).

    Attributes:
        host_rows: under torchrun, ``batch index -> rows of that global batch`` for the running
            epoch when the host knows them (bound to this rank's shards of the training data).
        stop_agreed: a stop on some rank, agreed at the last step.

    Example:
        >>> hooks = FitHooks()  # outside a fit: no hook, no stop query
        >>> hooks.before_step, hooks.validates, hooks.host_rows, hooks.stop_agreed
        (None, False, None, False)
    """

    __slots__ = ("before_step", "stop_training", "validates", "host_rows", "stop_agreed", "check_unused", "items")

    def __init__(
        self,
        before_step: Callable[[], None] | None = None,
        stop_training: Callable[[], bool] | None = None,
        validates: bool = False,
    ):
        self.before_step, self.stop_training, self.validates = before_step, stop_training, validates
        self.host_rows: Callable[[int], int] | None = None
        self.stop_agreed = False  # a fit starts with no stop agreed
        self.check_unused = False  # under plain DDP: look for parameters without a gradient at the first step
        self.items: bool | None = None  # a module's own loss takes num_items_in_batch: whether its labels shift


@dataclass(frozen=True)
class Clipping:
    """``compile``'s gradient clipping: a max global 2-norm and a max absolute element (``None``: off)."""

    norm: float | None = None
    value: float | None = None


@dataclass(frozen=True)
class LossShares:
    """How a batch's loss is shared out in a window (``compile``'s options, read by
    :meth:`Stepper.micro_batches` and :mod:`fitkit.training.micro_batches`).

    Attributes:
        weigh: ``batch -> the denominator of its mean loss`` (rows, weights or tokens).
        sums: the loss is a sum (``reduction="sum"``): no share, each rank counts whole.
        micro_batch_size: rows per forward / backward inside a batch, or ``None``.
    """

    weigh: Callable[[Batch], Any]
    sums: bool = False
    micro_batch_size: int | None = None


class Stepper:
    """Owns everything between ``loss`` and the next weights.

    Args:
        optimizer: the compiled optimizer.
        scheduler: the LR scheduler, or ``None``: see
            :class:`~fitkit.training.scheduling.SchedulerDriver`, which holds it.
        scheduler_interval: ``"epoch"`` or ``"step"`` (torch schedulers; timm ones get both).
        precision: ``"16-mixed"`` adds a ``GradScaler`` (unless ``loss_scale`` is ``False``).
        device: the model's device.
        accumulation: micro-batches per optimizer step, or an
            :class:`~fitkit.callbacks.AccumulationSchedule` (by epoch, applied at epoch begin).
        clip_grad_norm: max global 2-norm of the gradients, or ``None``.
        clip_grad_value: max absolute gradient element, or ``None``.
        parallel: the model's :class:`fitkit.distributed.Parallel` under torchrun, else ``None``.
        weigh: ``batch -> the denominator of its mean loss`` (rows, weights or tokens; see
            :mod:`fitkit.losses.denominators`); default: rows, or the sum of sample weights.
        sums: the loss is a sum (``reduction="sum"``): micro-batches are not scaled by their
            share, and under torchrun each rank's gradient counts whole (DDP's average undone),
            so a step's gradient is the sum over the window and the ranks.
        loss_scale: under ``"16-mixed"``, scale the loss with a ``GradScaler`` (``False``: no
            scaler; no step is skipped for an inf gradient).
        micro_batch_size: split each training batch into chunks of at most this many rows,
            accumulated into the batch's gradient (:mod:`fitkit.training.micro_batches`).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scheduler_interval: str,
        precision: str,
        device: torch.device,
        accumulation: int | AccumulationSchedule = 1,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        parallel: Parallel | None = None,
        weigh: Callable[[Batch], Any] | None = None,
        sums: bool = False,
        loss_scale: bool = True,
        micro_batch_size: int | None = None,
    ):
        self.optimizer = optimizer
        self.scheduling = SchedulerDriver(optimizer, scheduler, scheduler_interval)  # the LR scheduler and its steps
        self.precision = precision
        # loss_scale=False (Keras' auto_scale_loss=False): fp16 autocast with plain backward and steps
        self.scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" and loss_scale else None
        # micro-batches per step by epoch (an AccumulationSchedule), applied at epoch begin
        self.accumulation_schedule = accumulation if isinstance(accumulation, AccumulationSchedule) else None
        self.accumulation = accumulation(0) if isinstance(accumulation, AccumulationSchedule) else accumulation
        # None when neither is set: the step asks one attribute (hot path)
        both = clip_grad_norm, clip_grad_value
        self.clipping = None if both == (None, None) else Clipping(clip_grad_norm, clip_grad_value)
        self.parallel = parallel
        self._steps = 0  # steps taken, minus the device-side skips not yet read (see global_step)
        self._device_skips: torch.Tensor | None = None  # steps skipped on the device, not yet read
        self.takes_found_inf = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self.grad_norm: torch.Tensor | None = None
        self.window = Window()  # the coming step's accumulation window
        self.fit = FitHooks()  # the running fit's hooks (see fitting()); outside a fit, none
        # batch -> the denominator of its mean loss; a reduction="sum" loss (a window's gradient is the
        # sum of its micro-batches'); rows per forward / backward inside a batch (micro_batches), or None
        self.shares = LossShares(weigh or _batch_weight, sums, micro_batch_size)
        self._stepped = True
        # GradScaler skips optimizer.step() on inf/NaN gradients; a post-hook tells us whether
        # it ran, so a skipped step does not advance the scheduler (no extra host sync).
        # Only torch's GradScaler without found_inf skips step() on the host: the one case to watch.
        watch = self.scaler is not None and not self.takes_found_inf
        self._hook = optimizer.register_step_post_hook(self._mark_stepped) if watch else None
        #: one process and float32: train_step's no_sync and autocast contexts do nothing
        self.plain = parallel is None and precision == "32"

    @property
    def clip_grad_norm(self) -> float | None:
        """``compile(clip_grad_norm=...)``: max global 2-norm of the gradients, or ``None``."""
        return None if self.clipping is None else self.clipping.norm

    @property
    def clip_grad_value(self) -> float | None:
        """``compile(clip_grad_value=...)``: max absolute gradient element, or ``None``."""
        return None if self.clipping is None else self.clipping.value

    @property
    def weigh(self) -> Callable[[Batch], Any]:
        """``batch -> the denominator of its mean loss`` (:attr:`LossShares.weigh`)."""
        return self.shares.weigh

    @property
    def sums(self) -> bool:
        """Whether the loss is a sum (:attr:`LossShares.sums`)."""
        return self.shares.sums

    @property
    def micro_batch_size(self) -> int | None:
        """``compile(micro_batch_size=...)`` (:attr:`LossShares.micro_batch_size`)."""
        return self.shares.micro_batch_size

    @property
    def global_step(self) -> int:
        """Optimizer steps taken. Steps skipped on the device are subtracted here: reading it
        after such steps reads their count on the host (one sync, only when it is read)."""
        if self._device_skips is not None:
            skips, self._device_skips = self._device_skips, None
            self._steps -= int(skips)
        return self._steps

    @global_step.setter
    def global_step(self, value: int) -> None:
        self._steps, self._device_skips = int(value), None

    def restart_count(self, value: int = 0) -> int:
        """Set ``global_step`` to ``value`` (``fit(reset_time=True)``: 0); returns the count before."""
        before = self.global_step
        self.global_step = value
        return before

    def _count_device_skip(self, flag: torch.Tensor) -> None:
        flag = flag.detach().reshape(()).to(torch.int64)
        self._device_skips = flag if self._device_skips is None else self._device_skips + flag

    def _mark_stepped(self, *_: Any) -> None:
        self._stepped = True

    def close(self) -> None:
        """Remove the optimizer hook (a recompiled model builds a new stepper)."""
        if self._hook is not None:
            self._hook.remove()

    # -- the accumulation window ---------------------------------------------------------------
    def micro_batches(
        self, batches: Iterator[Batch], start: int, stop: Callable[[], bool]
    ) -> Iterator[tuple[int, Batch]]:
        """``(batch_index, batch)`` from ``start``, each micro-batch's window place set.

        ``stop()`` is asked after the last batch of each window; a stop ends the epoch there (a
        window is never cut: the loop's invariant 1, see :meth:`fitkit.training.loop.FitLoop.run_epoch`).
        """
        if self.accumulation == 1 and self.parallel is None and self.fit.items is None:  # every batch is a window
            window = self.window
            window.micro_last, window.micro_scale = True, None
            return enumerate(batches, start)
        return self._windows(batches, start, stop)

    def _windows(self, batches: Iterator[Batch], start: int, stop: Callable[[], bool]) -> Iterator[tuple[int, Batch]]:
        k = self.accumulation
        step = start
        while True:
            group = list(itertools.islice(batches, k))
            if not group:
                return
            # A module's own loss that takes num_items_in_batch: divided by the window's label tokens
            # over all ranks (/ W: DDP averages), as the Transformers Trainer passes it; no share.
            items = None if self.fit.items is None else [label_items(b[0], self.fit.items) for b in group]
            num_items = count = None
            # a batch without labels: the window weighs rows
            items = items if items is None or all(n is not None for n in items) else None
            if items is not None:
                if self.parallel is not None:
                    num_items = _distributed.global_share(items)
                elif k > 1:
                    num_items = _nonzero(sum(items))
                # else one batch a step on one process: the module's own mean is the step's; its
                # count (items_here) weighs the batch in the epoch loss, as the count does above
                shares: list[Any] = [None] * len(group)
            elif self.shares.sums:  # the sum over the window (and, times W against DDP's average, the ranks)
                scale = float(_distributed.world_size()) if self.parallel is not None else 1.0
                shares = [scale] * len(group)
            else:
                sizes = [self.shares.weigh(b) for b in group]
                # Under torchrun: (global weight of the window) / W, all-reduced on the device, so
                # each rank's share makes DDP's gradient average the exact global mean.
                # A window whose denominator is 0 (all weights 0, every token ignored) adds nothing.
                if self.parallel is None:
                    total = _nonzero(sum(sizes))
                else:
                    total, count = self._global_total(self.parallel, sizes, step)
                shares = [size / total for size in sizes]
            for i, batch in enumerate(group):
                window = self.window
                window.micro_scale, window.num_items, window.count = shares[i], num_items, count
                window.items_here = None if items is None else items[i]
                window.micro_last = i == len(group) - 1
                yield step, batch
                step += 1
                if window.micro_last and stop():
                    return

    def _global_total(self, parallel: Parallel, sizes: list[Any], step: int) -> tuple[Any, Any]:
        """Under torchrun: the window's global denominator / W, and the count DDP carries (or ``None``)."""
        known = _distributed.known_rows(self.fit.host_rows, sizes, step)
        if known is None and parallel.carries_count():
            # each rank's window mean; the sum of the denominators over the ranks rides in
            # DDP's all-reduce / FSDP's reduce-scatters (fitkit.distributed.counted): no collective of ours
            count = sum(sizes)
            return _nonzero(count), count
        # no collective when the sizes are rows that every rank's host knows
        return _distributed.global_share(sizes, known), None

    @contextlib.contextmanager
    def fitting(
        self,
        before_step: Callable[[], None] | None,
        stop_training: Callable[[], bool] | None,
        validates: bool,
        accumulation: AccumulationSchedule | None = None,
        items: bool | None = None,
    ) -> Iterator[None]:
        """Entered once per ``fit``: the fit's :class:`FitHooks` for each of its steps.

        ``before_step()`` (``on_backward_end``, or ``None`` when no callback listens) runs
        before each optimizer step of the fit; under torchrun ``stop_training()`` tells whether
        this rank wants to stop, and the ranks agree on it and on a host veto after the hook
        (``None``: the hook vetoes on the device only, ``Callback.device_veto_only``, and the
        ranks do not agree there). ``validates``: whether the fit validates at all (the per-epoch
        scheduler step reads it). ``accumulation``: the fit's own schedule (a
        ``GradientAccumulationScheduler``), or ``None``. ``items``: the module computes its own
        loss and takes ``num_items_in_batch`` (``True`` / ``False``: whether its labels shift;
        :func:`fitkit.losses.outputs.takes_num_items`), or ``None``.

        What the fit hands the stepper lives as long as the fit: its hooks, its epochs'
        ``host_rows`` (bound to this rank's shards of the training data: on CUDA, the data's
        device copy) and its :class:`Window` (the window's loss, a pending veto, the micro-batch's
        place) start afresh and are dropped on exit, also when the fit raises (inside a window:
        it would carry into the next fit); the accumulation in effect before is put back.
        """
        outer = self.fit, self.window, self.accumulation, self.accumulation_schedule
        self.fit, self.window = FitHooks(before_step, stop_training, validates), Window()
        self.fit.items = items
        parallel = self.parallel
        self.fit.check_unused = parallel is not None and not parallel.fsdp and not parallel.ddp_options.tolerates_unused
        if accumulation is not None:
            self.accumulation_schedule = accumulation
        try:
            yield
        finally:
            self.fit, self.window, self.accumulation, self.accumulation_schedule = outer

    @contextlib.contextmanager
    def step_of_its_own(self) -> Iterator[None]:
        """One ``train_on_batch`` step: a window of its own, also inside a ``fit``.

        A callback may call ``train_on_batch`` inside a fit's accumulation window: the fit's
        accumulated gradients, its window and its hooks are set aside meanwhile (the step runs
        no ``before_step``) and put back afterwards.
        """
        outer = self.fit, self.window
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        self.fit, self.window = FitHooks(), Window()
        try:
            yield
        finally:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            self.fit, self.window = outer

    def begin_epoch(self, epoch: int | None = None, host_rows: Callable[[int], int] | None = None) -> None:
        """A fit epoch starts: the LRs its last step used are recorded afresh, and an
        accumulation schedule sets this epoch's micro-batches per step.

        ``host_rows``: under torchrun, ``batch index -> rows of that global batch`` when the
        host knows them (fitkit's own shards), so a window's global size needs no all-reduce.
        """
        self.scheduling.keep_lrs_used(None)
        self.fit.host_rows = host_rows
        if self.accumulation_schedule is not None and epoch is not None:
            self.accumulation = self.accumulation_schedule(epoch)

    def no_sync(self, module: nn.Module) -> Any:
        """Non-final micro-batches of a window skip DDP's / FSDP's gradient all-reduce."""
        if self.parallel is None or self.window.micro_last:
            return NO_CONTEXT
        return self.parallel.no_sync(module)

    # -- backward and step -----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` scaled by the micro-batch's share of its window (and the scaler)."""
        window = self.window
        if window.micro_scale is not None:
            loss = loss * window.micro_scale
        if window.micro_last and self.parallel is not None:  # the reduction this backward starts carries it
            self.parallel.set_count(window.count)  # (None: the strategy's own mean, also after a counted fit)
        # Kept attached (a detach per step saved; step_loss detaches when read): after backward
        # the graph's buffers are freed, and the window drops the tensor at its step.
        window.loss = loss if window.loss is None else window.loss.detach() + loss.detach()
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, module: nn.Module) -> bool:
        """The optimizer step at the end of a window; returns whether the weights changed.

        A step the fp16 GradScaler skips (inf / NaN gradients) is no step: ``global_step``, the
        per-step scheduler and everything keyed on ``global_step`` (EMA, loggers, checkpoints)
        stay where they are. (A fused optimizer's step applies the skip on the device; the
        skip is counted there and subtracted when ``global_step`` is read.)

        The running fit's before-step hook (see :meth:`fitting`) runs after the gradients are
        unscaled and before clipping (the ``on_backward_end`` hook); it may call :meth:`skip`
        to veto this step. Under torchrun the veto and the fit's stop query are agreed over
        ranks here.
        """
        window = self.window  # the hook may run a train_on_batch: it puts this window back
        if not window.micro_last:
            return False
        opt = self.optimizer
        fit = self.fit
        if fit.check_unused:  # the fit's first step under DDP, before anything is applied
            fit.check_unused = False
            check_every_parameter_reached(module, opt)
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        before_step = fit.before_step
        if before_step is not None:
            before_step()
            if self.parallel is not None:
                self._agree_on_step(window, fit)
        window.loss = None
        veto = None if window.veto is None else self._take_veto()
        if window.skip_requested:  # a callback (e.g. TerminateOnNaN) vetoed this step
            return self._skip_step(window, opt)
        if self.clipping is not None:
            self._clip(module, self.clipping)
        if self.scaler is None and veto is None:
            opt.step()
            opt.zero_grad(set_to_none=True)
            self._stepped = True
            if not self.scheduling.per_step:  # nothing else counts steps: the common case inline (hot path)
                self._steps += 1
                return True
            return self._count_step(opt, None)
        skipped = self._optimizer_step(opt, veto)  # a device flag, or None: the host knows
        opt.zero_grad(set_to_none=True)
        return self._count_step(opt, skipped)

    def _agree_on_step(self, window: Window, fit: FitHooks) -> None:
        """Under torchrun, after the before-step hook: the ranks agree on its veto and on the stop query."""
        if fit.stop_training is not None:
            # A veto or a stop on one rank holds for all: the ranks step and stop together.
            agreed: Any = _distributed.any_rank(window.skip_requested, bool(fit.stop_training()))
            window.skip_requested, fit.stop_agreed = agreed
        elif window.skip_requested:
            _host_veto_unagreed()

    def _skip_step(self, window: Window, opt: torch.optim.Optimizer) -> bool:
        """A vetoed step: its gradients dropped, the GradScaler's scale updated; no step counted."""
        window.skip_requested = False
        opt.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.update()
        return False

    def _clip(self, module: nn.Module, clipping: Clipping) -> None:
        """``clip_grad_norm`` / ``clip_grad_value`` on the unscaled gradients, before the step."""
        if clipping.norm is not None:
            self.grad_norm = nn.utils.clip_grad_norm_(module.parameters(), clipping.norm)
        if clipping.value is not None:
            nn.utils.clip_grad_value_(module.parameters(), clipping.value)

    def _take_veto(self) -> torch.Tensor | None:
        """The device veto of the coming step (agreed over ranks), or ``None``."""
        window = self.window
        veto, window.veto = window.veto, None
        if veto is not None and self.parallel is not None:
            veto = _distributed.any_rank_on_device(veto)  # the ranks skip together (no host read)
        if veto is not None and not self.takes_found_inf and self.scaler is None:
            window.skip_requested |= bool(veto)  # this optimizer cannot skip on the device: one host read
            return None
        return veto

    def _count_step(self, opt: torch.optim.Optimizer, skipped: torch.Tensor | None) -> bool:
        """``global_step`` and a per-step scheduler after ``opt.step()``; whether it counted."""
        scheduling = self.scheduling
        per_step = scheduling.per_step
        if skipped is not None and per_step:
            # The scheduler must not advance on a skipped step and its LR is a host number:
            # the one host read per step of fp16 / a device veto with a per-step scheduler.
            self._stepped = not bool(skipped)
        elif skipped is not None:
            self._count_device_skip(skipped)
        if not self._stepped:
            return False  # the step was skipped (GradScaler or veto): nothing that counts steps moves
        self._steps += 1
        if per_step:  # timm's step_update counts optimizer steps: it gets global_step
            scheduling.step(self.global_step if scheduling.timm else None)
        return True

    def _optimizer_step(self, opt: torch.optim.Optimizer, veto: torch.Tensor | None) -> torch.Tensor | None:
        """``opt.step()``, through the GradScaler under fp16; ``veto`` skips it on the device.

        Returns the device flag of a step skipped on the device (``None`` when the host knows:
        ``self._stepped`` says then whether it ran).
        """
        self._stepped = True
        if self.scaler is not None:
            found = self.scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
            if veto is not None:  # the veto joins the scaler's verdict (the scale backs off too)
                for key, flag in found.items():
                    found[key] = torch.maximum(flag, veto.to(flag))
            skipped = sum(found.values()) if self.takes_found_inf else None
            self._stepped = self.takes_found_inf  # else the post-hook tells whether step() ran
            self.scaler.step(opt)
            self.scaler.update()
            return skipped
        if veto is None:
            opt.step()
            return None
        flag = veto.to(torch.float32).reshape(())
        opt.found_inf = flag  # type: ignore[attr-defined]  # torch's protocol, as GradScaler sets it
        try:
            opt.step()
        finally:
            del opt.found_inf  # type: ignore[attr-defined]
        return flag

    def skip(self, when: torch.Tensor | None = None) -> None:
        """Veto the coming optimizer step (its gradients are dropped); ``when``: only where
        that device bool is true, decided on the device (several calls are or-ed)."""
        window = self.window
        if when is None:
            window.skip_requested = True
        else:
            when = when.detach().reshape(()).to(torch.bool)
            window.veto = when if window.veto is None else window.veto | when

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self, record: bool = False) -> dict[str, Any]:
        """GradScaler state and the step count (the checkpoint's ``scaler`` and ``global_step``).

        ``record=True`` adds the per-step record (the last ``grad_norm``, the LRs used, the
        window's place, loss and host veto; not a device veto): an in-process snapshot, as the
        LR finder's.

        Example:
            >>> opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
            >>> a, b = Stepper(opt, None, "epoch", "32", torch.device("cpu")), Stepper(opt, None, "epoch", "32",
            ...     torch.device("cpu"))
            >>> a.global_step = 3; b.load_state_dict(a.state_dict()); b.global_step
            3
        """
        state: dict[str, Any] = {
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "global_step": self.global_step,
        }
        if record:
            window = self.window
            state["record"] = {
                "grad_norm": self.grad_norm,
                "lrs_used": self.scheduling.lrs_used,
                "micro_last": window.micro_last,
                "micro_scale": window.micro_scale,
                "window_loss": None if window.loss is None else window.loss.detach(),
                "skip_requested": window.skip_requested,
                "count": window.count,
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a saved GradScaler state loads only into a GradScaler)."""
        if state.get("scaler") is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.global_step = int(state["global_step"])
        record = state.get("record")
        if record is not None:
            window = self.window
            self.grad_norm = record["grad_norm"]
            self.scheduling.keep_lrs_used(record["lrs_used"])
            window.micro_last, window.micro_scale = record["micro_last"], record["micro_scale"]
            window.count = record.get("count")
            window.loss, window.skip_requested = record["window_loss"], record["skip_requested"]


def _host_veto_unagreed() -> None:
    raise RuntimeError(
        "A callback declaring `device_veto_only = True` vetoed an optimizer step on the host "
        "(model.skip_optimizer_step() without `when`) under torchrun, where the ranks do not agree "
        "on such a veto after on_backward_end, so they would step differently. Fix: pass the "
        "decision as a device tensor (skip_optimizer_step(when=flag)), or set device_veto_only = False."
    )
