"""
11. Hugging Face transformers
=============================

A `transformers <https://huggingface.co/docs/transformers>`_ model is an ``nn.Module``, so
``fit`` trains it as it is: a dict batch is passed as keyword arguments, the model's own loss is
the objective, and metrics and ``predict`` use its ``logits``. It needs the ``hf`` extra:

.. code-block:: bash

   pip install ".[hf]"     # from a checkout; once released: pip install "torch-fitkit[hf]"

Nothing on this page downloads weights: every model is built from a small config, as
``from_pretrained`` would build it before loading a checkpoint.
"""

# %%
# A classifier with its own loss
# ------------------------------
#
# A :class:`~transformers.BertForSequenceClassification` of two layers learns a toy task:
# sequences of 12 token ids, labelled 1 when token 7 occurs in them. The batch is a dict with the
# model's argument names; with ``labels`` in it, the model returns a ``ModelOutput`` that holds
# its loss, and ``compile(loss=None)`` trains on that loss.

import torch
import transformers
from transformers import BertConfig, BertForSequenceClassification

import fitkit

transformers.logging.set_verbosity_error()   # tiny configs: no notes on token ids

def token_task(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (n, 12), generator=g)
    ids[ids == 7] = 8
    has = torch.rand(n, generator=g) < 0.5
    ids[has, torch.randint(0, 12, (int(has.sum()),), generator=g)] = 7
    return ids, has.long()

ids, labels = token_task(512, seed=0)
ids_test, labels_test = token_task(256, seed=1)

config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=12, num_labels=2)
torch.manual_seed(0)
model = fitkit.Model(BertForSequenceClassification(config))
model.compile(optimizer="adam", loss=None, metrics=["accuracy"])
history = model.fit({"input_ids": ids, "labels": labels}, batch_size=32, epochs=5, verbose=0)
result = model.evaluate({"input_ids": ids_test, "labels": labels_test}, verbose=0)
print(f"test accuracy {result['accuracy']:.1f}")    # chance: 0.5
# sphinx_gallery_start_ignore
assert result["accuracy"] > 0.7
# sphinx_gallery_end_ignore

# %%
# ``module(**x)`` is the call, so any argument of the model's ``forward`` can be in the dict
# (``attention_mask``, ``token_type_ids``, ...). A dict of in-memory tensors, a tokenizer's
# ``BatchEncoding``, a ``Dataset`` whose items are dicts and a ``DataLoader`` of dict batches all
# work, as they do for any module.
#
# Which tensor is the prediction
# ------------------------------
#
# One rule, in :mod:`fitkit.losses.outputs`, picks the prediction out of a structured output: a tensor
# is the prediction; a dict or ``ModelOutput`` gives its ``"logits"`` entry, else its only tensor
# entry other than ``"loss"``; a namedtuple gives its ``logits`` field, else its first field.
# Metrics compare that prediction with ``y``, or, when there is no ``y``, with ``x["labels"]``.
# ``predict`` returns the ``logits`` of such an output, so the accuracy above can be checked by
# hand:

logits = model.predict({"input_ids": ids_test}, verbose=0)     # (N, num_labels)
print(logits.shape)
by_hand = (logits.argmax(-1) == labels_test).float().mean()
print(abs(float(by_hand) - result["accuracy"]) < 1e-6)
# sphinx_gallery_start_ignore
assert logits.shape == (256, 2) and abs(float(by_hand) - result["accuracy"]) < 1e-6
# sphinx_gallery_end_ignore

# %%
# The labels may also stay outside the inputs, as ``y``: then the model returns no loss, and a
# compiled loss takes the ``logits``. For this model the two are the same computation:

torch.manual_seed(0)
twin = fitkit.Model(BertForSequenceClassification(config))
twin.compile(optimizer="adam", loss="cross_entropy", metrics=["accuracy"])
twin_history = twin.fit({"input_ids": ids}, labels, batch_size=32, epochs=5, verbose=0)
print(twin_history.history == history.history)
# sphinx_gallery_start_ignore
assert twin_history.history == history.history
# sphinx_gallery_end_ignore

# %%
# The labels may also stay in the batch beside a compiled loss: a ``labels`` entry is then the
# loss's target (and the metrics'), as the Trainer's ``label_names`` default makes it for a
# custom loss. fitkit leaves it out of the module's inputs, so the model computes no loss of its
# own, and the run is the same computation once more:

