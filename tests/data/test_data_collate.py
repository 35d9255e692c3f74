"""Dataset samples that do not stack are named by their shapes, at any batch; a backup stays."""

from __future__ import annotations

import pytest
import torch

import fitkit
from fitkit.callbacks import BackupAndRestore
from fitkit.data.collate import NamingCollate


class Samples(torch.utils.data.Dataset):
    def __init__(self, ragged_at):
        self.ragged_at = ragged_at

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.ones(3 if i == self.ragged_at else 2), torch.zeros(1)


def test_a_ragged_sample_at_a_later_batch_names_the_batch_and_keeps_the_backup(tmp_path):
    torch.manual_seed(0)
    model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    folder = tmp_path / "bk"
    shapes = r"\(2,\), \(1,\)\), \(\(3,\), \(1,\)\)"  # the third batch: samples 8 to 11, 9 ragged
    with pytest.raises(ValueError, match=f"number 3 since the loader was built.*{shapes}.*Fix"):
        model.fit(
            Samples(ragged_at=9),
            batch_size=4,
            shuffle=False,
            epochs=1,
            verbose=0,
            callbacks=[BackupAndRestore(folder, save_freq=1)],
        )
    assert model.global_step == 2  # batches 1 and 2 trained; batch 3 could not be made
    backup = torch.load(folder / "backup.pt", weights_only=True)
    assert backup["global_step"] == 2 and backup["step_in_epoch"] == 2


def test_samples_that_stack_collate_as_torch_does():
    batch = NamingCollate()([(torch.ones(2), 1), (torch.zeros(2), 0)])
    assert torch.equal(batch[0], torch.tensor([[1.0, 1.0], [0.0, 0.0]])) and batch[1].tolist() == [1, 0]
