"""Checkpoint files: atomic writes, weights_only loads, and ModelCheckpoint's file policy."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from conftest import class_data, line_data, line_model, params_of, same_params, small_classifier
from torch import nn
from torch.optim import lr_scheduler

import fitkit
from fitkit.callbacks import EarlyStopping, LambdaCallback, ModelCheckpoint
from fitkit.training.checkpoint import atomic_save, is_rank_zero, safe_load


def _data(n: int = 16):
    x = torch.linspace(-1, 1, n).unsqueeze(1)
    return x, 3 * x + 1


def _model() -> fitkit.Model:
    model = fitkit.Model(nn.Linear(1, 1), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")
    return model


def _script(key: str, values: dict[int, float] | list[float]) -> LambdaCallback:
    return LambdaCallback(on_epoch_end=lambda epoch, logs: logs.__setitem__(key, values[epoch]))


def _files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


# -- files and loading ------------------------------------------------------------------------
class _Evil:
    """Unpickling this calls ``open(target, "w")``: a file appears if the pickle runs."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_a_checkpoint_whose_pickle_would_create_a_file_is_refused(tmp_path):
    target = tmp_path / "pwned.txt"
    path = tmp_path / "evil.pt"
    torch.save({"fitkit_version": fitkit.__version__, "module": _Evil(target)}, path)
    model = _model()
    with pytest.raises(RuntimeError, match="Refused to load .*weights_only=True"):
        model.load_checkpoint(path)
    with pytest.raises(RuntimeError, match="Refused to load"):
        model.load_weights(path)
    assert not target.exists()
    torch.load(path, weights_only=False)  # proof that the file is a real exploit
    assert target.exists()


def test_checkpoint_holds_the_documented_state_and_loads_weights_only(tmp_path):
    x, y = _data()
    model = _model()
    model.fit(x, y, epochs=2, verbose=0)
    model.save_checkpoint(tmp_path / "c.pt")
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert set(state) == {
        "fitkit_version",
        "module",
        "optimizer",
        "optimizer_class",
        "scheduler",
        "scheduler_class",
        "scaler",
        "epoch",
        "callback_config",
        "pass_offset",
        "step_in_epoch",
        "samples_in_epoch",
        "batch_size",
        "global_step",
        "rng",
        "callbacks",
        "history",
        "fitkit_checksum",
        "train_length",
    }
    assert state["train_length"] == len(x)  # what a position inside an epoch would mean
    assert state["optimizer_class"] == "SGD" and state["fitkit_checksum"].startswith("sha256:")
    assert state["epoch"] == 2 and state["step_in_epoch"] == 0 and state["global_step"] == 2
    assert set(state["rng"]) == {"python", "numpy", "torch", "cuda"}
    assert state["history"]["epoch"] == [0, 1]
    fresh = _model()
    fresh.load_weights(tmp_path / "c.pt")  # a full checkpoint also serves load_weights
    assert torch.equal(fresh.module.weight, model.module.weight)


def test_load_errors(tmp_path):
    model = _model()
    with pytest.raises(FileNotFoundError, match="No checkpoint file"):
        model.load_checkpoint(tmp_path / "missing.pt")
    model.save_weights(tmp_path / "w.pt")
    with pytest.raises(ValueError, match="is not a fitkit checkpoint. Fix: use load_weights"):
        model.load_checkpoint(tmp_path / "w.pt")
    with pytest.raises(RuntimeError, match="needs a compiled model"):
        fitkit.Model(nn.Linear(1, 1), device="cpu").load_checkpoint(tmp_path / "w.pt")


def test_atomic_save_failure_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "c.pt"
    atomic_save({"a": torch.ones(2)}, path)
    with pytest.raises(TypeError):
        atomic_save({"a": torch.zeros(2), "b": lambda: 0}, path)  # a lambda cannot be pickled
    assert torch.equal(safe_load(path, "cpu")["a"], torch.ones(2))
    assert os.listdir(tmp_path) == ["c.pt"]
    assert is_rank_zero()


