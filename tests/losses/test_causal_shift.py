"""A compiled loss on a causal LM's dict batch shifts the labels as the model's own loss does
(``compile(shift_labels=None)``: a Transformers causal LM shifts): the output at position ``t`` is
scored against label ``t + 1``, token-exact with -100 and under accumulation, equal to the
model's own loss and to a hand loop. ``shift_labels=`` sets it either way; a module fitkit does
not know, fed labels that repeat its inputs, is refused before step 1 naming ``shift_labels=``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fitkit
from fitkit.losses.labels import causal_shift, shifted

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V = 32
LR = 0.5


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=V,
        n_positions=8,
        n_embd=16,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _batch() -> dict[str, torch.Tensor]:
    """Two sequences of 6 whose shifted labels count 4 and 1 tokens (the rest -100)."""
    ids = torch.randint(1, V, (2, 6), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 5] = -100  # shifted: positions 1..4 of row 0 count
    labels[1, 2:] = -100  # and position 1 of row 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _hand(loss_of, shift: bool = True) -> tuple[nn.Module, float]:
    """One SGD step on both sequences at once: the loss over every counted token of the window."""
    net, batch = _gpt2(), _batch()
    logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
    labels = batch["labels"]
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    loss = loss_of(logits.reshape(-1, V), labels.reshape(-1))
    loss.backward()
    torch.optim.SGD(net.parameters(), lr=LR).step()
    return net, float(loss.detach())


def _fit(loss, accumulation: int = 2, module: nn.Module | None = None, **compile_kwargs):
    net = module if module is not None else _gpt2()
    model = fitkit.Model(net, device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=LR),
        loss=loss,
        gradient_accumulation_steps=accumulation,
        **compile_kwargs,
    )
    history = model.fit(_batch(), batch_size=2 // accumulation, epochs=1, shuffle=False, verbose=0)
    return net, model, history.history["loss"][0]


def _same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


def _smoothed(logits, labels):
    return F.cross_entropy(logits, labels, label_smoothing=0.1)


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize(
    "loss, by_hand, shift_labels",
    [
        ("cross_entropy", F.cross_entropy, None),  # decided from the model: it shifts
        (nn.CrossEntropyLoss(label_smoothing=0.1), _smoothed, None),
        ("cross_entropy", F.cross_entropy, True),
        ("cross_entropy", F.cross_entropy, False),  # set off: position t against label t
    ],
)
def test_a_compiled_loss_on_a_causal_lm_shifts_as_its_own_loss(loss, by_hand, shift_labels, accumulation):
    net, model, epoch_loss = _fit(loss, accumulation, shift_labels=shift_labels)
    hand, hand_loss = _hand(by_hand, shift=shift_labels is not False)
    assert model.global_step == 1
    _same(net, hand)
    assert epoch_loss == pytest.approx(hand_loss, rel=1e-5)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_compiled_cross_entropy_equals_the_models_own_loss(accumulation):
    own, _, own_loss = _fit(None, accumulation)
    compiled, _, compiled_loss = _fit("cross_entropy", accumulation)
    _same(compiled, own)
    assert compiled_loss == pytest.approx(own_loss, rel=1e-6)
    hand, hand_loss = _hand(F.cross_entropy)
    assert own_loss == pytest.approx(hand_loss, rel=1e-5)  # the mean over the 5 shifted label tokens


def test_evaluate_and_the_metrics_read_the_shifted_labels():
    net = _gpt2()
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy", metrics=["accuracy"])
    batch = _batch()
    result = model.evaluate(batch, verbose=0)
    with torch.no_grad():
        net.eval()
        logits = net(input_ids=batch["input_ids"]).logits[:, :-1]
        own = net(**batch).loss  # the model's own loss: shifted inside
    targets = batch["labels"][:, 1:]
    counted = targets != -100
    accuracy = float((logits.argmax(-1) == targets)[counted].float().mean())
    assert result["loss"] == pytest.approx(float(own), rel=1e-6)
    assert result["accuracy"] == pytest.approx(accuracy, abs=1e-7)


class _Wrapped(nn.Module):
    """A module fitkit does not know: GPT-2's logits as a plain tensor."""

    def __init__(self):
        super().__init__()
        self.gpt = _gpt2()

    def forward(self, input_ids, attention_mask=None):
        return self.gpt(input_ids=input_ids, attention_mask=attention_mask).logits


def test_an_unknown_module_whose_labels_repeat_its_inputs_is_refused_before_step_1():
    module = _Wrapped()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    model = fitkit.Model(module, device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy")
    with pytest.raises(
        ValueError,
        match=r"repeat its 'input_ids'.*cannot tell.*Fix: pass "
        r"compile\(shift_labels=True\) for a causal LM, or shift_labels=False",
    ):
        model.fit(_batch(), batch_size=1, verbose=0)
    assert model.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    # said either way, it trains: True as the causal LM's own loss, False on the labels as they are
    for shift in (True, False):
        net, model, epoch_loss = _fit("cross_entropy", 2, module=_Wrapped(), shift_labels=shift)
        hand, hand_loss = _hand(F.cross_entropy, shift=shift)
        _same(net.gpt, hand)
        assert epoch_loss == pytest.approx(hand_loss, rel=1e-5)


def test_what_fitkit_knows_of_a_module_and_the_switch_checked():
    assert causal_shift(_gpt2()) is True
    bert = transformers.BertConfig(
        vocab_size=V, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8
    )
    assert causal_shift(transformers.BertForMaskedLM(bert)) is False
    assert causal_shift(transformers.BertForTokenClassification(bert)) is False
    assert causal_shift(nn.Linear(2, 2)) is None
    assert shifted(torch.tensor([[1, 2, 3]]), pad=-1).tolist() == [[2, 3, -1]]
    model = fitkit.Model(_gpt2(), device="cpu")
    with pytest.raises(
        TypeError,
        match=r"Expected `shift_labels` to be True, False or None\. Received: "
        r"shift_labels='yes'\. Fix",
    ):
        model.compile(loss="cross_entropy", shift_labels="yes")
