"""Hugging Face ``datasets.Dataset`` objects straight into fit / evaluate / predict (the ``hf`` extra)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

pytest.importorskip("datasets")
pytest.importorskip("transformers")

import _hf_scenarios as sc  # noqa: E402
from _torchrun import run_torchrun  # noqa: E402

from fitkit.callbacks import BackupAndRestore, LambdaCallback  # noqa: E402


class TorchRows(Dataset):
    """The same rows as a plain torch Dataset: what a datasets.Dataset must behave like."""

    def __init__(self, ds):
        self.rows = [ds[i] for i in range(len(ds))]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


@pytest.mark.slow
def test_a_torch_formatted_dataset_trains_as_the_same_rows_in_a_torch_dataset():
    ds = sc.dataset()
    runs = []
    for source in (ds, TorchRows(ds)):
        model = sc.model()
        torch.manual_seed(1)  # the shuffle draws from here
        history = model.fit(source, batch_size=4, epochs=2, shuffle=True, validation_data=source, verbose=0)
        runs.append((sc.params(model), history.history, model.predict(source, batch_size=5, verbose=0)))
    (p_hf, h_hf, pred_hf), (p_t, h_t, pred_t) = runs
    assert all(torch.equal(p_hf[k], p_t[k]) for k in p_t)
    assert h_hf == h_t and len(h_hf["loss"]) == 2 and set(h_hf) >= {"val_loss", "val_accuracy"}
    assert torch.equal(pred_hf, pred_t) and pred_hf.shape == (16, 2)


def test_evaluate_on_a_dataset_is_the_hand_computed_loss_and_accuracy():
    ds, model = sc.dataset(), sc.model()
    batch = {k: ds[:][k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = model.module(**batch)["logits"]
    labels = torch.tensor(sc.LABELS)
    logs = model.evaluate(ds, batch_size=16, verbose=0)
    assert logs["loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-6)
    assert logs["accuracy"] == pytest.approx((logits.argmax(1) == labels).float().mean().item())


def test_a_dataset_without_the_torch_format_names_with_format():
    ds = sc.dataset().with_format(None)
    model = sc.model()
    with pytest.raises(ValueError) as info:
        model.fit(ds, verbose=0)
    msg = str(info.value)
    assert "`x` is a datasets.Dataset whose rows are Python objects (format type None), not tensors" in msg
    assert "Received columns: ['labels', 'input_ids', 'attention_mask']" in msg
    assert "Fix: pass `x.with_format('torch')`" in msg


def test_rows_of_different_lengths_ask_for_a_collator_before_any_step():
    model = sc.model()
    before = sc.params(model)
    with pytest.raises(ValueError) as info:
        model.fit(sc.dataset(None), batch_size=4, shuffle=False, verbose=0)
    msg = str(info.value)
    # The first 4 texts have 2, 2, 4 and 4 words.
    assert (
        "Rows of different lengths cannot be stacked into a batch: 'input_ids' has lengths [2, 4]; "
        "'attention_mask' has lengths [2, 4]. fitkit does not pad" in msg
    )
    assert "collate_fn=transformers.DataCollatorWithPadding(tokenizer)" in msg
    assert model.global_step == 0 and all(torch.equal(before[k], v) for k, v in sc.params(model).items())


def test_a_padding_collator_trains_evaluates_and_predicts_what_the_module_computes():
    model = sc.model()
    history = model.fit(sc.collated_loader(4, shuffle=True), epochs=2, verbose=0, validation_data=sc.collated_loader(4))
    assert len(history.history["val_loss"]) == 2 and model.global_step == 8
    with torch.no_grad():
        expected = torch.cat(
            [model.module(**{k: v for k, v in b.items() if k != "labels"})["logits"] for b in sc.collated_loader(4)]
        )
    pred = model.predict(sc.collated_loader(4), verbose=0)
    torch.testing.assert_close(pred, expected, rtol=0, atol=0)
    # A padded row gives the logits of the row alone (the mask leaves the padding out).
    alone = sc.dataset(None)[2]  # "very good fun movie", 4 tokens
    with torch.no_grad():
        one = model.module(alone["input_ids"][None], alone["attention_mask"][None])["logits"]
    torch.testing.assert_close(pred[2:3], one, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_language_modeling_collator_pads_labels_with_minus_100_and_trains():
    transformers = pytest.importorskip("transformers")
    tok = sc.tokenizer()
    collator = transformers.DataCollatorForLanguageModeling(tok, mlm=False)
    ds = sc.dataset(None).remove_columns("labels")
    batch = collator([ds[0], ds[2]])
    assert batch["labels"].tolist() == [[3, 5, -100, -100], [7, 3, 11, 5]]  # pads -> -100
    config = transformers.GPT2Config(vocab_size=len(sc.WORDS), n_positions=8, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    import fitkit

    model = fitkit.Model(transformers.GPT2LMHeadModel(config), device="cpu")
    model.compile("adamw", loss=None)
    loader = DataLoader(ds, batch_size=16, collate_fn=collator)
    with torch.no_grad():
        full = next(iter(loader))
        model.module.eval()
        hand = model.module(**full).loss.item()
    model.module.train()
    assert model.evaluate(loader, verbose=0)["loss"] == pytest.approx(hand, rel=1e-6)
    history = model.fit(DataLoader(ds, batch_size=4, shuffle=True, collate_fn=collator), epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]


class _Crash(Exception):
    pass


def _backup_run(folder, crash_step=None, save_freq=1, **fit_kwargs):
    model = sc.model()
    torch.manual_seed(1)

    def crash(batch, logs):
        if model.global_step == crash_step:
            raise _Crash

    callbacks = [LambdaCallback(on_train_batch_end=crash), BackupAndRestore(folder, save_freq=save_freq)]
    model.fit(
        sc.dataset(),
        batch_size=4,
        epochs=3,
        shuffle=True,
        validation_data=sc.dataset(),
        verbose=0,
        callbacks=callbacks,
        **fit_kwargs,
    )
    return model


@pytest.mark.slow
def test_backup_and_restore_resumes_a_shuffled_dataset_mid_epoch_exactly(tmp_path):
    ref = _backup_run(tmp_path / "ref")
    with pytest.raises(_Crash):
        _backup_run(tmp_path / "run", crash_step=6)  # epoch 1, after its second of 4 batches
    backup = torch.load(tmp_path / "run" / "backup.pt", weights_only=True)
    assert (backup["epoch"], backup["step_in_epoch"]) == (1, 1)  # the crash comes before that batch's backup
    resumed = _backup_run(tmp_path / "run")
    assert all(torch.equal(sc.params(ref)[k], v) for k, v in sc.params(resumed).items())
    assert resumed.history.history == ref.history.history


@pytest.mark.slow
@pytest.mark.parametrize("save_freq, step_in_epoch", [("epoch", 0), (1, 1)])
def test_backup_and_restore_continues_the_shuffled_pass_of_steps_per_epoch(tmp_path, save_freq, step_in_epoch):
    """16 rows in batches of 4, 2 per epoch: epoch 2 trains the second half of the pass epoch 1
    drew. A backup at its start, or after its first batch, resumes that pass exactly."""
    ref = _backup_run(tmp_path / "ref", save_freq=save_freq, steps_per_epoch=2)
    with pytest.raises(_Crash):
        _backup_run(tmp_path / "run", crash_step=4, save_freq=save_freq, steps_per_epoch=2)
    backup = torch.load(tmp_path / "run" / "backup.pt", weights_only=True)
    assert (backup["epoch"], backup["step_in_epoch"], backup["pass_offset"]) == (1, step_in_epoch, 2)
    resumed = _backup_run(tmp_path / "run", save_freq=save_freq, steps_per_epoch=2)
    assert all(torch.equal(sc.params(ref)[k], v) for k, v in sc.params(resumed).items())
    assert resumed.history.history == ref.history.history


JOB = """
import torch
import _hf_scenarios as sc
from fitkit import distributed
res = sc.distributed_checks(batch_size=4)  # 2 ranks x 4 = one process's batch of 8
res["world_size"] = distributed.world_size()
torch.save(res, OUT / f"rank{distributed.rank()}.pt")
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_a_dataset_and_a_collator_loader_shard_over_two_ranks_as_one_process(tmp_path):
    run_torchrun(JOB, tmp_path, nproc=2, timeout=150)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    ref = sc.distributed_checks(batch_size=8)
    assert r0["world_size"] == 2
    for r in (r0, r1):
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=0, atol=1e-6)
        for key, values in ref["history"].items():
            assert r["history"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), key
        assert r["evaluate"] == pytest.approx(ref["evaluate"], rel=1e-6)
        torch.testing.assert_close(r["predict"], ref["predict"], rtol=1e-6, atol=1e-6)  # every row once, in order
    assert all(torch.equal(r0["shuffled_params"][k], r1["shuffled_params"][k]) for k in r0["shuffled_params"])