# -- ModelCheckpoint ------------------------------------------------------------------------
def test_model_checkpoint_formats_epoch_and_log_keys(tmp_path):
    x, y = _data()
    ckpt = ModelCheckpoint(tmp_path / "m-{epoch:02d}-{loss:.3f}.pt")
    h = _model().fit(x, y, epochs=2, verbose=0, callbacks=[ckpt])
    assert _files(tmp_path) == [f"m-{e + 1:02d}-{loss:.3f}.pt" for e, loss in enumerate(h.history["loss"])]
    state = torch.load(tmp_path / _files(tmp_path)[0], weights_only=True)
    assert state["epoch"] == 1 and state["history"]["epoch"] == [0]  # written after History saw epoch 0
    message = r"uses \{val_acc\}, but fit has no validation data .*logs will hold learning_rate, loss"
    with pytest.raises(ValueError, match=message):
        _model().fit(x, y, epochs=1, verbose=0, callbacks=[ModelCheckpoint(tmp_path / "{val_acc}.pt")])
    with pytest.raises(ValueError, match="fields need names"):
        ModelCheckpoint(tmp_path / "{}.pt")


def test_save_top_k_keeps_exactly_the_k_best_files(tmp_path):
    x, y = _data()
    values = [5, 3, 4, 1, 2, 6]
    seen = []
    watch = LambdaCallback(on_epoch_begin=lambda e, logs: seen.append(_files(tmp_path)))
    ckpt = ModelCheckpoint(tmp_path / "ep{epoch}.pt", monitor="s_loss", save_top_k=2, save_weights_only=True)
    _model().fit(x, y, epochs=6, verbose=0, callbacks=[watch, _script("s_loss", values), ckpt])
    seen.append(_files(tmp_path))
    assert seen == [
        [],
        ["ep1.pt"],
        ["ep1.pt", "ep2.pt"],
        ["ep2.pt", "ep3.pt"],
        ["ep2.pt", "ep4.pt"],
        ["ep4.pt", "ep5.pt"],
        ["ep4.pt", "ep5.pt"],
    ]
    assert ckpt.kept == [(1.0, str(tmp_path / "ep4.pt")), (2.0, str(tmp_path / "ep5.pt"))]
    assert ckpt.best == 1.0 and ckpt.best_path == str(tmp_path / "ep4.pt")


def test_save_top_k_in_max_mode_and_argument_errors(tmp_path):
    x, y = _data()
    ckpt = ModelCheckpoint(tmp_path / "ep{epoch}.pt", monitor="score", mode="max", save_top_k=1, save_weights_only=True)
    _model().fit(x, y, epochs=4, verbose=0, callbacks=[_script("score", [0.1, 0.9, 0.5, float("nan")]), ckpt])
    assert _files(tmp_path) == ["ep2.pt"]
    with pytest.raises(ValueError, match="must differ per save.*add '\\{epoch:02d\\}'"):
        ModelCheckpoint(tmp_path / "best.pt", save_top_k=2)
    with pytest.raises(ValueError, match="either `save_best_only=True`.*or `save_top_k=k`"):
        ModelCheckpoint(tmp_path / "{epoch}.pt", save_best_only=True, save_top_k=2)
    with pytest.raises(ValueError, match="Expected `save_freq` to be 'epoch' or a positive int"):
        ModelCheckpoint(tmp_path / "{epoch}.pt", save_freq=0)


def test_save_best_only_writes_each_new_best(tmp_path):
    x, y = _data()
    model, snaps = _model(), []
    snap = LambdaCallback(on_epoch_end=lambda e, logs: snaps.append(model.module.weight.detach().clone()))
    ckpt = ModelCheckpoint(tmp_path / "best.pt", monitor="s_loss", save_best_only=True, save_weights_only=True)
    model.fit(x, y, epochs=4, verbose=0, callbacks=[_script("s_loss", [3, 1, 2, 1]), snap, ckpt])
    assert torch.equal(torch.load(tmp_path / "best.pt", weights_only=True)["weight"], snaps[1])


