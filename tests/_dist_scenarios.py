"""Training scenarios that run the same way on one process and under torchrun.

``tests/distributed/test_distributed.py`` runs them on 2 gloo processes (one torchrun launch) and, as the
reference, on one process in the test itself. Batch sizes are per rank: ``GLOBAL_BATCH //
world_size()``, so both runs see the same global batches.
"""

from __future__ import annotations

import collections
import functools
import gc
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import Callback, LambdaCallback, ModelCheckpoint
from fitkit.distributed import already_sharded, rank, world_size

GLOBAL_BATCH = 8
OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.5),
    "adam": functools.partial(torch.optim.Adam, lr=0.01),
}


def data(n: int, seed: int = 0):
    """``(x, y, w)``: ``(n, 3)`` inputs, ``(n, 1)`` noisy linear targets, ``(n,)`` weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1 * torch.randn(n, 1, generator=g)
    w = torch.rand(n, generator=g) + 0.5
    return x, y, w


def net() -> nn.Module:
    """Linear-Tanh-Linear with weights from a private generator (the same on every rank)."""
    g = torch.Generator().manual_seed(1234)
    module = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def full_params(model: fitkit.Model) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded (``full_tensor()`` of FSDP's DTensors: a collective)."""
    out = {}
    for name, p in model.module.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def trained(
    optimizer: str,
    n: int,
    *,
    weighted: bool = False,
    strategy: str = "auto",
    accumulation: int = 1,
    epochs: int = 3,
    callbacks=None,
):
    """Fit with shuffling and validation; return the model and its History."""
    torch.manual_seed(0)
    x, y, w = data(n)
    xv, yv, _ = data(11, seed=1)
    model = fitkit.Model(net(), device="cpu", strategy=strategy)
    model.compile(
        optimizer=OPTIMIZERS[optimizer], loss="mse", metrics=["mae"], gradient_accumulation_steps=accumulation
    )
    history = model.fit(
        x,
        y,
        sample_weight=w if weighted else None,
        batch_size=GLOBAL_BATCH // world_size(),
        epochs=epochs,
        shuffle=True,
        validation_data=(xv, yv),
        verbose=0,
        callbacks=callbacks,
    )
    return model, history


def parity(optimizer: str, n: int, **kwargs) -> dict:
    model, history = trained(optimizer, n, **kwargs)
    return {"params": full_params(model), "history": history.history}


def identity_model(strategy: str = "auto") -> fitkit.Model:
    lin = nn.Linear(1, 1)
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.bias.zero_()
    model = fitkit.Model(lin, device="cpu", strategy=strategy)
    model.compile(optimizer="sgd", loss="mae", metrics=["mae"])
    return model


def exact_evaluate(strategy: str = "auto") -> dict:
    """x = [0, 1, 2, 3, 4], y_pred = x, targets 0, MAE, batch 2: exactly 2.0 everywhere."""
    model = identity_model(strategy)
    x, y = torch.arange(5.0).unsqueeze(1), torch.zeros(5, 1)
    r, w = rank(), world_size()
    return {
        "tensors": model.evaluate(x, y, batch_size=2, verbose=0),
        "dataloader": model.evaluate(DataLoader(TensorDataset(x, y), batch_size=2), verbose=0),
        "dataset": model.evaluate(TensorDataset(x, y), batch_size=2, verbose=0),
        "shuffled_dataloader": model.evaluate(DataLoader(TensorDataset(x, y), batch_size=2, shuffle=True), verbose=0),
        "already_sharded": model.evaluate(already_sharded(x[r::w]), y[r::w], batch_size=2, verbose=0),
    }


class TwoHeads(nn.Module):
    def forward(self, x):
        return {"same": x, "double": 2 * x}


Heads = collections.namedtuple("Heads", "same double")


class NamedHeads(nn.Module):
    def forward(self, x):
        return Heads(x, 2 * x)


def exact_predict(strategy: str = "auto") -> dict:
    """5 samples over the ranks: 5 rows, in input order."""
    model = identity_model(strategy)
    x = torch.arange(5.0).unsqueeze(1)
    heads = fitkit.Model(TwoHeads(), device="cpu")
    return {
        "tensors": model.predict(x, batch_size=2, verbose=0),
        "dataloader": model.predict(DataLoader(TensorDataset(x), batch_size=2), verbose=0),
        "xy_batches": model.predict(DataLoader(TensorDataset(x, torch.zeros(5)), batch_size=3), verbose=0),
        "dict_outputs": heads.predict(x, batch_size=1, verbose=0),
        "namedtuple_outputs": fitkit.Model(NamedHeads(), device="cpu").predict(x, batch_size=1, verbose=0),
    }


