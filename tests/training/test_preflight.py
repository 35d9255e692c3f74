"""Batches the run did not plan for: a one-row batch under BatchNorm, a resume with another batch size;
and the checks before step 1 leave no trace."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from conftest import NoisyNet
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import BackupAndRestore, LambdaCallback


def _bn_model() -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    return model


def _fit_recording(model: fitkit.Model, *args, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(*args, verbose=0, **kwargs)
    return [str(w.message) for w in caught]


# -- a one-row training batch under BatchNorm --------------------------------------------------------
@pytest.mark.parametrize("shuffle", [False, True])
def test_in_memory_one_row_tail_is_dropped_with_one_warning_per_fit(shuffle):
    x, y = torch.randn(65, 3), torch.randn(65, 1)
    model = _bn_model()
    w0 = model.module[0].weight.detach().clone()
    messages = _fit_recording(model, x, y, batch_size=64, epochs=3, shuffle=shuffle)
    assert messages == [
        "65 training samples with batch_size=64 leave a last batch of one row, which BatchNorm cannot train on; "
        "that row is left out of each epoch. Fix: choose a batch_size that does not leave one sample over."
    ]
    assert model.global_step == 3  # one batch of 64 per epoch; no crash in epoch 1
    assert not torch.equal(model.module[0].weight, w0)
    assert model.history.params["steps"] == 1


def test_in_memory_one_row_tail_is_kept_without_batchnorm_or_with_frozen_batchnorm():
    x, y = torch.randn(65, 3), torch.randn(65, 1)
    model = _bn_model()
    model.module[1].eval()  # frozen statistics: one row is fine
    messages = _fit_recording(model, x, y, batch_size=64, epochs=1)
    assert model.global_step == 2 and not any("one row" in m for m in messages)


def test_validation_with_a_one_row_tail_is_not_touched():
    x, y = torch.randn(64, 3), torch.randn(64, 1)
    model = _bn_model()
    messages = _fit_recording(model, x, y, batch_size=32, epochs=1, validation_data=(x[:33], y[:33]))
    assert model.global_step == 2 and messages == []  # validation runs in eval mode


@pytest.mark.parametrize("source", ["dataloader", "list"])
def test_an_iterable_one_row_batch_is_skipped_with_one_warning(source):
    x, y = torch.randn(65, 3), torch.randn(65, 1)
    batches = [(x[:64], y[:64]), (x[64:], y[64:])]
    data = DataLoader(TensorDataset(x, y), batch_size=64) if source == "dataloader" else batches
    model = _bn_model()
    w0 = model.module[0].weight.detach().clone()
    messages = _fit_recording(model, data, epochs=3)
    assert messages == [
        "Batch 1 of epoch 1 has one row, which BatchNorm cannot train on; it is skipped, as is every later "
        "one-row training batch of this fit. Fix: use `drop_last=True` in the DataLoader, or a batch size that "
        "leaves no single row."
    ]
    assert model.global_step == 3 and not torch.equal(model.module[0].weight, w0)


@pytest.mark.parametrize("n, batch_size", [(5, 1), (1, 4)])
def test_in_memory_batches_of_one_row_each_are_an_error_before_step_1(n, batch_size):
    model = _bn_model()
    before = [t.clone() for t in model.module.state_dict().values()]
    with pytest.raises(
        ValueError,
        match=rf"every training batch here has one row \({n} samples, "
        rf"batch_size={batch_size}\)\. Fix: use batch_size >= 2",
    ):
        model.fit(torch.randn(n, 3), torch.randn(n, 1), batch_size=batch_size, epochs=2, verbose=0)
    assert model.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.state_dict().values(), strict=True))


def test_an_iterable_of_one_row_batches_is_an_error_not_an_empty_epoch():
    model = _bn_model()
    data = DataLoader(TensorDataset(torch.randn(3, 3), torch.randn(3, 1)), batch_size=1)
    before = [t.clone() for t in model.module.state_dict().values()]
    with pytest.warns(UserWarning, match="Batch 0 of epoch 1 has one row"):
        with pytest.raises(ValueError, match=r"Every training batch of epoch 1 \(3\) had one row.*Fix: use batches"):
            model.fit(data, epochs=2, verbose=0)
    assert model.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.state_dict().values(), strict=True))


# -- resuming a mid-epoch backup with another batch size -------------------------------------------
class _Recorder(nn.Module):
    """``Linear(1, 1)`` that records the row ids (its input) of every training forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def forward(self, x):
        if self.training:
            self.seen.append(x[:, 0].long().tolist())
        return self.lin(x)


