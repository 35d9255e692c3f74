"""``TensorBoard``: the logs as TensorBoard events, in Keras' layout (``torch.utils.tensorboard``).

Writes on rank 0 only when ``torch.distributed`` is initialized, and opens its files at the
first write, so a ``fit`` that fails its checks before the first step leaves no file behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fitkit.callbacks.mixins import StopsWriting
from fitkit.callbacks.monitor import StatefulCallback
from fitkit.checks import check_bool, check_int, read_clock
from fitkit.checks.declared import Option, declare, declared, every_option
from fitkit.distributed.group import is_rank_zero
from fitkit.files import check_target, to_python
from fitkit.files.preflight import check_writable_template

__all__ = ["TensorBoard"]


_TENSORBOARD_OPTIONS = declare(
    "TensorBoard",
    Option("log_dir", "path"),
    every_option("update_freq"),
    Option(
        "histogram_freq",
        "int",
        minimum=0,
        fix="pass every how many epochs to write weight histograms, e.g. histogram_freq=1, or 0 for none.",
    ),
    Option("write_steps_per_second", "bool"),
    Option("clock", "custom", checked_in="TensorBoard.__init__", bad=(3.0, "now")),  # read with write_steps_per_second
)


class TensorBoard(StopsWriting, StatefulCallback):
    """Write the logs as TensorBoard events with ``torch.utils.tensorboard`` (no TensorFlow).

    Keras' layout: training values go to ``log_dir/train`` and ``val_`` values to
    ``log_dir/validation`` under the same tag, so TensorBoard overlays them: ``epoch_loss``
    at step ``epoch`` (0-based). Every evaluation (each validation of ``fit``, and
    ``evaluate(callbacks=[...])``) is also written to ``log_dir/validation`` as
    ``evaluation_<key>_vs_iterations`` (``evaluation_loss_vs_iterations``, ...) at step
    ``model.global_step``, as Keras writes them at ``optimizer.iterations``. With an int
    ``update_freq``, batch logs (running epoch means) are also written every that many
    batches as ``batch_<key>`` at the optimizer step; reading them syncs with the device,
    once per write. With ``fit(validation_interval=...)`` each validation is also written as
    ``step_<key>`` in ``log_dir/validation`` at its ``global_step``.

    Args:
        log_dir: the folder TensorBoard reads (``tensorboard --logdir log_dir``).
        update_freq: ``"epoch"``, or an int number of batches.
        histogram_freq: every that many epochs (0-based epochs 0, n, 2n, ..., as Keras), a
            histogram of each floating-point tensor of ``model.state_dict()`` (parameters and
            buffers, as Keras' layer weights), tagged ``<name with / for .>/histogram``
            (``0/weight/histogram``) in ``log_dir/train`` at step ``epoch``; non-finite values
            are left out of a histogram. 0: none (Keras' default).
        write_steps_per_second: also write the optimizer steps per second of the epoch so far
            (steps since the epoch began over the seconds of ``clock`` since then):
            ``epoch_steps_per_second`` at each epoch end and, with an int ``update_freq``,
            ``batch_steps_per_second`` with the batch values (Keras' option). Not added to the
            logs. Skipped when no time has passed.
        clock: the host clock, in seconds (``time.perf_counter``; a test may pass a fake one).

    Raises:
        ImportError: the ``tensorboard`` package is missing (``pip install ".[tensorboard]"`` from a checkout).
        ValueError: a bad ``update_freq`` or ``histogram_freq``; ``log_dir`` is empty or an
            existing file.
        TypeError: ``write_steps_per_second`` not a bool, ``clock`` not callable.

    Example:
        >>> import tempfile, torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> log_dir = tempfile.mkdtemp()
        >>> _ = model.fit(torch.zeros(4, 1), torch.zeros(4, 1), callbacks=[TensorBoard(log_dir)], verbose=0)
        >>> sorted(p.name for p in Path(log_dir).iterdir())
        ['train']
    """

    skip_in_fast_dev_run = True  # it writes files: fit(fast_dev_run=...) leaves it out

    @declared(_TENSORBOARD_OPTIONS)
    def __init__(
        self,
        log_dir: str | os.PathLike,
        update_freq: str | int = "epoch",
        histogram_freq: int = 0,
        write_steps_per_second: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ):
        super().__init__()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "The TensorBoard callback needs the `tensorboard` package. Install the `tensorboard` extra: "
                "`pip install '.[tensorboard]'` from a checkout (`pip install 'torch-fitkit[tensorboard]'` "
                "once released; TensorFlow is not needed)."
            ) from None
        bad = isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
        if update_freq != "epoch" and bad:
            raise ValueError(
                f"Expected `update_freq` to be 'epoch' or a positive int. Received: update_freq={update_freq!r}."
            )
        check_int(
            "histogram_freq",
            histogram_freq,
            0,
            fix="pass every how many epochs to write weight histograms, e.g. histogram_freq=1, or 0 for none.",
        )
        check_bool("write_steps_per_second", write_steps_per_second)
        if not callable(clock):
            raise TypeError(f"Expected `clock` to be a callable returning seconds. Received: clock={clock!r}.")
        self.histogram_freq, self.write_steps_per_second, self.clock = histogram_freq, write_steps_per_second, clock
        self._epoch_start: tuple[float, int] | None = None  # (clock, global_step) at the epoch start
        self._writer_cls = SummaryWriter
        self.log_dir, self.update_freq = Path(check_target(log_dir, "log_dir", "TensorBoard", "folder")), update_freq
        self._writers: dict[str, Any] = {}
        self._reset()

    def _reset(self) -> None:
        self._batches_seen = 0

    def _get_state(self) -> dict[str, Any]:
        return {"batches_seen": self._batches_seen}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._batches_seen = state["batches_seen"]

    def _state_problems(self, state: Any) -> list[str]:
        from fitkit.files.content import is_count, typed_problems

        return typed_problems(state, {"batches_seen": (is_count, "an int >= 0")}, "its state")

    def _safely(self, write: Callable[[], None]) -> None:
        """Run ``write`` (rank 0's writes); a write that fails stops this fit's writing with one
        warning (:class:`~fitkit.callbacks.logging.StopsWriting`), and the run goes on."""
        if self._stopped:
            return
        try:
            write()
        except OSError as e:
            writers, self._writers = self._writers, {}
            for w in writers.values():
                with contextlib.suppress(Exception):  # its thread may hold the same error
                    w.close()
            self._stop_writing(e)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._stopped = False  # a new fit tries again
        if is_rank_zero():  # before step 1: a folder it can write
            check_writable_template(
                str(self.log_dir / "validation" / "events.out.tfevents.0"), None, "TensorBoard", "log_dir"
            )

    def _check_folders(self) -> None:
        """A writer whose folder was deleted fails in its thread with a raw error: name it."""
        gone = [name for name in self._writers if not (self.log_dir / name).is_dir()]
        if gone:
            self.close()
            raise FileNotFoundError(
                errno.ENOENT,
                f"TensorBoard's folder {str(self.log_dir / gone[0])!r} was deleted while fit was "
                "writing to it, so its event file is gone. Fix: leave `log_dir` in place while fit runs, or "
                "pass a new one.",
            )

    def _writer(self, name: str):
        if name not in self._writers:
            self._writers[name] = self._writer_cls(log_dir=str(self.log_dir / name))
        return self._writers[name]

    def _write(self, prefix: str, logs: Any, step: int, suffix: str = "") -> None:
        for key in list(logs):
            value = logs[key]
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    continue
                value = value.item()
            value = to_python(value)  # numpy scalars too
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            run, tag = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
            self._writer(run).add_scalar(f"{prefix}_{tag}{suffix}", value, step)

    def _steps_per_second(self) -> dict[str, float]:
        """``{"steps_per_second": ...}`` of the epoch so far, or ``{}`` (not asked, no time passed)."""
        if not self.write_steps_per_second or self._epoch_start is None:
            return {}
        start, first_step = self._epoch_start
        seconds = read_clock(self.clock) - start
        return {"steps_per_second": (self.model.global_step - first_step) / seconds} if seconds > 0 else {}

    def on_epoch_begin(self, epoch, logs=None):
        if self.write_steps_per_second:
            self._epoch_start = (read_clock(self.clock), self.model.global_step)

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq == "epoch":
            return
        self._batches_seen += 1
        if self._batches_seen >= self.update_freq:
            self._batches_seen = 0
            if is_rank_zero():
                values = {**(logs or {}), **self._steps_per_second()}
                self._safely(lambda: self._checked_write("batch", values, self.model.global_step))

    def on_epoch_end(self, epoch, logs=None):
        # Every rank takes the weights (an FSDP state dict is gathered collectively); rank 0 writes.
        weights = self._weights() if self.histogram_freq and epoch % self.histogram_freq == 0 else {}
        if is_rank_zero():
            self._safely(lambda: self._epoch_write(epoch, {**(logs or {}), **self._steps_per_second()}, weights))

    def _checked_write(self, prefix: str, logs: Any, step: int, suffix: str = "") -> None:
        self._check_folders()
        self._write(prefix, logs, step, suffix)

    def _epoch_write(self, epoch: int, logs: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
        self._checked_write("epoch", logs, epoch)
        for name, values in weights.items():
            self._writer("train").add_histogram(f"{name.replace('.', '/')}/histogram", values, epoch)
        for w in self._writers.values():
            w.flush()

    def _weights(self) -> dict[str, torch.Tensor]:
        """The floating-point tensors of ``model.state_dict()``, finite values only, on the CPU."""
        out = {}
        for name, tensor in self.model.state_dict().items():
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                values = tensor.detach().float().cpu().flatten()
                values = values[torch.isfinite(values)]
                if values.numel():
                    out[name] = values
        return out

    def on_test_end(self, logs=None):
        """Every evaluation: ``validation/evaluation_<key>_vs_iterations`` at ``global_step`` (Keras)."""
        if not is_rank_zero() or not logs:
            return
        values = {f"val_{k}": v for k, v in logs.items()}
        self._safely(lambda: self._checked_write("evaluation", values, self.model.global_step, "_vs_iterations"))
        if "do_validation" not in self.params:  # evaluate(callbacks=[...]): no fit closes the writers
            self._safely(self.close)

    def on_validation_end(self, logs=None):
        """Inside-epoch validations: ``validation/step_<key>`` at ``global_step``."""
        if self.params.get("validation_interval") and is_rank_zero() and logs:
            values = {k: v for k, v in logs.items() if k.startswith("val_")}
            self._safely(lambda: self._write("step", values, int(logs["step"])))

    def on_train_end(self, logs=None):
        self._safely(self.close)
        self._writers = {}  # closed, or dropped after a failed write

    def close(self) -> None:
        """Close the writers and their threads (idempotent; the next write opens new ones)."""
        writers, self._writers = self._writers, {}
        for name, w in writers.items():
            try:
                w.close()
            except OSError:
                if (self.log_dir / name).is_dir():
                    raise  # a folder that was deleted: the error is _check_folders' to give