def stop_on_one_rank() -> dict:
    """``stop_training`` set on the last rank only stops every rank at the same point."""
    last = world_size() - 1
    at_epoch_end = LambdaCallback(on_epoch_end=lambda epoch, logs: rank() == last and _stop(cb_model))
    mid_epoch = LambdaCallback(  # from the first batch of epoch 1 on: honoured at that epoch's end
        on_train_batch_end=lambda batch, logs: rank() == last and cb_model.epoch == 1 and _stop(cb_model)
    )
    out = {}
    for name, cb in (("epoch_end", at_epoch_end), ("mid_epoch", mid_epoch)):
        torch.manual_seed(0)
        x, y, _ = data(20)
        cb_model = fitkit.Model(net(), device="cpu")
        cb_model.compile(optimizer=OPTIMIZERS["sgd"], loss="mse")
        out[name] = cb_model.fit(x, y, batch_size=4, epochs=3, callbacks=[cb], verbose=0).epoch
    return out


def _stop(model: fitkit.Model) -> None:
    model.stop_training = True


def unshardable_error() -> str:
    model = identity_model()
    batches = [(torch.zeros(2, 1), torch.zeros(2, 1))]
    try:
        model.fit(batches, epochs=1, verbose=0)
    except ValueError as e:
        return str(e)
    return ""


def checkpoint_epochs(path, strategy: str = "auto", ckpt_dir=None) -> dict:
    """2 of 3 epochs with Adam, then a checkpoint (every rank calls; rank 0 writes)."""
    callbacks = None
    if ckpt_dir is not None:
        callbacks = [ModelCheckpoint(str(ckpt_dir / "ck-{epoch}.pt"), monitor="val_loss")]
    model, history = trained("adam", 37, strategy=strategy, epochs=2, callbacks=callbacks)
    model.save_checkpoint(path)
    return {"params": full_params(model)}


def resume(path, epochs: int = 3, strategy: str = "auto") -> dict:
    """Load a checkpoint (written at any world size) and train to ``epochs``."""
    torch.manual_seed(0)
    x, y, _ = data(37)
    xv, yv, _ = data(11, seed=1)
    model = fitkit.Model(net(), device="cpu", strategy=strategy)
    model.compile(optimizer=OPTIMIZERS["adam"], loss="mse", metrics=["mae"])
    start = model.load_checkpoint(path)
    loaded = full_params(model)
    history = model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH // world_size(),
        initial_epoch=start,
        epochs=epochs,
        shuffle=True,
        validation_data=(xv, yv),
        verbose=0,
    )
    return {"start": start, "loaded": loaded, "params": full_params(model), "history": history.history}


def parity_loader(n: int = 37) -> dict:
    """Fit on DataLoaders. Unshuffled, rank r's batch s holds positions 8s + r, 8s + r + 2, ...
    (the shares interleave), so the global batches are one process's batches of 8; the sample
    repeated for rank 1 is cut off. Shuffled: the order is the one one process's RandomSampler
    draws, so the global batches are one process's too."""
    torch.manual_seed(0)
    x, y, _ = data(n)
    xv, yv, _ = data(11, seed=1)
    bs = GLOBAL_BATCH // world_size()
    model = fitkit.Model(net(), device="cpu")
    model.compile(optimizer=OPTIMIZERS["adam"], loss="mse", metrics=["mae"])
    history = model.fit(
        DataLoader(TensorDataset(x, y), batch_size=bs),
        epochs=3,
        verbose=0,
        validation_data=DataLoader(TensorDataset(xv, yv), batch_size=bs),
    )
    out = {"params": full_params(model), "history": history.history}
    model.fit(DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True), epochs=2, verbose=0)
    out["shuffled_params"] = full_params(model)
    return out


