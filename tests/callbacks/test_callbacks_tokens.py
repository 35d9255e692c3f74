"""TokensSeen: the count of input tokens trained on, exact by hand, in History and checkpoints
(a run resumed from a backup ends with the count of the uninterrupted run)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitkit
from fitkit.callbacks import BackupAndRestore, CSVLogger, LambdaCallback, TokensSeen


class Bag(nn.Module):
    """(B, T) ids, or a dict with input_ids / attention_mask -> (B, 1)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, input_ids, attention_mask=None):
        e = self.embed(input_ids)
        if attention_mask is not None:
            e = e * attention_mask[..., None]
        return self.head(e.mean(1))


def _model(accumulation: int = 1) -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(Bag(), device="cpu")
    model.compile(optimizer="sgd", loss="mse", gradient_accumulation_steps=accumulation)
    return model


def _ids(n: int = 10, length: int = 6):
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 20, (n, length), generator=g), torch.randn(n, 1, generator=g)


def test_every_training_batch_counts_micro_batches_included(tmp_path):
    x, y = _ids()
    model = _model(accumulation=2)  # 10 rows, batch 4: 3 micro-batches, 2 optimizer steps per epoch
    history = model.fit(
        x,
        y,
        batch_size=4,
        epochs=3,
        verbose=0,
        validation_data=(x, y),
        callbacks=[TokensSeen(), CSVLogger(tmp_path / "log.csv")],
    )
    assert history.history["num_input_tokens_seen"] == [60, 120, 180]  # validation tokens do not count
    assert "num_input_tokens_seen" in (tmp_path / "log.csv").read_text().splitlines()[0]


def test_non_padding_counts_the_attention_mask_ones():
    x, y = _ids()
    mask = torch.ones_like(x)
    mask[:, 4:] = 0  # 4 real tokens a row
    mask[0, 1:] = 0  # row 0: 1 real token
    model = _model()
    counter = TokensSeen(non_padding=True)
    history = model.fit(
        {"input_ids": x, "attention_mask": mask}, y, batch_size=3, epochs=2, verbose=0, callbacks=[counter]
    )
    assert history.history["num_input_tokens_seen"] == [37, 74]  # 9 rows x 4 + 1
    assert isinstance(history.history["num_input_tokens_seen"][0], int)


def test_a_second_fit_goes_on_counting_and_the_state_round_trips():
    x, y = _ids()
    model, counter = _model(), TokensSeen()
    model.fit(x, y, batch_size=5, epochs=1, verbose=0, callbacks=[counter])
    history = model.fit(x, y, batch_size=5, epochs=1, verbose=0, callbacks=[counter])
    assert history.history["num_input_tokens_seen"] == [120]
    assert counter.state_dict() == {"num_input_tokens_seen": 120}
    other = TokensSeen()
    other.load_state_dict(counter.state_dict())
    assert other.value == 120


class _Crash(Exception):
    pass


def _run(folder, crash_at: int | None = None):
    x, y = _ids(12)
    model, counter = _model(), TokensSeen()

    def crash(batch, logs):
        if model.global_step == crash_at:
            raise _Crash

    model.fit(
        x,
        y,
        batch_size=2,
        epochs=3,
        verbose=0,
        callbacks=[LambdaCallback(on_train_batch_end=crash), counter, BackupAndRestore(folder, save_freq=2)],
    )
    return model, counter


def test_a_resumed_run_counts_as_the_uninterrupted_one(tmp_path):
    ref, ref_counter = _run(tmp_path / "ref")
    with pytest.raises(_Crash):
        _run(tmp_path / "run", crash_at=9)  # mid-epoch 1; the backup of step 8 is the resume point
    resumed, counter = _run(tmp_path / "run")
    assert ref_counter.value == counter.value == 3 * 12 * 6
    seen = resumed.history.history["num_input_tokens_seen"]
    assert seen == ref.history.history["num_input_tokens_seen"] == [72, 144, 216]


def test_batches_without_tokens_are_refused_at_the_first_batch():
    model = _model()
    with pytest.raises(ValueError, match=r"TokensSeen counts the tokens of an integer \(B, T\) input.*Fix:"):
        plain = fitkit.Model(nn.Linear(3, 1), device="cpu")
        plain.compile(optimizer="sgd", loss="mse")
        plain.fit(torch.zeros(4, 3), torch.zeros(4, 1), verbose=0, callbacks=[TokensSeen()])
    x, y = _ids()
    with pytest.raises(ValueError, match=r"attention_mask.*Fix:"):
        model.fit(x, y, verbose=0, callbacks=[TokensSeen(non_padding=True)])
    with pytest.raises(TypeError, match="non_padding"):
        TokensSeen(non_padding="yes")
