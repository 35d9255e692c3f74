"""PEFT: a LoRA ``PeftModel`` (tiny BERT from a config, no download) through fit, summary and
``save_weights(trainable_only=True)``."""

import io

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

import fitkit

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()
# a notice of transformers, raised inside peft.get_peft_model
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

T = 8


def _lora_bert(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=T,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    base = transformers.BertForSequenceClassification(config)
    lora = peft.LoraConfig(
        task_type=peft.TaskType.SEQ_CLS, r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query", "value"]
    )
    return peft.get_peft_model(base, lora)


def _data(n=32):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 30, (n, T), generator=g)
    return ids, (ids[:, 0] % 2)


def test_a_lora_model_trains_only_its_adapters_and_saves_them_alone(tmp_path):
    ids, labels = _data()
    net = _lora_bert()
    frozen = {k: p.detach().clone() for k, p in net.named_parameters() if not p.requires_grad}
    trainable = {k: p.detach().clone() for k, p in net.named_parameters() if p.requires_grad}
    assert frozen and trainable and all("lora_" in k or "modules_to_save" in k for k in trainable)

    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer="adam", loss="cross_entropy")
    before = model.evaluate({"input_ids": ids}, labels, verbose=0)["loss"]
    model.fit({"input_ids": ids, "labels": labels}, batch_size=8, epochs=3, verbose=0)
    after = model.evaluate({"input_ids": ids}, labels, verbose=0)["loss"]
    with torch.no_grad():
        logits = net(input_ids=ids).logits
    assert after == pytest.approx(float(F.cross_entropy(logits, labels)), abs=1e-6) and after < before
    for k, p in net.named_parameters():
        if k in frozen:
            assert torch.equal(p, frozen[k]), k  # the base model is untouched
    assert any(not torch.equal(p, trainable[k]) for k, p in net.named_parameters() if k in trainable)

    # summary: trainable and total, as PEFT counts them
    n_trainable, n_total = net.get_nb_trainable_parameters()
    console = Console(file=io.StringIO(), width=200)
    model.summary(print_fn=console.print)
    text = console.file.getvalue()
    total_row = next(line for line in text.splitlines() if " Total " in line)
    assert f"{n_total:,}" in total_row and f"{n_trainable:,}" in total_row
    assert f"Frozen parameters: {n_total - n_trainable:,}" in text

    # save_weights(trainable_only=True): the adapters (and the classifier PEFT trains) alone
    path = tmp_path / "adapters.pt"
    model.save_weights(path, trainable_only=True)
    saved = torch.load(path, weights_only=True)
    assert set(saved) == set(trainable)
    assert sum(t.numel() for t in saved.values()) == n_trainable

    fresh = fitkit.Model(_lora_bert(), device="cpu")  # the same base weights, fresh adapters
    fresh.load_weights(path, trainable_only=True)
    for (k, p), q in zip(net.state_dict().items(), fresh.module.state_dict().values(), strict=True):
        assert torch.equal(p, q), k
    with pytest.raises(ValueError):  # a whole-model load needs every key: nothing is loaded
        fitkit.Model(_lora_bert(), device="cpu").load_weights(path)
