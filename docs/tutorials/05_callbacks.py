"""
5. Callbacks
============

A callback is an object whose methods ``fit`` calls at fixed points of training: when it
begins and ends, at each epoch and each batch, after each backward pass. The stock callbacks
of :mod:`fitkit.callbacks` stop early, save checkpoints, resume a crashed run and write logs;
your own can do anything else. Hooks and their arguments are Keras's (0-based indices).

A small binary classification task, with a network large enough to over-fit it:
"""

import tempfile
from pathlib import Path

import torch
from torch import nn

import fitkit
from fitkit.callbacks import EMA, BackupAndRestore, Callback, CSVLogger, EarlyStopping, ModelCheckpoint, TensorBoard

torch.manual_seed(0)
x = torch.randn(600, 20)
w = torch.randn(20, 1)
y = (x @ w + 2.0 * torch.randn(600, 1) > 0).float()    # (N, 1) labels, noisy

def make_model():
    torch.manual_seed(1)                     # the same initial weights every time
    net = nn.Sequential(nn.Linear(20, 256), nn.ReLU(),
                        nn.Linear(256, 256), nn.ReLU(),
                        nn.Linear(256, 1))   # (B, 1) logits
    model = fitkit.Model(net)
    model.compile(optimizer=lambda params: torch.optim.Adam(params, lr=3e-3),
                  loss="bce_with_logits", metrics=["accuracy"])
    return model

tmp = Path(tempfile.mkdtemp())               # every file of this page goes here

# %%
# Early stopping
# --------------
#
# :class:`~fitkit.callbacks.EarlyStopping` watches a log key (``monitor``) and stops training
# when it has not improved for ``patience`` epochs. ``restore_best_weights=True`` puts back the
# weights of the best epoch at the end. ``mode="auto"`` knows that a loss should go down and an
# accuracy up.

model = make_model()
stop = EarlyStopping(monitor="val_loss", patience=3, restore_best_weights=True,
                     verbose=1)
history = model.fit(x, y, epochs=50, validation_split=0.25, callbacks=[stop],
                    verbose=2)
val_loss = history.history["val_loss"]
best_epoch = stop.best_epoch                       # 0-based: the weights the model holds now
# sphinx_gallery_start_ignore
assert best_epoch == val_loss.index(min(val_loss)) and stop.stopped_epoch == best_epoch + 3  # patience 3
# sphinx_gallery_end_ignore

# %%
# The learning curves, with the epoch whose weights were restored marked:

import matplotlib.pyplot as plt

figure = history.plot(keys=["loss", "accuracy"])
for ax in figure.axes:
    ax.axvline(best_epoch + 1, color="gray", linestyle="--", label=f"restored (epoch {best_epoch + 1})")
    ax.legend()
plt.figure(figure)
plt.show()

# %%
# The training loss keeps falling while the validation loss turned back up after its best epoch:
# the network started to learn the noise. The model now holds that epoch's weights, so evaluating on
# the validation part (the last 25% of the arrays, which ``validation_split`` takes before
# shuffling) gives the best epoch's ``val_loss`` again:

result = model.evaluate(x[450:], y[450:], verbose=0)
print(result["loss"], val_loss[best_epoch])
# sphinx_gallery_start_ignore
assert round(result["loss"], 4) == round(val_loss[best_epoch], 4)
# sphinx_gallery_end_ignore

# %%
# Three more rules stop at once, with Lightning's semantics: ``stopping_threshold`` (the
# monitor reached a target), ``divergence_threshold`` (it got worse than a limit: no point in
# waiting ``patience`` epochs) and ``check_finite`` (it became NaN or infinite).
# ``stop_reason`` says which rule stopped training:

model = make_model()
stop = EarlyStopping(monitor="val_loss", patience=10, divergence_threshold=0.5)
model.fit(x, y, epochs=50, validation_split=0.25, callbacks=[stop], verbose=0)
print(stop.stopped_epoch, stop.stop_reason)
# sphinx_gallery_start_ignore
assert stop.stop_reason.startswith("divergence_threshold")
# sphinx_gallery_end_ignore

