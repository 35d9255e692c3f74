"""Checks before the first step: in-memory data, and the first batch through module and loss.

For in-memory data the whole plan is known before step 1, so everything that would fail later
fails here, with nothing changed: non-finite values, floating inputs in another dtype than the
module's (cast, as Keras casts to its float type), a one-row last batch that BatchNorm cannot
train on (dropped with one warning), and the first batch run through the module, the loss and
the metrics. That run uses the module itself in eval mode under ``no_grad``, never the compiled
forward, so it costs no compilation of its own.

Every check that runs the module (or iterates a loader) leaves no trace (:func:`leaves_no_trace`):
the RNGs it drew from and the buffers it moved are put back, so a fit with the checks trains
exactly as one without them, and a resumed fit, which checks again, as the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.weak import WeakIdKeyDictionary

from fitkit import nest
from fitkit.checks import FitkitWarning
from fitkit.checks.gradient import check_loss_has_grad, wants_grad_check
from fitkit.compile import call
from fitkit.data import TensorBatches, device_batch
from fitkit.data import order as _order
from fitkit.devices import accelerator_rng_state, set_accelerator_rng_state
from fitkit.losses.labels import check_label_keys, decide_shift
from fitkit.losses.outputs import module_inputs, own_loss, prediction_of, require_prediction, targets_of
from fitkit.modes import modes
from fitkit.training.finite import check_batch_loss, check_in_memory

if TYPE_CHECKING:
    from fitkit.model import Model
    from fitkit.training.stepper import Stepper

__all__ = [
    "prepare_in_memory",
    "cast_to_module",
    "first_batch_check",
    "wrap",
    "describe",
    "has_training_batchnorm",
    "BatchGuard",
    "leaves_no_trace",
]


@contextlib.contextmanager
def leaves_no_trace(module: nn.Module, loader: Any = None) -> Iterator[None]:
    """Run a check as if it had not run: what it drew from the RNGs and moved in ``module``'s
    buffers is put back on exit, also when it raises.

    The RNGs: Python's ``random``, NumPy's global one, torch's CPU generator, the accelerators'
    (:func:`fitkit.devices.accelerator_rng_state`) and, when the check iterates ``loader`` (a
    :class:`~fitkit.data.DeviceLoader`), its DataLoader's and samplers' own generators and
    states (:func:`fitkit.data.order.capture`). A module that draws noise in eval mode would
    otherwise shift every later draw by the check's, and a resumed fit, which checks again
    after the RNG states were restored, would not continue the interrupted one. The buffers:
    each one's values (BatchNorm's statistics, a module's own counters or caches), and the
    tensor itself where the check replaced it (``self.count = self.count + 1``). They are
    copied once per check: a fit's start, not its steps.

    Example:
        >>> class Noisy(nn.Module):
        ...     def forward(self, x):
        ...         return x + torch.randn_like(x)
        >>> _ = torch.manual_seed(0)
        >>> with leaves_no_trace(Noisy()):
        ...     _ = Noisy()(torch.zeros(3))
        >>> a = torch.rand(1); _ = torch.manual_seed(0); bool(torch.rand(1) == a)
        True
    """
    rngs = random.getstate(), np.random.get_state(), torch.get_rng_state(), accelerator_rng_state()
    order = _order.capture(loader) if loader is not None else None
    # A lazy module's uninitialized buffer has no values yet (the check's forward initializes it,
    # as the first step would).
    buffers = [
        (m, name, b, _version(b), b.detach().clone())
        for m in module.modules()
        for name, b in m._buffers.items()
        if b is not None and not is_lazy(b)
    ]
    try:
        yield
    finally:
        py, np_state, cpu, accelerators = rngs
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        set_accelerator_rng_state(accelerators)
        if order is not None:
            _order.restore(loader, order)
        with torch.no_grad():
            for m, name, b, version, saved in buffers:
                m._buffers[name] = b  # the check may have replaced it (`self.n = self.n + 1`)
                if _version(b) != version:  # changed in place: its values come back
                    b.copy_(saved)


def _version(t: torch.Tensor) -> int | None:
    """``t``'s in-place version counter; ``None`` for an inference tensor, which none can change
    outside inference mode (and which has no counter)."""
    try:
        return t._version
    except RuntimeError:
        return None


def describe(batch: Any) -> str:
    """Shapes and dtypes of a batch's tensors, for error messages.

    Integer tensors also give their value range (token ids and class labels).

    Example:
        >>> describe((torch.zeros(2, 3), torch.tensor([0, 7])))
        'x: float32 (2, 3); y: int64 (2,) values 0..7'
        >>> describe(({"input_ids": torch.zeros(2, 5, dtype=torch.long)}, None, None))
        "x: 'input_ids' int64 (2, 5) values 0..0"
    """
    parts = []
    for name, part in zip(("x", "y", "sample_weight"), batch, strict=False):
        if isinstance(part, Mapping):  # name the entries: {"input_ids": ..., "labels": ...}
            named = [f"{k!r} {_describe_value(v)}" for k, v in part.items()]
            parts.append(f"{name}: " + (", ".join(named) if named else "an empty dict"))
            continue
        if part is not None or name == "x":
            parts.append(f"{name}: {_describe_value(part)}")
    return "; ".join(parts)


def _describe_value(value: Any) -> str:
    """Tensors by dtype and shape; anything else by what it is (``None``, ``list of 5 str``)."""
    ts = nest.leaves(value)
    if ts and (isinstance(value, torch.Tensor) or not _odd_leaves(value)):
        return ", ".join(_describe_tensor(t) for t in ts)
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)):
        kinds = "/".join(sorted({type(v).__name__ for v in value})) or "items"
        return f"{type(value).__name__} of {len(value)} {kinds}"
    return type(value).__name__


def _odd_leaves(value: Any) -> bool:
    """Whether a nested value holds something besides tensors (None, strings, numbers)."""
    if isinstance(value, Mapping):
        return any(_odd_leaves(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_odd_leaves(v) for v in value)
    return not isinstance(value, torch.Tensor)


def _describe_tensor(t: torch.Tensor) -> str:
    text = f"{str(t.dtype).replace('torch.', '')} {tuple(t.shape)}"
    if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool and t.numel():
        text += f" values {int(t.min())}..{int(t.max())}"
    return text


def _param_dtype(module: nn.Module) -> torch.dtype | None:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def has_training_batchnorm(module: nn.Module) -> bool:
    """Whether a BatchNorm layer would train (it needs more than one value per channel)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in module.modules())


