"""SIGTERM and Ctrl-C during fit: finish the step, back it up, run on_train_end, close, then exit.

The subprocess tests run one training script that sends itself the signal from a callback at a
known point (an optimizer step, a micro-batch inside an accumulation window, or validation),
then run it again and compare the final weights with an uninterrupted run, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import line_data, line_model

import fitkit
from fitkit.callbacks import BackupAndRestore, Callback, LambdaCallback
from fitkit.distributed.agreement import signal_grace
from fitkit.training.signals import deferred, watchdog

# Argument 1: the job's folder; 2: SIGTERM, SIGINT or none; 3: where to send it ("7": at the end
# of optimizer step 7; "a6": at the micro-batch after step 6 that does not close its window;
# "val1": at the end of epoch 1's validation); 4: "1" with BackupAndRestore(save_freq=3);
# 5: "1" sends the signal twice ("late": the second past signals.REPEAT_GRACE, set to 0);
# 6: gradient_accumulation_steps. 32 rows, batch 8, shuffled:
# 4 batches per epoch, 5 epochs, 20 optimizer steps without accumulation.
SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, threading
    import torch
    from torch import nn
    import fitkit
    from fitkit.callbacks import BackupAndRestore, CSVLogger, LambdaCallback, TensorBoard


    def main(folder, sig, at, backup, twice, accumulate):
        torch.set_num_threads(1)
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(40, 3, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3 * torch.randn(40, 1, generator=g)
        module = nn.Sequential(nn.Linear(3, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
        model = fitkit.Model(module, device="cpu")
        model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=0.05), loss="mse",
                      scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.7),
                      gradient_accumulation_steps=accumulate)
        signum = getattr(signal, sig) if sig != "none" else None
        sent = []

        def send():
            if not sent:
                sent.append(model.global_step)
                if twice == "late":
                    fitkit.training.signals.REPEAT_GRACE = 0.0
                os.kill(os.getpid(), signum)
                if twice != "0":
                    os.kill(os.getpid(), signum)

        def batch_end(batch, logs):
            if signum is None:
                return
            if at.isdigit() and model.global_step == int(at):
                send()
            if at.startswith("a") and model.global_step == int(at[1:]) and not model.closes_accumulation_window:
                send()

        def test_end(logs):
            if signum is not None and at.startswith("val") and model.epoch == int(at[3:]):
                send()

        def train_end(logs):
            with open(os.path.join(folder, "train_end.txt"), "a") as f:
                f.write(f"{model.global_step}\\n")

        callbacks = [LambdaCallback(on_train_batch_end=batch_end, on_test_end=test_end, on_train_end=train_end),
                     TensorBoard(os.path.join(folder, "tb")), CSVLogger(os.path.join(folder, "log.csv"))]
        if backup:
            callbacks.append(BackupAndRestore(os.path.join(folder, "backup"), save_freq=3))
        handlers = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
        flags = [m.training for m in module.modules()]
        try:
            history = model.fit(x[:32], y[:32], batch_size=8, epochs=5, validation_data=(x[32:], y[32:]),
                                callbacks=callbacks, verbose=0, shuffle=True)
            torch.save({"weights": model.state_dict(), "history": history.history, "steps": model.global_step},
                       os.path.join(folder, "final.pt"))
        finally:
            threads = [t for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread" and t.is_alive()]
            now = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
            with open(os.path.join(folder, "exit.json"), "w") as f:
                json.dump({"writer_threads": len(threads), "handlers_restored": handlers == now,
                           "modes_restored": flags == [m.training for m in module.modules()],
                           "grad": torch.is_grad_enabled(), "step": model.global_step}, f)


    if __name__ == "__main__":
        a = sys.argv
        main(a[1], a[2], a[3], a[4] == "1", a[5], int(a[6]))
    """
)

