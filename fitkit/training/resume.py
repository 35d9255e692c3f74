"""Where a resumed fit continues: the owner of a loaded :class:`~fitkit.training.state.ResumePoint`
for one ``fit`` call.

A fit takes its resume point after ``on_train_begin`` (a ``BackupAndRestore`` loads there), gives
the callbacks and the History their states, and then applies the rest where it belongs: at the
start of the resumed epoch (an epoch-boundary checkpoint: its RNG states, the loader's own order,
a ``steps_per_epoch`` pass carried over) or at its first batch (a checkpoint inside an epoch: the
epoch's data order replayed and the batches done skipped, the running totals, the RNG states of
the moment it was taken). Each is applied once.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from fitkit import distributed as _distributed
from fitkit.checks import FitkitWarning
from fitkit.data import order as _order
from fitkit.training.state import ResumePoint, set_rng_state

if TYPE_CHECKING:
    from fitkit.callbacks.base import CallbackList
    from fitkit.data import DeviceLoader
    from fitkit.training.position import Position
    from fitkit.training.scheduling import SchedulerDriver
    from fitkit.training.tracking import RunningTotals

__all__ = ["Resume", "RESUME_MODES", "check_resume_mode", "data_identity"]

#: ``fit(resume=...)``: ``None`` (continue where the checkpoint was taken), ``"restart_epoch"``
#: (a checkpoint taken inside an epoch starts that epoch over).
RESUME_MODES = (None, "restart_epoch")


def check_resume_mode(value: object) -> None:
    """``fit(resume=...)`` checked.

    Example:
        >>> check_resume_mode("restart")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Expected `resume` to be None or 'restart_epoch'. Received: resume='restart'. Fix: ...
    """
    if value not in RESUME_MODES:
        raise ValueError(
            f"Expected `resume` to be None or 'restart_epoch'. Received: resume={value!r}. Fix: leave it None "
            "to continue where a checkpoint was taken, or pass 'restart_epoch' to start its epoch over."
        )


def data_identity(loader: DeviceLoader | None) -> dict[str, Any]:
    """What a checkpoint records of the training set, so that its position keeps its meaning:
    ``train_length`` (samples, over all ranks) where the source has a length, and
    ``train_fingerprint`` for a Hugging Face ``datasets.Dataset`` (its own ``_fingerprint``). Cheap:
    no data is read.

    Example:
        >>> from fitkit.data import as_loader
        >>> data_identity(as_loader(torch.zeros(12, 2), torch.zeros(12), batch_size=4))
        {'train_length': 12}
    """
    from fitkit.data import TensorBatches

    batches = getattr(loader, "batches", None)
    if isinstance(batches, TensorBatches):
        return {"train_length": int(batches.n)}
    source = getattr(batches, "source", None)
    dataset = getattr(source, "dataset", source)  # a DataLoader's Dataset, or the Dataset itself
    out: dict[str, Any] = {}
    try:
        out["train_length"] = int(len(dataset))  # type: ignore[arg-type]
    except TypeError:  # an iterable without a length: nothing to compare
        return out
    fingerprint = getattr(dataset, "_fingerprint", None)
    if isinstance(fingerprint, str):
        out["train_fingerprint"] = fingerprint
    return out


class Resume:
    """A fit's resume point, applied once where each of its parts belongs.

    Args:
        train: the fit's training :class:`~fitkit.data.DeviceLoader`.
        position: the fit's :class:`~fitkit.training.position.Position` (moved to the resumed batch).
        scheduling: the stepper's scheduler driver: a checkpoint inside an epoch gives it back
            the learning rates the epoch's last step used (``lrs_used``), which the epoch logs
            (the loop's invariant 5: a backup at an epoch's last batch logs that batch's rate).

    Example:
        >>> resume = Resume(train=None, position=None)
        >>> resume.pending, resume.epoch_pass
        (None, (0, None))
    """

    def __init__(
        self,
        train: DeviceLoader | None,
        position: Position | None,
        scheduling: SchedulerDriver | None = None,
        mode: str | None = None,
    ):
        self.train, self.position, self.scheduling, self.mode = train, position, scheduling, mode
        self.pending: ResumePoint | None = None  # taken, not yet applied to an epoch
        # steps_per_epoch: a boundary resume's carried-over pass (offset, what drew it), for its epoch
        self.epoch_pass: tuple[int, dict[str, Any] | None] = (0, None)

    def take(
        self, before: ResumePoint | None, late: ResumePoint | None, start_epoch: int, callbacks: CallbackList
    ) -> int:
        """After ``on_train_begin``: the point loaded before fit (``before``) or by a callback
        (``late``: the fit starts at its epoch). Callback states and the History are loaded now.

        Returns:
            The epoch the fit starts at.
        """
        point = late or before
        if point is None:
            return start_epoch
        if late is not None:
            start_epoch = point.epoch
        point.apply_callbacks(callbacks)
        if point.epoch != start_epoch:
            warnings.warn(
                f"The loaded checkpoint continues at epoch {point.epoch}, but fit starts at "
                f"initial_epoch={start_epoch}; its position and RNG state are not used. "
                f"Fix: fit(..., initial_epoch={point.epoch}).",
                category=FitkitWarning,
                stacklevel=5,
            )
            return start_epoch
        self.pending = self._same_data(point)
        return start_epoch

    def _same_data(self, point: ResumePoint) -> ResumePoint:
        """A point inside an epoch continues on the training set it was taken on (its length and
        fingerprint, where recorded), else ``ValueError``; ``resume="restart_epoch"`` starts its
        epoch over instead."""
        saved = point.position
        if not saved.batches:
            return point
        if self.mode == "restart_epoch":
            return point.at_epoch_start()
        now = data_identity(self.train)
        before = {k: point.state[k] for k in ("train_length", "train_fingerprint") if point.state.get(k) is not None}
        changed = [k for k in before if k in now and now[k] != before[k]]
        if not changed:
            return point
        what = (
            f"{before['train_length']} samples, and this fit's has {now['train_length']}"
            if "train_length" in changed
            else f"the fingerprint {before['train_fingerprint']!r}, and this fit's is {now['train_fingerprint']!r}"
        )
        raise ValueError(
            f"The checkpoint was taken inside epoch {point.epoch + 1} ({saved.batches} batch(es) done) of a training "
            f"set of {what}: the saved position and order mean other rows of this data, so some rows would train "
            f"twice and some never. Fix: resume on the training set the checkpoint was taken on, or start that "
            "epoch over on this data with fit(..., resume='restart_epoch')."
        )

    def epoch_begin(self, epoch: int) -> None:
        """The start of ``epoch``: an epoch-boundary checkpoint's RNG states and loader order."""
        point = self.pending
        self.epoch_pass = (0, None)
        if point is not None and point.epoch == epoch and not point.position.batches:
            set_rng_state(point.rng)
            _order.restore(self.train, point.state.get("data_order"))
            self.epoch_pass = (point.position.pass_offset, point.position.pass_start)  # the carried-over pass
            self.pending = None

    def validation_due(self, epoch: int) -> bool:
        """Whether the point inside ``epoch`` was taken after a step whose validation a signal cut
        short (position key ``validation_due``): the resumed epoch runs it before its next batch, so
        History holds it as in the run never interrupted (the loop's invariant 2)."""
        point = self.pending
        return (
            point is not None
            and point.epoch == epoch
            and bool(point.position.batches)
            and bool(point.state.get("validation_due"))
        )

    def batches(self, epoch: int, totals: RunningTotals | None) -> tuple[Iterator[Any], int]:
        """This epoch's batch iterator and the index of its first batch (a mid-epoch resume)."""
        point, train = self.pending, self.train
        if train is None or self.position is None:
            raise RuntimeError("Resume.batches needs the fit's training data and position.")
        if point is None or point.epoch != epoch or not point.position.batches:
            offset, start = self.epoch_pass
            return train.epoch_batches(epoch, pass_offset=offset, pass_start=start), 0
        self.pending = None
        # Replay the epoch's data order from the RNG state it started with, skip what was done,
        # then continue from the RNG state of the moment the checkpoint was taken.
        saved = point.position
        if saved.epoch_rng is None or point.trackers is None or totals is None:
            raise RuntimeError(
                f"The checkpoint's position inside epoch {point.epoch + 1} lacks its RNG state or totals."
            )
        skip = saved.skip_for(train)
        done = self.position.resume_at(saved, skip, train.batch_size)
        torch.set_rng_state(saved.epoch_rng.cpu())
        _order.resume_inside_epoch(train, point.state.get("data_order"), point.epoch)
        # steps_per_epoch: where the running pass was, and what drew it
        it = train.epoch_batches(epoch, skip=skip, pass_offset=saved.pass_offset, pass_start=saved.pass_start)
        first = next(it, None)
        set_rng_state(point.rng)
        totals.load_state_dict(
            point.trackers, owner=_distributed.is_rank_zero(), rank=_distributed.rank(), ranks=_distributed.world_size()
        )
        if self.scheduling is not None:
            self.scheduling.keep_lrs_used(point.state.get("lrs_used"))
        return (it if first is None else _chain(first, it)), done


def _chain(first: object, it: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from it
