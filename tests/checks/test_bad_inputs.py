"""A sweep of bad inputs: each raises a clear error before step 1, with nothing changed.

Every case runs against a compiled classifier whose Adam optimizer already holds state (one
``train_on_batch``). After the error: every tensor of the module, the optimizer's state and
param groups, the scheduler and the step count are as before, and no file appeared under
``tmp_path``. The message names the argument or the fix.
"""

from __future__ import annotations

import copy
import itertools
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import (
    EMA,
    SWA,
    BackupAndRestore,
    CSVLogger,
    EarlyStopping,
    LambdaCallback,
    LearningRateScheduler,
    ModelCheckpoint,
    ProgressBar,
    ReduceLROnPlateau,
    TensorBoard,
    TerminateOnNaN,
    ThroughputMonitor,
    Timer,
    WeightAveraging,
)
from fitkit.files import atomic_save
from fitkit.layers import GPT
from fitkit.tools.batch_size_finder import find_batch_size
from fitkit.tools.export import export
from fitkit.tools.lr_finder import find_lr

N, FEATURES, CLASSES = 20, 4, 3


def _x(n: int = N, features: int = FEATURES, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, features, generator=torch.Generator().manual_seed(n + features)).to(dtype)


def _y(n: int = N, hi: int = CLASSES) -> torch.Tensor:
    return torch.arange(n) % hi


def _with(t: torch.Tensor, index: tuple, value: float) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def _loader(x, y, batch_size=5):
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


@dataclass
class Case:
    id: str
    call: Callable[[fitkit.Model, Any], Any]
    error: type[Exception]
    match: str  # names the argument or the fix
    setup: Callable[[fitkit.Model, Any], Any] | None = None
    scheduler: bool = True  # the model has a compiled scheduler
    gap: str | None = None  # why this one is not caught yet (an expected failure)


def fit(**kwargs):
    kwargs = {"x": _x(), "y": _y(), "epochs": 2, "batch_size": 5, "verbose": 0, **kwargs}
    return lambda model, tmp: model.fit(**kwargs)


def fit_cb(make_callback, **kwargs):
    """fit with a callback built from tmp_path (built inside the call, as a user would)."""
    kwargs = {"x": _x(), "y": _y(), "epochs": 2, "batch_size": 5, "verbose": 0, **kwargs}
    return lambda model, tmp: model.fit(callbacks=[make_callback(tmp)], **kwargs)


def evaluate(*args, **kwargs):
    kwargs = {"verbose": 0, **kwargs}
    return lambda model, tmp: model.evaluate(*args, **kwargs)


def predict(*args, **kwargs):
    kwargs = {"verbose": 0, **kwargs}
    return lambda model, tmp: model.predict(*args, **kwargs)


def compile_(**kwargs):
    kwargs = {"optimizer": "adam", "loss": "cross_entropy", **kwargs}
    return lambda model, tmp: model.compile(**kwargs)


def build(factory):
    return lambda model, tmp: factory(tmp)


def _mkdir(name):
    return lambda model, tmp: (tmp / name).mkdir()


def _file(name, data=b""):
    return lambda model, tmp: (tmp / name).write_bytes(data)


def _other_weights(name, module):
    return lambda model, tmp: torch.save(module.state_dict(), tmp / name)


def _sgd_checkpoint(name):
    def setup(model, tmp):
        other = fitkit.Model(nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, CLASSES)), device="cpu")
        other.compile(optimizer="sgd", loss="cross_entropy")
        other.save_checkpoint(tmp / name)

    return setup


def _evil_pickle(name):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    return lambda model, tmp: torch.save({"w": Evil()}, tmp / name)


class _Samples(torch.utils.data.Dataset):
    """A map-style Dataset of ``n`` samples; sample ``ragged_at`` has one feature more."""

    def __init__(self, n=N, ragged_at=None):
        self.n, self.ragged_at = n, ragged_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return _x(self.n)[i, :] if i != self.ragged_at else torch.zeros(FEATURES + 1), _y(self.n)[i]


def _recompile(**kwargs):
    kwargs = {"optimizer": "adam", "loss": "cross_entropy", **kwargs}
    return lambda model, tmp: model.compile(**kwargs)


def _crafted_group(name, **changes):
    """A checkpoint whose optimizer's first parameter group is changed (checksum recomputed)."""

    def setup(model, tmp):
        model.save_checkpoint(tmp / name)
        state = torch.load(tmp / name, weights_only=True)
        state["optimizer"]["param_groups"][0].update(changes)
        atomic_save(state, tmp / name)

    return setup


# StepLR(step_size=1, gamma=0.5)'s state as torch has it inside step() only
_SCHEDULER_IN_STEP = {
    "step_size": 1,
    "gamma": 0.5,
    "base_lrs": [0.001],
    "last_epoch": 0,
    "_step_count": 1,
    "_is_initial": True,
    "_get_lr_called_within_step": False,
    "_last_lr": [0.001],
}


def _crafted_checkpoint(name, **changes):
    def setup(model, tmp):
        model.save_checkpoint(tmp / name)
        state = torch.load(tmp / name, weights_only=True)
        state.update(changes)
        atomic_save(state, tmp / name)  # the checksum is recomputed: only the content is wrong

    return setup


def _link(name, target):
    def setup(model, tmp):
        (tmp / target).write_text("not mine\n")
        (tmp / name).symlink_to(tmp / target)

    return setup


def _weights_with_bad_aliases(name):
    def setup(model, tmp):
        import safetensors.torch

        state = {k: v.contiguous() for k, v in model.module.state_dict().items()}
        safetensors.torch.save_file(state, tmp / name, metadata={"fitkit_aliases": "{oops"})

    return setup


def _empty_source():
    return _loader(_x(0), _y(0))


def _four_tuples():
    yield _x(5), _y(5), torch.ones(5), torch.ones(5)