SIGINT_STATUS = (130, -signal.SIGINT)  # an uncaught KeyboardInterrupt


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """``run(name, sig, at, backup=True, twice=False, accumulate=1)``: one process of the script."""
    root = tmp_path_factory.mktemp("signals")
    script = root / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(fitkit.__file__).parents[1]), "OMP_NUM_THREADS": "1"}

    def run(name, sig="none", at="0", backup=True, twice=False, accumulate=1):
        folder = root / name
        folder.mkdir(exist_ok=True)
        (folder / "exit.json").unlink(missing_ok=True)
        repeat = twice if isinstance(twice, str) else "1" if twice else "0"
        args = [str(folder), sig, at, "1" if backup else "0", repeat, str(accumulate)]
        cmd = [sys.executable, str(script), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        return proc, folder

    return run


@pytest.fixture(scope="module")
def reference(job):
    """Uninterrupted runs' final state, by gradient_accumulation_steps (1 and 2)."""
    with ThreadPoolExecutor(2) as pool:
        runs = {k: pool.submit(job, f"ref{k}", accumulate=k) for k in (1, 2)}
        out = {}
        for k, f in runs.items():
            proc, folder = f.result()
            assert proc.returncode == 0, proc.stderr[-2000:]
            out[k] = torch.load(folder / "final.pt", weights_only=True)
    assert out[1]["steps"] == 20 and out[2]["steps"] == 10
    return out


def _backup(folder: Path) -> dict:
    state = torch.load(folder / "backup" / "backup.pt", weights_only=True)
    return {k: state[k] for k in ("global_step", "epoch", "step_in_epoch", "samples_in_epoch")}


def _exit(folder: Path) -> dict:
    return json.loads((folder / "exit.json").read_text())


def _clean_exit() -> dict:
    return {"writer_threads": 0, "handlers_restored": True, "modes_restored": True, "grad": True}


def _assert_resumes_bit_exact(job, name, ref, accumulate=1, train_end="") -> None:
    proc, folder = job(name, accumulate=accumulate)
    assert proc.returncode == 0, proc.stderr[-2000:]
    final = torch.load(folder / "final.pt", weights_only=True)
    assert final["steps"] == ref["steps"]
    assert final["weights"].keys() == ref["weights"].keys()
    for k, v in ref["weights"].items():
        assert torch.equal(final["weights"][k], v), k  # bit for bit
    assert final["history"] == ref["history"]
    assert (folder / "train_end.txt").read_text() == f"{train_end}{ref['steps']}\n"
    assert not (folder / "backup").exists()  # a fit that ends normally deletes its backup


def _csv_rows(folder: Path) -> list[str]:
    return (folder / "log.csv").read_text().splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_mid_epoch_backs_up_that_step_runs_on_train_end_and_the_rerun_is_bit_exact(job, reference, sig):
    # Step 7 is inside epoch 1 (batch index 2 of 4) and no regular backup step (3, 6, 9, ...).
    proc, folder = job(f"mid_{sig}", sig, "7")
    if sig == "SIGTERM":
        assert proc.returncode == 143, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr  # SystemExit(143): a quiet exit, as a killed process
    else:
        assert proc.returncode in SIGINT_STATUS, proc.stderr[-2000:]
        assert proc.stderr.rstrip().endswith("KeyboardInterrupt")
    assert _backup(folder) == {"global_step": 7, "epoch": 1, "step_in_epoch": 3, "samples_in_epoch": 24}
    assert (folder / "train_end.txt").read_text() == "7\n"  # on_train_end ran at the stop
    assert _exit(folder) == {**_clean_exit(), "step": 7}  # TensorBoard threads ended, modes, handlers back
    assert len(_csv_rows(folder)) == 2  # the header and epoch 0: no partial epoch row
    assert list((folder / "tb").rglob("events.out.tfevents.*"))
    _assert_resumes_bit_exact(job, f"mid_{sig}", reference[1], train_end="7\n")


@pytest.mark.slow
def test_sigterm_during_validation_ends_it_and_backs_up_the_epochs_last_step(job, reference):
    # The loop's invariant 2: the signal ends the validation after its batch; its partial values
    # are dropped, and the backup holds epoch 1 after its last step, so the resume validates again.
    proc, folder = job("val", "SIGTERM", "val1")  # epoch 1 validates after step 8
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert _backup(folder) == {"global_step": 8, "epoch": 1, "step_in_epoch": 4, "samples_in_epoch": 32}
    assert (folder / "train_end.txt").read_text() == "8\n"
    assert _exit(folder) == {**_clean_exit(), "step": 8}  # validation's eval mode is undone too
    assert len(_csv_rows(folder)) == 2  # epoch 0 was complete; epoch 1's row comes with the resume
    _assert_resumes_bit_exact(job, "val", reference[1], train_end="8\n")


@pytest.mark.slow
def test_a_signal_inside_an_accumulation_window_stops_where_the_window_closes(job, reference):
    # Two micro-batches per step: the signal comes after the first micro-batch of step 7.
    proc, folder = job("accumulate", "SIGTERM", "a6", accumulate=2)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert _backup(folder) == {"global_step": 7, "epoch": 3, "step_in_epoch": 2, "samples_in_epoch": 16}
    assert (folder / "train_end.txt").read_text() == "7\n"
    _assert_resumes_bit_exact(job, "accumulate", reference[2], accumulate=2, train_end="7\n")


@pytest.mark.slow
def test_without_backup_and_restore_callbacks_still_end_and_close(job):
    proc, folder = job("no_backup", "SIGTERM", "7", backup=False)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert not (folder / "backup").exists()
    assert (folder / "train_end.txt").read_text() == "7\n"
    assert _exit(folder) == {**_clean_exit(), "step": 7}
    assert _csv_rows(folder)[0].startswith("epoch,") and len(_csv_rows(folder)) == 2


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_second_signal_acts_at_once(job, sig):
    # A second SIGINT at once; a second SIGTERM once the repeat grace has passed.
    proc, folder = job(f"twice_{sig}", sig, "7", twice="late" if sig == "SIGTERM" else True)
    if sig == "SIGTERM":
        assert proc.returncode == 143, proc.stderr[-2000:]
    else:
        assert proc.returncode in SIGINT_STATUS and "KeyboardInterrupt" in proc.stderr
    assert not (folder / "train_end.txt").exists()  # no shutdown work after the second signal
    assert _backup(folder)["global_step"] == 6  # the last regular backup; none at the stop
    assert _exit(folder) == {**_clean_exit(), "step": 7}  # still closed (fit's finally)


@pytest.mark.slow
def test_a_sigterm_repeated_at_once_is_one_request_and_the_stop_backup_is_written(job):
    """SLURM signals every process of a job step and torchrun forwards its own SIGTERM: a worker
    gets SIGTERM twice within moments. Before, the second was an "exit now": no stop backup
    (the last was step 6) and no on_train_end; now the stop is the same as for one signal."""
    proc, folder = job("twice_at_once", "SIGTERM", "7", twice=True)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert _backup(folder) == {"global_step": 7, "epoch": 1, "step_in_epoch": 3, "samples_in_epoch": 24}
    assert (folder / "train_end.txt").read_text() == "7\n"
    assert _exit(folder) == {**_clean_exit(), "step": 7}


def test_the_repeat_grace_is_measured_from_the_first_sigterm():
    """Held: a SIGTERM within REPEAT_GRACE of the first; acts at once: a later one, and any
    signal of the other kind (a fake clock: no waiting)."""
    from fitkit.training import signals

    now = [100.0]
    with signals.deferred(clock=lambda: now[0]) as interrupt:
        os.kill(os.getpid(), signal.SIGTERM)
        assert (interrupt.signum, interrupt.at) == (signal.SIGTERM, 100.0)
        now[0] += signals.REPEAT_GRACE - 0.5
        os.kill(os.getpid(), signal.SIGTERM)  # the same request: held, nothing raised
        now[0] += 0.5
        with pytest.raises(SystemExit) as info:
            os.kill(os.getpid(), signal.SIGTERM)
        assert info.value.code == 143
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


# -- in this process ----------------------------------------------------------------------------
def _data():
    return line_data(24)


def _model() -> fitkit.Model:
    return line_model()


class _Closes(Callback):
    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def on_train_end(self, logs=None):
        self.events.append(f"on_train_end at {self.model.global_step}")

    def close(self):
        self.events.append("close")


class _SendAt(Callback):
    """Sends ``sig`` to this process at the end of optimizer step ``step``."""

    def __init__(self, step: int, sig: int):
        super().__init__()
        self.step, self.sig = step, sig

    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == self.step:
            os.kill(os.getpid(), self.sig)


def _handlers() -> tuple:
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)


