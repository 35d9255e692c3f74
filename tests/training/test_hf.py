"""Hugging Face transformers through fitkit's public API (the ``hf`` extra).

Models are built from configs (no download). A dict batch calls ``module(**x)``; with
``compile(loss=None)`` the output's own ``loss`` trains, metrics and ``predict`` take its
``logits`` (the rule of :mod:`fitkit.losses.outputs`), and metric targets come from ``y`` or
``x["labels"]``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fitkit
from fitkit.examples.shakespeare import default_text_path
from fitkit.text import CharTokenizer, NextTokenDataset

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()  # tiny configs: no notes about token ids or loss types

T = 12  # sequence length of the synthetic classification task


def _bert_config(num_labels: int = 2, dropout: float = 0.1) -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=T,
        num_labels=num_labels,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )


def _bert(num_labels: int = 2, dropout: float = 0.1) -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(_bert_config(num_labels, dropout))


def _token_task(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of ids in [1, 50); label 1 iff token 7 appears (half of them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (n, T), generator=g)
    ids[ids == 7] = 8
    has = torch.rand(n, generator=g) < 0.5
    pos = torch.randint(0, T, (n,), generator=g)
    ids[has, pos[has]] = 7
    return ids, has.long()


class DictItems(Dataset):
    """Hugging Face-style items: one dict of tensors per sample."""

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor):
        self.ids, self.labels = ids, labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(T, dtype=torch.long), "labels": self.labels[i]}


# -- GPT-2 on tiny Shakespeare ------------------------------------------------------------------
@pytest.mark.slow
def test_gpt2_trains_on_tiny_shakespeare_with_its_own_loss():
    text = default_text_path().read_text(encoding="utf-8")
    tokenizer = CharTokenizer(text)
    tokens = tokenizer.encode(text[:60_000])
    windows = NextTokenDataset(tokens, block_size=64)
    # Causal LM convention: labels are the inputs, the model shifts them inside.
    x = torch.stack([windows[i][0] for i in range(0, 48_000, 250)])  # (192, 64)
    x_val = torch.stack([windows[i][0] for i in range(50_000, 59_000, 250)])  # (36, 64), held out
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=tokenizer.vocab_size, n_positions=64)
    model = fitkit.Model(transformers.GPT2LMHeadModel(config), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3), loss=None)
    before = model.evaluate({"input_ids": x_val, "labels": x_val}, batch_size=12, verbose=0)["loss"]
    history = model.fit({"input_ids": x, "labels": x}, batch_size=12, epochs=2, verbose=0)
    after = model.evaluate({"input_ids": x_val, "labels": x_val}, batch_size=12, verbose=0)["loss"]

    assert before == pytest.approx(4.17, abs=0.3)  # ln 65: a uniform guess over 65 characters
    assert history.history["loss"][1] < history.history["loss"][0]
    assert after < before - 0.8

    logits = model.predict({"input_ids": x_val}, batch_size=12, verbose=0)
    assert logits.shape == (36, 64, 65) and logits.dtype == torch.float32
    # evaluate's loss is the model's own: next-token cross entropy over positions 1..63.
    by_hand = F.cross_entropy(logits[:, :-1].reshape(-1, 65), x_val[:, 1:].reshape(-1))
    assert after == pytest.approx(float(by_hand), abs=1e-5)
    with torch.no_grad():
        model.module.eval()
        assert torch.allclose(logits, model.module(input_ids=x_val).logits, atol=1e-5)


# -- BERT sequence classification ---------------------------------------------------------------
@pytest.mark.slow
def test_bert_trains_the_same_with_its_own_loss_and_with_cross_entropy():
    ids, labels = _token_task(512, seed=0)
    ids_test, labels_test = _token_task(256, seed=1)

    own = fitkit.Model(_bert(), device="cpu")
    own.compile(optimizer="adam", loss=None, metrics=["accuracy"])
    h_own = own.fit({"input_ids": ids, "labels": labels}, batch_size=32, epochs=5, verbose=0)
    ev_own = own.evaluate({"input_ids": ids_test, "labels": labels_test}, verbose=0)

    ce = fitkit.Model(_bert(), device="cpu")
    ce.compile(optimizer="adam", loss="cross_entropy", metrics=["accuracy"])
    h_ce = ce.fit({"input_ids": ids}, labels, batch_size=32, epochs=5, verbose=0)
    ev_ce = ce.evaluate({"input_ids": ids_test}, labels_test, verbose=0)

    # HF's sequence-classification loss is F.cross_entropy: the two paths are one computation.
    assert h_own.history == h_ce.history
    assert ev_own == ev_ce
    assert ev_own["accuracy"] > 0.9  # chance is 0.5

    logits = own.predict({"input_ids": ids_test}, verbose=0)  # the output's logits
    assert logits.shape == (256, 2)
    correct = int((logits.argmax(-1) == labels_test).sum())
    assert ev_own["accuracy"] == pytest.approx(correct / 256, abs=1e-7)
    assert ev_own["loss"] == pytest.approx(float(F.cross_entropy(logits, labels_test)), abs=1e-6)


def test_a_dataset_and_a_dataloader_of_dicts_train_as_in_memory_dicts():
    ids, labels = _token_task(64, seed=2)
    mask = torch.ones(64, T, dtype=torch.long)
    sources = {
        "in-memory": {"input_ids": ids, "attention_mask": mask, "labels": labels},
        "batch-encoding": transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": labels}),
        "dataset": DictItems(ids, labels),
        "dataloader": DataLoader(DictItems(ids, labels), batch_size=16),
    }
    results = {}
    for name, data in sources.items():
        # No dropout: a DataLoader draws a seed from torch's RNG, so dropout masks would differ.
        model = fitkit.Model(_bert(dropout=0.0), device="cpu")
        model.compile(optimizer="adam", loss=None, metrics=["accuracy"])
        history = model.fit(data, batch_size=16, epochs=2, shuffle=False, verbose=0)
        results[name] = (history.history, model.module.classifier.weight.detach().clone())
    reference, weights = results.pop("in-memory")
    assert len(reference["loss"]) == 2
    for name, (history, w) in results.items():
        assert history == reference, name
        assert torch.equal(w, weights), name


def test_validation_and_predict_take_dict_batches_from_a_dataloader():
    ids, labels = _token_task(64, seed=3)
    model = fitkit.Model(_bert(), device="cpu")
    model.compile(optimizer="adam", loss=None, metrics=["accuracy"])
    loader = DataLoader(DictItems(ids, labels), batch_size=16)
    history = model.fit(loader, validation_data=loader, epochs=1, verbose=0)
    assert history.history["val_loss"] == [pytest.approx(model.evaluate(loader, verbose=0)["loss"], abs=1e-6)]
    logits = model.predict(loader, verbose=0)  # `labels` in x are passed on; the logits come back
    assert logits.shape == (64, 2)
    assert torch.allclose(logits, model.predict({"input_ids": ids}, verbose=0), atol=1e-5)


def test_token_metrics_skip_the_minus_100_labels_of_a_model_with_its_own_loss():
    ids, _ = _token_task(32, seed=4)
    labels = (ids % 3).clone()
    labels[:, -4:] = -100  # e.g. padding: no loss, no metric
    torch.manual_seed(0)
    config = _bert_config(num_labels=3)
    model = fitkit.Model(transformers.BertForTokenClassification(config), device="cpu")
    model.compile(loss=None, metrics=["accuracy"])
    result = model.evaluate({"input_ids": ids, "labels": labels}, batch_size=32, verbose=0)
    logits = model.predict({"input_ids": ids}, batch_size=32, verbose=0)  # (32, T, 3)
    keep = labels != -100
    correct = (logits.argmax(-1) == labels)[keep]
    assert result["accuracy"] == pytest.approx(float(correct.float().mean()), abs=1e-7)
    assert result["loss"] == pytest.approx(float(F.cross_entropy(logits[keep], labels[keep])), abs=1e-6)


# -- errors, raised before the first step ---------------------------------------------------------
def test_labels_out_of_range_anywhere_in_memory_fail_before_any_step():
    ids, labels = _token_task(64, seed=5)
    labels[40] = 2  # not in the first batch: the model has 2 labels
    model = fitkit.Model(_bert(), device="cpu")
    model.compile(optimizer="adam", loss=None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError,
        match=r"Class labels must lie in \[0, 1\] .* Received labels from 0 to 2\. "
        r"Fix: .*`num_labels` of a Hugging Face config",
    ):
        model.fit({"input_ids": ids, "labels": labels}, batch_size=16, verbose=0)
    labels[0] = 5  # in the first batch: the model's own loss fails inside its forward
    with pytest.raises(ValueError, match=r"Received labels from 0 to 5"):
        model.fit({"input_ids": ids, "labels": labels}, batch_size=16, verbose=0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_no_labels_and_no_loss_is_an_error_that_names_the_fix():
    ids, _ = _token_task(16, seed=6)
    model = fitkit.Model(_bert(), device="cpu")
    model.compile(optimizer="adam", loss=None)
    with pytest.raises(RuntimeError, match=r"carries no 'loss' .*Fix: put the targets in the input dict as 'labels'"):
        model.fit({"input_ids": ids}, verbose=0)
    assert model.global_step == 0


def test_first_batch_errors_name_the_entries_of_a_dict_input():
    ids, labels = _token_task(16, seed=7)
    model = fitkit.Model(_bert(), device="cpu")
    model.compile(loss=None)
    with pytest.raises(ValueError, match=r"module's forward.*'input_ids' int64 \(16, 13\).*'labels' int64 \(16,\)"):
        model.fit({"input_ids": torch.cat([ids, ids[:, :1]], 1), "labels": labels}, batch_size=16, verbose=0)


# -- `labels` in a dict batch as the target of a compiled loss ------------------------------------
class _Spy(nn.Module):
    """A Hugging Face model that records the keyword names of every call."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.calls = inner, []

    def forward(self, **inputs):
        self.calls.append(sorted(inputs))
        return self.inner(**inputs)


