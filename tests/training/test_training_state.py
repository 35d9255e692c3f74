"""The run's registry of stateful parts: every part checks a checkpoint before any part changes,
and each part takes its state at one defined moment (a part built later gets it at birth)."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import class_data
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import LambdaCallback, ModelCheckpoint
from fitkit.files import CheckpointError, atomic_save, safe_load
from fitkit.files.manifest import write_manifest
from fitkit.files.sharded import STATE_NAME
from fitkit.training.state import RunState


# -- metrics of a resumed epoch ---------------------------------------------------------------------
def _regression(seed: int = 0) -> fitkit.Model:
    torch.manual_seed(seed)
    model = fitkit.Model(nn.Linear(3, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse", metrics=["mae", "mse"])
    return model


def _classifier(seed: int = 0) -> fitkit.Model:
    torch.manual_seed(seed)
    model = fitkit.Model(nn.Linear(4, 3), device="cpu")
    model.compile(optimizer="sgd", loss="cross_entropy", metrics=["accuracy", "f1"])
    return model


def _regression_data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 3, generator=g)
    return x, x.sum(1, keepdim=True) + 0.5


_SOURCES = {
    "DataLoader": lambda x, y: DataLoader(TensorDataset(x, y), batch_size=4),
    "shuffled DataLoader": lambda x, y: DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
    "Dataset": lambda x, y: TensorDataset(x, y),
}


def _resume_mid_epoch(make, source, tmp_path, batch: int = 2):
    """The uninterrupted run's History and the History of a run resumed from a checkpoint taken
    after ``batch + 1`` batches of epoch 1."""
    ref, path = make(), tmp_path / "mid.pt"
    save = LambdaCallback(
        on_train_batch_end=lambda b, logs: ref.epoch == 1 and b == batch and ref.save_checkpoint(path)
    )
    torch.manual_seed(5)
    ref.fit(source(), epochs=3, batch_size=4, verbose=0, callbacks=[save])
    resumed = make(seed=1)
    initial_epoch = resumed.load_checkpoint(path)
    torch.rand(3)  # fit restores the RNG states itself
    resumed.fit(source(), epochs=3, batch_size=4, initial_epoch=initial_epoch, verbose=0)
    return ref.history.history, resumed.history.history


@pytest.mark.parametrize("kind", sorted(_SOURCES))
def test_the_metrics_of_a_resumed_epoch_count_the_batches_before_the_checkpoint(tmp_path, kind):
    x, y = _regression_data()
    ref, resumed = _resume_mid_epoch(_regression, lambda: _SOURCES[kind](x, y), tmp_path)
    assert resumed == ref  # every key, bit for bit: loss, mae, mse of epochs 1 and 2


def test_the_metrics_of_a_resumed_epoch_have_the_values_of_the_whole_epoch(tmp_path):
    # A zero model and a regression target the metrics can be computed by hand on: epoch 0
    # trains nothing (lr 0), so epoch 1's mae is the mean |y| over all 8 rows.
    x = torch.arange(8.0).unsqueeze(1)

    def make(seed=0):
        model = fitkit.Model(nn.Linear(1, 1, bias=False), device="cpu")
        nn.init.zeros_(model.module.weight)
        model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), loss="mae", metrics=["mae", "mse"])
        return model

    ref, resumed = _resume_mid_epoch(make, lambda: DataLoader(TensorDataset(x, x), batch_size=4), tmp_path, batch=0)
    assert resumed["mae"] == ref["mae"] == [3.5, 3.5, 3.5]
    assert resumed["mse"] == [17.5, 17.5, 17.5]  # (0 + 1 + 4 + ... + 49) / 8


def test_classification_metrics_of_a_resumed_epoch_are_restored(tmp_path):
    x, y = class_data(32)
    ref, resumed = _resume_mid_epoch(
        _classifier, lambda: DataLoader(TensorDataset(x, y), batch_size=4), tmp_path, batch=3
    )
    assert resumed == ref


def test_the_metrics_of_a_hugging_face_dataset_resumed_inside_an_epoch(tmp_path):
    datasets = pytest.importorskip("datasets")
    x, y = _regression_data()
    hf = datasets.Dataset.from_dict({"x": x.tolist(), "y": y.tolist()}).with_format("torch")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            return self.lin(x)

    def make(seed=0):
        torch.manual_seed(seed)
        model = fitkit.Model(Net(), device="cpu")
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        return model

    def source():
        return DataLoader(
            hf,
            batch_size=4,
            collate_fn=lambda rows: (torch.stack([r["x"] for r in rows]), torch.stack([r["y"] for r in rows])),
        )

    ref, resumed = _resume_mid_epoch(make, source, tmp_path)
    assert resumed == ref


# -- a scheduler factory built after the restore ----------------------------------------------------
def _warmup(opt, total_steps):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 5) * (1 - s / total_steps))


def _planned(seed: int = 0, scheduler=_warmup, optimizer=None) -> fitkit.Model:
    torch.manual_seed(seed)
    model = fitkit.Model(nn.Linear(3, 1), device="cpu")
    model.compile(
        optimizer=optimizer or (lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.9)),
        loss="mse",
        scheduler=scheduler,
        scheduler_interval="step",
    )
    return model


def _lrs_of_each_step(model, seen, key="lr"):
    return LambdaCallback(on_train_batch_begin=lambda b, logs: seen.append(model[0].optimizer.param_groups[0][key]))


@pytest.mark.parametrize("load", ["load_checkpoint", "BackupAndRestore"])
def test_a_scheduler_factory_built_after_the_restore_keeps_the_restored_learning_rate(tmp_path, load):
    x, y = _regression_data()
    x, y = x[:20], y[:20]
    holder: list = [None]
    seen: list[float] = []
    ref = holder[0] = _planned()
    ref.fit(
        x,
        y,
        batch_size=2,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[
            _lrs_of_each_step(holder, seen),
            ModelCheckpoint(str(tmp_path / "c{batch}.pt"), save_freq=5, monitor="loss"),
        ],
    )
    assert seen == pytest.approx([0.0, 0.18, 0.32, 0.42, 0.48, 0.5, 0.4, 0.3, 0.2, 0.1], abs=1e-12)
    resumed = holder[0] = _planned(seed=1)
    after: list[float] = []
    resumed.fit(
        x,
        y,
        batch_size=2,
        epochs=1,
        shuffle=False,
        verbose=0,
        initial_epoch=resumed.load_checkpoint(tmp_path / "c5.pt"),
        callbacks=[_lrs_of_each_step(holder, after)],
    )
    assert after == seen[5:]  # the first resumed step at lr 0.5, not the warmup's 0.0
    assert after[0] == 0.5
    for a, b in zip(resumed.module.parameters(), ref.module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_one_cycle_built_after_the_restore_keeps_the_restored_momentum(tmp_path):
    # OneCycleLR's first step sets momentum too: both come back as the checkpoint had them.
    x, y = _regression_data()
    one_cycle = functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.1)
    holder: list = [None]
    lrs, momenta = [], []
    ref = holder[0] = _planned(scheduler=lambda opt, total_steps: one_cycle(opt, total_steps=total_steps))
    ref.fit(
        x,
        y,
        batch_size=4,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            _lrs_of_each_step(holder, lrs),
            _lrs_of_each_step(holder, momenta, "momentum"),
            ModelCheckpoint(str(tmp_path / "c{batch}.pt"), save_freq=4, monitor="loss"),
        ],
    )
    resumed = holder[0] = _planned(seed=1, scheduler=lambda opt, total_steps: one_cycle(opt, total_steps=total_steps))
    lrs2, momenta2 = [], []
    resumed.fit(
        x,
        y,
        batch_size=4,
        epochs=2,
        shuffle=False,
        verbose=0,
        initial_epoch=resumed.load_checkpoint(tmp_path / "c4.pt"),
        callbacks=[_lrs_of_each_step(holder, lrs2), _lrs_of_each_step(holder, momenta2, "momentum")],
    )
    assert (lrs2, momenta2) == (lrs[4:], momenta[4:])
    for a, b in zip(resumed.module.parameters(), ref.module.parameters(), strict=True):
        assert torch.equal(a, b)


# -- every part checks before any part changes ----------------------------------------------------
def _compiled(seed: int = 0) -> fitkit.Model:
    torch.manual_seed(seed)
    model = fitkit.Model(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), device="cpu")
    model.compile(optimizer="adam", loss="mse", scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    return model


def _everything(model: fitkit.Model):
    """The module, optimizer and scheduler states and the step count, copied."""
    import copy

    return (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(model.optimizer.state_dict()),
        copy.deepcopy(model.scheduler.state_dict()),
        model.global_step,
    )


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


_TRACKERS = {"loss_total": torch.tensor(1.0, dtype=torch.float64), "loss_count": 4, "loss_wsum": None, "metrics": {}}

_CRAFTED = {
    "epoch='x'": ("epoch", "x", r"checkpoint\['epoch'\] is 'x', expected an int >= 0"),
    "epoch=-3": ("epoch", -3, r"checkpoint\['epoch'\] is -3, expected an int >= 0"),
    "global_step=-1": ("global_step", -1, r"checkpoint\['global_step'\] is -1, expected an int >= 0"),
    "step_in_epoch=-1": ("step_in_epoch", -1, r"checkpoint\['step_in_epoch'\] is -1"),
    "world_size='x'": ("world_size", "x", r"checkpoint\['world_size'\] is 'x', expected an int >= 1"),
    "world_size=0": ("world_size", 0, r"checkpoint\['world_size'\] is 0, expected an int >= 1"),
    "world_size=True": ("world_size", True, r"checkpoint\['world_size'\] is True"),
    "batch_size=0": ("batch_size", 0, r"checkpoint\['batch_size'\] is 0"),
    "rng=None": ("rng", None, r"checkpoint\['rng'\] is NoneType"),
    "rng without numpy": ("rng", "no numpy", r"checkpoint\['rng'\]\['numpy'\] is not a state"),
    "scaler='x'": ("scaler", "x", r"checkpoint\['scaler'\] is 'x'"),
    "history=[]": ("history", [], r"checkpoint\['history'\] is \[\]"),
    "epoch_rng='x'": ("epoch_rng", "x", r"checkpoint\['epoch_rng'\] is 'x'"),
    "inside an epoch without its totals": ("step_in_epoch", 2, r"inside epoch 3 without its RNG state and running"),
    # nested contents: each names its field (once a raw error at the first resumed step)
    "rng python of 10 words": (
        "rng",
        lambda r: {**r, "python": (3, r["python"][1][:10], None)},
        r"checkpoint\['rng'\]\['python'\] is not a state of Python's random module",
    ),
    "rng python words >= 2**32": (
        "rng",
        lambda r: {**r, "python": (3, (2**40,) * 625, None)},
        r"checkpoint\['rng'\]\['python'\] is not a state",
    ),
    "rng numpy keys 2-d": (
        "rng",
        lambda r: {**r, "numpy": (r["numpy"][0], r["numpy"][1].reshape(2, 312), *r["numpy"][2:])},
        r"checkpoint\['rng'\]\['numpy'\] is not a state of NumPy's global generator",
    ),
    "rng numpy keys float": (
        "rng",
        lambda r: {**r, "numpy": (r["numpy"][0], r["numpy"][1].double(), *r["numpy"][2:])},
        r"checkpoint\['rng'\]\['numpy'\] is not a state",
    ),
    "rng numpy position 'x'": (
        "rng",
        lambda r: {**r, "numpy": (*r["numpy"][:2], "x", *r["numpy"][3:])},
        r"checkpoint\['rng'\]\['numpy'\] is not a state",
    ),
    "rng torch of 10 bytes": (
        "rng",
        lambda r: {**r, "torch": r["torch"][:10]},
        r"checkpoint\['rng'\]\['torch'\] is a torch.uint8 tensor of shape \(10,\), expected a "
        r"torch RNG state \(a uint8 tensor of \d+ bytes\)",
    ),
    "epoch_rng of 10 bytes": (
        "epoch_rng",
        torch.zeros(10, dtype=torch.uint8),
        r"checkpoint\['epoch_rng'\] is a torch.uint8 tensor of shape \(10,\)",
    ),
    "trackers loss_total of shape (3,)": (
        "trackers",
        {**_TRACKERS, "loss_total": torch.zeros(3, dtype=torch.float64)},
        r"checkpoint\['trackers'\]\['loss_total'\] is a torch.float64 tensor of "
        r"shape \(3,\), expected a 0-dim floating-point tensor",
    ),
    "trackers loss_total int64": (
        "trackers",
        {**_TRACKERS, "loss_total": torch.tensor(5)},
        r"checkpoint\['trackers'\]\['loss_total'\] is a torch.int64 tensor",
    ),
    "trackers without loss_wsum": (
        "trackers",
        {k: v for k, v in _TRACKERS.items() if k != "loss_wsum"},
        r"checkpoint\['trackers'\] has no 'loss_wsum'",
    ),
    "trackers loss_count nan": (
        "trackers",
        {**_TRACKERS, "loss_count": float("nan")},
        r"checkpoint\['trackers'\]\['loss_count'\] is nan, expected a count >= 0",
    ),
    "trackers metric state 'x'": (
        "trackers",
        {**_TRACKERS, "metrics": {"mae": {"total": "x"}}},
        r"checkpoint\['trackers'\]\['metrics'\]\['mae'\]\['total'\] is 'x', expected a "
        r"tensor or a list of tensors",
    ),
    "trackers metric of an int": (
        "trackers",
        {**_TRACKERS, "metrics": {"mae": 3}},
        r"checkpoint\['trackers'\]\['metrics'\]\['mae'\] is 3, expected a dict",
    ),
    "trackers terms of 3 sums for 2 names": (
        "trackers",
        {**_TRACKERS, "terms": {"names": ["mse", "kl"], "total": torch.zeros(3, dtype=torch.float64)}},
        r"checkpoint\['trackers'\]\['terms'\] is .*, expected a dict \{'names': \[str\], 'total': \(K,\) tensor\}",
    ),
    "data_order without generators": ("data_order", {"x": 1}, r"checkpoint\['data_order'\] has no 'generators'"),
    "data_order generator of 3 bytes": (
        "data_order",
        {"generators": [torch.zeros(3, dtype=torch.uint8)], "samplers": []},
        r"checkpoint\['data_order'\]\['generators'\] is \[tensor",
    ),
    "pass_start rng of 3 bytes": (
        "pass_start",
        {"epoch": 0, "rng": torch.zeros(3, dtype=torch.uint8), "order": None},
        r"checkpoint\['pass_start'\]\['rng'\] is a torch.uint8 tensor of shape \(3,\)",
    ),
    "samples_in_epoch beyond the batches": (
        "samples_in_epoch",
        1000,
        r"checkpoint\['samples_in_epoch'\] is 1000, more than 0 batch\(es\) of 8",
    ),
    "history of more values than epochs": (
        "history",
        lambda h: {**h, "history": {**h["history"], "loss": [1.0] * 5}},
        r"checkpoint\['history'\]\['history'\]\['loss'\] holds 5 values for 2 "
        r"epoch\(s\)",
    ),
    "history of a str value": (
        "history",
        lambda h: {**h, "history": {**h["history"], "loss": ["x", 1.0]}},
        r"checkpoint\['history'\]\['history'\]\['loss'\] is \['x', 1.0\], expected a list of "
        r"numbers",
    ),
    "history validations [1]": (
        "history",
        lambda h: {**h, "validations": [1]},
        r"checkpoint\['history'\]\['validations'\] is \[1\], expected a list of dicts",
    ),
    "scheduler last_epoch='x'": (
        "scheduler",
        lambda s: {**s, "last_epoch": "x"},
        r"checkpoint\['scheduler'\]\['last_epoch'\] is 'x', expected an int >= -1",
    ),
    "scheduler gamma='x'": (
        "scheduler",
        lambda s: {**s, "gamma": "x"},
        r"checkpoint\['scheduler'\]\['gamma'\] is 'x', expected a number as the model's",
    ),
    "scheduler base_lrs of 2 groups": (
        "scheduler",
        lambda s: {**s, "base_lrs": [0.1, 0.1]},
        r"checkpoint\['scheduler'\]\['base_lrs'\] is \[0.1, 0.1\], expected a list "
        r"of 1 number\(s\), one per parameter group",
    ),
    "scaler {'scale': 'x'}": (
        "scaler",
        {"scale": "x"},
        r"checkpoint\['scaler'\]\['scale'\] is 'x', expected a "
        r"number > 0",
    ),
    "callback_config {'EarlyStopping': 'x'}": (
        "callback_config",
        {"EarlyStopping": "x"},
        r"checkpoint\['callback_config'\] is \{'EarlyStopping': 'x'\}",
    ),
}

# The optimizer's state (a one-file checkpoint's; a sharded one keeps it in the shards).
_CRAFTED_OPTIMIZER = {
    "lr='x'": (
        lambda o: _group(o, lr="x"),
        r"checkpoint\['optimizer'\]\['param_groups'\]\[0\]\['lr'\] is 'x', expected a number as the model's",
    ),
    "betas='x'": (lambda o: _group(o, betas="x"), r"\['betas'\] is 'x', expected a list of 2 as the model's"),
    "a group without lr": (lambda o: _group(o, lr=None), r"\['param_groups'\]\[0\] has no 'lr'"),
    "a group that is not a dict": (
        lambda o: {**o, "param_groups": [1]},
        r"checkpoint\['optimizer'\]\['param_groups'\] is \[1\], expected a list of dicts",
    ),
    "no 'state'": (lambda o: {"param_groups": o["param_groups"]}, r"checkpoint\['optimizer'\] has no 'state'"),
    "'state' a list": (
        lambda o: {**o, "state": [1]},
        r"checkpoint\['optimizer'\]\['state'\] is \[1\], expected a dict",
    ),
    "a parameter id twice": (
        lambda o: {**o, "param_groups": o["param_groups"] * 2},
        r"checkpoint\['optimizer'\]\['param_groups'\] name a parameter id twice",
    ),
    "step='x'": (
        lambda o: _param_state(o, step="x"),
        r"checkpoint\['optimizer'\]\['state'\]\[0\]\['step'\] is 'x', expected a tensor or a number",
    ),
    # a 0-dim exp_avg once loaded, and the fused Adam kernel wrote past its end (heap corruption)
    "a 0-dim exp_avg": (
        lambda o: _param_state(o, exp_avg=torch.tensor(1.0)),
        r"\['state'\]\[0\]\['exp_avg'\] is a torch.float32 tensor of shape \(\), expected a "
        r"floating-point tensor of its parameter's shape \(4, 3\)",
    ),
    "an int64 exp_avg": (
        lambda o: _param_state(o, exp_avg=torch.zeros(4, 3, dtype=torch.long)),
        r"\['state'\]\[0\]\['exp_avg'\] is a torch.int64 tensor",
    ),
    "a parameter without exp_avg": (
        lambda o: _param_state(o, exp_avg=None),
        r"checkpoint\['optimizer'\]\['state'\]\[0\] has no 'exp_avg' \(Adam keeps "
        r"\['exp_avg', 'exp_avg_sq', 'step'\] for each parameter",
    ),
}


def _group(opt: dict, **changes) -> dict:
    group = {**opt["param_groups"][0], **changes}
    group = {k: v for k, v in group.items() if v is not None}
    return {**opt, "param_groups": [group, *opt["param_groups"][1:]]}


def _param_state(opt: dict, **changes) -> dict:
    state = {**opt["state"][0], **changes}
    state = {k: v for k, v in state.items() if v is not None}
    return {**opt, "state": {**opt["state"], 0: state}}


def _craft(state: dict, key: str, value):
    import copy

    state = dict(state)
    if isinstance(value, str) and value == "no numpy":
        state["rng"] = {k: v for k, v in state["rng"].items() if k != "numpy"}
    elif callable(value):
        state[key] = value(copy.deepcopy(state[key]))
    else:
        state[key] = value
    return state


def _saved(tmp_path, sharded: bool):
    model = _compiled()
    x, y = _regression_data()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    path = tmp_path / ("ck" if sharded else "ck.pt")
    model.save_checkpoint(path, sharded=sharded)
    return path


@pytest.mark.slow  # the first import of torch.distributed.checkpoint
@pytest.mark.parametrize("sharded", [False, True], ids=["one file", "sharded"])
def test_each_crafted_field_is_refused_before_any_part_changes(tmp_path, sharded):
    path = _saved(tmp_path, sharded)
    state_file = path / STATE_NAME if sharded else path
    good = safe_load(state_file, "cpu")
    model = _compiled(seed=1)
    model.fit(*_regression_data(), batch_size=8, epochs=1, verbose=0)  # an optimizer state to keep
    before = _everything(model)
    for name, (key, value, message) in _CRAFTED.items():
        atomic_save(_craft(good, key, value), state_file)
        if sharded:
            write_manifest(path)  # who can write the folder can rewrite its digests: the content checks still hold
        with pytest.raises(CheckpointError, match=message):
            model.load_checkpoint(path)
        assert _same(_everything(model), before), name
        assert model._core.pop_resume() is None, name  # nothing waits for the next fit either
    atomic_save(good, state_file)
    if sharded:
        write_manifest(path)
    assert model.load_checkpoint(path) == 2  # the file as written loads


def test_every_field_of_the_state_crafted_is_refused_before_any_part_changes(tmp_path):
    # Each top-level field of a one-file checkpoint in turn holds a complex number, a type no
    # field has (the checksum recomputed, as by whoever can write the file): 0 accepted, 0 raw.
    from fitkit.files.payload import CHECKSUM_KEY

    path = _saved(tmp_path, sharded=False)
    good = safe_load(path, "cpu")
    model = _compiled(seed=1)
    model.fit(*_regression_data(), batch_size=8, epochs=1, verbose=0)  # an optimizer state to keep
    before, accepted, fields = _everything(model), [], sorted(set(good) - {CHECKSUM_KEY})
    for key in fields:
        atomic_save({**good, key: 1j}, path)
        try:
            model.load_checkpoint(path)
        except CheckpointError as e:
            assert repr(key) in str(e), (key, str(e))  # named
        else:
            accepted.append(key)
        assert _same(_everything(model), before), key
        assert model._core.pop_resume() is None, key
    assert accepted == [] and len(fields) >= 15, (accepted, fields)


@pytest.mark.parametrize("name", sorted(_CRAFTED_OPTIMIZER))
def test_a_crafted_optimizer_state_is_refused_before_any_part_changes(tmp_path, name):
    path = _saved(tmp_path, sharded=False)
    good = safe_load(path, "cpu")
    craft, message = _CRAFTED_OPTIMIZER[name]
    atomic_save({**good, "optimizer": craft(good["optimizer"])}, path)
    model = _compiled(seed=1)
    model.fit(*_regression_data(), batch_size=8, epochs=1, verbose=0)
    before = _everything(model)
    with pytest.raises(CheckpointError, match=message):
        model.load_checkpoint(path)
    assert _same(_everything(model), before)
    assert model._core.pop_resume() is None


@pytest.mark.slow
def test_crafted_parameter_group_names_of_a_sharded_checkpoint_are_refused(tmp_path):
    # Once a raw "TypeError: 'int' object is not iterable" from the groups' comparison.
    path = _saved(tmp_path, sharded=True)
    good = safe_load(path / STATE_NAME, "cpu")
    atomic_save({**good, "param_groups_names": 3}, path / STATE_NAME)
    write_manifest(path)  # who can write the folder can rewrite its digests: the content checks still hold
    model = _compiled(seed=1)
    before = _everything(model)
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint\['param_groups_names'\] is 3, expected a list of lists of "
        r"parameter names",
    ):
        model.load_checkpoint(path)
    assert _same(_everything(model), before) and model._core.pop_resume() is None


@pytest.mark.slow
def test_a_crafted_sharded_checkpoint_cannot_shorten_or_lengthen_the_run(tmp_path):
    # epoch=-3 once trained 84 steps instead of 36: now refused, and the run stays as it was.
    path = _saved(tmp_path, sharded=True)
    good = safe_load(path / STATE_NAME, "cpu")
    atomic_save({**good, "epoch": -3}, path / STATE_NAME)
    write_manifest(path)  # who can write the folder can rewrite its digests: the content checks still hold
    model = _compiled(seed=1)
    with pytest.raises(CheckpointError, match=r"checkpoint\['epoch'\] is -3"):
        model.load_checkpoint(path)
    model.fit(*_regression_data(), batch_size=8, epochs=3, verbose=0)
    assert model.global_step == 9


def test_a_callback_state_of_the_wrong_type_is_refused_before_any_part_changes(tmp_path):
    x, y = _regression_data()
    model = _compiled()
    path = tmp_path / "c.pt"
    stop = fitkit.callbacks.EarlyStopping(monitor="loss", patience=5)
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[stop, LambdaCallback(on_epoch_end=lambda e, logs: model.save_checkpoint(path))],
    )
    good = safe_load(path, "cpu")
    atomic_save({**good, "callbacks": {"EarlyStopping": {"wait": "x"}}}, path)
    fresh = _compiled(seed=1)
    before = _everything(fresh)
    seen = []

    def load_inside_fit(logs):
        with pytest.raises(CheckpointError, match=r"callbacks\['EarlyStopping'\]"):
            fresh.load_checkpoint(path)
        seen.append(_same(_everything(fresh), before))

    fresh.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[
            fitkit.callbacks.EarlyStopping(monitor="loss", patience=5),
            LambdaCallback(on_train_begin=load_inside_fit),
        ],
    )
    assert seen == [True]


def test_the_registry_names_each_part_and_saves_what_fitkit_always_wrote():
    model = _compiled()
    model.fit(*_regression_data(), batch_size=8, epochs=1, verbose=0)
    run = RunState(model)
    state = run.state_dict()
    assert [p.name for p in run.parts] == [
        "version",
        "module",
        "optimizer",
        "stepper",
        "scheduler",
        "position",
        "rng",
        "callbacks",
        "history",
    ]
    assert {
        "fitkit_version",
        "module",
        "optimizer",
        "optimizer_class",
        "scheduler",
        "scheduler_class",
        "scaler",
        "global_step",
        "epoch",
        "step_in_epoch",
        "samples_in_epoch",
        "pass_offset",
        "batch_size",
        "rng",
        "callbacks",
        "callback_config",
        "history",
    } <= set(state)
    assert run.problems(state) == [] and run.differences(state) == []
    assert (state["optimizer_class"], state["scheduler_class"], state["global_step"]) == ("Adam", "StepLR", 3)


# -- callback states, metric states and the backups ----------------------------------------------------
_CRAFTED_CALLBACKS = {
    "EarlyStopping wait='x'": (
        "EarlyStopping",
        {"wait": "x"},
        r"callbacks\['EarlyStopping'\]: its state\['wait'\] is "
        r"'x', expected an int >= 0",
    ),
    "EarlyStopping best='x'": (
        "EarlyStopping",
        {"best": "x"},
        r"callbacks\['EarlyStopping'\]: its state\['best'\] is "
        r"'x', expected a number or None",
    ),
    "EarlyStopping best_weights of other shapes": (
        "EarlyStopping",
        {"best_weights": {"0.weight": torch.zeros(2)}},
        r"callbacks\['EarlyStopping'\]: its state\['best_weights'\]: '0.weight': shape \(2,\) in the file",
    ),
    "ReduceLROnPlateau cooldown_counter=-1": (
        "ReduceLROnPlateau",
        {"cooldown_counter": -1},
        r"callbacks\['ReduceLROnPlateau'\]: its state\['cooldown_counter'\] is -1",
    ),
    "EMA last_step='x'": ("EMA", {"last_step": "x"}, r"callbacks\['EMA'\]: its state\['last_step'\] is 'x'"),
    "EMA average of other shapes": (
        "EMA",
        {"averaged": {"n_averaged": torch.tensor(1)}},
        r"callbacks\['EMA'\]: its state\['averaged'\]: 'module.0.weight': in the module, "
        r"missing from the file",
    ),
}


def _stateful_callbacks():
    return [
        fitkit.callbacks.EarlyStopping(monitor="loss", patience=5),
        fitkit.callbacks.ReduceLROnPlateau(monitor="loss", patience=5),
        fitkit.callbacks.EMA(),
    ]


def _plain(seed: int = 0) -> fitkit.Model:
    torch.manual_seed(seed)
    model = fitkit.Model(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), device="cpu")
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.mark.parametrize("name", sorted(_CRAFTED_CALLBACKS))
def test_a_crafted_callback_state_is_refused_before_any_callback_changes(tmp_path, name):
    # Each once loaded and failed later: a TypeError at the first comparison, torch's
    # load_state_dict error of the average, a KeyError or a wrong restore at the end of fit.
    x, y = _regression_data()
    model, path = _plain(), tmp_path / "c.pt"
    save = LambdaCallback(on_epoch_end=lambda e, logs: model.save_checkpoint(path))
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[*_stateful_callbacks(), save])
    good = safe_load(path, "cpu")
    key, change, message = _CRAFTED_CALLBACKS[name]
    atomic_save({**good, "callbacks": {**good["callbacks"], key: {**good["callbacks"][key], **change}}}, path)
    fresh = _plain(seed=1)
    fresh.load_checkpoint(path)  # the callbacks are the next fit's: checked when it starts
    callbacks = _stateful_callbacks()
    states = [cb.state_dict() for cb in callbacks]
    with pytest.raises(CheckpointError, match=message) as info:
        fresh.fit(x, y, batch_size=8, epochs=3, initial_epoch=2, verbose=0, callbacks=callbacks)
    assert "so no callback state and no history was restored" in str(info.value)
    assert all(_same(cb.state_dict(), s) for cb, s in zip(callbacks[:2], states[:2], strict=True))


def _mid_epoch(tmp_path):
    x, y = _regression_data()
    model, path = _regression(), tmp_path / "mid.pt"
    model.fit(
        x,
        y,
        batch_size=4,
        epochs=2,
        verbose=0,
        callbacks=[
            LambdaCallback(
                on_train_batch_end=lambda b, logs: model.epoch == 1 and b == 2 and model.save_checkpoint(path)
            )
        ],
    )
    return path, safe_load(path, "cpu")


def test_running_metric_states_of_other_shapes_are_refused(tmp_path):
    # Once a raw "shape '[]' is invalid for input of size 5" at the first resumed step.
    path, good = _mid_epoch(tmp_path)
    metrics = {
        **good["trackers"]["metrics"],
        "mae": {**good["trackers"]["metrics"]["mae"], "sum_abs_error": torch.zeros(5)},
    }
    atomic_save({**good, "trackers": {**good["trackers"], "metrics": metrics}}, path)
    built = _regression(seed=1)
    built.fit(*_regression_data(), batch_size=4, epochs=1, verbose=0)  # its metrics are built
    before = _everything_plain(built)
    with pytest.raises(
        ValueError,
        match=r"metric 'mae': state 'sum_abs_error' has the shape \(5,\) in the "
        r"checkpoint, \(1,\) in the metric",
    ):
        built.load_checkpoint(path)
    assert _same(_everything_plain(built), before) and built._core.pop_resume() is None
    fresh = _regression(seed=1)  # metrics built from the first batch: checked at their birth
    fresh.load_checkpoint(path)
    with pytest.raises(
        ValueError,
        match=r"running metric states do not fit this fit's metrics, so none was "
        r"loaded:\n  - metric 'mae': state 'sum_abs_error' has the shape",
    ):
        fresh.fit(*_regression_data(), batch_size=4, epochs=2, initial_epoch=1, verbose=0)


def _everything_plain(model):
    import copy

    return copy.deepcopy(model.state_dict()), copy.deepcopy(model.optimizer.state_dict()), model.global_step


@pytest.mark.parametrize("damage", ["torch RNG of 10 bytes", "optimizer lr='x'", "EarlyStopping wait='x'"])
def test_a_crafted_newest_backup_resumes_from_the_previous_one(tmp_path, damage):
    x, y = _regression_data()
    folder = tmp_path / "backup"
    model = _plain()  # a run that ended after 2 of 3 epochs: backups of epochs 1 (previous) and 2 (newest)
    backup = fitkit.callbacks.BackupAndRestore(folder, delete_checkpoint=False)
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[fitkit.callbacks.EarlyStopping(monitor="loss", patience=5), backup],
    )
    assert (folder / "backup.pt").exists() and (folder / "backup.prev.pt").exists()
    newest = safe_load(folder / "backup.pt", "cpu")
    if damage == "torch RNG of 10 bytes":
        newest["rng"] = {**newest["rng"], "torch": newest["rng"]["torch"][:10]}
    elif damage == "optimizer lr='x'":
        newest["optimizer"] = _group(newest["optimizer"], lr="x")
    else:
        newest["callbacks"]["EarlyStopping"]["wait"] = "x"
    atomic_save(newest, folder / "backup.pt")
    resumed = _plain(seed=1)
    with pytest.warns(fitkit.checks.FitkitWarning, match=r"is damaged, so training resumes from the previous backup"):
        resumed.fit(
            x,
            y,
            batch_size=8,
            epochs=3,
            verbose=0,
            callbacks=[
                fitkit.callbacks.EarlyStopping(monitor="loss", patience=5),
                fitkit.callbacks.BackupAndRestore(folder),
            ],
        )
    assert resumed.history.epoch == [0, 1, 2] and resumed.global_step == 9


# -- every field of every callback state, crafted ----------------------------------------------------
def _every_stateful_callback(tmp_path) -> list:
    from fitkit.callbacks import (
        SWA,
        BackupAndRestore,
        CSVLogger,
        EarlyStopping,
        LearningRateScheduler,
        ReduceLROnPlateau,
        Timer,
    )

    return [
        EarlyStopping(monitor="loss", patience=5),
        ReduceLROnPlateau(monitor="loss", patience=5),
        fitkit.callbacks.EMA(),
        SWA(swa_lrs=0.01, swa_epoch_start=1),
        ModelCheckpoint(tmp_path / "ck" / "m.pt"),
        BackupAndRestore(tmp_path / "backup", delete_checkpoint=False),
        CSVLogger(tmp_path / "log.csv"),
        LearningRateScheduler(lambda epoch, lr: lr),
        Timer(3600),
    ]


def test_every_field_of_every_callback_state_crafted_is_named(tmp_path):
    from fitkit.files.content import callback_state_problems
    from fitkit.training.parts import stateful

    x, y = _regression_data()
    model, callbacks = _plain(), _every_stateful_callback(tmp_path)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
    mine = stateful(callbacks)
    saved = {key: cb.state_dict() for key, cb in mine.items()}
    accepted, cases = [], 0
    for key, state in saved.items():
        assert isinstance(state, dict) and state, key  # each of them holds a state after two epochs
        # a complex number is no field's type (no count, number, str, None, tensor, list or dict)
        for field, value in [(None, "x"), *((f, 1j) for f in state)]:
            crafted = value if field is None else {**state, field: value}
            cases += 1
            if not callback_state_problems({key: crafted}, {key: mine[key]}):
                accepted.append((key, field))
    assert accepted == [] and cases == len(saved) + sum(map(len, saved.values())) >= 30, (accepted, cases)


def test_a_crafted_timer_state_is_refused_before_any_callback_changes(tmp_path):
    # Once float('x') raised a raw ValueError inside the resumed fit, after the weights had been restored.
    x, y = _regression_data()
    model, path = _plain(), tmp_path / "c.pt"
    save = LambdaCallback(on_epoch_end=lambda e, logs: model.save_checkpoint(path))
    timer = fitkit.callbacks.Timer(3600, clock=lambda: 0.0)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[timer, save])
    good = safe_load(path, "cpu")
    assert good["callbacks"]["Timer"] == {"elapsed": 0.0}
    for elapsed, shown in (("x", "'x'"), (-1.0, "-1.0"), (float("inf"), "inf"), (None, "None")):
        atomic_save({**good, "callbacks": {**good["callbacks"], "Timer": {"elapsed": elapsed}}}, path)
        fresh = _plain(seed=1)
        fresh.load_checkpoint(path)
        mine = fitkit.callbacks.Timer(3600, clock=lambda: 5.0)
        with pytest.raises(
            CheckpointError,
            match=rf"callbacks\['Timer'\]: its state\['elapsed'\] is {shown}, "
            r"expected seconds: a finite number >= 0",
        ):
            fresh.fit(x, y, batch_size=8, epochs=3, initial_epoch=2, verbose=0, callbacks=[mine])
        assert mine.elapsed == 0.0 and not mine.stopped and fresh.global_step == 6
