"""Two runs on one folder: the second is refused before step 1, naming the first's pid and host;
a dead run's lock is taken over with a warning; stale-temp clean-up spares a live writer's temps."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import fitkit
from fitkit.callbacks import BackupAndRestore, CSVLogger, ModelCheckpoint
from fitkit.checks import FitkitWarning
from fitkit.files import remove_stale_temps
from fitkit.files.locks import FileLock, LockError, pid_alive, temp_owner

X, Y = torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), torch.randn(8, 1)

# The first run: it signals when its first step ran, then waits for the test's word to go on.
FIRST_RUN = textwrap.dedent("""
    import os, sys, time, torch, fitkit
    from fitkit.callbacks import BackupAndRestore, LambdaCallback, ModelCheckpoint
    folder = sys.argv[1]
    def hold(batch, logs):
        if batch == 0:
            open(os.path.join(folder, "started"), "w").close()
            while not os.path.exists(os.path.join(folder, "go")):
                time.sleep(0.02)
    torch.manual_seed(0)
    model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    cbs = [ModelCheckpoint(os.path.join(folder, "ep{epoch}.pt")), BackupAndRestore(os.path.join(folder, "bk")),
           LambdaCallback(on_train_batch_end=hold)]
    model.fit(torch.randn(8, 2), torch.randn(8, 1), epochs=2, batch_size=4, callbacks=cbs, verbose=0)
    print("first run done", sorted(os.listdir(folder)))
