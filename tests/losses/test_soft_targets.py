"""Soft targets as users write them: probabilities (mixup, distillation, label smoothing) for
cross-entropy over the class dimension fitkit uses for logits, and smoothed binary targets,
whose accuracy compares with the side of 0.5 they are on. Values are plain PyTorch's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fitkit


class Tokens(nn.Module):
    """(B, T, 4) -> (B, T, 5) logits, the language-model layout."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 5)

    def forward(self, x):
        return self.linear(x)


def _model(net, loss="cross_entropy", metrics=("accuracy",), lr=0.5) -> fitkit.Model:
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=lr), loss=loss, metrics=list(metrics))
    return model


def test_probability_targets_of_a_sequence_take_the_softmax_over_the_vocabulary():
    g = torch.Generator().manual_seed(1)
    x, probs = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 5, generator=g).softmax(-1)
    model = _model(Tokens())
    with torch.no_grad():
        logits = model.module(x)
    result = model.evaluate(x, probs, verbose=0)
    assert result["loss"] == float(F.cross_entropy(logits.reshape(-1, 5), probs.reshape(-1, 5)))
    assert result["accuracy"] == float((logits.argmax(-1) == probs.argmax(-1)).float().mean())


def test_a_training_step_on_mixed_up_targets_equals_the_hand_step():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 4, generator=g)
    a, b = torch.randint(0, 5, (4, 3), generator=g), torch.randint(0, 5, (4, 3), generator=g)
    probs = 0.7 * F.one_hot(a, 5).float() + 0.3 * F.one_hot(b, 5).float()  # mixup of two labelings
    hand = Tokens()
    loss = F.cross_entropy(hand(x).reshape(-1, 5), probs.reshape(-1, 5))
    loss.backward()
    torch.optim.SGD(hand.parameters(), lr=0.5).step()
    model = _model(Tokens(), metrics=())
    history = model.fit(x, probs, batch_size=4, shuffle=False, verbose=0)
    assert history.history["loss"] == [float(loss.detach())]
    for p, q in zip(model.module.parameters(), hand.parameters(), strict=True):
        assert torch.equal(p, q)


def test_label_smoothing_is_honoured_with_probability_targets():
    g = torch.Generator().manual_seed(3)
    x, probs = torch.randn(6, 4, generator=g), torch.randn(6, 5, generator=g).softmax(-1)
    torch.manual_seed(0)
    net = nn.Linear(4, 5)
    model = _model(net, loss=nn.CrossEntropyLoss(label_smoothing=0.1), metrics=())
    with torch.no_grad():
        expected = F.cross_entropy(net(x), probs, label_smoothing=0.1)
    assert model.evaluate(x, probs, verbose=0)["loss"] == float(expected)


def test_a_layout_seen_with_class_indices_holds_for_probabilities():
    # (B, C, L) segmentation logits: class indices (B, L) say the classes are on dim 1
    g = torch.Generator().manual_seed(4)

    class Seg(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv = nn.Conv1d(2, 3, 1)

        def forward(self, x):
            return self.conv(x)

    x = torch.randn(2, 2, 7, generator=g)
    model = _model(Seg(), metrics=())
    model.evaluate(x, torch.randint(0, 3, (2, 7), generator=g), verbose=0)
    probs = torch.randn(2, 3, 7, generator=g).softmax(1)
    with torch.no_grad():
        expected = F.cross_entropy(model.module(x), probs)  # PyTorch's dim 1
    assert model.evaluate(x, probs, verbose=0)["loss"] == float(expected)


def test_smoothed_binary_targets_score_by_their_side_of_one_half():
    torch.manual_seed(0)
    net = nn.Linear(2, 1)
    x = torch.randn(16, 2, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = net(x)
    y = torch.where(logits > 0, 0.9, 0.1)  # the model is right on every row, smoothed by 0.1
    model = _model(net, loss="bce_with_logits", metrics=("accuracy",))
    result = model.evaluate(x, y, verbose=0)
    assert result["accuracy"] == 1.0
    assert result["loss"] == float(F.binary_cross_entropy_with_logits(logits, y))