def test_labels_in_a_dict_batch_are_the_target_of_a_compiled_loss_and_of_metrics():
    ids, labels = _token_task(64, seed=4)
    mask = torch.ones(64, T, dtype=torch.long)
    model = fitkit.Model(_Spy(_bert(dropout=0.0)), device="cpu")
    model.compile(
        optimizer=torch.optim.SGD(model.module.parameters(), lr=0.1), loss="cross_entropy", metrics=["accuracy"]
    )
    history = model.fit(
        {"input_ids": ids, "attention_mask": mask, "labels": labels}, batch_size=16, epochs=1, shuffle=False, verbose=0
    )
    # The Trainer's way with a custom loss: the model is not given `labels` (no loss of its own).
    assert model.module.calls == [["attention_mask", "input_ids"]] * 5  # the check before step 1, 4 steps

    # Plain PyTorch: the same four SGD steps on F.cross_entropy of the logits.
    plain = _bert(dropout=0.0)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    losses = []
    for i in range(0, 64, 16):
        loss = F.cross_entropy(
            plain(input_ids=ids[i : i + 16], attention_mask=mask[i : i + 16]).logits, labels[i : i + 16]
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for (name, p), q in zip(model.module.inner.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    assert history.history["loss"][0] == pytest.approx(sum(losses) / 4, abs=1e-6)

    result = model.evaluate({"input_ids": ids, "attention_mask": mask, "labels": labels}, verbose=0)
    with torch.no_grad():
        logits = plain(input_ids=ids, attention_mask=mask).logits
    assert result["loss"] == pytest.approx(float(F.cross_entropy(logits, labels)), abs=1e-6)
    assert result["accuracy"] == pytest.approx(float((logits.argmax(-1) == labels).float().mean()), abs=1e-7)


def test_a_datasets_dataset_with_a_labels_column_trains_with_a_compiled_loss():
    datasets = pytest.importorskip("datasets")
    ids, labels = _token_task(32, seed=5)
    table = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()}).with_format("torch")
    a, b = fitkit.Model(_bert(dropout=0.0), device="cpu"), fitkit.Model(_bert(dropout=0.0), device="cpu")
    for m in (a, b):
        m.compile(optimizer="sgd", loss="cross_entropy")
    ha = a.fit(table, batch_size=8, epochs=1, shuffle=False, verbose=0)
    hb = b.fit({"input_ids": ids}, labels, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert ha.history == hb.history
    for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_model_with_its_own_loss_still_gets_the_labels():
    ids, labels = _token_task(16, seed=6)
    model = fitkit.Model(_Spy(_bert(dropout=0.0)), device="cpu")
    model.compile(optimizer="sgd", loss=None)
    model.fit({"input_ids": ids, "labels": labels}, batch_size=16, epochs=1, verbose=0)
    assert model.module.calls == [["input_ids", "labels"]] * 2  # the check before step 1, the step


# -- a model's own token loss under accumulation: num_items_in_batch --------------------------
def _gpt2_tiny() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=32,
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


def _uneven_labels() -> dict[str, torch.Tensor]:
    """Two sequences of 6: the first has 4 label tokens that count after the causal shift, the
    second 1 (the rest -100)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 32, (2, 6), generator=g)
    labels = ids.clone()
    labels[0, 5] = -100  # shifted targets: positions 1..4 of row 0 count (4)
    labels[1, 2:] = -100  # and position 1 of row 1 (1)
    return {"input_ids": ids, "labels": labels}


def test_a_models_own_token_loss_is_exact_under_accumulation_with_num_items_in_batch():
    """GPT-2 computes its own loss (compile(loss=None)) and takes num_items_in_batch: with
    micro-batches of 4 and 1 counted tokens and gradient_accumulation_steps=2, the step equals
    one step on both sequences at once (its mean over the 5 tokens), and the epoch loss is that
    mean. Without the count (before) each micro-batch's mean weighed the same: another step."""
    batch = _uneven_labels()
    hand = _gpt2_tiny()
    opt = torch.optim.SGD(hand.parameters(), lr=0.5)
    full = hand(**batch).loss  # the mean over the 5 shifted label tokens
    full.backward()
    opt.step()

    net = _gpt2_tiny()
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss=None, gradient_accumulation_steps=2)
    history = model.fit(batch, batch_size=1, epochs=1, shuffle=False, verbose=0)
    assert model.global_step == 1
    for (name, a), b in zip(net.named_parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    assert history.history["loss"][0] == pytest.approx(full.item(), rel=1e-5)


def test_num_items_in_batch_is_passed_only_to_a_module_that_takes_it_and_only_when_needed():
    """The count goes to a module's forward when it declares num_items_in_batch (or is a Hugging
    Face model), under accumulation or torchrun; one process without accumulation leaves the
    module's own mean alone; a module without the parameter never gets it."""
    seen = []

    class Own(nn.Module):
        def __init__(self, takes):
            super().__init__()
            self.lin, self.takes = nn.Linear(3, 1), takes

        def forward(self, x, labels=None, **kwargs):
            seen.append(kwargs.get("num_items_in_batch"))
            return {"loss": ((self.lin(x).squeeze(-1) - labels.float()) ** 2).mean()}

    class Takes(Own):
        def forward(self, x, labels=None, num_items_in_batch=None):
            return super().forward(x, labels, num_items_in_batch=num_items_in_batch)

    data = {"x": torch.randn(4, 3), "labels": torch.tensor([1, -100, 2, 3])}
    # windows of 2 rows: labels (1, -100) count 1, labels (2, 3) count 2
    for module, k, expected in (
        (Takes(True), 2, [1, 1, 2, 2]),
        (Takes(True), 1, [None] * 4),
        (Own(False), 2, [None] * 4),
    ):
        seen.clear()
        model = fitkit.Model(module, device="cpu")
        model.compile(optimizer="sgd", loss=None, gradient_accumulation_steps=k)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(data, batch_size=1, epochs=1, shuffle=False, verbose=0)
        assert [None if v is None else int(v) for v in seen[-4:]] == expected
        noted = [w for w in caught if "takes no `num_items_in_batch`" in str(w.message)]
        assert len(noted) == (1 if not module.takes and k == 2 else 0)  # the -100 label, weighed by rows


def test_an_own_loss_without_num_items_on_ignored_labels_is_noted_once_under_accumulation():
    """A module computing its own token mean without num_items_in_batch: under accumulation its
    micro-batch means weigh by rows; one FitkitWarning names the fix, only when labels hold -100
    and only where the weighing applies (not on one process without accumulation)."""
    from fitkit.checks import FitkitWarning

    class OwnMean(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = nn.Parameter(torch.zeros(3))

        def forward(self, ids, labels=None):
            logits = self.b.expand(ids.shape[0], ids.shape[1], 3)
            return {"loss": F.cross_entropy(logits.reshape(-1, 3), labels.reshape(-1)), "logits": logits}

    ignored = {"ids": torch.zeros(4, 2, dtype=torch.long), "labels": torch.tensor([[0, 1], [2, -100]] * 2)}
    full = {"ids": torch.zeros(4, 2, dtype=torch.long), "labels": torch.tensor([[0, 1], [2, 1]] * 2)}
    for data, k, expected in ((ignored, 2, 1), (full, 2, 0), (ignored, 1, 0)):
        model = fitkit.Model(OwnMean(), device="cpu")
        model.compile(optimizer="sgd", loss=None, gradient_accumulation_steps=k)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(data, batch_size=1, epochs=2, shuffle=False, verbose=0)
        notes = [w for w in caught if issubclass(w.category, FitkitWarning) and "num_items_in_batch" in str(w.message)]
        assert len(notes) == expected, (k, [str(w.message) for w in caught])


# -- label_names: the Trainer's target keys other than "labels" -------------------------------
def _qa_loss(out, y_true):
    """Question answering's loss as the Transformers models compute it: the mean of the start and
    end positions' cross-entropies."""
    start, end = y_true
    return (F.cross_entropy(out.start_logits, start) + F.cross_entropy(out.end_logits, end)) / 2


def test_question_answering_positions_are_the_targets_of_a_compiled_loss_by_default():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 50, (32, T), generator=g)
    start = torch.randint(0, T, (32,), generator=g)
    end = torch.randint(0, T, (32,), generator=g)
    torch.manual_seed(0)
    module = _Spy(transformers.BertForQuestionAnswering(_bert_config(dropout=0.0)))
    model = fitkit.Model(module, device="cpu")
    model.compile(
        optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
        loss=_qa_loss,
        label_names=fitkit.losses.labels.default_label_names(module.inner),
    )
    assert model.label_names == ("start_positions", "end_positions")  # the Trainer's default for QA
    history = model.fit(
        {"input_ids": ids, "start_positions": start, "end_positions": end},
        batch_size=8,
        epochs=1,
        shuffle=False,
        verbose=0,
    )
    assert module.calls == [["input_ids"]] * 5  # the positions are targets, not inputs: no loss of its own

    # The model's own loss, in a plain loop: the same four SGD steps.
    torch.manual_seed(0)
    plain = transformers.BertForQuestionAnswering(_bert_config(dropout=0.0))
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    losses = []
    for i in range(0, 32, 8):
        loss = plain(input_ids=ids[i : i + 8], start_positions=start[i : i + 8], end_positions=end[i : i + 8]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for (name, p), q in zip(module.inner.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    assert history.history["loss"][0] == pytest.approx(sum(losses) / 4, abs=1e-6)


def test_the_default_label_names_follow_the_trainers_rule():
    from fitkit.losses.labels import default_label_names

    cfg = _bert_config(dropout=0.0)
    assert default_label_names(transformers.BertForQuestionAnswering(cfg)) == ("start_positions", "end_positions")
    assert default_label_names(transformers.BertForSequenceClassification(cfg)) == ("labels",)
    assert default_label_names(transformers.BertForPreTraining(cfg)) == ("labels", "next_sentence_label")
    model = fitkit.Model(transformers.BertForQuestionAnswering(cfg), device="cpu")
    model.compile(optimizer="sgd", loss=_qa_loss)
    assert model.label_names == ("start_positions", "end_positions")


def test_a_named_target_key_and_a_batch_missing_one_of_several():
    x = {"features": torch.randn(8, 3, generator=torch.Generator().manual_seed(0)), "target": torch.randn(8, 1)}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, features):
            return self.lin(features)

    torch.manual_seed(0)
    model = fitkit.Model(Net(), device="cpu")
    model.compile(optimizer="sgd", loss="mse", label_names="target")
    result = model.evaluate(x, verbose=0)
    with torch.no_grad():
        expected = float(F.mse_loss(model.module(x["features"]), x["target"]))
    assert result["loss"] == pytest.approx(expected, abs=1e-7)

    model.compile(optimizer="sgd", loss=_qa_loss, label_names=["target", "other"])
    before = model.module.lin.weight.clone()
    with pytest.raises(ValueError, match=r"holds the label entries \['target'\] but not \['other'\].*Fix"):
        model.fit(x, epochs=1, verbose=0)
    assert torch.equal(model.module.lin.weight, before)
    for bad, kind in ((5, TypeError), ([], ValueError), (["a", "a"], ValueError)):
        with pytest.raises(kind, match=r"compile\(label_names=\).*Fix"):
            model.compile(optimizer="sgd", loss="mse", label_names=bad)
    assert model.label_names == ("target", "other")  # a refused compile changed nothing