def test_sigint_in_process_raises_keyboard_interrupt_after_on_train_end_and_close(tmp_path, capsys):
    model, closes, before = _model(), _Closes(), _handlers()
    w0 = model.module.weight.detach().clone()
    with pytest.raises(KeyboardInterrupt):
        model.fit(*_data(), batch_size=4, epochs=3, verbose=0, callbacks=[_SendAt(2, signal.SIGINT), closes])
    assert model.global_step == 2  # the step that was running finished; no step after it
    assert not torch.equal(model.module.weight, w0)
    assert closes.events == ["on_train_end at 2", "close"]
    assert capsys.readouterr().err == (
        "fitkit: SIGINT received: stopping after optimizer step 2, running "
        "on_train_end, then raising KeyboardInterrupt.\n"
    )  # no backup: none asked
    assert _handlers() == before
    assert model.module.training and torch.is_grad_enabled()


def test_sigterm_in_process_raises_system_exit_143_with_the_backup_of_that_step(tmp_path, capsys):
    model, before = _model(), _handlers()
    backup = BackupAndRestore(tmp_path / "b")
    with pytest.raises(SystemExit) as info:
        model.fit(*_data(), batch_size=4, epochs=3, verbose=0, callbacks=[_SendAt(8, signal.SIGTERM), backup])
    assert info.value.code == 143
    assert capsys.readouterr().err == (
        "fitkit: SIGTERM received: stopping after optimizer step 8, writing a "
        "backup, running on_train_end, then exiting with status 143.\n"
    )
    assert _handlers() == before
    state = torch.load(tmp_path / "b" / "backup.pt", weights_only=True)
    assert (state["global_step"], state["epoch"], state["step_in_epoch"]) == (8, 1, 2)
    assert torch.equal(state["module"]["weight"], model.module.weight.detach())


