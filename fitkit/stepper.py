"""The optimizer step: accumulation window, GradScaler, clipping, skips, scheduler, step count.

One :class:`Stepper` per compiled model. ``fit`` hands it the epoch's batches
(:meth:`Stepper.micro_batches` groups them into accumulation windows and weights each
micro-batch by its share of the window), ``train_step`` calls :meth:`Stepper.backward` and
:meth:`Stepper.step`. Gradient accumulation is sample-exact: each micro-batch's loss is scaled
by ``its samples / the window's samples`` (sample weights, if any), so a step equals one step on
the whole window, a short last window included. Nothing here reads a device value on the host.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fitkit import distributed as _distributed
from fitkit import nest
from fitkit.devices import NO_CONTEXT

__all__ = ["Stepper", "is_timm_scheduler"]


def is_timm_scheduler(scheduler: Any) -> bool:
    """Whether ``scheduler`` follows timm's protocol (``step(epoch, metric)``, ``step_update``).

    A class is not a scheduler but a factory (``scheduler=CosineLRScheduler`` would be called on
    the optimizer), though its functions answer to the same names.

    Example:
        >>> class Cosine:
        ...     def step(self, epoch, metric=None): ...
        ...     def step_update(self, num_updates, metric=None): ...
        >>> is_timm_scheduler(Cosine()), is_timm_scheduler(Cosine), is_timm_scheduler(object())
        (True, False, False)
    """
    return (
        not isinstance(scheduler, type)
        and callable(getattr(scheduler, "step_update", None))
        and callable(getattr(scheduler, "step", None))
    )


def _batch_weight(batch: tuple[Any, Any, Any]) -> Any:
    x, y, w = batch
    return w.sum() if w is not None else nest.rows(y if y is not None else x)


class Stepper:
    """Owns everything between ``loss`` and the next weights.

    Args:
        optimizer: the compiled optimizer.
        scheduler: a torch LR scheduler, a timm scheduler, or ``None``.
        scheduler_interval: ``"epoch"`` or ``"step"`` (torch schedulers; timm ones get both).
        precision: ``"16-mixed"`` adds a ``GradScaler``.
        device: the model's device.
        accumulation: micro-batches per optimizer step.
        clip_grad_norm: max global 2-norm of the gradients, or ``None``.
        clip_grad_value: max absolute gradient element, or ``None``.
        parallel: the model's :class:`fitkit.distributed.Parallel` under torchrun, else ``None``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scheduler_interval: str,
        precision: str,
        device: torch.device,
        accumulation: int = 1,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        parallel: Any = None,
    ):
        self.optimizer, self.scheduler, self.interval = optimizer, scheduler, scheduler_interval
        self.precision = precision
        self.scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
        self.accumulation = accumulation
        self.clip_grad_norm, self.clip_grad_value = clip_grad_norm, clip_grad_value
        self.parallel = parallel
        self.global_step = 0
        self.micro_last, self.micro_scale = True, None  # the current micro-batch's place in its window
        self.skip_requested = False
        self.window_loss: torch.Tensor | None = None  # the window's loss so far (detached)
        self.grad_norm: torch.Tensor | None = None
        self.lrs_used: list[Any] | None = None  # the LRs of the last step, before a scheduler moved them
        self.stop_agreed = False
        self.host_rows: Any = None  # under torchrun: batch index -> rows of that global batch, if known
        self.validates = False  # whether the running fit validates at all (see fitting())
        # The running fit's on_backward_end and stop query (see fitting(); None outside a fit).
        self._before_step: Any = None
        self._stop_training: Any = None
        self.timm = is_timm_scheduler(scheduler)
        self._stepped = True
        # GradScaler skips optimizer.step() on inf/NaN gradients; a post-hook tells us whether
        # it ran, so a skipped step does not advance the scheduler (no extra host sync).
        self._hook = optimizer.register_step_post_hook(self._mark_stepped)

    def set_scheduler(self, scheduler: Any) -> None:
        """Replace the scheduler (``None``: the LR moves only by callbacks)."""
        self.scheduler, self.timm = scheduler, is_timm_scheduler(scheduler)

    def _mark_stepped(self, *_: Any) -> None:
        self._stepped = True

    def close(self) -> None:
        """Remove the optimizer hook (a recompiled model builds a new stepper)."""
        self._hook.remove()

    # -- the accumulation window ---------------------------------------------------------------
    def micro_batches(self, batches: Iterator[Any], start: int, stop: Any) -> Iterator[tuple[int, Any]]:
        """Yield ``(batch_index, batch)`` from ``start``, setting each micro-batch's window place.

        ``stop()`` is asked after each batch of a window; a stop ends the epoch there.
        """
        k = self.accumulation
        if k == 1 and self.parallel is None:
            self.micro_last, self.micro_scale = True, None
            yield from enumerate(batches, start)
            return
        step = start
        while True:
            group = list(itertools.islice(batches, k))
            if not group:
                return
            sizes = [_batch_weight(b) for b in group]
            # Under torchrun: (global weight of the window) / W, all-reduced on the device, so
            # each rank's share makes DDP's gradient average the exact global mean.
            if self.parallel is None:
                total = sum(sizes)
            else:  # no collective when every rank's rows are known on the host
                total = _distributed.global_share(sizes, _distributed.known_rows(self.host_rows, sizes, step))
            for i, batch in enumerate(group):
                self.micro_scale = sizes[i] / total
                self.micro_last = i == len(group) - 1
                yield step, batch
                step += 1
                if stop():
                    return

    def single_batch(self) -> None:
        """A batch outside ``fit`` (``train_on_batch``) is a window of its own."""
        self.micro_last, self.micro_scale = True, None

    @contextlib.contextmanager
    def fitting(self, before_step: Any, stop_training: Any, validates: bool) -> Iterator[None]:
        """Entered once per ``fit``: the fit's hook and stop query for each of its steps.

        ``before_step()`` (``on_backward_end``, or ``None`` when no callback listens) runs
        before each optimizer step of the fit; under torchrun ``stop_training()`` tells whether
        this rank wants to stop. ``validates``: whether the fit validates at all (the per-epoch
        scheduler step reads it). All three are put back on exit.
        """
        outer = self._before_step, self._stop_training, self.validates
        self._before_step, self._stop_training, self.validates = before_step, stop_training, validates
        try:
            yield
        finally:
            self._before_step, self._stop_training, self.validates = outer

    @contextlib.contextmanager
    def step_of_its_own(self) -> Iterator[None]:
        """One ``train_on_batch`` step: a window of its own, also inside a ``fit``.

        A callback may call ``train_on_batch`` inside a fit's accumulation window: the fit's
        accumulated gradients, its window and its before-step hook are set aside meanwhile and
        put back afterwards.
        """
        window = (self.micro_last, self.micro_scale, self.window_loss, self.skip_requested, self._before_step)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        self.single_batch()
        self.window_loss, self.skip_requested, self._before_step = None, False, None
        try:
            yield
        finally:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            self.micro_last, self.micro_scale, self.window_loss, self.skip_requested, self._before_step = window

    def begin_epoch(self, host_rows: Any = None) -> None:
        """A fit epoch starts: the LRs its last step used are recorded afresh.

        ``host_rows``: under torchrun, ``batch index -> rows of that global batch`` when the
        host knows them (fitkit's own shards), so a window's global size needs no all-reduce.
        """
        self.lrs_used = None
        self.host_rows = host_rows

    def no_sync(self, module: nn.Module):
        """Non-final micro-batches of a window skip DDP's / FSDP's gradient all-reduce."""
        if self.parallel is None or self.micro_last:
            return NO_CONTEXT
        return self.parallel.no_sync(module)

    # -- backward and step -----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` scaled by the micro-batch's share of its window (and the scaler)."""
        if self.micro_scale is not None:
            loss = loss * self.micro_scale
        part = loss.detach()
        self.window_loss = part if self.window_loss is None else self.window_loss + part
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, module: nn.Module) -> bool:
        """The optimizer step at the end of a window; returns whether the weights changed.

        The running fit's before-step hook (see :meth:`fitting`) runs after the gradients are
        unscaled and before clipping (the ``on_backward_end`` hook); it may call :meth:`skip`
        to veto this step. Under torchrun the veto and the fit's stop query are agreed over
        ranks here.
        """
        if not self.micro_last:
            return False
        opt = self.optimizer
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        before_step, stop_training = self._before_step, self._stop_training
        if before_step is not None:
            before_step()
            if self.parallel is not None:
                # A veto or a stop on one rank holds for all: the ranks step and stop together.
                wants_stop = bool(stop_training()) if stop_training is not None else False
                agreed: Any = _distributed.any_rank(self.skip_requested, wants_stop)
                self.skip_requested, self.stop_agreed = agreed
        self.window_loss = None
        if self.skip_requested:  # a callback (e.g. TerminateOnNaN) vetoed this step
            self.skip_requested = False
            opt.zero_grad(set_to_none=True)
            if self.scaler is not None:
                self.scaler.update()
            return False
        if self.clip_grad_norm is not None:
            self.grad_norm = nn.utils.clip_grad_norm_(module.parameters(), self.clip_grad_norm)
        if self.clip_grad_value is not None:
            nn.utils.clip_grad_value_(module.parameters(), self.clip_grad_value)
        if self.scaler is not None:
            self._stepped = False
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        self.global_step += 1
        if self.scheduler is not None and self._stepped and (self.timm or self.interval == "step"):
            self.lrs_used = [g["lr"] for g in opt.param_groups]
            if self.timm:
                self.scheduler.step_update(num_updates=self.global_step)
            elif self.interval == "step":
                self.scheduler.step()
        return True

    def skip(self) -> None:
        """Veto the coming optimizer step (its gradients are dropped)."""
        self.skip_requested = True

    def step_epoch(self, epoch: int, logs: dict[str, float], validated: bool) -> None:
        """The per-epoch scheduler step, after validation.

        ``ReduceLROnPlateau`` steps on ``val_loss`` on epochs that validated, on ``loss`` when
        fit has no validation at all, and not at all on epochs whose validation was not
        scheduled. timm schedulers get ``step(epoch + 1, metric)``, as timm's training script,
        with the same metric (``None`` on epochs without validation, and a timm plateau
        scheduler is then not stepped).
        """
        sched = self.scheduler
        if sched is None:
            return
        metric = logs.get("val_loss") if validated else None if self.validates else logs.get("loss")
        if self.timm:
            plateau = isinstance(getattr(sched, "lr_scheduler", None), torch.optim.lr_scheduler.ReduceLROnPlateau)
            if metric is not None or not plateau:
                sched.step(epoch + 1, metric)
            return
        if self.interval != "epoch":
            return
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            if metric is not None:
                sched.step(metric)
        else:
            sched.step()

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self, record: bool = False) -> dict[str, Any]:
        """GradScaler state and the step count (the checkpoint's ``scaler`` and ``global_step``).

        ``record=True`` adds the per-step record (the last ``grad_norm``, the LRs used, the
        window's place and loss, a pending veto): an in-process snapshot, as the LR finder's.

        Example:
            >>> opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
            >>> a, b = Stepper(opt, None, "epoch", "32", torch.device("cpu")), Stepper(opt, None, "epoch", "32",
            ...     torch.device("cpu"))
            >>> a.global_step = 3; b.load_state_dict(a.state_dict()); b.global_step
            3
        """
        state: dict[str, Any] = {"scaler": None if self.scaler is None else self.scaler.state_dict(),
                                 "global_step": self.global_step}  # fmt: skip
        if record:
            state["record"] = {k: getattr(self, k) for k in _RECORD}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a saved GradScaler state loads only into a GradScaler)."""
        if state.get("scaler") is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.global_step = int(state["global_step"])
        for k, v in state.get("record", {}).items():
            setattr(self, k, v)


# The per-step record that a step overwrites (``state_dict(record=True)``).
_RECORD = ("grad_norm", "lrs_used", "micro_last", "micro_scale", "window_loss", "skip_requested")
