"""Callbacks that log epochs to files: ``CSVLogger`` and ``TensorBoard``.

Both write on rank 0 only when ``torch.distributed`` is initialized, and both open their
files at the first write, so a ``fit`` that fails its checks before the first step leaves
no file behind.
"""

from __future__ import annotations

import csv
import errno
import io
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from fitkit.callbacks.locking import take_lock
from fitkit.callbacks.logkeys import is_term_key
from fitkit.callbacks.mixins import StopsWriting
from fitkit.callbacks.monitor import StatefulCallback
from fitkit.callbacks.tensorboard import TensorBoard
from fitkit.checks import FitkitWarning, check_bool
from fitkit.checks.declared import Option, declare, declared
from fitkit.distributed.group import is_rank_zero
from fitkit.files import check_target, cut_to_last_line, to_python
from fitkit.files.content import typed_problems
from fitkit.files.locks import FileLock
from fitkit.files.preflight import check_writable_template

__all__ = ["CSVLogger", "TensorBoard"]  # TensorBoard lives in fitkit.callbacks.tensorboard


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _append_whole(path: Path, row: bytes, header: bytes) -> int:
    """Append ``row`` with one ``os.write`` (no buffer that a later flush could split), never
    through a symlink; a file deleted meanwhile is recreated, ``header`` first. On a failed or
    short write the file is cut back to its size before, so it keeps whole rows. Returns the
    file's size after."""
    flags = os.O_WRONLY | os.O_APPEND | _NOFOLLOW
    data = row
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:  # deleted mid-run: a new file, with its header
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, data = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666), header + row
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise OSError(
            e.errno,
            f"CSVLogger will not write through the symlink {str(path)!r} (it would change a file "
            "elsewhere). Fix: pass the real file, or remove the link.",
        ) from None
    try:
        size = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            os.ftruncate(fd, size)  # shrinking needs no space: the half row goes
            raise
        return size + written
    finally:
        os.close(fd)


