"""Every bool flag of the stock callbacks refuses a string ("no" would be truthy and, say,
delete a backup): a TypeError naming the flag, at construction, before any fit."""

from __future__ import annotations

import pytest

from fitkit import callbacks as C

FLAGS = [
    ("BackupAndRestore", {"backup_dir": "{tmp}/bk"}, "delete_checkpoint"),
    ("ModelCheckpoint", {"filepath": "{tmp}/m{{epoch}}.pt"}, "save_best_only"),
    ("ModelCheckpoint", {"filepath": "{tmp}/m{{epoch}}.pt"}, "save_weights_only"),
    ("EarlyStopping", {}, "restore_best_weights"),
    ("CSVLogger", {"filename": "{tmp}/log.csv"}, "append"),
    ("MLflowLogger", {}, "log_plot"),
    ("Profiler", {"dirpath": "{tmp}/prof"}, "record_shapes"),
    ("Profiler", {"dirpath": "{tmp}/prof"}, "profile_memory"),
    ("Profiler", {"dirpath": "{tmp}/prof"}, "with_stack"),
    ("WandbLogger", {}, "log_checkpoints"),
    ("TensorBoard", {"log_dir": "{tmp}/tb"}, "write_steps_per_second"),
]


@pytest.mark.parametrize("name, required, flag", FLAGS, ids=[f"{n}.{f}" for n, _, f in FLAGS])
def test_a_string_for_a_bool_flag_is_refused(tmp_path, name, required, flag):
    if name == "MLflowLogger":
        pytest.importorskip("mlflow")
    if name == "WandbLogger":
        pytest.importorskip("wandb")
    kwargs = {k: v.format(tmp=tmp_path) for k, v in required.items()}
    with pytest.raises(TypeError, match=f"`{flag}`"):
        getattr(C, name)(**kwargs, **{flag: "no"})
    assert list(tmp_path.iterdir()) == []  # nothing was made


def test_two_profilers_or_one_inside_a_running_profiler_are_refused_before_step_1(tmp_path):
    """Two torch profilers in one process crash it (segfault): fit refuses a second Profiler,
    and a Profiler while a torch.profiler.profile block runs, before anything changes."""
    import torch

    import fitkit

    model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    before = [p.detach().clone() for p in model.module.parameters()]
    x, y = torch.randn(8, 2), torch.randn(8, 1)
    with pytest.raises(ValueError, match=r"Received 2 holding torch.profiler .*: Profiler, Profiler\. Fix: pass one"):
        model.fit(x, y, batch_size=2, verbose=0, callbacks=[C.Profiler(tmp_path / "a"), C.Profiler(tmp_path / "b")])
    with torch.profiler.profile(), pytest.raises(RuntimeError, match="already running in this process"):
        model.fit(x, y, batch_size=2, verbose=0, callbacks=[C.Profiler(tmp_path / "c", verbose=0)])
    assert model.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))
    assert list(tmp_path.iterdir()) == []
    model.fit(x, y, batch_size=2, verbose=0, callbacks=[C.Profiler(tmp_path / "d", verbose=0)])  # one: fine
    assert model.global_step == 4
