"""predict's outputs leave the device as they come: the device holds one batch's, the host the rest once."""

from __future__ import annotations

import collections
import weakref

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.training import host_outputs
from fitkit.training.host_outputs import HostOutputs

Out = collections.namedtuple("Out", "logits aux")


class Tracked(nn.Module):
    """A Linear whose outputs are watched: ``alive`` counts those still referenced at each forward."""

    def __init__(self, structured: bool = False):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.structured = structured
        self.outputs: list[weakref.ref] = []
        self.alive: list[int] = []

    def forward(self, x):
        self.alive.append(sum(r() is not None for r in self.outputs))
        y = self.lin(x)
        self.outputs.append(weakref.ref(y))
        return Out(y, x.sum(1)) if self.structured else y


def _by_batches(lin, x, batch_size=4):
    """The reference a batch at a time, as predict runs it: a matmul's last bits may depend on the
    number of rows (BLAS kernels differ by shape on some CPUs), so one matmul of all rows is not
    the bitwise reference."""
    return torch.cat([lin(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])


def _x(n=50):
    return torch.randn(n, 3, generator=torch.Generator().manual_seed(0))


def _fake_device_move(monkeypatch):
    # On a CPU the output is the host copy; a fake move (a copy) stands for a device -> host copy.
    monkeypatch.setattr(host_outputs, "to_host", lambda out, pinned: fitkit.nest.map_structure(torch.clone, out))


@pytest.mark.parametrize("structured", [False, True])
def test_in_memory_predict_holds_one_batch_of_outputs_at_a_time(structured):
    net = Tracked(structured)
    model = fitkit.Model(net, device="cpu")
    out = model.predict(_x(), batch_size=4, verbose=0)  # 13 batches into one preallocated buffer
    assert len(net.alive) == 13 and max(net.alive) == 0  # at each forward, no earlier output is held
    expected = _by_batches(net.lin, _x())
    logits = out.logits if structured else out
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    if structured:
        assert isinstance(out, Out) and torch.equal(out.aux, _x().sum(1))


def test_predict_over_a_dataloader_holds_one_batch_of_outputs_at_a_time(monkeypatch):
    _fake_device_move(monkeypatch)
    net = Tracked()
    model = fitkit.Model(net, device="cpu")
    out = model.predict(DataLoader(TensorDataset(_x()), batch_size=4), verbose=0)
    assert len(net.alive) == 13 and max(net.alive) == 0
    torch.testing.assert_close(out, _by_batches(net.lin, _x()), rtol=0, atol=0)


def test_the_old_way_would_have_held_every_batch(monkeypatch):
    # The counter can fail: keeping the device outputs (no move at all) keeps them all alive.
    monkeypatch.setattr(host_outputs, "to_host", lambda out, pinned: out)
    net = Tracked()
    model = fitkit.Model(net, device="cpu")
    model.predict(DataLoader(TensorDataset(_x()), batch_size=4), verbose=0)
    assert net.alive[-1] == 12


def test_steps_cut_the_preallocated_outputs_to_the_rows_predicted():
    model = fitkit.Model(nn.Linear(3, 2), device="cpu")
    out = model.predict(_x(), batch_size=4, steps=3, verbose=0)
    assert out.shape == (12, 2)
    torch.testing.assert_close(out, model.module(_x()[:12]), rtol=0, atol=0)


def test_a_batch_that_does_not_fit_the_buffer_goes_on_as_parts():
    outs = HostOutputs(torch.device("cpu"), rows=4)
    outs.add(torch.zeros(2, 3))
    outs.add(torch.ones(2, 5))  # another trailing shape: concatenation then fails as torch.cat does
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        outs.result()
    outs = HostOutputs(torch.device("cpu"), rows=4)
    for n in (2, 2, 1):  # one row more than announced
        outs.add(torch.full((n, 1), float(n)))
    assert outs.result().flatten().tolist() == [2.0, 2.0, 2.0, 2.0, 1.0]


def test_non_tensor_leaves_keep_their_per_batch_lists():
    outs = HostOutputs(torch.device("cpu"), rows=3)
    outs.add({"name": "a", "p": torch.zeros(2)})
    outs.add({"name": "b", "p": torch.ones(1)})
    result = outs.result()
    assert result["name"] == ["a", "b"] and result["p"].tolist() == [0.0, 0.0, 1.0]