class _Crash(Exception):
    pass


def _crash_before(batch_index: int) -> LambdaCallback:
    # At the start of batch 3 the backup of batch 2 is written: the crash comes "at the end of batch 2".
    def crash(batch, logs):
        if batch == batch_index:
            raise _Crash

    return LambdaCallback(on_train_batch_begin=crash)


def _recorder_model() -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(_Recorder(), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    return model


ROWS = torch.arange(40.0).unsqueeze(1)  # each row's input is its index
TARGETS = torch.zeros(40, 1)


def _crashed_run(folder, data=None, seed=None, **kwargs) -> list[list[int]]:
    model = _recorder_model()
    if seed is not None:
        torch.manual_seed(seed)
    with pytest.raises(_Crash):
        args = (ROWS, TARGETS) if data is None else (data,)
        model.fit(
            *args, epochs=2, verbose=0, callbacks=[BackupAndRestore(folder, save_freq=1), _crash_before(3)], **kwargs
        )
    state = torch.load(folder / "backup.pt", weights_only=True)
    assert (state["epoch"], state["step_in_epoch"], state["samples_in_epoch"], state["batch_size"]) == (0, 3, 12, 4)
    return model.module.seen


def test_in_memory_resume_with_another_batch_size_starts_at_the_first_untrained_row(tmp_path):
    first = _crashed_run(tmp_path, batch_size=4, shuffle=False)
    assert first == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    model = _recorder_model()
    batch_ids = []
    cb = LambdaCallback(on_train_batch_begin=lambda batch, logs: batch_ids.append((model.epoch, batch)))
    callbacks = [BackupAndRestore(tmp_path, save_freq=1), cb]
    model.fit(ROWS, TARGETS, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    epoch0 = [list(range(i, min(i + 8, 40))) for i in range(12, 40, 8)]  # rows 12-39, in batches of 8
    assert model.module.seen == epoch0 + [list(range(i, i + 8)) for i in range(0, 40, 8)]
    assert sorted(r for b in first + epoch0 for r in b) == list(range(40))  # each row once in epoch 0
    assert model.global_step == 3 + 4 + 5
    # Batches counted in this fit's size: 12 rows done are 1 batch of 8, so the rest are 1..4 of 5.
    assert batch_ids == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4)]
    assert not tmp_path.joinpath("backup.pt").exists()


def test_in_memory_resume_with_another_batch_size_replays_the_shuffled_order(tmp_path):
    reference = _recorder_model()
    torch.manual_seed(5)
    reference.fit(ROWS, TARGETS, batch_size=4, epochs=1, shuffle=True, verbose=0)
    order = [r for b in reference.module.seen for r in b]  # epoch 0's permutation
    assert sorted(order) == list(range(40)) and order != list(range(40))
    first = _crashed_run(tmp_path, seed=5, batch_size=4, shuffle=True)
    assert first == [order[0:4], order[4:8], order[8:12]]
    model = _recorder_model()
    torch.manual_seed(99)  # the backup's RNG states replace this one
    model.fit(
        ROWS,
        TARGETS,
        batch_size=8,
        epochs=1,
        shuffle=True,
        verbose=0,
        callbacks=[BackupAndRestore(tmp_path, save_freq=1)],
    )
    assert model.module.seen == [order[12:20], order[20:28], order[28:36], order[36:40]]


