"""The compiled metrics of a model (:class:`MetricSet`): configured from the loss, built on the
first batch, updated on the device every step, copied per phase."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fitkit.losses import resolve_loss
from fitkit.losses.denominators import counted
from fitkit.metrics.names import (
    _REGRESSION,
    _SCORE_METRICS,
    MetricSpec,
    _is_metric,
    _make_classification,
    _make_regression,
    check_regression_shapes,
    check_reserved_keys,
    infer_task,
    snake_case,
)

__all__ = ["MetricSet"]


def _sync_free(metric: Any) -> Any:
    from fitkit.metrics.states import sync_free_update

    return sync_free_update(metric)


class _Entry:
    __slots__ = ("key", "metric", "kind", "output", "fn")

    def __init__(self, key: str, metric: Any, kind: str, output: str | None = None, fn: Any = None):
        # kind: labels | accuracy (labels, and the loss's count) | scores | regression | raw (a
        # torchmetrics object) | stat_scores (one updated without a host sync) | callable
        self.key, self.metric, self.kind, self.output, self.fn = key, metric, kind, output, fn


def _items(metrics: Any) -> list[tuple[str | None, Any]]:
    """``compile(metrics=...)`` as ``(log name or None, metric)`` pairs."""
    if metrics is None:
        return []
    if isinstance(metrics, (str, MetricSpec)) or _is_metric(metrics) or callable(metrics):
        metrics = [metrics]
    if isinstance(metrics, Mapping):
        return list(metrics.items())
    if isinstance(metrics, (list, tuple)):
        return [(None, m) for m in metrics]
    raise TypeError(
        "Expected `metrics` to be a list of names / torchmetrics.Metric objects / callables or a "
        f"dict {{log_name: metric}}. Received: {type(metrics).__name__}."
    )


def _spec(key: str | None, m: Any) -> tuple[str, Any]:
    """One metric's ``(log name, torchmetrics.Metric or MetricSpec)``."""
    if _is_metric(m):
        return key or snake_case(type(m).__name__), m
    if isinstance(m, str) or not isinstance(m, MetricSpec) and callable(m):
        m = MetricSpec(m)
    elif not isinstance(m, MetricSpec):
        raise TypeError(
            "Expected each metric to be a name, a torchmetrics.Metric, a callable fn(y_pred, y_true) "
            f"or a MetricSpec. Received: {m!r} of type {type(m).__name__}."
        )
    key = key or m.default_key()
    if key is None:
        raise ValueError(
            f"A metric callable needs a log name. Received: {m.metric!r}. Fix: pass a dict "
            "{'name': fn}, or a function defined with `def`."
        )
    return key, m


