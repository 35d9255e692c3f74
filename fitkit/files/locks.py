"""Locks that keep a run's folder (or file) its own, and the process tags of temp files.

A lock is a file, ``.<name>.lock``, created with ``O_CREAT | O_EXCL`` (atomic on local file
systems and NFSv3+): it holds the holder's pid and host. A second run that asks for the same
lock gets a :class:`LockError` naming them, before its first step. A lock whose holder is
dead (same host, no process with that pid, or that pid now another process's: the lock holds
the holder's start time and a token of its own) is taken over (``took_over`` says so; the
callbacks warn), so a killed run's folder resumes without a manual step. A lock from another
host cannot be checked, except that a SLURM job requeued onto another node (the same
``SLURM_JOB_ID``, a higher ``SLURM_RESTART_COUNT``) takes over its earlier attempt's locks:
SLURM requeues a job once it has ended. Any other lock from another host is taken over only on
the user's word, ``FITKIT_TAKE_OVER_LOCKS=1`` (every such lock of the re-run at once); a live
holder on this host never is. Temp files carry their writer's pid
(:func:`temp_prefix`), so the clean-up of a run's start removes only a dead process's temps.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import uuid
from pathlib import Path
from typing import Any

__all__ = ["FileLock", "LockError", "temp_prefix", "temp_owner", "pid_alive"]

_HOST = socket.gethostname()
TAKE_OVER = "FITKIT_TAKE_OVER_LOCKS"  # =1: take over locks of other hosts' runs (the user says they ended)


def _slurm_attempt() -> tuple[str | None, int]:
    """This process's SLURM job id (``None`` outside SLURM) and its requeue count."""
    try:
        attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        attempt = 0
    return os.environ.get("SLURM_JOB_ID") or None, attempt


class LockError(RuntimeError):
    """Another live run (or another callback of this fit) holds the lock of a folder or file."""