def test_a_dataloader_resumed_with_another_batch_size_continues_by_sample(tmp_path):
    def loader(batch_size):
        return DataLoader(TensorDataset(ROWS, TARGETS), batch_size=batch_size)

    _crashed_run(tmp_path, data=loader(4))  # 12 samples of epoch 0 done, in batches of 4
    model = _recorder_model()
    model.fit(loader(8), epochs=1, verbose=0, callbacks=[BackupAndRestore(tmp_path, save_freq=1)])
    # the other 28 samples, each once, in batches of 8 (fitkit replaced the loader's sampler)
    assert model.module.seen == [list(range(i, min(i + 8, 40))) for i in range(12, 40, 8)]
    assert model.global_step == 3 + 4


# -- a dict batch whose keys do not fit forward ---------------------------------------------------
class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 3)

    def forward(self, input_ids, attention_mask=None):
        return self.emb(input_ids).mean(1)


def _rows(**extra):
    row = {"input_ids": torch.tensor([1, 2, 3]), "attention_mask": torch.tensor([1, 1, 1]), **extra}
    return [dict(row) for _ in range(4)]


def test_dict_batch_with_keys_forward_does_not_take_lists_keys_and_parameters():
    model = fitkit.Model(TokenNet(), device="cpu")
    model.compile("sgd", None)  # no compiled loss: `labels` go to forward, which does not take them
    before = model.module.emb.weight.clone()
    with pytest.raises(ValueError) as info:
        model.fit(DataLoader(_rows(labels=torch.tensor(1)), batch_size=2), verbose=0)
    msg = str(info.value)
    assert msg.startswith("The first training batch failed in the module's forward: TypeError:")
    assert (
        "Fix: a dict batch is passed as `forward(**batch)`, so its keys must be forward's parameters. "
        "Batch keys: ['input_ids', 'attention_mask', 'labels']; forward's parameters: "
        "(input_ids, attention_mask=None); not taken by forward: ['labels']."
    ) in msg
    assert "needs a compiled loss (`compile(loss=...)`): the batch's `labels` are then its targets" in msg
    assert torch.equal(model.module.emb.weight, before) and model.global_step == 0
    # The fix works: with a compiled loss, `labels` are its targets and forward never sees them.
    model.compile("sgd", "cross_entropy")
    model.fit(DataLoader(_rows(labels=torch.tensor(1)), batch_size=2), verbose=0)
    assert model.global_step == 2


def test_dict_batch_missing_a_required_parameter_is_named():
    model = fitkit.Model(TokenNet(), device="cpu")
    model.compile("sgd", "cross_entropy")
    rows = [({"ids": torch.tensor([1, 2])}, torch.tensor(0)) for _ in range(2)]
    with pytest.raises(ValueError) as info:
        model.fit(DataLoader(rows, batch_size=2), verbose=0)
    msg = str(info.value)
    assert (
        "Batch keys: ['ids']; forward's parameters: (input_ids, attention_mask=None); not taken by forward: "
        "['ids']; required by forward but not in the batch: ['input_ids']." in msg
    )
    assert "pop('labels')" not in msg


class KwargsTokenNet(TokenNet):
    """A forward that takes ``**kwargs``, as most Transformers models' do; it records what it got."""

    def forward(self, input_ids, attention_mask=None, **kwargs):
        self.seen = sorted(kwargs)
        return self.emb(input_ids).mean(1)


