"""fitkit.files: atomic writes, full disks, stale temps, named damage, checksums, safe payloads."""

from __future__ import annotations

import builtins
import collections
import errno
import os
import stat
import subprocess
import zipfile

import numpy as np
import pytest
import torch
from _tmpfs import tmpfs
from conftest import WrappedFile

import fitkit
from fitkit.files import (
    CheckpointError,
    atomic_save,
    check_target,
    check_weights_only,
    cut_to_last_line,
    payload_checksum,
    remove_stale_temps,
    safe_load,
    to_python,
)
from fitkit.files import writing as files_writing


def _payload(n: int = 256) -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "fitkit_version": fitkit.__version__,
        "module": {"0.weight": torch.randn(n, 4, generator=g), "0.bias": torch.zeros(n)},
        "epoch": 3,
        "history": {"history": {"loss": [1.5, 0.25]}, "epoch": [0, 1]},
        "rng": {"python": (3, tuple(range(5)), None), "torch": torch.get_rng_state()},
    }


def _listing(folder) -> list[str]:
    return sorted(os.listdir(folder))


# -- writing --------------------------------------------------------------------------------
def test_a_checkpoint_carries_a_checksum_and_still_loads_with_plain_torch(tmp_path):
    path = tmp_path / "c.pt"
    atomic_save(_payload(), path)
    raw = torch.load(path, weights_only=True)
    assert raw["fitkit_checksum"] == payload_checksum(_payload())
    loaded = safe_load(path, "cpu")
    assert "fitkit_checksum" not in loaded and torch.equal(
        loaded["module"]["0.weight"], _payload()["module"]["0.weight"]
    )
    atomic_save({"weight": torch.ones(2)}, tmp_path / "w.pt")  # a state dict keeps exactly its keys
    assert list(torch.load(tmp_path / "w.pt", weights_only=True)) == ["weight"]


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_files_get_the_mode_the_umask_gives(tmp_path, mask):
    old = os.umask(mask)
    try:
        atomic_save({"a": torch.ones(1)}, tmp_path / "c.pt")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "c.pt").st_mode) == 0o666 & ~mask


class _FullDisk(WrappedFile):
    """A file whose writes fail with ENOSPC once ``room`` bytes are written."""

    def __init__(self, f, room):
        super().__init__(f)
        self.room = room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)


def _assert_disk_full_left_the_old_file(excinfo, path, folder):
    assert excinfo.value.errno == errno.ENOSPC
    assert str(path) in str(excinfo.value) and "Fix: free space or choose another folder" in str(excinfo.value)
    assert torch.equal(safe_load(path, "cpu")["a"], torch.ones(2))  # the older file is intact
    assert _listing(folder) == ["c.pt"]  # and no temp file is left


@pytest.mark.parametrize("room", [0, 100, 5000])
def test_a_full_disk_raises_enospc_naming_the_path(tmp_path, monkeypatch, room):
    path = tmp_path / "c.pt"
    atomic_save({"a": torch.ones(2)}, path)
    real_open = builtins.open
    monkeypatch.setattr(files_writing, "open", lambda *a, **k: _FullDisk(real_open(*a, **k), room), raising=False)
    with pytest.raises(OSError) as excinfo:
        atomic_save({"a": torch.zeros(2), "big": torch.zeros(10_000)}, path)
    _assert_disk_full_left_the_old_file(excinfo, path, tmp_path)