# %%
# Checkpoints: the best ``k``
# ---------------------------
#
# :class:`~fitkit.callbacks.ModelCheckpoint` writes a file at the end of each epoch (or every
# ``save_freq`` batches). The path is a format string: ``{epoch}`` (1-based) and every log key
# format into it. ``save_top_k=2`` keeps exactly the two best files by ``monitor``;
# ``save_best_only=True`` keeps just the best one under a fixed name. ``save_weights_only=True``
# writes the module's state dict (``model.load_weights``); without it, the file is a full,
# resumable checkpoint (``model.load_checkpoint``). Every write is atomic: a crash during a
# write never leaves a half-written file under the final name.

model = make_model()
checkpoint = ModelCheckpoint(tmp / "ckpt" / "{epoch:02d}-{val_loss:.3f}.pt",
                             monitor="val_loss", save_top_k=2,
                             save_weights_only=True)
history = model.fit(x, y, epochs=6, validation_split=0.25,
                    callbacks=[checkpoint], verbose=0)
kept = sorted(p.name for p in (tmp / "ckpt").iterdir())
print(kept)
best_two = sorted(sorted(history.history["val_loss"])[:2])
# sphinx_gallery_start_ignore
assert len(kept) == 2 and sorted(float(name[3:-3]) for name in kept) == [round(v, 3) for v in best_two]
# sphinx_gallery_end_ignore

# %%
# Three more options come from Keras and Lightning: ``initial_value_threshold=v`` saves
# nothing until ``monitor`` beats ``v``; ``every_n_epochs=n`` decides only at epochs ``n``,
# ``2n``, ...; ``save_last=True`` also keeps ``last.pt`` next to the ranked files, a full
# checkpoint of the latest state, replaced at every save, from which a run can always resume.
#
# Crash-proof training
# --------------------
#
# :class:`~fitkit.callbacks.BackupAndRestore` saves the whole training state (weights,
# optimizer, scheduler, RNG states, history, the state of the other callbacks) to one file at
# the end of each epoch, or every ``save_freq`` batches. If ``fit`` dies, running the same
# ``fit`` again with the same backup folder continues where the backup was taken, and ends with
# **the same weights** as a run that never stopped.
#
# Here a callback pulls the plug at the end of the third epoch:

class PowerCut(Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("power cut")

backup = BackupAndRestore(tmp / "backup")
model = make_model()
try:
    model.fit(x, y, epochs=5, callbacks=[backup, PowerCut()], verbose=0)
except RuntimeError as error:
    print(error, "- left behind:", sorted(p.name for p in (tmp / "backup").iterdir()))
# sphinx_gallery_start_ignore
assert (tmp / "backup" / "backup.pt").exists()
# sphinx_gallery_end_ignore

# %%
# ``backup.pt`` is the newest backup; ``backup.prev.pt`` the one before it, kept in case the
# newest is damaged (a disk fault, a file cut short): ``fit`` then warns, naming both files, and
# resumes from the previous one.
#
# The same script, run again (a new process would do the same: everything needed is in the
# file) picks up at the epoch the backup holds:

model = make_model()
history = model.fit(x, y, epochs=5, callbacks=[backup], verbose=2)
print(history.epoch)                         # epochs 0 and 1 come from the backup

reference = make_model()                     # the same training, never interrupted
reference.fit(x, y, epochs=5, verbose=0)
same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                             reference.state_dict().values()))
print("same weights as the uninterrupted run:", same)
print("backup deleted after success:", not backup.path.exists())
# sphinx_gallery_start_ignore
assert history.epoch == [0, 1, 2, 3, 4] and same and not backup.path.exists()
# sphinx_gallery_end_ignore

# %%
# Done by hand, the same resume is ``model.load_checkpoint(path)``, which restores the full state
# and returns the epoch to continue from: pass it on, as in
# ``model.fit(x, y, epochs=5, initial_epoch=model.load_checkpoint(path))``. Without
# ``initial_epoch``, ``fit`` would count from epoch 0 again (the history would read
# ``[0, 1, 0, 1, 2]``).
#
# Use one backup folder per training job. ``save_freq=500`` backs up every 500 batches, for
# epochs that take hours.
#
# Your own callback
# -----------------
#
# Subclass :class:`~fitkit.callbacks.Callback` and override the hooks you need; hooks you do
# not override cost nothing. ``self.model`` is the :class:`fitkit.Model`. Callbacks run in list
# order, with the history and the progress bar last, and share one ``logs`` dict per event: a
# key a callback adds in ``on_epoch_end`` is printed, recorded in the history and written by
# the loggers like a built-in one.
#
# This one records the largest gradient norm of each epoch. ``on_backward_end`` runs after the
# backward pass and before the optimizer step (with mixed precision, after unscaling). It keeps
# the norms as tensors and reads them once per epoch: a ``.item()`` per step would make the CPU
# wait for the GPU at every step.