LockError.__module__ = "fitkit.files"


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat``), or ``None``
    where that cannot be read (not Linux, no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


#: This process's own mark in its locks: a process that reuses a dead one's pid (a restarted
#: container often runs as pid 1 again) is not taken for the lock's holder.
_TOKEN = uuid.uuid4().hex


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host (a zombie counts as alive).

    Example:
        >>> pid_alive(os.getpid())
        True
    """
    if pid <= 0 or pid > 2**31 - 1:  # no such pid (os.kill would raise OverflowError)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:
        return True
    return True


def temp_prefix(name: str) -> str:
    """The start of a temp file's name for the file ``name``: ``.<name>.<pid>-``.

    Example:
        >>> temp_prefix("w.pt") == f".w.pt.{os.getpid()}-"
        True
    """
    return f".{name}.{os.getpid()}-"


_OWNER = re.compile(r"\.(\d+)-[^.]*\.tmp$")


def temp_owner(tmp_name: str) -> int | None:
    """The pid a temp file's name carries (see :func:`temp_prefix`); ``None`` for an older name.

    Example:
        >>> temp_owner(".w.pt.4242-k2j4.tmp"), temp_owner(".w.pt.k2j4.tmp")
        (4242, None)
    """
    match = _OWNER.search(tmp_name)
    return int(match.group(1)) if match else None


class FileLock:
    """An exclusive lock on a folder or a file, held by this process until :meth:`release`.

    Args:
        path: the lock file, e.g. ``folder/.backup.lock``.
        what: what it guards, for messages, e.g. ``"the backup folder 'runs/bk'"``.
        who: the callback that takes it, for messages.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> a = FileLock(os.path.join(folder, ".x.lock"), "x", "CSVLogger").acquire()
        >>> FileLock(os.path.join(folder, ".x.lock"), "x", "CSVLogger").acquire()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        fitkit.files.LockError: CSVLogger cannot use x: it is in use by another callback of this fit ...
        >>> a.release(); os.listdir(folder)
        []
    """

    def __init__(self, path: str | os.PathLike, what: str, who: str):
        self.path, self.what, self.who = Path(path), what, who
        self.held = False
        self._made: list[Path] = []
        self.took_over: str | None = None  # what acquire() says when it took a dead run's lock

    def acquire(self) -> FileLock:
        """Take the lock (creating missing parent folders).

        Raises:
            LockError: a live process (this one included: another callback of the same fit)
                holds it, or a process on another host does.
        """
        self._made = _missing_folders(self.path.parent)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_dir():
            raise LockError(
                f"{self.who} cannot use {self.what}: a folder is where its lock file goes "
                f"({str(self.path)!r}). Fix: remove or rename that folder."
            )
        self._check_link()
        my_job, my_attempt = _slurm_attempt()
        record = json.dumps(
            {
                "pid": os.getpid(),
                "host": _HOST,
                "token": _TOKEN,
                "start": _start_time(os.getpid()),
                "job": my_job,
                "attempt": my_attempt,
            }
        ).encode()
        for _ in range(3):  # a dead holder's lock is removed, then taken
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released meanwhile, or unreadable (being written): try again
                pid, host, token, start, job, attempt = holder
                mine = host == _HOST and pid == os.getpid() and token in (None, _TOKEN)
                why = None if mine else self._ended(pid, host, token, start, job, attempt)
                if why is not None:
                    self.took_over = (
                        f"{self.who}: {self.what} was locked by process {pid} on {host}, {why}; the lock is taken over."
                    )
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
                    continue
                raise self._refusal(mine, pid, host) from None
            try:
                os.write(fd, record)
            finally:
                os.close(fd)
            self.held = True
            return self
        raise LockError(f"{self.who} could not take the lock {str(self.path)!r} of {self.what}. Fix: try again.")

    def _check_link(self) -> None:
        """A symbolic link where the lock file goes is no lock fitkit wrote: a dangling one is
        removed (the link only) and the lock taken, saying so; one to an existing file is refused."""
        if not self.path.is_symlink():
            return
        target = os.readlink(self.path)
        if self.path.exists():
            raise LockError(
                f"{self.who} cannot use {self.what}: a symbolic link is where its lock file goes "
                f"({str(self.path)!r} -> {target!r}), and fitkit does not write a lock through a link. "
                "Fix: remove the link (the file it points to stays)."
            )
        self.path.unlink()
        self.took_over = (
            f"{self.who}: a dangling symbolic link was where the lock of {self.what} goes "
            f"({str(self.path)!r} -> {target!r}); the link is removed and the lock taken."
        )

    @classmethod
    def _ended(
        cls, pid: int, host: str, token: str | None, start: int | None, job: str | None, attempt: int | None
    ) -> str | None:
        """Why the holder's run is known to have ended (then its lock is taken over), or ``None``."""
        if host == _HOST:
            if cls._running(pid, token, start):
                return None  # a live holder on this host: never taken over
            return "which is no longer running (it was killed or crashed, or its container restarted)"
        my_job, my_attempt = _slurm_attempt()
        if job is not None and job == my_job and attempt is not None and attempt < my_attempt:
            return f"an earlier attempt ({attempt}) of this SLURM job {job}, requeued since (attempt {my_attempt})"
        if os.environ.get(TAKE_OVER) == "1":
            return f"another host; {TAKE_OVER}=1 says that run has ended"
        return None

    def _refusal(self, mine: bool, pid: int, host: str) -> LockError:
        if mine:
            return LockError(
                f"{self.who} cannot use {self.what}: it is in use by another callback of this fit (lock file "
                f"{str(self.path)!r}). Two callbacks writing one folder would delete each other's files. Fix: "
                "give each callback a folder or file of its own."
            )
        text = (
            f"{self.who} cannot use {self.what}: it is in use by another run: process {pid} on host {host} "
            f"(lock file {str(self.path)!r}). Two runs writing one folder would delete each other's files. "
        )
        if host == _HOST:
            return LockError(text + "Fix: give each run a folder or file of its own, or wait for that run to end.")
        run = self.path.parent.parent  # the run's folder, when callbacks write into its sub-folders
        near = {*self.path.parent.glob(".*.lock"), *run.glob(".*.lock"), *run.glob("*/.*.lock")} - {self.path}
        others = sorted(str(p) for p in near)
        listed = f" Other locks near it: {others}." if others else ""
        return LockError(
            text + f"A process on another host cannot be checked from here.{listed} Fix: give each run a folder "
            f"of its own, or wait for that run to end; if it is over (a crashed machine, a job moved to another "
            f"node), run again with {TAKE_OVER}=1 to take over every lock it left at once, or delete the lock file."
        )

    @staticmethod
    def _running(pid: int, token: str | None, start: int | None) -> bool:
        """Whether the lock's holder still runs on this host: its pid is alive, is not this
        process (whose own locks carry its token), and started when the holder did."""
        if pid == os.getpid():
            return token is None or token == _TOKEN  # an older lock without a token: this process's
        if not pid_alive(pid):
            return False
        now = _start_time(pid)
        return start is None or now is None or now == start  # another start time: the pid was reused

    def _holder(self) -> tuple[int, str, str | None, int | None, str | None, int | None] | None:
        """``(pid, host, token, start, job, attempt)`` of the lock file (older locks: ``None`` for
        what they do not hold), or ``None`` when it is gone or being written."""
        try:
            data: Any = json.loads(self.path.read_text())
            start, job, attempt = data.get("start"), data.get("job"), data.get("attempt")
            return (
                int(data["pid"]),
                str(data["host"]),
                data.get("token"),
                int(start) if isinstance(start, int) else None,
                job if isinstance(job, str) else None,
                attempt if isinstance(attempt, int) else None,
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError):
            # An empty or garbled lock: its writer died between create and write, or it is
            # being written now. Treat an old one as dead (pid 0), a fresh one as a retry.
            return (0, _HOST, None, None, None, None) if _age(self.path) > 5 else None

    def release(self) -> None:
        """Give the lock up (idempotent; only the lock this object took is removed)."""
        if not self.held:
            return
        self.held = False
        holder = self._holder()
        if holder is not None and holder[:3] == (os.getpid(), _HOST, _TOKEN):
            try:
                os.unlink(self.path)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
        for folder in self._made:  # the folders the lock made, when nothing else came into them
            try:
                folder.rmdir()
            except OSError:
                break


def _missing_folders(folder: Path) -> list[Path]:
    """The folders ``mkdir(parents=True)`` would make, deepest first."""
    out = []
    while not folder.exists() and folder.parent != folder:
        out.append(folder)
        folder = folder.parent
    return out


def _age(path: Path) -> float:
    import time

    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0