def prepare_in_memory(source: TensorBatches, module: nn.Module, training: bool, model: Model | None = None) -> None:
    """Check and adapt in-memory data before any step (nothing else changes on an error).

    NaN / inf values are looked for without copying the data; in ``x`` / ``y`` they are refused
    only where the ``model``'s loss (or gradient) on those rows is not finite (see
    :mod:`fitkit.training.finite`; without a model, always).

    Raises:
        ValueError: NaN / inf in ``sample_weight``, or in ``x`` / ``y`` that the loss does not
            handle, a negative weight, or training batches of one row each for a module with
            BatchNorm.
    """
    if source.w is not None and source.w.numel() and bool((source.w < 0).any()):
        first = int((source.w < 0).nonzero()[0, 0])
        raise ValueError(
            f"`sample_weight` must be >= 0. Received a negative weight at index {first} "
            f"({float(source.w[first])}). Fix: weights scale each sample's loss; use 0 to ignore one."
        )
    cast_to_module(source, module)
    check_in_memory(model, source, training)
    batchnorm = training and has_training_batchnorm(module)
    if batchnorm and (source.batch_size == 1 or source.n == 1):
        raise ValueError(
            f"BatchNorm cannot train on one row, and every training batch here has one row ({source.n} "
            f"samples, batch_size={source.batch_size}). Fix: use batch_size >= 2 with at least 2 samples, "
            "or put the BatchNorm layers in eval mode before fit."
        )
    if batchnorm and source.n % source.batch_size == 1:
        source.drop_single_tail()
        warnings.warn(
            f"{source.n} training samples with batch_size={source.batch_size} leave a last batch of "
            "one row, which BatchNorm cannot train on; that row is left out of each epoch. "
            "Fix: choose a batch_size that does not leave one sample over.",
            category=FitkitWarning,
            stacklevel=4,
        )