def token_data(n: int = 21, t: int = 5, classes: int = 4):
    """``(x, y, w)`` for a per-position classifier: ``(n, t, 3)`` inputs, ``(n, t)`` class targets
    padded with -100 to lengths 0..t (rows 0 and 1 hold no real token), ``(n,)`` weights."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, t, 3, generator=g)
    y = torch.randint(0, classes, (n, t), generator=g)
    lengths = torch.randint(0, t + 1, (n,), generator=g)
    lengths[:2] = 0
    y[torch.arange(t)[None, :] >= lengths[:, None]] = -100
    w = torch.rand(n, generator=g) + 0.5
    return x, y, w


class PerPosition(nn.Module):
    """Linear(3, 4) at every position: logits ``(B, T, 4)``, or ``(B, 4, T)`` with ``channels_first``."""

    def __init__(self, channels_first: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(99)
        self.linear = nn.Linear(3, 4)
        with torch.no_grad():
            for p in self.linear.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.channels_first = channels_first

    def forward(self, x):
        out = self.linear(x)
        return out.transpose(1, 2) if self.channels_first else out


def tokens(case: str, batch_size: int | None = None, accumulation: int = 2) -> dict:
    """Token-level cross-entropy with accumulation: ``case`` picks the weights.

    ``plain``: none; ``weighted``: ``(n,)`` sample weights; ``per_token``: ``(n, t)`` weights;
    ``class_weight``: ``{0: 1, 1: 3, 2: 0.5, 3: 2}`` per token; ``channels_first``: logits
    ``(B, C, T)``; ``zero_window``: unshuffled, the first 16 rows weigh 0 (the first window of 2
    global batches of 8 counts nothing).
    """
    torch.manual_seed(0)
    x, y, w = token_data()
    kw: dict = {}
    if case == "weighted":
        kw["sample_weight"] = w
    elif case == "per_token":
        kw["sample_weight"] = (w[:, None] * torch.arange(1, 6)).remainder(2.0)
    elif case == "class_weight":
        kw["class_weight"] = {0: 1, 1: 3, 2: 0.5, 3: 2}
    elif case == "zero_window":
        kw["sample_weight"] = torch.cat([torch.zeros(16), w[16:]])
    model = fitkit.Model(PerPosition(case == "channels_first"), device="cpu")
    model.compile(optimizer=OPTIMIZERS["sgd"], loss="cross_entropy", gradient_accumulation_steps=accumulation)
    bs = batch_size if batch_size is not None else GLOBAL_BATCH // world_size()
    history = model.fit(x, y, batch_size=bs, epochs=2, shuffle=case != "zero_window", verbose=0, **kw)
    ev_w = kw.get("sample_weight")
    ev = model.evaluate(x, y, batch_size=max(1, bs // 2), sample_weight=ev_w, verbose=0)
    return {"params": full_params(model), "history": history.history, "evaluate": ev}


class IdRecorder(nn.Module):
    """``net`` that records, per epoch, the sample ids it trains on (``x[:, 0]`` looked up in
    ``data(37)``'s inputs)."""

    def __init__(self, net: nn.Module, n: int = 37):
        super().__init__()
        self.net, self.seen = net, []
        self._ids = {float(v): i for i, v in enumerate(data(n)[0][:, 0])}

    def forward(self, x):
        if self.training and self.seen:
            self.seen[-1] += [self._ids[float(v)] for v in x[:, 0]]
        return self.net(x)

    def epochs(self) -> LambdaCallback:
        """The callback that starts a new list at each epoch."""
        return LambdaCallback(on_epoch_begin=lambda epoch, logs: self.seen.append([]))


class Crash(Exception):
    """What ``resume_case(crash=True)`` raises at step 7, as a crash would stop the job."""


def resume_case(kind: str, backup=None, crash: bool = False, steps_per_epoch: int | None = None) -> dict:
    """Adam on ``data(37)``, shuffled, global batch 8 over the ranks, 3 epochs (5 steps each).

    ``kind``: ``"tensors"`` (in memory) or ``"loader"`` (a shuffled DataLoader over a
    TensorDataset). ``backup``: a ``BackupAndRestore`` folder (a backup every 6 steps: at step 6,
    8 samples into epoch 1); it restores what is there. ``crash``: the job stops at step 7,
    after that backup. Returns this rank's sample ids per epoch and the parameters.

    ``steps_per_epoch=2``: a pass of 5 global batches spans the epochs (2, 2, then 1: the data
    runs out); the backup every 3 steps (at step 3: inside epoch 1, the pass's third batch done),
    the crash at step 4.
    """
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    from fitkit.callbacks import BackupAndRestore

    torch.manual_seed(0)
    x, y, _ = data(37)
    rec = IdRecorder(net())
    model = fitkit.Model(rec, device="cpu")
    model.compile(optimizer=OPTIMIZERS["adam"], loss="mse")
    bs = GLOBAL_BATCH // world_size()
    every, crash_step = (6, 7) if steps_per_epoch is None else (3, 4)
    callbacks = [rec.epochs()]
    if backup is not None:
        callbacks.append(BackupAndRestore(str(backup), save_freq=every, delete_checkpoint=False))

    def crash_at(batch, logs):
        if model.global_step == crash_step:
            raise Crash

    if crash:
        callbacks.append(LambdaCallback(on_train_batch_end=crash_at))
    if kind == "tensors":
        args, kw = (x, y), {"batch_size": bs, "shuffle": True}
    else:
        args, kw = (DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True),), {}
    try:
        with warnings.catch_warnings():  # steps_per_epoch: the pass runs out in epoch 3 (one warning)
            warnings.simplefilter("ignore", fitkit.FitkitWarning)
            model.fit(*args, **kw, epochs=3, steps_per_epoch=steps_per_epoch, verbose=0, callbacks=callbacks)
    except Crash:
        pass
    return {"ids": rec.seen, "params": [p.detach().clone() for p in rec.net.parameters()]}