@pytest.mark.parametrize(
    "net, extra, refused",
    [
        (TokenNet, {"text_len": torch.tensor(3)}, ["text_len"]),  # named parameters only: refused, named
        (TokenNet, {"text_len": torch.tensor(3), "labels": torch.tensor(1)}, ["text_len", "labels"]),
        (KwargsTokenNet, {"text_len": torch.tensor(3)}, []),  # **kwargs: passed on, as forward asked
        (KwargsTokenNet, {"text_len": torch.tensor(3), "labels": torch.tensor(1)}, []),
    ],
)
def test_a_key_forward_does_not_name_is_refused_unless_forward_takes_kwargs(net, extra, refused):
    # The rule the Hugging Face tutorial states, for both kinds of forward; no compiled loss, so
    # `labels` stays in the batch and goes to forward too.
    torch.manual_seed(0)
    model = fitkit.Model(net(), device="cpu")
    model.compile("sgd", None if "labels" in extra else "mse")
    rows = _rows(**extra) if "labels" in extra else [(r, torch.zeros(3)) for r in _rows(**extra)]
    loader = DataLoader(rows, batch_size=2)
    if refused:
        before = model.module.emb.weight.clone()
        with pytest.raises(ValueError, match=re.escape(f"; not taken by forward: {refused}")) as info:
            model.fit(loader, verbose=0)
        assert torch.equal(model.module.emb.weight, before) and model.global_step == 0
        msg = str(info.value)
        assert "Drop or rename the keys forward does not take" in msg
        assert ("(keep `labels`)" in msg) == ("labels" in refused)
        return
    if "labels" in extra:  # forward took every key and returned logits, no loss: the fit stops there
        with pytest.raises(RuntimeError, match="No loss to compute: none was compiled"):
            model.fit(loader, verbose=0)
    else:
        model.fit(loader, verbose=0)
        assert model.global_step == 2
    assert model.module.seen == sorted(k for k in extra)  # every extra key reached forward's **kwargs


def test_the_keys_error_never_tells_to_drop_labels():
    # `labels` alone is the extra key: the fix is a compiled loss, no "drop or rename" at all.
    model = fitkit.Model(TokenNet(), device="cpu")
    model.compile("sgd", None)
    keep = "not taken by forward: ['labels']. Keep `labels`, the loss's target: a module without"
    with pytest.raises(ValueError, match=re.escape(keep)) as info:
        model.fit(DataLoader(_rows(labels=torch.tensor(1)), batch_size=2), verbose=0)
    assert "Drop or rename" not in str(info.value) and "drop `labels`" not in str(info.value).lower()


# -- the checks leave no trace ----------------------------------------------------------------------
# 18 rows in batches of 4: the short last batch runs a shuffling sampler to its end, as a plain
# loop does, so the sampler's own generator draws the same in both.
NOISY_X = torch.linspace(-1, 1, 18).unsqueeze(1)
NOISY_Y = -0.5 * NOISY_X