def test_torchs_opaque_short_write_error_is_named_a_full_disk(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    atomic_save({"a": torch.ones(2)}, path)

    def save(obj, f):
        f.write(b"PK\x03\x04")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(OSError) as excinfo:
        atomic_save({"a": torch.zeros(2)}, path)
    _assert_disk_full_left_the_old_file(excinfo, path, tmp_path)
    assert "unexpected pos" in str(excinfo.value.__cause__)  # torch's own text stays chained


def test_a_real_full_tmpfs(tmp_path):
    with tmpfs(tmp_path / "small", "64k") as folder:
        path = folder / "c.pt"
        atomic_save({"a": torch.ones(2)}, path)
        with pytest.raises(OSError) as excinfo:
            atomic_save({"a": torch.zeros(2), "big": torch.zeros(100_000)}, path)  # 400 kB
        _assert_disk_full_left_the_old_file(excinfo, path, folder)


def test_a_payload_that_would_not_load_back_is_never_written(tmp_path):
    path = tmp_path / "c.pt"
    state = {"fitkit_version": "0.1.0", "callbacks": {"MyCb": {"x": np.zeros(2)}}}
    with pytest.raises(TypeError, match=r"checkpoint\['callbacks'\]\['MyCb'\]\['x'\] is a numpy.ndarray, which torch"):
        atomic_save(state, path)
    assert _listing(tmp_path) == []
    point = collections.namedtuple("Point", "x")
    for bad, name in [(np.float64(0.5), "numpy.float64"), (point(1), "Point"), (range(2), "range")]:
        with pytest.raises(TypeError, match=rf"checkpoint\['a'\]\[1\] is a \S*{name}, .* nothing was written"):
            check_weights_only({"a": [0, bad]}, path)


def test_every_type_check_weights_only_accepts_loads_with_weights_only(tmp_path):
    ok = {
        "s": "x",
        "b": b"y",
        "ba": bytearray(b"z"),
        "i": 1,
        "f": 0.5,
        "c": 1j,
        "t": True,
        "n": None,
        "od": collections.OrderedDict(a=1),
        "l": [1],
        "tu": (1,),
        "set": {1},
        "size": torch.Size([2]),
        "dtype": torch.float16,
        "dev": torch.device("cpu"),
        "layout": torch.strided,
        "tensor": torch.ones(2),
        "param": torch.nn.Parameter(torch.ones(1)),
        3: "int key",
    }
    check_weights_only(ok, tmp_path / "c.pt")
    torch.save(ok, tmp_path / "c.pt")
    assert set(torch.load(tmp_path / "c.pt", weights_only=True)) == set(ok)


def test_remove_stale_temps_removes_only_its_own_names(tmp_path):
    names = [".c.pt.abc123.tmp", ".c.pt.x.tmp", "c.pt", ".d.pt.abc.tmp", "c.pt.tmp", ".c.pt.abc.txt"]
    for name in names:
        (tmp_path / name).write_text("x")
    removed = remove_stale_temps(tmp_path, "c.pt")
    assert sorted(p.name for p in removed) == [".c.pt.abc123.tmp", ".c.pt.x.tmp"]
    assert _listing(tmp_path) == sorted(set(names) - {".c.pt.abc123.tmp", ".c.pt.x.tmp"})
    assert [p.name for p in remove_stale_temps(tmp_path, "*.pt")] == [".d.pt.abc.tmp"]
    assert remove_stale_temps(tmp_path / "missing", "c.pt") == []


@pytest.mark.parametrize(
    "text, kept",
    [("a,b\n1,2\n3,", "a,b\n1,2\n"), ("a,b\n1,2\n", "a,b\n1,2\n"), ("a,b", ""), ("", ""), ("a\n" + "9" * 70000, "a\n")],
)
def test_cut_to_last_line(tmp_path, text, kept):
    path = tmp_path / "log.csv"
    path.write_text(text)
    assert cut_to_last_line(path) == len(kept)
    assert path.read_text() == kept


def test_check_target_names_the_argument_and_the_fix(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"CSVLogger writes a file at `filename`, but it is an existing folder.*Fix"):
        check_target(tmp_path, "filename", "CSVLogger")
    with pytest.raises(
        ValueError, match="BackupAndRestore writes a folder at `backup_dir`, but it is an existing file"
    ):
        check_target(tmp_path / "file", "backup_dir", "BackupAndRestore", "folder")
    with pytest.raises(ValueError, match="but it is empty"):
        check_target("", "backup_dir", "BackupAndRestore", "folder")
    with pytest.raises(TypeError, match="Expected `filepath` to be a str or a path. Received: filepath=3"):
        check_target(3, "filepath", "ModelCheckpoint")
    assert check_target(tmp_path / "new.pt", "filepath", "ModelCheckpoint") == str(tmp_path / "new.pt")


# -- payload --------------------------------------------------------------------------------
def test_to_python_turns_log_values_into_python_numbers():
    logs = {"a": np.float64(0.5), "b": np.int64(3), "c": torch.tensor(2.5), "d": np.array([1.0, 2.0])}
    logs.update({"e": torch.tensor(True), "f": [np.float32(0.25)], "g": "text", "h": torch.tensor([1, 2])})
    out = to_python(logs)
    assert out == {"a": 0.5, "b": 3, "c": 2.5, "d": [1.0, 2.0], "e": True, "f": [0.25], "g": "text", "h": [1, 2]}
    assert [type(out[k]) for k in "abce"] == [float, int, float, bool] and type(out["f"][0]) is float


def test_the_checksum_survives_a_round_trip_and_sees_every_change(tmp_path):
    payload = {
        **_payload(),
        "set": {"a", "b"},
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "view": torch.ones(4, 4)[:, 1],
    }
    torch.save(payload, tmp_path / "p.pt")
    assert payload_checksum(torch.load(tmp_path / "p.pt", weights_only=True)) == payload_checksum(payload)
    base = payload_checksum({"a": [1, 2.0]})
    for other in [{"a": [1, 2]}, {"a": (1, 2.0)}, {"a": [1, 2.0, None]}, {"b": [1, 2.0]}]:
        assert payload_checksum(other) != base


# -- reading: named damage ------------------------------------------------------------------
def _saved(tmp_path) -> tuple[os.PathLike, bytes]:
    path = tmp_path / "c.pt"
    atomic_save(_payload(), path)
    return path, path.read_bytes()


def test_an_empty_file_is_named_empty(tmp_path):
    (tmp_path / "c.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"'.*c.pt' is empty \(0 bytes\).*Fix: use an earlier checkpoint"):
        safe_load(tmp_path / "c.pt", "cpu")


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9, 0.999])
def test_a_truncated_file_is_named_truncated(tmp_path, keep):
    path, data = _saved(tmp_path)
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"c.pt' is truncated \(its end is missing\).*Fix"):
        safe_load(path, "cpu")