class Grab(Callback):
    """Weak references to what one fit hands out: the training DeviceLoader, this rank's shards
    (``batches``) and, for in-memory data, the float32 copy fit made of float64 inputs."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.fail, self.refs = fail, {}

    def on_train_begin(self, logs=None):
        loader = self.params["train_data"]
        self.refs = {"loader": weakref.ref(loader), "shards": weakref.ref(loader.batches)}
        if hasattr(loader.batches, "x"):  # in-memory data: the cast copies
            self.refs.update(x=weakref.ref(loader.batches.x), y=weakref.ref(loader.batches.y))

    def on_train_batch_end(self, batch, logs=None):
        if self.fail and batch == 1:  # on every rank: the ranks fail together
            raise RuntimeError("boom")


def lifetime() -> dict:
    """What each rank still holds of a fit after it returned or raised: ``{case: {name: alive}}``
    for the loader, the shards, the cast data and the callback (all should be ``False``)."""
    out = {}
    for case in ("tensors", "tensors_raised", "dataloader"):
        torch.manual_seed(0)
        x, y, _ = data(20)
        model = fitkit.Model(net(), device="cpu")
        model.compile(optimizer=OPTIMIZERS["sgd"], loss="mse")
        grab = Grab(fail=case == "tensors_raised")
        # float64 inputs: fit's float32 copy is held by the fit only
        args = (x.double(), y.double()) if case != "dataloader" else (DataLoader(TensorDataset(x, y), batch_size=4),)
        try:
            model.fit(*args, batch_size=4, epochs=2, verbose=0, callbacks=[grab])
        except RuntimeError:
            pass
        refs = {**grab.refs, "callback": weakref.ref(grab)}
        del grab, args
        gc.collect()
        out[case] = {name: ref() is not None for name, ref in refs.items()}
    return out


class EpochBuckets(torch.utils.data.Sampler):
    """This rank's buckets of neighbouring rows in an order seeded by the epoch it was told."""

    def __init__(self, rows: list[int], batch_size: int):
        self.buckets = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
        self.epoch, self.epochs = 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        order = torch.randperm(len(self.buckets), generator=torch.Generator().manual_seed(self.epoch))
        return iter([self.buckets[i] for i in order.tolist()])


def batch_sampler_epochs() -> dict:
    """An ``already_sharded`` DataLoader with a batch sampler of this rank's rows: the epochs it
    was told in a fit of 3 epochs, and in one that starts at ``initial_epoch=2``."""
    x, y, _ = data(16)
    out = {}
    for name, start in (("fit", 0), ("initial_epoch_2", 2)):
        buckets = EpochBuckets(list(range(rank(), 16, world_size())), 2)
        model = fitkit.Model(net(), device="cpu")
        model.compile(optimizer=OPTIMIZERS["sgd"], loss="mse")
        loader = DataLoader(TensorDataset(x, y), batch_sampler=buckets)
        model.fit(already_sharded(loader), initial_epoch=start, epochs=3, verbose=0)
        out[name] = buckets.epochs
    return out


