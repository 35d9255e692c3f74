"""
2. A classifier
===============

A classifier of handwritten digits: data in a ``DataLoader``, a network with Dropout, accuracy
as a metric, validation every epoch, then ``evaluate``, ``predict``, ``summary()`` and the
learning curves. The data is scikit-learn's digits set (1,797 images of 8 x 8 pixels, shipped
inside scikit-learn, nothing to download; ``pip install ".[examples]"`` from a checkout).
"""

# %%
# The data
# --------

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

# (1797, 64) pixel values in 0..16 and (1797,) labels in 0..9
images, labels = load_digits(return_X_y=True)
x_train, x_test, y_train, y_test = train_test_split(
    images, labels, test_size=0.2, random_state=0, stratify=labels)

x_train = torch.tensor(x_train / 16, dtype=torch.float32)   # (N, 64) in [0, 1]
x_test = torch.tensor(x_test / 16, dtype=torch.float32)
y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)  # int64 classes
print(x_train.shape, x_test.shape, y_train.dtype)
# sphinx_gallery_start_ignore
assert x_train.shape == (1437, 64) and x_test.shape == (360, 64)
# sphinx_gallery_end_ignore

# %%
# A ``DataLoader`` serves a ``Dataset`` in shuffled mini-batches. ``fit`` takes it as it is (any
# iterable of ``(x, y)`` batches works, and so does a ``Dataset``):

from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
train_loader = DataLoader(TensorDataset(x_train, y_train), batch_size=32,
                          shuffle=True)
x_batch, y_batch = next(iter(train_loader))
print(len(train_loader), x_batch.shape, y_batch.shape)
# sphinx_gallery_start_ignore
assert len(train_loader) == 45  # 1,437 / 32, the last batch partial
# sphinx_gallery_end_ignore

# %%
# .. note::
#
#    For data that fits in memory, passing the tensors themselves, ``fit(x_train, y_train,
#    batch_size=32)``, is faster: fitkit then slices batches out of the tensors instead of
#    collating them sample by sample. A ``DataLoader`` is the tool for data read from disk or
#    augmented on the fly. In-memory NumPy arrays work too: their float64 values are cast to the
#    module's float32, as Keras does, while a ``DataLoader``'s batches are used as they come.
#
# The model
# ---------
#
# A two-layer perceptron with Dropout between the layers. It outputs 10 logits per image; the
# ``"cross_entropy"`` loss applies the softmax itself.

from torch import nn

import fitkit

net = nn.Sequential(
    nn.Linear(64, 128), nn.ReLU(),
    nn.Dropout(0.2),                 # zeroes 20% of the values, in training only
    nn.Linear(128, 10),              # (B, 10) logits
)
model = fitkit.Model(net)
model.compile(
    optimizer=torch.optim.Adam(model.module.parameters(), lr=3e-3),
    loss="cross_entropy",
    metrics=["accuracy"],
)

# %%
# The optimizer is built on ``model.module.parameters()``, after ``fitkit.Model`` has moved the
# module to its device; ``optimizer="adam"`` would build the same with PyTorch's default
# learning rate (1e-3). Metric names resolve to `torchmetrics
# <https://lightning.ai/docs/torchmetrics/>`_ (``"accuracy"``, ``"f1"``, ``"precision"``,
# ``"recall"``, ``"auroc"``, ``"mae"``, ``"rmse"``, ...); the task (binary, multi-class,
# multi-label) and the number of classes are read from the first batch. ``"accuracy"`` is the
# fraction of correct predictions, as in Keras. The metrics follow the loss: ``"cross_entropy"``
# says the network outputs logits (so ``"auroc"`` would get their softmax) and that targets equal
# to -100 count for nothing, in the loss and in every metric. A plain function
# ``fn(y_pred, y_true)`` is a metric too, averaged per sample; see :doc:`../api/metrics`.
#
# Training
# --------
#
# ``validation_data`` is evaluated after every epoch; its keys get a ``val_`` prefix.

history = model.fit(train_loader, epochs=6, validation_data=(x_test, y_test),
                    verbose=2)

# sphinx_gallery_start_ignore
assert history.history["val_accuracy"][-1] > 0.93  # what this page relies on (0.97 on the CPU that built it)
# sphinx_gallery_end_ignore

