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
