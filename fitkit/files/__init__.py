"""Files that load all-or-nothing and damage that is named: atomic writes, checksums, safe loads.

Every file fitkit writes goes through :func:`atomic_save` (or :func:`save_safetensors`): a temp
file in the same folder, fsync, then a rename, so a reader or a crash sees the old file or the
new one, never a mix. Every file fitkit reads goes through :func:`safe_load` (or
:func:`load_safetensors`), which refuses pickled code and names what is wrong with a damaged
file (empty, truncated, corrupted, not a checkpoint, written by a newer fitkit) and the fix.

Bit rot is caught twice over: torch writes a CRC-32 of every record of its zip archive (torch's
reader never checks them; :func:`safe_load` does), and a fitkit checkpoint also carries
``"fitkit_checksum"``, a SHA-256 of its payload, verified after loading. Measured on one CPU
core: 16 ms for a 4 MB module with its Adam state (a 12 MB file), plus 8 ms to verify the
CRC-32s when loading.

A sharded checkpoint (``strategy="fsdp"``) is a folder of ``torch.distributed.checkpoint``
shards plus a small checksummed file of the rest (:mod:`fitkit.files.sharded`);
:func:`consolidate_weights` turns one into a single weights file offline.

A run's folder is its own: callbacks lock their folder or file (:class:`FileLock`), delete
only files their own path template makes there (:mod:`fitkit.files.owned`), and check a
checkpoint's content before anything loads (:mod:`fitkit.files.content`). See the guide
"What fitkit guarantees about your files".
"""

from fitkit.files.differences import check_state_dict_fits, optimizer_differences, state_dict_differences
from fitkit.files.locks import FileLock, LockError
from fitkit.files.payload import (
    CHECKSUM_KEY,
    check_weights_only,
    payload_checksum,
    to_python,
)
from fitkit.files.reading import CheckpointError, RefusedCheckpointError, safe_load
from fitkit.files.safe_tensors import load_safetensors, save_safetensors
from fitkit.files.sharded import STATE_NAME, check_sharded, consolidate_weights, is_sharded, remove_path
from fitkit.files.writing import (
    atomic_save,
    check_target,
    cut_to_last_line,
    remove_stale_temps,
)

__all__ = [
    "CheckpointError",
    "atomic_save",
    "safe_load",
    "remove_stale_temps",
    "cut_to_last_line",
    "payload_checksum",
    "check_weights_only",
    "to_python",
    "save_safetensors",
    "load_safetensors",
    "state_dict_differences",
    "optimizer_differences",
    "check_target",
    "CHECKSUM_KEY",
    "consolidate_weights",
    "check_sharded",
    "is_sharded",
    "remove_path",
    "STATE_NAME",
    "FileLock",
    "LockError",
    "RefusedCheckpointError",
    "check_state_dict_fits",
]
