"""NEFTune: the noise each training forward adds to the input embeddings, reproduced exactly
from the RNG state it was drawn with; none in validation, evaluate or after fit; bad input
refused before step 1."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import NEFTune


class Tagger(nn.Module):
    """(B, L) token ids -> (B, 1): an embedding, then a mean over positions and a Linear."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


def _data(n: int = 12, length: int = 5):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 11, (n, length), generator=g), torch.randn(n, 1, generator=g)


def _model(net: nn.Module | None = None, lr: float = 0.1) -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(net or Tagger(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=lr), loss="mse")
    return model


class _Witness:
    """Records, per forward of ``embed``, the RNG state before it, the clean output and the output."""

    def __init__(self, embed: nn.Module):
        self.records = []
        self.pre = embed.register_forward_pre_hook(self._before)
        self.post = embed.register_forward_hook(self._after)  # registered first: runs before NEFTune's

    def _before(self, module, inputs):
        self.records.append({"rng": torch.get_rng_state(), "training": module.training})

    def _after(self, module, inputs, output):
        self.records[-1]["clean"] = output.detach().clone()

    def outputs(self, embed: nn.Module):
        # a hook registered after NEFTune's sees the noisy output
        return embed.register_forward_hook(lambda m, i, out: self.records[-1].__setitem__("out", out.detach().clone()))


def test_each_training_forward_gets_the_papers_uniform_noise_exactly():
    x, y = _data()
    model = _model()
    embed = model.module.embed
    witness = _Witness(embed)
    noise = NEFTune(noise_alpha=5.0)
    # the NEFTune hook goes on at on_train_begin, after the witness's first hook; the last hook sees its output
    late = {}

    class Late(fitkit.Callback):
        def on_train_begin(self, logs=None):
            late["handle"] = witness.outputs(embed)

    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[noise, Late()])
    late["handle"].remove()
    training = [r for r in witness.records if r["training"]]
    assert len(training) == 6 == noise.forwards  # 3 batches x 2 epochs
    bound = 5.0 / math.sqrt(5 * 6)  # alpha / sqrt(L * d)
    assert noise.bound == bound
    for r in training:
        after = torch.get_rng_state()
        torch.set_rng_state(r["rng"])  # the generator as it was when this forward drew its noise
        expected = r["clean"] + torch.empty_like(r["clean"]).uniform_(-bound, bound)
        torch.set_rng_state(after)
        assert torch.equal(r["out"], expected)
        assert not torch.equal(r["out"], r["clean"])
        assert (r["out"] - r["clean"]).abs().max() <= bound


def test_validation_evaluate_and_predict_see_the_plain_embeddings():
    x, y = _data()
    model = _model(lr=0.0)  # weights fixed: every loss is the loss of the same weights
    plain = model.evaluate(x, y, batch_size=4, verbose=0)["loss"]
    history = model.fit(
        x, y, batch_size=4, epochs=1, verbose=0, validation_data=(x, y), callbacks=[NEFTune(noise_alpha=10.0)]
    )
    assert history.history["val_loss"] == [plain]
    assert history.history["loss"] != [plain]  # the training forwards had noise
    assert model.evaluate(x, y, batch_size=4, verbose=0)["loss"] == plain
    model.module.train()
    assert torch.equal(model.module.embed(x), model.module.embed.weight[x])  # the hook is gone after fit


def test_the_hook_comes_off_when_fit_raises():
    x, y = _data()
    model = _model()

    class Boom(fitkit.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[NEFTune(), Boom()])
    assert not model.module.embed._forward_hooks


def test_a_hugging_face_style_model_names_its_embedding():
    class WithGetter(Tagger):
        def __init__(self):
            super().__init__()
            self.other = nn.Embedding(3, 6)  # two embeddings: the getter decides

        def get_input_embeddings(self):
            return self.embed

    x, y = _data()
    noise = NEFTune()
    model = _model(WithGetter())
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[noise])
    assert noise.forwards == 3 and noise._target is model.module.embed


def test_an_embedding_by_name_or_module():
    x, y = _data()
    for embedding in ("embed", None):
        model = _model()
        noise = NEFTune(embedding=embedding if embedding else model.module.embed)
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[noise])
        assert noise.forwards == 3


class TwoEmbeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Embedding(11, 6), nn.Embedding(11, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, ids):
        return self.head((self.a(ids) + self.b(ids)).mean(1))


@pytest.mark.parametrize(
    "net, kwargs, match",
    [
        (TwoEmbeddings, {}, r"2 nn.Embedding modules \(\['a', 'b'\]\).*Fix: pass NEFTune\(embedding='name'\)"),
        (Tagger, {"embedding": "embedd"}, r"embedding='embedd' is not a submodule's name.*\['embed'\]"),
        (Tagger, {"embedding": nn.Embedding(2, 2)}, r"not a submodule of the model"),
    ],
)
def test_no_embedding_found_is_an_error_before_step_1(net, kwargs, match):
    x, y = _data()
    model = _model(net())
    before = [p.clone() for p in model.module.parameters()]
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[NEFTune(**kwargs)])
    assert model.global_step == 0
    assert all(torch.equal(p, q) for p, q in zip(model.module.parameters(), before, strict=True))


@pytest.mark.parametrize(
    "alpha, error", [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), ("5", TypeError)]
)
def test_a_bad_alpha_is_refused(alpha, error):
    with pytest.raises(error, match="noise_alpha"):
        NEFTune(noise_alpha=alpha)


def test_a_bad_embedding_argument_is_refused():
    with pytest.raises(TypeError, match="Expected `embedding` to be an nn.Module, a submodule's name or None"):
        NEFTune(embedding=3)
