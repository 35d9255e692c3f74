"""fit(max_tokens=N): training ends with the optimizer step whose accumulation window brings the
tokens trained on (from epoch 0, ``B * T`` per batch as TokensSeen counts them) to N or more; a
window is never cut. Checked against a hand loop over the same windows, with accumulation, across
epochs, with a planned scheduler, on resume, and the bad inputs refused before step 1."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import BackupAndRestore, LambdaCallback, TokensSeen

T = 3
X = torch.arange(11 * T).remainder(7).reshape(11, T)  # 11 sequences of 3 token ids
Y = X.float().sum(1, keepdim=True) / 10
LR = 0.05
# batch_size=2: six batches of 2, 2, 2, 2, 2, 1 rows, so 6, 6, 6, 6, 6, 3 tokens (33 per epoch)
B = [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 11)]


class TokenLinear(nn.Module):
    """(B, T) token ids -> (B, 1): a linear map of the ids as numbers, no bias (exact by hand);
    ``values`` mapped instead when given (inputs whose ``input_ids`` hold no token)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(T, 1, bias=False)
        nn.init.zeros_(self.linear.weight)

    def forward(self, input_ids, attention_mask=None, values=None):
        return self.linear((input_ids if values is None else values).float())


def _model(accumulation: int | dict[int, int] = 1, scheduler=None) -> fitkit.Model:
    model = fitkit.Model(TokenLinear(), device="cpu")
    model.compile(
        optimizer=lambda p: torch.optim.SGD(p, lr=LR),
        loss="mse",
        gradient_accumulation_steps=accumulation,
        scheduler=scheduler,
        scheduler_interval="step",
    )
    return model


def _hand(windows: list[list[tuple[int, int]]], lr_at=lambda step: LR) -> torch.Tensor:
    """SGD steps, one per window of batches [a, b): the mean squared error over the window's rows."""
    w = torch.zeros(1, T, requires_grad=True)
    opt = torch.optim.SGD([w], lr=LR)
    for step, window in enumerate(windows):
        rows = torch.cat([torch.arange(a, b) for a, b in window])
        loss = torch.nn.functional.mse_loss(X[rows].float() @ w.T, Y[rows])
        opt.param_groups[0]["lr"] = lr_at(step)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w.detach()


def _tokens(windows: list[list[tuple[int, int]]]) -> int:
    return sum((b - a) * T for window in windows for a, b in window)


@pytest.mark.parametrize(
    "accumulation, max_tokens, windows, epochs",
    [
        (1, 12, [[B[0]], [B[1]]], [0]),  # exactly 12: after the second batch
        (1, 31, [[b] for b in B], [0]),  # 30 after five batches: the short last one (3 tokens) completes
        (3, 7, [B[:3]], [0]),  # ends inside the first window (18 tokens): that window completes
        (3, 20, [B[:3], B[3:]], [0]),  # 18, then inside the short second window (15): 33
        (3, 34, [B[:3], B[3:], B[:3]], [0, 1]),  # 33 in epoch 0, then the first window of epoch 1: 51
        (2, 40, [B[:2], B[2:4], B[4:], B[:2]], [0, 1]),  # 12 + 12 + 9, then 12 more: 45
        ({0: 3, 1: 2}, 50, [B[:3], B[3:], B[:2], B[2:4]], [0, 1]),  # by epoch (a dict): 18 + 15, then 12 + 12: 57
    ],
)
def test_the_token_budget_ends_at_the_window_that_reaches_it(accumulation, max_tokens, windows, epochs):
    model, seen = _model(accumulation), TokensSeen()
    history = model.fit(X, Y, batch_size=2, max_tokens=max_tokens, shuffle=False, verbose=0, callbacks=[seen])
    assert model.global_step == history.params["total_steps"] == len(windows)
    assert history.epoch == epochs
    assert seen.value == _tokens(windows) >= max_tokens  # the tokens TokensSeen counted in the same run
    torch.testing.assert_close(model.module.linear.weight.detach(), _hand(windows), rtol=0, atol=1e-6)


def test_shuffled_rows_keep_the_tokens_of_each_batch():
    model = _model(3)
    history = model.fit(X, Y, batch_size=2, epochs=None, max_tokens=34, verbose=0)  # shuffled: as unshuffled
    assert model.global_step == 3 and history.epoch == [0, 1]


def test_the_token_budget_plans_the_schedulers_steps_and_the_smaller_budget_wins():
    seen = {}

    def linear(opt, num_training_steps):  # the Transformers name of the planned steps
        seen["num_training_steps"] = num_training_steps
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / num_training_steps)

    model = _model(3, scheduler=linear)
    history = model.fit(X, Y, batch_size=2, max_tokens=34, shuffle=False, verbose=0)
    windows = [B[:3], B[3:], B[:3]]  # 18 + 15 + 18 = 51 >= 34: 3 steps, the LR 1, 2/3, 1/3 of LR
    assert seen["num_training_steps"] == history.params["total_steps"] == 3
    expected = _hand(windows, lr_at=lambda step: LR * (1 - step / 3))
    torch.testing.assert_close(model.module.linear.weight.detach(), expected, rtol=0, atol=1e-6)
    model = _model()
    model.fit(X, Y, batch_size=2, max_tokens=1000, max_steps=2, verbose=0)
    assert model.global_step == 2