torch.manual_seed(0)
third = fitkit.Model(BertForSequenceClassification(config))
third.compile(optimizer="adam", loss="cross_entropy", metrics=["accuracy"])
third_history = third.fit({"input_ids": ids, "labels": labels}, batch_size=32, epochs=5, verbose=0)
print(third_history.history == history.history)
# sphinx_gallery_start_ignore
assert third_history.history == history.history
# sphinx_gallery_end_ignore

# %%
# LoRA adapters (``pip install ".[peft]"`` from a checkout): a ``PeftModel`` from
# ``peft.get_peft_model(net, LoraConfig(...))`` is an ``nn.Module`` whose base weights are frozen,
# so ``fitkit.Model(peft_model)`` trains the adapters alone, and ``summary()`` counts its
# trainable parameters as PEFT's ``print_trainable_parameters()`` does.
# ``model.save_weights(path, trainable_only=True)`` writes the trainable parameters alone (the
# adapters: kilobytes, not the base model), and ``load_weights(path, trainable_only=True)`` puts
# them back into a model built the same way from the same base weights, as the Trainer saves only
# the adapters of a ``PeftModel``. ``trainable_only`` takes a bool (a string such as ``"no"`` is a
# ``TypeError``), and with every parameter frozen ``save_weights(..., trainable_only=True)`` is a
# ``ValueError``: the file would hold nothing.
#
# The Trainer's ``neftune_noise_alpha`` is the callback :class:`~fitkit.callbacks.NEFTune`:
# ``fit(..., callbacks=[NEFTune(noise_alpha=5.0)])`` adds the paper's uniform noise to the
# output of the model's ``get_input_embeddings()`` in training forwards only, so validations,
# ``evaluate`` and ``predict`` see the plain embeddings. Its ``include_num_input_tokens_seen``
# is :class:`~fitkit.callbacks.TokensSeen`: the tokens trained on, over all ranks, as
# ``num_input_tokens_seen`` in the epoch logs and in checkpoints (``non_padding=True`` counts
# the ``attention_mask``).

# %%
# When the rule finds no single prediction (a question-answering model returns
# ``start_logits`` and ``end_logits``), a compiled loss or compiled metrics stop before the first
# step with a ``ValueError`` that names the fix: return a tensor or a ``"logits"`` entry, or
# compile one loss per output and compute metrics in a custom ``test_step``
# (:doc:`../guides/custom_steps`). A plain callable loss ``fn(y_pred, y)`` gets the whole output.

class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        return {"start_logits": self.linear(x), "end_logits": -self.linear(x)}

qa = fitkit.Model(TwoHeads())
qa.compile(loss="cross_entropy")
try:
    qa.fit(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long), verbose=0)
except ValueError as e:
    print(str(e).split(". The rule")[0])

# %%
# The message goes on with the rule and the fix.
#
# Labels of -100 count for nothing, in the model's loss as in the metrics: with ``loss=None``,
# multiclass metrics skip them (Hugging Face's ignore index, used for padding and sub-word
# tokens). A label outside ``[0, num_labels)`` anywhere in in-memory data is an error before the
# first step.
#
# Data in a ``datasets.Dataset``
# ------------------------------
#
# Data kept in a Hugging Face `datasets <https://huggingface.co/docs/datasets>`_ ``Dataset``
# goes to ``fit``, ``evaluate`` and ``predict`` as it is, once its rows are tensors
# (``with_format("torch")``): fitkit batches it like a map-style ``Dataset`` (``batch_size``,
# ``shuffle``, one share per rank under ``torchrun``, a resume inside an epoch with
# :class:`~fitkit.callbacks.BackupAndRestore`), and each batch, a dict such as
# ``{"input_ids", "attention_mask", "labels"}``, is passed as ``forward(**batch)``. A tokenizer
# is built here from a word list (``tokenizers``' ``WordLevel`` model), so nothing downloads;
# ``AutoTokenizer.from_pretrained(...)`` gives the same kind of object.

import datasets
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding, PreTrainedTokenizerFast

datasets.disable_progress_bars()
words = ["[PAD]", "[UNK]", "good", "bad", "great", "awful", "movie", "plot", "very", "not", "the", "was"]
word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
word_level.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="[PAD]", unk_token="[UNK]")

