"""Fit a small regression model: alone, or under torchrun, without a change.

Usage: python scale_out.py BATCH_SIZE
       torchrun --standalone --nproc_per_node=2 scale_out.py BATCH_SIZE
"""

import os
import sys

import torch
from torch import nn

import fitkit

batch_size = int(sys.argv[1])                 # per process
torch.manual_seed(0)
x = torch.randn(1000, 8)
y = x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.1 * torch.randn(1000, 1)

net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
model = fitkit.Model(net)
model.compile(optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
              loss="mse", metrics=["mae"])
history = model.fit(x, y, batch_size=batch_size, epochs=3, validation_split=0.2,
                    verbose=2)                # progress lines: rank 0 only

result = model.evaluate(x, y, verbose=0)      # the same dict on every rank
rows = model.predict(x, verbose=0).shape[0]   # every row, in order, on every rank
line = f"loss {result['loss']:.4f}, mae {result['mae']:.4f}, {rows} rows\n"
print(line, end="", flush=True)   # one write: lines of two processes cannot mix

rank = os.environ.get("RANK", "0")            # set by torchrun
torch.save(model.state_dict(), f"weights-{batch_size}-rank{rank}.pt")