def cast_to_module(source: TensorBatches, module: nn.Module) -> None:
    """Floating in-memory ``x`` and ``y`` in the module's parameter dtype (float64 numpy arrays
    into a float32 module, as Keras casts to its float type); other dtypes stay as they are.

    Example:
        >>> tb = TensorBatches(torch.zeros(4, 2, dtype=torch.float64), torch.arange(4), None, 2, False)
        >>> cast_to_module(tb, nn.Linear(2, 1)); tb.x.dtype, tb.y.dtype
        (torch.float32, torch.int64)
    """
    dtype = _param_dtype(module)
    if dtype is None:
        return

    source.cast_floats(dtype)


def _first_batch(source: TensorBatches, device: torch.device) -> tuple[Any, Any, Any]:
    sl = slice(0, min(source.batch_size, source.n))
    # Copies, not views: the batch outlives the check (summary's example), the data must not.
    x, y = nest.map_structure(lambda t: t[sl].clone(), source.x), nest.map_structure(lambda t: t[sl].clone(), source.y)
    w = None if source.w is None else source.w[sl]
    return device_batch(x, y, w, device=device)  # through DeviceLoader, as every batch


def wrap(
    what: str, batch: Any, e: Exception, module: nn.Module | None = None, y_pred: Any = None, label: str = "first batch"
) -> Exception:
    """The error to raise for ``e``, raised by ``what`` on the first batch: what was fed and a fix.

    fitkit's own errors (a ``ValueError`` / ``TypeError`` that names a fix) and out-of-memory
    errors come back as they are; raise the result ``from e`` so that the original is chained.
    """
    if isinstance(e, (ValueError, TypeError)) and "Fix" in str(e) or isinstance(e, torch.OutOfMemoryError):
        return e
    fix = f"make the data's shapes and dtypes match what the {what} expects"
    dtype = _param_dtype(module) if module is not None else None
    floats = [t.dtype for t in nest.leaves(batch[0]) if t.is_floating_point()]
    keys_fix = dict_keys_fix(module, batch[0]) if what == "module's forward" and isinstance(e, TypeError) else None
    if keys_fix is not None:
        fix = keys_fix
    elif what == "module's forward" and dtype is not None and any(d != dtype for d in floats):
        other = str(next(d for d in floats if d != dtype)).replace("torch.", "")
        fix = (
            f"the module's parameters are {str(dtype).replace('torch.', '')} and x is {other}: convert the "
            "inputs (e.g. `x.float()`); fitkit converts in-memory arrays, not the batches of a DataLoader"
        )
    elif what == "loss" and y_pred is not None and not isinstance(y_pred, torch.Tensor):
        kind = f"a dict with keys {list(y_pred)}" if isinstance(y_pred, dict) else f"a {type(y_pred).__name__}"
        fix = (
            f"the module returns {kind} and the compiled loss takes a tensor: return one tensor, return "
            'a dict with a "loss" entry and compile(loss=None), or override compute_loss'
        )
    return ValueError(
        f"The {label} failed in the {what}: {type(e).__name__}: {str(e).rstrip('.')}. It was fed "
        f"{describe(batch)}. Fix: {fix} (the original error is chained below)."
    )


