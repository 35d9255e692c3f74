"""Loading is all or nothing for content too; every kind of damage is named, and a damaged newest
backup falls back to the previous one; weights files carry a checksum; hostile files cost little."""

from __future__ import annotations

import copy
import json
import struct
import warnings
import zipfile

import pytest
import torch

import fitkit
from fitkit.callbacks import BackupAndRestore, ModelCheckpoint
from fitkit.checks import FitkitWarning
from fitkit.files import CheckpointError, atomic_save, load_safetensors, safe_load
from fitkit.files.payload import with_weights_checksum

X, Y = torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), torch.randn(8, 1)


def _model(lr=0.1):
    torch.manual_seed(0)
    model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
    model.compile(optimizer=lambda p: torch.optim.Adam(p, lr=lr), loss="mse")
    return model


def _snapshot(model):
    return copy.deepcopy(
        {"module": model.module.state_dict(), "optimizer": model.optimizer.state_dict(), "step": model.global_step}
    )


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _trained(tmp_path):
    model = _model()
    model.fit(X, Y, epochs=1, verbose=0)
    model.save_checkpoint(tmp_path / "c.pt")
    return torch.load(tmp_path / "c.pt", weights_only=True)


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("epoch", "x", "checkpoint\\['epoch'\\] is 'x', expected an int >= 0"),
        ("epoch", -1, "checkpoint\\['epoch'\\] is -1"),
        ("global_step", -5, "checkpoint\\['global_step'\\] is -5"),
        ("step_in_epoch", 1.5, "checkpoint\\['step_in_epoch'\\] is 1.5"),
        ("callbacks", [], "checkpoint\\['callbacks'\\] is \\[\\]"),
    ],
    ids=["epoch str", "epoch negative", "global_step negative", "position float", "callbacks list"],
)
def test_a_crafted_checkpoint_is_refused_before_anything_changes(tmp_path, key, value, expected):
    state = _trained(tmp_path)
    state[key] = value
    atomic_save(state, tmp_path / "c.pt")  # checksum recomputed: only the content is wrong
    model = _model(lr=0.5)
    model.train_on_batch(X, Y)
    before = _snapshot(model)
    pattern = f"(?s)content fitkit does not write.*nothing was loaded.*{expected}.*Fix"
    with pytest.raises(CheckpointError, match=pattern):
        model.load_checkpoint(tmp_path / "c.pt")
    assert _same(_snapshot(model), before) and model._core.resume is None


def test_a_callback_state_of_the_wrong_type_is_refused_at_resume_before_step_1(tmp_path):
    folder = tmp_path / "bk"
    model = _model()
    cbs = [ModelCheckpoint(tmp_path / "m{epoch}.pt", monitor="loss", save_top_k=1), BackupAndRestore(folder)]
    with pytest.raises(KeyboardInterrupt):
        model.fit(X, Y, epochs=3, verbose=0, callbacks=[*cbs, _Stop(1)])
    state = torch.load(folder / "backup.pt", weights_only=True)
    state["callbacks"]["ModelCheckpoint"]["kept"] = "m1.pt"
    atomic_save(state, folder / "backup.pt")
    (folder / "backup.prev.pt").unlink(missing_ok=True)
    fresh = _model()
    before = _snapshot(fresh)
    with pytest.raises(CheckpointError, match=r"callbacks\['ModelCheckpoint'\]: its state\['kept'\] is 'm1.pt'"):
        fresh.fit(
            X,
            Y,
            epochs=3,
            verbose=0,
            callbacks=[
                ModelCheckpoint(tmp_path / "m{epoch}.pt", monitor="loss", save_top_k=1),
                BackupAndRestore(folder),
            ],
        )
    assert _same(_snapshot(fresh), before)
    # Loaded before fit, the states are checked when fit applies them, before step 1.
    fresh.load_checkpoint(folder / "backup.pt")
    with pytest.raises(ValueError, match=r"ModelCheckpoint'\]: its state\['kept'\]"):
        fresh.fit(
            X,
            Y,
            epochs=3,
            verbose=0,
            callbacks=[ModelCheckpoint(tmp_path / "m{epoch}.pt", monitor="loss", save_top_k=1)],
        )
    assert fresh.global_step == 2  # the loaded position, no step more


