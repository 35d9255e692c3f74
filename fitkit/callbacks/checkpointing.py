"""``ModelCheckpoint``, and what the callbacks that write checkpoints share.

``ModelCheckpoint`` and ``BackupAndRestore`` (:mod:`fitkit.callbacks.backup`) decide in
``on_train_batch_end`` / ``on_epoch_end`` (updating their own state) and write in the internal
``_save_on_*_end`` hooks, which run after every callback has seen the batch or epoch: a full
checkpoint then holds every callback's updated state and the history of that epoch. A backup
is written after the other files, so it never records a file that does not exist yet. Every
write is atomic (:func:`fitkit.files.atomic_save`), and only rank 0 writes when
``torch.distributed`` is initialized.
"""

from __future__ import annotations

import datetime
import glob
import math
import os
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from fitkit.callbacks import checkpoint_options as _options
from fitkit.callbacks.checkpoint_paths import OPTIONAL_STATE as _OPTIONAL_STATE
from fitkit.callbacks.checkpoint_paths import STATE as _STATE
from fitkit.callbacks.checkpoint_paths import field_names as _field_names
from fitkit.callbacks.checkpoint_paths import glob_of as _glob_of
from fitkit.callbacks.checkpoint_paths import last_path as _last_path
from fitkit.callbacks.locking import restore_name, take_lock
from fitkit.callbacks.monitor import (
    StatefulCallback,
    check_log_key,
    is_improvement,
    may_add_keys,
    monitor_value,
    per_validation,
    resolve_mode,
)
from fitkit.callbacks.scoring import scored_weights
from fitkit.checks import FitkitWarning, check_bool, check_every, check_int, check_mode, check_number, read_clock
from fitkit.checks.declared import Option, declare, declared, mode_option, verbose_option
from fitkit.distributed import is_distributed, say
from fitkit.distributed.group import is_rank_zero
from fitkit.files import check_target, remove_stale_temps
from fitkit.files.content import typed_problems
from fitkit.files.locks import FileLock
from fitkit.files.owned import Owned
from fitkit.files.preflight import check_writable_template

__all__ = ["ModelCheckpoint"]


_MODEL_CHECKPOINT_OPTIONS = declare(
    "ModelCheckpoint",
    Option("filepath", "path"),
    Option("monitor", "text"),
    mode_option(),
    Option("save_best_only", "bool"),
    Option("save_weights_only", "bool"),
    Option("save_top_k", "int", minimum=1, allow_none=True),
    Option("save_freq", "custom", checked_in="ModelCheckpoint.__init__", bad=(0, -1, "step", 1.5)),
    verbose_option(),
    Option("initial_value_threshold", "custom", checked_in="ModelCheckpoint.__init__", bad=("0.5", float("nan"))),
    Option("every_n_epochs", "int", minimum=0),
    Option("save_last", "custom", checked_in="ModelCheckpoint.__init__", bad=(5, 1.5)),
    Option("keep_last", "int", minimum=0, allow_none=True),
    Option("save_first_step", "bool"),
    Option(
        "save_on_exception", "custom", checked_in="fitkit.callbacks.checkpoint_options.exception_path", bad=(5, 1.5)
    ),
    Option("save_overwrite", "bool"),
    Option("train_time_interval", "custom", checked_in="ModelCheckpoint.__init__", bad=(60, "1h")),
    Option("clock", "callable", bad=(lambda: "now",)),
)


@dataclass(frozen=True)
class CheckpointOptions:
    """A :class:`ModelCheckpoint`'s arguments, checked (see the class for each); the callback's
    read-only attributes of the same names read them.

    Attributes:
        last_path: ``save_last``'s file, or ``None``.
        exception_path: ``save_on_exception``'s file, or ``None``.
        fields: the names ``filepath`` formats (``{epoch}``, ``{val_loss}``, ...).
        fraction: a float ``save_freq``'s fraction of the run, or ``None``.
    """

    filepath: str
    monitor: str
    mode: str
    save_best_only: bool
    save_weights_only: bool
    save_top_k: int | None
    save_freq: Any
    verbose: int
    initial_value_threshold: float | None
    every_n_epochs: int
    last_path: str | None
    keep_last: int | None
    exception_path: str | None
    save_overwrite: bool
    save_first_step: bool
    train_time_interval: datetime.timedelta | None
    clock: Callable[[], float]
    fields: frozenset[str]
    fraction: Fraction | None

    @property
    def ranked(self) -> bool:
        """Whether files are ranked by ``monitor`` (``save_best_only`` or ``save_top_k``)."""
        return self.save_best_only or self.save_top_k is not None