CASES = [
    # -- fit: types ----------------------------------------------------------------------------
    Case("fit x None", fit(x=None), ValueError, "needs data.*Fix"),
    Case("fit x str", fit(x="data.csv", y=None), TypeError, "Expected `x`"),
    Case("fit x int", fit(x=5, y=None), TypeError, "Expected `x`"),
    Case("fit y list of ints", fit(y=[0, 1] * 10), TypeError, "Expected `y`.*Fix"),
    Case("fit batch_size 0", fit(batch_size=0), ValueError, "batch_size"),
    Case("fit batch_size float", fit(batch_size=2.5), TypeError, "batch_size"),
    Case("fit batch_size str", fit(batch_size="32"), TypeError, "batch_size"),
    Case("fit epochs -1", fit(epochs=-1), ValueError, "epochs"),
    Case("fit epochs str", fit(epochs="2"), TypeError, "epochs"),  # a float is a fraction of an epoch
    Case("fit epochs nan", fit(epochs=float("nan")), ValueError, "epochs"),
    Case("fit initial_epoch -1", fit(initial_epoch=-1), ValueError, "initial_epoch"),
    Case("fit steps_per_epoch 0", fit(steps_per_epoch=0), ValueError, "steps_per_epoch"),
    Case("fit validation_steps 0", fit(validation_steps=0), ValueError, "validation_steps"),
    Case("fit validation_batch_size 0", fit(validation_batch_size=0), ValueError, "validation_batch_size"),
    Case("fit validation_split 1", fit(validation_split=1.0), ValueError, "validation_split"),
    Case("fit validation_split -0.1", fit(validation_split=-0.1), ValueError, "validation_split"),
    Case("fit validation_split bool", fit(validation_split=True), TypeError, "validation_split"),
    Case("fit validation_freq 0", fit(validation_freq=0), ValueError, "validation_freq"),
    Case("fit validation_freq [0]", fit(validation_freq=[0]), ValueError, "validation_freq"),
    Case("fit shuffle str", fit(shuffle="yes"), TypeError, "shuffle"),
    Case("fit verbose 5", fit(verbose=5), ValueError, "verbose"),
    Case("fit callbacks object", fit(callbacks=[object()]), TypeError, "Callback.*Fix"),
    Case("fit callbacks not a list", fit(callbacks=LambdaCallback()), TypeError, "callbacks.*Fix"),
    # -- fit: values, shapes, dtypes, labels, lengths, NaN ------------------------------------------
    Case(
        "fit wrong feature count",
        fit(x=_x(features=5)),
        ValueError,
        r"forward: RuntimeError: mat1 and mat2.*fed x: float32 \(5, 5\).*Fix",
    ),
    Case("fit integer x", fit(x=_x().long()), ValueError, r"forward.*x: int64 \(5, 4\).*Fix"),
    Case("fit x 3-D", fit(x=_x().reshape(N, 2, 2)), ValueError, "forward.*Fix"),
    Case("fit label above range", fit(y=_with(_y(), (7,), 5)), ValueError, r"Class labels must lie in \[0, 2\].*Fix"),
    Case("fit negative label", fit(y=_with(_y(), (3,), -1)), ValueError, r"labels from -1 to 2.*Fix"),
    Case(
        "fit y one-hot of 2 for 3 classes",
        fit(y=torch.zeros(N, 2)),
        ValueError,
        r"Loss 'cross_entropy' expects integer class indices.*shape \(5, 2\).*Fix",
    ),
    Case("fit y (N, 1) labels", fit(y=_y().unsqueeze(1)), ValueError, "Fix"),
    Case("fit x y lengths", fit(y=_y(N - 1)), ValueError, "same number of samples.*Fix"),
    Case("fit x 0-dim", fit(x=torch.tensor(1.0), y=None), ValueError, "batch dimension.*Fix"),
    Case("fit x empty", fit(x=_x(0), y=_y(0)), ValueError, "0 samples.*Fix"),
    Case("fit x tuple lengths", fit(x=(_x(), _x(N - 2))), ValueError, "same length"),
    Case("fit x dict wrong key", fit(x={"inputs": _x()}), ValueError, "forward.*Fix"),
    Case("fit x NaN", fit(x=_with(_x(), (4, 1), float("nan"))), ValueError, r"1 NaN.*first at row 4.*Fix"),
    Case(
        "fit x inf",
        fit(x=_with(_with(_x(), (9, 0), float("inf")), (12, 2), -float("inf"))),
        ValueError,
        r"`x` holds 2 NaN or infinite values \(first at row 9\)",
    ),
    Case(
        "fit x NaN numpy",
        fit(x=_with(_x(), (2, 0), float("nan")).numpy().astype(np.float64)),
        ValueError,
        "first at row 2",
    ),
    Case(
        "fit y float NaN",
        fit(y=_with(torch.eye(CLASSES)[_y()], (6, 0), float("nan"))),
        ValueError,
        r"`y` holds 1 NaN.*first at row 6",
    ),
    Case(
        "fit validation NaN",
        fit(validation_data=(_with(_x(6), (5, 3), float("nan")), _y(6))),
        ValueError,
        "first at row 5",
    ),
    Case("fit validation wrong features", fit(validation_data=(_x(6, 5), _y(6))), ValueError, "forward.*Fix"),
    Case(
        "fit validation label range",
        fit(validation_data=(_x(6), _with(_y(6), (0,), 9))),
        ValueError,
        "Class labels.*Fix",
    ),
    Case(
        "fit validation 4-tuple",
        fit(validation_data=(_x(6), _y(6), torch.ones(6), torch.ones(6))),
        ValueError,
        "validation_data",
    ),
    Case("fit validation str", fit(validation_data="val.csv"), TypeError, "Expected `validation_data`"),
    Case("fit validation (x,) with a loss", fit(validation_data=(_x(6),)), ValueError, "Fix"),
    # -- fit: weights ----------------------------------------------------------------------------
    Case(
        "fit sample_weight negative",
        fit(sample_weight=_with(torch.ones(N), (3,), -0.5)),
        ValueError,
        r"`sample_weight` must be >= 0.*index 3.*Fix",
    ),
    Case(
        "fit sample_weight NaN",
        fit(sample_weight=_with(torch.ones(N), (8,), float("nan"))),
        ValueError,
        r"`sample_weight` holds 1 NaN.*first at row 8",
    ),
    Case("fit sample_weight 2-D", fit(sample_weight=torch.ones(N, 2)), ValueError, "sample_weight.*Fix"),
    Case("fit sample_weight length", fit(sample_weight=torch.ones(N - 3)), ValueError, "same number of samples"),
    Case("fit class_weight list", fit(class_weight=[1.0, 2.0]), TypeError, "class_weight"),
    Case("fit class_weight negative key", fit(class_weight={-1: 1.0}), ValueError, "class_weight"),
    Case("fit class_weight str value", fit(class_weight={0: "a"}), TypeError, "class_weight"),
    Case("fit class_weight missing class", fit(class_weight={0: 1.0, 1: 2.0}), ValueError, "no entry for class 2.*Fix"),
    Case(
        "fit class_weight continuous",
        fit(y=torch.randn(N, CLASSES), class_weight={0: 1.0}),
        ValueError,
        "continuous.*Fix",
    ),
    Case(
        "fit class_weight negative weight",
        fit(class_weight={0: 1.0, 1: -1.0, 2: 1.0}),
        ValueError,
        r"`class_weight\[1\]` to be a finite number >= 0.*Fix",
    ),
    Case(
        "fit class_weight NaN weight",
        fit(class_weight={0: 1.0, 1: float("nan"), 2: 1.0}),
        ValueError,
        r"`class_weight\[1\]`",
    ),
    # -- fit: other sources -----------------------------------------------------------------------
    Case("fit y with a DataLoader", fit(x=_loader(_x(), _y()), y=_y()), ValueError, "`y` must be None.*Fix"),
    Case(
        "fit sample_weight with a DataLoader",
        fit(x=_loader(_x(), _y()), y=None, sample_weight=torch.ones(N)),
        ValueError,
        "sample_weight.*Fix",
    ),
    Case(
        "fit validation_split with a DataLoader",
        fit(x=_loader(_x(), _y()), y=None, validation_split=0.2),
        ValueError,
        "validation_split.*Fix",
    ),
    Case("fit empty DataLoader", fit(x=_empty_source(), y=None), ValueError, "(yielded no batch|has 0 batches).*Fix"),
    Case("fit batches of 4 elements", fit(x=_four_tuples(), y=None), ValueError, "4 elements"),
    Case(
        "fit DataLoader wrong features",
        fit(x=_loader(_x(features=5), _y()), y=None),
        ValueError,
        r"first training batch failed in the module's forward: RuntimeError: mat1 and mat2.*x: float32 \(5, 5\).*Fix",
    ),
    Case(
        "fit DataLoader label range",
        fit(x=_loader(_x(), _with(_y(), (1,), 7)), y=None),
        ValueError,
        r"class label outside \[0, 2\].*Target 7.*Fix",
    ),
    Case(
        "fit list of float64 batches",
        fit(x=[(_x(dtype=torch.float64), _y())], y=None),
        ValueError,
        "first training batch.*Fix: the module's parameters are float32 and x is float64",
    ),
    # -- evaluate / predict -------------------------------------------------------------------------
    Case("evaluate batch_size 0", evaluate(_x(), _y(), batch_size=0), ValueError, "batch_size"),
    Case("evaluate steps 0", evaluate(_x(), _y(), steps=0), ValueError, "steps"),
    Case("evaluate wrong features", evaluate(_x(features=2), _y()), ValueError, "forward.*Fix"),
    Case("evaluate label range", evaluate(_x(), _with(_y(), (0,), 3)), ValueError, "Class labels.*Fix"),
    Case("evaluate NaN", evaluate(_with(_x(), (1, 1), float("nan")), _y()), ValueError, "first at row 1"),
    Case("evaluate no y", evaluate(_x()), ValueError, "Fix"),
    Case(
        "evaluate sample_weight length",
        evaluate(_x(), _y(), sample_weight=torch.ones(3)),
        ValueError,
        "same number of samples",
    ),
    Case("predict batch_size -1", predict(_x(), batch_size=-1), ValueError, "batch_size"),
    Case("predict steps 0", predict(_x(), steps=0), ValueError, "steps"),
    Case("predict x str", predict("x.npy"), TypeError, "Expected `x`"),
    Case("predict verbose loud", predict(_x(), verbose="loud"), ValueError, "verbose"),
    Case("predict wrong features", predict(_x(features=6)), ValueError, "forward.*Fix"),
    Case("predict x int", predict(7), TypeError, "Expected `x`"),
    # -- compile -----------------------------------------------------------------------------------
    Case("compile optimizer name", compile_(optimizer="adamx"), ValueError, "optimizer"),
    Case("compile optimizer int", compile_(optimizer=5), TypeError, "optimizer"),
    Case("compile loss name", compile_(loss="cross_entropyy"), ValueError, "loss"),
    Case("compile loss int", compile_(loss=5), TypeError, "loss"),
    Case("compile metric name", compile_(metrics=["acuracy"]), ValueError, "metric"),
    Case("compile scheduler_interval", compile_(scheduler_interval="minute"), ValueError, "scheduler_interval"),
    Case("compile precision", compile_(precision="8"), ValueError, "precision"),
    Case("compile accumulation 0", compile_(gradient_accumulation_steps=0), ValueError, "gradient_accumulation_steps"),
    Case("compile jit_compile", compile_(jit_compile="maybe"), TypeError, "jit_compile"),
    Case("compile scheduler int", compile_(scheduler=5), TypeError, "scheduler"),
    Case(
        "compile optimizer of other params",
        compile_(optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)),
        ValueError,
        "optimizer.*Fix",
    ),
    # -- callbacks: paths, monitors, schedules ------------------------------------------------------
    Case(
        "ModelCheckpoint path is a folder",
        build(lambda tmp: ModelCheckpoint(tmp / "ckpt.pt")),
        ValueError,
        "existing folder.*Fix",
        setup=_mkdir("ckpt.pt"),
    ),
    Case("ModelCheckpoint filepath int", build(lambda tmp: ModelCheckpoint(5)), TypeError, "filepath"),
    Case("ModelCheckpoint mode", build(lambda tmp: ModelCheckpoint(tmp / "m.pt", mode="up")), ValueError, "mode"),
    Case(
        "ModelCheckpoint save_freq 0",
        build(lambda tmp: ModelCheckpoint(tmp / "m.pt", save_freq=0)),
        ValueError,
        "save_freq",
    ),
    Case(
        "ModelCheckpoint {val_acc} placeholder",
        fit_cb(lambda tmp: ModelCheckpoint(tmp / "m{val_acc:.2f}.pt")),
        ValueError,
        "val_acc",
    ),
    # The monitor is read only when it ranks files (save_best_only / save_top_k), as in Keras.
    Case(
        "ModelCheckpoint monitor never logged",
        fit_cb(lambda tmp: ModelCheckpoint(tmp / "m.pt", monitor="val_acc", save_best_only=True)),
        ValueError,
        "val_acc",
    ),
    Case(
        "ModelCheckpoint under a file",
        fit_cb(lambda tmp: ModelCheckpoint(tmp / "afile" / "m.pt")),
        ValueError,
        "afile",
        setup=_file("afile"),
    ),
    Case(
        "CSVLogger file is a folder",
        build(lambda tmp: CSVLogger(tmp / "log.csv")),
        ValueError,
        "existing folder.*Fix",
        setup=_mkdir("log.csv"),
    ),
    Case(
        "BackupAndRestore dir is a file",
        build(lambda tmp: BackupAndRestore(tmp / "bk")),
        ValueError,
        "existing file.*Fix",
        setup=_file("bk"),
    ),
    Case(
        "BackupAndRestore save_freq",
        build(lambda tmp: BackupAndRestore(tmp / "b", save_freq="batch")),
        ValueError,
        "save_freq",
    ),
    Case(
        "BackupAndRestore dir under a file",
        fit_cb(lambda tmp: BackupAndRestore(tmp / "afile" / "bk")),
        ValueError,
        "afile",
        setup=_file("afile"),
    ),
    Case(
        "TensorBoard log_dir is a file",
        build(lambda tmp: TensorBoard(tmp / "tb")),
        ValueError,
        "log_dir",
        setup=_file("tb"),
    ),
    Case(
        "TensorBoard update_freq 0",
        build(lambda tmp: TensorBoard(tmp / "tb", update_freq=0)),
        ValueError,
        "update_freq",
    ),
    Case("EarlyStopping patience -1", build(lambda tmp: EarlyStopping(patience=-1)), ValueError, "patience"),
    Case(
        "EarlyStopping monitor never logged",
        fit_cb(lambda tmp: EarlyStopping(monitor="val_accuracy")),
        ValueError,
        "val_accuracy",
    ),
    Case("ReduceLROnPlateau factor 1.5", build(lambda tmp: ReduceLROnPlateau(factor=1.5)), ValueError, "factor"),
    Case("LearningRateScheduler int", build(lambda tmp: LearningRateScheduler(5)), TypeError, "schedule"),
    Case(
        "LearningRateScheduler and a compiled scheduler",
        fit_cb(lambda tmp: LearningRateScheduler(lambda e, lr: lr)),
        ValueError,
        "would both set the learning rate.*Fix",
    ),
    Case(
        "LearningRateScheduler returns str",
        fit_cb(lambda tmp: LearningRateScheduler(lambda epoch, lr: "fast")),
        TypeError,
        "schedule",
        scheduler=False,
    ),
    Case(
        "LearningRateScheduler returns -1",
        fit_cb(lambda tmp: LearningRateScheduler(lambda epoch, lr: -1.0)),
        ValueError,
        "schedule",
        scheduler=False,
    ),
    Case(
        "ReduceLROnPlateau and a compiled scheduler",
        fit_cb(lambda tmp: ReduceLROnPlateau()),
        ValueError,
        "would both set the learning rate",
    ),
    Case(
        "LambdaCallback unknown hook",
        build(lambda tmp: LambdaCallback(on_epoch_ends=print)),
        TypeError,
        "on_epoch_ends",
    ),
    # -- load -------------------------------------------------------------------------------------
    Case("load_weights missing file", lambda m, tmp: m.load_weights(tmp / "nope.pt"), FileNotFoundError, "nope.pt"),
    Case("load_weights path int", lambda m, tmp: m.load_weights(5), TypeError, "path"),
    Case(
        "load_weights folder",
        lambda m, tmp: m.load_weights(tmp / "d"),
        IsADirectoryError,
        "is a folder.*Fix",
        setup=_mkdir("d"),
    ),
    Case(
        "load_weights empty file",
        lambda m, tmp: m.load_weights(tmp / "e.pt"),
        ValueError,
        "empty.*Fix",
        setup=_file("e.pt"),
    ),
    Case(
        "load_weights text file",
        lambda m, tmp: m.load_weights(tmp / "t.pt"),
        ValueError,
        "t.pt.*Fix",
        setup=_file("t.pt", b"epoch,loss\n0,1.0\n"),
    ),
    Case(
        "load_weights random bytes",
        lambda m, tmp: m.load_weights(tmp / "r.pt"),
        ValueError,
        "r.pt.*Fix",
        setup=_file("r.pt", bytes(range(256)) * 8),
    ),
    Case(
        "load_weights 5-class head",
        lambda m, tmp: m.load_weights(tmp / "h.pt"),
        ValueError,
        "does not fit this model.*Fix",
        setup=_other_weights("h.pt", nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 5))),
    ),
    Case(
        "load_weights extra key",
        lambda m, tmp: m.load_weights(tmp / "x.pt"),
        ValueError,
        "does not fit",
        setup=_other_weights(
            "x.pt", nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, CLASSES), nn.Linear(CLASSES, 1))
        ),
    ),
    Case(
        "load_weights code pickle",
        lambda m, tmp: m.load_weights(tmp / "evil.pt"),
        RuntimeError,
        "Refused.*Fix",
        setup=_evil_pickle("evil.pt"),
    ),
    Case(
        "load_checkpoint of weights",
        lambda m, tmp: m.load_checkpoint(tmp / "w.pt"),
        ValueError,
        "not a fitkit checkpoint.*Fix",
        setup=lambda m, tmp: m.save_weights(tmp / "w.pt"),
    ),
    # -- files: templates, names, links, locks (before step 1) -------------------------------------
    Case(
        "ModelCheckpoint {epoch:s}",
        fit_cb(lambda tmp: ModelCheckpoint(tmp / "ep{epoch:s}.pt")),
        ValueError,
        r"cannot format the values it will get.*\{epoch\} and \{batch\} are ints.*Fix",
    ),
    Case(
        "ModelCheckpoint {loss:d}",
        fit_cb(lambda tmp: ModelCheckpoint(tmp / "m{loss:d}.pt")),
        ValueError,
        "cannot format.*Fix",
    ),
    Case(
        "ModelCheckpoint name past NAME_MAX",
        fit_cb(lambda tmp: ModelCheckpoint(tmp / ("a" * 240 + "{epoch}.pt"))),
        ValueError,
        r"bytes \(with the temp file's 22 extra characters\), past this file system's limit of 255.*Fix",
    ),
    Case(
        "CSVLogger name past NAME_MAX",
        fit_cb(lambda tmp: CSVLogger(tmp / ("b" * 250 + ".csv"))),
        ValueError,
        "past this file system's limit.*Fix",
    ),
    Case(
        "CSVLogger append through a symlink",
        fit_cb(lambda tmp: CSVLogger(tmp / "log.csv", append=True)),
        ValueError,
        "append through the symlink.*target.txt.*Fix",
        setup=_link("log.csv", "target.txt"),
    ),
    Case(
        "two CSVLoggers on one file",
        lambda m, tmp: m.fit(
            _x(), _y(), epochs=1, verbose=0, callbacks=[CSVLogger(tmp / "log.csv"), CSVLogger(tmp / "log.csv")]
        ),
        RuntimeError,
        "CSVLogger cannot use the file.*in use by another callback of this fit.*Fix",
    ),
    Case(
        "two BackupAndRestore on one folder",
        lambda m, tmp: m.fit(
            _x(), _y(), epochs=1, verbose=0, callbacks=[BackupAndRestore(tmp / "bk"), BackupAndRestore(tmp / "bk")]
        ),
        RuntimeError,
        "BackupAndRestore cannot use the backup folder.*another callback of this fit.*Fix",
    ),
    Case(
        "ModelCheckpoint verbose str",
        build(lambda tmp: ModelCheckpoint(tmp / "m.pt", verbose="yes")),
        TypeError,
        "`verbose`",
    ),
    Case(
        "TerminateOnNaN raise_error str",
        build(lambda tmp: TerminateOnNaN(raise_error="yes")),
        TypeError,
        "`raise_error`",
    ),
    Case(
        "LambdaCallback wrong arity",
        build(lambda tmp: LambdaCallback(on_epoch_end=lambda: None)),
        TypeError,
        r"`on_epoch_end` is called as on_epoch_end\(epoch, logs\).*Fix",
    ),
    Case(
        "LambdaCallback batch hook of 1 argument",
        build(lambda tmp: LambdaCallback(on_batch_end=lambda b: 0)),
        TypeError,
        r"on_train_batch_end\(batch, logs\).*Fix",
    ),
    # -- training that would do nothing, or log the wrong thing -----------------------------------
    Case(
        "fit loss detached",
        fit(),
        ValueError,
        r"loss of the first batch has no gradient.*Fix.*without \.detach\(\)",
        setup=_recompile(loss=lambda p, t: nn.functional.cross_entropy(p, t).detach()),
    ),
    Case(
        "fit loss int tensor",
        fit(),
        ValueError,
        r"no gradient \(a int64 tensor",
        setup=_recompile(loss=lambda p, t: torch.tensor(3)),
    ),
    Case(
        "fit loss constant",
        fit(),
        ValueError,
        "no gradient.*trainable parameters",
        setup=_recompile(loss=lambda p, t: torch.tensor(1.0)),
    ),
    Case(
        "fit loss detached, DataLoader",
        fit(x=_loader(_x(), _y()), y=None),
        ValueError,
        "no gradient",
        setup=_recompile(loss=lambda p, t: nn.functional.cross_entropy(p, t).detach()),
    ),
    Case(
        "compile metric named loss",
        compile_(metrics={"loss": "accuracy"}),
        ValueError,
        "metric name 'loss' is a key fit writes itself.*Fix",
    ),
    Case(
        "compile metric named val_acc",
        compile_(metrics={"val_acc": "accuracy"}),
        ValueError,
        "'val_acc'.*`val_` prefix.*Fix",
    ),
    Case(
        "compile metric named learning_rate",
        compile_(metrics={"learning_rate": "accuracy"}),
        ValueError,
        "learning rate's key",
    ),
    Case(
        "compile metric named learning_rate/pg1",
        compile_(metrics={"learning_rate/pg1": "mae"}),
        ValueError,
        "learning rate's key",
    ),
    Case(
        "compile optimizer with a parameter outside the module",
        lambda m, tmp: m.compile(
            optimizer=torch.optim.SGD([*m.module.parameters(), nn.Parameter(torch.zeros(2))], lr=0.1),
            loss="cross_entropy",
        ),
        ValueError,
        r"also holds 1 parameter\(s\) that are not the module's.*shape \(2,\).*Fix",
    ),
    Case(
        "fit sample_weight complex",
        fit(sample_weight=torch.ones(N, dtype=torch.complex64)),
        TypeError,
        "`sample_weight` to hold real numbers.*complex64.*Fix",
    ),
    Case(
        "fit sample_weight numpy str",
        fit(sample_weight=np.array(["1"] * N)),
        TypeError,
        "`sample_weight` to hold real numbers.*<U1.*Fix",
    ),
    Case(
        "fit zero-length Dataset shuffle",
        fit(x=_Samples(0), y=None, shuffle=True),
        ValueError,
        "_Samples has 0 samples.*Fix",
    ),
    Case(
        "fit mae on a 3-class classifier",
        fit(),
        ValueError,
        r"metric 'mae' compares.*\(5, 3\) and \(5,\).*Fix",
        setup=_recompile(metrics=["mae"]),
    ),
    Case(
        "fit r2 on a 3-class classifier",
        fit(),
        ValueError,
        "metric 'r2' compares.*Fix",
        setup=_recompile(metrics=["r2"]),
    ),
    Case(
        "fit ragged Dataset samples",
        fit(x=_Samples(ragged_at=2), y=None, shuffle=False),
        ValueError,
        r"batch of the Dataset \(number 1.*different shapes.*\(4,\).*\(5,\).*Fix",
    ),
    # -- damaged and crafted files ---------------------------------------------------------------
    Case(
        "load_checkpoint epoch str",
        lambda m, tmp: m.load_checkpoint(tmp / "c.pt"),
        ValueError,
        r"content fitkit does not write.*checkpoint\['epoch'\] is 'x'.*Fix",
        setup=_crafted_checkpoint("c.pt", epoch="x"),
    ),
    Case(
        "load_checkpoint global_step negative",
        lambda m, tmp: m.load_checkpoint(tmp / "c.pt"),
        ValueError,
        r"checkpoint\['global_step'\] is -1",
        setup=_crafted_checkpoint("c.pt", global_step=-1),
    ),
    Case(
        "load_checkpoint callbacks str",
        lambda m, tmp: m.load_checkpoint(tmp / "c.pt"),
        ValueError,
        r"checkpoint\['callbacks'\] is 'x'",
        setup=_crafted_checkpoint("c.pt", callbacks="x"),
    ),
    Case(
        "load_state_dict extra key",
        lambda m, tmp: m.load_state_dict({**m.module.state_dict(), "x": torch.ones(1)}),
        RuntimeError,
        "nothing was loaded.*'x': in the file, not in the module.*Fix",
    ),
    Case(
        "load_state_dict dtype",
        lambda m, tmp: m.load_state_dict({k: v.double() for k, v in m.module.state_dict().items()}),
        RuntimeError,
        "nothing was loaded.*dtype torch.float64 in the file",
    ),
    Case(
        "load_weights safetensors aliases not JSON",
        lambda m, tmp: m.load_weights(tmp / "w.safetensors"),
        ValueError,
        "metadata 'fitkit_aliases' is not the JSON.*Fix",
        setup=_weights_with_bad_aliases("w.safetensors"),
    ),
    Case(
        "load_checkpoint SGD into Adam",
        lambda m, tmp: m.load_checkpoint(tmp / "sgd.pt"),
        ValueError,
        "SGD.*Fix",
        setup=_sgd_checkpoint("sgd.pt"),
    ),
    # -- helpers, options and user functions (issue 28) ---------------------------------------------
    Case(
        "find_lr batch_size 0",
        lambda m, tmp: find_lr(m, _x(), _y(), batch_size=0, num_steps=5),
        ValueError,
        r"Expected `batch_size` >= 1\. Received: batch_size=0\. Fix",
    ),
    Case(
        "find_lr batch_size str",
        lambda m, tmp: find_lr(m, _x(), _y(), batch_size="8", num_steps=5),
        TypeError,
        r"Expected `batch_size` to be an int\. Received: batch_size='8'\. Fix",
    ),
    Case(
        "find_lr plot str",
        lambda m, tmp: find_lr(m, _x(), _y(), num_steps=5, plot="no"),
        TypeError,
        r"Expected `plot` to be a bool\. Received: plot='no'",
    ),
    Case(
        "find_lr path is a folder",
        lambda m, tmp: find_lr(m, _x(), _y(), num_steps=5, path=tmp / "plots"),
        ValueError,
        r"find_lr writes a file at `path`, but it is an existing folder\. Received: path=.*Fix",
        setup=_mkdir("plots"),
    ),
    Case(
        "find_lr path under a file",
        lambda m, tmp: find_lr(m, _x(), _y(), num_steps=5, path=tmp / "afile" / "lr.png"),
        ValueError,
        r"find_lr writes a file at `path`, but .*afile' above it is an existing file.*Fix",
        setup=_file("afile"),
    ),
    Case(
        "find_lr path int",
        lambda m, tmp: find_lr(m, _x(), _y(), num_steps=5, path=5),
        TypeError,
        r"Expected `path` to be a str or a path\. Received: path=5",
    ),
    Case(
        "find_batch_size init_val 0",
        lambda m, tmp: find_batch_size(m, _x(), _y(), init_val=0),
        ValueError,
        r"Expected `init_val` >= 1\. Received: init_val=0",
    ),
    Case(
        "Model timeout inf",
        lambda m, tmp: fitkit.Model(nn.Linear(4, 3), device="cpu", timeout=float("inf")),
        ValueError,
        r"Expected `timeout` to be a finite number of seconds.*Received: timeout=inf\. Fix",
    ),
    Case(
        "WeightAveraging avg_fn raises",
        fit_cb(lambda tmp: WeightAveraging(avg_fn=lambda a, c, n: a / "n")),
        ValueError,
        r"WeightAveraging's `avg_fn` failed when tried before training on a copy of one weight "
        r"\(shape \(8, 4\)\): TypeError: .*Expected `avg_fn\(averaged, current, num_averaged\).*Fix",
    ),
    Case(
        "WeightAveraging avg_fn of 2 arguments",
        fit_cb(lambda tmp: WeightAveraging(avg_fn=lambda a, c: a)),
        ValueError,
        r"`avg_fn` failed .*takes 2 positional arguments but 3.*Fix",
    ),
    Case(
        "WeightAveraging avg_fn returns a scalar",
        fit_cb(lambda tmp: WeightAveraging(avg_fn=lambda a, c, n: a.sum())),
        ValueError,
        r"`avg_fn` returned a tensor of shape \(\) when tried before training on a weight of shape "
        r"\(8, 4\)\. Expected .*Fix",
    ),
    Case(
        "WeightAveraging multi_avg_fn raises",
        fit_cb(lambda tmp: WeightAveraging(multi_avg_fn=lambda a, c, n: a.missing)),
        ValueError,
        r"`multi_avg_fn` failed .*AttributeError.*Expected `multi_avg_fn\(averaged_list, current_list, .*Fix",
    ),
    Case(
        "SWA avg_fn raises",
        fit_cb(lambda tmp: SWA(swa_lrs=0.01, swa_epoch_start=1, avg_fn=lambda a, c, n: 1 / 0)),
        ValueError,
        r"SWA's `avg_fn` failed when tried before training.*ZeroDivisionError.*Fix",
        scheduler=False,
    ),
    Case(
        "fit empty validation generator",
        fit(validation_data=(b for b in []), epochs=1),  # one validation: two are refused for any generator
        ValueError,
        r"`validation_data` \(generator\) yields no batch, so the first validation, after the first epoch's "
        r"training, would fail\. Fix",
    ),
    Case(
        "fit one-shot validation generator validated twice",
        fit(validation_data=((torch.zeros(5, 4), torch.zeros(5, dtype=torch.long)) for _ in range(2))),
        ValueError,
        r"Expected `validation_data` to give a pass for each of the 2 validations this fit schedules\. "
        r"Received: validation_data=generator \(one-shot.*Fix: pass a re-iterable source.*validation_steps=N",
    ),
    Case(
        "fit endless training source without steps_per_epoch",
        fit(x=itertools.cycle([(torch.zeros(5, 4), torch.zeros(5, dtype=torch.long))]), y=None, batch_size=None),
        ValueError,
        r"Expected `x` to end, or `steps_per_epoch=` to bound an epoch\. Received: x=itertools\.cycle.*"
        r"Fix: pass steps_per_epoch=N",
    ),
    Case(
        "evaluate endless source without steps",
        evaluate(itertools.repeat((torch.zeros(5, 4), torch.zeros(5, dtype=torch.long)))),
        ValueError,
        r"Expected `x` to end, or `steps=` to bound evaluate\. Received: x=itertools\.repeat.*Fix: pass steps=N",
    ),
    Case(
        "fit ragged samples in the first batch of a DataLoader",
        fit(x=DataLoader(_Samples(ragged_at=2), batch_size=5), y=None),
        ValueError,
        r"training DataLoader could not be made after 0 optimizer step\(s\).*default_collate.*equal "
        r"shapes.*Fix: pass DataLoader\(\.\.\., collate_fn=\.\.\.\)",
    ),
    # -- issue 43's examples, and what the option fuzz (tests/checks/test_declared_options.py) found ---------
    Case(
        "fit min_steps above max_steps",
        fit(max_steps=20, min_steps=50),
        ValueError,
        r"min_steps=50 asks for more than max_steps=20, which ends training first\. Fix",
    ),
    Case(
        "compile loss reduction avg",
        compile_(loss=nn.CrossEntropyLoss(reduction="avg")),
        ValueError,
        r"Expected the loss's `reduction` to be one of 'mean', 'sum', 'none'\. Received: "
        r"CrossEntropyLoss\(reduction='avg'\)\. Fix",
    ),
    Case(
        "ModelCheckpoint save_last is its own filepath",
        fit_cb(lambda tmp: ModelCheckpoint(tmp / "ck.pt", save_last=tmp / "ck.pt")),
        ValueError,
        r"Expected `save_last` to be a file of its own, but .*ck\.pt' is a file of `filepath`.*Fix",
    ),
    Case(
        "ModelCheckpoint save_last matches the filepath pattern",
        fit_cb(lambda tmp: ModelCheckpoint(tmp / "ep{epoch}.pt", save_last=tmp / "ep3.pt")),
        ValueError,
        r"Expected `save_last` to be a file of its own, but .*ep3\.pt' is a file of `filepath`.*Fix",
    ),
    Case(
        "CSVLogger separator newline",
        fit_cb(lambda tmp: CSVLogger(tmp / "log.csv", separator="\n")),
        ValueError,
        r"Expected `separator` to be one character that is not a line break.*Received: separator='\\n'\. Fix",
    ),
    Case(
        "CSVLogger separator quote",
        fit_cb(lambda tmp: CSVLogger(tmp / "log.csv", separator='"')),
        ValueError,
        r"Received: separator='\"'\. Fix",
    ),
    Case(
        "ProgressBar refresh_interval -1",
        fit_cb(lambda tmp: ProgressBar(refresh_interval=-1)),
        ValueError,
        r"Expected `refresh_interval` >= 0\.0\. Received: refresh_interval=-1\. Fix",
    ),
    Case(
        "WeightAveraging start at a step and an epoch",
        fit_cb(lambda tmp: WeightAveraging(update_starting_at_step=2, update_starting_at_epoch=1)),
        ValueError,
        r"Expected at most one of `update_starting_at_step` and `update_starting_at_epoch`\. Received: "
        r"update_starting_at_step=2, update_starting_at_epoch=1\. Fix",
    ),
    Case(
        "ThroughputMonitor clock returns a str",
        fit_cb(lambda tmp: ThroughputMonitor(clock=lambda: "now")),
        TypeError,
        r"Expected `clock` to return seconds as a number\. Received: clock\(\) returned 'now' \(str\)\. Fix",
    ),
    Case(
        "Timer clock returns None",
        fit_cb(lambda tmp: Timer(3600, clock=lambda: None)),
        TypeError,
        r"Expected `clock` to return seconds as a number\. Received: clock\(\) returned None \(NoneType\)\. Fix",
    ),
    Case(
        "find_lr lr_max",
        lambda m, tmp: find_lr(m, _x(), _y(), lr_max=1),
        TypeError,
        r"find_lr\(\) got an unexpected keyword argument 'lr_max'\. Fix.*Valid keywords: .*end_lr",
    ),
    Case(
        "find_lr path in a missing folder",
        lambda m, tmp: find_lr(m, _x(), _y(), num_steps=5, path=tmp / "missing" / "dir" / "lr.png"),
        ValueError,
        r"find_lr writes its plot at `path`, but the folder .*missing/dir' does not exist\. .*Fix",
    ),
    Case(
        "fit numpy object array in a dict x",
        fit(x={"input": _x().numpy(), "note": np.array([object()] * N, dtype=object)}),
        TypeError,
        r"Expected `x\['note'\]` to be a numeric array \(bool, int, float or complex\)\. Received an array of "
        r"dtype object, shape \(20,\)\. Fix",
    ),
    Case(
        "fit sample_weight str",
        fit(sample_weight="w"),
        TypeError,
        r"Expected `sample_weight` to be an array of real numbers.*Received: sample_weight='w' \(str\)\. Fix",
    ),
    Case(
        "fit max_time negative",
        fit(max_time=-1),
        ValueError,
        r"Expected `max_time` to be a positive number\. Received: max_time=-1\. Fix",
    ),
    Case(
        "save_weights trainable_only with every parameter frozen",
        lambda m, tmp: (m.module.requires_grad_(False), m.save_weights(tmp / "w.pt", trainable_only=True)),
        ValueError,
        r"save_weights\(trainable_only=True\) would write an empty file to .*w\.pt': no parameter of "
        r"the module requires grad \(all are frozen\)\. Received: trainable_only=True\. Fix",
    ),
    Case(
        "export example_input str",
        lambda m, tmp: export(m.module, tmp / "m.pt2", "x"),
        TypeError,
        r"Expected `example_input` to be one input batch.*Received: example_input='x' \(str\)\. Fix",
    ),
    Case(
        "compile use_ema with an EMA callback that swaps in at the end too",
        fit_cb(lambda tmp: EMA(swap_at_end=True)),
        ValueError,
        r"Expected at most one averaged copy of the weights to put into the module when fit ends\. Received 2: "
        r"compile\(use_ema=True\)'s EMA and EMA \(callbacks\[0\]\).*Fix",
        setup=_recompile(use_ema=True),
    ),
    Case(
        "ProgressBar console int",
        fit_cb(lambda tmp: ProgressBar(console=5)),
        TypeError,
        r"Expected `console` to be a rich\.console\.Console or None\. Received: console=5 \(int\)\. Fix",
    ),
    Case(
        "fit validation_data complex",
        fit(validation_data=1j),
        TypeError,
        r"Expected `validation_data` to be \(x_val, y_val\).*Received: validation_data=1j \(complex\)\. Fix",
    ),
    # crafted fields the registry test (tests/training/test_crafted_fields.py) found accepted
    Case(
        "load_checkpoint global_step 2**64",
        lambda m, tmp: m.load_checkpoint(tmp / "c.pt"),
        ValueError,
        r"checkpoint\['global_step'\] is 18446744073709551616, expected an int >= 0.*Fix",
        setup=_crafted_checkpoint("c.pt", global_step=2**64),
    ),
    Case(
        "load_checkpoint optimizer lr nan",
        lambda m, tmp: m.load_checkpoint(tmp / "c.pt"),
        ValueError,
        r"checkpoint\['optimizer'\]\['param_groups'\]\[0\]\['lr'\] is nan, expected a number as the model's.*Fix",
        setup=_crafted_group("c.pt", lr=float("nan")),
    ),
    Case(
        "load_checkpoint optimizer maximize flipped",
        lambda m, tmp: m.load_checkpoint(tmp / "c.pt"),
        ValueError,
        r"does not fit this model.*optimizer group 0: maximize=True in the file, False in the model.*Fix",
        setup=_crafted_group("c.pt", maximize=True),
    ),
    Case(
        "load_checkpoint scheduler _is_initial set",
        lambda m, tmp: m.load_checkpoint(tmp / "c.pt"),
        ValueError,
        r"checkpoint\['scheduler'\]\['_is_initial'\] is True, expected False.*Fix",
        setup=_crafted_checkpoint("c.pt", scheduler=_SCHEDULER_IN_STEP),
    ),
]


