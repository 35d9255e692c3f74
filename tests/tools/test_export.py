"""Export for serving: torch.export programs and ONNX files that onnxruntime runs."""

import importlib.util

import pytest
import torch
from torch import nn

import fitkit
from fitkit.examples.digits import build_net
from fitkit.layers import GPT
from fitkit.tools.export import export


def _onnx_outputs(path, feeds):
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session, names, [session.run(None, dict(zip(names, f, strict=True)))[0] for f in feeds]


def _needs_onnx():
    for name in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(name)


def test_digits_cnn_to_onnx_runs_in_onnxruntime_on_two_batch_sizes(tmp_path):
    _needs_onnx()
    model = fitkit.Model(build_net(), device="cpu")  # dropout layers: eval mode must be exported
    model.module.train()
    path = model.export(tmp_path / "digits.onnx", torch.rand(1, 64), format="onnx")
    assert path == tmp_path / "digits.onnx" and path.is_file()
    assert not (tmp_path / "digits.onnx.data").exists()  # small weights stay in the one file
    assert all(m.training for m in model.module.modules())  # flags restored
    xs = [torch.rand(1, 64), torch.rand(7, 64)]
    session, names, outs = _onnx_outputs(path, [[x.numpy()] for x in xs])
    assert session.get_inputs()[0].shape == ["batch", 64]  # symbolic, not the example's size
    assert session.get_outputs()[0].shape == ["batch", 10]
    model.module.eval()
    with torch.no_grad():
        for x, out in zip(xs, outs, strict=True):
            assert out.shape == (len(x), 10)
            torch.testing.assert_close(torch.from_numpy(out), model.module(x), atol=1e-5, rtol=0)


def test_gpt_preset_to_onnx_runs_in_onnxruntime_on_two_batch_sizes(tmp_path):
    _needs_onnx()
    gpt = GPT(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    path = export(gpt, tmp_path / "gpt.onnx", torch.randint(0, 65, (2, 16)), format="onnx")
    idx = [torch.randint(0, 65, (1, 16)), torch.randint(0, 65, (5, 16))]
    _, names, outs = _onnx_outputs(path, [[i.numpy()] for i in idx])
    assert names == ["idx"]
    gpt.eval()
    with torch.no_grad():
        for i, out in zip(idx, outs, strict=True):
            assert out.shape == (len(i), 16, 65)
            torch.testing.assert_close(torch.from_numpy(out), gpt(i), atol=1e-5, rtol=0)


def test_torch_format_loads_back_and_matches_on_two_batch_sizes(tmp_path):
    net = build_net()
    path = export(net, tmp_path / "sub" / "digits.pt2", torch.rand(3, 64))  # parent created
    program = torch.export.load(path)
    assert isinstance(program, torch.export.ExportedProgram)
    net.eval()
    with torch.no_grad():
        for n in (1, 9):
            x = torch.rand(n, 64)
            torch.testing.assert_close(program.module()(x), net(x), atol=1e-6, rtol=0)


def test_tuple_and_dict_inputs_follow_fits_calling_convention(tmp_path):
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(4, 2)

        def forward(self, x, z):
            return self.a(x) + self.b(z)

    net = Two()
    x, z = torch.rand(1, 3), torch.rand(1, 4)
    for i, example in enumerate([(x, z), {"x": x, "z": z}]):
        program = torch.export.load(export(net, tmp_path / f"two{i}.pt2", example))
        x5, z5 = torch.rand(5, 3), torch.rand(5, 4)
        call = program.module()(x5, z5) if i == 0 else program.module()(x=x5, z=z5)
        torch.testing.assert_close(call, net(x5, z5))


def test_static_batch_keeps_the_example_size(tmp_path):
    net = nn.Linear(4, 2)
    program = torch.export.load(export(net, tmp_path / "s.pt2", torch.rand(3, 4), dynamic_batch=False))
    assert program.module()(torch.rand(3, 4)).shape == (3, 2)
    with pytest.raises(AssertionError, match="Guard failed"):  # the batch size is fixed
        program.module()(torch.rand(4, 4))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # Python control flow on a tensor's value
            return self.fc(x)
        return x


def test_a_module_that_cannot_be_traced_raises_a_clear_error(tmp_path):
    net = DataDependent()
    with pytest.raises(RuntimeError, match=r"could not export DataDependent.*torch\.where or torch\.cond") as info:
        export(net, tmp_path / "bad.pt2", torch.rand(2, 4))
    assert info.value.__cause__ is not None  # the original error, chained
    assert net.training and not (tmp_path / "bad.pt2").exists()


def test_bad_arguments(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"Unknown export format 'tflite'\. Valid formats: torch, onnx\."):
        export(nn.Linear(2, 2), tmp_path / "x", torch.rand(2, 2), format="tflite")
    with pytest.raises(TypeError, match="Expected `module` to be a torch.nn.Module"):
        export(lambda x: x, tmp_path / "x", torch.rand(2, 2))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "onnxscript" else real(n, *a))
    expected = (
        r"needs onnxscript\. Install the `onnx` extra: "
        r"`pip install '\.\[onnx\]'` from a checkout \(`pip install 'torch-fitkit\[onnx\]'`"
    )
    with pytest.raises(ImportError, match=expected):
        export(nn.Linear(2, 2), tmp_path / "x.onnx", torch.rand(2, 2), format="onnx")
    assert not (tmp_path / "x.onnx").exists()


Pair = __import__("collections").namedtuple("Pair", "a b")


class OnPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, p):
        return self.lin(p.a) + p.b


@pytest.mark.slow
def test_a_namedtuple_input_is_one_input_in_torch_and_onnx(tmp_path):
    torch.manual_seed(0)
    model = fitkit.Model(OnPair(), device="cpu")
    example = Pair(torch.ones(1, 2), torch.ones(1, 1))
    three = Pair(torch.arange(6.0).reshape(3, 2), torch.tensor([[1.0], [2.0], [3.0]]))
    with torch.no_grad():
        expected = model.module(three)  # lin(a) + b, shape (3, 1)
    path = model.export(tmp_path / "pair.pt2", example)
    with torch.serialization.safe_globals([Pair]):  # torch loads the example input weights_only
        program = torch.export.load(path).module()
    torch.testing.assert_close(program(three), expected)
    _needs_onnx()
    _, names, (out,) = _onnx_outputs(
        model.export(tmp_path / "pair.onnx", example, format="onnx"), [(three.a.numpy(), three.b.numpy())]
    )
    assert len(names) == 2 and out.shape == (3, 1)
    torch.testing.assert_close(torch.from_numpy(out), expected)