def sum_reduction(accumulation: int = 2) -> dict:
    """``nn.MSELoss(reduction="sum")``: the step's gradient is the sum over the window and the
    ranks (16 rows, global batch 8, 2 windows of 2 micro-batches: one step per 16 rows)."""
    x, y, _ = data(32)
    model = fitkit.Model(net(), device="cpu")
    model.compile(
        optimizer=functools.partial(torch.optim.SGD, lr=0.001),
        loss=nn.MSELoss(reduction="sum"),
        gradient_accumulation_steps=accumulation,
    )
    history = model.fit(x, y, batch_size=GLOBAL_BATCH // world_size(), shuffle=False, epochs=1, verbose=0)
    return {"params": full_params(model), "loss": history.history["loss"], "steps": model.global_step}


class _Unused(nn.Module):
    """``net()`` with a second head the loss never reaches (a parameter without a gradient)."""

    def __init__(self):
        super().__init__()
        self.body, self.spare = net(), nn.Linear(3, 1)
        with torch.no_grad():  # the same values on every rank and in the one-process reference
            self.spare.weight.fill_(0.25)
            self.spare.bias.fill_(-0.5)

    def forward(self, x):
        return self.body(x)


def ddp_options(case: str, fsdp: bool = False) -> dict:
    """``unfreeze``: the first layer frozen at compile, unfrozen by a callback at epoch 2's start
    (DDP must follow: its wrapper is rebuilt); ``unfreeze_mid_epoch``: the same after step 2, in
    the epoch; ``find_unused`` / ``static_graph``: a parameter
    without a gradient, trained with DDP's option (``fsdp``: the unfreezing cases under FSDP,
    which follows the flags by itself). Weights after 3 epochs, no shuffling."""
    from fitkit.distributed import DDP

    x, y, _ = data(32)
    callbacks = []
    if case == "unfreeze":
        module = net()
        module[0].requires_grad_(False)
        unfreeze = LambdaCallback(on_epoch_begin=lambda e, logs: module[0].requires_grad_(True) if e == 1 else None)
        callbacks.append(unfreeze)
        strategy: Any = "auto"
    elif case == "unfreeze_mid_epoch":  # after step 2 of epoch 1's 4: followed from step 3
        module = net()
        module[0].requires_grad_(False)
        callbacks.append(
            LambdaCallback(
                on_train_batch_end=lambda b, logs: module[0].requires_grad_(True) if model.global_step == 2 else None
            )
        )
        strategy = "auto"
    elif case == "bucket_view":
        module, strategy = net(), DDP(gradient_as_bucket_view=True)
    else:
        module = _Unused()
        strategy = DDP(**{"find_unused_parameters" if case == "find_unused" else "static_graph": True})
    model = fitkit.Model(module, device="cpu", strategy="fsdp" if fsdp and world_size() > 1 else strategy)
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.05), loss="mse")
    model.fit(x, y, batch_size=GLOBAL_BATCH // world_size(), epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    return {"params": full_params(model)}


def ce_case(kind: str, callbacks=(), metrics=None) -> dict:
    """Cross-entropy on 37 rows, batches of 8 over all ranks, 1 epoch of SGD, no shuffling:
    ``index`` class targets, ``probabilities`` (one-hot floats) or ``ignored`` (row 5 is
    -100). Returns the parameters, the epoch's loss and the History's logs (with ``metrics``)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(37, 3, generator=g), torch.randint(0, 4, (37,), generator=g)
    if kind == "probabilities":
        y = torch.nn.functional.one_hot(y, 4).float()
    elif kind == "ignored":
        y[5] = -100
    module = nn.Linear(3, 4)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    model = fitkit.Model(module, device="cpu")
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.1), loss="cross_entropy", metrics=metrics)
    h = model.fit(
        x, y, batch_size=GLOBAL_BATCH // world_size(), epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks)
    )
    return {"params": full_params(model), "loss": h.history["loss"][0], "logs": dict(h.history)}


def unused_refused(bucket_view: bool = False) -> dict:
    """``_Unused`` under the default DDP: refused at the first step, nothing applied."""
    from fitkit.distributed import DDP

    x, y, _ = data(16)
    module = _Unused()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    model = fitkit.Model(module, device="cpu", strategy=DDP(gradient_as_bucket_view=True) if bucket_view else "auto")
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.05), loss="mse")
    try:
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    except RuntimeError as e:
        error = str(e)
    else:
        error = ""
    same = all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())
    return {"error": error, "unchanged": same, "step": model.global_step}


def _bn_net() -> nn.Module:
    g = torch.Generator().manual_seed(7)
    module = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def bn_validation() -> dict:
    """BatchNorm under DDP, validated every 2 steps inside the epoch: each validation's numbers
    and the BatchNorm buffers it ran with (captured at ``on_test_begin``)."""
    x, y, _ = data(48)
    xv, yv, _ = data(20, seed=5)
    x = x + torch.arange(48).unsqueeze(1) / 12.0  # rank 1's batches differ from rank 0's in scale
    states: list[dict[str, torch.Tensor]] = []
    capture = LambdaCallback(
        on_test_begin=lambda logs: states.append({k: v.clone() for k, v in model.module.state_dict().items()})
    )
    model = fitkit.Model(_bn_net(), device="cpu")
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.05), loss="mse", metrics=["mae"])
    h = model.fit(
        x,
        y,
        batch_size=4,
        epochs=1,
        shuffle=False,
        verbose=0,
        validation_data=(xv, yv),
        validation_interval=2,
        callbacks=[capture],
    )
    return {"validations": [dict(v) for v in h.validations], "states": states}


def bn_reference(state: dict[str, torch.Tensor]) -> dict:
    """One process: the validation set's loss and MAE under ``state``."""
    xv, yv, _ = data(20, seed=5)
    module = _bn_net()
    module.load_state_dict(state)
    model = fitkit.Model(module, device="cpu")
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model.evaluate(xv, yv, verbose=0, return_dict=True)


def time_budget() -> dict:
    """A Timer of 3 s whose (fake) clock runs 1 s per batch on rank 0 and 0.25 s on rank 1:
    rank 0 spends its budget at step 3, and the ranks stop together where they agree (after
    step 1, then every 8 steps: step 9; 16 steps per epoch, so no epoch end comes first)."""
    import os

    from fitkit.callbacks import Timer

    now = [0.0]
    per_batch = 1.0 if rank() == 0 else 0.25
    tick = LambdaCallback(on_train_batch_begin=lambda b, logs: now.__setitem__(0, now[0] + per_batch))
    timer = Timer(duration=3, clock=lambda: now[0])
    x, y, _ = data(128)
    model = fitkit.Model(net(), device="cpu")
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.01), loss="mse")
    old = os.environ.get("FITKIT_SIGNAL_SECONDS")
    os.environ["FITKIT_SIGNAL_SECONDS"] = "1000"  # agreements by steps only: deterministic
    try:
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[tick, timer])
    finally:
        if old is None:
            os.environ.pop("FITKIT_SIGNAL_SECONDS")
        else:
            os.environ["FITKIT_SIGNAL_SECONDS"] = old
    return {"step": model.global_step, "spent": timer.stopped, "elapsed": timer.elapsed}


