"""Model.summary with real output shapes: from example_input, input_shape or the last batch seen."""

import pytest
import torch
from torch import nn

import fitkit
from fitkit.examples.digits import build_net
from fitkit.layers import GPT
from fitkit.tools.summary import summary_table


def _shapes(table):
    return list(table.columns[2].cells)


@pytest.mark.parametrize("how", ["input_shape", "example_input"])
def test_digits_table_has_real_shapes(how):
    model = fitkit.Model(build_net(), device="cpu")
    kwargs = {"input_shape": (64,)} if how == "input_shape" else {"example_input": torch.rand(5, 64)}
    printed = []
    table = model.summary(print_fn=printed.append, **kwargs)
    assert printed == [table]
    shapes = _shapes(table)
    assert "?" not in shapes
    b = 1 if how == "input_shape" else 5
    assert shapes[0] == f"({b}, 1, 8, 8)"  # Unflatten
    assert shapes[-1] == f"({b}, 10)"  # Total: the module's output
    assert all(m.training for m in model.module.modules())  # flags restored


def test_digits_example_prints_real_shapes(capsys, monkeypatch):
    pytest.importorskip("sklearn")
    from fitkit.examples import digits

    tables = []
    monkeypatch.setattr(fitkit.Model, "fit", lambda self, *a, **k: None)  # the table, not training
    real = fitkit.Model.summary
    monkeypatch.setattr(fitkit.Model, "summary", lambda self, *a, **k: tables.append(real(self, *a, **k)))
    digits.main(["--epochs", "1", "--verbose", "2"])
    assert len(tables) == 1 and "?" not in _shapes(tables[0])


def test_token_ids_as_example_input_and_a_tuple_input():
    gpt = GPT(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)
    table = summary_table(gpt, print_fn=lambda t: None, example_input=torch.zeros(2, 8, dtype=torch.long))
    shapes = dict(zip([c.strip() for c in table.columns[0].cells], _shapes(table), strict=True))
    assert shapes["lm_head"] == "(2, 8, 11)" and shapes["Total"] == "(2, 8, 11)"

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(4, 2)

        def forward(self, x, z):
            return self.a(x), self.b(z)

    table = summary_table(Two(), print_fn=lambda t: None, example_input=(torch.zeros(1, 3), torch.zeros(1, 4)))
    assert _shapes(table) == ["(1, 2)", "(1, 2)", "(1, 2), (1, 2)"]


def test_without_an_input_shapes_are_unknown_until_a_batch_is_seen():
    model = fitkit.Model(nn.Sequential(nn.Linear(4, 3)), device="cpu")
    assert _shapes(model.summary(print_fn=lambda t: None)) == ["?", "?"]
    model.compile("sgd", "mse")
    model.fit(torch.zeros(6, 4), torch.zeros(6, 3), batch_size=4, verbose=0)
    assert _shapes(model.summary(print_fn=lambda t: None)) == ["(4, 3)", "(4, 3)"]
    # An explicit input wins over the batch the model kept.
    assert _shapes(model.summary(print_fn=lambda t: None, input_shape=(4,))) == ["(1, 3)", "(1, 3)"]


def test_bad_inputs():
    model = fitkit.Model(nn.Linear(4, 3), device="cpu")
    with pytest.raises(ValueError, match="not both"):
        model.summary(print_fn=print, input_shape=(4,), example_input=torch.zeros(1, 4))
    with pytest.raises(TypeError, match=r"Expected `input_shape` to be a tuple of ints.*Received: input_shape=4"):
        model.summary(print_fn=print, input_shape=4)
    with pytest.raises(ValueError, match=r"input_shape.*>= 1. Received: input_shape=\(0,\)"):
        model.summary(print_fn=print, input_shape=(0,))
    with pytest.raises(ValueError, match=r"summary could not run Linear on the example input \(\(1, 5\)\)") as info:
        model.summary(print_fn=print, input_shape=(5,))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert model.module.training