# %%
# The run is seeded, but the last digits may differ between CPU models. The training loss and
# accuracy of an epoch are the exact means over its samples, with Dropout active; the ``val_``
# values are computed afterwards with Dropout off.
#
# On a terminal or in a notebook, ``verbose="auto"`` (the default) draws a live progress bar for
# each epoch, with the running loss and metrics and the time left, and replaces it with the line
# above when the epoch ends. In a log file or CI, where a live bar is noise, it prints just the
# lines (``verbose=2``); ``verbose=0`` is silent.
#
# Modes and ``no_grad``: handled
# ------------------------------
#
# Dropout must be on while training and off while evaluating, and evaluation should not record
# gradients. In a hand-written loop that is ``net.train()``, ``net.eval()`` and
# ``with torch.no_grad():`` in the right places, and forgetting one is a silent bug. ``fit``
# trains the module in the mode it is in (a new module is in training mode, so Dropout is on);
# validation, ``evaluate`` and ``predict`` put every submodule in eval mode with autograd off;
# all three leave every flag and the grad mode as they found them:

sample = x_test[:5]
print(net.training, torch.is_grad_enabled())   # as we left it: training, grad on

# training mode: Dropout draws a new mask at every call
print(torch.equal(net(sample), net(sample)))
p1 = model.predict(sample, verbose=0)
p2 = model.predict(sample, verbose=0)
print(torch.equal(p1, p2), p1.requires_grad)   # eval mode, no autograd graph

print(net.training, torch.is_grad_enabled())   # restored
# sphinx_gallery_start_ignore
assert net.training and torch.equal(p1, p2) and not p1.requires_grad
# sphinx_gallery_end_ignore

# %%
# A submodule that you put in eval mode yourself (a frozen, pre-trained part) stays in eval mode
# during ``fit``.
#
# Evaluate and predict
# --------------------
#
# ``evaluate`` returns the loss and the metrics over the whole data set as a dict of floats.
# ``predict`` returns the module's outputs for every row, in input order, on the CPU:

result = model.evaluate(x_test, y_test, verbose=0)
print(sorted(result))
print(f"test accuracy: {result['accuracy']:.2f}")

logits = model.predict(x_test, verbose=0)            # (360, 10)
predicted = logits.argmax(dim=-1)
print(logits.shape, predicted[:10].tolist(), y_test[:10].tolist())
print(f"by hand:       {(predicted == y_test).float().mean():.2f}")

probabilities = logits.softmax(dim=-1)               # rows sum to 1
print(probabilities.sum(dim=-1)[:3])
# sphinx_gallery_start_ignore
assert result["accuracy"] == (predicted == y_test).float().mean().item()
# sphinx_gallery_end_ignore

# %%
# Which digits does it confuse? scikit-learn's ``ConfusionMatrixDisplay`` draws, for each true
# digit (a row), how often each digit was predicted (a column); the diagonal is what it gets
# right.

import matplotlib.pyplot as plt
from sklearn.metrics import ConfusionMatrixDisplay

display = ConfusionMatrixDisplay.from_predictions(y_test, predicted, colorbar=False)
display.ax_.set_title(f"digits, test set: accuracy {result['accuracy']:.2f}")
plt.show()

# %%
# Summary
# -------
#
# ``summary()`` prints the layers, their output shapes and their parameter counts. Output shapes
# come from the last in-memory batch that ``fit`` or ``evaluate`` saw (here ``evaluate``'s first
# batch of 32); before any, they show ``?``.

table = model.summary()

# %%
# Learning curves
# ---------------
#
# ``fit`` returns a :class:`~fitkit.callbacks.History` (also kept as ``model.history``):
# one float per epoch for every logged key.

print(list(history.history))
print(history.epoch)
print([round(v, 2) for v in history.history["val_accuracy"]])

# sphinx_gallery_start_ignore
assert history.epoch == [0, 1, 2, 3, 4, 5]
# sphinx_gallery_end_ignore

# %%
# ``history.plot()`` draws them with matplotlib (``pip install ".[plot]"``), a ``val_``
# curve on the same axes as its training curve; given a ``path``, it saves a PNG too. It returns
# the figure and leaves pyplot's list of open figures as it was (plotting in a loop leaks
# nothing); ``plt.figure(figure)`` hands it to pyplot to show it:

figure = history.plot(keys=["loss", "accuracy"])
print([ax.get_title() for ax in figure.axes])
plt.figure(figure)
plt.show()

# %%
# Next: :doc:`../tutorials/03_layers` looks inside the layers, down to the transformer block.