def _cell(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    return str(to_python(value))


def _check_separator(separator: Any) -> None:
    """One character that can separate fields: not a line break, a quote, a letter or a digit."""
    if not isinstance(separator, str) or len(separator) != 1:
        raise ValueError(f"Expected `separator` to be one character. Received: separator={separator!r}.")
    if separator in '\r\n"' or separator.isalnum():
        raise ValueError(
            f"Expected `separator` to be one character that is not a line break, a quote, a letter or a digit "
            f"(the CSV reader would split rows or fields there). Received: separator={separator!r}. "
            "Fix: pass separator=',' or separator='\\t'."
        )


_CSV_LOGGER_OPTIONS = declare(
    "CSVLogger",
    Option("filename", "path"),
    Option("separator", "custom", check=_check_separator, bad=("\n", "\r", '"', ",,", "", 5)),
    Option("append", "bool"),
)


class CSVLogger(StopsWriting, StatefulCallback):
    """Write one row per epoch to a CSV file: ``epoch``, then one column per log key.

    The columns are fixed when the first row is written, in sorted order (Keras' order): every
    key of the epoch-log plan ``params["metrics"]`` (loss, metrics, learning rates, and the
    ``val_`` keys whenever fit validates, as Keras adds them up front), plus the keys that a
    callback earlier in the list adds to the first epoch's logs, and the terms of a loss that
    returns them (``loss_<name>``) beside every loss column (``val_loss_<name>`` too). A key with no value in an
    epoch is written as ``NA`` (a ``val_`` column on the epochs that ``validation_freq`` leaves
    out); a key that first appears in a later epoch is left out, with one warning.

    Each row is written whole, with one write, and flushed. With ``append=True`` an existing
    file is continued under its own header (its columns win). A resumed ``fit``
    (``BackupAndRestore`` or ``load_checkpoint``) always appends under the columns the
    checkpoint recorded: it first cuts the file back to the rows its checkpoint had seen, so a
    crash never leaves a row twice; both cut a partial last row (a write a kill interrupted)
    back to the last complete one. The column order is thus the same in every row and across
    a resume.

    With ``fit(validation_interval=...)`` the file gains a ``step`` column (``global_step``)
    and each validation gets a row of its own (its ``epoch``, ``step`` and ``val_`` values,
    the training columns ``NA``); the epoch rows then hold the training values.

    Args:
        filename: the CSV file.
        separator: the field separator: one character, not a line break, a quote, a letter or a
            digit (the CSV reader would split rows or fields there).
        append: continue an existing file instead of overwriting it.

    Raises:
        TypeError: ``filename`` is not a str or a path.
        ValueError: ``separator`` is not such a character; ``filename`` is empty or a folder.

    Example:
        >>> import os, tempfile, torch, fitkit
        >>> model = fitkit.Model(torch.nn.Linear(1, 1, bias=False), device="cpu")
        >>> model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss="mse")
        >>> path = os.path.join(tempfile.mkdtemp(), "log.csv")
        >>> x = torch.zeros(4, 1)  # the loss is 0
        >>> _ = model.fit(x, x, epochs=2, validation_data=(x, x), validation_freq=2,
        ...               callbacks=[CSVLogger(path)], verbose=0)
        >>> print(open(path).read())
        epoch,learning_rate,loss,val_loss
        0,0.5,0.0,NA
        1,0.5,0.0,0.0
        <BLANKLINE>
    """

    skip_in_fast_dev_run = True  # it writes files: fit(fast_dev_run=...) leaves it out

    @declared(_CSV_LOGGER_OPTIONS)
    def __init__(self, filename: str | os.PathLike, separator: str = ",", append: bool = False):
        super().__init__()
        check_bool("append", append)
        if not isinstance(separator, str) or len(separator) != 1:
            raise ValueError(f"Expected `separator` to be one character. Received: separator={separator!r}.")
        self.filename = Path(check_target(filename, "filename", "CSVLogger"))
        self.separator, self.append = separator, bool(append)
        self._lock: FileLock | None = None
        self._reset()

    def _reset(self) -> None:
        self.keys: list[str] | None = None  # the columns after ``epoch``, fixed at the first row
        self._size: int | None = None  # bytes of the file after the last row written
        self._opened = False  # whether this fit has prepared the file
        self._resumed = False  # whether this fit continues a checkpoint's rows
        self._warned: set[str] = set()

    def _get_state(self) -> dict[str, Any]:
        return {"keys": self.keys, "size": self._size}

    def _set_state(self, state: dict[str, Any]) -> None:
        self.keys, self._size = state["keys"], state["size"]
        self._opened, self._resumed = False, True

    def _state_problems(self, state: Any) -> list[str]:
        keys = (lambda v: v is None or (isinstance(v, list) and all(isinstance(k, str) for k in v)), "a list of str")
        size = (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0), "an int >= 0")
        out = typed_problems(state, {"keys": keys, "size": size}, "its state")
        header = None if out or state["keys"] is None else self._header()
        if header is not None and header != ["epoch", *state["keys"]]:
            out.append(
                f"its state['keys'] is {state['keys']!r}, but the columns of {str(self.filename)!r} are "
                f"{header[1:]!r} (the rows it continues)"
            )
        return out

    def _header(self) -> list[str] | None:
        """The first row of the file this logger continues (``None``: no file, or an empty one)."""
        path = self.filename
        if path.is_symlink() or not path.is_file():
            return None
        with open(path, newline="") as f:
            return next(csv.reader(f, delimiter=self.separator), None)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._stopped = False  # a new fit tries again
        if not is_rank_zero():
            return
        # Before step 1: a folder it can write, a name the file system takes, no link to
        # follow when appending, and no other run (or CSVLogger of this fit) on the file.
        check_writable_template(str(self.filename), None, "CSVLogger", "filename")
        if self.append and self.filename.is_symlink():
            raise ValueError(
                f"CSVLogger(append=True) would append through the symlink {str(self.filename)!r} to "
                f"{os.path.realpath(self.filename)!r}, a file elsewhere. Fix: pass the real file, or remove the link."
            )
        self.close()
        name = self.filename.name
        self._lock = take_lock(self.filename.parent / f".{name}.lock", f"the file {str(self.filename)!r}", "CSVLogger")

    def _open(self) -> bool:
        """Prepare the file for this fit's first row; return whether a header is needed.

        An appended file's header, when it has one, sets the columns.
        """
        self._opened = True
        path = self.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() and (self._resumed or self.append):
            raise ValueError(
                f"CSVLogger will not continue {str(path)!r}: it is a symlink to a file elsewhere. Fix: pass the "
                "real file, or remove the link."
            )
        exists = path.is_file() and path.stat().st_size > 0
        if self._resumed and self._size is not None and exists:
            os.truncate(path, min(self._size, path.stat().st_size))  # rows after the checkpoint go
            return cut_to_last_line(path) == 0
        if self.append and exists:
            if cut_to_last_line(path) == 0:
                return True
            with open(path, newline="") as f:
                header = next(csv.reader(f, delimiter=self.separator), None)
            if header:
                self.keys = [k for k in header if k != "epoch"]
            return not header
        if path.is_symlink():  # replaced, never followed (as the checkpoint writers do)
            path.unlink()
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o666))
        return True

    def _columns(self, logs: Any) -> list[str]:
        planned = (self.params or {}).get("metrics") or []
        step = ["step"] if (self.params or {}).get("validation_interval") else []
        # a loss of terms (fitkit.losses.terms): each term beside every planned loss column, so
        # that a val_loss_<name> of an epoch that did not validate still has its column
        names = {k.split("loss_", 1)[1] for k in logs if is_term_key(k)}
        terms = {f"{k}_{n}" for k in planned if k.endswith("loss") for n in names}
        return sorted(set(planned) | set(logs) | set(step) | terms)

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        if self.params.get("validation_interval"):  # the val_ values have rows of their own
            logs = {k: v for k, v in logs.items() if not k.startswith("val_")}
            logs["step"] = self.model.global_step
        self._row(epoch, logs)

    def on_validation_end(self, logs=None):
        """With ``validation_interval``: one row per validation (``epoch``, ``step``, ``val_``
        values; the training columns ``NA``)."""
        if self.params.get("validation_interval") and logs:
            self._row(int(logs["epoch"]), {k: v for k, v in logs.items() if k != "epoch"})

    def _row(self, epoch: int, logs: dict[str, Any]) -> None:
        if self._stopped:
            return
        header = False
        if is_rank_zero() and not self._opened:
            header = self._open()
        if self.keys is None:
            self.keys = self._columns(logs)
        new = [k for k in logs if k not in self.keys and k not in self._warned]
        if new:
            self._warned.update(new)
            warnings.warn(
                f"CSVLogger: the logs of epoch {epoch + 1} hold {', '.join(sorted(new))}, which the file's "
                f"columns (fixed at its first row: {', '.join(self.keys)}) do not have; left out. Fix: add "
                "the key from the first epoch on (or write NaN until it has a value).",
                category=FitkitWarning,
                stacklevel=2,
            )
        if not is_rank_zero():
            return
        text, head = io.StringIO(), io.StringIO()
        writer = csv.writer(text, delimiter=self.separator, lineterminator="\n")
        csv.writer(head, delimiter=self.separator, lineterminator="\n").writerow(["epoch", *self.keys])
        writer.writerow([epoch, *(_cell(logs[k]) if k in logs else "NA" for k in self.keys)])
        row = (head.getvalue() if header else "") + text.getvalue()
        try:
            self._size = _append_whole(self.filename, row.encode(), head.getvalue().encode())
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise
            self._stop_writing(
                OSError(
                    e.errno,
                    f"CSVLogger could not write epoch {epoch + 1} to {str(self.filename)!r}: {e.strerror}. "
                    "The file keeps its whole rows.",
                )
            )

    def close(self) -> None:
        """Release the file's lock (the file itself is opened for each row and closed after
        it). Idempotent, like every file-owning callback's ``close()``."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()