g = torch.Generator().manual_seed(0)
texts, stars = [], []
for _ in range(256):
    positive = bool(torch.rand(1, generator=g) < 0.5)
    opinion = ["good", "great"] if positive else ["bad", "awful"]
    n = int(torch.randint(1, 4, (1,), generator=g))       # 1 to 3 opinion words: rows differ in length
    picked = [opinion[int(i)] for i in torch.randint(0, 2, (n,), generator=g)]
    texts.append("the movie was " + " very ".join(picked))
    stars.append(int(positive))

reviews = datasets.Dataset.from_dict({"text": texts, "label": stars})
reviews = reviews.map(lambda rows: tokenizer(rows["text"]), batched=True, remove_columns=["text"])
reviews = reviews.rename_column("label", "labels").with_format("torch")
split = reviews.train_test_split(test_size=0.25, seed=0)
print(split["train"])
print(split["train"][0])

# %%
# The rows have different lengths (``"the movie was good"`` has 4 tokens, ``"the movie was
# bad very awful"`` 6), so they cannot be stacked as they are. fitkit does not pad on its own,
# since the pad id and the padding of the labels are the tokenizer's and the collator's to
# decide: a batch of rows of several lengths stops with a ``ValueError`` that says so. A
# ``DataLoader`` with ``transformers``' :class:`~transformers.DataCollatorWithPadding` pads
# each batch to its longest row (``DataCollatorForLanguageModeling`` does the same for language
# models, with -100 labels at the padding); padding every row to one length when tokenizing
# (``padding="max_length"``) lets the ``Dataset`` go in directly.

config = BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=16, num_labels=2)
torch.manual_seed(0)
reviewer = fitkit.Model(BertForSequenceClassification(config))
reviewer.compile(optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), loss=None, metrics=["accuracy"])
try:
    reviewer.fit(split["train"], batch_size=32, verbose=0)
except ValueError as e:
    print(str(e).split(" fitkit does not pad")[0])

collator = DataCollatorWithPadding(tokenizer)
train_loader = DataLoader(split["train"], batch_size=32, shuffle=True, collate_fn=collator)
test_loader = DataLoader(split["test"], batch_size=64, collate_fn=collator)
history = reviewer.fit(train_loader, epochs=3, validation_data=test_loader, verbose=2)
print(reviewer.predict(test_loader, verbose=0).shape)     # (64, 2): every test row, in order
# sphinx_gallery_start_ignore
assert history.history["val_accuracy"][-1] > 0.9
# sphinx_gallery_end_ignore

# %%
# A ``datasets.Dataset`` without the torch format (its rows are Python lists) is refused before
# the first step with the fix, ``with_format("torch")``. A dict batch is passed as
# ``forward(**batch)``, by this rule: when ``forward`` names its parameters, a key it does not
# name (a leftover ``"text"`` column, say) is refused before the first step, with the batch's
# keys and ``forward``'s parameters listed; when ``forward`` takes ``**kwargs``, as most
# Transformers models' do today, every key is passed on to it, and the model uses it or
# ignores it (fitkit cannot tell which). Remove the columns the model does not use yourself
# (``Dataset.remove_columns``), as the Trainer's ``remove_unused_columns`` does. ``labels`` is
# never one to remove: with a compiled loss it is the loss's target and is not passed on.
# ``tests/training/test_preflight.py`` checks this rule for both kinds of ``forward``.
#
# GPT-2 on tiny Shakespeare
# -------------------------
#
# A :class:`~transformers.GPT2LMHeadModel` with the sizes of the :doc:`04_microgpt` recipe (4
# layers, 4 heads, 128 dimensions, a 65-character vocabulary, 64 positions) trains on tiny
# Shakespeare, tokenized by :class:`~fitkit.text.CharTokenizer`. A causal language model shifts
# its ``labels`` inside (position ``t`` predicts token ``t + 1``), so the labels are the inputs.
# Items of a ``Dataset`` are dicts, as Hugging Face datasets serve them:

from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

from fitkit.examples.shakespeare import default_text_path
from fitkit.text import CharTokenizer, NextTokenDataset

text = default_text_path().read_text(encoding="utf-8")
tokenizer = CharTokenizer(text)                       # 65 characters
tokens = tokenizer.encode(text[:100_000])             # a slice, for the docs build

class CausalWindows(Dataset):
    """Windows of 64 tokens as {"input_ids", "labels"} (the model shifts the labels)."""

    def __init__(self, tokens):
        self.windows = NextTokenDataset(tokens, block_size=64)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        x, _ = self.windows[i]
        return {"input_ids": x, "labels": x}

n_train = int(0.9 * len(tokens))
train_set, val_set = CausalWindows(tokens[:n_train]), CausalWindows(tokens[n_train:])

config = GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=tokenizer.vocab_size,
                    n_positions=64)

# %%
# A language model is trained for a number of optimizer steps rather than epochs, and validated
# every so many steps: ``max_steps`` is the budget (the Trainer's and Lightning's name; with it
# and no ``epochs`` the epochs run on until the budget is spent), and ``validation_interval=20``
# validates after every 20 optimizer steps on ``validation_steps`` batches, each validation a
# record of ``history.validations`` with its step. :class:`~fitkit.callbacks.BackupAndRestore`
# makes the run survive a stop: when the job is stopped (SIGTERM from SLURM or Kubernetes,
# Ctrl-C), fitkit finishes the optimizer step, writes a backup, says so in one line and exits
# (status 143 for SIGTERM); the same script run again resumes from that step, bit for bit, by
# sample, at any number of processes (:doc:`../tutorials/07_scaling_out`). A run that ends
# normally deletes its backup, as in Keras.

import tempfile

from fitkit.callbacks import BackupAndRestore

torch.manual_seed(0)
gpt2 = fitkit.Model(GPT2LMHeadModel(config))
gpt2.compile(optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3), loss=None, clip_grad_norm=1.0)
history = gpt2.fit(train_set, batch_size=12, max_steps=40, validation_data=val_set,
                   validation_steps=10, validation_interval=20, verbose=2,
                   callbacks=[BackupAndRestore(tempfile.mkdtemp())])

validations = [(record["step"], round(record["val_loss"], 4)) for record in history.validations]
print(validations)
print(gpt2.global_step, validations[-1][1] < validations[0][1] < 4.17)   # ln 65
# sphinx_gallery_start_ignore
assert gpt2.global_step == 40 and [step for step, _ in validations] == [20, 40]
assert validations[-1][1] < validations[0][1] < 4.17
# sphinx_gallery_end_ignore
logits = gpt2.predict({"input_ids": tokens[:64][None]}, verbose=0)
print(logits.shape)                                   # (B, T, V)

# %%
# A compiled loss on a causal LM's ``labels`` shifts them as the model's own loss does: with
# ``compile(loss="cross_entropy")`` (or ``nn.CrossEntropyLoss(label_smoothing=0.1)``, or any loss
# on the logits) the output at position ``t`` is scored against label ``t + 1`` and the last
# position counts for nothing, token-exact with ``-100`` labels, under accumulation and across
# ranks; per-token metrics read the same shifted labels. That is ``compile(shift_labels=None)``:
# it follows the model (a Transformers causal LM shifts; a masked LM or a token classifier does
# not). ``shift_labels=True`` / ``False`` says it either way, the Transformers Trainer's choice
# between its causal-LM loss and a loss on aligned labels. A module fitkit does not know (GPT-2
# inside a module of yours, returning a tensor), fed labels that repeat its ``input_ids``, is
# refused before the first step with a ``ValueError`` that names ``shift_labels=``. Scored with a
# compiled loss, the trained GPT-2 gets the validation loss of its own loss:

scored = fitkit.Model(gpt2.module)
scored.compile(loss="cross_entropy", metrics=["accuracy"])
own = gpt2.evaluate(val_set, batch_size=12, steps=5, verbose=0)["loss"]
compiled = scored.evaluate(val_set, batch_size=12, steps=5, verbose=0)
print(round(own, 4), round(compiled["loss"], 4), 0 < compiled["accuracy"] < 1)
# sphinx_gallery_start_ignore
assert abs(own - compiled["loss"]) < 1e-5
# sphinx_gallery_end_ignore

# %%
# Targets already shifted may also come as ``y`` (a :class:`~fitkit.text.NextTokenDataset` gives
# ``(x, y)`` so): ``y`` is never shifted.
#
# With the full recipe of :doc:`04_microgpt` (2,000 steps of batch 12 on the whole text, AdamW
# with warm-up and cosine decay, no dropout), ``benchmarks/hf_gpt2.py`` trains this GPT-2 and
# fitkit's :class:`~fitkit.layers.GPT` preset side by side. Scored alike, over all 64 positions of
# the same 200 fixed validation batches, they end close: GPT-2 (809,856 parameters, with biases)
# at a validation loss of 1.909, the preset (795,904 parameters, no biases) at 1.913.
#
# .. code-block:: bash
#
#    python benchmarks/hf_gpt2.py            # both models, about 7 minutes on one CPU thread