@dataclass
class _Running:
    """What a :class:`ModelCheckpoint` tracks while fits run (not its options, not its kept files)."""

    batches_seen: int = 0  # batches since the last save (an int save_freq)
    last_batch: int | None = None  # the last batch seen (the final save's {batch})
    pending: tuple[str, list[str], int] | None = None  # (path, evicted, epoch) to write
    pending_last: int | None = None  # the epoch whose event writes `last_path`
    first_done: bool = False  # save_first_step: written in this fit
    save_steps: frozenset[int] = frozenset()  # a fractional save_freq: the global steps that save
    since: float = 0.0  # train_time_interval: the clock at the fit's start or the last save
    time_agreed: bool = False  # under torchrun: the ranks agreed the interval has passed
    signalled: bool = False  # a SIGTERM / SIGINT stopped this fit
    writing: bool = False  # writing its own file: not adopted by save_checkpoint (run_files.adopt)
    existing: set[str] = field(default_factory=set)  # files on disk when the fit began (save_overwrite=False)
    own: set[str] = field(default_factory=set)  # files this callback wrote (also before a resume)

    def reset(self) -> None:
        """A fresh start's counts and pending writes (the clock, the signal and the files known are kept)."""
        self.batches_seen, self.last_batch, self.pending, self.pending_last = 0, None, None, None
        self.first_done, self.save_steps = False, frozenset()


def _option(name: str) -> Any:
    """A read-only attribute of :class:`ModelCheckpoint` that reads its :class:`CheckpointOptions`."""
    return property(lambda self: getattr(self.options, name), doc=f"``{name}``, as checked (read-only).")