""")


def _model():
    torch.manual_seed(0)
    model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse")
    return model


def _wait_for(path, proc):
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(proc.communicate())
        time.sleep(0.02)


@pytest.mark.slow
def test_a_second_run_on_a_running_runs_folder_is_refused_before_step_1(tmp_path):
    script = tmp_path / "first.py"
    script.write_text(FIRST_RUN)
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen(
        [sys.executable, str(script), str(run)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(run / "started", first)
        model = _model()
        before = {k: v.clone() for k, v in model.module.state_dict().items()}
        host = socket.gethostname()
        for cbs, what in [
            ([BackupAndRestore(run / "bk")], "backup folder"),
            ([ModelCheckpoint(run / "ep{epoch}.pt")], "checkpoint files"),
        ]:
            with pytest.raises(LockError, match=f"{what}.*another run: process {first.pid} on host {host}.*Fix"):
                model.fit(X, Y, epochs=2, callbacks=cbs, verbose=0)
        assert all(torch.equal(before[k], v) for k, v in model.module.state_dict().items())
        assert model.global_step == 0
        (run / "go").touch()
        out, err = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == 0, err  # the first run was never disturbed
    assert "first run done ['ep1.pt', 'ep2.pt', 'go', 'started']" in out  # its backup folder went at its end
    assert not any(p.suffix == ".lock" for p in run.rglob("*"))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_dead_runs_lock_is_taken_over_with_a_warning(tmp_path):
    folder = tmp_path / "bk"
    folder.mkdir()
    pid = _dead_pid()
    assert not pid_alive(pid)
    (folder / ".backup.lock").write_text(f'{{"pid": {pid}, "host": "{socket.gethostname()}"}}')
    with pytest.warns(FitkitWarning, match=f"locked by process {pid} .* no longer running .* taken over"):
        _model().fit(X, Y, epochs=1, callbacks=[BackupAndRestore(folder)], verbose=0)
    assert not folder.exists()  # the backup and its lock went at the end, as after any fit


def test_a_lock_of_another_host_is_never_taken_over(tmp_path):
    lock = tmp_path / ".x.lock"
    lock.write_text('{"pid": 1, "host": "elsewhere"}')
    with pytest.raises(LockError, match="process 1 on host elsewhere.*delete the lock file"):
        FileLock(lock, "x", "CSVLogger").acquire()
    assert lock.read_text() == '{"pid": 1, "host": "elsewhere"}'


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp: [CSVLogger(tmp / "log.csv"), CSVLogger(tmp / "log.csv")],
        lambda tmp: [BackupAndRestore(tmp / "bk"), BackupAndRestore(tmp / "bk")],
        lambda tmp: [ModelCheckpoint(tmp / "m.pt"), ModelCheckpoint(tmp / "m.pt")],
    ],
    ids=["CSVLogger", "BackupAndRestore", "ModelCheckpoint"],
)
def test_two_callbacks_on_one_file_in_one_fit_are_refused_before_step_1(tmp_path, make):
    model = _model()
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    with pytest.raises(LockError, match="in use by another callback of this fit.*Fix"):
        model.fit(X, Y, epochs=2, callbacks=make(tmp_path), verbose=0)
    assert all(torch.equal(before[k], v) for k, v in model.module.state_dict().items())
    assert model.global_step == 0 and not list(tmp_path.rglob("*.lock"))  # both released
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("*.csv"))


def test_a_lock_is_held_while_fit_runs_and_released_after(tmp_path):
    seen = []
    from fitkit.callbacks import LambdaCallback

    spy = LambdaCallback(on_epoch_begin=lambda epoch, logs: seen.append(sorted(p.name for p in tmp_path.iterdir())))
    _model().fit(X, Y, epochs=1, callbacks=[CSVLogger(tmp_path / "log.csv"), spy], verbose=0)
    assert seen == [[".log.csv.lock"]] and sorted(p.name for p in tmp_path.iterdir()) == ["log.csv"]


def test_stale_temp_clean_up_removes_only_a_dead_processs_temps(tmp_path):
    live, dead = os.getppid(), _dead_pid()
    names = [f".c.pt.{live}-abc.tmp", f".c.pt.{dead}-abc.tmp", ".c.pt.legacy.tmp"]
    for name in names:
        (tmp_path / name).touch()
    removed = sorted(p.name for p in remove_stale_temps(tmp_path, "c.pt"))
    assert removed == sorted([f".c.pt.{dead}-abc.tmp", ".c.pt.legacy.tmp"])
    assert os.listdir(tmp_path) == [f".c.pt.{live}-abc.tmp"]
    assert temp_owner(names[0]) == live


def test_temp_files_carry_the_writers_pid(tmp_path, monkeypatch):
    seen = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (seen.append(os.path.basename(a)), real(a, b)))
    _model().save_weights(tmp_path / "w.pt")
    assert len(seen) == 1 and temp_owner(seen[0]) == os.getpid() and seen[0].startswith(".w.pt.")


# -- real restarts: pids reused, odd files where the lock goes ------------------------------------


def _write_lock(path, **record) -> None:
    import json
    import socket

    path.write_text(json.dumps({"host": socket.gethostname(), **record}))


def test_a_lock_with_this_pid_from_an_earlier_process_is_taken_over(tmp_path):
    """A restarted container runs as the same pid: the old lock carries another process's token."""
    from fitkit.files.locks import FileLock

    lock = tmp_path / ".x.lock"
    _write_lock(lock, pid=os.getpid(), token="0" * 32, start=1)
    taken = FileLock(lock, "x", "CSVLogger").acquire()
    assert taken.took_over is not None and "no longer running" in taken.took_over
    taken.release()
    assert not lock.exists()


def test_a_reused_pid_of_another_process_is_taken_over_and_a_live_holder_is_not(tmp_path):
    from fitkit.files.locks import FileLock, LockError, _start_time

    parent = os.getppid()
    if _start_time(parent) is None:
        pytest.skip("no /proc start times here")
    lock = tmp_path / ".x.lock"
    _write_lock(lock, pid=parent, token="a" * 32, start=_start_time(parent) + 1)  # the pid, another start
    taken = FileLock(lock, "x", "CSVLogger").acquire()
    assert taken.took_over is not None
    taken.release()
    _write_lock(lock, pid=parent, token="a" * 32, start=_start_time(parent))  # the live holder itself
    with pytest.raises(LockError, match=f"another run: process {parent}"):
        FileLock(lock, "x", "CSVLogger").acquire()


def test_a_huge_pid_and_a_folder_in_the_locks_place(tmp_path):
    from fitkit.files.locks import FileLock, LockError

    lock = tmp_path / ".x.lock"
    _write_lock(lock, pid=10**30)
    taken = FileLock(lock, "x", "CSVLogger").acquire()  # no OverflowError: no such process
    assert taken.took_over is not None
    taken.release()
    (tmp_path / ".y.lock").mkdir()
    with pytest.raises(LockError, match=r"a folder is where its lock file goes.*Fix: remove or rename"):
        FileLock(tmp_path / ".y.lock", "y", "CSVLogger").acquire()