@pytest.mark.parametrize(
    "data",
    [b"epoch,loss\n0,1.5\n", bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)), b"\x80\x04K\x01."],
)
def test_a_file_that_is_not_a_checkpoint_is_named_so(tmp_path, data):
    (tmp_path / "c.pt").write_bytes(data)
    with pytest.raises(CheckpointError, match=r"c.pt' is not a fitkit or torch checkpoint \(it starts with .*Fix"):
        safe_load(tmp_path / "c.pt", "cpu")


def test_a_zip_that_is_not_a_torch_file_is_named_damaged(tmp_path):
    with zipfile.ZipFile(tmp_path / "c.pt", "w") as z:
        z.writestr("readme.txt", "hello")
    with pytest.raises(CheckpointError, match="c.pt' is damaged: torch.load failed with"):
        safe_load(tmp_path / "c.pt", "cpu")


def test_a_file_from_a_newer_fitkit_is_named_so(tmp_path):
    atomic_save({**_payload(), "fitkit_version": "99.0.0"}, tmp_path / "c.pt")
    with pytest.raises(
        CheckpointError, match=r"written by fitkit 99.0.0, newer than this fitkit .*pip install -U torch-fitkit"
    ):
        safe_load(tmp_path / "c.pt", "cpu")


def test_files_without_a_checksum_still_load(tmp_path):
    state = {"weight": torch.ones(2, 2)}
    torch.save(state, tmp_path / "plain.pt")  # user code
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    torch.save({k: v for k, v in _payload().items()}, tmp_path / "old.pt")  # an older fitkit: no checksum
    for name in ["plain.pt", "legacy.pt"]:
        assert torch.equal(safe_load(tmp_path / name, "cpu")["weight"], state["weight"])
    assert safe_load(tmp_path / "old.pt", "cpu")["epoch"] == 3