def test_save_freq_in_batches(tmp_path):
    x, y = _data()
    ckpt = ModelCheckpoint(tmp_path / "e{epoch}-b{batch}.pt", save_freq=3, save_weights_only=True)
    _model().fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[ckpt])  # 4 batches per epoch
    # batches 3 and 6 of 8, then the final step (the run ends between two saves): e2-b4
    assert _files(tmp_path) == ["e1-b3.pt", "e2-b2.pt", "e2-b4.pt"]


def test_numbering_continues_and_a_better_best_survives_a_resume(tmp_path):
    x, y = _data()
    values = {0: 3.0, 1: 1.0, 2: 2.0, 3: 2.5, 4: 0.5}
    model, snaps = _model(), {}
    snap = LambdaCallback(on_epoch_end=lambda e, logs: snaps.__setitem__(e, model.module.weight.detach().clone()))

    def callbacks():
        return [
            _script("s_loss", values),
            snap,
            ModelCheckpoint(tmp_path / "ep{epoch:02d}.pt"),
            ModelCheckpoint(tmp_path / "best.pt", monitor="s_loss", save_best_only=True, save_weights_only=True),
        ]

    model.fit(x, y, epochs=3, verbose=0, callbacks=callbacks())
    first = {n: (tmp_path / n).read_bytes() for n in ("ep01.pt", "ep02.pt", "ep03.pt")}
    best = lambda: torch.load(tmp_path / "best.pt", weights_only=True)["weight"]  # noqa: E731
    assert torch.equal(best(), snaps[1])

    torch.manual_seed(123)
    model = _model()
    initial_epoch = model.load_checkpoint(tmp_path / "ep03.pt")
    assert initial_epoch == 3
    checked = []
    check = LambdaCallback(on_epoch_begin=lambda e, logs: checked.append((e, torch.equal(best(), snaps[1]))))
    model.fit(x, y, epochs=5, initial_epoch=initial_epoch, verbose=0, callbacks=[check, *callbacks()])
    assert checked == [(3, True), (4, True)]  # 2.5 at epoch 3 did not replace the best 1.0
    assert torch.equal(best(), snaps[4])  # 0.5 at epoch 4 did
    assert _files(tmp_path) == ["best.pt", "ep01.pt", "ep02.pt", "ep03.pt", "ep04.pt", "ep05.pt"]
    assert all((tmp_path / n).read_bytes() == b for n, b in first.items())
    assert model.history.epoch == [0, 1, 2, 3, 4]


def test_every_builtin_callback_state_is_saved_and_loads_weights_only(tmp_path):
    from fitkit.callbacks import (
        BackupAndRestore,
        CSVLogger,
        LearningRateScheduler,
        ReduceLROnPlateau,
        TensorBoard,
        TerminateOnNaN,
    )

    x, y = _data()
    callbacks = [
        EarlyStopping(monitor="loss", patience=5, restore_best_weights=True),
        ReduceLROnPlateau(monitor="loss"),
        LearningRateScheduler(lambda e, lr: lr),
        CSVLogger(tmp_path / "log.csv"),
        TensorBoard(tmp_path / "tb"),
        TerminateOnNaN(),
        BackupAndRestore(tmp_path / "backup", delete_checkpoint=False),
        ModelCheckpoint(tmp_path / "full.pt"),
    ]
    _model().fit(x, y, epochs=2, verbose=0, callbacks=callbacks)
    for name in ("full.pt", "backup/backup.pt"):
        state = torch.load(tmp_path / name, weights_only=True)
        assert sorted(state["callbacks"]) == sorted(type(cb).__name__ for cb in callbacks)
        assert set(state["callbacks"]["EarlyStopping"]["best_weights"]) == {"weight", "bias"}
        assert state["callbacks"]["CSVLogger"]["size"] == (tmp_path / "log.csv").stat().st_size
    for cb in callbacks:  # and each loads back into a fresh instance's protocol
        cb.load_state_dict(cb.state_dict())


