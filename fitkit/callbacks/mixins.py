"""Behaviours that several callbacks share: a logger that stops writing instead of ending a run,
and a save every ``save_freq`` training batches."""

from __future__ import annotations

import warnings
from typing import Any

from fitkit.checks import FitkitWarning

__all__ = ["StopsWriting", "SavesEveryNBatches"]


class StopsWriting:
    """A logger that never ends a run: when its file cannot be written (a full disk, a deleted
    folder, a read-only mount), it warns once, naming the file and the fix, and writes nothing
    more in this ``fit``; training goes on. (Checkpoints and backups still fail loudly.)"""

    _stopped = False  # this fit's writes failed once: no more tries until the next fit

    def _stop_writing(self, error: OSError) -> None:
        if self._stopped:
            return
        self._stopped = True
        warnings.warn(
            f"{type(self).__name__} stopped writing for the rest of this fit, which goes on: {error} "
            "(Fix: free space or keep the folder; the next fit writes again.)",
            category=FitkitWarning,
            stacklevel=3,
        )


class SavesEveryNBatches:
    """``save_freq`` as a number of training batches, counted where a save can hold the state:
    ``on_train_batch_end`` marks a save due once ``save_freq`` batches ran and the batch closes
    an accumulation window (inside a window the gradients would not be saved);
    ``_save_on_batch_end`` (after every callback's batch hook) then calls ``_save_due(logs)``
    once. ``save_freq="epoch"``: nothing here."""

    save_freq: Any
    model: Any
    _batches_seen = 0
    _due = False

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.save_freq == "epoch":
            return
        self._batches_seen += 1
        if self._batches_seen >= self.save_freq and self.model.closes_accumulation_window:
            self._batches_seen, self._due = 0, True

    def _save_on_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._due:
            self._due = False
            self._save_due(logs)

    def _save_due(self, logs: Any) -> None:
        raise NotImplementedError
