"""compile(micro_batch_size=...) (Composer's device_train_microbatch_size): each batch in chunks,
accumulated into exactly the unsplit batch's step, by rows, sample weights and tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import Callback

N, BATCH, T, V = 10, 4, 5, 7


class Seen(nn.Module):
    """A token model (B, T) -> (B, T, V) that records the rows of each training forward."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, 6), nn.Linear(6, V)
        self.rows: list[int] = []

    def forward(self, x):
        if self.training:
            self.rows.append(x.shape[0])
        return self.head(torch.tanh(self.emb(x)))


class Rows(nn.Module):
    """(B, 3) -> (B, 1), recording the rows of each training forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        self.rows: list[int] = []

    def forward(self, x):
        if self.training:
            self.rows.append(x.shape[0])
        return self.lin(x)


class Counts(Callback):
    def __init__(self):
        super().__init__()
        self.batches, self.backward_ends = 0, 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1

    def on_backward_end(self, batch):
        self.backward_ends += 1


def _case(source: str):
    """(module, x, y, sample_weight, loss) for one denominator: rows, sample weights, tokens, a sum."""
    g = torch.Generator().manual_seed(0)
    if source == "tokens":  # cross-entropy over (B, T) targets with ignored positions: a token mean
        x = torch.randint(0, V, (N, T), generator=g)
        y = torch.randint(0, V, (N, T), generator=g)
        y[torch.rand(N, T, generator=g) < 0.4] = -100
        y[1] = -100  # a row where nothing counts
        return Seen(), x, y, None, "cross_entropy"
    x, y = torch.randn(N, 3, generator=g), torch.randn(N, 1, generator=g)
    w = torch.rand(N, generator=g) + 0.1 if source == "weights" else None
    loss = nn.MSELoss(reduction="sum") if source == "sum" else "mse"
    return Rows(), x, y, w, loss


def _fit(source: str, micro: int | None, accumulation: int):
    module, x, y, w, loss = _case(source)
    torch.manual_seed(0)
    for p in module.parameters():
        nn.init.normal_(p, std=0.5)
    model = fitkit.Model(module, device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        loss=loss,
        micro_batch_size=micro,
        gradient_accumulation_steps=accumulation,
    )
    counts = Counts()
    history = model.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=2, shuffle=False, callbacks=[counts], verbose=0)
    return model, history, counts


@pytest.mark.parametrize("source", ["rows", "weights", "tokens", "sum"])
@pytest.mark.parametrize(("micro", "accumulation"), [(1, 1), (3, 1), (2, 2), (3, 2), (4, 1), (100, 1)])
def test_micro_batches_give_the_unsplit_batchs_step(source, micro, accumulation):
    whole, whole_history, whole_counts = _fit(source, None, accumulation)
    split, split_history, split_counts = _fit(source, micro, accumulation)
    for a, b in zip(split.module.parameters(), whole.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a reduction="sum" loss logs the sum of each chunk it ran (as of each micro-batch under accumulation)
    for key in ("loss", "learning_rate") if source != "sum" else ("learning_rate",):
        assert split_history.history[key] == pytest.approx(whole_history.history[key], rel=1e-5)
    # the loop counts whole batches: batch hooks, optimizer steps, on_backward_end
    assert (split_counts.batches, split_counts.backward_ends) == (whole_counts.batches, whole_counts.backward_ends)
    assert split.global_step == whole.global_step
    batches = [BATCH, BATCH, N - 2 * BATCH] * 2  # 4, 4, 2 rows per batch, two epochs
    expected = [min(micro, b - lo) for b in batches for lo in range(0, b, micro)]
    assert split.module.rows == expected
    assert whole.module.rows == batches


def test_micro_batches_match_a_hand_loop_exactly_in_one_chunk_per_row_case():
    """A batch of 4 rows in chunks of 2 against the hand loop: mean over chunk * 2/4, summed."""
    module, x, y, _, _ = _case("rows")
    torch.manual_seed(0)
    hand = Rows()
    hand.load_state_dict(module.state_dict())
    model = fitkit.Model(module, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.05), loss="mse", micro_batch_size=2)
    model.fit(x[:8], y[:8], batch_size=4, shuffle=False, verbose=0)
    opt = torch.optim.SGD(hand.parameters(), lr=0.05)
    for lo in (0, 4):
        opt.zero_grad()
        for c in (lo, lo + 2):
            (nn.functional.mse_loss(hand(x[c : c + 2]), y[c : c + 2]) * (2 / 4)).backward()
        opt.step()
    for a, b in zip(module.parameters(), hand.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, r"Expected `micro_batch_size` >= 1\. Received: micro_batch_size=0\."),
        (2.0, TypeError, r"Expected `micro_batch_size` to be an int\. Received: micro_batch_size=2\.0\."),
    ],
)
def test_micro_batch_size_errors(value, error, match):
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    with pytest.raises(error, match=match):
        model.compile(loss="mse", micro_batch_size=value)
    assert model.optimizer is None