class _Stop(fitkit.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch + 1:
            raise KeyboardInterrupt


def _flip(path, offset_from_end=None, at=None):
    data = bytearray(path.read_bytes())
    i = at if at is not None else len(data) - offset_from_end
    data[i] ^= 0x10
    path.write_bytes(bytes(data))


def _zero_crcs(path):
    """Zero every CRC-32 field (local headers and central directory): torch's compute_crc32=False."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
    for info in infos:
        data[info.header_offset + 14 : info.header_offset + 18] = b"\0\0\0\0"
    pos = 0
    while (pos := data.find(b"PK\x01\x02", pos)) >= 0:
        data[pos + 16 : pos + 20] = b"\0\0\0\0"
        pos += 4
    path.write_bytes(bytes(data))


def _tensor_offset(path, record_suffix):
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(record_suffix))
    data = path.read_bytes()
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len


def _damage(kind, path):
    if kind == "garbage text":
        path.write_text("this is not a checkpoint\n")
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[:300])
    elif kind == "random bytes":
        path.write_bytes(bytes(range(256)) * 4)
    elif kind == "flipped byte, CRC zeroed":
        _flip(path, at=_tensor_offset(path, "data/0") + 1)
        _zero_crcs(path)
    elif kind == "edited content":
        state = torch.load(path, weights_only=True)
        state["epoch"] = -3
        atomic_save(state, path)
    elif kind == "empty":
        path.write_bytes(b"")


DAMAGE = ["garbage text", "truncated", "random bytes", "flipped byte, CRC zeroed", "edited content", "empty"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_every_kind_of_damage_of_the_newest_backup_falls_back_to_the_previous_one(tmp_path, kind):
    folder = tmp_path / "bk"
    with pytest.raises(KeyboardInterrupt):
        _model().fit(X, Y, epochs=4, verbose=0, callbacks=[BackupAndRestore(folder), _Stop(2)])
    prev = torch.load(folder / "backup.prev.pt", weights_only=True)
    assert prev["epoch"] == 2  # the backup of epoch 2; backup.pt is epoch 3's
    _damage(kind, folder / "backup.pt")
    model = _model()
    with pytest.warns(FitkitWarning, match="backup.pt' is damaged, so training resumes from the previous backup"):
        history = model.fit(X, Y, epochs=4, verbose=0, callbacks=[BackupAndRestore(folder)])
    assert history.epoch == [0, 1, 2, 3] and model.global_step == 4
    reference = _model()
    reference.fit(X, Y, epochs=4, verbose=0)
    assert torch.equal(model.module.weight, reference.module.weight)  # resumed from epoch 2 exactly


def test_weights_files_carry_a_checksum_and_stay_plain_state_dicts(tmp_path):
    model = _model()
    model.save_weights(tmp_path / "w.pt")
    plain = torch.load(tmp_path / "w.pt", weights_only=True)  # any torch tool reads it
    assert sorted(plain) == ["bias", "weight"]
    torch.nn.Linear(2, 1).load_state_dict(plain)
    path = tmp_path / "w.pt"
    _flip(path, at=_tensor_offset(path, "data/0") + 1)
    _zero_crcs(path)  # the CRC cannot tell: the payload checksum does
    other = _model(lr=0.3)
    before = _snapshot(other)
    with pytest.raises(CheckpointError, match="w.pt' is corrupted: its checksum does not match its tensors"):
        other.load_weights(path)
    assert _same(_snapshot(other), before)


def test_a_legacy_format_weights_file_is_checked_and_an_old_file_without_a_checksum_loads(tmp_path):
    state = _model().module.state_dict()
    legacy = tmp_path / "legacy.pt"
    torch.save(with_weights_checksum(state), legacy, _use_new_zipfile_serialization=False)
    data = bytearray(legacy.read_bytes())
    raw = state["weight"].numpy().tobytes()
    data[data.find(raw) + 2] ^= 0x01
    legacy.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="legacy.pt' is corrupted: its checksum"):
        safe_load(legacy, "cpu")
    torch.save(state, tmp_path / "old.pt")  # an older fitkit's (or torch's) file: no checksum
    model = _model(lr=0.7)
    model.load_weights(tmp_path / "old.pt")
    assert torch.equal(model.module.weight, state["weight"])


def test_a_flipped_record_name_in_the_central_directory_is_named(tmp_path):
    path = tmp_path / "c.pt"
    _model().save_checkpoint(path)
    data = bytearray(path.read_bytes())
    central = data.find(b"PK\x01\x02")
    name_at = data.find(b"data.pkl", central)
    data[name_at] = ord("x")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="c.pt' is (damaged|truncated|corrupted).*Fix"):
        safe_load(path, "cpu")


def test_a_hostile_compressed_record_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "c.pt"
    _model().save_checkpoint(path)
    top = zipfile.ZipFile(path).namelist()[0].split("/")[0]
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{top}/data/99", b"\0" * 10_000_000)  # 10 MB that deflate to ~10 kB
    assert path.stat().st_size < 200_000
    with pytest.raises(CheckpointError, match="record '.*data/99' is compressed, which torch never does"):
        safe_load(path, "cpu")
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(f"{top}/extra.bin", b"x")
    with pytest.raises(CheckpointError, match="damaged or is not a torch file"):
        safe_load(path, "cpu")


def test_damaged_safetensors_metadata_and_a_huge_header_are_named(tmp_path):
    pytest.importorskip("safetensors")
    import safetensors.torch

    path = tmp_path / "w.safetensors"
    w = torch.ones(2, 2)
    safetensors.torch.save_file({"a": w}, path, metadata={"fitkit_aliases": "{not json"})
    with pytest.raises(CheckpointError, match="metadata 'fitkit_aliases' is not the JSON.*Fix"):
        load_safetensors(path)
    safetensors.torch.save_file({"a": w}, path, metadata={"fitkit_aliases": json.dumps({"b": "missing"})})
    with pytest.raises(CheckpointError, match="fitkit_aliases"):
        load_safetensors(path)
    path.write_bytes(struct.pack("<Q", 90_000_000) + b"{" + b" " * 100)  # a 90 MB header, 109 bytes of file
    with pytest.raises(CheckpointError, match="header declares 90000000 bytes.*not parsed"):
        load_safetensors(path)
    with open(path, "wb") as f:  # a sparse 200 MB file: the header would fit in it
        f.write(struct.pack("<Q", 200_000_000))
        f.truncate(200_000_100)
    with pytest.raises(CheckpointError, match="safetensors allows at most 100000000"):
        load_safetensors(path)


def test_load_state_dict_is_all_or_nothing(tmp_path):
    model = _model()
    good = {k: v + 1 for k, v in model.module.state_dict().items()}
    before = copy.deepcopy(model.module.state_dict())
    for bad, expected in [
        ({**good, "extra": torch.zeros(1)}, "'extra': in the file, not in the module"),
        ({"weight": good["weight"]}, "'bias': in the module, missing from the file"),
        ({**good, "bias": good["bias"].double()}, "'bias': dtype torch.float64 in the file"),
    ]:
        with pytest.raises(RuntimeError, match=f"(?s)nothing was loaded.*{expected}"):
            model.load_state_dict(bad)
        assert _same(model.module.state_dict(), before)
    with pytest.raises(RuntimeError, match="dtype"):
        model.load_state_dict({"weight": good["weight"], "bias": good["bias"].double()}, strict=False)
    assert _same(model.module.state_dict(), before)
    with warnings.catch_warnings():
        model.load_state_dict({"weight": good["weight"], "extra": torch.zeros(1)}, strict=False)
    assert torch.equal(model.module.weight, good["weight"]) and torch.equal(model.module.bias, before["bias"])
