"""Sharded checkpoints, the weights export, and a stream split by rank and worker.

Usage: torchrun --standalone --nproc_per_node=2 sharded_checkpoint.py
"""

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import fitkit
from fitkit.distributed import already_sharded, is_rank_zero, split_by_rank_and_worker
from fitkit.files import consolidate_weights

torch.manual_seed(0)
x = torch.randn(256, 8)
y = x.sum(1, keepdim=True)
net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

model = fitkit.Model(net, strategy="fsdp")
model.compile(optimizer="adamw", loss="mse")
backup = fitkit.callbacks.BackupAndRestore("runs/backup", save_freq=4, async_save=True)
model.fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[backup])
model.save_checkpoint("runs/final")            # a folder: .metadata, __0_0.distcp, ...
model.save_weights("model.safetensors")        # one file of the full weights (rank 0 writes)


class Stream(IterableDataset):                 # a stream: nothing to index, so split it
    def __iter__(self):
        yield from zip(x[:64], y[:64])


loader = DataLoader(split_by_rank_and_worker(Stream()), batch_size=8, num_workers=2)
model.fit(already_sharded(loader), epochs=1, verbose=0)

if is_rank_zero():
    print(sorted(p.name for p in Path("runs/final").iterdir()))
    consolidate_weights("runs/final", "final.safetensors")   # offline, on one process, too
    print(sorted(p.name for p in Path(".").glob("*.safetensors")))
