"""Quick runs: fast_dev_run, overfit_batches, limit_train_batches / limit_val_batches and
num_sanity_val_steps (Lightning's flags), with the batches each one runs recorded by id."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import (
    BackupAndRestore,
    Callback,
    CSVLogger,
    LambdaCallback,
    ModelCheckpoint,
    TensorBoard,
)


class Ids(nn.Module):
    """A linear model on ``x[:, 1:]`` that records the sample ids (``x[:, 0]``) of every batch,
    by phase, once ``recording`` is on (the preflight's first-batch checks stay out)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 1)
        self.recording = False
        self.seen: list[tuple[str, list[int]]] = []

    def forward(self, x):
        if self.recording:
            self.seen.append(("train" if self.training else "val", x[:, 0].long().tolist()))
        return self.lin(x[:, 1:])

    def batches(self, phase: str) -> list[list[int]]:
        return [ids for p, ids in self.seen if p == phase]


def _data(n: int):
    x = torch.stack([torch.arange(n, dtype=torch.float32), torch.linspace(-1, 1, n)], 1)
    return x, 2 * x[:, 1:] + 1


def _model(seed: int = 0) -> tuple[fitkit.Model, Ids]:
    torch.manual_seed(seed)
    net = Ids()
    model = fitkit.Model(net, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
    return model, net


def _record(net: Ids) -> LambdaCallback:
    return LambdaCallback(on_train_begin=lambda logs: setattr(net, "recording", True))


def _chunks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


# -- limit_train_batches / limit_val_batches ------------------------------------------------------
def test_limit_train_batches_int_takes_the_first_batches_of_every_epoch():
    model, net = _model()
    x, y = _data(20)
    steps = []
    cb = LambdaCallback(on_epoch_begin=lambda e, logs: steps.append(model.history.params["steps"]))
    model.fit(
        x, y, batch_size=2, epochs=2, shuffle=False, limit_train_batches=3, verbose=0, callbacks=[_record(net), cb]
    )
    assert net.batches("train") == [[0, 1], [2, 3], [4, 5]] * 2
    assert model.global_step == 6 and steps == [3, 3]


def test_limit_train_batches_fraction_is_the_first_batches_of_each_shuffled_epoch():
    x, y = _data(20)
    full, fnet = _model()
    full.fit(x, y, batch_size=2, epochs=3, verbose=0, callbacks=[_record(fnet)])
    part, pnet = _model()
    part.fit(x, y, batch_size=2, epochs=3, limit_train_batches=0.25, verbose=0, callbacks=[_record(pnet)])
    per_epoch = [fnet.batches("train")[10 * e : 10 * e + 2] for e in range(3)]  # int(0.25 * 10) = 2
    assert pnet.batches("train") == [b for epoch in per_epoch for b in epoch]
    assert per_epoch[0] != per_epoch[1]  # Lightning's rule: shuffled data, another subset each epoch
    assert part.global_step == 6


def test_limit_val_batches_int_fraction_and_zero():
    x, y = _data(20)
    vx, vy = _data(10)
    for limit, expected in ((2, [[0, 1], [2, 3]]), (0.6, [[0, 1], [2, 3], [4, 5]])):  # int(0.6 * 5) = 3
        model, net = _model()
        h = model.fit(
            x,
            y,
            batch_size=2,
            epochs=1,
            validation_data=(vx, vy),
            limit_val_batches=limit,
            verbose=0,
            callbacks=[_record(net)],
        )
        assert net.batches("val") == expected
        # val_loss: the exact mean over the limited batches, as evaluate over those samples
        n = sum(len(b) for b in expected)
        assert h.history["val_loss"] == [model.evaluate(vx[:n], vy[:n], batch_size=2, verbose=0)["loss"]]
    model, net = _model()
    h = model.fit(
        x, y, batch_size=2, epochs=1, validation_data=(vx, vy), limit_val_batches=0, verbose=0, callbacks=[_record(net)]
    )
    assert net.batches("val") == [] and "val_loss" not in h.history  # Lightning: 0 turns validation off


def test_limit_batches_bad_values_and_conflicts_change_nothing():
    x, y = _data(20)
    model, net = _model()
    before = [p.detach().clone() for p in net.parameters()]
    cases = [
        ({"limit_train_batches": 0}, ValueError, "limit_train_batches"),
        ({"limit_train_batches": 1.5}, ValueError, "limit_train_batches"),
        ({"limit_train_batches": "3"}, TypeError, "limit_train_batches"),
        ({"limit_train_batches": 0.01}, ValueError, r"int\(0.01 \* 10\) = 0 batches"),
        ({"limit_train_batches": 2, "steps_per_epoch": 5}, ValueError, "both set the batches of an epoch"),
        ({"limit_val_batches": 2, "validation_steps": 1}, ValueError, "both set the batches of a validation"),
        ({"fast_dev_run": True, "limit_train_batches": 2}, ValueError, "fast_dev_run=True and limit_train_batches"),
        ({"overfit_batches": 2, "limit_val_batches": 1}, ValueError, "overfit_batches=2 and limit_val_batches"),
        ({"fast_dev_run": -1}, ValueError, "fast_dev_run"),
        ({"num_sanity_val_steps": -2}, ValueError, "num_sanity_val_steps"),
        ({"num_sanity_val_steps": 1.0}, TypeError, "num_sanity_val_steps"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            model.fit(x, y, batch_size=2, validation_data=(x, y), verbose=0, **kwargs)
    with pytest.raises(ValueError, match="the data has no length"):
        model.fit(iter([(x[:2], y[:2])] * 3), limit_train_batches=0.5, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert model.global_step == 0


def test_limit_train_batches_on_an_iterable_without_length():
    model, net = _model()
    x, y = _data(12)
    batches = [(x[i : i + 2], y[i : i + 2]) for i in range(0, 12, 2)]
    model.fit((b for b in batches), limit_train_batches=4, verbose=0, callbacks=[_record(net)])
    assert net.batches("train") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_limit_train_batches_resumes_exactly_after_a_crash(tmp_path):
    x, y = _data(20)

    def run(crash: bool, backup) -> fitkit.Model:
        model, _ = _model()

        def stop(batch, logs):
            if crash and model.global_step == 5:  # inside epoch 1 (4 batches per epoch)
                raise KeyboardInterrupt

        cbs = [BackupAndRestore(str(backup), save_freq=1), LambdaCallback(on_train_batch_end=stop)]
        try:
            model.fit(x, y, batch_size=2, epochs=3, limit_train_batches=4, verbose=0, callbacks=cbs)
        except KeyboardInterrupt:
            pass
        return model

    straight = run(False, tmp_path / "a")
    run(True, tmp_path / "b")
    resumed = run(False, tmp_path / "b")
    assert resumed.global_step == straight.global_step == 12
    pairs = zip(straight.module.parameters(), resumed.module.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert resumed.history.history["loss"] == straight.history.history["loss"]


# -- overfit_batches ------------------------------------------------------------------------------
def test_overfit_batches_trains_and_validates_on_the_same_first_batches_every_epoch():
    x, y = _data(20)
    vx, vy = _data(10)
    model, net = _model()
    model.fit(
        x, y, batch_size=2, epochs=3, validation_data=(vx, vy), overfit_batches=2, verbose=0, callbacks=[_record(net)]
    )  # (shuffle=True, the default, is turned off)
    assert net.batches("train") == [[0, 1], [2, 3]] * 3
    assert net.batches("val") == [[0, 1], [2, 3]] * 3  # Lightning: the validation data's first n batches
    model, net = _model()
    model.fit(x, y, batch_size=2, epochs=2, overfit_batches=0.2, verbose=0, callbacks=[_record(net)])
    assert net.batches("train") == [[0, 1], [2, 3]] * 2  # int(0.2 * 10) = 2


def test_overfit_batches_refuses_data_whose_batches_change():
    x, y = _data(8)
    model, _ = _model()
    with pytest.raises(ValueError, match="shuffle=False"):
        model.fit(DataLoader(TensorDataset(x, y), batch_size=2, shuffle=True), overfit_batches=2, verbose=0)
    with pytest.raises(ValueError, match="one-shot iterator"):
        model.fit(((x[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)), overfit_batches=2, verbose=0)
    model.fit(DataLoader(TensorDataset(x, y), batch_size=2), overfit_batches=1, epochs=2, verbose=0)
    assert model.global_step == 2


# -- fast_dev_run ---------------------------------------------------------------------------------
class Writes(Callback):
    skip_in_fast_dev_run = True  # a callback of the user's that writes: left out too
    calls = 0

    def on_train_begin(self, logs=None):
        Writes.calls += 1


@pytest.mark.parametrize("value, n", [(True, 1), (3, 3)])
def test_fast_dev_run_runs_n_batches_writes_no_file_and_overrides_the_budget(tmp_path, value, n):
    x, y = _data(20)
    vx, vy = _data(10)

    def run(folder, **kwargs) -> tuple[fitkit.Model, Ids, fitkit.History]:
        model, net = _model()
        callbacks = [
            ModelCheckpoint(str(folder / "ckpt" / "e{epoch}.pt"), monitor="val_loss"),
            BackupAndRestore(str(folder / "backup"), save_freq=1, delete_checkpoint=False),
            CSVLogger(str(folder / "log.csv")),
            TensorBoard(str(folder / "tb")),
            Writes(),
            _record(net),
        ]
        h = model.fit(
            x, y, batch_size=2, validation_data=(vx, vy), shuffle=False, verbose=0, callbacks=callbacks, **kwargs
        )
        return model, net, h

    Writes.calls = 0
    run(tmp_path / "real", epochs=1)  # the same callbacks without fast_dev_run: they write
    assert {p.name for p in (tmp_path / "real").iterdir()} == {"ckpt", "backup", "log.csv", "tb"}
    assert Writes.calls == 1
    model, net, h = run(
        tmp_path / "dev", epochs=100, max_steps=50, validation_freq=5, num_sanity_val_steps=2, fast_dev_run=value
    )
    assert [ids[0] for ids in net.batches("train")] == list(range(0, 2 * n, 2))  # n batches, one epoch
    assert [ids[0] for ids in net.batches("val")] == list(range(0, 2 * n, 2))  # one validation, n batches
    assert h.epoch == [0] and model.global_step == n and len(h.history["val_loss"]) == 1
    assert not (tmp_path / "dev").exists()  # no file, no folder
    assert Writes.calls == 1


# -- num_sanity_val_steps -------------------------------------------------------------------------
class BrokenValidation(fitkit.Model):
    """Validation that breaks on its second batch (the preflight checks the first one only)."""

    def test_step(self, batch):
        if batch[0][0, 0] >= 2:
            raise RuntimeError("broken validation")
        return super().test_step(batch)


def test_sanity_check_fails_before_the_first_step():
    torch.manual_seed(0)
    net = Ids()
    model = BrokenValidation(net, device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    before = [p.detach().clone() for p in net.parameters()]
    steps = []
    x, y = _data(8)
    with pytest.raises(RuntimeError, match="broken validation"):
        model.fit(
            x,
            y,
            batch_size=2,
            validation_data=(x, y),
            num_sanity_val_steps=2,
            verbose=0,
            callbacks=[LambdaCallback(on_train_batch_begin=lambda b, logs: steps.append(b))],
        )
    assert steps == [] and model.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    with pytest.raises(RuntimeError, match="broken validation"):  # without it: after a whole epoch
        model.fit(
            x,
            y,
            batch_size=2,
            validation_data=(x, y),
            verbose=0,
            callbacks=[LambdaCallback(on_train_batch_begin=lambda b, logs: steps.append(b))],
        )
    assert steps == [0, 1, 2, 3] and model.global_step == 4


@pytest.mark.parametrize("n, batches", [(2, 2), (-1, 5)])
def test_sanity_check_runs_n_batches_and_changes_nothing(n, batches):
    x, y = _data(20)
    vx, vy = _data(10)

    def run(sanity: int) -> tuple[fitkit.Model, Ids, list[str]]:
        torch.manual_seed(0)
        net = Ids()
        model = fitkit.Model(nn.Sequential(nn.Dropout(0.5), net), device="cpu")  # dropout: the RNG is used
        model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse", metrics=["mae"])
        net.recording = True
        hooks: list[str] = []
        cb = LambdaCallback(
            on_test_begin=lambda logs: hooks.append("test_begin"),
            on_train_begin=lambda logs: hooks.append("train_begin"),
        )
        model.fit(
            x,
            y,
            batch_size=2,
            epochs=2,
            validation_data=(vx, vy),
            num_sanity_val_steps=sanity,
            verbose=0,
            callbacks=[cb],
        )
        return model, net, hooks

    plain, pnet, phooks = run(0)
    checked, cnet, chooks = run(n)
    i = next(k for k, (a, b) in enumerate(zip(cnet.seen, pnet.seen, strict=False)) if a != b)
    assert cnet.seen[i : i + batches] == [("val", ids) for ids in _chunks(list(range(10)), 2)[:batches]]
    # the same batches, dropout masks and values before and after it
    assert cnet.seen[:i] + cnet.seen[i + batches :] == pnet.seen
    assert all(torch.equal(a, b) for a, b in zip(plain.module.parameters(), checked.module.parameters(), strict=True))
    assert checked.history.history == plain.history.history  # logs nothing
    assert chooks == phooks  # no hook: no on_test_begin before on_train_begin


# -- torchrun: every rank runs the same limited batches ------------------------------------------
QUICK_JOB = """
import sys
from pathlib import Path

import torch
import _dist_scenarios as sc

sys.path.insert(0, str(Path(sc.__file__).parent / "training"))  # this test module's folder
import test_quick_runs as q
from fitkit import distributed

# The first fit of this scenario in a torchrun process trains on other batches than later ones
# (seen without any quick-run option too); a warm-up fit keeps that apart from what is tested here.
q.quick_case(distributed.world_size())
res = {name: q.quick_case(distributed.world_size(), **kw) for name, kw in q.QUICK_CASES.items()}
torch.save(res, OUT / f"rank{distributed.rank()}.pt")
"""

QUICK_CASES = {
    "limits": {"limit_train_batches": 3, "limit_val_batches": 2},
    "fractions": {"limit_train_batches": 0.5, "limit_val_batches": 0.34},  # int(0.5 * 5) = 2, int(0.34 * 3) = 1
    "fast_dev_run": {"fast_dev_run": 2},
    "overfit": {"overfit_batches": 2},
    "sanity": {"num_sanity_val_steps": 2},
}


def quick_case(world: int, **kwargs) -> dict:
    """SGD on 40 samples (5 global batches of 8 over the ranks), validation on 24 (3 batches)."""
    import _dist_scenarios as sc

    torch.manual_seed(0)
    x, y, _ = sc.data(40)
    xv, yv, _ = sc.data(24, seed=1)
    model = fitkit.Model(sc.net(), device="cpu")
    model.compile(optimizer=sc.OPTIMIZERS["sgd"], loss="mse")
    steps: list[int] = []
    vals: list[int] = []
    cb = LambdaCallback(
        on_train_batch_end=lambda b, logs: steps.append(b), on_test_batch_end=lambda b, logs: vals.append(b)
    )
    h = model.fit(x, y, batch_size=8 // world, epochs=2, validation_data=(xv, yv), verbose=0, callbacks=[cb], **kwargs)
    return {
        "params": sc.full_params(model),
        "history": h.history,
        "steps": steps,
        "vals": vals,
        "global_step": model.global_step,
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_quick_runs_under_torchrun_agree_with_one_process(tmp_path):
    from _torchrun import run_torchrun

    run_torchrun(QUICK_JOB, tmp_path, nproc=2, timeout=150)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    expected = {  # (train batches per epoch, validation batches per validation, epochs)
        "limits": (3, 2, 2),
        "fractions": (2, 1, 2),
        "fast_dev_run": (2, 2, 1),
        "overfit": (2, 2, 2),
        "sanity": (5, 3, 2),
    }
    for name, kwargs in QUICK_CASES.items():
        one = quick_case(1, **kwargs)
        train, val, epochs = expected[name]
        for r in (r0, r1):
            got = r[name]
            assert got["steps"] == list(range(train)) * epochs, name
            assert got["vals"] == list(range(val)) * epochs, name  # the sanity batches call no hook
            assert got["global_step"] == one["global_step"] == train * epochs
            assert got["history"].keys() == one["history"].keys()
            for key, values in one["history"].items():
                assert got["history"][key] == pytest.approx(values, rel=0, abs=1e-6), (name, key)
            for k, p in one["params"].items():
                torch.testing.assert_close(got["params"][k], p, rtol=0, atol=1e-6)
        assert all(torch.equal(r0[name]["params"][k], r1[name]["params"][k]) for k in one["params"])
