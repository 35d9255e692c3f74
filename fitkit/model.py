"""The ``Model``: compile, fit, evaluate, predict around any ``nn.Module``.

The model is a facade: each verb's signature and docstring live here, and each hands its
arguments by name to the training core (``fitkit.training``), whose shared state hangs under
one internal name, ``model._core``. ``fit`` goes ``Model.fit`` -> ``calls.prepare_fit`` ->
``planning.plan_fit`` (one frozen ``FitPlan``) -> ``calls.run_fit`` -> ``FitLoop.run``; the
architecture guide follows a batch from there.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fitkit import distributed as _distributed
from fitkit.callbacks.base import Callback, History
from fitkit.checks import known_keywords
from fitkit.checks.declared import declared
from fitkit.devices import NO_CONTEXT, autocast, optimizer_to, resolve_device
from fitkit.distributed import meta as _meta
from fitkit.losses.labels import LABELS
from fitkit.metrics import MetricSet
from fitkit.training import calls as _calls
from fitkit.training import options as _options
from fitkit.training import steps as _steps
from fitkit.training.calls import prepare_fit, run_fit
from fitkit.training.compiling import compile_model
from fitkit.training.core import Core
from fitkit.training.files_and_tools import FilesAndTools
from fitkit.training.recompute import check_recompute, checkpoint_activations

__all__ = ["Model"]


class Model(FilesAndTools):
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
    def __init__(
        self,
        module: nn.Module,
        *,
        device: str | torch.device = "auto",
        strategy: str | _distributed.FSDP = "auto",
        timeout: float | None = None,
        activation_checkpointing: object = False,
    ):
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
        parallel = _distributed.Parallel(strategy, self.device) if _distributed.is_distributed() else None
        if not _meta.on_meta(module):
            self.module = module.to(self.device)
        elif parallel is not None and parallel.fsdp:
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
        self._core = Core(self.module, parallel, self.device)  # the training core's state (internal)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The compiled optimizer (``None`` before ``compile``)."""
        stepper = self._core.stepper
        return None if stepper is None else stepper.optimizer

    @property
    def scheduler(self) -> Any:
        """The compiled LR scheduler, or ``None``; assign ``None`` to stop it stepping."""
        stepper = self._core.stepper
        return None if stepper is None else stepper.scheduling.scheduler

    @scheduler.setter
    def scheduler(self, value: object) -> None:
        self._core.require_compiled("scheduler").scheduling.set_scheduler(value)

    @property
    def metrics(self) -> MetricSet:
        """The compiled metrics, the template each phase (epoch, validation, evaluate) copies."""
        return self._core.phases.template

    # The step options compile set, stored once, in the stepper (read-only here).
    @property
    def precision(self) -> str:
        """The compiled precision, ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``."""
        stepper = self._core.stepper
        return "32" if stepper is None else stepper.precision

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (1 before ``compile``)."""
        stepper = self._core.stepper
        return 1 if stepper is None else stepper.accumulation

    @property
    def clip_grad_norm(self) -> float | None:
        """The compiled max global gradient 2-norm, or ``None``."""
        stepper = self._core.stepper
        return None if stepper is None else stepper.clip_grad_norm

    @property
    def clip_grad_value(self) -> float | None:
        """The compiled max absolute gradient element, or ``None``."""
        stepper = self._core.stepper
        return None if stepper is None else stepper.clip_grad_value

    @property
    def scheduler_interval(self) -> str:
        """When a torch scheduler steps, ``"epoch"`` or ``"step"``."""
        stepper = self._core.stepper
        return "epoch" if stepper is None else stepper.scheduling.interval

    # -- the public vocabulary of callbacks and overrides ------------------------------------
    @property
    def global_step(self) -> int:
        """Optimizer steps taken (read-only; a vetoed or skipped step does not count)."""
        stepper = self._core.stepper
        return 0 if stepper is None else stepper.global_step

    @property
    def epoch(self) -> int:
        """The running epoch of ``fit`` (0-based; after fit, the last one run; read-only)."""
        loop = self._core.fit
        return self._core.last_epoch if loop is None else loop.epoch

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
        loop = self._core.fit
        return self._core.last_validated if loop is None else bool(loop.validated)

    @property
    def closes_accumulation_window(self) -> bool:
        """Whether the current micro-batch is the last of its accumulation window (it steps).

        Always ``True`` without gradient accumulation. Callbacks that write full checkpoints
        wait for it: inside a window the accumulated gradients are in no file.
        """
        stepper = self._core.stepper
        return True if stepper is None else stepper.window.micro_last

    @property
    def step_loss(self) -> torch.Tensor | None:
        """The loss of the coming optimizer step, detached, on the device (in ``on_backward_end``).

        With gradient accumulation it is the whole window's loss (each micro-batch weighted by
        its share), so a NaN in any micro-batch shows. Reading its value syncs with the device.
        """
        stepper = self._core.stepper
        loss = None if stepper is None else stepper.window.loss
        return None if loss is None else loss.detach()

    @property
    def callbacks(self) -> list[Callback]:
        """The callbacks of the running ``fit``, in call order (History and the bar last).

        Empty outside ``fit``. A callback may look for another one here (``MLflowLogger``
        finds the ``ModelCheckpoint`` whose best file it logs).
        """
        loop = self._core.fit
        return list(loop.callbacks.callbacks) if loop is not None and loop.running else []

    @property
    def train_batch(self) -> Any:
        """The batch ``(x, y, sample_weight)`` of the running training step, on the device.

        ``None`` outside ``fit``; read it in the batch hooks (``ThroughputMonitor`` counts its rows).
        """
        loop = self._core.running_fit()
        return None if loop is None else loop.batch

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The global gradient 2-norm of the last step, before clipping (``clip_grad_norm`` only)."""
        stepper = self._core.stepper
        return None if stepper is None else stepper.grad_norm

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The ``GradScaler`` of ``precision="16-mixed"`` (``None`` otherwise; read-only)."""
        stepper = self._core.stepper
        return None if stepper is None else stepper.scaler

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
        if self._core.stepper is not None:
            self._core.stepper.skip(when)

    # -- the module ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module: the training forward (DDP / compiled) once compiled, else the module."""
        return self._core.training_forward.run(*args, **kwargs)

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
        self._core.phases.to(self.device)
        self._core.new_forward(self.module, self._core.training_forward.jit)
        return self

    # -- compile ---------------------------------------------------------------------------
    @known_keywords
    @declared(_options.COMPILE)
    def compile(
        self,
        optimizer: object = "adam",
        loss: object = None,
        metrics: object = None,
        *,
        loss_weights: object = None,
        scheduler: object = None,
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
        loss_scale: bool = True,
        micro_batch_size: int | None = None,
        shift_labels: bool | None = None,
    ) -> None:
        """Set the optimizer, loss, metrics and step options. Checks everything first.

        Args:
            optimizer: a name (``"adam"``, ``"adamw"``, ``"sgd"``, ...; torch's defaults), an
                ``Optimizer`` on ``model.module.parameters()``, or a factory ``params -> Optimizer``
                (timm's ``create_optimizer_v2`` result works as an ``Optimizer``).
            loss: a name (``"mse"``, ``"cross_entropy"``, ...), an ``nn.Module`` or a callable,
                called as ``loss(y_pred, y_true)``; ``None`` when the module returns its own
                loss (a ``ModelOutput`` or dict with ``"loss"``, as Hugging Face models do).
                A callable may return a dict or tuple of 0-dim terms: the total trains, each
                term logs as ``loss_<name>`` (:mod:`fitkit.losses.terms`).
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
                ``GradientAccumulationScheduler`` (see :mod:`fitkit.callbacks.accumulation`).
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
            loss_scale: under ``precision="16-mixed"``, scale the loss with a ``GradScaler``
                (the default). ``False`` (Keras' ``auto_scale_loss=False``): fp16 autocast with a
                plain backward and step, no scaler, no step skipped for an inf gradient (for a
                model whose gradients fit fp16's range, or that scales its loss itself); no
                effect under other precisions.
            micro_batch_size: run each training batch's forward and backward in chunks of at
                most this many rows (Composer's ``device_train_microbatch_size``), accumulated
                so the step's gradient is the unsplit batch's (by rows, sample weights or
                tokens); batches, steps and callbacks still count whole batches. ``None``: whole
                batches (see :mod:`fitkit.training.micro_batches`).
            shift_labels: a compiled loss on a dict batch's labels scores the output at position ``t``
                against label ``t + 1`` (``True``, a causal LM, as its own loss shifts them; the last
                position is ignored), or against label ``t`` (``False``). ``None``: as the model's own
                loss does (a Transformers causal LM shifts), else ``False``, and a batch whose labels
                repeat its ``input_ids`` on a module fitkit does not know is refused before step 1.

        Raises:
            ValueError: unknown names (the message lists valid ones), bad values.
            TypeError: wrong types.
        """
        done = compile_model(self, optimizer, loss, metrics, _keywords(locals(), "optimizer", "loss", "metrics"))
        self.loss, self.compiled_ema, self.label_names = done.loss, done.ema, done.label_names
        self._core.install(self.module, done.stepper, done.metrics, done.jit)

    # -- fit -------------------------------------------------------------------------------
    @known_keywords
    @declared(_options.FIT)
    def fit(
        self,
        x: object = None,
        y: object = None,
        *,
        batch_size: int | None = None,
        epochs: int | float | None = None,
        verbose: int | str = "auto",
        callbacks: list[Callback] | None = None,
        validation_split: float = 0.0,
        validation_data: object = None,
        shuffle: bool | str = True,
        class_weight: Mapping[int, float] | None = None,
        sample_weight: object = None,
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
        max_time: object = None,
        resume: str | None = None,
        max_samples: int | None = None,
        max_tokens: int | None = None,
        # quick runs (Lightning's names; fitkit.training.quick)
        fast_dev_run: bool | int = False,
        overfit_batches: int | float = 0,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        num_sanity_val_steps: int = 0,
        reset_time: bool = False,
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
                ``"batch"`` (Keras): in-memory data only, the order of chunks of ``batch_size``
                consecutive rows is shuffled, each chunk kept whole (a short last one last).
            class_weight: ``{class_index: weight}``, folded into the sample weights.
            sample_weight: ``(N,)`` weights for in-memory ``x`` or a Dataset.
            initial_epoch: the epoch to start at (resume).
            steps_per_epoch: batches per epoch (Keras 3): the data iterator then carries over
                across epochs; an epoch ends early (one warning) when the data runs out, and the
                next starts a fresh pass (10 batches with ``steps_per_epoch=9``: 9, 1, 9, 1, ...).
                Needed for an endless source (``itertools.cycle``: refused without it, or without
                ``max_steps`` / ``max_samples`` / ``max_time`` to end the run; a generator is run
                one pass, and with ``epochs`` > 1 the fit stops after it with a warning, as in
                Keras). Callbacks find the batches each epoch really runs
                in ``params["steps"]``. A checkpoint keeps the running pass: a resume continues
                it in the same shuffled order.
            validation_steps: batches per validation. Needed for an endless source (refused
                without it), and for a generator validated in more than one epoch (refused
                without it: its one pass would serve the first validation only).
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
                steps, then run after the next step on all), or a
                :class:`~fitkit.training.budget.RunFraction` ``(f)``: after the steps at each
                fraction ``f`` of the run's planned steps (Composer's ``eval_interval="0.25dur"``).
                Validations then run only there; each is
                recorded in ``history.validations`` with its ``step`` and fires
                ``on_validation_end``; the training stream (totals, data order, RNG) is that
                of a fit without them. Not with ``validation_freq``. See
                :mod:`fitkit.training.step_validation`.
            validate_at_end: with ``validation_interval``, also validate at the run's last
                optimizer step when it is not a multiple of the interval (an epoch bound or
                ``max_steps`` reached between validations), so the final weights are scored,
                as the Trainer's end-of-training evaluation does; not after an early stop.
                ``ValueError`` without ``validation_interval``.
            min_epochs, min_steps: no stop before this many epochs (counted from epoch 0, as
                ``epochs``) and optimizer steps (``global_step``) are done (Lightning's Trainer
                flags): a stop requested earlier (``EarlyStopping``, ``model.stop_training``) is
                dropped and training goes on, so the callback decides again later. A signal
                (SIGTERM) and ``max_steps`` still stop. ``ValueError`` above ``epochs`` /
                ``max_steps``. Every stop, whatever its source (these holds, ``max_steps``,
                ``max_time``, ``EarlyStopping``, ``model.stop_training`` set at any hook, a
                signal), finishes the open accumulation window: its step applies the window's
                gradient and the epoch loss holds its loss (Lightning's and the Trainer's rule).
            max_time: a training time budget (Lightning's ``Trainer(max_time=...)``): seconds,
                a ``datetime.timedelta``, a dict of its keywords or ``"DD:HH:MM:SS"``. Adds a
                :class:`~fitkit.callbacks.Timer` with that duration (checked after each
                optimizer step; its elapsed time is in checkpoints, so a resumed run counts the
                time already spent; under torchrun the ranks stop at one agreed step).
                ``ValueError`` with a ``Timer`` in the callbacks already.
            max_samples: a budget in samples (over all ranks; Composer's ``max_duration="Nsp"``):
                training ends with the optimizer step whose accumulation window brings the samples
                trained on, counted from epoch 0, to ``max_samples`` or more (a window is never
                cut). ``epochs=None`` then runs until it is spent. Turned into ``max_steps`` before
                step 1 (the smaller budget wins), so it fills a scheduler's ``total_steps`` and
                resumes exactly; needs batch sizes known before the fit (see
                :func:`fitkit.training.budget.sample_budget`).
            max_tokens: a budget in tokens (Composer's ``max_duration="Ntok"``), counted as
                :class:`~fitkit.callbacks.TokensSeen` counts them (``B * T`` of the integer input,
                padding and ``-100`` labels included, over all ranks), with ``max_samples``' rule;
                needs in-memory tensors (else a ``ValueError`` before step 1); not with
                ``max_samples``. See :mod:`fitkit.training.token_budget`.
            resume: ``None``: a loaded checkpoint (or ``BackupAndRestore``'s backup) continues where
                it was taken; one taken inside an epoch needs the training set it was taken on (its
                length, and a ``datasets.Dataset``'s fingerprint, are in the checkpoint): another
                is a ``ValueError`` before step 1. ``"restart_epoch"``: such a checkpoint starts its
                epoch over (see :mod:`fitkit.training.resume`).
            fast_dev_run: a smoke test before a long job (Lightning's flag): ``True`` (1) or an
                int ``n`` runs ``n`` training batches and then one validation of ``n`` batches,
                in one epoch (``initial_epoch``), whatever ``epochs``, ``max_steps``,
                ``validation_freq`` and ``validation_interval`` say; no sanity check. The
                callbacks that write files or tune (``skip_in_fast_dev_run``: ModelCheckpoint,
                BackupAndRestore, CSVLogger, TensorBoard, MLflowLogger, Profiler,
                OptunaPruning, RayReport, LearningRateFinder) are left out, so no file is
                written. The weights do train on those batches (the batch size search is no
                callback: :meth:`find_batch_size` runs before ``fit``).
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
                states, the loaders' own generators, BatchNorm statistics, modes and metrics
                are left as they were. A one-shot source (a generator) is teed: the batches
                checked are validated again; ``-1`` checks ``validation_steps`` batches where
                given, and with a one-shot source that has no ``len()`` and no
                ``validation_steps`` is a ``ValueError``. Default 0 (Lightning's is 2; Keras has none). See
                :mod:`fitkit.training.quick`.
            reset_time: start a fresh run on a trained model (Composer's ``reset_time``):
                ``global_step`` restarts at 0, so ``max_steps``, ``params["total_steps"]`` and
                every step count (a ``save_freq`` fraction, ``validation_interval``) count from
                this fit's first step, and a ``total_steps`` scheduler factory is built again
                for it; weights and optimizer state are kept. Without it, a second ``fit``
                trains ``range(initial_epoch, epochs)`` again (Keras) while ``max_steps`` counts
                the steps taken in every fit (Lightning). See :func:`fitkit.training.budget.fresh_run`.

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
        plan = prepare_fit(self, x, y, _keywords(locals(), "x", "y"))
        self.history = History()
        return run_fit(self, plan, self.history)

    # -- evaluate / predict ------------------------------------------------------------------
    @known_keywords
    @declared(_options.EVALUATE)
    def evaluate(
        self,
        x: object = None,
        y: object = None,
        *,
        batch_size: int | None = 32,
        verbose: int | str = "auto",
        sample_weight: object = None,
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
                callback that sets ``model.stop_evaluating``; an ``itertools.cycle`` / ``count``
                / ``repeat`` without it is a ``ValueError``).
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
        return _calls.evaluate(self, x, y, _keywords(locals(), "x", "y"))

    @known_keywords
    @declared(_options.PREDICT)
    def predict(
        self,
        x: object,
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
            steps: predict this many batches only (or set ``model.stop_predicting``); an
                ``itertools.cycle`` / ``count`` / ``repeat`` without it is a ``ValueError``.
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
        return _calls.predict(self, x, _keywords(locals(), "x"))

    # -- single batches ----------------------------------------------------------------------
    def train_on_batch(
        self,
        x: object,
        y: object = None,
        sample_weight: object = None,
        class_weight: Mapping[int, float] | None = None,
        return_dict: bool = True,
    ) -> Any:
        """One optimizer step on one batch; returns that batch's loss and metrics.

        Args:
            x: the batch's inputs ``(B, ...)`` (tensors or numpy arrays, or a tuple / dict).
            y: its targets ``(B, ...)``.
            sample_weight: ``(B,)`` weights for the loss.
            class_weight: ``{class_index: weight}``, folded into the sample weights (Keras).
            return_dict: ``True`` (fitkit's default, kept from its first release): the dict;
                ``False``: Keras' forms, the loss alone (a float) without metrics, else the list
                ``[loss, *metrics]`` (Keras 3's default is ``False``).

        Returns:
            ``{"loss": float, <metric>: float, ...}`` for this batch alone (see ``return_dict``).

        Raises:
            RuntimeError: ``compile`` was not called.
            TypeError: ``return_dict`` is not a bool (before the step).
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
        return _calls.train_on_batch(self, x, y, sample_weight, class_weight, return_dict)

    def test_on_batch(self, x: object, y: object = None, sample_weight: object = None, return_dict: bool = True) -> Any:
        """Loss and metrics of one batch in eval mode, without training.

        Args:
            x: the batch's inputs ``(B, ...)``.
            y: its targets ``(B, ...)``.
            sample_weight: ``(B,)`` weights for the loss.
            return_dict: as in :meth:`train_on_batch` (``False``: a float or ``[loss, *metrics]``).

        Returns:
            ``{"loss": float, <metric>: float, ...}`` for this batch.

        Raises:
            RuntimeError: ``compile`` was not called.
            TypeError: ``return_dict`` is not a bool.

        Example:
            >>> model = Model(nn.Linear(1, 1, bias=False), device="cpu")
            >>> _ = nn.init.zeros_(model.module.weight)
            >>> model.compile(loss="mse")
            >>> model.test_on_batch(torch.ones(2, 1), torch.full((2, 1), 3.0))
            {'loss': 9.0}
            >>> model.test_on_batch(torch.ones(2, 1), torch.full((2, 1), 3.0), return_dict=False)  # Keras' scalar
            9.0
        """
        return _calls.test_on_batch(self, x, y, sample_weight, return_dict)

    def predict_on_batch(self, x: object) -> Any:
        """The module's output for one batch in eval mode under ``no_grad``, on the CPU.

        Args:
            x: the batch's inputs ``(B, ...)``.

        Returns:
            The module's output structure for the batch.

        Example:
            >>> Model(nn.Linear(3, 2), device="cpu").predict_on_batch(torch.zeros(4, 3)).shape
            torch.Size([4, 2])
        """
        return _calls.predict_on_batch(self, x)

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

    compute_loss = _steps.compute_loss

    train_step = _steps.train_step

    test_step = _steps.test_step

    predict_step = _steps.predict_step

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
        stepper = self._core.stepper or self._core.require_compiled("backward")
        if loss.requires_grad:
            stepper.backward(loss)

    def optimizer_step(self) -> bool:
        """Step the optimizer if this micro-batch closes its accumulation window.

        Runs ``on_backward_end`` (gradients unscaled), the skip decision, clipping, the
        GradScaler and a per-step scheduler. Returns whether the weights changed.
        """
        stepper = self._core.stepper or self._core.require_compiled("optimizer_step")
        return stepper.step(self.module)

    update_metrics = _steps.update_metrics


def _keywords(arguments: dict[str, Any], *positional: str) -> dict[str, Any]:
    """A verb's keyword arguments by name, from its ``locals()`` (less ``self`` and ``positional``)."""
    return {k: v for k, v in arguments.items() if k != "self" and k not in positional}
