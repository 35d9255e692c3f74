"""``BackupAndRestore``: back up the whole training state, resume a crashed fit exactly.

It decides in ``on_train_batch_end`` / ``on_epoch_end`` and writes in the internal
``_save_on_*_end`` hooks, after every other callback (and every other checkpoint file) of the
same event, so a backup never records a file that does not exist yet. It also writes at a
SIGTERM / SIGINT during fit (``_save_on_interrupt``) and keeps that backup for the re-run.
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from fitkit.callbacks.locking import take_lock
from fitkit.callbacks.mixins import SavesEveryNBatches
from fitkit.callbacks.monitor import StatefulCallback
from fitkit.checks import FitkitWarning, check_bool, check_every
from fitkit.checks.declared import Option, declare, declared, every_option
from fitkit.distributed import dcp
from fitkit.distributed.group import is_distributed, is_rank_zero
from fitkit.files import CheckpointError, check_target, remove_path, remove_stale_temps
from fitkit.files.content import is_count, typed_problems
from fitkit.files.locks import FileLock
from fitkit.files.preflight import check_writable
from fitkit.files.swap import readable_path, restore_interrupted

__all__ = ["BackupAndRestore"]


_BACKUP_AND_RESTORE_OPTIONS = declare(
    "BackupAndRestore",
    Option("backup_dir", "path"),
    every_option("save_freq"),
    Option("delete_checkpoint", "bool"),
    Option("async_save", "bool"),
)


class BackupAndRestore(SavesEveryNBatches, StatefulCallback):
    """Back up the training state so that a crashed ``fit``, run again, continues exactly.

    The backup is one full checkpoint, ``backup_dir/backup.pt``, replaced atomically at the end
    of each epoch or every ``save_freq`` batches; the one it replaces is kept as
    ``backup.prev.pt`` (Keras' ``double_checkpoint``). Under ``strategy="fsdp"`` both are
    folders of shards (``torch.distributed.checkpoint``: each rank writes and reads only its
    own; see :mod:`fitkit.distributed.dcp`), which resume at any world size. When the newest backup is damaged
    (:class:`fitkit.files.CheckpointError`), ``fit`` warns, naming both files, and resumes
    from the previous one. When ``fit`` starts and a backup exists, the
    model, optimizer, scheduler, RNG states, history and callback states are restored and
    training continues from where the backup was taken, inside an epoch included (the rest
    of that epoch sees the same batches in the same order). The resumed run ends with the same
    weights as an uninterrupted one (CPU, same seed). The backup is deleted after a ``fit``
    that ends normally (``delete_checkpoint``, both files) and kept when ``fit`` raises.

    Args:
        backup_dir: the folder of the backup; one per training job.
        save_freq: ``"epoch"``, or an int: every that many batches (at the end of a gradient
            accumulation group).
        delete_checkpoint: delete the backup when ``fit`` ends normally.
        async_save: for sharded backups (``strategy="fsdp"``): training waits only while the
            state is copied, a background thread writes it. At most one write is in flight;
            the next backup, a SIGTERM and the end of ``fit`` wait for it. A write cut short
            is never taken for a backup: the previous one resumes. One-file backups are
            always written at once.

    Raises:
        TypeError: ``backup_dir`` is not a str or a path.
        ValueError: a bad ``save_freq``; ``backup_dir`` is empty or an existing file.

    Example:
        >>> import os, tempfile, torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1), device="cpu")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> backup = BackupAndRestore(tempfile.mkdtemp(), delete_checkpoint=False)
        >>> _ = model.fit(torch.zeros(4, 1), torch.zeros(4, 1), epochs=2, callbacks=[backup], verbose=0)
        >>> history = model.fit(torch.zeros(4, 1), torch.zeros(4, 1), epochs=3, callbacks=[backup], verbose=0)
        >>> history.epoch  # epochs 0 and 1 came from the backup
        [0, 1, 2]
    """

    is_backup = True  # written after the other checkpoint files of the same event

    skip_in_fast_dev_run = True  # it writes files: fit(fast_dev_run=...) leaves it out

    @declared(_BACKUP_AND_RESTORE_OPTIONS)
    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        async_save: bool = False,
    ):
        super().__init__()
        check_bool("delete_checkpoint", delete_checkpoint)
        if not isinstance(async_save, bool):
            raise TypeError(f"Expected `async_save` to be a bool. Received: async_save={async_save!r}.")
        self.async_save = async_save
        check_every("save_freq", save_freq, "epoch", "batches")
        check_target(backup_dir, "backup_dir", "BackupAndRestore", "folder")
        self.backup_dir = Path(backup_dir)
        self.save_freq, self.delete_checkpoint = save_freq, bool(delete_checkpoint)
        self._lock: FileLock | None = None
        self._reset()

    @property
    def path(self) -> Path:
        """The backup file."""
        return self.backup_dir / "backup.pt"

    @property
    def prev_path(self) -> Path:
        """The previous backup, kept until the next one is written."""
        return self.backup_dir / "backup.prev.pt"

    def _reset(self) -> None:
        self._batches_seen = 0
        self._due = False
        self._rotate = False  # whether backup.pt is a good backup, to keep as the previous one

    def _get_state(self) -> dict[str, Any]:
        return {"batches_seen": self._batches_seen}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._batches_seen = state["batches_seen"]

    def _state_problems(self, state: Any) -> list[str]:
        return typed_problems(state, {"batches_seen": (is_count, "an int >= 0")}, "its state")

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._due = False
        self._interrupted = False
        if is_rank_zero():
            # Before step 1: the folder is writable, and no other run (or other
            # BackupAndRestore of this fit) uses it.
            check_writable(self.backup_dir, "BackupAndRestore", "backup_dir")
            self.close()
            self._lock = take_lock(
                self.backup_dir / ".backup.lock", f"the backup folder {str(self.backup_dir)!r}", "BackupAndRestore"
            )
            # Temp files of a write a crash interrupted are never a backup: clear them.
            remove_stale_temps(self.backup_dir, self.path.name)
            remove_path(self.backup_dir / f".{self.path.name}.tmp")  # a sharded write cut short
        # Restores module / optimizer / scheduler now; fit applies the RNG states, the
        # position in the epoch, the history and the callback states (this one's too).
        self._rotate = False
        if readable_path(self.path).exists():  # a file, or a folder of shards (or its copy kept by a cut swap)
            try:
                self.model.load_checkpoint(self.path)  # fit starts at the backup's epoch
                self._rotate = True
                return
            except CheckpointError as e:
                if not self.prev_path.exists():
                    raise
                warnings.warn(
                    f"The backup {str(self.path)!r} is damaged, so training resumes from the previous "
                    f"backup {str(self.prev_path)!r}, one backup earlier. ({e})",
                    category=FitkitWarning,
                    stacklevel=2,
                )
        if self.prev_path.exists():  # the newest is damaged, or a crash came between the two
            self.model.load_checkpoint(self.prev_path)

    def _save_on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._write()

    def _save_due(self, logs: Any) -> None:  # every save_freq batches (SavesEveryNBatches)
        self._write()

    def _save_on_interrupt(self):
        # SIGTERM / SIGINT: the state of this step boundary, kept for the re-run.
        self._interrupted = True
        self._write(at_once=True)
        if is_distributed():
            # No rank leaves before rank 0's stop backup is on disk: the first rank to exit makes
            # torchrun stop the others, which would cut that write short.
            torch.distributed.barrier()

    def _write(self, at_once: bool = False) -> None:
        # A run that a callback stopped is about to end: a crash from here on replays from
        # the previous backup and stops at the same point, while a backup written now would
        # resume past the stop. Every rank calls save_checkpoint; rank 0 writes.
        if not self.model.stop_training:
            dcp.wait()  # the write in flight, if any, is the backup to keep as the previous one
            if is_rank_zero():
                restore_interrupted(self.path)  # a swap killed between its renames
            moved = self._rotate and is_rank_zero() and self.path.exists()
            if moved:
                if self.path.is_dir() or self.prev_path.is_dir():
                    remove_path(self.prev_path)  # a folder cannot be replaced in one rename
                os.replace(self.path, self.prev_path)  # atomic; a crash now resumes from it
            background = self.async_save and not at_once and dcp.is_sharded_default(self.model)
            try:
                if background:
                    self.model.save_checkpoint(self.path, async_save=True)
                else:
                    self.model.save_checkpoint(self.path)
            except OSError as e:
                if not moved or e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise OSError(
                    e.errno,
                    f"{os.strerror(e.errno)} while writing the backup {str(self.path)!r}. The last good "
                    f"backup was moved to {str(self.prev_path)!r} before the write and is intact: a re-run "
                    "resumes from it. Fix: free space or choose another folder.",
                ) from e
            self._rotate = True

    def close(self) -> None:
        """Release the folder's lock (idempotent)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def on_train_end(self, logs=None):
        dcp.wait()
        if self._interrupted:
            return  # the backup is what the re-run resumes from
        if self.delete_checkpoint and is_rank_zero():
            self.close()  # before the folder goes
            remove_path(self.path)
            remove_path(self.prev_path)
            try:
                self.backup_dir.rmdir()  # only if nothing else is in it
            except OSError:
                pass