def _classifier(scheduler: bool = True) -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, CLASSES)), device="cpu")
    step_lr = (lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)) if scheduler else None
    model.compile(optimizer="adam", loss="cross_entropy", metrics=["accuracy"], scheduler=step_lr)
    model.train_on_batch(_x(8), _y(8))  # the optimizer holds state to protect
    return model


def _snapshot(model: fitkit.Model) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "module": model.module.state_dict(),
            "optimizer": model.optimizer.state_dict(),
            "optimizer_class": type(model.optimizer),
            "scheduler": model.scheduler.state_dict() if model.scheduler is not None else None,
            "step": model.global_step,
            "lr": [g["lr"] for g in model.optimizer.param_groups],
        }
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _files(tmp) -> set[str]:
    return {str(p.relative_to(tmp)) for p in tmp.rglob("*")}


PARAMS = [
    pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.gap)] if c.gap else []) for c in CASES
]


@pytest.mark.parametrize("case", PARAMS)
def test_bad_input_raises_a_clear_error_before_step_1_and_changes_nothing(case, tmp_path, capsys):
    model = _classifier(case.scheduler)
    if case.setup is not None:
        case.setup(model, tmp_path)
    files, before = _files(tmp_path), _snapshot(model)
    with pytest.raises(case.error) as info:
        case.call(model, tmp_path)
    message = str(info.value)
    assert re.search(case.match, message, re.S), message
    assert "Fix" in message or "`" in message or "'" in message, message  # names the fix or the argument
    assert _same(_snapshot(model), before)
    assert _files(tmp_path) == files
    assert "pwned" not in capsys.readouterr().out