class ModelCheckpoint(StatefulCallback):
    """Save the model (or only its weights) at the end of epochs or every N batches.

    ``filepath`` is a format string: ``{epoch}`` is the 1-based epoch, ``{batch}`` the 1-based
    batch (with an int ``save_freq``), and any log key formats too, e.g.
    ``"ckpt/{epoch:02d}-{val_loss:.2f}.pt"``. A full checkpoint is
    ``model.save_checkpoint``'s file (resumable with ``load_checkpoint``); ``save_weights_only``
    writes the module's state dict. ``{epoch}`` keeps counting after a resume, and the best
    value is part of the checkpoint, so a resumed run never overwrites a better "best" file
    with a worse one.

    Args:
        filepath: where to write; a format string.
        monitor: the log key that ranks checkpoints (with ``save_best_only`` / ``save_top_k``).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (see :func:`fitkit.callbacks.monitor.resolve_mode`).
        save_best_only: write only when ``monitor`` improves on the best so far (Keras).
        save_weights_only: write the module's state dict instead of the full training state.
        save_top_k: keep exactly the ``k`` best files: a better one is written, then the worst
            beyond ``k`` is deleted. ``filepath`` must then differ per save (``{epoch}``).
        save_freq: ``"epoch"``, or an int: every that many batches (full checkpoints wait for
            the end of a gradient accumulation group). With an int, the run's last batch is
            saved too when training ends between two saves (``max_steps=9`` with ``save_freq=5``:
            batches 5 and 9), as the Transformers Trainer and torchtitan save the final step.
            A float ``f`` in ``(0, 1]``: a fraction of the run (Composer's ``"0.25dur"``):
            after the first optimizer step at or past each multiple of ``f`` of
            ``params["total_steps"]`` (``global_step >= ceil(i * f * total_steps)``), and at
            the last one, so ``0.25`` over 10 planned steps saves after steps 3, 5, 8 and 10;
            the steps count ``global_step`` as the plan does (:mod:`fitkit.training.budget`),
            so a resumed run saves where the uninterrupted one would; a run that ends early
            saves its last step too. ``ValueError`` at ``on_train_begin`` when the planned
            steps are unknown (see :mod:`fitkit.callbacks.checkpoint_options`).
        verbose: 1 prints a line at each save.
        initial_value_threshold: with ``save_best_only`` or ``save_top_k``, the value to beat
            before anything is saved (Keras): it is the starting "best", so no file is written
            until ``monitor`` is strictly better than it.
        every_n_epochs: decide only every n-th epoch, counted 1-based: epochs n, 2n, ...
            (Lightning's ``every_n_epochs``, Poutyne's ``period``); the others write nothing.
            0 writes no file of ``filepath`` at all, only ``save_last``'s, every epoch
            (Lightning). Only with ``save_freq="epoch"``.
        save_last: also keep ``last.pt`` in the folder of ``filepath`` (or the path given as a
            string): the full training state (resumable, whatever ``save_weights_only`` says),
            replaced at every save event, i.e. every epoch (or ``save_freq`` batches) that
            ``every_n_epochs`` lets through, whether or not the ranked file was written there
            (Lightning's ``save_last``). Never evicted by ``save_top_k``. A path that ``filepath``
            formats to (its own file) is refused: the two writes would overwrite each other.
        keep_last: keep only the ``n`` newest files of ``filepath`` this callback wrote,
            deleting older ones, oldest first, after each new file is written; the best file
            it tracks (``save_best_only``) is never deleted, nor any file it did not write.
            The list carries over in checkpoints, so a resumed run goes on rotating it. The
            peers' names: the Trainer's ``save_total_limit``, torchtitan's ``keep_latest_k``,
            Accelerate's ``total_limit``. Not with ``save_top_k`` (which keeps the best k).
            ``0``: keep none after the run: the newest is kept while it runs (a crash leaves one
            to resume from) and deleted when ``fit`` ends (kept when a SIGTERM / SIGINT stops
            it: the preempted run resumes from it), so only the best file
            (``save_best_only``) and ``save_last``'s remain (one of them is required).
        save_overwrite: ``False``: never replace a file that was on disk when the fit began
            (Composer's ``overwrite=False``): writing one raises ``FileExistsError`` and writes
            nothing. Files this callback wrote, also before a resume, are its own to replace.
        save_on_exception: ``True`` (``on_exception.pt`` beside the files) or a path: when
            ``fit`` raises an ``Exception`` after at least one step, write a full checkpoint of
            the last completed batch there before the error goes on (Lightning's
            ``save_on_exception``), so ``load_checkpoint`` resumes the crashed run. Not on a
            kill, ``KeyboardInterrupt`` or ``SystemExit`` (a signal is ``BackupAndRestore``'s).
            Under gradient accumulation, a crash inside a window leaves that window's gradients
            out of the file (its earlier micro-batches count as trained); under torchrun every
            rank must raise, as a save is a collective. With ``save_overwrite=False`` a file
            there before the fit began is left as it was (the error goes on, nothing written).
        save_first_step: also write a file of ``filepath`` after the first optimizer step of
            each fit (the Trainer's ``logging_first_step``), so a broken path or a state that
            does not save fails at once. Not with ``save_best_only`` / ``save_top_k``, nor with
            fields other than ``{epoch}``, ``{batch}`` and ``{step}``.
        train_time_interval: a ``datetime.timedelta``: save at the first batch end (of a whole
            accumulation group) after that much training time since the fit began or since
            the last save, as Lightning's ``train_time_interval`` (the time restarts with each
            ``fit`` call; not with ``save_freq`` or ``every_n_epochs``). Under torchrun the ranks
            agree where they agree on signals (after at most 8 steps, about every 2 s) and save
            after the next step, all together.
        clock: seconds for ``train_time_interval`` (``time.monotonic``; a fake clock in tests).

    Raises:
        ValueError: a bad ``filepath`` (an existing folder too), ``mode``, ``save_freq``, ``save_top_k`` or
            ``every_n_epochs``, both ``save_best_only`` and ``save_top_k``, an
            ``initial_value_threshold`` without either, ``every_n_epochs`` with an int
            ``save_freq``; at ``on_train_begin``, a direction ``auto`` cannot infer; when
            saving, a key the logs do not hold.
        TypeError: ``initial_value_threshold`` is not a number, ``save_last`` neither a bool
            nor a path, ``train_time_interval`` not a positive timedelta, ``clock`` not callable.

    Example:
        >>> import os, tempfile, torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> folder = tempfile.mkdtemp()
        >>> ckpt = ModelCheckpoint(os.path.join(folder, "ep{epoch:02d}.pt"), save_weights_only=True)
        >>> _ = model.fit(torch.zeros(4, 1), torch.zeros(4, 1), epochs=2, callbacks=[ckpt], verbose=0)
        >>> sorted(os.listdir(folder))
        ['ep01.pt', 'ep02.pt']
    """

    skip_in_fast_dev_run = True  # it writes files: fit(fast_dev_run=...) leaves it out
    filepath = _option("filepath")
    monitor = _option("monitor")
    mode = _option("mode")
    save_best_only = _option("save_best_only")
    save_weights_only = _option("save_weights_only")
    save_top_k = _option("save_top_k")
    save_freq = _option("save_freq")
    verbose = _option("verbose")
    initial_value_threshold = _option("initial_value_threshold")
    every_n_epochs = _option("every_n_epochs")
    last_path = _option("last_path")
    keep_last = _option("keep_last")
    exception_path = _option("exception_path")
    save_overwrite = _option("save_overwrite")
    save_first_step = _option("save_first_step")
    train_time_interval = _option("train_time_interval")
    clock = _option("clock")

    @declared(_MODEL_CHECKPOINT_OPTIONS)
    def __init__(
        self,
        filepath: str | os.PathLike,
        monitor: str = "val_loss",
        mode: str = "auto",
        save_best_only: bool = False,
        save_weights_only: bool = False,
        save_top_k: int | None = None,
        save_freq: str | int = "epoch",
        verbose: int = 0,
        initial_value_threshold: float | None = None,
        every_n_epochs: int = 1,
        save_last: bool | str | os.PathLike = False,
        keep_last: int | None = None,
        train_time_interval: datetime.timedelta | None = None,
        clock: Callable[[], float] = time.monotonic,
        save_overwrite: bool = True,
        save_on_exception: bool | str | os.PathLike = False,
        save_first_step: bool = False,
    ):
        super().__init__()
        _check_time_interval(train_time_interval, save_freq, every_n_epochs, clock)
        check_bool("save_best_only", save_best_only)
        check_bool("save_weights_only", save_weights_only)
        if not isinstance(monitor, str):
            raise TypeError(f"Expected `monitor` to be a log key (str). Received: monitor={monitor!r}.")
        path = check_target(filepath, "filepath", "ModelCheckpoint")
        fields = _field_names(path)
        check_mode(mode)
        fraction = self._check_freq(save_freq, verbose, every_n_epochs)
        if initial_value_threshold is not None:
            check_number("initial_value_threshold", initial_value_threshold, minimum=-math.inf)
            if not save_best_only and save_top_k is None:
                raise ValueError(
                    "`initial_value_threshold` is the value a checkpoint must beat, so it needs "
                    "`save_best_only=True` or `save_top_k=k`. Received neither."
                )
        last = _last_path(path, save_last)
        _check_retention(path, fields, last, keep_last, save_top_k, save_best_only)
        exception = _check_safety(
            path, fields, save_best_only, save_top_k, save_overwrite, save_on_exception, save_first_step
        )
        #: the arguments, checked (read-only attributes of the same names read them)
        self.options = CheckpointOptions(
            filepath=path,
            monitor=monitor,
            mode=mode,
            save_best_only=bool(save_best_only),
            save_weights_only=bool(save_weights_only),
            save_top_k=save_top_k,
            save_freq=save_freq,
            verbose=verbose,
            initial_value_threshold=initial_value_threshold,
            every_n_epochs=every_n_epochs,
            last_path=last,
            keep_last=keep_last,
            exception_path=exception,
            save_overwrite=bool(save_overwrite),
            save_first_step=bool(save_first_step),
            train_time_interval=train_time_interval,
            clock=clock,
            fields=frozenset(fields),
            fraction=fraction,
        )
        self._mode = mode if mode != "auto" else None
        self._run = _Running()  # what the fits track: counts, files to write, files known
        self._owned = Owned(self.filepath, "ModelCheckpoint")
        self._locks: list[FileLock] = []
        self._reset()

    @staticmethod
    def _check_freq(save_freq: Any, verbose: Any, every_n_epochs: Any) -> Fraction | None:
        """``save_freq``, ``verbose`` and ``every_n_epochs``; returns ``save_freq``'s fraction of an epoch, if one."""
        fraction = _options.check_fraction(save_freq)
        if fraction is None:
            check_every("save_freq", save_freq, "epoch", "batches")
        if not isinstance(verbose, bool):
            check_int("verbose", verbose, 0)
        check_int("every_n_epochs", every_n_epochs, 0)
        if every_n_epochs != 1 and save_freq != "epoch":
            raise ValueError(
                f"`every_n_epochs` counts epochs, but save_freq={save_freq!r} saves every that many "
                "batches. Fix: pass one of them."
            )
        return fraction

    @property
    def _ranked(self) -> bool:
        return self.options.ranked

    def _reset(self) -> None:
        t = self.initial_value_threshold
        self.best: float | None = None if t is None else float(t)
        self.best_path: str | None = None
        self.kept: list[tuple[float, str]] = []  # (value, path) of the files save_top_k keeps
        self.recent: list[str] = []  # files written, oldest first (keep_last's rotation)
        self._run.reset()

    def _get_state(self) -> dict[str, Any]:
        # File names relative to the template's folder: a copied run folder resumes with its
        # own files, and a restored name is checked against the folder (_set_state).
        rel = self._owned.relative
        return {
            "best": self.best,
            "best_path": None if self.best_path is None else rel(self.best_path),
            "kept": [[v, rel(p)] for v, p in self.kept],
            "batches_seen": self._run.batches_seen,
        } | ({"recent": [rel(p) for p in self.recent]} if self.keep_last is not None else {})

    def _set_state(self, state: dict[str, Any]) -> None:
        self.best = state["best"]
        best = state["best_path"]
        self.best_path = None if best is None else restore_name(self._owned, best, "its best file")
        kept = [(float(v), restore_name(self._owned, p, "a kept file")) for v, p in state["kept"]]
        self.kept = [(v, p) for v, p in kept if p is not None]  # never a file outside the folder
        self._run.batches_seen = state["batches_seen"]
        recent = [restore_name(self._owned, p, "a recent file") for p in state.get("recent", [])]
        self.recent = [p for p in recent if p is not None]
        # save_overwrite=False: the files the resumed run wrote are its own to replace
        own = [*self.recent, *(p for _, p in self.kept), self.best_path]
        self._run.own |= {os.path.abspath(p) for p in own if p is not None}

    def _state_problems(self, state: Any) -> list[str]:
        return typed_problems(state, _STATE, "its state", _OPTIONAL_STATE)

    def owns(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` is a file of ``filepath``'s pattern inside its folder (the only
        files this callback deletes, overwrites or lets ``MLflowLogger`` upload)."""
        last = self.last_path
        return self._owned.owns(path) or (last is not None and os.path.abspath(path) == os.path.abspath(last))

    def on_train_begin(self, logs=None):
        # Before step 1: every key the decisions read can hold a value when they are taken.
        batch_level = (
            (1 if self.train_time_interval is not None else None)
            if self.save_freq == "epoch"
            else (1 if self.options.fraction is not None else self.save_freq)
        )
        self._run.since, self._run.time_agreed = (
            read_clock(self.clock),
            False,
        )  # the interval counts from each fit's start
        if "batch" in self.options.fields and batch_level is None:
            raise ValueError(
                f"ModelCheckpoint's filepath {self.filepath!r} uses {{batch}}, but save_freq='epoch' "
                "saves at epoch ends, where there is no batch. Fix: pass an int `save_freq`, or drop {batch}."
            )
        for name in sorted(self.options.fields - {"epoch", "batch", "step"}):
            subject = f"ModelCheckpoint's filepath {self.filepath!r} uses {{{name}}}"
            check_log_key(name, self.params, self.model, "ModelCheckpoint", subject=subject, batch_level=batch_level)
        if self._ranked:
            check_log_key(self.monitor, self.params, self.model, "ModelCheckpoint", batch_level=batch_level)
            self._check_schedules_meet()
            self._mode = resolve_mode(self.monitor, self.mode, self.model, "ModelCheckpoint")
        if is_rank_zero():
            check_writable_template(self.filepath, self.options.fields, "ModelCheckpoint", "filepath")
            if self.last_path is not None:
                check_writable_template(self.last_path, None, "ModelCheckpoint", "save_last")
            self._lock()
        super().on_train_begin(logs)
        self._run.pending = self._run.pending_last = None  # never a file decided by a fit that raised
        self._plan_fraction()  # before step 1 (an unknown plan is refused), after the state's reset above
        self._run.first_done = self._run.signalled = False
        if not self.save_overwrite:  # what is on disk now is not this fit's to replace
            paths = [*glob.glob(_glob_of(self.filepath)), self.last_path, self.exception_path]
            self._run.existing = {os.path.abspath(p) for p in paths if p is not None and os.path.exists(p)}
        if is_rank_zero():  # temp files of a write a kill interrupted: never a checkpoint
            folders, name = os.path.split(_glob_of(self.filepath))
            for folder in glob.glob(folders or os.curdir):
                remove_stale_temps(folder, name)

    def _plan_fraction(self) -> None:
        """A fractional ``save_freq``: the global steps that save, from the planned steps."""
        if self.options.fraction is None:
            return
        total = self.params.get("total_steps")
        if total is None:
            raise ValueError(
                f"ModelCheckpoint(save_freq={self.save_freq!r}) saves at fractions of the run's planned optimizer "
                "steps, but this fit's step count is unknown (params['total_steps'] is None: training data "
                "without a length and no max_steps). Fix: pass `max_steps=` or `steps_per_epoch=` to fit, or an "
                "int save_freq."
            )
        self._run.save_steps = _options.fraction_steps(self.options.fraction, int(total))
        if self.model.global_step >= total:  # a second fit on a trained model, its time not reset
            warnings.warn(
                f"ModelCheckpoint(save_freq={self.save_freq!r}) saves at fractions of the run's {total} planned "
                f"steps, counted in `global_step`, and the model has taken {self.model.global_step} already, so it "
                "saves only at the end. Fix: fit(..., reset_time=True) to start a fresh run, or an int save_freq.",
                category=FitkitWarning,
                stacklevel=2,
            )

    def _lock(self) -> None:
        """One lock per template (and one for ``last.pt``): a second run, or a second
        callback, writing the same files is refused before step 1."""
        self.close()
        folder = self._owned.root or os.curdir
        targets = [(os.path.join(folder, self._owned.lock_name()), f"the checkpoint files {self.filepath!r}")]
        if self.last_path is not None:
            last = Path(self.last_path)
            targets.append((str(last.parent / f".{last.name}.lock"), f"the file {self.last_path!r}"))
        for path, what in targets:
            self._locks.append(take_lock(path, what, "ModelCheckpoint"))

    def close(self) -> None:
        """Release the locks of this fit (idempotent)."""
        locks, self._locks = self._locks, []
        for lock in locks:
            lock.release()

    def _check_schedules_meet(self) -> None:
        """A ``val_`` monitor decided every n epochs needs a validation on one of those epochs."""
        scheduled = self.params.get("validation_epochs")
        epochs = self.params.get("epochs")
        if (
            not self.monitor.startswith("val_")
            or self.save_freq != "epoch"
            or not scheduled
            or epochs is None
            or not self.every_n_epochs
        ):
            return
        if may_add_keys(self.model):
            return  # a callback of the user's may write the key on other epochs
        decide = [e for e in range(min(scheduled), epochs) if (e + 1) % self.every_n_epochs == 0]
        if decide and not set(decide) & set(scheduled):
            raise ValueError(
                f"ModelCheckpoint decides at epochs {[e + 1 for e in decide]} (every_n_epochs="
                f"{self.every_n_epochs}), but validation runs at epochs {[e + 1 for e in scheduled]}, so "
                f"{self.monitor!r} never holds a value when it decides. Fix: make `validation_freq` and "
                "`every_n_epochs` meet (e.g. equal), or monitor a training key."
            )

    def on_epoch_end(self, epoch, logs=None):
        if self.train_time_interval is not None:
            return  # saved by training time only
        if self.save_freq == "epoch" and self.every_n_epochs == 0:
            self._run.pending_last = epoch if self.last_path is not None else None  # no ranked file (Lightning)
        elif self.save_freq == "epoch" and (epoch + 1) % self.every_n_epochs == 0 and not per_validation(self):
            self._decide(epoch, None, logs or {})

    def on_validation_end(self, logs=None):
        # Inside-epoch validation with a val_ monitor: decide at each validation ({step} names it).
        if (
            self.save_freq == "epoch"
            and self.every_n_epochs != 0
            and per_validation(self)
            and self.train_time_interval is None
        ):
            self._decide(self.model.epoch, None, logs or {})

    def _save_on_validation_end(self, logs=None):
        self._write()

    # -- train_time_interval: a time trigger (agreed over ranks where they agree on signals) --
    def time_due(self) -> bool:
        """This rank's clock says ``train_time_interval`` has passed since the last save."""
        interval = self.train_time_interval
        return interval is not None and read_clock(self.clock) - self._run.since >= interval.total_seconds()

    def time_agreed(self) -> None:
        """Under torchrun: the ranks agreed that the interval has passed; save at the next step."""
        self._run.time_agreed = True

    def _time_save(self, batch: int, logs: Any) -> None:
        if not is_distributed():
            due = self.time_due()
        else:
            due = self._run.time_agreed
        full = not self.save_weights_only or self.last_path is not None
        if due and (not full or self.model.closes_accumulation_window):  # a window's gradients: wait
            self._run.time_agreed, self._run.since = False, read_clock(self.clock)
            self._decide(self.model.epoch, batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        # A full checkpoint inside an accumulation group would lose its gradients: wait.
        o, run = self.options, self._run  # read per batch: no property call
        full = not o.save_weights_only or o.last_path is not None
        closes = not full or self.model.closes_accumulation_window
        if o.save_first_step and not run.first_done and closes:
            run.first_done = True
            path = self._path(self.model.epoch, batch, logs or {})
            run.pending = None if path is None else (path, [], self.model.epoch)
        if o.train_time_interval is not None:
            self._time_save(batch, logs or {})
            return
        if o.save_freq == "epoch":
            return
        run.batches_seen += 1
        run.last_batch = batch
        due = self.model.global_step in run.save_steps if o.fraction is not None else run.batches_seen >= o.save_freq
        if due and closes:
            run.batches_seen = 0
            self._decide(self.model.epoch, batch, logs or {})

    def on_train_end(self, logs=None):
        # The final step of a run that ends between two saves is saved too (Trainer, torchtitan).
        if self.save_freq != "epoch" and self._run.batches_seen and self._run.last_batch is not None:
            self._run.batches_seen = 0
            self._decide(self.model.epoch, self._run.last_batch, logs or {})
            self._write()
        if self.keep_last == 0 and not self._run.signalled:  # keep none after the run (a preempted run keeps it)
            done, self.recent = self.recent, []
            if is_rank_zero():
                for p in done:
                    if p != self.best_path and self._owned.owns(p):
                        Path(p).unlink(missing_ok=True)

    def _save_on_interrupt(self) -> None:
        """A SIGTERM / SIGINT stops the fit: ``keep_last=0`` keeps its newest file for the resume."""
        self._run.signalled = True

    def _save_on_exception(self) -> None:
        """``fit`` raised after a step: the state of the last completed batch, resumable."""
        path = self.exception_path
        if path is not None and (self.save_overwrite or os.path.abspath(path) not in self._run.existing):
            self.model.save_checkpoint(path)
            say(self.verbose, f"fit raised: saved {self.exception_path}.")

    def _save_on_epoch_end(self, epoch, logs=None):
        self._write()

    def _save_on_batch_end(self, batch, logs=None):
        self._write()

    def _path(self, epoch: int, batch: int | None, logs: Any) -> str | None:
        """The file name of this save; ``None`` when a ``{val_...}`` field has no value this epoch."""
        values: dict[str, Any] = {"epoch": epoch + 1}
        if batch is not None:
            values["batch"] = batch + 1
        if "step" in self.options.fields:  # the global_step of the save (a validation's own, if any)
            values["step"] = int(logs["step"]) if "step" in logs else self.model.global_step
        for name in sorted(self.options.fields - values.keys()):
            try:
                value = monitor_value(logs, name, "ModelCheckpoint", self.params if batch is None else None, self.model)
            except ValueError:
                raise ValueError(
                    f"ModelCheckpoint's filepath {self.filepath!r} uses {{{name}}}, which the logs "
                    f"do not hold. Available keys: epoch, {'batch, ' if batch is not None else ''}"
                    f"{', '.join(sorted(logs))}."
                ) from None
            if value is None:  # validation_freq left this epoch out: no name, no file
                return None
            values[name] = value
        path = self.filepath.format(**values)
        if os.path.isdir(path):
            raise ValueError(
                f"ModelCheckpoint's filepath {self.filepath!r} names the existing folder {path!r}. "
                "Fix: end `filepath` with a file name, e.g. '.../ep{epoch:02d}.pt'."
            )
        return path

    def _decide(self, epoch: int, batch: int | None, logs: Any) -> None:
        """Update the best / kept files and set the file to write, if any."""
        if self.last_path is not None:
            self._run.pending_last = epoch  # every save event, ranked file written or not
        current = None
        if self._ranked:
            current = self._monitored(batch, logs)
            if current is None:  # validation_freq left this epoch out
                return
        path = self._path(epoch, batch, logs)
        if path is None:
            return
        evicted: list[str] = []
        # Ranked files only (save_top_k, save_best_only): both are set above then.
        cur: float = float("nan") if current is None else current
        mode: str = self._mode or "min"
        if self.save_top_k is not None:
            ranked_out = self._rank_top_k(cur, path, mode, self.save_top_k)
            if ranked_out is None:
                return
            evicted = ranked_out
        elif self.save_best_only:
            if self.best is not None and not is_improvement(cur, self.best, mode):
                return
            if math.isnan(cur):
                return
            self.best, self.best_path = cur, path
        self._run.pending = (path, evicted, epoch)

    def _monitored(self, batch: int | None, logs: Any) -> float | None:
        """The monitored value of this save event (``None``: not logged this epoch); resolves ``mode``."""
        # Batch logs never skip: a val_ monitor at batch level was refused at on_train_begin.
        params = self.params if batch is None else None
        current = monitor_value(logs, self.monitor, "ModelCheckpoint", params, self.model)
        if current is None:  # validation_freq left this epoch out
            return None
        if self._mode is None:  # hooks called directly, without on_train_begin
            self._mode = resolve_mode(self.monitor, self.mode, self.model, "ModelCheckpoint")
        return current

    def _rank_top_k(self, cur: float, path: str, mode: str, k: int) -> list[str] | None:
        """``save_top_k=k``: rank ``path`` among the kept files; the files it evicts, ``None`` when not kept."""
        if math.isnan(cur):
            return None
        t = self.initial_value_threshold
        if t is not None and not is_improvement(cur, t, mode):
            return None  # the top k are taken among the values that beat the threshold
        same = [v for v, p in self.kept if p == path]
        if same and not is_improvement(cur, same[0], mode):
            return None  # never overwrite a better file of the same name
        others = [(v, p) for v, p in self.kept if p != path]
        if len(others) >= k and not is_improvement(cur, self._worst(others)[0], mode):
            return None
        ranked = sorted(others + [(cur, path)], key=lambda vp: vp[0], reverse=mode == "max")
        self.kept, evicted = ranked[:k], [p for _, p in ranked[k:]]
        if self.best is None or is_improvement(cur, self.best, mode):
            self.best, self.best_path = cur, path
        return evicted

    def _write(self) -> None:
        self._write_ranked()
        if self._run.pending_last is not None:
            epoch, self._run.pending_last = self._run.pending_last, None
            self._refuse_overwrite(self.last_path)
            self.model.save_checkpoint(self.last_path)  # after the ranked file, as Lightning does
            say(self.verbose, f"Epoch {epoch + 1}: saved {self.last_path}.")

    def _write_ranked(self) -> None:
        if self._run.pending is None:
            return
        path, evicted, epoch = self._run.pending
        self._run.pending = None
        # Every rank calls save (gathering FSDP shards is a collective); rank 0 writes. The
        # file first, then the eviction: a crash in between leaves k + 1 files, never k - 1.
        self._refuse_overwrite(path)
        self._run.writing = True  # its own file: not adopted by save_checkpoint (run_files.adopt)
        try:
            with scored_weights(self.model, self.monitor) if self._ranked else nullcontext():
                if self.save_weights_only:
                    self.model.save_weights(path)
                else:
                    self.model.save_checkpoint(path)
        finally:
            self._run.writing = False
        self._evict(evicted)
        self.rotate(path)
        say(self.verbose, f"Epoch {epoch + 1}: saved {path}.")

    def rotate(self, path: str) -> None:
        """``path`` (a file of ``filepath``'s pattern, just written) joins the ``keep_last``
        rotation: the oldest files beyond ``keep_last`` are deleted (``keep_last=0``: beyond 1
        until the run ends), never the best file. ``save_checkpoint(path)`` calls it for a file
        of the pattern that the user writes (:mod:`fitkit.training.run_files`)."""
        if self.keep_last is None or self._run.writing or not self._owned.owns(path):
            return
        self.recent = [p for p in self.recent if p != path] + [path]
        old = self.recent[: max(0, len(self.recent) - max(1, self.keep_last))]
        self.recent = self.recent[len(old) :]
        self._evict([p for p in old if p != self.best_path])  # never the best one it tracks

    def _evict(self, evicted: list[str]) -> None:
        if is_rank_zero():
            for p in evicted:
                if self._owned.owns(p):  # only a file of this template, inside its folder
                    Path(p).unlink(missing_ok=True)

    @property
    def glob_pattern(self) -> str:
        """The glob of the files ``filepath`` formats to (each field is ``*``)."""
        return _glob_of(self.filepath)

    def _refuse_overwrite(self, path: str | None) -> None:
        if not self.save_overwrite and path is not None:
            _options.refuse_overwrite(path, self._run.existing, self._run.own)
            self._run.own.add(os.path.abspath(path))

    def _worst(self, kept: list[tuple[float, str]]) -> tuple[float, str]:
        pick = max if self._mode == "min" else min
        return pick(kept, key=lambda vp: vp[0])


def _check_time_interval(interval: Any, save_freq: Any, every_n_epochs: Any, clock: Any) -> None:
    """``ModelCheckpoint``'s ``train_time_interval`` and ``clock`` checked."""
    if interval is not None:
        if not isinstance(interval, datetime.timedelta) or interval.total_seconds() <= 0:
            raise TypeError(
                "Expected `train_time_interval` to be a datetime.timedelta > 0 (Lightning's). Received: "
                f"train_time_interval={interval!r}. Fix: e.g. datetime.timedelta(minutes=30)."
            )
        if save_freq != "epoch" or every_n_epochs != 1:
            raise ValueError(
                f"`train_time_interval` saves by training time, and save_freq={save_freq!r} / every_n_epochs="
                f"{every_n_epochs!r} say when to save too. Fix: pass one of them (as Lightning allows one)."
            )
    if not callable(clock):
        raise TypeError(f"Expected `clock` to be a callable returning seconds. Received: clock={clock!r}.")


def _check_retention(
    filepath: str, fields: set[str], last_path: str | None, keep_last: Any, save_top_k: Any, save_best_only: Any
) -> None:
    """``keep_last`` (the newest files) and ``save_top_k`` (the best): one list, of files that differ per save."""
    if keep_last is not None:
        check_int("keep_last", keep_last, 0, fix="pass how many newest files to keep, e.g. keep_last=3.")
        _options.check_retention(keep_last, save_best_only, last_path)
        if save_top_k is not None:
            raise ValueError(
                f"`keep_last={keep_last}` keeps the newest files and `save_top_k={save_top_k}` the best "
                "ones; one callback keeps one list. Fix: pass one of them (or two ModelCheckpoint callbacks "
                "with different filepaths)."
            )
        if not fields and keep_last:
            raise ValueError(
                f"`keep_last={keep_last}` keeps several files, so `filepath` must differ per save. Received: "
                f"{filepath!r}. Fix: add '{{epoch:02d}}' (or '{{batch}}' / '{{step}}') to it."
            )
    if save_top_k is not None:
        check_int("save_top_k", save_top_k, 1)
        if save_best_only:
            raise ValueError(
                "Pass either `save_best_only=True` (write each new best) or `save_top_k=k` "
                "(keep the k best files), not both."
            )
        if save_top_k > 1 and not fields:
            raise ValueError(
                f"`save_top_k={save_top_k}` keeps several files, so `filepath` must differ per "
                f"save. Received: {filepath!r}. Fix: add '{{epoch:02d}}' to it."
            )


def _check_safety(
    filepath: str,
    fields: set[str],
    save_best_only: Any,
    save_top_k: Any,
    save_overwrite: Any,
    save_on_exception: Any,
    save_first_step: Any,
) -> str | None:
    """``save_overwrite``, ``save_on_exception`` and ``save_first_step`` checked; returns the exception path."""
    check_bool("save_overwrite", save_overwrite)
    check_bool("save_first_step", save_first_step)
    exception_path = _options.exception_path(filepath, save_on_exception)
    ranked = bool(save_best_only) or save_top_k is not None
    if save_first_step and (ranked or fields - {"epoch", "batch", "step"}):
        raise ValueError(
            f"`save_first_step=True` writes a file after step 1, where no ranking or log value is known, but "
            f"filepath={filepath!r}, save_best_only={bool(save_best_only)}, save_top_k={save_top_k}. "
            "Fix: name the file with {epoch}, {batch} or {step} only, and drop the ranking (or use a second "
            "ModelCheckpoint for the first step)."
        )
    return exception_path
