"""``Profiler``: :mod:`torch.profiler` over a schedule of optimizer steps (Lightning's ``PyTorchProfiler``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from fitkit.callbacks.base import Callback
from fitkit.checks import check_bool, check_int
from fitkit.checks.declared import Option, declare, declared, verbose_option
from fitkit.distributed.group import is_rank_zero

__all__ = ["Profiler"]


_PROFILER_OPTIONS = declare(
    "Profiler",
    Option("dirpath", "path", allow_none=True),
    Option("wait", "int", minimum=0),
    Option("warmup", "int", minimum=0),
    Option("active", "int", minimum=1),
    Option("repeat", "int", minimum=0),
    Option("trace", "choice", choices=("tensorboard", "chrome")),
    Option("record_shapes", "bool"),
    Option("profile_memory", "bool"),
    Option("with_stack", "bool"),
    Option("row_limit", "int", minimum=1),
    verbose_option(),
)


class Profiler(Callback):
    """Profile training with :mod:`torch.profiler` and print the top operators at the end.

    The profiler starts with ``fit`` and advances one step per optimizer step (once per
    accumulation group), following :func:`torch.profiler.schedule`: ``wait`` steps idle,
    ``warmup`` steps traced but discarded, ``active`` steps recorded, the cycle ``repeat``
    times (0: until ``fit`` ends). Each finished cycle writes a trace to ``dirpath``:
    ``trace="tensorboard"`` through :func:`torch.profiler.tensorboard_trace_handler` (open it
    with TensorBoard's profiler plugin or Perfetto), ``"chrome"`` as
    ``trace_<cycle>.json`` for ``chrome://tracing`` / Perfetto. When ``fit`` ends, the
    operators of the recorded steps (every cycle's), sorted by self time (CPU; device time on CUDA), are in
    :attr:`table` and printed on rank 0 (``verbose=1``), like Keras'
    ``TensorBoard(profile_batch=...)`` and Lightning's profiler summary. The profiler adds no
    host sync of its own; its recording slows the profiled steps (profile a few steps only).

    Args:
        dirpath: the folder for the traces (``None``: no trace file, the table only).
        wait, warmup, active, repeat: the schedule, in optimizer steps.
        trace: ``"tensorboard"`` or ``"chrome"``.
        record_shapes, profile_memory, with_stack: passed to :class:`torch.profiler.profile`.
        row_limit: rows of the table.
        verbose: 1 prints the table when ``fit`` ends (rank 0).

    Attributes:
        table: the table of the top operators (``None`` before a profiled ``fit`` ends).
        traces: the trace files written, in order.

    Raises:
        TypeError, ValueError: bad arguments (checked when it is created).

    Example:
        >>> import tempfile, torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(4, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> prof = Profiler(tempfile.mkdtemp(), wait=1, warmup=1, active=2, trace="chrome", verbose=0)
        >>> _ = model.fit(torch.ones(16, 4), torch.ones(16, 1), batch_size=2, verbose=0, callbacks=[prof])
        >>> len(prof.traces), "aten::addmm" in prof.table
        (1, True)
    """

    skip_in_fast_dev_run = True  # it writes files: fit(fast_dev_run=...) leaves it out
    process_resource = "torch.profiler (one profiler per process: two crash it)"

    @declared(_PROFILER_OPTIONS)
    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        trace: str = "tensorboard",
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        row_limit: int = 15,
        verbose: int = 1,
    ):
        super().__init__()
        check_bool("record_shapes", record_shapes)
        check_bool("profile_memory", profile_memory)
        check_bool("with_stack", with_stack)
        check_int("wait", wait, 0)
        check_int("warmup", warmup, 0)
        check_int("active", active, 1)
        check_int("repeat", repeat, 0)
        check_int("row_limit", row_limit, 1)
        if trace not in ("tensorboard", "chrome"):
            raise ValueError(f"Expected `trace` to be 'tensorboard' or 'chrome'. Received: trace={trace!r}.")
        if dirpath is not None and not isinstance(dirpath, (str, os.PathLike)):
            raise TypeError(f"Expected `dirpath` to be a folder path or None. Received: dirpath={dirpath!r}.")
        if dirpath is not None and Path(dirpath).is_file():
            raise ValueError(f"`dirpath` {str(dirpath)!r} is a file. Fix: pass a folder for the traces.")
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.wait, self.warmup, self.active, self.repeat = wait, warmup, active, repeat
        self.trace, self.row_limit, self.verbose = trace, row_limit, verbose
        self.options = {"record_shapes": record_shapes, "profile_memory": profile_memory, "with_stack": with_stack}
        self.table: str | None = None
        self.traces: list[str] = []
        self._profiler: Any = None
        self._last_step = 0

    def _on_trace_ready(self, prof: Any) -> None:
        if self.dirpath is None or not is_rank_zero():
            return
        before = set(self.dirpath.glob("*.json")) if self.dirpath.is_dir() else set()
        if self.trace == "chrome":
            self.dirpath.mkdir(parents=True, exist_ok=True)
            path = self.dirpath / f"trace_{len(self.traces)}.json"
            prof.export_chrome_trace(str(path))
            self.traces.append(str(path))
        else:
            tensorboard_trace_handler(str(self.dirpath))(prof)
            self.traces += sorted(str(p) for p in set(self.dirpath.glob("*.json")) - before)

    def resource_in_use(self) -> str | None:
        """Why the profiler cannot start now (another one runs in this process), or ``None``."""
        if torch.autograd.profiler._is_profiler_enabled:
            return (
                "a torch profiler is already running in this process (a torch.profiler.profile block "
                "around fit?). Fix: drop the Profiler callback, or end the other profiler before fit."
            )
        return None

    def on_train_begin(self, logs=None):
        cuda = self.model.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        self.table, self.traces = None, []
        self._profiler = profile(
            activities=activities,
            on_trace_ready=self._on_trace_ready,
            acc_events=True,
            **self.options,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat),
        )
        self._profiler.start()
        self._last_step = self.model.global_step

    def on_train_batch_end(self, batch, logs=None):
        step = self.model.global_step
        if self._profiler is not None and step != self._last_step:  # an optimizer step ran
            self._last_step = step
            self._profiler.step()

    def on_train_end(self, logs=None):
        prof, self._profiler = self._profiler, None
        if prof is None:
            return
        prof.stop()
        events = prof.key_averages()
        if len(events):
            self.table = events.table(sort_by=self._sort, row_limit=self.row_limit)
            if self.verbose and is_rank_zero():
                print(self.table)

    def close(self) -> None:
        if self._profiler is not None:  # fit raised: stop the profiler, keep what it traced
            prof, self._profiler = self._profiler, None
            prof.stop()