def test_the_sweep_is_large():
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)


def _model(module: nn.Module | None = None, loss: str = "cross_entropy") -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(module if module is not None else nn.Linear(4, 3), device="cpu")
    model.compile(optimizer="adam", loss=loss, metrics=["accuracy"] if loss == "cross_entropy" else None)
    return model


def _state(model: fitkit.Model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def _unchanged(model: fitkit.Model, before: dict[str, torch.Tensor]) -> bool:
    now = model.module.state_dict()
    return now.keys() == before.keys() and all(torch.equal(now[k], v) for k, v in before.items())


def _fit_fails(model, tmp_path, *args, error=ValueError, **kwargs) -> BaseException:
    """fit with a checkpoint and a CSV log; the error must come before either writes a file."""
    before = _state(model)
    callbacks = [ModelCheckpoint(tmp_path / "ckpt.pt", save_freq=1), CSVLogger(tmp_path / "log.csv")]
    with pytest.raises(error) as info:
        model.fit(*args, epochs=2, verbose=0, callbacks=callbacks, **kwargs)
    assert _unchanged(model, before) and model.global_step == 0
    assert list(tmp_path.iterdir()) == []
    return info.value


# -- raw torch errors from the first batch, wrapped ------------------------------------------------
def test_a_wrong_feature_count_names_the_forward_and_what_was_fed(tmp_path):
    e = _fit_fails(_model(), tmp_path, torch.randn(10, 5), torch.arange(10) % 3, batch_size=4)
    assert str(e).startswith(
        "The first batch failed in the module's forward: RuntimeError: mat1 and mat2 shapes cannot be multiplied "
        "(4x5 and 4x3). It was fed x: float32 (4, 5); y: int64 (4,) values 0..2. Fix: make the data's shapes"
    )
    assert isinstance(e.__cause__, RuntimeError)  # the original, chained


class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return {"scores": self.lin(x), "features": x}


def test_a_module_returning_a_dict_with_a_compiled_loss_names_the_loss_and_the_keys(tmp_path):
    e = _fit_fails(_model(_DictOut(), loss="mse"), tmp_path, torch.randn(10, 4), torch.randn(10, 3), batch_size=4)
    # The structured-output rule (fitkit.losses.outputs) names the loss, the dict's entries and the fix.
    message = str(e)
    assert message.startswith("fitkit cannot pick one prediction tensor for the loss 'mse' out of the module's output")
    assert "'scores'" in message and "'features'" in message and "Fix" in message


def test_a_gpt_token_id_above_the_vocabulary_shows_the_id_range(tmp_path):
    torch.manual_seed(0)
    gpt = GPT(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=8)
    x = torch.randint(0, 10, (6, 8))
    x[4, 3] = 12
    e = _fit_fails(_model(gpt), tmp_path, x, torch.randint(0, 10, (6, 8)), batch_size=6)
    assert str(e).startswith(
        "The first batch failed in the module's forward: IndexError: index out of range in self. It was fed "
        "x: int64 (6, 8) values 0..12;"
    )
    assert isinstance(e.__cause__, IndexError)


def test_a_dataloader_gets_the_same_check_on_its_first_training_batch(tmp_path):
    model = _model()
    data = DataLoader(TensorDataset(torch.randn(10, 5), torch.arange(10) % 3), batch_size=4)
    before = _state(model)
    with pytest.raises(
        ValueError,
        match=r"^The first training batch failed in the module's forward: RuntimeError: "
        r"mat1 and mat2 shapes cannot be multiplied \(4x5 and 4x3\)\. It was fed x: float32 \(4, 5\)",
    ):
        model.fit(data, epochs=2, verbose=0, callbacks=[ModelCheckpoint(tmp_path / "ckpt.pt", save_freq=1)])
    assert _unchanged(model, before) and model.global_step == 0
    assert list(tmp_path.iterdir()) == []


def test_float64_batches_of_a_dataloader_get_a_dtype_fix():
    model = _model()
    data = DataLoader(TensorDataset(torch.randn(10, 4, dtype=torch.float64), torch.arange(10) % 3), batch_size=4)
    with pytest.raises(ValueError, match=r"Fix: the module's parameters are float32 and x is float64: convert"):
        model.fit(data, epochs=1, verbose=0)


def test_predict_names_the_forward_on_a_bad_first_batch():
    with pytest.raises(ValueError, match=r"^The first batch failed in the module's forward: RuntimeError: mat1"):
        _model().predict(torch.randn(10, 6), verbose=0)


# -- float64 NumPy arrays ----------------------------------------------------------------------------
def test_float64_numpy_inputs_are_cast_and_train_exactly_as_float32():
    x32, y = torch.randn(24, 4), torch.arange(24) % 3
    as32, as64 = _model(), _model()
    as32.fit(x32, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    as64.fit(x32.numpy().astype(np.float64), y.numpy(), epochs=2, batch_size=8, verbose=0, shuffle=False)
    for k, v in as32.module.state_dict().items():
        assert torch.equal(as64.module.state_dict()[k], v)
    x64 = x32.double()  # a float64 tensor too, in evaluate and predict
    assert as64.evaluate(x64, y, verbose=0) == as32.evaluate(x32, y, verbose=0)
    out = as64.predict(x64, verbose=0)
    assert out.dtype == torch.float32 and torch.equal(out, as32.predict(x32, verbose=0))


# -- accepted silently before --------------------------------------------------------------------
def test_nan_and_inf_in_x_and_y_name_the_count_and_the_first_row(tmp_path):
    x = torch.randn(12, 4)
    x[5, 1], x[9, 0], x[9, 2] = float("nan"), float("inf"), -float("inf")
    e = _fit_fails(_model(), tmp_path, x, torch.arange(12) % 3)
    assert str(e) == (
        "`x` holds 3 NaN or infinite values (first at row 5). Fix: clean or impute `x` before fit; "
        "a NaN input turns every weight NaN."
    )
    y = torch.randn(12, 3)
    y[7, 2] = float("nan")
    e = _fit_fails(_model(nn.Linear(4, 3), loss="mse"), tmp_path, torch.randn(12, 4), y)
    assert str(e).startswith("`y` holds 1 NaN or infinite values (first at row 7).")


def test_a_negative_sample_weight_is_an_error(tmp_path):
    w = torch.ones(12)
    w[4] = -2.0
    e = _fit_fails(_model(), tmp_path, torch.randn(12, 4), torch.arange(12) % 3, sample_weight=w)
    assert str(e) == (
        "`sample_weight` must be >= 0. Received a negative weight at index 4 (-2.0). Fix: weights "
        "scale each sample's loss; use 0 to ignore one."
    )


@pytest.mark.parametrize("shape", [(12,), (12, 1), (12, 3)])
def test_class_weight_with_continuous_targets_is_an_error(tmp_path, shape):
    model = _model(nn.Linear(4, shape[-1] if len(shape) > 1 else 1), loss="mse")
    y = torch.randn(*shape) + 0.25
    e = _fit_fails(model, tmp_path, torch.randn(12, 4), y, class_weight={0: 1.0, 1: 2.0})
    assert str(e).startswith(
        "`class_weight` needs class labels (or one-hot / probability rows), but the targets are continuous (e.g. "
    )
    assert str(e).endswith("Fix: pass `sample_weight` for regression targets.")


def test_class_weight_with_one_hot_or_probability_rows_still_works():
    model = _model()
    one_hot = torch.eye(3)[torch.arange(12) % 3] * 0.9 + 0.1 / 3  # label smoothing: rows in [0, 1]
    model.fit(torch.randn(12, 4), one_hot, class_weight={0: 1.0, 1: 2.0, 2: 1.0}, epochs=1, verbose=0)
    assert model.global_step == 1


def test_initial_epoch_at_or_past_epochs_warns_that_nothing_will_train():
    model = _model()
    before = _state(model)
    with pytest.warns(UserWarning, match=r"initial_epoch=3 >= epochs=3: nothing will train.*Fix: pass epochs > "):
        history = model.fit(torch.randn(8, 4), torch.arange(8) % 3, initial_epoch=3, epochs=3, verbose=0)
    assert history.epoch == [] and model.global_step == 0 and _unchanged(model, before)


# -- paths that cannot be written, at construction ----------------------------------------------------
def test_paths_of_the_wrong_kind_fail_at_construction(tmp_path):
    (tmp_path / "ckpt.pt").mkdir()
    (tmp_path / "log.csv").mkdir()
    (tmp_path / "backup").write_text("")
    made = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"ModelCheckpoint writes a file at `filepath`, but it is an existing folder"):
        ModelCheckpoint(tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match=r"CSVLogger writes a file at `filename`, but it is an existing folder"):
        CSVLogger(tmp_path / "log.csv")
    with pytest.raises(ValueError, match=r"BackupAndRestore writes a folder at `backup_dir`, but it is an existing"):
        BackupAndRestore(tmp_path / "backup")
    assert sorted(p.name for p in tmp_path.iterdir()) == made
    assert list((tmp_path / "ckpt.pt").iterdir()) == [] and list((tmp_path / "log.csv").iterdir()) == []
    assert (tmp_path / "backup").read_text() == ""


def test_path_arguments_must_be_paths():
    model = _model()
    for call in (model.save_weights, model.load_weights, model.save_checkpoint, model.load_checkpoint):
        with pytest.raises(TypeError, match=r"Expected `path` to be a str or a path\. Received: path=3 \(int\)\. Fix"):
            call(3)


def test_no_warning_for_good_inputs():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _model().fit(np.random.default_rng(0).normal(size=(16, 4)), np.arange(16) % 3, epochs=1, verbose=0)


# -- budgets and intervals that cannot act: a FitkitWarning before step 1 (issue 28) ---------------------
def _val():
    return (_x(6), _y(6))


WARNS = [
    (
        "max_steps at the step count",
        {"max_steps": 1},
        r"fit\(max_steps=1\) is already spent: the model has taken 1 optimizer steps .*Fix: pass max_steps > 1",
    ),
    (
        "max_steps below the step count, epochs=None",
        {"max_steps": 1, "epochs": None},
        r"fit\(max_steps=1\) is already spent.*Fix",
    ),
    (
        "validation_interval longer than the fit",
        {"validation_data": _val(), "validation_interval": 100},
        r"fit\(validation_interval=100\) is longer than this fit: .*from step 1 to 9, so it never validates.*"
        r"Fix: pass validation_interval <= 8",
    ),
    (
        "EarlyStopping start_from_epoch past the fit",
        {"callbacks": [EarlyStopping(monitor="loss", start_from_epoch=5)]},
        r"EarlyStopping\(start_from_epoch=5\) never acts: this fit ends after epoch index 1 \(epochs=2\).*"
        r"Fix: pass start_from_epoch < 2",
    ),
]


@pytest.mark.parametrize("kwargs, match", [pytest.param(k, m, id=i) for i, k, m in WARNS])
def test_a_budget_spent_or_an_interval_longer_than_the_fit_warns_before_step_1(kwargs, match):
    model = _classifier(scheduler=False)  # global_step 1
    with pytest.warns(fitkit.FitkitWarning, match=match):
        model.fit(**{"x": _x(), "y": _y(), "epochs": 2, "batch_size": 5, "verbose": 0, **kwargs})


def test_an_early_stopping_patience_longer_than_the_fit_is_not_warned():
    # A large patience is how people keep EarlyStopping's best value without stopping (Keras says
    # nothing either): only a start_from_epoch past the fit, which never looks, is warned.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _model().fit(
            _x(), _y(), epochs=2, batch_size=5, verbose=0, callbacks=[EarlyStopping(monitor="loss", patience=5)]
        )


