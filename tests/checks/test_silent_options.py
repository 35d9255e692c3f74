"""Options that were taken silently are refused before step 1, naming the argument and the fix,
with nothing changed: the weights, the optimizer's step count and the files stay as they were."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import fitkit

X = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
Y = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))


class _Keyed(nn.Module):
    """A module fed dict batches ``{"features": (B, 2), "target": (B, 1)}``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, features):
        return self.lin(features)


def _model(module: nn.Module | None = None, **compile_kwargs) -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(module if module is not None else nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="sgd", **{"loss": "mse", **compile_kwargs})
    return model


def _frozen() -> fitkit.Model:
    model = _model()
    model.module.requires_grad_(False)
    return model


def _fit(model, **kwargs):
    return model.fit(X, Y, batch_size=4, verbose=0, **kwargs)


_DICT = {"features": X, "target": Y}
CASES = {
    # min_epochs / min_steps the fit ends before (the bounds explicit in epochs / max_steps were refused before)
    "min_epochs, epochs=None": (
        _model,
        lambda m, d: _fit(m, min_epochs=2),
        ValueError,
        r"min_epochs=2 asks for more epochs than this fit runs \(1; epochs=None runs 1",
    ),
    "min_epochs, fractional epochs": (
        _model,
        lambda m, d: _fit(m, min_epochs=3, epochs=2.5),
        ValueError,
        r"min_epochs=3 .*its step budget, 5 steps, ends it before 3 epochs, "
        r"which take 6.*Fix",
    ),
    "min_epochs beyond max_steps": (
        _model,
        lambda m, d: _fit(m, min_epochs=3, epochs=10, max_steps=4),
        ValueError,
        r"min_epochs=3 .* 4 steps, ends it before 3 epochs, which take 6.*Fix",
    ),
    "min_epochs beyond max_steps' epochs": (
        _model,
        lambda m, d: _fit(m, min_epochs=3, max_steps=4),
        ValueError,
        r"min_epochs=3 asks for more epochs than this fit runs \(2\)",
    ),
    "min_steps beyond the epochs": (
        _model,
        lambda m, d: _fit(m, min_steps=9, epochs=2),
        ValueError,
        r"min_steps=9 asks for more optimizer steps than this fit plans \(4\).*Fix",
    ),
    "label_names matching no key": (
        lambda: _model(_Keyed(), label_names="targets"),
        lambda m, d: m.fit(_DICT, batch_size=4, verbose=0),
        ValueError,
        r"compile\(label_names=\['targets'\]\) names no key of the batch \(keys: "
        r"\['features', 'target'\]\).*Fix: .*label_names=\['target'\]",
    ),
    "label_names with a tensor x": (
        lambda: _model(label_names="target"),
        lambda m, d: _fit(m),
        ValueError,
        r"label_names=\['target'\]\) names no key .* a Tensor \(no dict\).*Fix",
    ),
    "a loss module's bogus reduction": (
        lambda: _model(loss=nn.MSELoss(reduction="bogus")),
        lambda m, d: _fit(m),
        ValueError,
        r"Expected the loss's `reduction` to be one of .* Received: "
        r"MSELoss\(reduction='bogus'\)\. Fix",
    ),
    "trainable_only a string": (
        _model,
        lambda m, d: m.save_weights(os.path.join(d, "w.pt"), trainable_only="no"),
        TypeError,
        r"Expected `trainable_only` to be a bool\. Received: "
        r"trainable_only='no'\. Fix",
    ),
    "trainable_only a string, load": (
        _model,
        lambda m, d: m.load_weights(os.path.join(d, "w.pt"), trainable_only="no"),
        TypeError,
        r"Received: trainable_only='no'",
    ),
    "every parameter frozen": (
        _frozen,
        lambda m, d: m.save_weights(os.path.join(d, "w.pt"), trainable_only=True),
        ValueError,
        r"would write an empty file to .*w\.pt': no parameter of the module "
        r"requires grad \(all are frozen\)\. Received: trainable_only=True\. Fix",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_silent_option_is_refused_and_changes_nothing(case, tmp_path):
    build, call, error, match = CASES[case]
    if case == "a loss module's bogus reduction":  # refused by compile itself
        with pytest.raises(error, match=match):
            build()
        return
    model = build()
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    with pytest.raises(error, match=match):
        call(model, str(tmp_path))
    assert model.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in model.module.state_dict().items())
    assert os.listdir(tmp_path) == []  # no file written


def test_the_options_still_work_where_they_are_right(tmp_path):
    model = _model(_Keyed(), label_names="target")  # a key of the batch: its loss is the targets' MSE
    model.fit(_DICT, batch_size=8, epochs=1, verbose=0, min_epochs=1)
    with torch.no_grad():
        expected = float(nn.functional.mse_loss(model.module(X), Y))
    assert model.evaluate(_DICT, verbose=0)["loss"] == pytest.approx(expected, abs=1e-7)
    assert _fit(_model(), min_epochs=2, epochs=2, min_steps=4).epoch == [0, 1]
    assert _model(loss=nn.MSELoss(reduction="sum")).loss.reduction == "sum"
    model = _model()
    model.module.weight.requires_grad_(False)
    model.save_weights(tmp_path / "w.pt", trainable_only=True)
    assert sorted(torch.load(tmp_path / "w.pt", weights_only=True)) == ["bias"]
