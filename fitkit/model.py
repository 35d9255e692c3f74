"""The ``Model``: compile, fit, evaluate, predict around any ``nn.Module``.

The model is a facade. It holds what outlives a call (the module, the compiled loss, the
metric template and phase stack, the :class:`~fitkit.training.stepper.Stepper`, the history, a pending
resume point) and hands each call to an object that owns that call's state; once a call
returns or raises, nothing of it stays reachable from the model. The data flow of ``fit``, in
the order a batch meets it::

    Model.fit                     the verb (model.py)
    -> planning.plan_fit          checks every argument, builds the loaders (planning.py)
    -> distributed.sharded        as_loader, then each rank's share (data/, distributed/)
    -> preflight.in_memory_check  in-memory data and its first batch (preflight.py)
    -> FitLoop.run / run_epoch    epochs, Position, resume, totals (loop.py, position.py)
    -> DeviceLoader.epoch_batches the only place a batch changes device (data/loaders.py)
    -> Stepper.micro_batches      the accumulation window (stepper.py)
    -> Model.train_step           forward, compute_loss, backward, update_metrics,
                                  optimizer_step -> Stepper.step (model.py, stepper.py)
    -> CallbackList.on_train_batch_end -> EvalLoop.run (validation, eval_loop.py) -> on_epoch_end -> History
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fitkit import data as _data
from fitkit import distributed as _distributed
from fitkit import nest
from fitkit.callbacks.base import Callback, History
from fitkit.callbacks.swap_ema import compiled_ema, with_compiled_ema
from fitkit.checks import check_bool, check_int, check_number, known_keywords
from fitkit.checks.declared import declared
from fitkit.checks.preflight import cast_to_module
from fitkit.compile import Forward, resolve_jit_compile
from fitkit.devices import NO_CONTEXT, PRECISIONS, autocast, optimizer_to, resolve_device
from fitkit.distributed import meta as _meta
from fitkit.files.differences import check_state_dict_fits
from fitkit.losses import MultiLoss, resolve_loss
from fitkit.losses.denominators import denominator, objective, targets_count
from fitkit.losses.labels import LABELS, resolve_label_names
from fitkit.losses.outputs import module_inputs, own_loss, prediction_of, require_prediction, targets_of
from fitkit.metrics import MetricSet
from fitkit.tools.summary import summary_table
from fitkit.training import checkpoint as _checkpoint
from fitkit.training import options as _options
from fitkit.training import planning
from fitkit.training.accumulation import AccumulationSchedule
from fitkit.training.loop import EvalLoop, FitLoop, PredictLoop
from fitkit.training.modes import modes
from fitkit.training.optim import check_plateau_mode, resolve_optimizer, resolve_scheduler
from fitkit.training.quick import check_quick, sanity_check
from fitkit.training.recompute import check_recompute, checkpoint_activations
from fitkit.training.state import ResumePoint
from fitkit.training.stepper import Stepper
from fitkit.training.tracking import Phases
from fitkit.training.validation_sets import named_sets, run_validation

__all__ = ["Model"]


class Model:
    """Keras-style training for any ``nn.Module``.

    Args:
        module: the network. Moved to ``device`` at once.
        device: ``"auto"`` (``FITKIT_DEVICE`` env, else cuda, else mps, else cpu), a device
            string or a ``torch.device``. Under torchrun a bare cuda is ``cuda:LOCAL_RANK``.
        strategy: under torchrun (``WORLD_SIZE`` > 1): ``"auto"`` or ``"ddp"`` wraps the
            module in DDP at ``compile()``, ``"fsdp"`` shards it with FSDP2 ``fully_shard``;
            the process group starts here if needed (see :mod:`fitkit.distributed`).
            ``fitkit.distributed.FSDP(wrap=..., mixed_precision=..., ...)`` is ``"fsdp"`` with
            options (the units, mixed precision, activation checkpointing, CPU offload). On one
            process every strategy trains plainly, so the same script runs both ways.
        timeout: under torchrun, seconds a collective may wait for the other ranks before the
            job ends with an error (a rank that hangs or died without its process ending);
            ``None``: the ``FITKIT_DIST_TIMEOUT`` environment variable, else torch's default
            (10 min for nccl, 30 min for gloo). Used when fitkit starts the process group; refused
            (``ValueError``) when a group started elsewhere is running (Ray Train's
            ``TorchTrainer``: set ``TorchConfig(timeout_s=...)`` there).
        activation_checkpointing: recompute the activations of these submodules in the
            backward instead of keeping them (:func:`torch.utils.checkpoint.checkpoint`,
            non-reentrant), on one process or under DDP: ``True`` (the default units of
            ``FSDP``: transformer blocks), a module class, a class name, a list of them, or a
            function ``module -> bool``, the spec of ``FSDP(wrap=...)``. Gradients equal the
            plain run's bit for bit; each unit's forward runs once more per step (Lightning /
            Transformers' ``gradient_checkpointing``). With FSDP use
            ``FSDP(activation_checkpointing=True)``. See :mod:`fitkit.training.recompute`.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``strategy`` not a string or ``FSDP``, ``timeout``
            not a number.
        ValueError: an unknown ``strategy``; a ``timeout`` that is not positive, or given while a
            process group that fitkit did not start is running; an
            ``activation_checkpointing`` that picks no submodule, or one with an FSDP strategy.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> x = torch.linspace(-1, 1, 64).unsqueeze(1)
        >>> y = 3 * x + 2
        >>> model = Model(nn.Linear(1, 1), device="cpu")
        >>> model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss="mse")
        >>> history = model.fit(x, y, epochs=20, batch_size=16, verbose=0)
        >>> [round(v, 2) for v in (model.module.weight.item(), model.module.bias.item())]
        [3.0, 2.0]
    """

    @declared(_options.MODEL)
    def __init__(self, module: nn.Module, *, device: str | torch.device = "auto",
                 strategy: str | _distributed.FSDP = "auto", timeout: float | None = None,
                 activation_checkpointing: Any = False):  # fmt: skip
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"Expected `module` to be a torch.nn.Module. Received: {type(module).__name__}. "
                "Fix: wrap your network, e.g. fitkit.Model(nn.Sequential(...))."
            )
        _distributed.check_strategy(strategy)
        if isinstance(strategy, _distributed.FSDP):
            strategy.check_names(module)  # a typo in wrap= would wrap nothing, on any number of processes
        given, timeout = timeout, _distributed.check_timeout(timeout)
        _distributed.check_timeout_applies(given)  # a group started elsewhere (Ray Train) keeps its own
        self.device = resolve_device(device)
        _distributed.init_if_needed(self.device, timeout)  # under torchrun: nccl on CUDA, gloo on CPU
        if activation_checkpointing is not None and activation_checkpointing is not False:
            check_recompute(activation_checkpointing, strategy)
            checkpoint_activations(module, activation_checkpointing)
        self.strategy = strategy
        self._parallel = _distributed.Parallel(strategy, self.device) if _distributed.is_distributed() else None
        if not _meta.on_meta(module):
            self.module = module.to(self.device)
        elif self._parallel is not None and self._parallel.fsdp:
            self.module = module  # compile shards it, then allocates only this rank's shards
        else:
            self.module = module
            _meta.materialize(module, self.device)  # one process or DDP: the whole module here
        # What compile sets (public, read by callbacks and loggers; the optimizer, the scheduler
        # and the step options are the stepper's, the metric template the phase stack's: see the
        # properties below).
        self.loss: Any = None
        self.compiled_ema: Any = None  # compile(use_ema=True)'s EMA callback, first in every fit
        self.label_names: tuple[str, ...] = LABELS  # a dict batch's target keys (compile(label_names=))
        # Flags a callback sets; the running loop reads them.
        self.stop_training = False
        self.stop_evaluating = False
        self.stop_predicting = False
        self.history: History | None = None
        self._stepper: Stepper | None = None
        self._forward = Forward(self.module)
        self._fit: FitLoop | None = None  # the running fit only (None once it returned or raised)
        self._phases = Phases(self.device, _distributed.reduce_loss_totals if self._parallel is not None else None)
        self._resume: ResumePoint | None = None  # loaded, waiting for the next fit
        self._example_x: Any = None  # the last first batch checked (summary's output shapes)
        # What the model keeps of the last fit: plain values (model.epoch, model.validated, and
        # where a checkpoint taken now continues).
        self._fit_ended: dict[str, Any] | None = None
        self._last_epoch, self._last_validated = 0, False

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The compiled optimizer (``None`` before ``compile``)."""
        return None if self._stepper is None else self._stepper.optimizer

    @property
    def scheduler(self) -> Any:
        """The compiled LR scheduler, or ``None``; assign ``None`` to stop it stepping."""
        return None if self._stepper is None else self._stepper.scheduling.scheduler

    @scheduler.setter
    def scheduler(self, value: Any) -> None:
        self._require_compiled("scheduler").scheduling.set_scheduler(value)

    @property
    def metrics(self) -> MetricSet:
        """The compiled metrics: the template each phase (epoch, validation, evaluate) copies."""
        return self._phases.template

    # The step options compile set, stored once, in the stepper (read-only here).
    @property
    def precision(self) -> str:
        """The compiled precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``."""
        return "32" if self._stepper is None else self._stepper.precision

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (1 before ``compile``)."""
        return 1 if self._stepper is None else self._stepper.accumulation

    @property
    def clip_grad_norm(self) -> float | None:
        """The compiled max global gradient 2-norm, or ``None``."""
        return None if self._stepper is None else self._stepper.clip_grad_norm

    @property
    def clip_grad_value(self) -> float | None:
        """The compiled max absolute gradient element, or ``None``."""
        return None if self._stepper is None else self._stepper.clip_grad_value

    @property
    def scheduler_interval(self) -> str:
        """When a torch scheduler steps: ``"epoch"`` or ``"step"``."""
        return "epoch" if self._stepper is None else self._stepper.scheduling.interval

    # -- the public vocabulary of callbacks and overrides ------------------------------------
    @property
    def global_step(self) -> int:
        """Optimizer steps taken (read-only; a vetoed or skipped step does not count)."""
        return 0 if self._stepper is None else self._stepper.global_step

    @property
    def epoch(self) -> int:
        """The running epoch of ``fit`` (0-based; after fit, the last one run; read-only)."""
        return self._last_epoch if self._fit is None else self._fit.epoch

    @property
    def validated(self) -> bool:
        """Whether the running epoch's validation ran, over N > 0 samples (read-only).

        ``False`` from ``on_epoch_begin`` until the validation has run, and all epoch long on
        epochs that ``validation_freq`` leaves out; ``True`` in ``on_epoch_end`` after a
        validation. ``params["do_validation"]`` says whether fit validates at all. Monitoring
        callbacks read the two to skip a ``val_`` monitor on epochs without validation.

        Example:
            >>> model = Model(nn.Linear(1, 1), device="cpu")
            >>> model.compile(optimizer="sgd", loss="mse")
            >>> seen = []
            >>> from fitkit.callbacks import LambdaCallback
            >>> watch = LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(model.validated))
            >>> x = torch.zeros(4, 1)
            >>> _ = model.fit(x, x, epochs=4, validation_data=(x, x), validation_freq=2,
            ...               callbacks=[watch], verbose=0)
            >>> seen
            [False, True, False, True]
        """
        loop = self._fit
        return self._last_validated if loop is None else bool(loop.validated)

    @property
    def closes_accumulation_window(self) -> bool:
        """Whether the current micro-batch is the last of its accumulation window (it steps).

        Always ``True`` without gradient accumulation. Callbacks that write full checkpoints
        wait for it: inside a window the accumulated gradients are in no file.
        """
        return True if self._stepper is None else self._stepper.window.micro_last

    @property
    def step_loss(self) -> torch.Tensor | None:
        """The loss of the coming optimizer step, detached, on the device (in ``on_backward_end``).

        With gradient accumulation it is the whole window's loss (each micro-batch weighted by
        its share), so a NaN in any micro-batch shows. Reading its value syncs with the device.
        """
        loss = None if self._stepper is None else self._stepper.window.loss
        return None if loss is None else loss.detach()

    @property
    def callbacks(self) -> list[Callback]:
        """The callbacks of the running ``fit``, in call order (History and the bar last).

        Empty outside ``fit``. A callback may look for another one here (``MLflowLogger``
        finds the ``ModelCheckpoint`` whose best file it logs).
        """
        loop = self._fit
        return list(loop.callbacks.callbacks) if loop is not None and loop.running else []

    @property
    def train_batch(self) -> Any:
        """The batch ``(x, y, sample_weight)`` of the running training step, on the device.

        ``None`` outside ``fit``; read it in the batch hooks (``ThroughputMonitor`` counts its rows).
        """
        loop = self.running_fit()
        return None if loop is None else loop.batch

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The global gradient 2-norm of the last step, before clipping (``clip_grad_norm`` only)."""
        return None if self._stepper is None else self._stepper.grad_norm

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The ``GradScaler`` of ``precision="16-mixed"`` (``None`` otherwise; read-only)."""
        return None if self._stepper is None else self._stepper.scaler

    def skip_optimizer_step(self, when: torch.Tensor | None = None) -> None:
        """Veto the coming optimizer step (call it from ``on_backward_end``).

        The accumulated gradients are dropped, the weights, optimizer state, scheduler and
        ``global_step`` stay as they are (``TerminateOnNaN`` uses it).

        Args:
            when: a 0-dim bool tensor on the device: skip only where it is true, decided on the
                device with no host read, for optimizers whose step takes ``found_inf``
                (torch's ``fused=True`` Adam / AdamW / SGD / Adagrad, as fitkit builds them by
                name) or under ``precision="16-mixed"``; other optimizers read it on the host.
                A per-step scheduler reads it too (it must know whether to advance).
        """
        if self._stepper is not None:
            self._stepper.skip(when)

    # -- the module ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module: the training forward (DDP / compiled) once compiled, else the module."""
        return self._forward.run(*args, **kwargs)

    def to(self, device: str | torch.device) -> Model:
        """Move the module, the optimizer state and the metric state to ``device``.

        Args:
            device: ``"auto"``, a device string such as ``"cpu"`` or ``"cuda:1"``, or a
                ``torch.device`` (as for :class:`Model`).

        Returns:
            The model itself, with ``model.device`` set to the resolved device.

        Raises:
            TypeError: ``device`` is neither a string nor a ``torch.device``.
            ValueError: not a device name, or a device this machine lacks.

        Example:
            >>> model = Model(nn.Linear(2, 1), device="cpu")
            >>> model.to("cpu") is model, model.device
            (True, device(type='cpu'))
        """
        self.device = resolve_device(device)
        self.module.to(self.device)
        if self.optimizer is not None:
            optimizer_to(self.optimizer, self.device)
        self._phases.to(self.device)
        self._forward = Forward(self.module, self._wrap_for_training(), self._forward.jit)
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict (never with ``_orig_mod.`` or ``module.`` prefixes).

        With ``strategy="fsdp"`` under torchrun it is the full, unsharded state: a collective
        that every rank calls; rank 0 gets the tensors on the CPU, other ranks an empty dict.

        Returns:
            ``{name: tensor}``, as ``nn.Module.state_dict`` returns it. Without FSDP the tensors
            share storage with the module's: clone them to keep a snapshot.

        Example:
            >>> sorted(Model(nn.Linear(2, 1), device="cpu").state_dict())
            ['bias', 'weight']
        """
        if self._parallel is not None:
            return self._parallel.state_dict(self.module)
        return self.module.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True):
        """Load a module state dict (as ``nn.Module.load_state_dict``; a full one under FSDP).

        Args:
            state_dict: ``{name: tensor}``, e.g. from :meth:`state_dict`, without ``module.``
                or ``_orig_mod.`` prefixes; tensors are copied onto the module's device.
            strict: require the keys to match the module's exactly.

        Returns:
            ``nn.Module.load_state_dict``'s named tuple of ``missing_keys`` and
            ``unexpected_keys``.

        Raises:
            RuntimeError: keys that do not match (with ``strict=True``), or tensors of another
                shape or dtype; every difference is listed and nothing is loaded (with
                ``strict=False`` the keys both hold must still fit).

        Example:
            >>> a, b = Model(nn.Linear(2, 1), device="cpu"), Model(nn.Linear(2, 1), device="cpu")
            >>> b.load_state_dict(a.state_dict())
            <All keys matched successfully>
        """
        if self._parallel is not None:
            return self._parallel.load_state_dict(self.module, state_dict, strict=strict)
        check_state_dict_fits(self.module, state_dict, strict)  # all or nothing, as load_weights
        return self.module.load_state_dict(state_dict, strict=strict)

    def refresh_parallel(self) -> None:
        """Under DDP: a new training wrapper when the trainable parameters changed since the
        last was built (:mod:`fitkit.distributed.ddp`); the fit loop calls it before each
        optimizer step's first micro-batch. Nothing on one process or under FSDP."""
        if self._parallel is not None and not self._parallel.fsdp and self.optimizer is not None:
            self._forward.refresh()

    def _wrap_for_training(self) -> Any:
        # Under torchrun the training forward is DDP's (built once the optimizer exists).
        if self._parallel is None or self.optimizer is None:
            return None
        return self._parallel.wrap

    # -- compile ---------------------------------------------------------------------------
    @known_keywords
    @declared(_options.COMPILE)
    def compile(
        self,
        optimizer: Any = "adam",
        loss: Any = None,
        metrics: Any = None,
        *,
        loss_weights: Any = None,
        scheduler: Any = None,
        scheduler_interval: str = "epoch",
        precision: str = "32",
        gradient_accumulation_steps: int | dict[int, int] = 1,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        jit_compile: bool | str | dict = "auto",
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        label_names: str | Sequence[str] | None = None,
    ) -> None:
        """Set the optimizer, loss, metrics and step options. Checks everything first.

        Args:
            optimizer: a name (``"adam"``, ``"adamw"``, ``"sgd"``, ...; torch's defaults), an
                ``Optimizer`` on ``model.module.parameters()``, or a factory ``params -> Optimizer``
                (timm's ``create_optimizer_v2`` result works as an ``Optimizer``).
            loss: a name (``"mse"``, ``"cross_entropy"``, ...), an ``nn.Module`` or a callable,
                called as ``loss(y_pred, y_true)``; ``None`` when the module returns its own
                loss (a ``ModelOutput`` or dict with ``"loss"``, as Hugging Face models do).
                Metrics and ``predict`` take a structured output's ``"logits"`` (the rule of
                :mod:`fitkit.losses.outputs`), and metric targets come from ``y`` or ``x["labels"]``.
            metrics: names, ``torchmetrics.Metric`` objects, callables ``fn(y_pred, y_true)``,
                :class:`fitkit.metrics.MetricSpec` objects, or ``{log_name: metric}``.
            loss_weights: a number that multiplies a single loss, or, for a module with several
                outputs and as many losses, one weight per loss (``loss`` is then a list or dict
                like the outputs).
            scheduler: a ``torch.optim.lr_scheduler`` object, a timm scheduler, or a factory
                ``optimizer -> scheduler``. A factory with a ``total_steps`` (or
                ``num_training_steps``) parameter is built at the start of the first ``fit``
                with the optimizer steps that fit plans (``max_steps``, else ``epochs`` times the
                steps per epoch; see :mod:`fitkit.training.budget`). A timm scheduler gets ``step_update(num_updates)``
                after each optimizer step and ``step(epoch + 1, metric)`` after each epoch
                (``metric``: ``val_loss``, else ``loss``), as timm's ``train.py`` calls them.
            scheduler_interval: ``"epoch"`` or ``"step"`` (per optimizer step).
            precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"`` (with a GradScaler).
            gradient_accumulation_steps: micro-batches per optimizer step (sample-exact), or a
                dict ``{first_epoch: micro-batches}`` that changes it at epoch starts
                (``{0: 8, 4: 4, 8: 1}``; epochs before the first key: 1), as Lightning's
                ``GradientAccumulationScheduler`` (see :mod:`fitkit.training.accumulation`).
            clip_grad_norm: clip the global gradient 2-norm to this value before each step.
            clip_grad_value: clip each gradient element to ``[-v, v]`` before each step.
            jit_compile: ``"auto"`` (torch.compile on CUDA only), True, False, or a dict of
                ``torch.compile`` kwargs.
            use_ema: keep an EMA of the weights (Keras' optimizer ``use_ema``): every ``fit``
                runs :func:`fitkit.callbacks.swap_ema.compiled_ema`'s callback first; the EMA
                replaces the weights when ``fit`` ends (validate on it with ``SwapEMAWeights``),
                so ``fit`` refuses another averaging callback that swaps in at the end.
            ema_momentum: ``new_average = ema_momentum * average + (1 - ema_momentum) * weights``.
            ema_overwrite_frequency: copy the EMA into the weights every that many optimizer steps.
            label_names: the keys of a dict batch that are the targets of a compiled loss and the
                metrics (taken out of the batch before ``forward``; several give a tuple ``y_true``),
                as the Transformers Trainer's ``label_names``. ``None``: ``"labels"``, or for a
                Transformers model the Trainer's default (``start_positions`` / ``end_positions``
                for question answering); see :mod:`fitkit.losses.labels`. Keys given here that a
                dict batch does not hold are refused before step 1 (they would be ignored).

        Raises:
            ValueError: unknown names (the message lists valid ones), bad values.
            TypeError: wrong types.
        """
        if precision not in PRECISIONS:
            raise ValueError(
                f"Unknown precision {precision!r}. Valid values: {', '.join(PRECISIONS)}. "
                "Fix: pass one of them, e.g. precision='bf16-mixed'."
            )
        if precision == "16-mixed" and self.device.type not in ("cuda", "cpu", "mps"):
            raise ValueError(
                f"precision='16-mixed' is not supported on {self.device.type}. Fix: use 'bf16-mixed' or '32'."
            )
        accumulation = None
        if isinstance(gradient_accumulation_steps, dict):
            accumulation = AccumulationSchedule(gradient_accumulation_steps, name="gradient_accumulation_steps")
        else:
            check_int("gradient_accumulation_steps", gradient_accumulation_steps, 1,
                      fix="pass an int >= 1, or a dict {first_epoch: micro-batches} such as {0: 8, 4: 4}.")
        check_number("clip_grad_norm", clip_grad_norm, positive=True, allow_none=True)
        check_number("clip_grad_value", clip_grad_value, positive=True, allow_none=True)
        jit = resolve_jit_compile(jit_compile, self.device)
        loss_fn = resolve_loss(loss, loss_weights)
        metric_set = MetricSet(metrics)
        ema = compiled_ema(use_ema, ema_momentum, ema_overwrite_frequency)
        labels = resolve_label_names(label_names, self.module)
        # Everything that can be checked is checked: only now does anything change.
        if self._parallel is not None:
            self._parallel.prepare(self.module, optimizer)  # FSDP shards before the optimizer exists
        opt = resolve_optimizer(optimizer, self.module, self.device)
        sched = resolve_scheduler(scheduler, opt, scheduler_interval)
        check_plateau_mode(sched)
        self.loss, self.compiled_ema, self.label_names = loss_fn, ema, labels
        self._phases.configure(metric_set.configure(loss_fn, self.device))
        if self._stepper is not None:
            self._stepper.close()
        self._stepper = Stepper(
            opt, sched, scheduler_interval, precision, self.device,
            accumulation if accumulation is not None else int(gradient_accumulation_steps),  # type: ignore[arg-type]
            clip_grad_norm, clip_grad_value, self._parallel, weigh=self._batch_denominator,
            sums=getattr(loss_fn, "reduction", "mean") == "sum",
        )  # fmt: skip
        self._forward = Forward(self.module, self._wrap_for_training(), jit)

    def _require_compiled(self, verb: str) -> Stepper:
        if self._stepper is None:
            raise RuntimeError(
                f"`{verb}` needs a compiled model. Call `model.compile(optimizer=..., loss=...)` "
                f"before `model.{verb}(...)`."
            )
        return self._stepper

    # -- fit -------------------------------------------------------------------------------
    @known_keywords
    @declared(_options.FIT)
    def fit(
        self,
        x: Any = None,
        y: Any = None,
        *,
        batch_size: int | None = None,
        epochs: int | float | None = None,
        verbose: int | str = "auto",
        callbacks: list[Callback] | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool = True,
        class_weight: Mapping[int, float] | None = None,
        sample_weight: Any = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int | list[int] = 1,
        max_steps: int | None = None,
        validation_interval: int | float | datetime.timedelta | None = None,
        validate_at_end: bool = False,
        min_epochs: int | None = None,
        min_steps: int | None = None,
        max_time: Any = None,
        # quick runs (Lightning's names; fitkit.training.quick)
        fast_dev_run: bool | int = False,
        overfit_batches: int | float = 0,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        num_sanity_val_steps: int = 0,
    ) -> History:
        """Train for ``range(initial_epoch, epochs)`` and return the :class:`~fitkit.History`.

        ``epochs`` is the index of the last epoch (Keras): ``fit(..., initial_epoch=2,
        epochs=5)`` runs 3 epochs. Submodules the user left in train mode train in train mode,
        frozen (``.eval()``) ones stay frozen; validation runs in eval mode under ``no_grad``;
        every flag and the grad mode are restored afterwards. Epoch loss and metrics are exact
        per-sample means (the loss weighted by ``sample_weight``: ``sum(w * l) / sum(w)``).

        Args:
            x: inputs ``(N, ...)`` as a tensor or numpy array; a tuple (``module(*x)``) or dict
                (``module(**x)``) of them; or a ``Dataset``, a ``DataLoader`` or any iterable of
                batches ``x``, ``(x, y)`` or ``(x, y, sample_weight)``. Floating in-memory ``x``
                and ``y`` are cast to the module's parameter dtype (float64 NumPy arrays become
                float32, as Keras casts to ``floatx``); other sources' batches are not cast.
            y: targets ``(N, ...)`` for in-memory ``x``; ``None`` for the other kinds.
            batch_size: samples per batch (in-memory ``x`` and Datasets; ``None``: 32, as Keras); refused
                (``ValueError``) with a ``DataLoader`` or another iterable of batches, which batch
                themselves (``history.params["batch_size"]`` is then the loader's own); per process under
                torchrun.
            epochs: index of the last epoch (not a count; see above). ``None`` (the
                default): 1, or unbounded when ``max_steps`` is given (Lightning's rule). A float
                (the Trainer's ``num_train_epochs=2.5``) trains the whole epochs, then the
                fraction of the next one's optimizer steps, rounded up (a step budget counted
                from epoch 0, as ``max_steps``; the smaller of the two wins).
            verbose: 0 silent, 1 progress bar, 2 one line per epoch, ``"auto"``: 1 on a
                terminal or notebook, else 2.
            callbacks: :class:`~fitkit.callbacks.Callback` objects, called in list order
                (History and the progress bar last).
            validation_split: fraction in ``[0, 1)`` taken from the end of the arrays before
                shuffling (arrays, tensors and Datasets only).
            validation_data: ``(x_val, y_val)``, ``(x_val, y_val, sample_weight)``, a Dataset,
                a DataLoader or an iterable; its logs get a ``val_`` prefix. Several sets:
                ``{"name": set, ...}``, validated in turn, each logged as ``val_<name>_<key>``
                and the first also as ``val_<key>`` (:mod:`fitkit.training.validation_sets`).
            shuffle: reshuffle in-memory data and Datasets every epoch (one ``randperm``).
            class_weight: ``{class_index: weight}``, folded into the sample weights.
            sample_weight: ``(N,)`` weights for in-memory ``x`` or a Dataset.
            initial_epoch: the epoch to start at (resume).
            steps_per_epoch: batches per epoch (Keras 3): the data iterator then carries over
                across epochs; an epoch ends early (one warning) when the data runs out, and the
                next starts a fresh pass (10 batches with ``steps_per_epoch=9``: 9, 1, 9, 1, ...).
                Needed for infinite iterables. Callbacks find the batches each epoch really runs
                in ``params["steps"]``. A checkpoint keeps the running pass: a resume continues
                it in the same shuffled order.
            validation_steps: batches per validation.
            validation_batch_size: default ``batch_size``.
            validation_freq: validate every n epochs, or at the listed (1-based) epochs.
            max_steps: stop once ``model.global_step`` (optimizer steps, one per accumulation
                window, counted over every fit of the model and resumed from a checkpoint)
                reaches this, whichever of ``epochs`` and ``max_steps`` comes first (Lightning's
                and Transformers' ``max_steps``). A window is never cut; the epoch the budget
                cuts still ends with its logs, validation, ``on_epoch_end`` and ``History``
                entry. Callbacks find it in ``params["max_steps"]``, and the planned optimizer
                steps in ``params["total_steps"]`` (see :mod:`fitkit.training.budget`).
            validation_interval: validate inside epochs: an int ``N``, after every ``N``-th
                optimizer step (``global_step % N == 0``; Transformers' ``eval_steps``), or a
                float in ``(0, 1]``, every ``max(1, int(f * S))`` of an epoch's ``S`` steps
                (Lightning's ``val_check_interval``), or a ``datetime.timedelta`` of training
                time (checked after each step; under torchrun agreed by the ranks within 8
                steps, then run after the next step on all). Validations then run only there; each is
                recorded in ``history.validations`` with its ``step`` and fires
                ``on_validation_end``; the training stream (totals, data order, RNG) is that
                of a fit without them. Not with ``validation_freq``. See
                :mod:`fitkit.training.step_validation`.
            validate_at_end: with ``validation_interval``, also validate at the run's last
                optimizer step when it is not a multiple of the interval (an epoch bound or
                ``max_steps`` reached between validations), so the final weights are scored,
                as the Trainer's end-of-training evaluation does; not after an early stop.
                ``ValueError`` without ``validation_interval``.
            min_epochs / min_steps: no stop before this many epochs (counted from epoch 0, as
                ``epochs``) and optimizer steps (``global_step``) are done (Lightning's Trainer
                flags): a stop requested earlier (``EarlyStopping``, ``model.stop_training``) is
                dropped and training goes on, so the callback decides again later. A signal
                (SIGTERM) and ``max_steps`` still stop. ``ValueError`` above ``epochs`` /
                ``max_steps``.
            max_time: a training time budget (Lightning's ``Trainer(max_time=...)``): seconds,
                a ``datetime.timedelta``, a dict of its keywords or ``"DD:HH:MM:SS"``. Adds a
                :class:`~fitkit.callbacks.Timer` with that duration (checked after each
                optimizer step; its elapsed time is in checkpoints, so a resumed run counts the
                time already spent; under torchrun the ranks stop at one agreed step).
                ``ValueError`` with a ``Timer`` in the callbacks already.
            fast_dev_run: a smoke test before a long job (Lightning's flag): ``True`` (1) or an
                int ``n`` runs ``n`` training batches and then one validation of ``n`` batches,
                in one epoch (``initial_epoch``), whatever ``epochs``, ``max_steps``,
                ``validation_freq`` and ``validation_interval`` say; no sanity check. The
                callbacks that write files or tune (``skip_in_fast_dev_run``: ModelCheckpoint,
                BackupAndRestore, CSVLogger, TensorBoard, MLflowLogger, Profiler,
                OptunaPruning, LearningRateFinder, BatchSizeFinder) are left out, so no file is
                written. The weights do train on those batches.
            overfit_batches: train on the same first ``n`` batches every epoch (an int, or a
                float: ``int(f * batches)``), shuffling turned off; each validation runs the
                validation data's first ``n`` batches (a float: that fraction of them), as in
                Lightning. A shuffled DataLoader or a generator is refused.
            limit_train_batches: at most this many batches per epoch, the first of each
                epoch's pass (an int ``>= 1``, or a float in ``(0, 1]``: ``int(f * batches)``);
                shuffled data gives another subset each epoch. Not with ``steps_per_epoch``.
            limit_val_batches: at most this many batches per validation (an int, or a float
                fraction); ``0`` turns validation off. Not with ``validation_steps``.
            num_sanity_val_steps: validation batches run before step 1 (``-1``: all), so a
                broken validation fails in seconds; no hook runs, nothing is logged, the RNG
                states, modes and metrics are left as they were. Default 0 (Lightning's is 2;
                Keras has none). See :mod:`fitkit.training.quick`.

        Returns:
            The :class:`~fitkit.History`: ``history.history[key]`` is a list of floats per
            epoch (``loss``, metrics, ``learning_rate``, ``val_*``); ``history.validations``
            one record per validation (``epoch``, ``step``, ``val_*``).

        Raises:
            RuntimeError: ``compile`` was not called.
            TypeError: an argument of the wrong type.
            ValueError: a bad value or data (lengths, shapes, labels, NaN / inf values, negative
                sample weights), raised before the first step for in-memory data, so the
                weights are left as they were; a training or scheduled validation source that
                yields no batch.

        Example:
            >>> _ = torch.manual_seed(0)
            >>> model = Model(nn.Linear(2, 1), device="cpu")
            >>> model.compile(optimizer="sgd", loss="mse")
            >>> history = model.fit(torch.zeros(10, 2), torch.ones(10, 1), epochs=3,
            ...                     batch_size=5, verbose=0)
            >>> history.epoch, sorted(history.history)
            ([0, 1, 2], ['learning_rate', 'loss'])
            >>> # a step budget: 3 optimizer steps more (2 per epoch), the second epoch cut after 1
            >>> model.fit(torch.zeros(10, 2), torch.ones(10, 1), batch_size=5, max_steps=9, verbose=0).epoch
            [0, 1]
            >>> model.global_step
            9
            >>> # validation every 2 optimizer steps, recorded with its step
            >>> h = model.fit(torch.zeros(10, 2), torch.ones(10, 1), batch_size=5, epochs=2, verbose=0,
            ...               validation_data=(torch.zeros(4, 2), torch.ones(4, 1)), validation_interval=2)
            >>> [(v["epoch"], v["step"]) for v in h.validations]
            [(0, 10), (1, 12)]
            >>> # a smoke test: 1 batch of training and 1 of validation, whatever `epochs` says
            >>> _ = model.fit(torch.zeros(10, 2), torch.ones(10, 1), batch_size=5, epochs=50, verbose=0,
            ...               validation_data=(torch.zeros(4, 2), torch.ones(4, 1)), fast_dev_run=True)
            >>> model.global_step  # 13 before: one step more
            14
        """
        self._require_compiled("fit")
        check_bool("validate_at_end", validate_at_end)
        for name, value, bound, bound_name in (("min_epochs", min_epochs, epochs, "epochs"),
                                               ("min_steps", min_steps, max_steps, "max_steps")):
            check_int(name, value, 0, allow_none=True)
            if value is not None and isinstance(bound, int) and not isinstance(bound, bool) and value > bound:
                raise ValueError(
                    f"{name}={value} asks for more than {bound_name}={bound}, which ends training first. "
                    f"Fix: lower {name}, or raise {bound_name}."
                )
        if validate_at_end and validation_interval is None:
            raise ValueError(
                "validate_at_end=True adds a validation at the last step to those of `validation_interval`, "
                "but validation_interval is None (validations then run at epoch ends, the last one included). "
                "Fix: pass validation_interval=N, or drop validate_at_end."
            )
        callbacks = _with_time_budget(max_time, callbacks)
        quick = check_quick(fast_dev_run, overfit_batches, limit_train_batches, limit_val_batches,
                            num_sanity_val_steps, x=x, steps_per_epoch=steps_per_epoch,
                            validation_steps=validation_steps)  # fmt: skip
        plan = planning.plan_fit(
            self, x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
            callbacks=with_compiled_ema(self.compiled_ema, callbacks),
            validation_split=validation_split, validation_data=validation_data, shuffle=shuffle,
            class_weight=class_weight, sample_weight=sample_weight, initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
            validation_batch_size=validation_batch_size, validation_freq=validation_freq, max_steps=max_steps,
            validation_interval=validation_interval, quick=quick,
        )  # fmt: skip
        self._keep_example(plan.example)
        sanity_check(self, plan.val, quick.sanity_steps)  # before step 1: a broken validation fails now
        self._require_compiled("fit").scheduling.build_planned(plan.total_steps, resolve_scheduler)
        self.history = History()
        cbs = planning.callback_list(self, plan.callbacks, plan.verbose, plan.shown_epochs, plan.train.num_batches,
                                     self.history, **plan.params)  # fmt: skip
        loop = FitLoop(self, plan.train, cbs, initial_epoch=initial_epoch, epochs=plan.epochs, validation=plan.val,
                       schedule=plan.schedule, validation_steps=validation_steps, max_steps=plan.params["max_steps"],
                       validation_interval=plan.interval, accumulation=plan.accumulation,
                       validate_at_end=validate_at_end, min_epochs=min_epochs, min_steps=min_steps)  # fmt: skip
        del plan, cbs  # the loop holds the call's data and callbacks; it lets go when it ends
        outer, self._fit = self._fit, loop
        try:
            loop.run()
        finally:
            self._fit = outer
            self._let_go(loop)
        return self.history

    def _let_go(self, loop: FitLoop) -> None:
        """Keep plain values of a finished (or failed) fit; the loop and its data go."""
        self._last_epoch, self._last_validated = loop.epoch, bool(loop.validated)
        self._fit_ended = loop.state_dict(boundary=True)
        self._keep_example(loop.example)

    def _keep_example(self, x: Any) -> None:
        if x is not None:
            self._example_x = x  # the last first batch checked: summary's input

    # -- fitkit's internal surface: what its own packages use of a model (not for users) --------
    @property
    def stepper(self) -> Stepper | None:
        """The compiled :class:`~fitkit.training.stepper.Stepper` (``None`` before ``compile``)."""
        return self._stepper

    @property
    def parallel(self) -> _distributed.Parallel | None:
        """DDP / FSDP under torchrun (:class:`fitkit.distributed.Parallel`), else ``None``."""
        return self._parallel

    @property
    def phases(self) -> Phases:
        """The phase stack and the metric template (:class:`~fitkit.training.tracking.Phases`)."""
        return self._phases

    def running_fit(self) -> FitLoop | None:
        """The running fit loop (a checkpoint taken now holds its position), else ``None``."""
        loop = self._fit
        return loop if loop is not None and loop.running else None

    def fit_position(self) -> dict[str, Any]:
        """Where a checkpoint taken now continues: the running fit's position (inside an epoch,
        its RNG state and totals too), else where the last fit ended, else the start."""
        loop = self.running_fit()
        if loop is not None:
            return loop.state_dict()
        return dict(self._fit_ended or {"epoch": 0, "step_in_epoch": 0, "samples_in_epoch": 0,
                                        "pass_offset": 0, "batch_size": None})  # fmt: skip

    def await_resume(self, point: ResumePoint) -> None:
        """Keep a loaded checkpoint's :class:`~fitkit.training.state.ResumePoint` for the next fit."""
        self._resume = point

    def pop_resume(self) -> ResumePoint | None:
        """Take the waiting resume point (a loaded resume point serves one fit only)."""
        point, self._resume = self._resume, None
        return point

    # -- evaluate / predict ------------------------------------------------------------------
    @known_keywords
    @declared(_options.EVALUATE)
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
        return_dict: bool = True,
    ) -> Any:
        """Loss and metrics over the data, as exact per-sample means: ``{"loss": ..., ...}``.

        Runs every submodule in eval mode with autograd off and restores both afterwards. A
        short last batch counts by its size (not a mean of batch means); under torchrun the
        values are reduced over all ranks, every sample counted once. Called from a callback
        during ``fit``, it keeps totals of its own: the training epoch stays exact.

        Args:
            x: inputs, as for :meth:`fit`; or several named sets, ``{"name": (x, y), "other":
                DataLoader(...), ...}`` (as ``fit``'s ``validation_data``), each evaluated in turn.
            y: targets for in-memory ``x``.
            batch_size: samples per batch (in-memory ``x`` and Datasets).
            verbose: 0, 1, 2 or ``"auto"`` (see :meth:`fit`).
            sample_weight: ``(N,)`` weights for the loss.
            steps: evaluate this many batches only (an infinite generator needs it, or a
                callback that sets ``model.stop_evaluating``).
            callbacks: callbacks whose ``on_test_*`` hooks run.
            return_dict: ``False`` returns Keras' form: the loss alone (a float) without
                metrics, else the list ``[loss, *metrics]`` in the order of ``compile``.

        Returns:
            ``{"loss": float, <metric>: float, ...}`` (or Keras' scalar / list). For named sets
            ``{"<name>_loss": float, "<name>_<metric>": float, ...}`` per set, or with
            ``return_dict=False`` one scalar / list per set, in the dict's order.

        Raises:
            RuntimeError: ``compile`` was not called.
            TypeError: an argument of the wrong type.
            ValueError: a bad value or data (lengths, shapes, labels), or a source with no sample.

        Example:
            >>> model = Model(nn.Linear(1, 1), device="cpu")
            >>> _ = nn.init.zeros_(model.module.weight), nn.init.zeros_(model.module.bias)
            >>> model.compile(loss="mse", metrics=["mae"])
            >>> model.evaluate(torch.zeros(5, 1), torch.tensor([[1.0], [1], [1], [1], [4]]),
            ...                batch_size=2, verbose=0)
            {'loss': 4.0, 'mae': 1.600000023841858}
            >>> model.evaluate(torch.zeros(2, 1), torch.ones(2, 1), verbose=0, return_dict=False)  # Keras' list
            [1.0, 1.0]
            >>> model.evaluate({"ones": (torch.zeros(2, 1), torch.ones(2, 1)),
            ...                 "twos": (torch.zeros(2, 1), torch.full((2, 1), 2.0))}, verbose=0)
            {'ones_loss': 1.0, 'ones_mae': 1.0, 'twos_loss': 4.0, 'twos_mae': 2.0}
        """
        self._require_compiled("evaluate")
        check_bool("return_dict", return_dict)
        batch_size, verbose, callbacks = planning.call_args(batch_size, steps, verbose, callbacks)
        sets = named_sets(x, "x") if y is None and sample_weight is None else None
        if sets is not None:
            return self._evaluate_sets(sets, batch_size, verbose, steps, callbacks, return_dict)
        loader = _distributed.sharded(
            _data.as_loader, x, y, sample_weight, batch_size=batch_size, device=self.device, steps=steps
        )
        self._keep_example(planning.check_data(self, loader, "x", training=False))
        cbs = planning.callback_list(self, callbacks, verbose, None, loader.num_batches)
        logs = EvalLoop(self, loader, cbs, steps).run()
        values = [logs[k] for k in ("loss", *self.metrics.keys) if k in logs]
        return logs if return_dict else values[0] if len(values) == 1 else values

    def _evaluate_sets(self, sets: dict[str, Any], batch_size: int | None, verbose: int, steps: int | None,
                       callbacks: list[Callback], return_dict: bool) -> Any:  # fmt: skip
        """``evaluate({"name": data, ...})``: every set in turn (:mod:`fitkit.training.validation_sets`)."""
        val = planning.validation_loaders(self, sets, batch_size, argument="x")
        for name, loader in val.items():
            planning.check_data(self, loader, f"x[{name!r}]", training=False)
        cbs = planning.callback_list(self, callbacks, verbose, None, None)
        logs = run_validation(self, val.map(lambda loader: loader), cbs, steps, what="evaluate")
        if return_dict:
            return logs
        keys = [k for k in ("loss", *self.metrics.keys) if f"{val.names[0]}_{k}" in logs]
        per_set = [[logs[f"{name}_{k}"] for k in keys] for name in val.names]
        return [v[0] if len(v) == 1 else v for v in per_set]

    @known_keywords
    @declared(_options.PREDICT)
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
        rank gets every row once, in input order. In-memory ``x`` with 0 rows gives the
        module's output for an empty batch (shape ``(0, ...)``); another source that yields
        no batch is a ``ValueError``.

        Args:
            x: inputs, as for :meth:`fit` (targets, if any, are ignored).
            batch_size: samples per batch (in-memory ``x`` and Datasets).
            verbose: 0, 1, 2 or ``"auto"`` (see :meth:`fit`).
            steps: predict this many batches only (or set ``model.stop_predicting``).
            callbacks: callbacks whose ``on_predict_*`` hooks run.

        Returns:
            The module's output structure (a tensor ``(N, ...)``, or a tuple / namedtuple /
            list / dict of them) with every batch concatenated on dim 0. A dict-like output
            with a ``"logits"`` entry (Hugging Face's ``ModelOutput``) gives its logits.

        Raises:
            TypeError: an argument of the wrong type.
            ValueError: a bad value, or a source that yields no batch.

        Example:
            >>> model = Model(nn.Linear(3, 2), device="cpu")
            >>> model.predict(torch.zeros(10, 3), batch_size=4, verbose=0).shape
            torch.Size([10, 2])
        """
        batch_size, verbose, callbacks = planning.call_args(batch_size, steps, verbose, callbacks)
        loader = _distributed.sharded(_data.as_loader, x, batch_size=batch_size, device=self.device, steps=steps)
        src = loader.batches
        if isinstance(src, _data.TensorBatches):
            cast_to_module(src, self.module)  # float64 arrays into a float32 module, as fit does
        if isinstance(src, _data.TensorBatches) and src.n == 0 and not _distributed.is_distributed():
            return self.predict_on_batch(src.x)
        cbs = planning.callback_list(self, callbacks, verbose, None, loader.num_batches)
        out = PredictLoop(self, loader, cbs, steps).run()
        nothing = isinstance(out, torch.Tensor) and out.numel() == 0 and out.dim() == 1
        if nothing and not isinstance(src, _data.TensorBatches):
            raise ValueError(
                f"`x` ({_data.loaders.source_name(src)}) yielded no batch, so there is nothing to "
                "predict. Fix: pass data with at least one sample (a generator is used up after one pass)."
            )
        return out

    # -- single batches ----------------------------------------------------------------------
    def train_on_batch(
        self, x: Any, y: Any = None, sample_weight: Any = None, class_weight: Mapping[int, float] | None = None
    ) -> dict[str, float]:
        """One optimizer step on one batch; returns that batch's loss and metrics.

        Args:
            x: the batch's inputs ``(B, ...)`` (tensors or numpy arrays, or a tuple / dict).
            y: its targets ``(B, ...)``.
            sample_weight: ``(B,)`` weights for the loss.
            class_weight: ``{class_index: weight}``, folded into the sample weights (Keras).

        Returns:
            ``{"loss": float, <metric>: float, ...}`` for this batch alone.

        Raises:
            RuntimeError: ``compile`` was not called.
            ValueError: a label without a class weight.

        Example:
            >>> model = Model(nn.Linear(1, 1, bias=False), device="cpu")
            >>> _ = nn.init.ones_(model.module.weight)
            >>> model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
            >>> model.train_on_batch(torch.ones(2, 1), torch.zeros(2, 1))
            {'loss': 1.0}
            >>> round(model.module.weight.item(), 6)  # w - lr * 2 * w * x^2
            0.8
        """
        stepper = self._require_compiled("train_on_batch")
        batch = _data.device_batch(x, y, sample_weight, device=self.device, class_weight=class_weight)
        phases = self._phases
        totals = phases.new_totals()
        # targets_count(.., None): one batch's targets are not the scanned ones of a fit it runs within
        with stepper.step_of_its_own(), modes(self.module, training=None, grad=True), phases.running(totals), \
                targets_count(self.loss, None):  # fmt: skip
            self.train_step(batch)
        phases.adopt(totals)
        return totals.result()

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

        Example:
            >>> model = Model(nn.Linear(1, 1, bias=False), device="cpu")
            >>> _ = nn.init.zeros_(model.module.weight)
            >>> model.compile(loss="mse")
            >>> model.test_on_batch(torch.ones(2, 1), torch.full((2, 1), 3.0))
            {'loss': 9.0}
        """
        self._require_compiled("test_on_batch")
        batch = _data.device_batch(x, y, sample_weight, device=self.device)
        totals = self._phases.new_totals()
        with modes(self.module, training=False, grad=False), self._phases.running(totals), \
                targets_count(self.loss, None):  # fmt: skip
            self.test_step(batch)
        return totals.result()

    def predict_on_batch(self, x: Any) -> Any:
        """The module's output for one batch in eval mode under ``no_grad``, on the CPU.

        Args:
            x: the batch's inputs ``(B, ...)``.

        Returns:
            The module's output structure for the batch.

        Example:
            >>> Model(nn.Linear(3, 2), device="cpu").predict_on_batch(torch.zeros(4, 3)).shape
            torch.Size([4, 2])
        """
        batch = _data.device_batch(x, device=self.device)
        with modes(self.module, training=False, grad=False):
            return nest.concat([self.predict_step(batch)])

    # -- override points ---------------------------------------------------------------------
    @property
    def default_compute_loss(self) -> bool:
        """Whether :meth:`compute_loss` is fitkit's own (not overridden in a subclass)."""
        return type(self).compute_loss is Model.compute_loss

    @property
    def default_train_step(self) -> bool:
        """Whether :meth:`train_step` is fitkit's own."""
        return type(self).train_step is Model.train_step

    @property
    def default_test_step(self) -> bool:
        """Whether :meth:`test_step` is fitkit's own."""
        return type(self).test_step is Model.test_step

    def compute_loss(self, x: Any, y: Any, y_pred: Any, sample_weight: torch.Tensor | None) -> torch.Tensor:
        """The batch's training objective: ``sum(w * l) / sum(w)`` over its loss terms.

        The terms are the tokens that count for a class-index loss (``"cross_entropy"``,
        ``"nll"``: every target position but ``ignore_index``) and the rows for the others;
        ``w`` is 1 without sample weights (see :mod:`fitkit.losses.denominators`). Override it to add
        terms (e.g. a regularizer); ``x`` is there for losses that need it. With
        ``compile(loss=None)``, a module output that carries its own ``"loss"`` (Hugging Face
        models called with ``labels``) is the objective. With a compiled loss and no ``y``, a dict
        batch's ``"labels"`` are the targets (the Transformers Trainer's default ``label_names``), for
        the metrics too; the default steps then leave ``labels`` out of the module's inputs, as the
        Trainer does for a custom loss, so the model does not compute a loss of its own.

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
        if self.loss is None:
            own = own_loss(y_pred)
            if own is not None:
                return own
            raise RuntimeError(
                "No loss to compute: none was compiled and the module's output carries no 'loss' (a "
                "Hugging Face model computes one only when its inputs hold `labels`). Fix: put the "
                "targets in the input dict as 'labels', `model.compile(loss=...)`, or override `compute_loss`."
            )
        if y is None:
            y = targets_of(x, y, self.label_names)  # a dict batch's "labels" (Hugging Face's convention)
        if y is None:
            raise ValueError(
                f"The loss needs targets, but the batch has no `y` (nor a dict entry named by label_names="
                f"{list(self.label_names)}). Fix: pass `y=`, yield `(x, y)` batches, put the targets in a dict "
                "batch as 'labels' (or name their key: compile(label_names=[...])), or override `compute_loss`."
            )
        if not isinstance(self.loss, MultiLoss) and not isinstance(y_pred, torch.Tensor):
            # A plain callable loss may read the whole structured output; fitkit's losses need
            # the prediction picked by the rule of fitkit.losses.outputs.
            pred = prediction_of(y_pred)
            if pred is not None:
                y_pred = pred
            elif self.loss.kind != "custom":
                require_prediction(y_pred, f"the loss '{self.loss.name}'")
        if sample_weight is None and isinstance(y, torch.Tensor) and y.is_floating_point():
            return self.loss(y_pred, y)  # float targets count rows: objective's common case, one call less
        return objective(self.loss, y_pred, y, sample_weight)  # sum(w * l) / sum(w) over rows or tokens

    def train_step(self, batch: tuple[Any, Any, Any]) -> None:
        """One (micro-)batch of training: forward, loss, backward, metrics, optimizer step.

        ``batch`` is ``(x, y, sample_weight)`` on the device (``y`` / ``sample_weight`` may be
        ``None``). Override it with the public pieces: ``self(x)`` (the training forward),
        :meth:`compute_loss`, :meth:`autocast`, :meth:`backward`, :meth:`optimizer_step`
        (a no-op inside an accumulation window) and :meth:`update_metrics`; see
        "Custom training steps" in the docs for an auxiliary loss and a two-optimizer step.
        """
        x, y, sample_weight = batch
        stepper = self._stepper or self._require_compiled("train_step")
        inputs = x if isinstance(x, torch.Tensor) else self._forward_inputs(x, y)
        window = stepper.window
        if window.num_items is not None and isinstance(inputs, Mapping):  # the module's own token loss
            inputs = {**inputs, "num_items_in_batch": window.num_items}
        if stepper.plain:  # one process, float32: both contexts below would do nothing
            y_pred = self._forward(inputs)
            loss = self.compute_loss(x, y, y_pred, sample_weight)
            self.backward(loss)
        else:
            with stepper.no_sync(self.module):
                with self.autocast():
                    y_pred = self._forward(inputs)
                    loss = self.compute_loss(x, y, y_pred, sample_weight)
                if self._parallel is not None and nest.rows(y if y is not None else x) == 0:
                    loss = loss.nan_to_num(0.0)  # a rank's empty share of a short last batch: 0, not 0/0
                self.backward(loss)
        # Metrics first: a metric that rejects the batch then fails before the weights change.
        target = y if y is not None else targets_of(x, y, self.label_names)
        if window.items_here is not None and isinstance(inputs, Mapping):  # a module's own token loss:
            here = window.items_here  # the batch's mean and its count of label tokens go to the totals
            if window.num_items is None:  # its own mean: NaN where no label counts (0 / 0), weighed 0 here
                mean = loss.detach().where(here > 0, 0.0)
            else:
                mean = loss.detach() * (window.num_items / torch.clamp(here, min=1))
            self._update(mean, y_pred, target, sample_weight, here)
        else:
            self.update_metrics(loss, y_pred, target, sample_weight)
        self.optimizer_step()

    def _forward_inputs(self, x: Any, y: Any) -> Any:
        """The module's inputs (:func:`fitkit.losses.outputs.module_inputs`)."""
        return module_inputs(x, y, self.loss is not None and self.default_compute_loss, self.label_names)

    def test_step(self, batch: tuple[Any, Any, Any]) -> None:
        """One batch of evaluation (eval mode, no grad): loss and metrics."""
        x, y, sample_weight = batch
        with self.autocast():
            y_pred = self._forward(x if isinstance(x, torch.Tensor) else self._forward_inputs(x, y))
            has_loss = self.loss is not None or not self.default_compute_loss or own_loss(y_pred) is not None
            # y=None still reaches compute_loss: an override may not need targets (autoencoders),
            # and the default one says that a compiled loss does.
            loss = self.compute_loss(x, y, y_pred, sample_weight) if has_loss else None
        self.update_metrics(loss, y_pred, targets_of(x, y, self.label_names), sample_weight)

    def predict_step(self, batch: tuple[Any, Any, Any]) -> Any:
        """One batch of prediction: the module's output for ``x`` (``y`` is ignored).

        Under mixed precision the module runs under autocast, and float16 / bfloat16 outputs
        come back as float32, as a user of ``predict`` expects (Keras returns float32 too).
        """
        with self.autocast():
            out = self._forward(batch[0])
        if isinstance(out, Mapping) and "logits" in out:
            out = out["logits"]
        if self.precision == "32":
            return out
        return nest.map_structure(lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, out)

    # -- the pieces a train_step override uses -----------------------------------------------
    def autocast(self) -> Any:
        """The autocast context of the compiled ``precision`` (a no-op for ``"32"``)."""
        if self.precision == "32":
            return NO_CONTEXT
        return autocast(self.device, self.precision)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the accumulation share and the fp16 GradScaler applied.

        A loss that needs no gradient (every parameter frozen) is not backpropagated.
        """
        stepper = self._stepper or self._require_compiled("backward")
        if loss.requires_grad:
            stepper.backward(loss)

    def optimizer_step(self) -> bool:
        """Step the optimizer if this micro-batch closes its accumulation window.

        Runs ``on_backward_end`` (gradients unscaled), the skip decision, clipping, the
        GradScaler and a per-step scheduler. Returns whether the weights changed.
        """
        stepper = self._stepper or self._require_compiled("optimizer_step")
        return stepper.step(self.module)

    def update_metrics(
        self, loss: torch.Tensor | None, y_pred: Any, y: Any, sample_weight: torch.Tensor | None = None
    ) -> None:
        """Add a batch to the running phase's loss and metrics (on the device, no sync).

        Call it from a custom ``train_step`` / ``test_step`` so the logs see the batch.
        ``y_pred`` may be a structured output (its prediction is picked as in
        :mod:`fitkit.losses.outputs`).

        Raises:
            RuntimeError: called outside ``fit`` / ``evaluate`` / ``*_on_batch``.
        """
        stack = self._phases.stack
        if not stack:
            raise RuntimeError(
                "`update_metrics` adds to the running fit / evaluate; it was called outside one. "
                "Fix: call it from train_step or test_step."
            )
        totals = stack[-1]
        pred = y_pred if isinstance(y_pred, torch.Tensor) else prediction_of(y_pred)
        if pred is None and y is not None and totals.metrics.entries != []:
            require_prediction(y_pred, "the compiled metrics")  # raises, naming the rule and the fix
        count = denominator(self.loss, y, sample_weight, y_pred) if loss is not None else None
        totals.update(loss, y_pred if pred is None else pred, y, sample_weight, denominator=count)

    def _update(self, loss: torch.Tensor, y_pred: Any, y: Any, sample_weight: Any, count: Any) -> None:
        """:meth:`update_metrics` with the batch's loss denominator given (a module's own token loss)."""
        stack = self._phases.stack
        pred = y_pred if isinstance(y_pred, torch.Tensor) else prediction_of(y_pred)
        stack[-1].update(loss, y_pred if pred is None else pred, y, sample_weight, denominator=count)

    def _batch_denominator(self, batch: tuple[Any, Any, Any]) -> int | torch.Tensor:
        x, y, w = batch
        return denominator(self.loss, y if y is not None else targets_of(x, y, self.label_names), w, x)

    # -- files -------------------------------------------------------------------------------
    def save_weights(self, path: str | os.PathLike, *, trainable_only: bool = False) -> None:
        """Write the module's state dict to ``path`` atomically (under torchrun: rank 0 writes).

        With ``strategy="fsdp"`` gathering the state is a collective: call it on every rank.
        The file holds only tensors (no optimizer state); reload it with :meth:`load_weights`.
        A path ending in ``.safetensors`` writes safetensors (``pip install torch-fitkit[safetensors]``;
        tied weights are stored once), readable by Hugging Face's and timm's tools.

        With ``trainable_only=True`` the file holds only the parameters with ``requires_grad``
        (their full state-dict names): for a PEFT ``PeftModel`` the LoRA adapters, as the
        Transformers Trainer saves only a ``PeftModel``'s adapters. Load it back onto the same base
        model with ``load_weights(path, trainable_only=True)``. (PEFT's own adapter folder, for
        ``PeftModel.from_pretrained``, is ``model.module.save_pretrained(folder)``.)

        Args:
            path: the file to write; missing parent folders are created, an existing file is
                replaced.
            trainable_only: write the trainable parameters alone (no frozen weights, no buffers).

        Raises:
            OSError: the file cannot be written (the old file, if any, is left as it was).
            ValueError: ``trainable_only=True`` with every parameter frozen (nothing to save).

        Example:
            >>> import os, tempfile
            >>> model = Model(nn.Linear(2, 1), device="cpu")
            >>> with tempfile.TemporaryDirectory() as d:
            ...     model.save_weights(os.path.join(d, "weights.pt"))
            ...     sorted(torch.load(os.path.join(d, "weights.pt"), weights_only=True))
            ['bias', 'weight']
        """
        _checkpoint.save_weights(self, path, trainable_only)

    def load_weights(self, path: str | os.PathLike, strict: bool = True, *, trainable_only: bool = False) -> None:
        """Load a state dict saved by :meth:`save_weights` (or a checkpoint) onto ``model.device``.

        The file is read with ``torch.load(..., weights_only=True)``, or with safetensors when
        the path ends in ``.safetensors``. A file written by :meth:`save_checkpoint` works too:
        only its module weights are loaded. Keys, shapes and dtypes are compared first: on any
        mismatch nothing is loaded.

        Args:
            path: the file to read.
            strict: require the file's keys to match the module's exactly, as in
                ``nn.Module.load_state_dict``.
            trainable_only: the file holds the trainable parameters alone (written by
                ``save_weights(..., trainable_only=True)``): its keys are compared with those, and
                the frozen weights are left as they are.

        Raises:
            FileNotFoundError: no file at ``path``.
            RuntimeError: an unsafe file (pickled code; refused before it runs).
            ValueError: keys, shapes or dtypes that do not match (nothing is loaded then).

        Example:
            >>> import os, tempfile
            >>> model, other = Model(nn.Linear(2, 1), device="cpu"), Model(nn.Linear(2, 1), device="cpu")
            >>> with tempfile.TemporaryDirectory() as d:
            ...     model.save_weights(os.path.join(d, "weights.pt"))
            ...     other.load_weights(os.path.join(d, "weights.pt"))
            >>> torch.equal(other.module.weight, model.module.weight)
            True
        """
        _checkpoint.load_weights(self, path, strict, trainable_only)

    def checkpoint_state(self) -> dict[str, Any]:
        """The full training state as a ``weights_only``-loadable dict.

        Module, optimizer (and its class), scheduler, grad scaler, epoch, position inside the
        epoch (batches and samples; with ``steps_per_epoch``, the running pass's offset and what
        drew its order), global step, RNG states, callback states, history, the
        fitkit version; :meth:`save_checkpoint` adds a checksum of the payload.
        """
        return _checkpoint.checkpoint_state(self)

    def save_checkpoint(self, path: str | os.PathLike, *, sharded: bool | None = None,
                        async_save: bool = False) -> None:  # fmt: skip
        """Write the full training state (:meth:`checkpoint_state`) to ``path`` atomically.

        Under torchrun rank 0 writes (its RNG states); the state is unwrapped, so the file
        resumes at any world size. With ``strategy="fsdp"`` the checkpoint is a folder of shards
        (``torch.distributed.checkpoint``, see :mod:`fitkit.distributed.dcp`): every rank
        writes its own shards and no rank gathers the full state; it loads at any world size,
        one process included. Call it on every rank.

        Args:
            path: the file (or folder) to write; missing parent folders are created, an
                existing one is replaced once the new one is complete.
            sharded: write a folder of shards; ``None``: under ``strategy="fsdp"`` only.
            async_save: for a sharded checkpoint: return once the state is copied off the
                training tensors and write it in a background thread (one save in flight;
                the next save, the end of ``fit`` and a SIGTERM wait for it).

        Raises:
            OSError: the file cannot be written (the old file, if any, is left as it was).
            ValueError: ``async_save=True`` for a one-file checkpoint.
        """
        _checkpoint.save_checkpoint(self, path, sharded, async_save)

    def load_checkpoint(self, path: str | os.PathLike) -> int:
        """Restore a checkpoint; the next ``fit(..., initial_epoch=k)`` continues from it.

        Tensors are mapped onto ``model.device``. RNG states, the position inside the epoch
        and callback states are applied when ``fit`` reaches that point, so code run in
        between does not change the result. A ``BackupAndRestore`` calls it for you.

        Args:
            path: a file or a folder of shards written by :meth:`save_checkpoint`.

        Returns:
            ``k``: the epoch to pass as ``initial_epoch`` (0-based).

        Raises:
            FileNotFoundError: no file at ``path``.
            RuntimeError: the model is not compiled (the optimizer must exist), or the file is
                unsafe.
            ValueError: the file is not a fitkit checkpoint, is damaged, or does not match the
                model (nothing is loaded then).
        """
        self._require_compiled("load_checkpoint")
        return _checkpoint.load_checkpoint(self, path)

    def summary(self, print_fn: Any = None, *, input_shape: tuple[int, ...] | None = None,
                example_input: Any = None) -> Any:
        """Print a rich table of layers: type, output shape, parameters (trainable, frozen).

        Output shapes come from one forward pass with hooks (eval mode, ``no_grad``, flags
        restored) on ``example_input``, else on zeros of ``input_shape``, else on the first
        batch of the last in-memory data that fit / evaluate saw; ``?`` when there is none.

        Args:
            print_fn: called with the table; default: print it to the terminal with rich
                (under torchrun, on rank 0 only).
            input_shape: the shape of one sample, without the batch dimension, e.g. ``(64,)``:
                a ``(1, *input_shape)`` batch of zeros in the parameters' dtype on
                ``model.device`` (float inputs only: pass token ids as ``example_input``).
            example_input: one input batch: a tensor, a tuple (``module(*x)``) or a dict
                (``module(**x)``); moved to ``model.device``.

        Returns:
            The ``rich.table.Table``: one row per submodule, then a ``Total`` row.

        Raises:
            TypeError: ``input_shape`` is not a tuple or list of ints.
            ValueError: both ``input_shape`` and ``example_input``, a size < 1, or an input
                the module fails on (the error is chained).

        Example:
            >>> model = Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), device="cpu")
            >>> table = model.summary(print_fn=lambda table: None, input_shape=(4,))
            >>> [list(c.cells) for c in table.columns[:3]]
            [['0', '1', 'Total'], ['Linear', 'ReLU', ''], ['(1, 8)', '(1, 8)', '(1, 8)']]
        """
        if input_shape is not None and example_input is not None:
            raise ValueError("Pass `input_shape` or `example_input` to summary, not both.")
        if input_shape is not None:
            if not isinstance(input_shape, (tuple, list)) or not all(
                isinstance(d, int) and not isinstance(d, bool) for d in input_shape
            ):
                raise TypeError(
                    "Expected `input_shape` to be a tuple of ints (one sample, without the batch "
                    f"dimension), e.g. (64,). Received: input_shape={input_shape!r}."
                )
            if any(d < 1 for d in input_shape):
                raise ValueError(f"Expected every size in `input_shape` >= 1. Received: input_shape={input_shape!r}.")
            param = next(self.module.parameters(), None)
            dtype = param.dtype if param is not None else torch.get_default_dtype()
            example_input = torch.zeros((1, *input_shape), device=self.device, dtype=dtype)
        elif example_input is not None:
            example_input = _data.device_batch(example_input, device=self.device)[0]
        else:
            example_input = self._example_x  # the first batch of the last in-memory data
        return summary_table(self.module, print_fn, example_input)

    def export(self, path: str | os.PathLike, example_input: Any, format: str = "torch",
               dynamic_batch: bool = True) -> Path:
        """Export the module for serving: a ``torch.export`` program (``.pt2``) or ONNX.

        See :func:`fitkit.tools.export.export`: traced once in eval mode under ``no_grad`` (flags
        restored), with dimension 0 of the inputs symbolic when ``dynamic_batch``.

        Args:
            path: the file to write.
            example_input: one input batch (tensor, tuple or dict, as ``fit`` passes ``x``);
                moved to ``model.device``.
            format: ``"torch"`` (``torch.export.save``) or ``"onnx"`` (``torch.onnx.export``,
                needs ``pip install torch-fitkit[onnx]``).
            dynamic_batch: export a symbolic batch size instead of the example's.

        Returns:
            The path written.

        Raises:
            ValueError: an unknown ``format``.
            ImportError: ONNX without onnx / onnxscript.
            RuntimeError: a module that ``torch.export`` cannot trace (cause chained).

        Example:
            >>> import tempfile
            >>> model = Model(nn.Linear(4, 2), device="cpu")
            >>> path = model.export(tempfile.mkdtemp() + "/linear.pt2", torch.zeros(1, 4))
            >>> torch.export.load(path).module()(torch.ones(3, 4)).shape
            torch.Size([3, 2])
        """
        from fitkit.tools.export import export

        return export(self.module, path, _data.device_batch(example_input, device=self.device)[0], format=format,
                      dynamic_batch=dynamic_batch)  # fmt: skip

    # -- tools ------------------------------------------------------------------------------
    def find_lr(self, x: Any, y: Any = None, **kwargs: Any) -> Any:
        """Sweep the learning rate and suggest one; the model is left exactly as it was.

        See :func:`fitkit.tools.lr_finder.find_lr` for the arguments (``batch_size``, ``start_lr``,
        ``end_lr``, ``num_steps``, ``smooth``, ``diverge_threshold``, ``plot``, ``path``).

        Returns:
            A :class:`fitkit.tools.lr_finder.LRFinderResult` (``lrs``, ``losses``, ``suggestion``).

        Example:
            >>> model = Model(nn.Linear(2, 1), device="cpu")
            >>> model.compile(optimizer="sgd", loss="mse")
            >>> result = model.find_lr(torch.randn(32, 2), torch.randn(32, 1), num_steps=5)
            >>> len(result.lrs), result.lrs[-1]
            (5, 10.0)
        """
        from fitkit.tools.lr_finder import find_lr

        return find_lr(self, x, y, **kwargs)

    def find_batch_size(self, x: Any, y: Any = None, **kwargs: Any) -> Any:
        """The largest batch size that fits, by doubling; everything is put back afterwards.

        See :func:`fitkit.tools.batch_size_finder.find_batch_size` for the arguments
        (``init_val``, ``max_trials``, ``steps_per_trial``, ``max_val``); Lightning's
        ``BatchSizeFinder``.

        Returns:
            A :class:`fitkit.tools.batch_size_finder.BatchSizeResult` (``batch_size``, ``trials``).

        Example:
            >>> model = Model(nn.Linear(2, 1), device="cpu")
            >>> model.compile(loss="mse")
            >>> model.find_batch_size(torch.randn(8, 2), torch.randn(8, 1)).trials  # 8: all the data
            [(2, True), (4, True), (8, True)]
        """
        from fitkit.tools.batch_size_finder import find_batch_size

        return find_batch_size(self, x, y, **kwargs)



def _with_time_budget(max_time: Any, callbacks: Any) -> Any:
    """``callbacks`` with ``fit(max_time=...)``'s :class:`~fitkit.callbacks.Timer` added."""
    if max_time is None:
        return callbacks
    from fitkit.callbacks.timer import Timer

    timer = Timer(max_time)  # checks the duration
    listed = list(callbacks or [])
    if any(isinstance(cb, Timer) for cb in listed):
        raise ValueError(
            "fit(max_time=...) adds a Timer, and the callbacks hold one already: two time budgets. "
            "Fix: pass one of them (max_time=, or Timer(duration=...))."
        )
    return [*listed, timer]
