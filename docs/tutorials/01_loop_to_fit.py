"""
1. From the five-step loop to ``fit``
======================================

Every PyTorch training loop is the same five steps: **forward**, **loss**, **backward**,
**step**, **zero the gradients**. This tutorial writes them by hand, then hands them to
:meth:`fitkit.Model.fit`, and checks that both give the same answer.
"""

# %%
# Tensors
# -------
#
# A tensor is an n-dimensional array with a shape, a dtype and a device.

import torch

x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
print(x.shape, x.dtype, x.device)
print(x.sum(dim=0))      # reduce over rows: one value per column
print(x @ x.T)           # matrix product (2, 3) @ (3, 2) -> (2, 2)

# %%
# Autograd
# --------
#
# A tensor created with ``requires_grad=True`` records the operations applied to it;
# ``backward()`` walks that record back and stores each derivative in ``.grad``. For
# *y = x²* the derivative is *2x*, so at *x = 3* it is 6:

x = torch.tensor(3.0, requires_grad=True)
y = x ** 2
y.backward()
print(y.item(), x.grad)

# %%
# Gradients **accumulate**: a second ``backward()`` adds to ``x.grad`` instead of replacing it.
# That is why step 5 of the loop exists.

y = x ** 2
y.backward()
print(x.grad)   # 6 + 6

# %%
# Linear regression by hand
# -------------------------
#
# Data from the line *y = 3x + 2* plus a little noise; the model must find *W = 3* and
# *b = 2*.

torch.manual_seed(0)
X = torch.rand(256, 1) * 2 - 1                  # (N, 1) in [-1, 1)
Y = 3 * X + 2 + 0.1 * torch.randn(256, 1)       # (N, 1)

W = torch.zeros(1, 1, requires_grad=True)
b = torch.zeros(1, requires_grad=True)
lr = 0.1

for epoch in range(200):
    y_pred = X @ W + b                      # 1. forward
    loss = ((y_pred - Y) ** 2).mean()       # 2. loss (mean squared error)
    loss.backward()                         # 3. backward: fills W.grad and b.grad
    with torch.no_grad():                   # 4. step (not recorded by autograd)
        W -= lr * W.grad
        b -= lr * b.grad
    W.grad = None                           # 5. zero the gradients
    b.grad = None

print(f"W = {W.item():.2f}, b = {b.item():.2f}, loss = {loss.item():.4f}")

# %%
# The loss does not go to zero: 0.01 is the variance of the noise (0.1²), the best any
# line can do.
#
# The same loop with ``nn`` and ``optim``
# ---------------------------------------
#
# ``nn.Linear`` holds ``W`` and ``b`` as parameters, ``nn.MSELoss`` is the loss, and an optimizer
# does steps 4 and 5. This time the data is fed in mini-batches of 32, shuffled every epoch, as
# real training does:

from torch import nn

torch.manual_seed(0)
net = nn.Linear(1, 1)
loss_fn = nn.MSELoss()
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

net.train()                     # training mode (matters for Dropout, BatchNorm)
for epoch in range(20):
    perm = torch.randperm(len(X))
    for i in range(0, len(X), 32):
        idx = perm[i:i + 32]
        y_pred = net(X[idx])                    # 1. forward
        loss = loss_fn(y_pred, Y[idx])          # 2. loss: (prediction, target)
        loss.backward()                         # 3. backward
        optimizer.step()                        # 4. step
        optimizer.zero_grad()                   # 5. zero

print(f"W = {net.weight.item():.2f}, b = {net.bias.item():.2f}")
by_hand = (net.weight.detach().clone(), net.bias.detach().clone())

# %%
# The same with ``fitkit``
# ------------------------
#
# :class:`fitkit.Model` wraps the same ``nn.Linear``. ``compile`` picks the optimizer and the
# loss, ``fit`` runs the loop above: same seed, same shuffling, same batches.

import functools

import fitkit

torch.manual_seed(0)
model = fitkit.Model(nn.Linear(1, 1))
model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.1), loss="mse")
history = model.fit(X, Y, epochs=20, batch_size=32, verbose=0)

print(f"W = {model.module.weight.item():.2f}, b = {model.module.bias.item():.2f}")
print(f"final epoch loss: {history.history['loss'][-1]:.4f}")
# sphinx_gallery_start_ignore
assert torch.allclose(model.module.weight, by_hand[0]) and torch.allclose(model.module.bias, by_hand[1])
# sphinx_gallery_end_ignore

# %%
# The hand-written loop and ``fit`` agree to the last printed digit, because ``fit`` is that
# loop: one ``torch.randperm`` per epoch from the global generator, then index slices.
#
# ``optimizer`` also takes a name (``"sgd"``, ``"adam"``, ``"adamw"``, ... with PyTorch's
# default hyper-parameters) or an optimizer you built yourself on ``model.module.parameters()``.
# ``loss`` takes a name (``"mse"``, ``"cross_entropy"``, ...), an ``nn.Module`` or any callable,
# always called in PyTorch's order ``loss(y_pred, y_true)``.
#
# What ``fit`` did for you
# ------------------------
#
# ``verbose=2`` prints one line per epoch (``verbose=1``, the default on a terminal or in a
# notebook, draws a live progress bar instead):

torch.manual_seed(0)
model = fitkit.Model(nn.Linear(1, 1))
model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.1), loss="mse")
history = model.fit(X, Y, epochs=3, batch_size=32, verbose=2)
# sphinx_gallery_start_ignore
assert history.history["loss"][0] > history.history["loss"][1] > history.history["loss"][2]
# sphinx_gallery_end_ignore

# %%
# (The time after the step count is the wall time of the epoch.) Besides the five steps, ``fit``:
#
# - trains every submodule in the mode you left it in (a new module is in training mode; a
#   submodule you froze with ``.eval()`` stays frozen), runs validation in eval mode without
#   autograd, and restores every ``training`` flag and the grad mode afterwards;
# - moves each batch to ``model.device`` (``"auto"``: CUDA, else Apple MPS, else CPU), after
#   casting in-memory float inputs to the module's dtype (NumPy's float64 arrays become float32,
#   as Keras casts to ``floatx``);
# - reports the **exact** epoch mean of the loss: each batch counts by its number of samples,
#   so the short last batch does not get the weight of a full one;
# - reads the loss from the device once per epoch, not once per step (no host sync per step);
# - checks its arguments, the shapes of the data and the first batch through the module and the
#   loss **before** the first step, so a mistake raises at once and changes nothing:

try:
    model.fit(X, Y[:100], epochs=1, verbose=0)
except ValueError as e:
    print(e)

# %%
# ``evaluate`` returns the loss (and metrics) as a dict of Python floats, and ``predict`` the
# module's outputs for every row, in order, on the CPU:

print(model.evaluate(X, Y, verbose=0).keys())
print(model.predict(torch.tensor([[0.0], [1.0]]), verbose=0).shape)
# sphinx_gallery_start_ignore
assert list(model.evaluate(X, Y, verbose=0)) == ["loss"]
# sphinx_gallery_end_ignore

# %%
# Next: :doc:`../gallery/02_classifier` trains a real classifier with metrics, validation and a
# ``DataLoader``.
