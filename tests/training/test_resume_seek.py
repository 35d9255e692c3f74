"""A resume inside an epoch seeks where the source can (Composer's spin_dataloaders=False):
a map-style Dataset or a plain DataLoader loads only the untrained samples; an iterable of
batches cannot seek, so the batches already trained are drawn again and dropped (Composer's
spin_dataloaders=True). Either way the final weights are those of the uninterrupted run."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fitkit
from fitkit.callbacks import ModelCheckpoint

N, BATCH = 20, 4  # 5 batches per epoch; the checkpoint after batch 3 of the first epoch


class _Counted(Dataset):
    """Rows ``i -> (i / N, 2 * i / N)`` that count the samples loaded."""

    def __init__(self):
        self.loaded: list[int] = []

    def __len__(self):
        return N

    def __getitem__(self, i):
        self.loaded.append(int(i))
        v = torch.tensor([i / N])
        return v, 2 * v


class _Batches:
    """A re-iterable of batches that cannot seek; counts the batches drawn."""

    def __init__(self):
        self.drawn = 0

    def __iter__(self):
        for b in range(N // BATCH):
            self.drawn += 1
            rows = torch.arange(b * BATCH, (b + 1) * BATCH, dtype=torch.float32).unsqueeze(1) / N
            yield rows, 2 * rows


def _source(kind: str):
    if kind == "dataset":
        ds = _Counted()
        return ds, {"batch_size": BATCH, "shuffle": False}, lambda: len(ds.loaded)
    if kind == "loader":
        ds = _Counted()
        return DataLoader(ds, batch_size=BATCH), {}, lambda: len(ds.loaded)
    if kind == "shuffled loader":
        ds = _Counted()
        return DataLoader(ds, batch_size=BATCH, shuffle=True), {}, lambda: len(ds.loaded)
    it = _Batches()
    return it, {}, lambda: it.drawn * BATCH


def _model() -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss="mse")
    return model


@pytest.mark.parametrize(
    "kind, loaded_on_resume",
    [
        ("dataset", 8),  # the 2 untrained batches only: seeks
        ("loader", 8),
        ("shuffled loader", 8),  # the epoch's order drawn again from its saved RNG state, then seeks
        ("iterable of batches", 20),  # cannot seek: all 5 batches drawn, the first 3 dropped
    ],
)
def test_a_resume_loads_only_what_it_trains_where_the_source_can_seek(tmp_path, kind, loaded_on_resume):
    torch.manual_seed(1)
    full = _model()
    data, kwargs, _ = _source(kind)
    full.fit(data, epochs=1, verbose=0, **kwargs, callbacks=[ModelCheckpoint(tmp_path / "s{step}.pt", save_freq=3)])
    resumed = _model()
    data, kwargs, loaded = _source(kind)
    assert resumed.load_checkpoint(tmp_path / "s3.pt") == 0
    resumed.fit(data, epochs=1, verbose=0, **kwargs)
    assert loaded() == loaded_on_resume
    assert resumed.global_step == 5
    torch.testing.assert_close(resumed.module.state_dict(), full.module.state_dict(), rtol=0, atol=0)
