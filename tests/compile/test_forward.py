"""jit_compile: policy, a cheap backend on the CPU, recompile counts, fallback, clean files."""

import warnings

import pytest
import torch
from conftest import CountingBackend
from torch import nn

import fitkit
from fitkit.compile import resolve_jit_compile


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 3))


def _data(n=50):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_policy():
    cpu = torch.device("cpu")
    assert resolve_jit_compile("auto", cpu) is False
    assert resolve_jit_compile(False, cpu) is False
    assert resolve_jit_compile(True, cpu) == {}
    assert resolve_jit_compile({"backend": "eager"}, cpu) == {"backend": "eager"}
    with pytest.raises(TypeError, match="Expected `jit_compile` to be 'auto', True, False or a dict"):
        resolve_jit_compile("yes", cpu)


def test_no_recompilation_storm():
    torch._dynamo.reset()
    backend = CountingBackend()
    x, y = _data(50)  # batch 16: 16, 16, 16, 2 -> a smaller last batch every epoch
    model = fitkit.Model(_net(), device="cpu")
    model.compile(loss="cross_entropy", metrics=["accuracy"], jit_compile={"backend": backend})
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, validation_data=(x, y))
    after_first_epoch = backend.compiles
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, validation_data=(x, y))
    model.evaluate(x, y, batch_size=16, verbose=0)
    model.predict(x, batch_size=16, verbose=0)
    # A train graph, recompiled once with a dynamic batch size for the smaller last batch, and
    # an eval (no-grad) graph that starts dynamic; the first-batch check runs the module itself
    # and compiles nothing. After that, more epochs, evaluate and predict reuse them.
    assert after_first_epoch == 3
    assert backend.compiles == after_first_epoch
    # New batch sizes reuse the dynamic graphs; dynamo still specializes a batch of exactly 1
    # (50 = 7 * 7 + 1) and guards view offsets once: bounded, not one per batch or epoch.
    model.evaluate(x, y, batch_size=7, verbose=0)
    model.predict(x, batch_size=9, verbose=0)
    model.fit(x, y, batch_size=9, epochs=2, verbose=0, validation_data=(x, y))
    assert backend.compiles <= after_first_epoch + 3


def test_compiled_matches_eager_and_files_have_no_prefix(tmp_path):
    torch._dynamo.reset()
    x, y = _data(40)
    eager = fitkit.Model(_net(), device="cpu")
    compiled = fitkit.Model(_net(), device="cpu")
    eager.compile(loss="cross_entropy", jit_compile=False)
    compiled.compile(loss="cross_entropy", jit_compile={"backend": "aot_eager"})
    torch.manual_seed(1)
    eager.fit(x, y, batch_size=8, epochs=2, verbose=0)
    torch.manual_seed(1)
    compiled.fit(x, y, batch_size=8, epochs=2, verbose=0)
    for pa, pb in zip(eager.module.parameters(), compiled.module.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-5, rtol=1e-5)

    assert not any("_orig_mod" in k for k in compiled.state_dict())
    compiled.save_weights(tmp_path / "w.pt")
    compiled.save_checkpoint(tmp_path / "c.pt")
    for f in ("w.pt", "c.pt"):
        raw = torch.load(tmp_path / f, weights_only=True)
        keys = raw.keys() if f == "w.pt" else raw["module"].keys()
        assert not any("_orig_mod" in k for k in keys)

    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 3))
    plain.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True), strict=True)
    plain.eval()
    torch.testing.assert_close(plain(x), compiled.predict(x, verbose=0))

    # and the other way: an eager file loads into a compiled model
    back = fitkit.Model(_net(), device="cpu")
    back.compile(loss="cross_entropy", jit_compile={"backend": "eager"})
    back.load_weights(tmp_path / "w.pt")
    torch.testing.assert_close(back.predict(x, verbose=0), compiled.predict(x, verbose=0))


def test_failing_compile_falls_back_with_one_warning():
    torch._dynamo.reset()

    def broken_backend(gm, example_inputs):
        raise RuntimeError("backend exploded")

    x, y = _data(32)
    model = fitkit.Model(_net(), device="cpu")
    model.compile(loss="cross_entropy", jit_compile={"backend": broken_backend})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hist = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    fallback = [w for w in caught if "torch.compile failed" in str(w.message)]
    assert len(fallback) == 1
    assert len(hist.history["loss"]) == 2
    assert model._core.training_forward._fn is model._core.training_forward.eager  # eager from the fallback on


def test_bad_compile_kwargs_fall_back():
    model = fitkit.Model(_net(), device="cpu")
    model.compile(loss="cross_entropy", jit_compile={"no_such_option": 1})
    x, y = _data(8)
    with pytest.warns(UserWarning, match="torch.compile failed"):  # at the first forward
        model.fit(x, y, epochs=1, verbose=0)