def time_validation(folder) -> dict:
    """validation_interval=timedelta(seconds=2.5) and ModelCheckpoint(train_time_interval= the
    same) with fake clocks of 1 s per batch on rank 0 and 0.1 s on rank 1: the ranks agree
    where they agree on signals (after step 1, then every 8 steps) and validate and save after
    the next step, together."""
    import datetime
    import os

    from fitkit.training.step_validation import ValidationInterval

    now = [0.0]
    per_batch = 1.0 if rank() == 0 else 0.1
    tick = LambdaCallback(on_train_batch_begin=lambda b, logs: now.__setitem__(0, now[0] + per_batch))
    real = ValidationInterval.clock
    ValidationInterval.clock = staticmethod(lambda: now[0])
    old = os.environ.get("FITKIT_SIGNAL_SECONDS")
    os.environ["FITKIT_SIGNAL_SECONDS"] = "1000"  # agreements by steps only: deterministic
    x, y, _ = data(128)
    model = fitkit.Model(net(), device="cpu")
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.01), loss="mse")
    try:
        ck = ModelCheckpoint(
            folder / "m-{step}.pt",
            monitor="loss",
            keep_last=10,
            clock=lambda: now[0],
            train_time_interval=datetime.timedelta(seconds=2.5),
        )
        h = model.fit(
            x,
            y,
            batch_size=4,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[tick, ck],
            validation_data=(x[:16], y[:16]),
            validation_interval=datetime.timedelta(seconds=2.5),
        )
    finally:
        ValidationInterval.clock = real
        if old is None:
            os.environ.pop("FITKIT_SIGNAL_SECONDS")
        else:
            os.environ["FITKIT_SIGNAL_SECONDS"] = old
    return {
        "validations": [(v["step"], v["val_loss"]) for v in h.validations],
        "steps": model.global_step,
        "saved": [os.path.basename(p) for p in ck.recent],
    }


def own_items(loss: Any = None) -> dict:
    """A tiny GPT-2 computing its own loss (it takes num_items_in_batch) on 4 sequences whose
    counted label tokens are 4, 1, 3, 2: batches of 2 over all ranks, SGD, one epoch. On 2 ranks
    each step's gradient is the mean over the step's counted tokens of both ranks, as one process
    with batches of 2 computes it. ``loss``: a compiled loss instead (it shifts the labels as the
    model's own loss does). Returns the parameters and the epoch loss."""
    import transformers

    transformers.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 32, (4, 6), generator=g)
    labels = ids.clone()
    for row, counted in enumerate((4, 1, 3, 2)):
        labels[row, 1 + counted :] = -100  # the causal shift: positions 1..counted count
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
    net = transformers.GPT2LMHeadModel(cfg)
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.5), loss=loss)
    h = model.fit(
        {"input_ids": ids, "labels": labels},
        batch_size=GLOBAL_BATCH // 4 // world_size(),
        epochs=1,
        shuffle=False,
        verbose=0,
    )
    return {"params": full_params(model), "loss": h.history["loss"][0]}


