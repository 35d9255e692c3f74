"""Scale-out under ``torchrun``: process group, DDP / FSDP2, data shards, exact reductions.

Launched by ``torchrun`` (``WORLD_SIZE`` > 1), the same script trains data-parallel with no
code change: :class:`fitkit.Model` starts the process group (nccl on CUDA, gloo on CPU) on
its ``LOCAL_RANK`` device, wraps the module at ``compile()`` (DDP, or FSDP2 ``fully_shard``
with ``strategy="fsdp"``) and shards every input per rank. fitkit launches nothing itself.

What makes the numbers exact, not approximately right:

- **No duplicates.** In-memory tensors: one global permutation per epoch (drawn on rank 0 from
  the global torch generator, exactly as one process draws it, then broadcast), cut into global
  batches of ``batch_size * world_size`` samples; rank ``r`` gets the ``r``-th contiguous
  share of each. A one-process run with ``batch_size * world_size`` sees the same global
  batches. A plain ``DataLoader`` (a Dataset's too) gets fitkit's rank shares of the order a
  one-process iteration of it draws (same shuffle and batch size; rank 0's RNG, broadcast once
  per epoch); the samples repeated to even out the shards are cut off on the host, where their
  positions are known (local position ``j`` on rank ``r`` is global position ``r + j * W``).
- **Resumes by sample at any world size.** A global batch is a contiguous run of the epoch's
  order, so the samples a mid-epoch checkpoint has done are a prefix of it: a resume replays
  the order from the epoch's RNG state, leaves out that prefix and cuts the rest into the new
  job's global batches, at any world size and batch size (in memory, a Dataset, a plain
  DataLoader). An ``IterableDataset``, a sampler of the user's or ``already_sharded`` data
  resumed at another world size is refused before the first step, with the reason.
- **Same steps on every rank.** A rank whose share of the short last batch is empty still runs
  the step (forward and backward on an empty batch, zero contribution), so DDP's all-reduce
  never waits for a rank that is not coming.
- **Exact gradients.** Each rank backpropagates ``sum(w * l) * W / global_weight``, so DDP's
  gradient average is the single-process mean over the global batch, short last batches
  included. ``global_weight`` is known on the host for fitkit's shards with rows as the loss's
  terms; otherwise (sample weights, ignored or per-token class targets, a DataLoader's labels)
  it rides in DDP's own gradient all-reduce, or in the reduce-scatters of FSDP's units
  (:mod:`~fitkit.distributed.counted`): no collective per step beyond DDP's / FSDP's, for every
  built-in loss. Where the gradients are reduced in a 16-bit type it is all-reduced on its own
  (one small collective per step, no host read).
- **Exact logs.** Epoch loss totals and counts are summed over ranks before the division;
  torchmetrics metrics sync their states in ``compute()``. Every rank gets the same History.

What a script should know:

- ``batch_size`` is per process; the global batch is ``batch_size * world_size``.
- Every rank runs the same calls (``fit``, ``evaluate``, ``predict``, ``save_checkpoint``):
  they contain collectives. Inputs fitkit cannot shard (iterables of batches,
  ``IterableDataset``) raise ``ValueError`` unless wrapped in :func:`already_sharded`.
- ``model.stop_training`` set on some ranks only stops every rank where the ranks agree:
  after ``on_backward_end`` when a callback uses that hook and may veto on the host, at the
  signal agreement points (every few steps and seconds, :mod:`~fitkit.distributed.agreement`)
  and at the end of the epoch. A step vetoed on one rank (``TerminateOnNaN``) is skipped on
  all; ``TerminateOnNaN`` vetoes on the device, so it adds no collective to any step.
- Rank 0 prints and writes files; ``save_weights`` writes on rank 0 only and holds the plain
  module's full state (under ``strategy="fsdp"`` gathering it is a collective: call it on
  every rank; it is the full-weights export). ``save_checkpoint`` writes one file on rank 0
  under DDP, and under ``strategy="fsdp"`` a folder in which every rank writes its own shards
  (:mod:`~fitkit.distributed.dcp`); call it on every rank. ``fitkit.files.consolidate_weights``
  turns such a folder into one weights file, offline.
- A process group you start yourself is used as it is; create the ``Model`` after it.

The package, one concern per module (everything is re-exported here):

- :mod:`~fitkit.distributed.group`: the process group, ranks and collectives, and the exact
  loss reductions (``init_if_needed``, ``rank``, ``any_rank``, ``global_share``, ...).
- :mod:`~fitkit.distributed.parallel`: ``Model(strategy=...)``, DDP / FSDP2 wrapping and full
  state dicts (``check_strategy``, ``Parallel``).
- :mod:`~fitkit.distributed.counted`: the loss denominator summed over the ranks inside DDP's
  gradient all-reduce (a communication hook) or FSDP's reduce-scatters (a custom reduce-scatter).
- :mod:`~fitkit.distributed.fsdp`: ``Model(strategy=FSDP(...))``, the FSDP2 options: the wrap
  policy (Hugging Face's ``_no_split_modules`` by default), mixed precision, activation
  checkpointing, CPU offload.
- :mod:`~fitkit.distributed.dcp`: sharded checkpoints (``torch.distributed.checkpoint``),
  sync and async, loading at any world size.
- :mod:`~fitkit.distributed.split`: iterables split by rank and DataLoader worker
  (``split_by_rank_and_worker``), and one training epoch end agreed by all ranks.
- :mod:`~fitkit.distributed.sharding`: each rank's share of the data and ``predict``'s rows
  gathered back (``already_sharded``, ``shard``, ``gather_predictions``).

Example:
    >>> world_size(), rank(), is_distributed(), is_rank_zero()
    (1, 0, False, True)
    >>> check_strategy("fsdp")
    'fsdp'
"""

