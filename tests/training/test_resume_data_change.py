"""A checkpoint records the training set's length (and a ``datasets.Dataset``'s fingerprint): a
fresh process that resumes inside an epoch onto another length is refused before step 1, naming
both lengths and the fix; ``fit(resume="restart_epoch")`` starts that epoch over on the new data."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from fitkit.data import as_loader
from fitkit.training.resume import data_identity

# Backups after every batch; 12 rows in batches of 4, crashed at the end of step 2 of epoch 0, before
# that step's backup (the backup holds step 1; argv:
# folder, rows, crash step, resume mode). SGD on a bias-free linear model: steps by hand below.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch import nn
    import fitkit
    from fitkit.callbacks import BackupAndRestore, LambdaCallback

    folder, rows, crash_at, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    x = torch.arange(14 * 2, dtype=torch.float32).reshape(14, 2) / 10
    y = x.sum(1, keepdim=True)
    module = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(module.weight)
    model = fitkit.Model(module, device="cpu")
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss="mse")

    def crash(batch, logs):
        if model.global_step == crash_at:
            raise SystemExit(3)

    try:
        model.fit(x[:rows], y[:rows], batch_size=4, epochs=1, shuffle=mode == "shuffle", verbose=0,
                  callbacks=[BackupAndRestore(folder, save_freq=1), LambdaCallback(on_train_batch_end=crash)],
                  resume="restart_epoch" if mode == "restart_epoch" else None)
    except ValueError as e:
        print(json.dumps({"error": str(e), "step": model.global_step, "weight": module.weight.tolist()}))
        sys.exit(0)
    print(json.dumps({"step": model.global_step, "weight": module.weight.tolist()}))
    """
)


def _run(script, folder, rows: int, crash_at: int, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), str(folder), str(rows), str(crash_at), mode],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _hand(batches: list[tuple[int, int]]) -> list[float]:
    """The weight after SGD steps on rows [a, b) of the script's data, in order."""
    x = torch.arange(14 * 2, dtype=torch.float32).reshape(14, 2) / 10
    y = x.sum(1, keepdim=True)
    w = torch.zeros(1, 2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for a, b in batches:
        loss = torch.nn.functional.mse_loss(x[a:b] @ w.T, y[a:b])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w.detach()[0].tolist()


@pytest.mark.slow
def test_a_resume_onto_another_length_is_refused_and_restart_epoch_starts_it_over(tmp_path):
    import json

    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    # the crash: 12 rows, shuffled, in step 2 of epoch 0 (the backup holds 1 batch done)
    crashed = _run(script, tmp_path / "backup", 12, 2, "shuffle")
    assert crashed.returncode == 3, crashed.stderr
    (saved,) = [p for p in (tmp_path / "backup").rglob("*") if p.is_file() and p.suffix != ".lock"]
    state = torch.load(saved, weights_only=True)
    assert state["train_length"] == 12 and state["step_in_epoch"] == 1
    # a fresh process on 14 rows: refused before step 1 (the backup's step, nothing more)
    refused = _run(script, tmp_path / "backup", 14, -1, "shuffle")
    out = json.loads(refused.stdout.strip().splitlines()[-1])
    assert "training set of 12 samples, and this fit's has 14" in out["error"]
    assert "Fix: resume on the training set the checkpoint was taken on" in out["error"]
    assert "fit(..., resume='restart_epoch')" in out["error"]
    assert out["step"] == 1

    # unshuffled, so that the steps can be written down: the backup's step on rows 0..3 of the 12,
    # then the epoch over again on the 14 rows (batches 0-4, 4-8, 8-12, 12-14): 5 steps in all
    crashed = _run(script, tmp_path / "again", 12, 2, "plain")
    assert crashed.returncode == 3, crashed.stderr
    restarted = _run(script, tmp_path / "again", 14, -1, "restart_epoch")
    out = json.loads(restarted.stdout.strip().splitlines()[-1])
    assert out["step"] == 5
    expected = _hand([(0, 4), (0, 4), (4, 8), (8, 12), (12, 14)])
    assert out["weight"][0] == pytest.approx(expected, abs=1e-6)


def test_the_data_identity_of_each_source():
    assert data_identity(as_loader(torch.zeros(12, 2), torch.zeros(12), batch_size=4)) == {"train_length": 12}
    dataset = torch.utils.data.TensorDataset(torch.zeros(7, 2))
    assert data_identity(as_loader(torch.utils.data.DataLoader(dataset, batch_size=2))) == {"train_length": 7}
    assert data_identity(as_loader(dataset, batch_size=2)) == {"train_length": 7}
    assert data_identity(as_loader(iter([(torch.zeros(2, 2),)]))) == {}  # no length: nothing to compare
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"x": [[0.0, 1.0]] * 5}).with_format("torch")
    assert data_identity(as_loader(hf, batch_size=2)) == {"train_length": 5, "train_fingerprint": hf._fingerprint}


def test_resume_takes_none_or_restart_epoch():
    import fitkit

    model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    model.compile(loss="mse")
    with pytest.raises(
        ValueError,
        match=r"Expected `resume` to be None or 'restart_epoch'\. Received: "
        r"resume='restart'\. Fix",
    ):
        model.fit(torch.zeros(4, 2), torch.zeros(4, 1), resume="restart", verbose=0)
    assert model.global_step == 0