def tokens_seen() -> dict:
    """TokensSeen over 33 sequences of 3 tokens (the last global batch uneven), 2 epochs:
    the global count on every rank, as on one process."""
    from fitkit.callbacks import TokensSeen

    torch.manual_seed(0)
    module = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 1))
    model = fitkit.Model(module, device="cpu")
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.01), loss="mse")
    x = torch.arange(99).remainder(10).reshape(33, 3)
    h = model.fit(
        x, torch.zeros(33, 1), batch_size=GLOBAL_BATCH // world_size(), epochs=2, verbose=0, callbacks=[TokensSeen()]
    )
    return {"seen": h.history["num_input_tokens_seen"]}


def data_budget_errors() -> list[str]:
    """max_tokens / max_samples on data marked already_sharded: this rank's share, so the global
    counts are unknown before the fit; the messages, or "" where a fit ran."""
    x, y = torch.arange(24).remainder(10).reshape(8, 3), torch.zeros(8, 1)
    r, w = rank(), world_size()
    errors = []
    for budget in ({"max_tokens": 12}, {"max_samples": 4}):
        model = fitkit.Model(nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 1)), device="cpu")
        model.compile(optimizer="sgd", loss="mse")
        try:
            model.fit(already_sharded(x[r::w]), y[r::w], batch_size=2, verbose=0, **budget)
            errors.append("")
        except ValueError as e:
            errors.append(str(e) if model.global_step == 0 else f"after step {model.global_step}: {e}")
    return errors


def token_budget() -> dict:
    """fit(max_tokens=150) over 33 sequences of 3 tokens, accumulation 2: global batches of
    24, 24, 24, 24 and 3 tokens, windows of 48, 48 and 3 (99 an epoch); the budget is global."""
    from fitkit.callbacks import TokensSeen

    torch.manual_seed(0)
    module = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 1))
    model = fitkit.Model(module, device="cpu")
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.01), loss="mse", gradient_accumulation_steps=2)
    x = torch.arange(99).remainder(10).reshape(33, 3)
    y = x.float().mean(1, keepdim=True) / 10
    h = model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH // world_size(),
        max_tokens=150,
        shuffle=False,
        verbose=0,
        callbacks=[TokensSeen()],
    )
    return {
        "steps": model.global_step,
        "total_steps": h.params["total_steps"],
        "epochs": h.epoch,
        "seen": h.history["num_input_tokens_seen"],
        "params": full_params(model),
    }


class OwnTokenLoss(nn.Module):
    """Linear(3, 4) logits; given ``labels``, its own loss: the summed cross-entropy of the
    labels that are not -100 divided by ``num_items_in_batch`` (the Transformers convention;
    without it, their mean)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.linear = nn.Linear(3, 4)
        with torch.no_grad():
            for p in self.linear.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x, labels=None, num_items_in_batch=None):
        logits = self.linear(x)
        if labels is None:
            return logits
        if num_items_in_batch is None:
            return {"loss": nn.functional.cross_entropy(logits, labels, ignore_index=-100), "logits": logits}
        total = nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        return {"loss": total / num_items_in_batch, "logits": logits}


def counted_then_own(strategy: str = "auto") -> dict:
    """One Model, two fits of 8 rows in global batches of 4, SGD, no shuffling. Fit 1: the
    compiled cross-entropy on class targets where row 4 (the last batch's first) is -100, so the
    ranks' counts of that last step differ (1 and 2 under torchrun: the count rides in FSDP's
    reduce-scatter). Fit 2, after ``compile(loss=None)``: the module's own loss taking
    ``num_items_in_batch``, labels with -100 in rows 1 and 6: 3 counted labels in each global
    batch (one process without accumulation averages its batches' own means into the epoch
    loss, torchrun weighs them by their labels: equal counts give both the same). Returns fit
    2's parameters and epoch loss, fit 1's epoch loss, and whether fit 1's count rode in the
    gradient reduction (the count hook / reduce-scatter installed)."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(8, 3, generator=g)
    y = torch.randint(0, 4, (8,), generator=g)
    y[4] = -100
    labels = torch.randint(0, 4, (8,), generator=g)
    labels[[1, 6]] = -100
    model = fitkit.Model(OwnTokenLoss(), device="cpu", strategy=strategy)
    sgd = functools.partial(torch.optim.SGD, lr=0.5)
    bs = 4 // world_size()
    model.compile(optimizer=sgd, loss="cross_entropy")
    first = model.fit(x, y, batch_size=bs, epochs=1, shuffle=False, verbose=0).history["loss"][0]
    parallel = model._core.parallel  # under torchrun: fit 1's count rode in the gradient reduction
    counted = parallel is not None and parallel.carries_count() and parallel.counted is not None
    model.compile(optimizer=sgd, loss=None)
    h = model.fit({"x": x, "labels": labels}, batch_size=bs, epochs=1, shuffle=False, verbose=0)
    return {"params": full_params(model), "loss": h.history["loss"][0], "first": first, "counted": counted}