def _noisy_model() -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(NoisyNet(), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
    return model


def _by_hand(batches, epochs: int) -> NoisyNet:
    """The plain loop the fit must equal: seed, build, then forward / backward / step per batch."""
    torch.manual_seed(0)
    net = NoisyNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(epochs):
        for x, y in batches:
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    return net


def _noisy_loader(**kwargs) -> DataLoader:
    return DataLoader(TensorDataset(NOISY_X, NOISY_Y), batch_size=4, **kwargs)


@pytest.mark.parametrize("source", ["arrays", "dataloader", "shuffled-dataloader", "dataloader-own-generator"])
def test_a_fit_with_the_first_batch_check_equals_the_plain_loop_bit_for_bit(source):
    # The check runs the module once more (eval mode: the noise, not dropout or BatchNorm); it
    # puts the RNGs and buffers back, so every training step draws what the plain loop draws.
    if source == "arrays":
        data, kwargs = (NOISY_X, NOISY_Y), {"batch_size": 4, "shuffle": False}
        batches = [(NOISY_X[i : i + 4], NOISY_Y[i : i + 4]) for i in range(0, 18, 4)]
    else:
        gen = torch.Generator().manual_seed(3) if source == "dataloader-own-generator" else None
        loader = _noisy_loader(shuffle=source != "dataloader", generator=gen)
        data, kwargs, batches = (loader,), {}, loader
    model = _noisy_model()
    model.fit(*data, epochs=3, verbose=0, **kwargs)
    after_fit = torch.get_rng_state()
    if source == "dataloader-own-generator":
        gen.manual_seed(3)  # the plain loop draws the same orders from the loader's generator
    net = _by_hand(batches, epochs=3)
    for name, value in net.state_dict().items():
        assert torch.equal(model.module.state_dict()[name], value), name
    assert int(model.module.rows_seen) == 54  # 3 epochs of 18 rows: the check's 4 rows are not counted
    assert int(model.module.bn.num_batches_tracked) == 15
    assert torch.equal(after_fit, torch.get_rng_state())  # the fit drew what the plain loop drew, no more


def test_the_validation_check_leaves_the_loaders_own_generator_and_the_buffers_untouched():
    # The first validation batch is drawn and run before step 1: the validation DataLoader's own
    # generator (its sampler's order and the iterator's base seed) must not move for it.
    gen = torch.Generator().manual_seed(7)
    val = _noisy_loader(shuffle=True, generator=gen)
    model = _noisy_model()
    history = model.fit(_noisy_loader(), epochs=2, validation_data=val, verbose=0)
    expected = torch.Generator().manual_seed(7)
    for _ in range(2):  # two validations, one pass each
        list(_noisy_loader(shuffle=True, generator=expected))
    assert torch.equal(gen.get_state(), expected.get_state())
    assert int(model.module.rows_seen) == 2 * 18 + 2 * 18  # training and validation rows, no check's
    assert len(history.history["val_loss"]) == 2


def test_a_lazy_modules_buffers_are_initialized_by_the_check_as_by_a_first_step():
    # LazyBatchNorm1d's buffers have no values before the first forward: the check's forward
    # initializes them (nothing to put back), and training then moves them as usual.
    torch.manual_seed(0)
    model = fitkit.Model(nn.Sequential(nn.Linear(3, 4), nn.LazyBatchNorm1d(), nn.Linear(4, 1)), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    model.fit(torch.randn(12, 3), torch.randn(12, 1), batch_size=4, epochs=2, verbose=0)
    bn = model.module[1]
    assert bn.running_mean.shape == (4,) and int(bn.num_batches_tracked) == 6


def test_the_first_batch_check_runs_once_for_the_same_data_and_model():
    """fit in chunks on the same tensors: the check's forward runs in the first call only; new or
    written tensors, a new compile or other data run it again, and bad data is still refused."""

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 1)
            self.forwards = 0

        def forward(self, x):
            self.forwards += 1
            return self.linear(x)

    net = Counting()
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    x, y = torch.randn(8, 2), torch.randn(8, 1)

    def forwards(*args, **kwargs) -> int:
        before = net.forwards
        model.fit(*args, batch_size=4, verbose=0, **kwargs)
        return net.forwards - before

    assert forwards(x, y) == 3  # the check, then 2 steps
    assert forwards(x, y) == 2  # the same tensors and model: no check forward
    y[0, 0] = 0.5  # an in-place write: checked again
    assert forwards(x, y) == 3
    assert forwards(x.clone(), y) == 3  # another tensor
    model.compile(optimizer="sgd", loss="mae")
    assert forwards(x, y) == 3  # a new compile
    with pytest.raises(ValueError, match="shaped like the prediction"):
        model.fit(x, torch.randn(8, 3), batch_size=4, verbose=0)
    before = net.forwards
    model.evaluate(x, y, batch_size=8, verbose=0)
    model.evaluate(x, y, batch_size=8, verbose=0)
    assert net.forwards - before == 3  # evaluate has a check of its own, once: 1 + 1 batch, then 1 batch


class Shouting(nn.Module):
    """A forward that fails with a message ending in a period, as many libraries' do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, x):
        raise RuntimeError("The input is not what this layer takes.")


def test_a_wrapped_error_that_ends_with_a_period_gets_no_second_one():
    model = fitkit.Model(Shouting(), device="cpu")
    model.compile("sgd", "mse")
    wrapped = "RuntimeError: The input is not what this layer takes. It was fed "
    with pytest.raises(ValueError, match=re.escape(wrapped)) as info:
        model.fit(torch.zeros(4, 2), torch.zeros(4, 1), verbose=0)
    assert ".." not in str(info.value).replace("...", "")