class MaxGradNorm(Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.norms = []

    def on_backward_end(self, batch):
        params = self.model.module.parameters()
        norms = [p.grad.norm() for p in params if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack(norms)))

    def on_epoch_end(self, epoch, logs=None):
        logs["grad_norm"] = torch.stack(self.norms).max().item()

# %%
# Logging: CSV and TensorBoard
# ----------------------------
#
# :class:`~fitkit.callbacks.CSVLogger` writes a row per epoch; :class:`~fitkit.callbacks.TensorBoard`
# writes scalars for ``tensorboard --logdir`` with ``torch.utils.tensorboard`` (the
# ``tensorboard`` extra, ``pip install ".[tensorboard]"``; no TensorFlow needed). Both see the custom key. Runs tracked in
# Weights & Biases take :class:`~fitkit.callbacks.WandbLogger` (the
# ``wandb`` extra; ``WANDB_MODE=offline`` needs no network), and MLflow
# :class:`~fitkit.callbacks.MLflowLogger` (:doc:`../tutorials/08_mlflow`):

model = make_model()
history = model.fit(x, y, epochs=3, verbose=2, callbacks=[
    MaxGradNorm(), CSVLogger(tmp / "log.csv"), TensorBoard(tmp / "tensorboard")])

print((tmp / "log.csv").read_text().splitlines()[0])
print(sorted(p.name for p in (tmp / "tensorboard").iterdir()))
# sphinx_gallery_start_ignore
assert "grad_norm" in history.history and "grad_norm" in (tmp / "log.csv").read_text().splitlines()[0]
# sphinx_gallery_end_ignore

# %%
# (With validation data, TensorBoard also writes a ``validation`` folder, so that the two
# curves of each key share one chart.) The layout is Keras': each validation (and each
# ``evaluate(callbacks=[board])``) also lands as ``evaluation_loss_vs_iterations`` at its
# optimizer step, ``write_steps_per_second=True`` adds ``epoch_steps_per_second`` and
# ``histogram_freq=n`` a histogram of every weight every ``n`` epochs:

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

model = make_model()
board = TensorBoard(tmp / "tensorboard2", histogram_freq=1, write_steps_per_second=True)
model.fit(x, y, epochs=2, validation_split=0.25, verbose=0, callbacks=[board])
events = EventAccumulator(str(tmp / "tensorboard2" / "validation"))
events.Reload()
print([(e.step, round(e.value, 4)) for e in events.Scalars("evaluation_loss_vs_iterations")])
# sphinx_gallery_start_ignore
assert [e.step for e in events.Scalars("evaluation_loss_vs_iterations")] == [15, 30]
# sphinx_gallery_end_ignore

# %%
#
# Validation every n epochs, and keys of your own
# -----------------------------------------------
#
# With ``validation_freq=2`` only every second epoch validates. Whether the running epoch did
# is :attr:`fitkit.Model.validated`, a state the training loop owns (``params["do_validation"]``
# says whether ``fit`` validates at all). The stock callbacks read it: a ``val_`` monitor skips
# the epochs without validation (they do not count towards ``patience``), and
# :class:`~fitkit.callbacks.CSVLogger` has the ``val_`` columns from the first row on, with
# ``NA`` where an epoch has no value, as in Keras:

class Watch(Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(epoch, self.model.validated)

model = make_model()
history = model.fit(x, y, epochs=4, validation_split=0.25, validation_freq=2, verbose=0,
                    callbacks=[Watch(), CSVLogger(tmp / "every2.csv")])
print((tmp / "every2.csv").read_text())
# sphinx_gallery_start_ignore
assert (tmp / "every2.csv").read_text().splitlines()[1].endswith(",NA,NA")  # epoch 1: no validation
# sphinx_gallery_end_ignore

# %%
# The columns are the keys ``fit`` plans to log (``params["metrics"]``) plus those a callback
# adds in the first epoch, in sorted order; a resumed or appended run keeps the file's columns.
#
# A callback may score a held-out set of its own and log it under a ``val_`` name, a common
# Keras pattern; the monitors take it like any other key, without ``validation_data``. Put it
# before the callbacks that read it:

x_fit, y_fit, x_hold, y_hold = x[:450], y[:450], x[450:], y[450:]

class HeldOutF1(Callback):
    def on_epoch_end(self, epoch, logs=None):
        predicted = self.model.predict(x_hold, verbose=0) > 0     # (N, 1) bool
        true_positives = (predicted & (y_hold > 0)).sum().item()
        logs["val_f1"] = 2 * true_positives / (predicted.sum().item() + (y_hold > 0).sum().item())

stop = EarlyStopping(monitor="val_f1", mode="max", patience=2)
history = make_model().fit(x_fit, y_fit, epochs=20, callbacks=[HeldOutF1(), stop], verbose=0)
print(len(history.epoch), stop.stop_reason)
# sphinx_gallery_start_ignore
assert stop.stop_reason.startswith("patience: val_f1")
# sphinx_gallery_end_ignore

# %%
# A monitor that no log will hold is an error before the first step, so a typo costs no
# training: without a callback that may add keys (any callback that is not one of fitkit's
# stock ones, or a ``LambdaCallback``), the monitor must be one of the planned keys. A
# ``ModelCheckpoint`` with an int ``save_freq`` decides on batch logs, which hold only the
# running ``loss`` and metrics: a ``val_`` monitor there is refused the same way.

try:
    make_model().fit(x, y, epochs=3, validation_split=0.25, verbose=0,
                     callbacks=[EarlyStopping(monitor="val_acc")])
except ValueError as error:
    print(error)
    # sphinx_gallery_start_ignore
    assert "EarlyStopping monitors 'val_acc'" in str(error)
    # sphinx_gallery_end_ignore

# %%
# A NaN value is never the best for :class:`~fitkit.callbacks.EarlyStopping`,
# :class:`~fitkit.callbacks.ModelCheckpoint` or :class:`~fitkit.callbacks.ReduceLROnPlateau`:
# it counts as an epoch without improvement.
#
# Averaged weights: EMA and SWA
# -----------------------------
#
# The weights at the end of training wander with the last batches' noise; an average of the
# recent weights usually generalizes a little better and gives steadier validation curves.
# :class:`~fitkit.callbacks.EMA` keeps an exponential moving average of the weights, updated
# after every optimizer step (``torch.optim.swa_utils.AveragedModel``). With
# ``evaluate_with_ema=True`` (the default) validation runs on the average, while training
# continues on the weights themselves, untouched; ``swap_at_end=True`` leaves the average in
# the module when ``fit`` ends. The average is saved in checkpoints and resumes exactly.

plain = make_model()
plain_history = plain.fit(x, y, epochs=6, validation_split=0.25, verbose=0)

model = make_model()
ema = EMA(decay=0.9)                    # about the last 10 steps
history = model.fit(x, y, epochs=6, validation_split=0.25, callbacks=[ema], verbose=0)
for epoch, (a, b) in enumerate(zip(plain_history.history["val_loss"],
                                   history.history["val_loss"]), 1):
    print(f"epoch {epoch}: val_loss {a:.2f} -> with EMA {b:.2f}")
# sphinx_gallery_start_ignore
assert history.history["val_loss"] != plain_history.history["val_loss"]
# sphinx_gallery_end_ignore

# %%
# The average lags at first (epoch 1 still remembers the initial weights), then moves less
# from epoch to epoch than the weights themselves do. ``ema.averaged_model.module`` is a
# module holding the averaged weights, ready for ``fitkit.Model(...).predict``.
#
# :class:`~fitkit.callbacks.SWA` is stochastic weight averaging (Lightning's
# ``StochasticWeightAveraging``): from ``swa_epoch_start`` on, ``SWALR`` anneals the learning
# rate to ``swa_lrs``, the weights at the end of each epoch join an equal-weight average, and
# at the end the average replaces the weights and BatchNorm statistics are recomputed over the
# training data.
#
# Both are :class:`~fitkit.callbacks.WeightAveraging` callbacks (Lightning's
# ``WeightAveraging``): one base whose ``should_update(step_idx, epoch_idx)`` decides when the
# weights join the average, with ``update_every_n_steps``, ``update_starting_at_step`` and
# ``update_starting_at_epoch`` for the usual schedules, and a user ``avg_fn`` /
# ``multi_avg_fn`` (torch's ``AveragedModel`` signatures) for another average. The count of
# updates is kept on the host too, so an update never waits for the GPU. Keras' forms work as
# in Keras: ``compile(use_ema=True, ema_momentum=0.99)`` keeps the optimizer's EMA and puts it
# in the module when ``fit`` ends, and :class:`~fitkit.callbacks.SwapEMAWeights` validates on it
# (``swap_on_epoch=True``: also at each epoch end, for the callbacks after it).
#
# Averaging callbacks combine, with one rule: a validation scores one set of weights and the
# module ends ``fit`` with one, so at most one of them validates on its average and at most one
# swaps it in at the end (``evaluate_with_ema=False`` / ``swap_at_end=False`` on the others);
# ``fit`` refuses more before the first step, naming both. They share one swap of the weights,
# so training always continues from the training weights, however many averages are kept.
#
# When validation runs on the EMA, the best ``val_loss`` was scored on the EMA weights, so
# those are the weights ``EarlyStopping(restore_best_weights=True)`` puts back and
# ``ModelCheckpoint(save_best_only=True)`` writes (a full checkpoint also carries the training
# weights, in the EMA's state, so it still resumes exactly):

model = make_model()
stop = EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
history = model.fit(x, y, epochs=6, validation_split=0.25, verbose=0,
                    callbacks=[EMA(decay=0.9), stop])
again = model.evaluate(x[450:], y[450:], verbose=0)["loss"]
print(f"best {min(history.history['val_loss']):.4f}, after the restore {again:.4f}")
# sphinx_gallery_start_ignore
assert round(again, 4) == round(min(history.history["val_loss"]), 4)
# sphinx_gallery_end_ignore

# %%
# Finding a learning rate
# -----------------------
#
# :meth:`fitkit.Model.find_lr` runs the learning-rate range test of fastai's ``lr_find`` and
# Lightning's ``Tuner.lr_find``: a hundred optimizer steps, the learning rate growing
# exponentially from ``1e-7`` to ``10``, the smoothed loss recorded until it diverges. The
# suggestion is where the loss falls fastest. The sweep trains for real, then puts everything
# back: weights, optimizer state, scheduler, RNG states.

model = make_model()
before = [p.clone() for p in model.module.parameters()]
result = model.find_lr(x, y)
print(len(result.lrs), f"suggestion: {result.suggestion:.1e}")
untouched = all(torch.equal(a, b) for a, b in zip(before, model.module.parameters()))
print("weights untouched:", untouched)
# sphinx_gallery_start_ignore
assert untouched and 1e-3 < result.suggestion < 1e-1
# sphinx_gallery_end_ignore

# %%
# ``result.plot()`` draws the smoothed loss against the learning rate (log scale), the
# suggestion in red (``path=`` saves it as a PNG too):

figure = result.plot()
plt.show()

# %%
# Here it suggests about ``1e-2``, a few times the ``3e-3`` this page trains with. Start from
# the suggestion or a little below it (it marks the steepest fall, not the minimum).
#
# ``find_lr(..., apply=True)`` also sets the suggestion as the learning rate (every parameter
# group, their ratios kept, and a scheduler's ``base_lrs``); ``mode="linear"`` sweeps evenly
# instead of exponentially. :class:`~fitkit.callbacks.LearningRateFinder` does the same at the
# start of ``fit``, over its training batches, and then trains at the rate found:

from fitkit.callbacks import LearningRateFinder

model = make_model()
finder = LearningRateFinder(num_steps=50)
history = model.fit(x, y, epochs=1, callbacks=[finder], verbose=0)
print(model.optimizer.param_groups[0]["lr"] == finder.result.suggestion,
      len(finder.result.lrs) <= 50)
# sphinx_gallery_start_ignore
assert model.optimizer.param_groups[0]["lr"] == finder.result.suggestion and len(finder.result.lrs) <= 50
# sphinx_gallery_end_ignore

# %%
# Throughput and profiling
# ------------------------
#
# :class:`~fitkit.callbacks.ThroughputMonitor` (Lightning's) adds the training speed to the
# epoch logs, so the history, the CSV file and TensorBoard get it like any other key: samples
# and batches per second (validation time left out), tokens per second for token batches (an
# integer ``(B, T)`` input), the model's FLOPs per step, counted once on the first batch with
# ``torch.utils.flop_counter.FlopCounterMode``, and the MFU when the device's peak FLOP/s is
# known (a table of common GPUs, or ``peak_flops=``). It reads the clock only at epoch ends
# (and every ``log_every_n_steps`` batches if asked), so no step waits for the GPU.

from fitkit.callbacks import ThroughputMonitor

model = make_model()
history = model.fit(x, y, epochs=1, verbose=0, callbacks=[ThroughputMonitor(peak_flops=1e12)])
print(sorted(k for k in history.history if k.startswith("throughput/")))
print(history.history["throughput/flops_per_step"])
# sphinx_gallery_start_ignore
assert history.history["throughput/flops_per_step"] == [2 * 32 * 70_912 * 2 + 2 * 32 * 65_792]
# sphinx_gallery_end_ignore

# %%
# With ``log_every_n_steps=4`` the same keys go into the batch logs every 4 batches as well, so
# a callback (or the progress bar, or TensorBoard) sees the speed as the run goes. A window
# starts afresh each epoch, so 3 epochs of 19 batches give 4 windows each, 12 in all; the first
# holds the warm-up and the FLOP count.

speeds = []
watch = fitkit.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: speeds.append(
    float(logs["throughput/samples_per_sec"])) if "throughput/samples_per_sec" in logs else None)