def test_padding_and_ignored_labels_count_as_tokensseen_counts_them():
    """The budget counts ``B * T`` of ``input_ids`` (TokensSeen's default), not the attention
    mask's ones nor the labels that are not -100: 16 tokens are 2 batches of 2 x 4, not 4."""
    ids = torch.arange(32).remainder(5).reshape(8, 4)
    mask = torch.tensor([1, 1, 0, 0]).repeat(8, 1)  # 2 real tokens a row
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))

    class PerPosition(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 5)

        def forward(self, input_ids, attention_mask):
            return self.embed(input_ids)  # (B, T, V)

    model = fitkit.Model(PerPosition(), device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy")
    every, real = TokensSeen(), TokensSeen(non_padding=True)
    x = {"input_ids": ids, "attention_mask": mask}
    model.fit(x, labels, batch_size=2, max_tokens=16, shuffle=False, verbose=0, callbacks=[every, real])
    assert model.global_step == 2
    assert (every.value, real.value) == (16, 8)


def test_a_resumed_fit_stops_where_the_uninterrupted_one_does(tmp_path):
    class Stop(Exception):
        pass

    def run(crash: bool) -> tuple[fitkit.Model, list[int]]:
        model, batches = _model(3), []

        def on_batch_begin(batch, logs):
            if crash and model.global_step == 3:  # after the backup of step 3, mid-epoch 1
                raise Stop
            batches.append(batch)

        backup = BackupAndRestore(tmp_path / "backup", save_freq=3)  # at every window's end
        fit_args = {"batch_size": 2, "max_tokens": 70, "shuffle": False, "verbose": 0}
        model.fit(X, Y, **fit_args, callbacks=[backup, LambdaCallback(on_train_batch_begin=on_batch_begin)])
        return model, batches

    with pytest.raises(Stop):
        run(crash=True)
    resumed, batches = run(crash=False)
    # 70 tokens: epochs 0 and 1 (66, 2 steps each), then the first window of epoch 2 (18 more): 5 steps.
    # The resumed process trains batches 3-5 of epoch 1 and 0-2 of epoch 2.
    assert batches == [3, 4, 5, 0, 1, 2]
    windows = [B[:3], B[3:]] * 2 + [B[:3]]
    assert resumed.global_step == resumed.history.params["total_steps"] == 5
    assert resumed.history.epoch == [0, 1, 2]
    torch.testing.assert_close(resumed.module.linear.weight.detach(), _hand(windows), rtol=0, atol=1e-6)


def _loader_of(x, y):
    return DataLoader(TensorDataset(x, y), batch_size=2)


@pytest.mark.parametrize(
    "data, kwargs, error, match",
    [
        ((X, Y), {"max_tokens": 0}, ValueError, r"Expected `max_tokens` >= 1\. Received: max_tokens=0\. Fix: "),
        ((X, Y), {"max_tokens": 1.5}, TypeError, r"Expected `max_tokens` to be an int\. Received: max_tokens=1\.5"),
        ((X, Y), {"max_tokens": True}, TypeError, r"Expected `max_tokens` to be an int\. Received: max_tokens=True"),
        (
            (X, Y),
            {"max_tokens": 30, "max_samples": 10},
            ValueError,
            r"Expected at most one of `max_tokens` and `max_samples`\. Received: max_tokens=30, max_samples=10\. "
            r"Fix: pass only `max_tokens` or only `max_samples`\.",
        ),
        (
            (_loader_of(X, Y), None),
            {"max_tokens": 30},
            ValueError,
            r"fit\(max_tokens=30\) needs the tokens of every training batch before the fit.*"
            r"Received: x of kind DataLoader\. Fix: pass max_steps=",
        ),
        (
            (iter([(X[:2], Y[:2])]), None),
            {"max_tokens": 30},
            ValueError,
            r"fit\(max_tokens=30\) needs the tokens of every training batch",
        ),
        (
            (X, Y),
            {"max_tokens": 30, "steps_per_epoch": 2},
            ValueError,
            r"fit\(max_tokens=30\) needs the tokens.*Received: x of kind in-memory tensors, steps_per_epoch=2\. Fix: ",
        ),
        (
            (X.float(), Y),
            {"max_tokens": 30},
            ValueError,
            r"Expected token inputs for `max_tokens`: an integer \(B, T\) tensor.*"
            r"Received: inputs \(11, 3\) torch\.float32\. Fix: pass the token ids",
        ),
        (
            ({"input_ids": X[:, :0], "values": X}, Y),
            {"max_tokens": 30},
            ValueError,
            r"Expected sequences of length T >= 1 for `max_tokens`\. Received: max_tokens=30.*Fix: ",
        ),
    ],
)
def test_bad_token_budgets_are_refused_before_step_1(data, kwargs, error, match):
    model = _model()
    x, y = data
    with pytest.raises(error, match=match):
        model.fit(x, y, batch_size=None if y is None else 2, verbose=0, **kwargs)
    assert model.global_step == 0
    assert torch.count_nonzero(model.module.linear.weight) == 0
    assert not model.optimizer.state