# Names outside __all__ are re-exported too: the model, the loops and the stepper call
# `fitkit.distributed.sharded`, `.global_share`, `.gather_predictions`, ...
from fitkit.distributed import dcp, ddp, fsdp, parallel  # noqa: F401
from fitkit.distributed.agreement import SignalAgreement  # noqa: F401
from fitkit.distributed.ddp import DDP
from fitkit.distributed.fsdp import FSDP
from fitkit.distributed.group import (  # noqa: F401
    all_gather_object,
    all_reduce_sum,
    any_rank,
    any_rank_on_device,
    check_timeout,
    check_timeout_applies,
    global_share,
    init_if_needed,
    is_distributed,
    is_rank_zero,
    known_rows,
    launched_by_torchrun,
    rank,
    reduce_loss_totals,
    say,
    world_size,
)
from fitkit.distributed.parallel import Parallel, check_strategy
from fitkit.distributed.sharding import (  # noqa: F401
    ShardedLoaderBatches,
    ShardedTensorBatches,
    already_sharded,
    gather_predictions,
    host_rows,
    shard,
    sharded,
    unwrap,
)
from fitkit.distributed.split import (  # noqa: F401
    RankWorkerSplit,
    agree_on_epoch_end,
    check_worker_copies,
    split_by_rank_and_worker,
)

#: Values of ``Model(strategy=...)``: "auto" is DDP under torchrun, nothing on one process.
STRATEGIES = parallel.STRATEGIES  # the same tuple; bound here too so Sphinx finds this comment

__all__ = [
    "STRATEGIES",
    "launched_by_torchrun",
    "init_if_needed",
    "is_distributed",
    "is_rank_zero",
    "say",
    "rank",
    "world_size",
    "all_reduce_sum",
    "any_rank",
    "all_gather_object",
    "already_sharded",
    "split_by_rank_and_worker",
    "check_strategy",
    "FSDP",
    "DDP",
    "Parallel",
    "shard",
    "sharded",
]