model = make_model()
model.fit(x, y, epochs=3, verbose=0, callbacks=[ThroughputMonitor(log_every_n_steps=4), watch])
fig, ax = plt.subplots(figsize=(6, 3), layout="constrained")  # labels uncut
ax.plot(range(1, len(speeds) + 1), speeds, marker="o")
ax.set_xlabel("window of 4 batches (3 epochs)")
ax.set_ylabel("samples / s (last 4 batches)")
ax.set_ylim(bottom=0)
ax.set_title("ThroughputMonitor(log_every_n_steps=4)")
plt.show()
print(len(speeds))
# sphinx_gallery_start_ignore
assert len(speeds) == 12 and all(v > 0 for v in speeds)
# sphinx_gallery_end_ignore

# %%
# A step of 32 rows through the 70,912 weights of the three ``Linear`` layers costs
# ``2 * 32 * 70,912`` FLOPs forward, as much again for the weight gradients, and
# ``2 * 32 * 65,792`` for the input gradients of the last two layers (the first one's input
# needs none).
#
# :class:`~fitkit.callbacks.Profiler` runs ``torch.profiler`` over a schedule of optimizer
# steps (``wait`` idle, ``warmup`` traced and dropped, ``active`` recorded, ``repeat`` cycles),
# writes a trace per cycle (TensorBoard's profiler plugin, or a Chrome trace for
# ``chrome://tracing`` and Perfetto) and prints the operators that took the most time when
# ``fit`` ends, like Keras' ``TensorBoard(profile_batch=...)``:

from fitkit.callbacks import Profiler

model = make_model()
profiler = Profiler(tmp / "profile", wait=1, warmup=1, active=2, trace="chrome", verbose=0)
model.fit(x[:256], y[:256], epochs=1, verbose=0, callbacks=[profiler])
print(len(profiler.traces), "aten::addmm" in profiler.table)
# sphinx_gallery_start_ignore
assert len(profiler.traces) == 1 and "aten::addmm" in profiler.table
# sphinx_gallery_end_ignore

# %%
#
# Other stock callbacks: :class:`~fitkit.callbacks.ReduceLROnPlateau`,
# :class:`~fitkit.callbacks.LearningRateScheduler`, :class:`~fitkit.callbacks.TerminateOnNaN`
# and :class:`~fitkit.callbacks.LambdaCallback` (hooks from plain functions); see
# :mod:`fitkit.callbacks`.

# sphinx_gallery_start_ignore
import shutil

shutil.rmtree(tmp, ignore_errors=True)
# sphinx_gallery_end_ignore