@pytest.mark.requires_cuda
def test_a_cuda_checkpoint_loads_onto_a_cpu_model(tmp_path):
    x, y = _data()
    gpu = fitkit.Model(nn.Linear(1, 1), device="cuda")
    gpu.compile(optimizer="adam", loss="mse")
    gpu.fit(x, y, epochs=2, verbose=0, callbacks=[EarlyStopping(monitor="loss", restore_best_weights=True)])
    gpu.save_checkpoint(tmp_path / "c.pt")
    cpu = _model()
    cpu.compile(optimizer="adam", loss="mse")
    assert cpu.load_checkpoint(tmp_path / "c.pt") == 2
    assert cpu.module.weight.device.type == "cpu"
    assert all(t.device.type == "cpu" for s in cpu.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    torch.testing.assert_close(cpu.module.weight, gpu.module.weight.cpu())
    cpu.fit(x, y, epochs=3, initial_epoch=2, verbose=0)  # the RNG states of the file apply on the CPU


X, Y = class_data()


def test_a_checkpoint_with_another_scheduler_class_changes_nothing(tmp_path):
    saved = small_classifier(partial(lr_scheduler.StepLR, step_size=1, gamma=0.5))
    saved.fit(X, Y, epochs=1, verbose=0)
    saved.save_checkpoint(tmp_path / "c.pt")
    model = small_classifier(partial(lr_scheduler.ExponentialLR, gamma=0.9))
    before = params_of(model.module)
    with pytest.raises(ValueError, match="scheduler: StepLR in the file, ExponentialLR in the model"):
        model.load_checkpoint(tmp_path / "c.pt")
    assert same_params(model.module, before) and model.scheduler.gamma == 0.9 and model.global_step == 0
    with pytest.raises(ValueError, match="scheduler: the file has StepLR, the model none"):
        small_classifier().load_checkpoint(tmp_path / "c.pt")


def test_a_callback_that_now_watches_another_key_starts_fresh(tmp_path):
    x, y = line_data(16)
    model = line_model()
    stop = EarlyStopping(monitor="loss", patience=1)
    save = LambdaCallback(on_epoch_end=lambda epoch, logs: model.save_checkpoint(tmp_path / "c.pt"))
    model.fit(x, y, epochs=2, verbose=0, callbacks=[stop, save])
    resumed = line_model()
    resumed.load_checkpoint(tmp_path / "c.pt")
    other = EarlyStopping(monitor="learning_rate", mode="min", patience=5)
    with pytest.warns(fitkit.FitkitWarning, match="was saved watching .*'loss'.* now watches .*'learning_rate'"):
        resumed.fit(x, y, initial_epoch=2, epochs=3, verbose=0, callbacks=[other])
    assert other.best == 0.05  # its own first value, not the saved best loss


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_an_adapter_file_loaded_as_a_whole_model_names_trainable_only(tmp_path, suffix):
    # A frozen base and a trainable head (as LoRA adapters): the head's file, written with
    # trainable_only=True, loads only with it; without it the error names the option, not the
    # frozen weights missing from the file, and nothing changes.
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")

    def build(seed):
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        net[0].requires_grad_(False)
        return fitkit.Model(net, device="cpu")

    path = tmp_path / f"adapters{suffix}"
    build(0).save_weights(path, trainable_only=True)
    model = build(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expected = (
        r"holds only trainable parameters \(2 of the module's 4 state-dict entries\).*Expected "
        r"`trainable_only=True` to load such a file\. Received: trainable_only=False\. "
        r"Fix: model\.load_weights\(.*, trainable_only=True\)\."
    )
    with pytest.raises(ValueError, match=expected) as info:
        model.load_weights(path)
    assert "missing from the file" not in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model.load_weights(path, trainable_only=True)  # the fix works: the head is build(0)'s, the base build(1)'s
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))[1]
    assert torch.equal(model.module[1].weight, head.weight) and torch.equal(model.module[0].weight, before["0.weight"])
    # A whole-model file that lacks a trainable key is still listed key by key (not this error).
    torch.save({"0.weight": before["0.weight"]}, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match=r"'1\.weight': in the module, missing from the file"):
        model.load_weights(tmp_path / "partial.pt")
