"""A sharded checkpoint's .metadata is read with an unpickler that knows only the index's own
classes: a crafted one is refused before anything in it runs, wherever fitkit reads the folder
(load_checkpoint, consolidate_weights, check_sharded), and a genuine one still loads."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn

import fitkit
from fitkit.files import CheckpointError, check_sharded, consolidate_weights


def _sharded(tmp_path):
    torch.manual_seed(0)
    model = fitkit.Model(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)), device="cpu")
    model.compile(optimizer="adamw", loss="mse")
    model.fit(torch.randn(8, 2), torch.randn(8, 3), batch_size=4, verbose=0)
    path = tmp_path / "ck"
    model.save_checkpoint(path, sharded=True)
    return model, path


class _Payload:
    """Unpickling it would create the marker file (a stand-in for any code)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path, marker) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))


def test_a_genuine_index_reads_and_loads(tmp_path):
    model, path = _sharded(tmp_path)
    meta = check_sharded(path)
    assert any(k.startswith("model.") for k in meta.state_dict_metadata)
    other = fitkit.Model(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)), device="cpu")
    other.compile(optimizer="adamw", loss="mse")
    other.load_checkpoint(path)
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k


@pytest.mark.parametrize("reader", ["load_checkpoint", "consolidate_weights", "check_sharded"])
def test_a_crafted_index_is_refused_before_it_runs(tmp_path, reader):
    model, path = _sharded(tmp_path)
    marker = tmp_path / "ran"
    _plant(path, marker)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        if reader == "load_checkpoint":
            model.load_checkpoint(path)
        elif reader == "consolidate_weights":
            consolidate_weights(path, tmp_path / "w.pt")
        else:
            check_sharded(path)
    assert isinstance(info.value, RuntimeError)  # the "refused" kind, as for a one-file checkpoint
    assert "Refused to load" in str(info.value) and "it names io.open, which is not part of" in str(info.value)
    assert not marker.exists()
    assert not (tmp_path / "w.pt").exists()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_a_global_of_the_index_modules_that_is_not_a_class_is_refused(tmp_path):
    _, path = _sharded(tmp_path)

    class Call:
        def __reduce__(self):
            from torch.distributed.checkpoint import filesystem

            return (filesystem._split_by_size_and_type, (1, []))

    (path / ".metadata").write_bytes(pickle.dumps(Call()))
    with pytest.raises(CheckpointError, match="Refused to load"):
        check_sharded(path)
    assert os.path.isdir(path)
