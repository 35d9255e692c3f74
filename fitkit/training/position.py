"""Where a fit is in its data, and the arithmetic of resuming there.

One :class:`Position` per ``fit`` (the running one) and one per loaded checkpoint (where the
next ``fit`` continues). It holds the epoch, the batches and the samples done in it, the
``steps_per_epoch`` pass offset and the epoch's RNG state, with ``state_dict`` /
``load_state_dict`` in the checkpoint's keys (``epoch``, ``step_in_epoch``,
``samples_in_epoch``, ``pass_offset``, ``pass_start``, ``batch_size``, ``epoch_rng``).

With ``steps_per_epoch`` a pass over the data spans epochs, so a checkpoint inside it holds
what drew the pass's order (``pass_start``: the epoch it opened in, the torch RNG state and the
loader's own generators, see :attr:`fitkit.data.DeviceLoader.pass_start`) besides its offset:
a resume draws the same order again and continues at the same batch of it.

The sample count is the primary quantity of a resume: in-memory data, a Dataset and a plain
DataLoader continue at the first untrained sample whatever the batch size, and it is counted
over all ranks (global), so a checkpoint taken under torchrun resumes at any world size. Other
sources can only skip whole batches, and need the world size and batch size the checkpoint was
taken with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fitkit.data import DeviceLoader

__all__ = ["Position"]


class Position:
    """The position in the data: epoch, batches and samples done in it, pass offset, RNG state.

    Args:
        epoch: the running epoch, or the next one at an epoch boundary (0-based).
        batches: batches of ``epoch`` done (a resume counts the skipped ones).
        samples: samples of ``epoch`` done, over all ranks (a loaded checkpoint's; a running
            fit computes it from its batches, see :attr:`samples`).
        pass_offset: with ``steps_per_epoch``, batches of the data's running pass taken before
            ``epoch`` began (the iterator carries over across epochs).
        pass_start: with ``steps_per_epoch``, what drew that pass's order (a loaded
            checkpoint's; ``None``: none saved, e.g. a file of an older fitkit).
        batch_size: samples per batch of one process (``None``: unknown, e.g. a generator).
        world: processes whose batches make one global batch (torchrun's world size for
            sharded data, else 1).
        n_used: samples an epoch trains on (in-memory data; ``None`` otherwise).

    Example:
        >>> p = Position(batch_size=4, n_used=10)
        >>> p.begin_epoch(0); p.enter(); p.done(2)
        >>> p.samples, p.state_dict(pass_offset=0)["samples_in_epoch"]
        (8, 8)
        >>> p.done(3); p.samples  # the short last batch: capped at the 10 samples
        10
    """

    def __init__(
        self,
        epoch: int = 0,
        batches: int = 0,
        samples: int = 0,
        pass_offset: int = 0,
        batch_size: int | None = None,
        world: int = 1,
        n_used: int | None = None,
        epoch_rng: torch.Tensor | None = None,
        pass_start: dict[str, Any] | None = None,
    ):
        self.epoch = epoch
        self.batches = batches
        self._samples = samples
        self.pass_offset = pass_offset
        self.pass_start = pass_start
        self.batch_size = batch_size
        self.world = world
        self.saved_world: int | None = None  # a loaded checkpoint's world size (None: unknown)
        self.n_used = n_used
        self.epoch_rng: torch.Tensor | None = epoch_rng
        self.in_epoch = False  # between the first and the last batch of an epoch
        self.epochs_done = epoch
        # (batches, samples) a resume skipped in the running epoch: counting goes on from there
        # (samples None: a source that resumed by batches, whose samples are not known).
        self._base: tuple[int, int | None] = (batches, samples)

    # -- the running fit ---------------------------------------------------------------------
    def starts_at(self, epoch: int) -> None:
        """The fit starts at ``epoch`` (a backup restored before the first epoch moved it)."""
        self.epochs_done = epoch

    def begin_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` starts from its first batch."""
        self.epoch, self.batches, self._base, self.epoch_rng = epoch, 0, (0, 0), None

    def set_rng(self, rng: torch.Tensor) -> None:
        """The torch RNG state the epoch's data order is drawn from (replayed on resume)."""
        self.epoch_rng = rng

    def enter(self) -> None:
        """The epoch's batches start: a checkpoint now is taken inside the epoch."""
        self.in_epoch = True

    def leave(self) -> None:
        """The epoch's batches are over."""
        self.in_epoch = False

    def done(self, batches: int) -> None:
        """``batches`` of the running epoch are done (a resume's skipped ones included)."""
        self.batches = batches

    def end_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` is complete: a checkpoint now continues at the next one."""
        self.epochs_done = epoch + 1

    @property
    def samples(self) -> int:
        """Samples of the running epoch done, over all ranks (exact for fixed-size batches).

        0 when the batch size is unknown or the epoch resumed by batches.
        """
        batches, samples = self._base
        if self.batch_size is None or samples is None:
            return 0
        size = self.batch_size * self.world  # a batch index counts one global batch of every rank's share
        done = (samples or batches * size) + (self.batches - batches) * size
        return done if self.n_used is None else min(done, self.n_used)

    # -- resume --------------------------------------------------------------------------------
    def skip_for(self, loader: DeviceLoader) -> tuple[int, int | None]:
        """``(batches, samples)`` to skip in this position's epoch of ``loader``.

        Sources whose epoch order fitkit knows as one list of samples (in-memory data, a
        map-style Dataset, a plain DataLoader, split over ranks by fitkit or on one process)
        resume at the first untrained sample whatever the world size and batch size
        (``(0, samples)``); other sources resume by batches (``(batches, None)``) and need the
        world size and batch size the checkpoint was taken with.

        Raises:
            ValueError: another world size or batch size than the checkpoint's, for a source
                that cannot resume by samples.
        """
        now, user = _processes(), loader.sharded == "user"
        moved = self.saved_world is not None and self.saved_world != now
        if self._samples and not (user and moved) and _by_sample(loader, user):
            return 0, self._samples
        if moved:
            source = type(getattr(loader.batches, "source", loader.batches)).__name__
            why = (
                "it is marked already_sharded: each rank's share is your own split, which fitkit cannot redo"
                if user
                else f"fitkit does not know the order of this source ({source}: an iterable, a sampler "
                "of its own or a DistributedSampler) as one list of samples, so it resumes by batches"
            )
            raise ValueError(
                f"The checkpoint was taken inside epoch {self.epoch + 1} on {self.saved_world} process(es), and "
                f"this fit runs on {now}. The data cannot be re-split: {why}, and batches at another world size "
                f"hold other samples, so the untrained samples of that epoch cannot be found. Fix: resume on "
                f"{self.saved_world} process(es), pass tensors, a map-style Dataset or a plain DataLoader "
                "(sequential or shuffled) and let fitkit split it (they resume by sample at any world size), or "
                "resume from a checkpoint taken at an epoch end."
            )
        now_bs = getattr(loader, "batch_size", None)
        if self.batch_size is not None and now_bs is not None and now_bs != self.batch_size:
            raise ValueError(
                f"The checkpoint was taken inside epoch {self.epoch + 1} with batch_size={self.batch_size}, "
                f"but this fit uses batch_size={now_bs}, so the untrained samples of that epoch cannot be "
                f"found in this source. Fix: resume with batch_size={self.batch_size}, or pass in-memory data, "
                "a map-style Dataset or a plain DataLoader."
            )
        return self.batches, None

    def resume_at(self, point: Position, skip: tuple[int, int | None], batch_size: int | None) -> int:
        """Continue inside ``point``'s epoch after ``skip`` (:meth:`skip_for`); returns the
        index of the first batch to run, counted in this fit's ``batch_size``."""
        done = point.batches if skip[1] is None else skip[1] // ((batch_size or 1) * self.world)
        self.batches = done
        self._base = (done, point._samples if skip[1] is not None else None)
        self.epoch_rng = None if point.epoch_rng is None else point.epoch_rng.cpu()
        return done

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self, pass_offset: int, pass_start: dict[str, Any] | None = None) -> dict[str, Any]:
        """Where a checkpoint taken now resumes: inside the running epoch, or at the next one.

        ``pass_offset``: the loader's (:attr:`~fitkit.data.DeviceLoader.pass_offset` inside an
        epoch, :attr:`~fitkit.data.DeviceLoader.carried_over` between epochs).
        ``pass_start``: the loader's :attr:`~fitkit.data.DeviceLoader.pass_start`, kept (key
        ``pass_start``) inside an epoch, and between epochs when a pass carries over.
        """
        state: dict[str, Any]
        if self.in_epoch:
            state = {
                "epoch": self.epoch,
                "step_in_epoch": self.batches,
                "samples_in_epoch": self.samples,
                "pass_offset": pass_offset,
                "world_size": max(self.world, _processes()),
            }
        else:
            state = {"epoch": self.epochs_done, "step_in_epoch": 0, "samples_in_epoch": 0, "pass_offset": pass_offset}
        if pass_start is not None and (self.in_epoch or pass_offset):
            state["pass_start"] = pass_start
        return state

    @classmethod
    def load_state_dict(cls, state: dict[str, Any]) -> Position:
        """The position a checkpoint's ``state`` holds (files of every fitkit version read)."""
        return cls(
            epoch=int(state["epoch"]),
            batches=int(state["step_in_epoch"]),
            samples=int(state.get("samples_in_epoch") or 0),
            pass_offset=int(state.get("pass_offset") or 0),
            batch_size=state.get("batch_size"),
            epoch_rng=state.get("epoch_rng"),
            pass_start=state.get("pass_start"),
        )._saved_on(state.get("world_size"))

    def _saved_on(self, world: int | None) -> Position:
        self.saved_world = None if world is None else int(world)  # None: a file of an older fitkit
        return self


def _processes() -> int:
    """The processes of this job (torchrun's world size, 1 without a process group)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _by_sample(loader: DeviceLoader, user: bool) -> bool:
    """Whether ``loader``'s source resumes by sample (see :meth:`Position.skip_for`)."""
    from fitkit.data import TensorBatches
    from fitkit.data.resume_order import splittable

    src = loader.batches
    if isinstance(src, TensorBatches):
        return True
    if user or loader.steps is not None:
        return False
    known = getattr(src, "by_sample", None)  # fitkit's rank shares of a DataLoader
    return bool(known) if known is not None else splittable(getattr(src, "source", None))