def dict_keys_fix(module: Any, x: Any) -> str | None:
    """Why a dict batch does not fit ``module.forward(**x)``, as a fix; ``None`` when its keys fit.

    The rule: a key that names none of forward's parameters is refused, unless forward takes
    ``**kwargs`` (most Transformers models do): then every key is passed on, and the model uses it
    or ignores it. ``labels`` is never to be dropped: it is the loss's target.

    Example:
        >>> class Net(nn.Module):
        ...     def forward(self, input_ids, attention_mask=None):
        ...         return input_ids
        >>> dict_keys_fix(Net(), {"input_ids": 0, "attention_mask": 1}) is None
        True
        >>> print(dict_keys_fix(Net(), {"input_ids": 0, "text": "a"}).split("; ")[2].split(". ")[0])
        not taken by forward: ['text']
        >>> class Open(nn.Module):
        ...     def forward(self, input_ids, **kwargs):
        ...         return input_ids
        >>> dict_keys_fix(Open(), {"input_ids": 0, "text": "a"}) is None  # passed on in **kwargs
        True
    """
    if not isinstance(x, Mapping) or module is None:
        return None
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    params = sig.parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in params) and not [p for p in params if p.kind is not p.VAR_POSITIONAL]:
        return None
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    extra = [] if any(p.kind is p.VAR_KEYWORD for p in params) else [k for k in x if k not in named]
    missing = [
        p.name
        for p in params
        if p.default is p.empty and p.name not in x and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if not extra and not missing:
        return None
    shown = "(" + str(sig)[1:-1].replace("'", "") + ")"
    text = (
        f"a dict batch is passed as `forward(**batch)`, so its keys must be forward's parameters. "
        f"Batch keys: {list(x)}; forward's parameters: {shown}"
    )
    if extra:
        text += f"; not taken by forward: {extra}"
    if missing:
        text += f"; required by forward but not in the batch: {missing}"
    if missing or [k for k in extra if k != "labels"]:
        # Never "drop `labels`": it is the loss's target, which the next sentence keeps.
        text += (
            ". Drop or rename the keys forward does not take"
            + (" (keep `labels`)" if "labels" in extra else "")
            + " (e.g. `Dataset.remove_columns` / `rename_column`, or a `collate_fn`), or add them to forward"
        )
    if "labels" in extra:
        text += (
            ". Keep `labels`, the loss's target: a module without a `labels` parameter needs a compiled loss "
            "(`compile(loss=...)`): the batch's `labels` are then its targets and are not passed to forward"
        )
    return text


def _inputs_and_targets(model: Any, x: Any, y: Any) -> tuple[Any, Any]:
    """The module's inputs and the loss's targets: a dict batch's ``labels`` when a loss is compiled."""
    compiled = model.loss is not None and model.default_compute_loss
    names = model.label_names
    return module_inputs(x, y, compiled, names), targets_of(x, y, names) if compiled else y


def first_batch_check(
    model: Model, batch: tuple[Any, Any, Any], y_all: Any = None, label: str = "first batch", training: bool = True
) -> Any:
    """Run one batch through the module, the loss and the metrics, changing nothing.

    Shape, dtype and class-range errors surface here, named by the call that failed
    (forward, loss, metric) with what was fed; the original error is chained. ``y_all``: all
    in-memory targets (``y``, or ``x["labels"]``), whose class labels are range-checked against
    the module's outputs. ``label``: how the message names the batch. ``training``: the batches
    train, so with ``loss=None`` the output must carry its own loss (evaluation may log metrics
    alone).

    Returns:
        The batch's ``x``: the example input that ``summary`` runs when given none.
    """
    x, y, w = batch
    module = model.module
    check_label_keys(model.label_names, module, x)  # compile(label_names=) that would be ignored
    if not model.default_test_step:
        _check_with_test_step(model, batch, label)
        return x
    # Training batches build the graph once, to see that the loss has a gradient to follow.
    grad = wants_grad_check(model, training)
    inputs, y = _inputs_and_targets(model, x, y)
    with modes(module, training=False, grad=grad), model.autocast():
        try:
            y_pred = call(module, inputs)
        except Exception as e:
            if model.loss is None:
                _check_own_labels(module, x, y_all)  # the module's own loss met a label out of range?
            raise wrap("module's forward", batch, e, module, label=label) from e
        y = _aligned_targets(model, batch, y_pred, y)
        if model.loss is None and model.default_compute_loss:
            _check_without_loss(model, batch, y, y_pred, y_all, label, training, grad)
        if y is None and model.loss is not None and model.default_compute_loss:
            model.compute_loss(x, y, y_pred, w)  # raises: a compiled loss needs targets
        if y is not None and model.loss is not None:
            _check_compiled_loss(model, batch, y, y_pred, y_all, label, grad)
        _check_metrics(model, batch, y, y_pred, label)
    return x


def _check_without_loss(
    model: Model,
    batch: tuple[Any, Any, Any],
    y: Any,
    y_pred: Any,
    y_all: Any,
    label: str,
    training: bool,
    grad: bool,
) -> None:
    """``loss=None``: the output's own loss, or (training) the fix, or (evaluation) something to log."""
    x, _, w = batch
    if own_loss(y_pred) is not None:
        _check_own_loss(model, batch, y_pred, y_all)
    elif training:
        model.compute_loss(x, y, y_pred, w)  # raises: nothing to train on, and the fix
    else:
        _check_something_to_evaluate(model, x, y, y_pred)
    if grad:
        check_loss_has_grad(own_loss(y_pred), label)


def _check_compiled_loss(
    model: Model, batch: tuple[Any, Any, Any], y: Any, y_pred: Any, y_all: Any, label: str, grad: bool
) -> None:
    """The compiled loss on the batch: its dtype / shape / class range, a finite value, a gradient."""
    x, _, w = batch
    module = model.module
    try:
        prepare: Any = getattr(model.loss, "prepare", None)
        pred = prediction_of(y_pred)  # a structured output's prediction (fitkit.losses.outputs)
        if getattr(model.loss, "kind", None) == "class_index" and isinstance(pred, torch.Tensor) and prepare:
            # Before the loss: torch's own out-of-range error names no fix.
            prepare(pred, y)  # dtype / shape errors; sets the class layout
            check_class_range(model.loss, pred, y_all)
        loss = model.compute_loss(x, y, y_pred, w)
    except Exception as e:
        raise wrap("loss", batch, e, module, y_pred, label=label) from e
    check_batch_loss(batch, loss, label)  # NaN in the batch that the loss does not handle
    if grad:
        check_loss_has_grad(loss, label)


def _check_metrics(model: Model, batch: tuple[Any, Any, Any], y: Any, y_pred: Any, label: str) -> None:
    """The compiled metrics built on the batch (once: later batches find them built)."""
    target = targets_of(batch[0], y, model.label_names)
    if model.metrics.entries is None and target is not None:
        pred = require_prediction(y_pred, "the compiled metrics")  # the rule's error names the fix
        try:
            model.metrics.build(pred, target)
        except Exception as e:
            raise wrap("metrics", batch, e, model.module, label=label) from e


def _aligned_targets(model: Model, batch: tuple[Any, Any, Any], y_pred: Any, y: Any) -> Any:
    """The loss's targets once ``compile(shift_labels=None)`` is decided for a module fitkit did not
    know (:func:`fitkit.losses.labels.decide_shift`, from the first batch's output and labels)."""
    names = model.label_names
    if getattr(names, "shift", False) is not None or batch[1] is not None:
        return y
    decide_shift(names, y_pred, batch[0])  # type: ignore[arg-type]
    return _inputs_and_targets(model, batch[0], batch[1])[1]


def _check_own_loss(model: Model, batch: tuple[Any, Any, Any], y_pred: Any, y_all: Any) -> None:
    """A module's own loss: its labels in range, and sample weights only where they reach it."""
    x, y, w = batch
    check_class_range(None, prediction_of(y_pred), y_all)
    if w is not None:  # raises where the weights cannot reach the module's own loss (a 0-dim mean)
        model.compute_loss(x, y, y_pred, w)


def _check_something_to_evaluate(model: Model, x: Any, y: Any, y_pred: Any) -> None:
    """Without a compiled loss and without the output's own loss, only metrics can be logged: refuse
    an evaluation that would log nothing (no metrics, or no targets for them)."""
    if model.metrics.specs and targets_of(x, y, model.label_names) is not None:
        return
    keys = sorted(map(str, y_pred)) if isinstance(y_pred, Mapping) else type(y_pred).__name__
    why = "no metrics are compiled" if not model.metrics.specs else "the batch has no targets for the metrics"
    raise ValueError(
        f"Expected something to evaluate: compile(loss=None) and the module's output holds no 'loss' (output: "
        f"{keys}), and {why}, so evaluation would return no value. Fix: compile a loss "
        "(compile(loss=...)), return {'loss': ...} from forward (pass the labels in the batch), or compile "
        "metrics and give the batches targets."
    )


def _check_own_labels(module: nn.Module, x: Any, y_all: Any) -> None:
    """After a failed forward with ``labels`` in ``x``: name a label out of range if that is why.

    A Hugging Face model computes its loss inside ``forward``, so a bad label fails there with
    torch's ``IndexError``; the forward without ``labels`` tells the number of classes.
    """
    if not isinstance(x, Mapping) or "labels" not in x:
        return
    try:
        out = call(module, {k: v for k, v in x.items() if k != "labels"})
    except Exception:
        return  # the forward fails for another reason: the caller reports it
    check_class_range(None, prediction_of(out), y_all)


def _check_with_test_step(model: Model, batch: tuple[Any, Any, Any], label: str) -> None:
    """An overridden ``test_step`` knows what the module's output means: run it, eagerly."""
    phases = model._core.phases
    totals = phases.new_totals()
    try:
        # The module itself, not the compiled forward: no compilation here.
        plain = model._core.training_forward.plain()
        with modes(model.module, training=False, grad=False), phases.running(totals), plain:
            model.test_step(batch)
    except Exception as e:
        raise wrap("test_step", batch, e, label=label) from e
    phases.adopt(totals)


def check_class_range(loss: Any, y_pred: Any, y_all: Any) -> None:
    """Class labels of in-memory targets must fit the module's outputs (``ValueError``).

    ``loss=None`` stands for the module's own loss (``compile(loss=None)``), read by Hugging
    Face's convention: integer ``labels`` index the last dimension of the logits (one more
    than the labels have), and -100 is ignored. Anything else (float labels, a single output)
    is left to the module.

    Example:
        >>> check_class_range(None, torch.zeros(4, 3), torch.tensor([0, 2, -100, 1]))  # fits
        >>> check_class_range(None, torch.zeros(4, 3), torch.tensor([0, 3, 1, 1]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Class labels must lie in [0, 2] for a module with 3 outputs. Received labels from 0 to 3. ...
    """
    if not isinstance(y_all, torch.Tensor) or not isinstance(y_pred, torch.Tensor):
        return
    if y_all.is_floating_point() or y_all.dtype == torch.bool or y_all.numel() == 0:
        return
    if loss is None:
        if not y_pred.is_floating_point() or y_pred.dim() != y_all.dim() + 1 or y_pred.shape[-1] < 2:
            return
        n_classes, ignore = y_pred.shape[-1], -100
    elif getattr(loss, "kind", None) == "class_index":
        n_classes = y_pred.shape[-1] if loss.class_last else y_pred.shape[1]
        ignore = getattr(loss, "ignore_index", -100)
    else:
        return
    valid = y_all[y_all != ignore] if ignore is not None else y_all
    if valid.numel() == 0:
        return
    lo, hi = int(valid.min()), int(valid.max())
    if lo < 0 or hi >= n_classes:
        raise ValueError(
            f"Class labels must lie in [0, {n_classes - 1}] for a module with {n_classes} "
            f"outputs. Received labels from {lo} to {hi}. Fix: remap the labels, or give the "
            "module one output per class (`num_labels` of a Hugging Face config)."
        )


def in_memory_check(model: Model, source: TensorBatches, training: bool) -> Any:
    """:func:`prepare_in_memory`, then the first batch and the class range of every label.

    A custom ``train_step`` with the default ``test_step`` may read the module's output in a
    way only it knows: its training data gets the data checks, not the first-batch run.

    Returns:
        The first batch's ``x`` (a copy) when it was run, else ``None``.
    """
    with leaves_no_trace(model.module):  # the NaN rows' trial and the first batch run the module
        prepare_in_memory(source, model.module, training, model)
        if source.n == 0 or training and not model.default_train_step and model.default_test_step:
            return None
        signature = _checked_signature(model, source, training)
        seen = _CHECKED.get(model.module, {}).get(training)  # fit's and evaluate's data apart
        if seen is not None and seen[0] == signature:
            return seen[1]  # the same data and model passed this check in an earlier call
        y_all = targets_of(source.x, source.y, model.label_names)
        example = first_batch_check(model, _first_batch(source, model.device), y_all, training=training)
        checked = _CHECKED.setdefault(model.module, {})
        checked[training] = (_checked_signature(model, source, training), example)  # lazy shapes now known
        return example


# The first-batch check of in-memory data, once per module, data and model set-up: a script that
# calls fit (or evaluate) in chunks on the same tensors runs the check's forward once. The key
# holds the data tensors' identities and version counters (an in-place write runs it again), the
# compiled loss, metrics and steps, and every parameter's shape, dtype, device and requires_grad.
_CHECKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _Same:
    """Equal to another ``_Same`` of the very same objects (compared by identity, held weakly
    where they allow it, so the key keeps no data alive)."""

    def __init__(self, objects: list[Any]):
        self.refs = [_ref(o) for o in objects]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Same)
            and len(self.refs) == len(other.refs)
            and all(a() is not None and a() is b() for a, b in zip(self.refs, other.refs, strict=True))
        )

    __hash__ = None  # type: ignore[assignment]


