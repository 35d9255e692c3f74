"""One process: a plain DataLoader resumes inside an epoch by sample, at any batch size, in the
order the interrupted epoch drew (the global RNG's or the loader's own generator's)."""

from __future__ import annotations

import pytest
import torch
from _dist_scenarios import OPTIMIZERS, IdRecorder, data, net
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.data.resume_order import OrderShare, loader_order


def _fit(batch_size, backup, *, crash=False, generator=False, dataset=False):
    """Adam on data(37), a shuffled DataLoader, 3 epochs; a backup every 3 steps; ``crash``: the
    job stops at step 8 (batch 8: after the step-6 backup, 8 samples into epoch 1)."""
    torch.manual_seed(0)
    x, y, _ = data(37)
    rec = IdRecorder(net())
    model = fitkit.Model(rec, device="cpu")
    model.compile(optimizer=OPTIMIZERS["adam"], loss="mse")
    callbacks = [rec.epochs()]
    if backup is not None:
        callbacks.append(fitkit.callbacks.BackupAndRestore(backup, save_freq=3, delete_checkpoint=False))

    def crash_at_8(batch, logs):
        if model.global_step == 8:
            raise KeyboardInterrupt

    if crash:
        callbacks.append(fitkit.callbacks.LambdaCallback(on_train_batch_end=crash_at_8))
    g = torch.Generator().manual_seed(5) if generator else None
    if dataset:  # a map-style Dataset: fitkit builds the DataLoader
        args, kw = (TensorDataset(x, y),), {"batch_size": batch_size, "shuffle": True}
    else:
        args, kw = (DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=g),), {}
    try:
        model.fit(*args, **kw, epochs=3, verbose=0, callbacks=callbacks)
    except KeyboardInterrupt:
        pass
    return rec.seen, [p.detach().clone() for p in rec.net.parameters()]


@pytest.mark.parametrize(
    "generator, dataset", [(False, False), (True, False), (False, True)], ids=["global_rng", "own_generator", "dataset"]
)
def test_a_dataloader_resumes_by_sample_at_another_batch_size(tmp_path, generator, dataset):
    ref_ids, ref_params = _fit(8, None, generator=generator, dataset=dataset)
    _fit(8, tmp_path / "bk", crash=True, generator=generator, dataset=dataset)  # the step-6 backup: 8 samples
    for batch_size in (5, 8):
        backup = tmp_path / f"bk{batch_size}"
        backup.mkdir()
        (backup / "backup.pt").write_bytes((tmp_path / "bk" / "backup.pt").read_bytes())
        ids, params = _fit(batch_size, backup, generator=generator, dataset=dataset)
        assert ids[0] == ref_ids[1][8:]  # the rest of the interrupted epoch's order, each once
        assert len(ids) == 2 and ids[1] == ref_ids[2]  # the next epoch: the uninterrupted order
        if batch_size == 8:  # the same batches: the uninterrupted weights, bitwise
            assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))


def test_the_order_is_a_one_process_iterations_and_the_shares_split_it():
    dl = DataLoader(TensorDataset(torch.arange(7)), batch_size=7, shuffle=True)
    torch.manual_seed(3)
    order = loader_order(7, True, None, None)
    assert next(iter(dl))[0].tolist() == order.tolist()  # the RNG state was left as it was
    shares = [OrderShare(7, r, 3, shuffle=False, generator=None) for r in range(3)]
    for s in shares:
        s.run(order[2:])  # 5 samples left over 3 ranks: 2, 2, 2 with one padded
    assert [list(s) for s in shares] == [order[[2, 5]].tolist(), order[[3, 6]].tolist(), order[[4, 2]].tolist()]