def test_a_custom_previous_handler_comes_back_and_hears_the_second_signal(monkeypatch):
    from fitkit.training import signals

    monkeypatch.setattr(signals, "REPEAT_GRACE", 0.0)  # the second SIGTERM is no repeat of the first
    heard = []

    def mine(signum, frame):
        heard.append(signum)

    old = signal.signal(signal.SIGTERM, mine)
    try:
        model = _model()
        model.fit(*_data(), batch_size=4, epochs=1, verbose=0)
        assert signal.getsignal(signal.SIGTERM) is mine  # restored after a normal fit
        with deferred() as interrupt:
            os.kill(os.getpid(), signal.SIGTERM)
            assert interrupt.signum == signal.SIGTERM and heard == []  # held
            os.kill(os.getpid(), signal.SIGTERM)
            assert heard == [signal.SIGTERM]  # the second one reaches the previous handler at once
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)


def test_fit_in_another_thread_installs_no_handler():
    before, seen, errors = _handlers(), [], []

    def look(batch, logs):
        seen.append(_handlers())

    def train():
        try:
            cb = LambdaCallback(on_train_batch_end=look)
            _model().fit(*_data(), batch_size=4, epochs=1, verbose=0, callbacks=[cb])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=train)
    t.start()
    t.join()
    assert errors == [] and len(seen) == 6
    assert all(h == before for h in seen)  # signals go to the main thread's handlers, untouched


def test_deferred_disabled_holds_nothing():
    before = _handlers()
    with deferred(enabled=False) as interrupt:
        assert _handlers() == before
    assert interrupt.signum is None


WATCHED = """
import os, signal, sys, time
from fitkit.training.signals import deferred, watchdog
acted = sys.argv[1] == "acted"
with deferred() as interrupt, watchdog(lambda: acted, grace=0.5):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(3)  # as a rank that waits: its handler holds the signal, the step never ends
print("held", interrupt.signum)
"""


@pytest.mark.parametrize("acted", ["acted", "waiting"])
def test_the_watchdog_ends_a_process_that_does_not_act_on_a_signal_within_the_grace(acted):
    """Not acted on 0.5 s after the SIGTERM: status 143 and the line; acted on (the fit's stop
    and backup under way): the process goes on and ends as the fit decides."""
    done = subprocess.run([sys.executable, "-c", WATCHED, acted], capture_output=True, text=True, timeout=120)
    line = (
        "fitkit: SIGTERM received 0.5 s ago, but rank 0 could not reach a step where the ranks agree to stop: it "
        "waits for another rank (in a collective) or runs a long step or callback. Exiting with status 143 without "
        "a stop backup (FITKIT_SIGNAL_GRACE=0.5); the last backup stays the resume point.\n"
    )
    if acted == "acted":
        assert (done.returncode, done.stdout, done.stderr) == (0, "held 15\n", "")
    else:
        assert (done.returncode, done.stdout, done.stderr) == (143, "", line)


def test_the_watchdog_leaves_a_wakeup_fd_it_does_not_own_and_puts_back_none():
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        signal.set_wakeup_fd(write)
        with watchdog(lambda: False, grace=0.5):
            assert signal.set_wakeup_fd(write) == write  # still the owner's (an event loop's)
        assert signal.set_wakeup_fd(-1) == write
        with watchdog(lambda: False, grace=0.5):
            assert signal.set_wakeup_fd(-1) not in (-1, write)  # the watchdog's own
        assert signal.set_wakeup_fd(-1) == -1
    finally:
        signal.set_wakeup_fd(-1)
        os.close(read), os.close(write)


@pytest.mark.parametrize(
    ("env", "grace"),
    [
        ({}, 20.0),
        ({"FITKIT_SIGNAL_GRACE": "3"}, 3.0),
        ({"PET_SHUTDOWN_TIMEOUT": "110"}, 100.0),
        ({"PET_SHUTDOWN_TIMEOUT": "25"}, 20.0),
        ({"PET_SHUTDOWN_TIMEOUT": "110", "FITKIT_SIGNAL_GRACE": "7.5"}, 7.5),
    ],
)
def test_the_grace_follows_torchruns_shutdown_timeout_unless_set(monkeypatch, env, grace):
    for key in ("FITKIT_SIGNAL_GRACE", "PET_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert signal_grace() == grace


def test_a_grace_that_is_not_a_positive_number_is_refused(monkeypatch):
    monkeypatch.setenv("FITKIT_SIGNAL_GRACE", "soon")
    with pytest.raises(
        ValueError,
        match=r"Expected FITKIT_SIGNAL_GRACE to be a positive float\. Received: "
        r"FITKIT_SIGNAL_GRACE='soon'\. Fix: unset it",
    ):
        signal_grace()