def _ref(o: Any) -> Any:
    try:
        return weakref.ref(o)
    except TypeError:
        return lambda: o


def _checked_signature(model: Model, source: TensorBatches, training: bool) -> tuple[Any, ...]:
    leaves = [t for part in (source.x, source.y, source.w) if part is not None for t in nest.leaves(part)]
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    params = tuple(
        (n, None if is_lazy(p) else tuple(p.shape), p.dtype, p.device, p.requires_grad)
        for n, p in model.module.named_parameters()
    )
    steps = (model.default_train_step, model.default_test_step, model.default_compute_loss)
    return (
        _Same([*tensors, model.loss, model.metrics]),
        tuple(t._version for t in tensors),
        source.n,
        source.batch_size,
        training,
        steps,
        str(model.precision),
        params,
    )


class BatchGuard:
    """The decisions about a fit's training batches as they come, for what preflight could not
    see before step 1: a source's first batch, and one-row batches under BatchNorm.

    Args:
        model: the :class:`fitkit.Model`.
        train: the fit's :class:`~fitkit.data.DeviceLoader`.

    Attributes:
        skip_single: a BatchNorm layer trains, so a one-row batch that is a window of its own is
            skipped (with one warning per fit).
        check_first: the first training batch still needs :func:`first_batch_check` (sources
            other than in-memory data, which had theirs before fit; a custom ``train_step`` with
            the default ``test_step`` is skipped, as preflight skips it).
    """

    def __init__(self, model: Model, train: Any):
        self.skip_single = has_training_batchnorm(model.module)
        self.check_first = not isinstance(getattr(train, "batches", None), TensorBatches) and (
            model.default_train_step or not model.default_test_step
        )
        self._warned_single = False

    def single(self, batch: tuple[Any, Any, Any], stepper: Stepper, step: int, epoch: int) -> bool:
        """Whether ``batch`` is a one-row batch BatchNorm cannot train on (it is then skipped)."""
        x, y, _ = batch
        window = stepper.window
        if nest.rows(y if y is not None else x) != 1 or not window.micro_last or window.micro_scale is not None:
            return False
        if not self._warned_single:
            self._warned_single = True  # one warning per fit
            warnings.warn(
                f"Batch {step} of epoch {epoch + 1} has one row, which BatchNorm cannot train on; it is "
                "skipped, as is every later one-row training batch of this fit. Fix: use `drop_last=True` in "
                "the DataLoader, or a batch size that leaves no single row.",
                category=FitkitWarning,
                stacklevel=5,
            )
        return True

    def first(self, model: Model, batch: tuple[Any, Any, Any]) -> Any:
        """:func:`first_batch_check` of the first training batch, once; returns its ``x``.

        Between the RNG states the fit set (a resume's) and the batch's training step: it
        leaves no trace, so that step draws what it would draw without the check.
        """
        self.check_first = False
        with leaves_no_trace(model.module):
            return first_batch_check(model, batch, label="first training batch")

    @staticmethod
    def nothing_trained(epoch: int, skipped: int) -> None:
        """``ValueError`` when every batch of the fit's first epoch was a skipped one-row batch."""
        if skipped:
            raise ValueError(
                f"Every training batch of epoch {epoch + 1} ({skipped}) had one row, and BatchNorm cannot "
                "train on one row, so nothing was trained. Fix: use batches of at least 2 rows, or put the "
                "BatchNorm layers in eval mode (`module.eval()` on them) before fit."
            )
