"""The ``Model``: compile, fit, evaluate, predict around any ``nn.Module``.

The data flow, in the order a batch meets it::

    fit(x, y) -> as_loader(...) -> DeviceLoader.__iter__  (the only place a batch moves)
              -> _run_epoch -> train_step(batch) -> CallbackList.on_train_batch_end -> History
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fitkit import compile as _compile
from fitkit import data as _data
from fitkit import distributed as _distributed
from fitkit.callbacks.base import Callback, CallbackList, History
from fitkit.callbacks.progress import resolve_verbose
from fitkit.checkpoint import CheckpointMixin
from fitkit.devices import PRECISIONS, move_to_device, optimizer_to, resolve_device
from fitkit.evaluation import (
    EvaluationMixin,
    _check_callbacks,
    _check_int,
)
from fitkit.loop import FitLoopMixin, validation_epochs
from fitkit.losses import MultiLoss, resolve_loss
from fitkit.metrics import MetricSet
from fitkit.optim import resolve_optimizer, resolve_scheduler
from fitkit.summary import summary_table
from fitkit.training import StepMixin

__all__ = ["Model"]


class Model(FitLoopMixin, StepMixin, EvaluationMixin, CheckpointMixin):
    """Keras-style training for any ``nn.Module``.

    Args:
        module: the network. Moved to ``device`` at once.
        device: ``"auto"`` (``FITKIT_DEVICE`` env, else cuda, else mps, else cpu), a device
            string or a ``torch.device``. Under torchrun a bare cuda is ``cuda:LOCAL_RANK``.
        strategy: under torchrun (``WORLD_SIZE`` > 1): ``"auto"`` or ``"ddp"`` wraps the
            module in DDP at ``compile()``, ``"fsdp"`` shards it with FSDP2 ``fully_shard``;
            the process group starts here if needed (see :mod:`fitkit.distributed`). On one
            process every strategy trains plainly, so the same script runs both ways.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``strategy`` not a string.
        ValueError: an unknown ``strategy``.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> x = torch.linspace(-1, 1, 64).unsqueeze(1)
        >>> y = 3 * x + 2
        >>> model = Model(nn.Linear(1, 1), device="cpu")
        >>> model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss="mse")
        >>> history = model.fit(x, y, epochs=20, batch_size=16, verbose=0)
        >>> [round(v, 2) for v in (model.module.weight.item(), model.module.bias.item())]
        [3.0, 2.0]
    """

    def __init__(self, module: nn.Module, *, device: str | torch.device = "auto", strategy: str = "auto"):
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"Expected `module` to be a torch.nn.Module. Received: {type(module).__name__}. "
                "Fix: wrap your network, e.g. fitkit.Model(nn.Sequential(...))."
            )
        _distributed.check_strategy(strategy)
        self.device = resolve_device(device)
        _distributed.init_if_needed(self.device)  # under torchrun: nccl on CUDA, gloo on CPU
        self.module = module.to(self.device)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.loss = None
        self.metrics = MetricSet()
        self.stop_training = False
        self.history: History | None = None
        self._compiled = False
        self._callbacks = CallbackList([], self, {})
        self._global_step = 0
        self._init_step_state()
        self.strategy = strategy
        self._parallel = _distributed.Parallel(strategy, self.device) if _distributed.is_distributed() else None

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (read-only; a skipped step does not count)."""
        return self._global_step

    @property
    def epoch(self) -> int:
        """The running epoch (0-based; read-only)."""
        return self._epoch

    # -- the module ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

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
        self.metrics.to(self.device)
        self._forward_module = None if self._forward_module is None else self._wrap_forward()
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
            RuntimeError: keys that do not match (with ``strict=True``) or tensors of the
                wrong shape.

        Example:
            >>> a, b = Model(nn.Linear(2, 1), device="cpu"), Model(nn.Linear(2, 1), device="cpu")
            >>> b.load_state_dict(a.state_dict())
            <All keys matched successfully>
        """
        if self._parallel is not None:
            return self._parallel.load_state_dict(self.module, state_dict, strict=strict)
        return self.module.load_state_dict(state_dict, strict=strict)

    # -- compile ---------------------------------------------------------------------------
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
        gradient_accumulation_steps: int = 1,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        jit_compile: bool | str | dict = "auto",
    ) -> None:
        """Set the optimizer, loss, metrics and step options. Checks everything first.

        Args:
            optimizer: a name (``"adam"``, ``"adamw"``, ``"sgd"``, ...; torch's defaults), an
                ``Optimizer`` on ``model.module.parameters()``, or a factory ``params -> Optimizer``.
            loss: a name (``"mse"``, ``"cross_entropy"``, ...), an ``nn.Module`` or a callable,
                called as ``loss(y_pred, y_true)``.
            metrics: names, ``torchmetrics.Metric`` objects or ``{log_name: metric}``.
            loss_weights: for a module with several outputs and as many losses: one weight per
                loss (``loss`` is then a list or dict like the outputs).
            scheduler: a ``torch.optim.lr_scheduler`` object or a factory ``optimizer ->
                scheduler``.
            scheduler_interval: ``"epoch"`` or ``"step"`` (per optimizer step).
            precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"`` (with a GradScaler).
            gradient_accumulation_steps: micro-batches per optimizer step (sample-exact).
            clip_grad_norm: clip the global gradient 2-norm to this value before each step.
            clip_grad_value: clip each gradient element to ``[-v, v]`` before each step.
            jit_compile: ``"auto"`` (torch.compile on CUDA only), True, False, or a dict of
                ``torch.compile`` kwargs.

        Raises:
            ValueError: unknown names (the message lists valid ones), bad values.
            TypeError: wrong types.
        """
        if precision not in PRECISIONS:
            raise ValueError(f"Unknown precision {precision!r}. Valid values: {', '.join(PRECISIONS)}.")
        _check_int("gradient_accumulation_steps", gradient_accumulation_steps, 1)
        for name, v in (("clip_grad_norm", clip_grad_norm), ("clip_grad_value", clip_grad_value)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"Expected `{name}` to be a positive number or None. Received: {name}={v!r}.")
        jit = _compile.resolve_jit_compile(jit_compile, self.device)
        loss_fn = resolve_loss(loss) if loss_weights is None else _multi_loss(loss, loss_weights)
        metric_set = MetricSet(metrics)
        if self._parallel is not None:
            self._parallel.prepare(self.module, optimizer)  # FSDP shards before the optimizer exists
        opt = resolve_optimizer(optimizer, self.module, self.device)
        sched = resolve_scheduler(scheduler, opt, scheduler_interval)
        if precision == "16-mixed" and self.device.type not in ("cuda", "cpu", "mps"):
            raise ValueError(f"precision='16-mixed' is not supported on {self.device.type}.")
        # Everything is valid: only now does the model change.
        self.optimizer, self.scheduler, self.scheduler_interval = opt, sched, scheduler_interval
        self.loss = loss_fn
        self.metrics = metric_set
        self.metrics.loss_kind = getattr(loss_fn, "kind", None)
        self.metrics._loss_name = getattr(loss_fn, "name", "")
        self.metrics.device = self.device
        self.precision = precision
        self.gradient_accumulation_steps = int(gradient_accumulation_steps)
        self.clip_grad_norm, self.clip_grad_value = clip_grad_norm, clip_grad_value
        self._scaler = torch.amp.GradScaler(self.device.type) if precision == "16-mixed" else None
        self._jit = jit
        self._forward_module = self._wrap_forward()
        self._watch_optimizer_steps()
        self._compiled = True

    def _require_compiled(self, verb: str) -> None:
        if not self._compiled:
            raise RuntimeError(
                f"`{verb}` needs a compiled model. Call `model.compile(optimizer=..., loss=...)` "
                f"before `model.{verb}(...)`."
            )

    # -- fit -------------------------------------------------------------------------------
    def fit(
        self,
        x: Any = None,
        y: Any = None,
        *,
        batch_size: int | None = 32,
        epochs: int = 1,
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
                batches ``x``, ``(x, y)`` or ``(x, y, sample_weight)``.
            y: targets ``(N, ...)`` for in-memory ``x``; ``None`` for the other kinds.
            batch_size: samples per batch (in-memory ``x`` and Datasets); per process under
                torchrun.
            epochs: index of the last epoch (not a count; see above).
            verbose: 0 silent, 1 progress bar, 2 one line per epoch, ``"auto"``: 1 on a
                terminal or notebook, else 2.
            callbacks: :class:`~fitkit.callbacks.Callback` objects, called in list order
                (History and the progress bar last).
            validation_split: fraction in ``[0, 1)`` taken from the end of the arrays before
                shuffling (arrays, tensors and Datasets only).
            validation_data: ``(x_val, y_val)``, ``(x_val, y_val, sample_weight)``, a Dataset,
                a DataLoader or an iterable; its logs get a ``val_`` prefix.
            shuffle: reshuffle in-memory data and Datasets every epoch (one ``randperm``).
            class_weight: ``{class_index: weight}``, folded into the sample weights.
            sample_weight: ``(N,)`` weights for in-memory ``x`` or a Dataset.
            initial_epoch: the epoch to start at (resume).
            steps_per_epoch: batches per epoch; needed for infinite iterables.
            validation_steps: batches per validation.
            validation_batch_size: default ``batch_size``.
            validation_freq: validate every n epochs, or at the listed (1-based) epochs.

        Returns:
            The :class:`~fitkit.History`: ``history.history[key]`` is a list of floats per
            epoch (``loss``, metrics, ``learning_rate``, ``val_*``).

        Raises:
            RuntimeError: ``compile`` was not called.
            TypeError: an argument of the wrong type.
            ValueError: a bad value or data (lengths, shapes, labels), raised before the first
                step for in-memory data, so the weights are left as they were.

        Example:
            >>> _ = torch.manual_seed(0)
            >>> model = Model(nn.Linear(2, 1), device="cpu")
            >>> model.compile(optimizer="sgd", loss="mse")
            >>> history = model.fit(torch.zeros(10, 2), torch.ones(10, 1), epochs=3,
            ...                     batch_size=5, verbose=0)
            >>> history.epoch, sorted(history.history)
            ([0, 1, 2], ['learning_rate', 'loss'])
        """
        self._require_compiled("fit")
        batch_size = 32 if batch_size is None else batch_size
        _check_int("batch_size", batch_size, 1)
        _check_int("epochs", epochs, 0)
        _check_int("initial_epoch", initial_epoch, 0)
        _check_int("steps_per_epoch", steps_per_epoch, 1, allow_none=True)
        _check_int("validation_steps", validation_steps, 1, allow_none=True)
        _check_int("validation_batch_size", validation_batch_size, 1, allow_none=True)
        if not isinstance(shuffle, bool):
            raise TypeError(f"Expected `shuffle` to be a bool. Received: shuffle={shuffle!r}.")
        if isinstance(validation_split, bool) or not isinstance(validation_split, (int, float)) or not 0 <= validation_split < 1:
            raise ValueError(f"Expected `validation_split` in [0, 1). Received: validation_split={validation_split!r}.")
        val_epochs = validation_epochs(validation_freq)
        verbose = resolve_verbose(verbose)
        callbacks = _check_callbacks(callbacks)
        if x is None:
            raise ValueError("`fit` needs data. Received x=None. Fix: pass tensors, a Dataset or a DataLoader.")
        if validation_split:
            if validation_data is not None:
                warnings.warn("`validation_data` is given, so `validation_split` is ignored.", stacklevel=2)
            else:
                (x, y, sample_weight), validation_data = _data.split_validation(x, y, sample_weight, validation_split)
        train = _data.as_loader(
            x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
            class_weight=class_weight, steps=steps_per_epoch, device=self.device,
        )  # fmt: skip
        val = None
        if validation_data is not None:
            val = _data.validation_loader(
                validation_data, batch_size=validation_batch_size or batch_size, device=self.device
            )
        self._preflight(train)
        if val is not None:
            self._preflight(val)
        cbs = self._make_callbacks(callbacks, verbose, epochs, train.num_batches)
        self._fit_loop(train, (val, val_epochs, validation_steps), cbs, initial_epoch, epochs)
        return self.history

    # -- helpers ---------------------------------------------------------------------------
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
            example_input = move_to_device(example_input, self.device)
        else:
            example_input = self._example_x  # the first batch of the last in-memory data
        return summary_table(self.module, print_fn, example_input)

    # -- export (issue 13) -----------------------------------------------------------------
    def export(self, path: str | os.PathLike, example_input: Any, format: str = "torch",
               dynamic_batch: bool = True) -> Path:
        """Export the module for serving: a ``torch.export`` program (``.pt2``) or ONNX.

        See :func:`fitkit.export.export`: traced once in eval mode under ``no_grad`` (flags
        restored), with dimension 0 of the inputs symbolic when ``dynamic_batch``.

        Args:
            path: the file to write.
            example_input: one input batch (tensor, tuple or dict, as ``fit`` passes ``x``);
                moved to ``model.device``.
            format: ``"torch"`` (``torch.export.save``) or ``"onnx"`` (``torch.onnx.export``,
                needs ``pip install fitkit[onnx]``).
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
        from fitkit.export import export

        return export(self.module, path, move_to_device(example_input, self.device), format=format,
                      dynamic_batch=dynamic_batch)  # fmt: skip


def _multi_loss(loss: Any, loss_weights: Any):
    if not isinstance(loss, (list, tuple, Mapping)):
        raise TypeError(
            "`loss_weights` needs one loss per output: pass `loss` as a list or dict. "
            f"Received: loss={loss!r}."
        )
    return MultiLoss(loss, loss_weights)
