"""A host-sync counter that works on the CPU: every op that would make a CUDA step wait for the host.

On a GPU, an op syncs when the host must read a device value (``.item()``, ``bool(t)``,
``.tolist()``, a copy to the CPU) or an output size that depends on the data (``nonzero``,
boolean-mask indexing, ``unique``, ``bincount``, ``masked_select``). On the CPU none of these
waits, so nothing measures them there; :class:`SyncCounter` logs each one anyway, with the
Python stack that called it:

- a ``TorchDispatchMode`` sees the aten ops (``_local_scalar_dense`` is what every
  ``.item()`` / ``bool()`` / ``float()`` of a tensor becomes);
- wrappers on ``Tensor.item / tolist / numpy / cpu / __bool__``, ``Tensor.to`` with the CPU as
  the target of a tensor that is elsewhere, and ``torch.cuda.synchronize`` name the Python-level
  call (the aten op under a wrapper is then not counted twice).

:class:`StepMarks`, a callback, tags each event with the batch it fell in: the interval from
``on_*_batch_begin(b)`` to the next batch's begin (so ``train_step``, every callback's batch
hooks and the loop's own work between two batches are in it), and everything else (epoch ends,
validation set-up, the end of a pass) as ``"other"``. Steady-state steps are the intervals of
batch 1 to the second-to-last batch of each pass: batch 0 builds the metrics and the last one
ends the epoch. An event whose stack passes through a log point (``LOG_POINTS``: the progress
bar's text, TensorBoard's batch logs) reads the host by design and is counted apart.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fitkit

__all__ = ["SyncCounter", "StepMarks", "CountSteps", "Event", "count_syncs"]

#: aten ops that read a device value on the host, or whose output size depends on the data.
SYNC_OPS = (
    "aten._local_scalar_dense",
    "aten.item",
    "aten.is_nonzero",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.bincount",
    "aten.equal",
    "aten.repeat_interleave",
)

#: ``(file name, function)`` of the places that read the host on purpose, at a log point.
LOG_POINTS = {("progress.py", "format_logs"), ("tensorboard.py", "_write"), ("mlflow.py", "_log_metrics")}

#: Reads of tensors that live on the host on every device: torch keeps a non-capturable
#: optimizer's ``step`` count on the CPU, and reads it there.
HOST_VALUES = {("optimizer.py", "_get_value")}


class Event:
    """One host read: what it was, the step it fell in, and the stack (innermost last)."""

    __slots__ = ("what", "phase", "stack")

    def __init__(self, what: str, phase: tuple[Any, ...], stack: list[traceback.FrameSummary]):
        self.what, self.phase, self.stack = what, phase, stack

    @property
    def of_a_host_value(self) -> bool:
        return any((os.path.basename(f.filename), f.name) in HOST_VALUES for f in self.stack[-3:])

    @property
    def at_log_point(self) -> bool:
        return any((os.path.basename(f.filename), f.name) in LOG_POINTS for f in self.stack)

    def where(self) -> str:
        """The innermost frames of fitkit, torch and the test: enough to find the line."""
        frames = [f for f in self.stack if os.path.basename(f.filename) != "_syncs.py"][-8:]
        return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))

    def __repr__(self) -> str:
        return f"{self.what} in {self.phase}: {self.where()}"


def _is_bool_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class _Ops(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(SYNC_OPS) or (name.startswith("aten.index.Tensor") and _is_bool_index(args)):
            self.counter.record(name)
        return func(*args, **(kwargs or {}))


def _to_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
    if self.device.type == "cpu":
        return False
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    return target is not None and not isinstance(target, torch.dtype) and torch.device(target).type == "cpu"


class SyncCounter:
    """Log every host read while active; ``phase`` says which step it falls in.

    Example (in a test)::

        counter = SyncCounter()
        with counter:
            bool(torch.ones(()) > 0)
        assert [e.what for e in counter.events] == ["Tensor.__bool__"]
    """

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.phase: tuple[Any, ...] = ("other",)
        self.phases: list[tuple[Any, ...]] = []  # every batch interval seen, in order
        self._depth = 0  # inside a wrapped call: its aten ops are that call's, not new reads
        self._stack = contextlib.ExitStack()

    def record(self, what: str) -> None:
        if self._depth:
            return
        event = Event(what, self.phase, traceback.extract_stack()[:-2])
        if not event.of_a_host_value:
            self.events.append(event)

    def _wrap(self, owner: Any, name: str, when: Any = None) -> None:
        original = getattr(owner, name)
        counter = self

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if when is None or when(*args, **kwargs):
                counter.record(f"{getattr(owner, '__name__', owner)}.{name}")
            counter._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._depth -= 1

        own = name in vars(owner)  # else inherited (Tensor.__bool__ is TensorBase's): delete ours after
        setattr(owner, name, wrapper)
        self._stack.callback(setattr, owner, name, original) if own else self._stack.callback(delattr, owner, name)

    def __enter__(self) -> SyncCounter:
        for name in ("item", "tolist", "numpy", "cpu", "__bool__"):
            self._wrap(torch.Tensor, name)
        self._wrap(torch.Tensor, "to", _to_cpu)
        self._wrap(torch.cuda, "synchronize")
        self._stack.enter_context(_Ops(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    @property
    def count(self) -> int:
        """Every host read seen, wherever it fell."""
        return len(self.events)

    # -- the counts ----------------------------------------------------------------------------
    def steady(self, kind: str = "train") -> dict[tuple[Any, ...], list[Event]]:
        """``{(kind, pass, batch): events}`` of every steady-state step of ``kind`` (log points
        left out), empty lists included: batch 1 to the second-to-last of each pass."""
        last: dict[Any, int] = collections.defaultdict(int)
        for phase in self.phases:
            if phase[0] == kind:
                last[phase[1]] = max(last[phase[1]], phase[2])
        steps: dict[tuple[Any, ...], list[Event]] = {
            p: [] for p in self.phases if p[0] == kind and 1 <= p[2] < last[p[1]]
        }
        for e in self.events:
            if e.phase in steps and not e.at_log_point:
                steps[e.phase].append(e)
        return steps

    def per_step(self, kind: str = "train") -> list[int]:
        """Host reads of each steady-state step of ``kind``, in order."""
        return [len(v) for v in self.steady(kind).values()]

    def step_events(self, kind: str = "train") -> list[Event]:
        """Every host read of the steady-state steps of ``kind`` (log points left out)."""
        return [e for events in self.steady(kind).values() for e in events]

    def outside_steps(self) -> list[Event]:
        """Reads at epoch ends, pass ends and log points (allowed: once per epoch / log)."""
        return [e for e in self.events if e.phase[0] == "other" or e.at_log_point]


class StepMarks(fitkit.callbacks.Callback):
    """Tags a :class:`SyncCounter`'s events with the batch they fall in (put it first in the list).

    A pass is one training epoch, one validation, one ``evaluate`` or one ``predict``.
    """

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter
        self.passes: collections.Counter[str] = collections.Counter()

    def _begin(self, kind: str, batch: int) -> None:
        phase = (kind, self.passes[kind], batch)
        self.counter.phases.append(phase)
        self.counter.phase = phase

    def _end(self, kind: str) -> None:
        self.passes[kind] += 1
        self.counter.phase = ("other",)

    def on_epoch_begin(self, epoch, logs=None):
        self.counter.phase = ("other",)

    def on_train_batch_begin(self, batch, logs=None):
        self._begin("train", batch)

    def on_epoch_end(self, epoch, logs=None):
        self._end("train")

    def on_test_begin(self, logs=None):
        self.counter.phase = ("other",)  # validation: the last training batch's interval ends here

    def on_test_batch_begin(self, batch, logs=None):
        self._begin("test", batch)

    def on_test_end(self, logs=None):
        self._end("test")

    def on_predict_batch_begin(self, batch, logs=None):
        self._begin("predict", batch)

    def on_predict_end(self, logs=None):
        self._end("predict")


def count_syncs(run: Any) -> SyncCounter:
    """Run ``run(marks)`` under a fresh counter; ``marks`` is the callback to pass first."""
    counter = SyncCounter()
    marks = StepMarks(counter)
    with counter:
        run(marks)
    return counter


class CountSteps(fitkit.callbacks.Callback):
    """Counts host reads from the batch end of optimizer step ``start`` to that of step ``stop``
    (``count``, once ``stop`` is reached): a quick check for one callback's per-step cost."""

    def __init__(self, start: int, stop: int) -> None:
        super().__init__()
        self.start, self.stop = start, stop
        self.counter: SyncCounter | None = None
        self.count: int | None = None

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        step = self.model.global_step
        if step == self.start and self.counter is None and self.count is None:  # once (micro-batches share a step)
            self.counter = SyncCounter().__enter__()
        elif step == self.stop and self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.count, self.counter = self.counter.count, None

    def on_train_end(self, logs: Any = None) -> None:
        if self.counter is not None:  # the fit ended before step ``stop``: never leave torch patched
            self.counter.__exit__(None, None, None)
            self.counter = None
