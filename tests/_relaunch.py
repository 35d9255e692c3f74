"""Stop a 2-epoch fit at one boundary kind, relaunch it, and compare with the uninterrupted run.

``tests/distributed/test_distributed_relaunch.py`` runs every case of :data:`CASES` in one torchrun launch
(2 gloo ranks): a reference fit per strategy, then per case a fit stopped there (an exception
both ranks raise, as a crash would end the job, or a SIGTERM to every process, as SLURM sends
it) and a relaunch with a fresh model from the backup it left. 48 rows in global batches of 8:
6 optimizer steps an epoch, shuffled, with validation after each epoch.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from typing import Any

import torch
from _dist_scenarios import GLOBAL_BATCH, data, full_params, net

import fitkit
from fitkit.callbacks import BackupAndRestore, Callback
from fitkit.distributed import rank, world_size

#: name: (strategy, BackupAndRestore's save_freq, how the run stops, where: a step or an epoch).
#: ``crash_begin``: an exception in the batch-begin hook when ``global_step == where`` (the last
#: backup is the one taken at that step); ``crash_validation``: an exception as epoch ``where``'s
#: validation begins (after the epoch's last step, before its end); ``term_step``: SIGTERM to
#: every process in step ``where``'s batch-end hook; ``term_validation``: SIGTERM to every process
#: in epoch ``where``'s validation.
CASES: dict[str, tuple[str, Any, str, int]] = {
    "ddp_mid_epoch": ("auto", 1, "crash_begin", 3),  # backup at step 3 of 6
    "ddp_after_last_step": ("auto", 3, "crash_validation", 0),  # save_freq divides the epoch: step 6
    "ddp_epoch_end": ("auto", "epoch", "crash_begin", 6),  # the epoch-end backup of epoch 0
    "ddp_validation_term": ("auto", "epoch", "term_validation", 0),  # stops at epoch 0's end
    "ddp_term_last_step": ("auto", 100, "term_step", 6),  # the stop backup after step 6 of 6
    "fsdp_term_mid_epoch": ("fsdp", 100, "term_step", 3),
    "fsdp_after_last_step": ("fsdp", 2, "crash_validation", 0),
    "fsdp_term_last_step": ("fsdp", 100, "term_step", 6),
}
#: the case whose backup (copied before its relaunch) the test resumes on one process (2 -> 1)
CROSS_SIZE = "ddp_after_last_step"
ROWS, EPOCHS = 48, 2


class Crash(Exception):
    """What a stopped run raises on every rank."""


class Stop(Callback):
    """Ends the run at ``where`` the way ``how`` says (see :data:`CASES`)."""

    def __init__(self, how: str, where: int):
        super().__init__()
        self.how, self.where = how, where

    def _term(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_begin(self, batch, logs=None):
        if self.how == "crash_begin" and self.model.global_step == self.where:
            raise Crash

    def on_train_batch_end(self, batch, logs=None):
        if self.how == "term_step" and self.model.global_step == self.where:
            self._term()

    def on_test_begin(self, logs=None):
        if self.how == "crash_validation" and self.model.epoch == self.where:
            raise Crash

    def on_test_batch_end(self, batch, logs=None):
        if self.how == "term_validation" and self.model.epoch == self.where and batch == 0:
            self._term()


def fit(strategy: str, callbacks: list[Any]) -> tuple[fitkit.Model, list[int], dict]:
    """The 2-epoch fit; returns the model, the global step at each batch's begin, the History."""
    torch.manual_seed(0)
    x, y, w = data(ROWS)
    xv, yv, _ = data(10, seed=1)
    model = fitkit.Model(net(), device="cpu", strategy=strategy, timeout=120)
    model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss="mse", metrics=["mae"])
    begun: list[int] = []
    seen = fitkit.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: begun.append(model.global_step))
    history: dict = {}
    try:
        history = model.fit(
            x,
            y,
            sample_weight=w,
            batch_size=GLOBAL_BATCH // world_size(),
            epochs=EPOCHS,
            shuffle=True,
            validation_data=(xv, yv),
            verbose=0,
            callbacks=[*callbacks, seen],
        ).history
    except (Crash, SystemExit):
        pass
    return model, begun, history


def result(model: fitkit.Model, begun: list[int], history: dict) -> dict:
    return {"params": full_params(model), "begun": begun, "history": history}


def run_all(out) -> dict:
    """Every case on this rank: ``{"reference_<strategy>": ..., case: {...}}``."""
    os.environ["FITKIT_SIGNAL_SECONDS"] = "1e-9"  # the ranks agree after every step: a SIGTERM stops at one step
    res: dict[str, Any] = {}
    for strategy in ("auto", "fsdp"):
        res[f"reference_{strategy}"] = result(*fit(strategy, []))
    for name, (strategy, freq, how, where) in CASES.items():
        folder = out / name
        stopped, _, _ = fit(
            strategy, [BackupAndRestore(folder, save_freq=freq, delete_checkpoint=False), Stop(how, where)]
        )
        if name == CROSS_SIZE and rank() == 0:
            shutil.copytree(folder, out / "cross_size")
        torch.distributed.barrier()  # the stop (and its copy) is on disk for every rank
        t0 = time.perf_counter()
        relaunched = fit(strategy, [BackupAndRestore(folder)])
        res[name] = {**result(*relaunched), "stopped_at": stopped.global_step, "relaunch_s": time.perf_counter() - t0}
    return res


def tied_gpt(strategy: str = "auto") -> fitkit.Model:
    """A tiny :class:`fitkit.layers.GPT` (vocabulary 16, 8 channels): its head weight is its token
    embedding's. Adam, token cross-entropy."""
    from fitkit.layers import GPT

    torch.manual_seed(5)
    model = fitkit.Model(
        GPT(vocab_size=16, block_size=4, n_layer=1, n_head=2, n_embd=8), device="cpu", strategy=strategy
    )
    model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss="cross_entropy")
    return model
