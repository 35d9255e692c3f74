"""The one rule that picks the prediction out of a structured output, and its error.

The rule (fitkit/losses/outputs.py): a tensor; a dict / ``ModelOutput``'s ``"logits"``, else its only
tensor entry besides ``"loss"``; a namedtuple's ``logits`` field, else its first field.
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fitkit
from fitkit.losses.outputs import prediction_of, require_prediction

Out = namedtuple("Out", "scores aux")


class DictNet(nn.Module):
    """Returns ``{"loss"?: ..., **heads}``; the loss is its own when ``labels`` are given."""

    def __init__(self, heads: tuple[str, ...]):
        super().__init__()
        self.heads = heads
        self.linear = nn.Linear(3, 2)

    def forward(self, x, labels=None):
        z = self.linear(x)
        out = {name: z * (i + 1) for i, name in enumerate(self.heads)}
        if labels is not None:
            out["loss"] = F.cross_entropy(out[self.heads[0]], labels)
        return out


def _data(n: int = 8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)


def test_the_rule_picks_logits_then_the_only_other_tensor_then_a_namedtuples_first_field():
    logits, other = torch.zeros(2, 3), torch.ones(2, 3)
    assert prediction_of({"hidden": other, "logits": logits}) is logits
    assert prediction_of({"loss": torch.tensor(1.0), "scores": other}) is other
    assert prediction_of({"a": logits, "b": other}) is None
    assert prediction_of(Out(other, logits)) is other
    assert prediction_of((logits, other)) is None  # a plain tuple: several outputs


@pytest.mark.parametrize("data", ["in-memory", "iterable"])
def test_a_compiled_loss_without_a_prediction_fails_before_any_step_and_names_the_fix(data):
    x, y = _data()
    model = fitkit.Model(DictNet(("start", "end")), device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy")
    before = model.module.linear.weight.detach().clone()
    source = (x, y) if data == "in-memory" else ([(x, y)],)
    with pytest.raises(
        ValueError,
        match=r"cannot pick one prediction tensor for the loss 'cross_entropy' out of "
        r"the module's output: a dict with tensor entries 'start', 'end'\. "
        r"The rule .*'logits'.*Fix: return a tensor, or put the prediction under "
        r"'logits'",
    ):
        model.fit(*source, verbose=0)
    assert torch.equal(model.module.linear.weight, before) and model.global_step == 0


@pytest.mark.parametrize("data", ["in-memory", "iterable"])
def test_metrics_without_a_prediction_fail_before_any_step_and_name_the_fix(data):
    x, y = _data()
    model = fitkit.Model(DictNet(("start", "end")), device="cpu")
    model.compile(optimizer="sgd", loss=None, metrics=["accuracy"])  # the module's own loss
    before = model.module.linear.weight.detach().clone()
    batch = {"x": x, "labels": y}
    with pytest.raises(
        ValueError,
        match=r"cannot pick one prediction tensor for the compiled metrics .*"
        r"entries 'start', 'end'.*compute metrics in a custom test_step",
    ):
        model.fit(batch if data == "in-memory" else [batch], verbose=0)
    assert torch.equal(model.module.linear.weight, before) and model.global_step == 0
    with pytest.raises(ValueError, match=r"for the compiled metrics"):
        model.evaluate(batch, verbose=0)


def test_require_prediction_describes_what_it_got():
    with pytest.raises(ValueError, match=r"output: a tuple of 2 items\."):
        require_prediction((torch.zeros(1), torch.zeros(1)), "the loss 'mse'")
    assert require_prediction(Out(torch.ones(1), torch.zeros(1)), "x").tolist() == [1.0]


def test_an_output_with_logits_trains_evaluates_and_predicts_by_the_rule():
    x, y = _data(16)
    model = fitkit.Model(DictNet(("logits", "aux")), device="cpu")
    model.compile(optimizer="sgd", loss=None, metrics=["accuracy"])
    model.fit({"x": x, "labels": y}, batch_size=8, verbose=0)
    result = model.evaluate({"x": x, "labels": y}, batch_size=16, verbose=0)
    logits = model.predict({"x": x}, verbose=0)  # the "logits" entry, not the dict
    assert isinstance(logits, torch.Tensor) and logits.shape == (16, 2)
    assert result["loss"] == pytest.approx(float(F.cross_entropy(logits, y)), abs=1e-6)
    assert result["accuracy"] == float((logits.argmax(-1) == y).float().mean())
    # A dict without "logits" comes back whole from predict.
    model2 = fitkit.Model(DictNet(("start", "end")), device="cpu")
    out = model2.predict({"x": x}, verbose=0)
    assert sorted(out) == ["end", "start"] and out["end"].shape == (16, 2)


def test_a_plain_callable_loss_reads_the_whole_structured_output():
    x, y = _data()

    def two_heads(out, target):
        return F.cross_entropy(out["start"], target) + F.cross_entropy(out["end"], target)

    model = fitkit.Model(DictNet(("start", "end")), device="cpu")
    model.compile(optimizer="sgd", loss=two_heads)
    result = model.evaluate(x, y, verbose=0)
    with torch.no_grad():
        out = model.module(x)
    assert result["loss"] == pytest.approx(float(two_heads(out, y)), abs=1e-6)