def test_a_dangling_link_where_the_lock_goes_is_named_and_taken_over(tmp_path):
    # Once: O_EXCL saw the link, reading it found no file, and every run ended in "Fix: try again".
    csv, lock = tmp_path / "log.csv", tmp_path / ".log.csv.lock"
    lock.symlink_to(tmp_path / "gone")
    with pytest.warns(
        FitkitWarning,
        match=r"CSVLogger: a dangling symbolic link was where the lock of .* goes "
        r"\('.*\.log\.csv\.lock' -> '.*gone'\); the link is removed and the lock taken\.",
    ):
        _model().fit(X, Y, epochs=2, callbacks=[CSVLogger(csv)], verbose=0)
    assert csv.read_text().count("\n") == 3 and not lock.exists() and not lock.is_symlink()  # header, 2 epochs
    # a link to an existing file is not fitkit's lock: refused, naming both, and the file stays
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    lock.symlink_to(target)
    with pytest.raises(
        LockError,
        match=r"a symbolic link is where its lock file goes \('.*\.lock' -> '.*notes\.txt'"
        r"\).*Fix: remove the link",
    ):
        FileLock(lock, "x", "CSVLogger").acquire()
    assert target.read_text() == "mine" and lock.is_symlink()


# -- locks from other hosts: a requeued SLURM job, and the user's word ---------------------
def _foreign_lock(path, **extra):
    import json

    path.write_text(json.dumps({"pid": 4242, "host": "node-17", "token": "t", "start": 1, **extra}))


def test_a_requeued_slurm_job_takes_over_its_earlier_attempts_locks_from_another_node(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "991")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    folder = tmp_path / "bk"
    folder.mkdir()
    _foreign_lock(folder / ".backup.lock", job="991", attempt=1)
    with pytest.warns(
        FitkitWarning,
        match=r"locked by process 4242 on node-17, an earlier attempt \(1\) of this "
        r"SLURM job 991, requeued since \(attempt 2\); the lock is taken over",
    ):
        _model().fit(X, Y, epochs=1, callbacks=[BackupAndRestore(folder)], verbose=0)
    # The same attempt on another node (or another job) is a live run as far as anyone here knows.
    for extra in ({"job": "991", "attempt": 2}, {"job": "990", "attempt": 0}, {}):
        lock = tmp_path / ".x.lock"
        _foreign_lock(lock, **extra)
        with pytest.raises(LockError, match="process 4242 on host node-17"):
            FileLock(lock, "x", "CSVLogger").acquire()
        assert lock.exists()


def test_take_over_locks_takes_every_lock_of_another_host_in_one_rerun_and_never_a_live_one(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "bk").mkdir(parents=True)
    _foreign_lock(run / "bk" / ".backup.lock")
    _foreign_lock(run / ".log.csv.lock")
    _foreign_lock(run / ".other.lock")
    callbacks = [BackupAndRestore(run / "bk"), CSVLogger(run / "log.csv")]
    model = _model()
    with pytest.raises(
        LockError,
        match=r"another host cannot be checked from here\. Other locks near it: "
        r"\['.*run/\.log\.csv\.lock', '.*run/\.other\.lock'\]\. Fix: .* run again "
        r"with FITKIT_TAKE_OVER_LOCKS=1 to take over every lock it left at once",
    ):
        model.fit(X, Y, epochs=1, callbacks=callbacks, verbose=0)
    assert model.global_step == 0
    monkeypatch.setenv("FITKIT_TAKE_OVER_LOCKS", "1")
    with pytest.warns(FitkitWarning, match="FITKIT_TAKE_OVER_LOCKS=1 says that run has ended") as caught:
        model.fit(X, Y, epochs=1, callbacks=callbacks, verbose=0)
    assert len([w for w in caught if "taken over" in str(w.message)]) == 2 and model.global_step == 1
    # A live holder on this host is never taken over, whatever the variable says.
    lock = tmp_path / ".live.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(f'{{"pid": {holder.pid}, "host": "{socket.gethostname()}"}}')
        with pytest.raises(LockError, match=f"process {holder.pid} on host .*wait for that run to end"):
            FileLock(lock, "x", "CSVLogger").acquire()
    finally:
        holder.kill()
        holder.wait()