def test_a_spent_max_steps_changes_nothing():
    model = _classifier(scheduler=False)
    before = _snapshot(model)
    with pytest.warns(fitkit.FitkitWarning, match="already spent"):
        history = model.fit(_x(), _y(), batch_size=5, max_steps=1, verbose=0)
    assert history.epoch == [] and _same(_snapshot(model), before)


def test_a_checkpoint_every_n_epochs_past_the_fit_warns_and_writes_nothing(tmp_path):
    with pytest.warns(
        fitkit.FitkitWarning,
        match=r"ModelCheckpoint\(every_n_epochs=5\) writes nothing in this fit.*"
        r"the fit runs epochs 1 to 2\. Fix: pass every_n_epochs <= 2",
    ):
        _model().fit(
            _x(),
            _y(),
            epochs=2,
            batch_size=5,
            verbose=0,
            callbacks=[ModelCheckpoint(tmp_path / "m{epoch}.pt", every_n_epochs=5)],
        )
    assert list(tmp_path.iterdir()) == []


def test_intervals_and_patience_the_fit_reaches_do_not_warn(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = _model()
        model.fit(
            _x(),
            _y(),
            epochs=2,
            batch_size=5,
            verbose=0,
            validation_data=_val(),
            validation_interval=8,
            callbacks=[
                EarlyStopping(monitor="loss", patience=1),
                EarlyStopping(monitor="loss", patience=9, restore_best_weights=True),  # acts at the end
                ModelCheckpoint(tmp_path / "m.pt", every_n_epochs=2),
            ],
        )
        assert model.global_step == 8 and len(model.history.history["val_loss"]) == 1
        model.fit(_x(), _y(), batch_size=5, max_steps=9, verbose=0)  # one step left
        assert model.global_step == 9


# -- logger options: TypeErrors at construction (issue 28) -----------------------------------------------
LOGGERS = [
    (
        "MLflowLogger",
        {"tags": ["a", "b"]},
        r"Expected `tags` to be a dict of \{name: value\} with str names, or None\. "
        r"Received: tags=\['a', 'b'\] \(list\)\. Fix: pass e\.g\. tags=",
    ),
    ("MLflowLogger", {"tags": {1: "a"}}, r"Received: tags=\{1: 'a'\} \(a key of type int\)\. Fix"),
    (
        "MLflowLogger",
        {"tracking_uri": 5},
        r"Expected `tracking_uri` to be a str or None\. Received: tracking_uri=5 "
        r"\(int\)\. Fix: pass a URI such as",
    ),
    ("MLflowLogger", {"experiment_name": 5}, r"Expected `experiment_name` to be a str or None\. Received: .*Fix"),
    ("MLflowLogger", {"run_name": ["a"]}, r"Expected `run_name` to be a str or None\. Received: run_name=\['a'\].*Fix"),
    ("WandbLogger", {"project": 5}, r"Expected `project` to be a str or None\. Received: project=5 \(int\)\. Fix"),
    ("WandbLogger", {"config": [1]}, r"Expected `config` to be a dict .*Received: config=\[1\] \(list\)\. Fix"),
]


@pytest.mark.parametrize("name, kwargs, match", LOGGERS, ids=[f"{n} {list(k)[0]}" for n, k, _ in LOGGERS])
def test_logger_names_uris_and_tags_of_the_wrong_type_are_refused(tmp_path, monkeypatch, name, kwargs, match):
    pytest.importorskip("mlflow" if name == "MLflowLogger" else "wandb")
    from fitkit import callbacks as C

    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match=match):
        getattr(C, name)(**kwargs)
    assert list(tmp_path.iterdir()) == []