def _tensor_region(data: bytes, tensor: torch.Tensor) -> int:
    start = data.find(tensor.numpy().tobytes())
    assert start > 0
    return start


def test_twenty_single_bit_flips_in_tensor_bytes_are_all_detected(tmp_path):
    path, data = _saved(tmp_path)
    weight = _payload()["module"]["0.weight"]
    start, size = _tensor_region(data, weight), weight.numel() * 4
    for k in range(20):
        pos = start + k * (size - 1) // 19
        flipped = bytearray(data)
        flipped[pos] ^= 1 << (k % 8)
        path.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError, match=r"c.pt' is corrupted: checksum mismatch in its record '.*data/\d+'"):
            safe_load(path, "cpu")


def test_the_payload_checksum_catches_what_the_archive_crc_does_not(tmp_path, monkeypatch):
    path, data = _saved(tmp_path)
    monkeypatch.setattr("fitkit.files.reading._verify_archive", lambda p, where: None)  # as torch.load alone
    weight = _payload()["module"]["0.weight"]
    flipped = bytearray(data)
    flipped[_tensor_region(data, weight) + 100] ^= 0x10
    path.write_bytes(bytes(flipped))
    assert not torch.equal(torch.load(path, weights_only=True)["module"]["0.weight"], weight)  # torch: silent
    with pytest.raises(CheckpointError, match="c.pt' is corrupted: its checksum does not match its contents"):
        safe_load(path, "cpu")
    # Rewritten by another tool with a changed value but the old checksum: caught as well.
    monkeypatch.undo()
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    raw["epoch"] = 4
    torch.save(raw, path)
    with pytest.raises(CheckpointError, match="its checksum does not match"):
        safe_load(path, "cpu")


class _Run:
    """Unpickling calls ``fn(*args)``; each variant would create ``target`` if it ran."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _exploits(target) -> list:
    t = str(target)
    code = f"open({t!r}, 'w').close()"
    calls = [
        _Run(open, t, "w"),
        _Run(exec, code),
        _Run(eval, f"__import__('builtins').exec({code!r})"),
        _Run(os.system, f"touch {t}"),
        _Run(os.mkdir, t),
        _Run(os.makedirs, t),
        _Run(subprocess.call, ["touch", t]),
        _Run(subprocess.run, ["touch", t]),
        _Run(subprocess.Popen, ["touch", t]),
        _Run(compile, code, "x", "exec"),
    ]
    nested = [{"module": c} for c in calls[:4]] + [[1, calls[0]], (calls[3],), {"a": {"b": [calls[1]]}}]
    nested += [{"fitkit_version": fitkit.__version__, "callbacks": {"Cb": calls[6]}}, torch.nn.Linear(1, 1)]
    nested += [{"optimizer": torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)}]
    return calls + nested


def test_twenty_malicious_pickles_are_refused_and_none_runs(tmp_path):
    target = tmp_path / "pwned"
    exploits = _exploits(target)
    assert len(exploits) == 20
    for i, obj in enumerate(exploits):
        path = tmp_path / f"evil{i}.pt"
        torch.save(obj, path)
        with pytest.raises(RuntimeError, match="Refused to load .*weights_only=True"):
            safe_load(path, "cpu")
        assert not target.exists(), f"exploit {i} ran"


def test_a_missing_file_and_a_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="No checkpoint file at"):
        safe_load(tmp_path / "missing.pt", "cpu")
    with pytest.raises(IsADirectoryError, match="is a folder, not a checkpoint. Fix: pass the file in it"):
        safe_load(tmp_path, "cpu")
