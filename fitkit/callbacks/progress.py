"""The rich progress bar that ``verbose`` adds to fit / evaluate / predict."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from fitkit.callbacks.base import Callback
from fitkit.checks.declared import Option, declare, declared
from fitkit.distributed.group import is_rank_zero
from fitkit.formatting import format_value

__all__ = ["ProgressBar", "resolve_verbose", "format_logs"]


def resolve_verbose(verbose: Any, console: Console | None = None) -> int:
    """``"auto"`` is 1 on a terminal or in a notebook, else 2; 0, 1 and 2 pass through.

    Raises:
        ValueError: anything else.

    Example:
        >>> resolve_verbose(0), resolve_verbose(2)
        (0, 2)
    """
    if verbose == "auto":
        console = console or Console()
        return 1 if console.is_terminal or console.is_jupyter else 2
    if isinstance(verbose, bool) or verbose not in (0, 1, 2):
        raise ValueError(f"Expected `verbose` to be 0, 1, 2 or 'auto'. Received: verbose={verbose!r}.")
    return int(verbose)


def format_logs(logs: Mapping[str, Any]) -> str:
    """``loss: 0.1234 - accuracy: 0.9500`` from logs of floats or 0-dim tensors.

    Tensors are read together in one transfer (one host sync for all of them). Values are
    printed by :func:`fitkit.formatting.format_value`: learning rates in their one format, every
    other value in the one format of losses and metrics.

    Example:
        >>> format_logs({"loss": torch.tensor(0.5), "accuracy": 0.25, "learning_rate": 0.001})
        'loss: 0.5000 - accuracy: 0.2500 - learning_rate: 0.001'
    """
    keys = [k for k, v in logs.items() if isinstance(v, (int, float, torch.Tensor))]
    tensors = [logs[k] for k in keys if isinstance(logs[k], torch.Tensor) and logs[k].numel() == 1]
    values = iter(torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist()) if tensors else iter(())
    parts = []
    for k in keys:
        v = logs[k]
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                continue
            v = next(values)
        parts.append(f"{k}: {format_value(k, v)}")
    return " - ".join(parts)


def _check_console(value: object) -> None:
    if not isinstance(value, Console):
        raise TypeError(
            f"Expected `console` to be a rich.console.Console or None. Received: console={value!r} "
            f"({type(value).__name__}). Fix: pass console=Console(...), or leave it out for standard output."
        )


_PROGRESS_BAR_OPTIONS = declare(
    "ProgressBar",
    Option("verbose", "int", minimum=0, maximum=2),
    Option("refresh_interval", "number", minimum=0.0, fix="pass seconds between redraws, e.g. refresh_interval=0.1."),
    Option("console", "custom", check=_check_console, allow_none=True, bad=(5, "stdout")),
)


class ProgressBar(Callback):
    """Progress for fit / evaluate / predict with rich.

    ``verbose=1``: a live bar per epoch with ETA; the metric text is refreshed at most every
    ``refresh_interval`` seconds, the only time batch logs are read (a host sync).
    ``verbose=2``: one line per epoch. Works on terminals, in notebooks and in logs.

    Args:
        verbose: 1 or 2.
        refresh_interval: seconds between redraws of the live bar.
        console: a ``rich.console.Console``; default: one on standard output.

    Example:
        >>> from io import StringIO
        >>> bar = ProgressBar(verbose=2, console=Console(file=StringIO(), width=80))
        >>> bar.set_params({"epochs": 3, "steps": 10})
        >>> bar.on_epoch_begin(0); bar.on_epoch_end(0, {"loss": 0.5})
        >>> bar.console.file.getvalue().split(" - ")[0]
        'Epoch 1/3'
    """

    @declared(_PROGRESS_BAR_OPTIONS)
    def __init__(self, verbose: int = 1, refresh_interval: float = 0.1, console: Console | None = None):
        super().__init__()
        self.verbose = verbose
        self.refresh_interval = refresh_interval
        self.console = console or Console()
        self._progress: Progress | None = None
        self._pending: tuple[str, int | None] | None = None
        self._task: Any = None
        self._last = 0.0
        self._start = 0.0
        self._in_fit = False

    # -- live bar helpers ---------------------------------------------------------------
    def _open(self, description: str, total: int | None) -> None:
        self._start = self._last = time.perf_counter()
        self._pending = None
        if self.verbose != 1 or not is_rank_zero() or not (self.console.is_terminal or self.console.is_jupyter):
            return  # a live bar in a log file is noise: the summary line is enough
        # The bar itself starts at the first refresh: a phase shorter than refresh_interval
        # draws nothing but its summary line (no flicker, and no rendering cost).
        self._pending = (description, total)

    def _start_bar(self) -> None:
        if self._pending is None:
            return
        description, total = self._pending
        self._pending = None
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=self.console,
            transient=True,  # replaced by one summary line when the phase ends
            auto_refresh=False,  # redrawn from the batch hook, throttled: no thread, no GIL fight
        )
        self._task = self._progress.add_task(description, total=total, metrics="")
        self._progress.start()

    def _tick(self, batch: int, logs: Mapping[str, Any] | None) -> None:
        if self._progress is None and self._pending is None:
            return
        now = time.perf_counter()
        if now - self._last < self.refresh_interval:
            return
        self._last = now
        if self._progress is None:
            self._start_bar()
        text = format_logs(logs) if logs else ""
        if self._progress is None:  # the bar did not start
            return
        self._progress.update(self._task, completed=batch + 1, metrics=text)
        self._progress.refresh()

    def _close(self, title: str, logs: Mapping[str, Any] | None) -> None:
        """End the phase: drop the live bar, print one line with the phase's logs."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if not is_rank_zero():
            return  # under torchrun only rank 0 prints
        seconds = time.perf_counter() - self._start
        steps = f" - {self._seen} step{'s' if self._seen != 1 else ''}" if self._seen else ""
        text = format_logs(logs or {})
        took = f"{seconds:.1f}s" if seconds >= 1 else f"{seconds * 1000:.0f}ms"
        line = f"{title}{steps} - {took}" + (f" - {text}" if text else "")
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    # -- fit -----------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        self._in_fit = True
        self._seen = 0

    def on_train_end(self, logs=None):
        self._in_fit = False

    def on_epoch_begin(self, epoch, logs=None):
        self._seen = 0
        self._open(self._epoch_title(epoch), self.params.get("steps"))

    def on_train_batch_end(self, batch, logs=None):
        self._seen = batch + 1
        self._tick(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._close(self._epoch_title(epoch), logs)

    def _epoch_title(self, epoch: int) -> str:
        epochs = self.params.get("epochs")  # None: unbounded (a step budget of unknown epochs)
        return f"Epoch {epoch + 1}/{epochs}" if epochs is not None else f"Epoch {epoch + 1}"

    def on_validation_end(self, logs=None):
        """A validation inside the epoch (``validation_interval``): one line above the bar."""
        if not self.params.get("validation_interval") or not is_rank_zero() or not logs:
            return
        text = format_logs({k: v for k, v in logs.items() if k.startswith("val_")})
        line = f"Validation at step {logs['step']} (epoch {logs['epoch'] + 1}) - {text}"
        target = self._progress.console if self._progress is not None else self.console
        target.print(line, highlight=False, markup=False, soft_wrap=True)

    # -- evaluate / predict (validation inside fit draws no bar of its own) -------------
    def on_test_begin(self, logs=None):
        if not self._in_fit:
            self._seen = 0
            self._open("Evaluate", self.params.get("steps"))

    def on_test_batch_end(self, batch, logs=None):
        if not self._in_fit:
            self._seen = batch + 1
            self._tick(batch, logs)

    def on_test_end(self, logs=None):
        if not self._in_fit:
            self._close("Evaluate", logs)

    def on_predict_begin(self, logs=None):
        self._seen = 0
        self._open("Predict", self.params.get("steps"))

    def on_predict_batch_end(self, batch, logs=None):
        self._seen = batch + 1
        self._tick(batch, None)

    def on_predict_end(self, logs=None):
        self._close("Predict", None)