class MetricSet:
    """The compiled metrics of a model: configured from the loss, built on the first batch.

    Args:
        metrics: names, ``torchmetrics.Metric`` objects, callables ``fn(y_pred, y_true)``,
            :class:`MetricSpec` objects, a list of those, or a dict ``{log_name: metric}``.

    Raises:
        ValueError: an unknown name (listing valid names), a lambda without a dict key, or, on
            the first batch, a classification metric asked of regression targets, or one that
            needs logits vs probabilities that nothing states.
        TypeError: an entry of another type.

    Example:
        >>> ms = MetricSet(["accuracy"]).configure("cross_entropy")
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0], [0.0, 1.0]])
        >>> ms.update(logits, torch.tensor([0, 1, 1, -100]))  # -100: the loss's ignore_index
        >>> {k: round(float(v), 4) for k, v in ms.compute().items()}
        {'accuracy': 0.6667}

        A callable, averaged per sample:

        >>> def abs_error(y_pred, y):
        ...     return (y_pred.squeeze(-1) - y).abs()  # (B,)
        >>> ms = MetricSet([abs_error, "mse"])
        >>> ms.update(torch.zeros(2, 1), torch.tensor([1.0, 1.0])); ms.update(torch.zeros(1, 1), torch.tensor([4.0]))
        >>> {k: float(v) for k, v in ms.compute().items()}
        {'abs_error': 2.0, 'mse': 6.0}
    """

    def __init__(self, metrics: Any = None):
        self.specs: list[tuple[str, Any]] = [_spec(key, m) for key, m in _items(metrics)]  # (log name, metric)
        keys = [k for k, _ in self.specs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"Metric log names must be unique. Received: {keys}. Fix: pass a dict.")
        check_reserved_keys(keys)
        self.entries: list[_Entry] | None = None if self.specs else []
        self.loss_kind: str | None = None
        self.output: str | None = None
        self.ignore_index: int | None = None
        self.loss_name: str | None = None
        self.device: torch.device | None = None
        self.task: str | None = None
        self.num_classes = 0
        self.class_last = False
        self.keeps_inputs = True
        #: a checkpoint's metric states that wait for the metrics to be built (:mod:`fitkit.metrics.saved`)
        self.pending: dict[str, Any] | None = None
        self.pending_owner = True  # whether the pending states are this rank's to take (see load_state_dict)

    @property
    def keys(self) -> list[str]:
        """The log names of the metrics, in the order given (known before the first batch).

        A name logs as itself, a ``torchmetrics.Metric`` as its class name in snake case, a
        callable as its ``__name__``, a dict entry as its key.

        Example:
            >>> MetricSet(["accuracy", "mae"]).keys, MetricSet({"acc": "accuracy"}).keys
            (['accuracy', 'mae'], ['acc'])
        """
        return [k for k, _ in self.specs]

    def higher_is_better(self, key: str) -> bool | None:
        """The direction of the metric logged as ``key`` (``None`` when unknown).

        Example:
            >>> def score(y_pred, y):
            ...     return y_pred
            >>> up = MetricSpec(score, higher_is_better=True)
            >>> ms = MetricSet({"acc": "accuracy", "err": "mae", "s": score, "s2": up})
            >>> [ms.higher_is_better(k) for k in ms.keys]
            [True, False, None, True]
        """
        for k, m in self.specs:
            if k == key:
                return m.higher_is_better
        return None

    def configure(self, loss: Any = None, device: torch.device | str | None = None) -> MetricSet:
        """Take what the loss knows (kind, ``output``, ``ignore_index``) and the device.

        Without a loss (``compile(loss=None)``: a module that computes its own, as Hugging Face
        models do), multiclass metrics skip targets of -100, Hugging Face's ignore index.

        ``Model.compile`` calls it once with the resolved loss. Metrics already built are built
        again at the next batch, for the new loss.

        Args:
            loss: a :class:`fitkit.losses.Loss` (or anything :func:`fitkit.losses.resolve_loss`
                takes), or ``None``.
            device: where the metric states live; ``None`` keeps the current one.

        Returns:
            This MetricSet.

        Example:
            >>> ms = MetricSet(["accuracy"]).configure(torch.nn.CrossEntropyLoss(ignore_index=0), "cpu")
            >>> ms.output, ms.ignore_index, ms.device
            ('logits', 0, device(type='cpu'))
        """
        loss = resolve_loss(loss)
        self.loss_kind = getattr(loss, "kind", None)
        self.output = getattr(loss, "output", None)
        # loss=None: the module's own loss (Hugging Face's), whose labels mark ignored positions
        # with -100; no class label is negative. Applied to multiclass labels only (see
        # _classification_entry): torchmetrics' binary ignore_index would sync every step.
        self.ignore_index = getattr(loss, "ignore_index", None) if loss is not None else -100
        self.loss_name = getattr(loss, "name", None)
        if self.entries:
            self.entries = None
        if device is not None:
            self.to(device)
        return self

    def clone(self) -> MetricSet:
        """A fresh MetricSet with the same metrics and configuration, sharing no state.

        Built metric objects (and torchmetrics objects given by the user) are deep copies,
        reset; the loss information, device and the task inferred so far are kept. ``fit``
        gives each phase (a training epoch, a validation, an ``evaluate`` nested in a callback)
        its own copy, so no phase resets another's running values.

        Example:
            >>> ms = MetricSet(["mae"])
            >>> ms.update(torch.zeros(2), torch.tensor([1.0, 3.0]))
            >>> other = ms.clone()
            >>> other.update(torch.zeros(1), torch.tensor([10.0]))
            >>> ms.compute()["mae"].item(), other.compute()["mae"].item()
            (2.0, 10.0)
        """
        new = copy.copy(self)
        new.pending = None  # a checkpoint's states belong to the phase they were loaded into
        copies: dict[int, Any] = {}

        def fresh(m: Any) -> Any:
            if not _is_metric(m):
                return m
            if id(m) not in copies:  # one copy per object: a raw entry stays its spec's object
                copies[id(m)] = c = copy.deepcopy(m)
                c.reset()
            return copies[id(m)]

        new.specs = [(k, fresh(m)) for k, m in self.specs]
        if self.entries is not None:
            new.entries = [_Entry(e.key, fresh(e.metric), e.kind, e.output, e.fn) for e in self.entries]
        return new

    def build(self, y_pred: torch.Tensor, y: torch.Tensor) -> None:
        """Create the metrics for the task the first batch shows (from shapes and dtypes only).

        Raises:
            ValueError: predictions or targets that are not single tensors, a classification
                metric asked of regression targets, or a metric that needs logits vs
                probabilities where neither the loss nor a :class:`MetricSpec` says which.
        """
        if not isinstance(y_pred, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise ValueError(
                "Compiled metrics need a module with one tensor output and tensor targets. "
                f"Received y_pred of type {type(y_pred).__name__} and y of type {type(y).__name__}. "
                "Fix: for several outputs, compute metrics in a callback or a custom test_step."
            )
        task, n, class_last = infer_task(y_pred, y, self.loss_kind)
        device = self.device or y_pred.device
        entries = []
        for key, m in self.specs:
            if _is_metric(m):
                from fitkit.metrics.states import sync_free_update  # the user imported torchmetrics

                entries.append(_Entry(key, m, "stat_scores" if sync_free_update(m) is not None else "raw"))
            elif callable(m.metric):
                from fitkit.metrics.states import CallableMean  # imports torchmetrics

                dtype = torch.float32 if device.type == "mps" else torch.float64
                entries.append(_Entry(key, CallableMean(dtype), "callable", fn=m.metric))
            elif m.metric in _REGRESSION:
                check_regression_shapes(key, y_pred, y)
                entries.append(_Entry(key, _make_regression(m.metric), "regression"))
            else:
                entries.append(self._classification_entry(key, m, task, n, y_pred, y))
        for e in entries:
            e.metric.to(device)
        self.task, self.num_classes, self.class_last, self.entries = task, n, class_last, entries
        # Entries that may keep ``y_pred`` itself (a callable's result, a user's metric, a list
        # state) get it detached; the built-in label metrics only count.
        self.keeps_inputs = any(e.kind not in ("labels", "accuracy") for e in entries)
        if self.pending is not None:  # a resumed epoch's states, loaded at birth
            self.load_state_dict(self.pending, owner=self.pending_owner)

    def _classification_entry(self, key: str, spec: MetricSpec, task: str, n: int, y_pred, y) -> _Entry:
        name = str(spec.metric)
        if task == "regression":
            raise ValueError(
                f"Metric '{name}' needs class targets, but the first batch looks like regression: "
                f"y_pred {tuple(y_pred.shape)} {y_pred.dtype}, y {tuple(y.shape)} {y.dtype}. "
                "Fix: pass integer class labels, or use a regression metric such as 'mae'."
            )
        kind = "scores" if name in _SCORE_METRICS else "labels"
        output = spec.output or self.output
        if output is None and (kind == "scores" or task != "multiclass"):
            need = "probabilities" if kind == "scores" else f"a threshold for {task} predictions"
            raise ValueError(
                f"Metric '{name}' needs {need}, and the loss ({self.loss_name}) does not say whether the "
                "module outputs logits or probabilities. Fix: pass "
                f"`fitkit.metrics.MetricSpec('{name}', output='logits')` (or 'probs' / 'log_probs') in "
                "`metrics=`, or a loss that says: 'bce_with_logits' (logits), 'bce' (probabilities), or "
                "`fitkit.losses.Loss(fn, output='logits')`. A torchmetrics object is used as given."
            )
        own_loss = self.loss_kind is None  # compile(loss=None): -100 is skipped in multiclass labels only
        ignore = None if own_loss and task != "multiclass" else self.ignore_index
        metric = _make_classification(name, task, n, ignore, self.device or y_pred.device)
        if name == "accuracy" and task == "multiclass":
            kind = "accuracy"  # labels, and the loss's count of the targets when it has one
        return _Entry(key, metric, kind, output)

    def update(self, y_pred: Any, y: Any) -> None:
        """Add one batch (``y_pred`` detached here) to every metric's state, with no host sync.

        Args:
            y_pred: the module's output, ``(B, ...)``.
            y: the targets, ``(B, ...)``.

        Raises:
            TypeError: a metric callable that returns neither a tensor nor a number.
            ValueError: a metric callable whose result is neither 0-dim nor ``(B, ...)``.
        """
        entries = self.entries
        if entries is None:
            with torch.no_grad():
                self.build(y_pred, y)
            entries = self.entries
        if not entries:
            return
        if (
            len(entries) == 1
            and entries[0].kind == "accuracy"
            and type(y) is torch.Tensor
            and y.dim() == 1
            and y.dtype is torch.long
            and type(y_pred) is torch.Tensor
            and y_pred.dim() == 2
            and y_pred.dtype is torch.float32
        ):
            # the classification step with accuracy alone: what _update does for it, in one call
            # ((B, C) scores, (B,) class indices: no reshape, no cast, no probability targets)
            metric = entries[0].metric
            metric.update(y_pred.argmax(1), y, counted(y, metric.ignore_index))
            return
        if self.keeps_inputs:
            with torch.no_grad():
                self._update(y_pred.detach(), y)
        else:  # label counts only: integer ops record no graph; no context (Python calls), no detach (an op)
            self._update(y_pred.detach() if y_pred.dtype in (torch.float16, torch.bfloat16) else y_pred, y)

    def _update(self, y_pred: Any, y: Any) -> None:
        given_pred, given_y = y_pred, y  # what callables see: the tensors as the module gave them
        if y_pred.dtype in (torch.float16, torch.bfloat16):
            y_pred = y_pred.float()  # mixed precision: built-in metrics in float32, targets never cast down
        if self.class_last:
            same = y.shape == y_pred.shape  # (B, T, V) class probabilities
            y_pred = y_pred.reshape(-1, y_pred.shape[-1])  # (B*T, V)
            y = y.reshape(y_pred.shape) if same else y.reshape(-1)
        if self.task != "regression" and not y.is_floating_point() and y.dtype != torch.long:
            y = y.long()
        prepared: dict[tuple[str, str | None], tuple[torch.Tensor, torch.Tensor]] = {}
        for e in self.entries or ():  # built by update
            if e.kind == "callable":
                out = _metric_value(e.key, e.fn(given_pred, given_y))
                e.metric.update(out, int(given_y.shape[0]))
            elif e.kind in ("raw", "stat_scores"):
                # (B, 1) predictions meet (B,) targets as they do in the loss (no broadcast).
                same = y_pred.shape == y.shape or y_pred.numel() != y.numel()
                # torchmetrics' multi-class stat scores count with bincount (a host sync):
                # fitkit's own counts go into the same states (see states.sync_free_update).
                update = e.metric.update if e.kind == "raw" else _sync_free(e.metric)
                update(y_pred if same else y_pred.reshape(y.shape), y)
            elif e.kind == "regression":
                p = y_pred.reshape(y.shape) if y_pred.shape != y.shape and y_pred.numel() == y.numel() else y_pred
                e.metric.update(p, y.to(p.dtype))
            else:
                kind = "scores" if e.kind == "scores" else "labels"
                if (kind, e.output) not in prepared:
                    make = self._scores if kind == "scores" else self._labels
                    prepared[kind, e.output] = make(y_pred, y, e.output)
                if e.kind == "accuracy":  # the loss's count of these targets, when it made one
                    e.metric.update(*prepared[kind, e.output], counted(given_y, e.metric.ignore_index))
                else:
                    e.metric.update(*prepared[kind, e.output])

    def _target(self, y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.task == "multiclass" and y.shape == y_pred.shape:
            return y.argmax(1)  # class-probability targets
        if self.task in ("binary", "multilabel"):
            y = y.reshape(y_pred.shape) if y.shape != y_pred.shape else y
            # soft / smoothed targets (0.1 / 0.9): the class is the side of 0.5 they are on
            return (y > 0.5).long() if y.is_floating_point() else y
        return y

    def _labels(self, y_pred: torch.Tensor, y: torch.Tensor, output: str | None):
        target = self._target(y_pred, y)
        if self.task == "multiclass":
            return y_pred.argmax(1), target  # the same for logits, probabilities and log-probabilities
        threshold = {"logits": 0.0, "probs": 0.5, "log_probs": math.log(0.5)}[output or "logits"]
        return (y_pred > threshold).long().reshape(target.shape), target

    def _scores(self, y_pred: torch.Tensor, y: torch.Tensor, output: str | None):
        target = self._target(y_pred, y)
        p = y_pred.float()
        if output == "log_probs":
            p = p.exp()
        elif output == "logits":
            p = p.softmax(1) if self.task == "multiclass" else p.sigmoid()
        return (p if self.task == "multiclass" else p.reshape(target.shape)), target

    def compute(self) -> dict[str, torch.Tensor]:
        """Epoch values (0-dim tensors) of every metric updated since the last reset."""
        out = {}
        for e in self.entries or []:
            if e.metric.update_count:
                out[e.key] = e.metric.compute()
        return out

    def reset(self) -> None:
        """Clear every metric's state (at the start of each epoch and evaluation).

        Example:
            >>> ms = MetricSet(["accuracy"])
            >>> ms.update(torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0]))
            >>> ms.compute()
            {'accuracy': tensor(0.5000)}
            >>> ms.reset(); ms.compute()
            {}
        """
        for e in self.entries or []:
            e.metric.reset()

    def state_dict(self, sync: bool = False) -> dict[str, dict[str, Any]]:
        """The running states by log key (``sync``: summed over ranks, a collective); before the
        metrics are built, the states that wait for them (:mod:`fitkit.metrics.saved`)."""
        from fitkit.metrics.saved import metric_states

        return dict(self.pending or {}) if self.entries is None else metric_states(self.entries, sync)

    def load_state_dict(self, states: dict[str, dict[str, Any]], owner: bool = True) -> None:
        """Load :meth:`state_dict` now if the metrics are built, else at their birth (:meth:`build`).

        ``owner=False``: states summed over ranks that another rank takes; this rank's metrics
        get their empty states with the saved update counts (the same metrics compute everywhere).
        """
        from fitkit.metrics.saved import load_metric_states

        self.pending = dict(states) if self.entries is None else None
        self.pending_owner = owner
        if self.entries is not None:
            load_metric_states(self.entries, states, owner=owner)

    def to(self, device: torch.device | str) -> None:
        """Move the metric states to ``device``, in place; metrics built later are created there.

        Args:
            device: the model's device.
        """
        self.device = torch.device(device)
        for e in self.entries or []:
            e.metric.to(self.device)


def _metric_value(key: str, out: Any) -> Any:
    """A callable metric's result: a tensor, or a Python / NumPy number taken as the batch mean.

    Keras averages plain numbers over the batches (weighted by their sizes), and so does fitkit.
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (int, float, np.number)):  # bool is an int: 0 or 1, as Keras reads it
        return torch.tensor(float(out), dtype=torch.float64)
    raise TypeError(
        f"Metric '{key}' must return a tensor or a number. Received {type(out).__name__}. "
        "Fix: return a 0-dim tensor (the batch mean), one value per sample, or a float."
    )