def bf16_root(mixed_precision: Any = torch.bfloat16, wrap: Any = None) -> dict:
    """Linear(3, 8)-ReLU-Linear(8, 1) under ``FSDP(mixed_precision=..., wrap=...)`` (default
    wrap: the first Linear is a unit, the root holds the last), MSE, SGD, 2 epochs of 16 rows
    in global batches of 8, no shuffling (one process: plain float32 training). Returns the
    epoch losses, the full parameters and the dtypes a forward of 4 rows shows after the fit:
    the first Linear's output, the last Linear's weight, input and output, the module's output."""
    from fitkit.distributed import FSDP

    g = torch.Generator().manual_seed(21)
    module = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x = torch.randn(16, 3, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
    first = module[0]
    strategy = FSDP(wrap=(lambda m: m is first) if wrap is None else wrap, mixed_precision=mixed_precision)
    model = fitkit.Model(module, device="cpu", strategy=strategy)
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.05), loss="mse")
    h = model.fit(x, y, batch_size=GLOBAL_BATCH // world_size(), epochs=2, shuffle=False, verbose=0)
    params = full_params(model)  # before the forward below: FSDP's root stays gathered after it
    seen: dict[str, Any] = {}
    hooks = [
        module[0].register_forward_hook(lambda m, i, o: seen.__setitem__("unit_out", o.dtype)),
        module[2].register_forward_hook(
            lambda m, i, o: seen.__setitem__("head", (m.weight.dtype, i[0].dtype, o.dtype))
        ),
    ]
    with torch.no_grad():
        seen["out"] = module(x[:4]).dtype
    for hook in hooks:
        hook.remove()
    return {"loss": h.history["loss"], "params": params, "dtypes": seen}


def _terms_model() -> tuple[fitkit.Model, Any]:
    """``net()`` compiled with a loss of two terms (the MSE and an L1 penalty on the first layer's
    weights), SGD, windows of 3 batches."""
    module = net()

    def loss(out, target):
        return {"mse": nn.functional.mse_loss(out, target), "l1": 0.01 * module[0].weight.abs().sum()}

    model = fitkit.Model(module, device="cpu")
    model.compile(optimizer=functools.partial(torch.optim.SGD, lr=0.05), loss=loss, gradient_accumulation_steps=3)
    return model, loss


def loss_terms(checkpoint=None) -> dict:
    """A loss of two terms (``_terms_model``) on ``data(37)``, global batch 8 (the last one 5 rows:
    3 + 2 over the ranks), windows of 3 batches (the second short), 2 epochs, validation on
    ``data(11, seed=1)``: the weights, and every term's epoch means (``loss_mse``, ``loss_l1``,
    ``val_...``) over all ranks. ``checkpoint``: a path where a checkpoint is taken at the end of
    epoch 0's first window, inside the epoch (every rank calls; rank 0 writes)."""
    x, y, _ = data(37)
    xv, yv, _ = data(11, seed=1)
    model, _ = _terms_model()
    callbacks = []
    if checkpoint is not None:

        def save(batch, logs):
            if batch == 2 and model.epoch == 0:  # the first window's end (step 1), 3 of the 5 batches
                model.save_checkpoint(checkpoint)

        callbacks.append(LambdaCallback(on_train_batch_end=save))
    per_rank = GLOBAL_BATCH // world_size()
    history = model.fit(
        x, y, batch_size=per_rank, epochs=2, shuffle=False, verbose=0, validation_data=(xv, yv), callbacks=callbacks
    )
    evaluated = model.evaluate(xv, yv, batch_size=per_rank, verbose=0)
    return {"params": full_params(model), "history": history.history, "evaluate": evaluated, "steps": model.global_step}


def loss_terms_resumed(checkpoint) -> dict:
    """``loss_terms`` resumed from its checkpoint inside epoch 0 (on this process)."""
    x, y, _ = data(37)
    xv, yv, _ = data(11, seed=1)
    model, _ = _terms_model()
    model.load_checkpoint(checkpoint)
    per_rank = GLOBAL_BATCH // world_size()
    history = model.fit(x, y, batch_size=per_rank, epochs=2, shuffle=False, verbose=0, validation_data=(xv, yv))
    return {"params": full_params(model), "history": history.history}