# -- a loss whose gradient reaches no parameter (issue 28, left from round 3) ----------------------------
class _Unreached(nn.Module):
    """The output detached, plus a tensor that requires grad but is no Parameter: the loss requires grad."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.shift = torch.zeros(3, requires_grad=True)

    def forward(self, x):
        return self.lin(x).detach() + self.shift


def test_a_loss_that_requires_grad_but_reaches_no_parameter_is_refused_before_step_1(tmp_path):
    e = _fit_fails(_model(_Unreached()), tmp_path, _x(), _y(), batch_size=5)
    assert str(e).startswith("The loss of the first batch requires grad, but its gradient reaches no parameter: ")
    assert "Fix: compute the loss from the module's output without .detach()" in str(e)


# -- ragged samples after the first batch of a user's DataLoader: named, not torch's stack error -------------
def test_ragged_samples_in_a_later_batch_of_a_users_dataloader_name_the_collate_fix():
    model = _model()
    with pytest.raises(
        ValueError,
        match=r"A batch of the training DataLoader could not be made after 1 optimizer "
        r"step\(s\) of this fit: its collate_fn \(torch's default_collate\).*Fix: pass DataLoader",
    ) as e:
        model.fit(DataLoader(_Samples(ragged_at=7), batch_size=5), epochs=1, verbose=0)
    assert isinstance(e.value.__cause__, RuntimeError) and model.global_step == 1


# -- what a failed batch was fed, when it holds None or strings ------------------------------------------
def test_describe_names_none_and_strings_in_a_batch():
    from fitkit.training.preflight import describe

    assert describe(({"x": torch.zeros(2, 4), "mask": None}, torch.tensor([0, 1]), None)) == (
        "x: 'x' float32 (2, 4), 'mask' None; y: int64 (2,) values 0..1"
    )
    assert describe(({"text": ["a", "b"]}, None, None)) == "x: 'text' list of 2 str"
    assert describe((None, None, None)) == "x: None"


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x=None, mask=None):
        return self.lin(x * mask)


def test_a_dict_batch_holding_none_says_so(tmp_path):
    e = _fit_fails(_model(_Masked()), tmp_path, [({"x": _x(5), "mask": None}, _y(5))])
    assert "It was fed x: 'x' float32 (5, 4), 'mask' None; y: int64 (5,) values 0..2. Fix" in str(e)


def test_samples_of_equal_shapes_holding_a_value_torch_cannot_stack_are_named_as_such():
    from fitkit.data.collate import NamingCollate

    with pytest.raises(
        ValueError,
        match=r"its samples' tensors have equal shapes, but a value torch cannot stack is "
        r"among them .*The first sample holds \(\(2,\), object\)\. Fix",
    ):
        NamingCollate()([(torch.zeros(2), object()), (torch.zeros(2), object())])
    with pytest.raises(
        ValueError,
        match=r"its samples have different kinds of values \(each sample's tensors: "
        r"\(\(2,\), None\), \(\(2,\), \(1,\)\)\).*a column is None in some samples and not in others",
    ):
        NamingCollate()([(torch.zeros(2), None), (torch.zeros(2), torch.ones(1))])
    assert NamingCollate()([(torch.zeros(2), None), (torch.ones(2), None)])[1] is None  # a None column stays None


def test_sample_weight_with_a_hugging_face_dataset_weights_the_loss():
    datasets = pytest.importorskip("datasets")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x)

    data = datasets.Dataset.from_dict({"x": _x().tolist(), "labels": _y().tolist()}).with_format("torch")
    zero = _model(Net())
    before = _state(zero)
    with pytest.warns(fitkit.FitkitWarning, match="every sample weight was 0"):
        zero.fit(data, sample_weight=torch.zeros(N), batch_size=5, epochs=1, verbose=0, shuffle=False)
    assert _unchanged(zero, before)  # a weight of 0 everywhere: no gradient
    half, plain = _model(Net()), _model(Net())
    half.fit(data, sample_weight=torch.full((N,), 0.5), batch_size=5, epochs=1, verbose=0, shuffle=False)
    plain.fit(_x(), _y(), batch_size=5, epochs=1, verbose=0, shuffle=False)
    assert half.global_step == plain.global_step == 4


class _Widening(nn.Module):
    """3 logits for the first two forwards (the check before step 1 and step 1), then 6."""

    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(4, 6), 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)[:, :3] if self.calls <= 2 else self.lin(x)


@pytest.mark.parametrize("sample_weight", [None, torch.ones(N)], ids=["plain", "weighted"])
def test_an_output_that_widens_during_training_is_refused_at_the_batch_it_widens(sample_weight):
    model = _model(_Widening())
    with pytest.raises(
        ValueError,
        match=r"^Loss 'cross_entropy' got logits for 6 classes \(5, 6\), but earlier "
        r"batches had 3: the module's output changed width during training.*Fix: make the module's "
        r"output size fixed",
    ):
        model.fit(_x(), _y(), batch_size=5, epochs=1, verbose=0, shuffle=False, sample_weight=sample_weight)
    assert model.global_step == 1  # step 1 ran on 3 logits; the step with 6 was not applied
    model.compile(optimizer="adam", loss="cross_entropy")  # a new head on purpose: compile again
    history = model.fit(_x(), _y(), batch_size=5, epochs=1, verbose=0)
    assert history.epoch == [0] and len(history.history["loss"]) == 1


class _Keyed(nn.Module):
    """A module fed dict batches: ``forward(features)``; with ``logits_only`` it returns ``{"logits": ...}``
    and takes (and ignores) ``labels``, as a Hugging Face model called without a loss would."""

    def __init__(self, logits_only: bool = False):
        super().__init__()
        self.lin, self.logits_only = nn.Linear(FEATURES, CLASSES), logits_only

    def forward(self, features, labels=None):
        out = self.lin(features)
        return {"logits": out} if self.logits_only else out


def test_label_names_that_the_batches_do_not_hold_are_refused_before_step_1(tmp_path):
    model = fitkit.Model(_Keyed(), device="cpu")
    model.compile(optimizer="adam", loss="cross_entropy", label_names=["target"])
    err = _fit_fails(model, tmp_path, {"features": _x(), "labels": _y()}, batch_size=5)
    assert re.search(
        r"compile\(label_names=\['target'\]\) names no key of the batch "
        r"\(keys: \['features', 'labels'\]\).*Fix",
        str(err),
    )
    # y passed apart: label_names would be ignored, so it is refused too
    err = _fit_fails(model, tmp_path, {"features": _x()}, _y(), batch_size=5)
    assert "names no key of the batch (keys: ['features'])" in str(err)
    # the key the batches do hold: its tensor is the target (taken out of forward's inputs)
    x, y = _x(), _y()
    got = model.evaluate({"features": x, "target": y}, verbose=0)["loss"]
    assert got == pytest.approx(nn.functional.cross_entropy(model.module.lin(x), y).item(), rel=1e-6)


def test_evaluate_of_dict_batches_whose_module_returns_no_loss_and_no_metric_is_an_error():
    model = fitkit.Model(_Keyed(logits_only=True), device="cpu")
    model.compile(optimizer="adam")  # loss=None: the module's own loss, which it does not return
    x, y = _x(), _y()
    with pytest.raises(
        ValueError,
        match=r"Expected something to evaluate: compile\(loss=None\) and the module's "
        r"output holds no 'loss' \(output: \['logits'\]\), and no metrics are compiled.*Fix",
    ):
        model.evaluate({"features": x, "labels": y}, verbose=0)
    # batches from an iterable are not checked before the loop: the loop names it at its end
    with pytest.raises(ValueError, match=r"Expected `evaluate` to compute a loss or a metric\..*Fix"):
        model.evaluate([{"features": x[:5], "labels": y[:5]}], verbose=0)
    model.compile(optimizer="adam", metrics=["accuracy"])
    with pytest.raises(ValueError, match=r"and the batch has no targets for the metrics.*Fix"):
        model.evaluate({"features": x}, verbose=0)
    # with a metric and targets there is a value: the fraction of correct predictions, by hand
    correct = (model.module.lin(x).argmax(1) == y).float().mean().item()
    assert model.evaluate({"features": x, "labels": y}, verbose=0) == {"accuracy": pytest.approx(correct)}


def test_find_lr_refuses_a_plot_path_in_a_missing_folder_before_the_sweep(tmp_path):
    # Once a raw FileNotFoundError after the whole sweep had run.
    model, forwards = _model(), []
    model.module.register_forward_hook(lambda module, args, out: forwards.append(1))
    with pytest.raises(
        ValueError, match=r"find_lr writes its plot at `path`, but the folder .*missing/dir' does not exist"
    ):
        find_lr(model, _x(), _y(), num_steps=5, path=tmp_path / "missing" / "dir" / "lr.png")
    assert forwards == [] and model.global_step == 0 and list(tmp_path.iterdir()) == []
