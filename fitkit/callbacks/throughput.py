"""``ThroughputMonitor``: samples, batches and tokens per second, FLOPs and MFU (Lightning's words).

Timing reads the host clock only at log points (epoch ends, every ``log_every_n_steps``
batches); on CUDA it records events there and around validation, and reads them at the log
points, so no step waits for the device. FLOPs are counted once, on the first training batch
of ``fit``, with :class:`torch.utils.flop_counter.FlopCounterMode`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from fitkit import nest
from fitkit.callbacks.base import Callback
from fitkit.checks import check_bool, check_int, check_number, read_clock
from fitkit.checks.declared import Option, declare, declared

__all__ = ["ThroughputMonitor", "peak_flops_of", "token_count"]

# Dense peak FLOP/s of common GPUs (vendor datasheets, no sparsity): bf16 / fp16 tensor cores,
# fp32 without TF32. Matched by a substring of torch.cuda.get_device_name(), in this order.
_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("h200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("h100 pcie", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    ("h100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),  # SXM
    ("a100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    ("l40s", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    ("l4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),
    ("v100", {"fp16": 125e12, "fp32": 15.7e12}),
    ("t4", {"fp16": 65e12, "fp32": 8.1e12}),
]
_DTYPE = {"bf16-mixed": "bf16", "16-mixed": "fp16", "32": "fp32"}


def peak_flops_of(device_name: str, precision: str) -> float | None:
    """The dense peak FLOP/s of a known GPU at a fitkit ``precision``, or ``None``.

    Args:
        device_name: e.g. ``torch.cuda.get_device_name()``, ``"NVIDIA H100 80GB HBM3"``.
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``.

    Example:
        >>> peak_flops_of("NVIDIA A100-SXM4-80GB", "bf16-mixed"), peak_flops_of("cpu", "32")
        (312000000000000.0, None)
    """
    name, dtype = device_name.lower(), _DTYPE.get(precision)
    for key, peaks in _PEAKS:
        if key in name:
            return peaks.get(dtype) if dtype else None
    return None


def token_count(x: Any) -> int | None:
    """``B * T`` for token batches: an integer ``(B, T)`` input (``input_ids`` of a dict first).

    Example:
        >>> token_count({"input_ids": torch.zeros(4, 7, dtype=torch.long)}), token_count(torch.zeros(4, 7))
        (28, None)
    """
    if isinstance(x, dict) and isinstance(x.get("input_ids"), torch.Tensor):
        x = x["input_ids"]
    for t in nest.leaves(x):
        if t.dim() == 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return int(t.shape[0] * t.shape[1])
    return None


def _rows(x: Any) -> int:
    ts = nest.leaves(x)
    return int(ts[0].shape[0]) if ts and ts[0].dim() > 0 else 1


class _Timer:
    """Training seconds between marks: the host clock, or CUDA events read only when asked."""

    def __init__(self, clock: Callable[[], float], cuda: bool):
        self.clock, self.cuda = clock, cuda
        self.done = 0.0  # seconds of closed segments
        self.open: Any = None  # the start of the running segment (a time or an event)
        self.closed: list[tuple[Any, Any]] = []  # CUDA: (start, end) events not read yet

    def _mark(self) -> Any:
        if not self.cuda:
            return read_clock(self.clock)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        if self.open is None:
            self.open = self._mark()

    def stop(self) -> None:
        if self.open is None:
            return
        end, start, self.open = self._mark(), self.open, None
        if self.cuda:
            self.closed.append((start, end))
        else:
            self.done += end - start

    def take(self) -> float:
        """Seconds since the last take (a log point: CUDA events are read, waiting for them)."""
        running = self.open is not None
        self.stop()
        for start, end in self.closed:
            end.synchronize()
            self.done += start.elapsed_time(end) / 1000.0
        self.closed = []
        seconds, self.done = self.done, 0.0
        if running:
            self.start()
        return seconds


_THROUGHPUT_MONITOR_OPTIONS = declare(
    "ThroughputMonitor",
    Option("log_every_n_steps", "int", minimum=1, allow_none=True),
    Option("peak_flops", "number", positive=True, allow_none=True),
    Option("count_flops", "bool"),
    Option("clock", "callable", bad=(lambda: "now", lambda: None)),
)


class ThroughputMonitor(Callback):
    """Log training throughput (Lightning's ``ThroughputMonitor``): samples/s, batches/s, tokens/s.

    Each epoch's logs get ``throughput/samples_per_sec`` and ``throughput/batches_per_sec``
    (the epoch's training rows and batches over its training seconds, validation excluded),
    ``throughput/tokens_per_sec`` when the inputs are token batches (an integer ``(B, T)``
    tensor, or a dict's ``input_ids``: ``B * T`` tokens a batch), and, from the FLOPs of the
    first training batch of ``fit`` (counted once with
    :class:`~torch.utils.flop_counter.FlopCounterMode`, forward and backward),
    ``throughput/flops_per_step`` (one optimizer step: the batch's FLOPs times
    ``gradient_accumulation_steps``), ``throughput/flops_per_sec`` and, when the peak FLOP/s
    is known, ``throughput/mfu`` (model FLOPs utilization, in ``[0, 1]``). The peak is
    ``peak_flops`` if given, else the table of common GPUs (:func:`peak_flops_of`) for the
    device and ``precision``; on a CPU without ``peak_flops`` there is no ``mfu`` key. With
    ``log_every_n_steps`` the same keys go into the batch logs every n training batches, over
    the batches since the last such point (a host read of the clock, and on CUDA of two
    events, there and only there). The values are per process (under torchrun, multiply by
    the world size for the whole job). A module run through ``torch.compile`` hides its
    operators from the counter: no FLOPs keys then.

    Args:
        log_every_n_steps: also log in the batch logs every n training batches (``None``: epochs only).
        peak_flops: the device's peak FLOP/s for MFU (a number > 0), overriding the table.
        count_flops: count FLOPs on the first batch (``False``: no FLOPs or MFU keys).
        clock: the host clock, in seconds (``time.perf_counter``; a test may pass a fake one).

    Raises:
        TypeError, ValueError: bad arguments (checked when it is created).

    Example:
        >>> import torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(4, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(torch.ones(8, 4), torch.ones(8, 1), batch_size=4, verbose=0,
        ...                     callbacks=[ThroughputMonitor(peak_flops=1e12)])
        >>> history.history["throughput/flops_per_step"]  # forward 2*4*4*1, backward the same for the weights
        [64.0]
        >>> sorted(k for k in history.history if k.startswith("throughput/"))
        ['throughput/batches_per_sec', 'throughput/flops_per_sec', 'throughput/flops_per_step', \
'throughput/mfu', 'throughput/samples_per_sec']
    """

    @declared(_THROUGHPUT_MONITOR_OPTIONS)
    def __init__(
        self,
        log_every_n_steps: int | None = None,
        peak_flops: float | None = None,
        count_flops: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ):
        super().__init__()
        check_int("log_every_n_steps", log_every_n_steps, 1, allow_none=True)
        check_number("peak_flops", peak_flops, positive=True, allow_none=True)
        check_bool("count_flops", count_flops)
        if not callable(clock):
            raise TypeError(f"Expected `clock` to be a function returning seconds. Received: clock={clock!r}.")
        self.log_every_n_steps, self.peak_flops, self.count_flops = log_every_n_steps, peak_flops, count_flops
        self.clock = clock
        self.flops_per_batch: int | None = None
        self._counter: FlopCounterMode | None = None
        self._epoch: tuple[int, int, int] = (0, 0, 0)  # (rows, batches, tokens) since the last log point
        self._window: tuple[int, int, int] = (0, 0, 0)
        self._epoch_timer = self._window_timer = _Timer(clock, False)

    def on_train_begin(self, logs=None):
        cuda = self.model.device.type == "cuda"
        self._epoch_timer, self._window_timer = _Timer(self.clock, cuda), _Timer(self.clock, cuda)
        self._tokens_seen = False
        self.flops_per_batch = None
        self._flops_pending = self.count_flops
        self._peak = self.peak_flops
        if self._peak is None and cuda:
            self._peak = peak_flops_of(torch.cuda.get_device_name(self.model.device), self.model.precision)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = self._window = (0, 0, 0)
        self._epoch_timer.take()
        self._window_timer.take()
        self._epoch_timer.start()
        self._window_timer.start()

    def on_train_batch_begin(self, batch, logs=None):
        if self._flops_pending:
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def on_train_batch_end(self, batch, logs=None):
        if self._counter is not None:
            self._close_counter()
        x = self.model.train_batch[0] if self.model.train_batch is not None else None
        tokens = token_count(x) if x is not None else None
        self._tokens_seen = self._tokens_seen or tokens is not None
        add = (_rows(x) if x is not None else 0, 1, tokens or 0)
        self._epoch = (self._epoch[0] + add[0], self._epoch[1] + 1, self._epoch[2] + add[2])
        self._window = (self._window[0] + add[0], self._window[1] + 1, self._window[2] + add[2])
        n = self.log_every_n_steps
        if n is not None and logs is not None and self._window[1] >= n:
            logs.update(self._rates(self._window, self._window_timer.take()))
            self._window = (0, 0, 0)

    def _close_counter(self) -> None:
        counter, self._counter, self._flops_pending = self._counter, None, False
        if counter is None:
            return
        counter.__exit__(None, None, None)
        total = counter.get_total_flops()
        self.flops_per_batch = int(total) if total else None

    def on_test_begin(self, logs=None):
        self._epoch_timer.stop()  # validation is not training time
        self._window_timer.stop()

    def on_test_end(self, logs=None):
        if self.model.train_batch is not None or self._epoch[1]:  # inside an epoch of fit
            self._epoch_timer.start()
            self._window_timer.start()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and self._epoch[1]:
            logs.update(self._rates(self._epoch, self._epoch_timer.take()))

    def _rates(self, counts: tuple[int, int, int], seconds: float) -> dict[str, float]:
        rows, batches, tokens = counts
        if seconds <= 0:
            return {}
        out = {"throughput/samples_per_sec": rows / seconds, "throughput/batches_per_sec": batches / seconds}
        if self._tokens_seen:
            out["throughput/tokens_per_sec"] = tokens / seconds
        if self.flops_per_batch is not None:
            out["throughput/flops_per_step"] = float(self.flops_per_batch * self.model.gradient_accumulation_steps)
            flops_per_sec = self.flops_per_batch * batches / seconds
            out["throughput/flops_per_sec"] = flops_per_sec
            if self._peak is not None:
                out["throughput/mfu"] = flops_per_sec / self._peak
        return out

    def on_train_end(self, logs=None):
        self.close()

    def close(self) -> None:
        if self._counter is not None:  # fit raised inside the counted batch
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)
