"""Sharded checkpoints (``torch.distributed.checkpoint``): under FSDP each rank writes and reads
its own shards; a folder loads at another world size, on one process without a process group
included; async writes; a write cut short is never taken for a checkpoint."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from _dist_scenarios import OPTIMIZERS, data, net
from _torchrun import run_torchrun

import fitkit
from fitkit.files import CheckpointError, consolidate_weights
from fitkit.files.manifest import MANIFEST_NAME, verify_manifest, write_manifest

JOB = """
import os, signal, torch, fitkit
import torch.distributed as dist
from fitkit.distributed import rank, dcp
from _dist_scenarios import data, net, full_params, OPTIMIZERS

def fsdp_model():
    torch.manual_seed(0)
    m = fitkit.Model(net(), device="cpu", strategy="fsdp")
    m.compile(optimizer=OPTIMIZERS["adam"], loss="mse")
    return m

def full_optim(m):  # the plain optimizer's format, gathered (a collective; rank 0 gets it)
    return m._core.parallel.optimizer_state_dict(m.module, m.optimizer)

gathers = []
plain_gather = fitkit.distributed.Parallel.state_dict
def counting_gather(self, module):
    gathers.append(1)
    return plain_gather(self, module)
fitkit.distributed.Parallel.state_dict = counting_gather

res = {}
x, y, w = data(37)
m = fsdp_model()
m.fit(x, y, batch_size=4, epochs=2, shuffle=True, verbose=0)
m.save_checkpoint(OUT / "ck")
res["full_gathers_in_save"] = len(gathers)
res["params"], res["optim"] = full_params(m), full_optim(m)
m2 = fsdp_model()
m2.load_checkpoint(OUT / "ck")
res["loaded_params"], res["loaded_optim"] = full_params(m2), full_optim(m2)
res["local_rows"] = {n: p.to_local().shape[0] for n, p in m2.module.named_parameters()}
# async: what is saved is the state at the call, whatever training does while it is written
m.save_checkpoint(OUT / "ck_async", async_save=True)
res["async_before"] = full_params(m)
with torch.no_grad():
    for p in m.module.parameters():
        p.add_(1.0)
dcp.wait()
m3 = fsdp_model()
m3.load_checkpoint(OUT / "ck_async")
res["async_loaded"] = full_params(m3)
m.save_weights(OUT / "full.safetensors")  # the full-weights export: one file, rank 0
# a flipped byte in rank 1's shard: every rank refuses the load (rank 0 checks), nothing changes
import shutil
if rank() == 0:
    shutil.copytree(OUT / "ck", OUT / "ck_flip")
    shard = bytearray((OUT / "ck_flip" / "__1_0.distcp").read_bytes())
    shard[len(shard) // 2] ^= 0x01
    (OUT / "ck_flip" / "__1_0.distcp").write_bytes(bytes(shard))
dist.barrier()
m4 = fsdp_model()
flip_before = full_params(m4)
try:
    m4.load_checkpoint(OUT / "ck_flip")
    res["flip_error"] = None
except fitkit.files.CheckpointError as e:
    res["flip_error"] = str(e)
res["flip_after"], res["flip_before"] = full_params(m4), flip_before
res["flip_optim_empty"] = not m4.optimizer.state
# GPT's head weight is its token embedding: one tensor in the shards, tied again after the load
from _relaunch import tied_gpt
g = tied_gpt("fsdp")
g.fit(torch.randint(0, 16, (8, 4)), torch.randint(0, 16, (8, 4)), batch_size=2, epochs=1, verbose=0)
g.save_checkpoint(OUT / "ck_tied")
g2 = tied_gpt("fsdp")
g2.load_checkpoint(OUT / "ck_tied")
res["tied"] = {"tied": g2.module.lm_head.weight is g2.module.embed.wte.weight,
               "saved": full_params(g), "loaded": full_params(g2)}
torch.save(res, OUT / f"rank{rank()}.pt")
dist.barrier()

# Async backups every 2 batches; rank 0 is SIGKILLed inside the third background write.
from torch.distributed.checkpoint import FileSystemWriter
writes, plain_write = [], FileSystemWriter.write_data
def killing_write(self, plan, planner):
    writes.append(1)
    if len(writes) == 3 and rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return plain_write(self, plan, planner)
FileSystemWriter.write_data = killing_write
m = fsdp_model()
m.fit(x, y, batch_size=4, epochs=3, shuffle=True, verbose=0,
      callbacks=[fitkit.callbacks.BackupAndRestore(OUT / "bk", save_freq=2, async_save=True)])
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp")
    run_torchrun(JOB, out, nproc=2, timeout=150, check=False)  # the job ends in the SIGKILL
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    return r0, r1, out


def _plain(optimizer: str = "adam") -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(net(), device="cpu")
    model.compile(optimizer=OPTIMIZERS[optimizer], loss="mse")
    return model


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _equal_optim(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys() and len(a["state"]) == 4
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for f in a["state"][i]:
            assert torch.equal(torch.as_tensor(a["state"][i][f]), torch.as_tensor(b["state"][i][f])), (i, f)
    assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]]


def _torchrun_test(f):
    return pytest.mark.distributed(pytest.mark.slow(f))


@_torchrun_test
def test_each_rank_writes_its_shards_and_no_rank_gathers(job):
    r0, r1, out = job
    assert r0["full_gathers_in_save"] == r1["full_gathers_in_save"] == 0
    files = [".metadata", "__0_0.distcp", "__1_0.distcp", "fitkit_state.pt"]
    assert sorted(os.listdir(out / "ck")) == sorted([*files, MANIFEST_NAME])
    for folder in ("ck", "ck_async"):  # every rank's files, sync and async: recorded and intact
        assert sorted(json.loads((out / folder / MANIFEST_NAME).read_text())["files"]) == files
        assert verify_manifest(out / folder) is True


@_torchrun_test
def test_a_flipped_byte_in_one_ranks_shard_is_refused_on_every_rank_and_nothing_changes(job):
    r0, r1, _ = job
    for r in (r0, r1):
        assert re.fullmatch(
            r"'.*ck_flip' is damaged: its file '__1_0\.distcp' does not match its manifest .*", r["flip_error"]
        )
        assert r["flip_optim_empty"]
    _equal(r0["flip_after"], r0["flip_before"])
    # net(): Linear(3, 8), Tanh, Linear(8, 1): FSDP shards dim 0 over 2 ranks
    assert r0["local_rows"] == {"0.weight": 4, "0.bias": 4, "2.weight": 1, "2.bias": 1}
    assert r1["local_rows"] == {"0.weight": 4, "0.bias": 4, "2.weight": 0, "2.bias": 0}


@_torchrun_test
def test_load_at_the_same_world_size_gives_every_tensor(job):
    r0, r1, _ = job
    for r in (r0, r1):
        _equal(r["loaded_params"], r["params"])
    _equal_optim(r0["loaded_optim"], r0["optim"])


@_torchrun_test
def test_load_on_one_process_without_a_group_gives_every_tensor(job):
    r0, _, out = job
    model = _plain()
    assert model.load_checkpoint(out / "ck") == 2
    _equal({n: p.detach() for n, p in model.module.named_parameters()}, r0["params"])
    _equal_optim(model.optimizer.state_dict(), r0["optim"])


@_torchrun_test
def test_async_save_holds_the_state_of_the_call(job):
    r0, r1, _ = job
    for r in (r0, r1):
        _equal(r["async_loaded"], r["async_before"])


def _tied_index(folder) -> list[str]:
    from fitkit.files.sharded import read_metadata

    return sorted(k for k in read_metadata(folder / ".metadata").state_dict_metadata if k.startswith("model."))


@_torchrun_test
def test_a_tied_weight_is_stored_once_in_the_shards_and_loads_tied(job, tmp_path):
    r0, r1, out = job
    index = _tied_index(out / "ck_tied")
    assert "model.embed.wte.weight" in index and "model.lm_head.weight" not in index
    for r in (r0, r1):
        assert r["tied"]["tied"]
        _equal(r["tied"]["loaded"], r["tied"]["saved"])
    weights = (
        torch.load(tmp_path / "w.pt", weights_only=True)
        if consolidate_weights(out / "ck_tied", tmp_path / "w.pt")
        else {}
    )
    assert weights["lm_head.weight"].data_ptr() == weights["embed.wte.weight"].data_ptr()  # one storage in the file
    assert torch.equal(weights["embed.wte.weight"], r0["tied"]["saved"]["embed.wte.weight"])


def test_a_tied_weight_on_one_process_is_stored_once_and_loads_tied(tmp_path):
    from _relaunch import tied_gpt

    from fitkit.files.sharded import read_metadata

    g = tied_gpt()
    g.fit(torch.randint(0, 16, (8, 4)), torch.randint(0, 16, (8, 4)), batch_size=2, epochs=1, verbose=0)
    g.save_checkpoint(tmp_path / "ck", sharded=True)
    meta = read_metadata(tmp_path / "ck" / ".metadata")
    assert _tied_index(tmp_path / "ck") == sorted(f"model.{k}" for k in g.module.state_dict() if k != "lm_head.weight")
    wte = meta.state_dict_metadata["model.embed.wte.weight"]
    assert tuple(wte.size) == (16, 8)
    fresh = tied_gpt()
    fresh.load_checkpoint(tmp_path / "ck")
    assert fresh.module.lm_head.weight is fresh.module.embed.wte.weight
    for k, v in g.module.state_dict().items():
        assert torch.equal(fresh.module.state_dict()[k], v), k
    # the optimizer state of the one parameter came back too
    assert torch.equal(
        fresh.optimizer.state[fresh.module.lm_head.weight]["exp_avg"],
        g.optimizer.state[g.module.lm_head.weight]["exp_avg"],
    )


@_torchrun_test
def test_full_weights_export_and_offline_consolidation(job, tmp_path):
    r0, _, out = job
    model = _plain()
    model.load_weights(out / "full.safetensors")  # written after the +1.0 of the async test
    exported = {n: p.detach() for n, p in model.module.named_parameters()}
    _equal(exported, {k: v + 1.0 for k, v in r0["async_before"].items()})
    names = consolidate_weights(out / "ck", tmp_path / "w.pt")
    assert names == ["0.bias", "0.weight", "2.bias", "2.weight"]
    _equal(torch.load(tmp_path / "w.pt", weights_only=True), r0["params"])


@_torchrun_test
def test_sigkill_during_an_async_backup_resumes_from_the_previous_one(job):
    """Backups at global steps 2, 4, 6 (5 batches of 8 per epoch); the third was cut short."""
    _, _, out = job
    bk = out / "bk"
    assert not (bk / "backup.pt").exists() and (bk / ".backup.pt.tmp").is_dir()
    state = torch.load(bk / "backup.prev.pt" / "fitkit_state.pt", weights_only=True)
    assert (state["global_step"], state["epoch"], state["samples_in_epoch"]) == (4, 0, 32)
    x, y, _ = data(37)
    ref = _plain()
    ref.fit(x, y, batch_size=8, epochs=3, shuffle=True, verbose=0)
    resumed = _plain()
    with pytest.warns(fitkit.checks.FitkitWarning, match="which is no longer running"):  # the killed job's lock
        resumed.fit(
            x, y, batch_size=8, epochs=3, shuffle=True, verbose=0, callbacks=[fitkit.callbacks.BackupAndRestore(bk)]
        )
    for a, b in zip(resumed.module.parameters(), ref.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# -- one process: the folder's guarantees ----------------------------------------------------
def _trained_folder(path):
    model = _plain()
    x, y, _ = data(16)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    model.save_checkpoint(path, sharded=True)
    return model


@pytest.mark.slow  # the first import of torch.distributed.checkpoint
def test_a_damaged_or_unfinished_folder_is_named_and_nothing_changes(tmp_path):
    _trained_folder(tmp_path / "ck")
    fresh = _plain()
    before = [p.detach().clone() for p in fresh.module.parameters()]
    shard = tmp_path / "ck" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 8)
    damage = rf"shard file '__0_0.distcp' has {size - 8} bytes, the index needs {size}"
    with pytest.raises(CheckpointError, match=damage):
        fresh.load_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "fitkit_state.pt").unlink()  # as a write killed before its last file
    with pytest.raises(CheckpointError, match="fitkit_state.pt missing"):
        fresh.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.module.parameters(), strict=True))
    assert not fresh.optimizer.state


def test_a_folder_of_another_model_is_refused_before_anything_is_read(tmp_path):
    _trained_folder(tmp_path / "ck")
    narrow = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    other = fitkit.Model(narrow, device="cpu")
    other.compile(optimizer="sgd", loss="mse")
    before = [p.detach().clone() for p in other.module.parameters()]
    with pytest.raises(
        ValueError,
        match=r"(?s)'0.weight': shape \(8, 3\) in the file, \(4, 3\) in the module.*"
        r"optimizer: Adam in the file, SGD in the model",
    ):
        other.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(before, other.module.parameters(), strict=True))


def test_a_damaged_sharded_backup_falls_back_to_the_previous_one(tmp_path):
    model = _trained_folder(tmp_path / "backup.prev.pt")
    model.save_checkpoint(tmp_path / "backup.pt", sharded=True)
    (tmp_path / "backup.pt" / ".metadata").write_bytes(b"garbage")
    resumed = _plain()
    with pytest.warns(fitkit.checks.FitkitWarning, match="is damaged, so training resumes from the previous backup"):
        history = resumed.fit(
            *data(16)[:2], batch_size=4, epochs=2, verbose=0, callbacks=[fitkit.callbacks.BackupAndRestore(tmp_path)]
        )
    assert history.epoch == [0, 1] and resumed.global_step == 8


def test_async_save_needs_a_sharded_checkpoint(tmp_path):
    model = _plain()
    with pytest.raises(ValueError, match="async_save=True writes a sharded checkpoint"):
        model.save_checkpoint(tmp_path / "c.pt", async_save=True)
    assert not (tmp_path / "c.pt").exists()


class _WritesMarker:
    """Unpickled by plain pickle, it writes ``marker``: what a crafted checkpoint would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _craft_metadata(folder, marker, nested: bool) -> None:
    """Replace ``folder``'s ``.metadata`` by a pickle that runs code when plain-unpickled: the
    payload alone, or hidden inside the real index (an extra entry)."""
    import pickle

    from fitkit.files.sharded import read_metadata

    meta_file = folder / ".metadata"
    if nested:
        meta = read_metadata(meta_file)
        meta.state_dict_metadata["model.extra"] = _WritesMarker(marker)
        payload = meta
    else:
        payload = _WritesMarker(marker)
    meta_file.write_bytes(pickle.dumps(payload))


def _files(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("nested", [False, True], ids=["payload", "inside-the-index"])
def test_a_crafted_metadata_is_refused_before_it_runs(tmp_path, nested):
    """load_checkpoint, BackupAndRestore and consolidate_weights refuse a ``.metadata`` that
    would run code; the code never runs, the model and the folder stay as they were."""
    import pickle

    from fitkit.files import RefusedCheckpointError

    marker = tmp_path / "marker"
    _trained_folder(tmp_path / "bk" / "backup.pt")
    _craft_metadata(tmp_path / "bk" / "backup.pt", marker, nested)
    files = _files(tmp_path / "bk")
    fresh = _plain()
    before = [p.detach().clone() for p in fresh.module.parameters()]
    refused = r"Refused to load '.*\.metadata': it names builtins\.exec"
    with pytest.raises(RefusedCheckpointError, match=refused):
        fresh.load_checkpoint(tmp_path / "bk" / "backup.pt")
    with pytest.raises(RefusedCheckpointError, match=refused):
        consolidate_weights(tmp_path / "bk" / "backup.pt", tmp_path / "w.pt")
    with pytest.raises(RefusedCheckpointError, match=refused):  # no previous backup to fall back to
        fresh.fit(
            *data(16)[:2],
            batch_size=4,
            epochs=1,
            verbose=0,
            callbacks=[fitkit.callbacks.BackupAndRestore(tmp_path / "bk")],
        )
    assert not marker.exists()
    assert not (tmp_path / "w.pt").exists()
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.module.parameters(), strict=True))
    assert not fresh.optimizer.state and fresh.global_step == 0
    assert _files(tmp_path / "bk") == files  # nothing written, nothing removed
    assert isinstance(RefusedCheckpointError("x"), RuntimeError)
    with open(tmp_path / "bk" / "backup.pt" / ".metadata", "rb") as f:  # the file is live: plain pickle runs it
        pickle.load(f)
    assert marker.read_text() == "ran"


def test_a_crafted_metadata_over_the_newest_backup_falls_back_to_the_previous_one(tmp_path):
    marker = tmp_path / "marker"
    _trained_folder(tmp_path / "backup.prev.pt")
    _trained_folder(tmp_path / "backup.pt")
    _craft_metadata(tmp_path / "backup.pt", marker, nested=True)
    resumed = _plain()
    with pytest.warns(
        fitkit.checks.FitkitWarning,
        match=r"(?s)is damaged, so training resumes from the previous.*"
        r"Refused to load",
    ):
        history = resumed.fit(
            *data(16)[:2], batch_size=4, epochs=2, verbose=0, callbacks=[fitkit.callbacks.BackupAndRestore(tmp_path)]
        )
    assert history.epoch == [0, 1] and resumed.global_step == 8  # as for any damage of the newest
    assert not marker.exists()


def test_a_pickled_item_in_a_shard_is_refused_before_it_runs(tmp_path):
    """DCP loads a shard's non-tensor items with ``torch.load(weights_only=False)``: fitkit
    loads them with ``weights_only=True`` first, so an item carrying code is refused."""
    import dataclasses
    import io
    import pickle

    from fitkit.files import RefusedCheckpointError
    from fitkit.files.sharded import read_metadata

    marker = tmp_path / "marker"
    folder = tmp_path / "ck"
    _trained_folder(folder)
    meta = read_metadata(folder / ".metadata")
    index = next(i for i in meta.storage_data if i.fqn.startswith("optim.param_groups"))  # a pickled item
    buf = io.BytesIO()
    torch.save(_WritesMarker(marker), buf)
    (folder / "__0_9.distcp").write_bytes(buf.getvalue())
    meta.storage_data[index] = dataclasses.replace(
        meta.storage_data[index], relative_path="__0_9.distcp", offset=0, length=len(buf.getvalue())
    )
    (folder / ".metadata").write_bytes(pickle.dumps(meta))  # an index of DCP's own classes only
    write_manifest(folder)  # who can write the folder can rewrite its digests: the refusal still holds
    fresh = _plain()
    before = [p.detach().clone() for p in fresh.module.parameters()]
    with pytest.raises(RefusedCheckpointError, match=rf"Refused to load '.*ck': its item '{index.fqn}' holds pickled"):
        fresh.load_checkpoint(folder)
    assert not marker.exists()
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.module.parameters(), strict=True))
    assert not fresh.optimizer.state
    assert fresh.optimizer.param_groups[0]["lr"] == 0.01


def test_a_shard_torch_cannot_read_gives_a_checkpoint_error_and_a_backup_falls_back(tmp_path):
    """torch's CheckpointException (a BaseException) never escapes: it becomes a CheckpointError
    naming the folder, the optimizer stays as it was, and a backup falls back past it."""
    from torch.distributed.checkpoint import CheckpointException

    _trained_folder(tmp_path / "backup.prev.pt")
    _trained_folder(tmp_path / "backup.pt")
    from fitkit.files.sharded import read_metadata

    meta = read_metadata(tmp_path / "backup.pt" / ".metadata")
    info = next(v for k, v in meta.storage_data.items() if k.fqn == "model.0.weight")
    shard = tmp_path / "backup.pt" / info.relative_path
    data_ = bytearray(shard.read_bytes())
    data_[info.offset] ^= 0xFF  # the tensor record's first byte: torch.load of it fails
    shard.write_bytes(bytes(data_))
    write_manifest(tmp_path / "backup.pt")  # digests rewritten too: torch's own error is still converted
    fresh = _plain()
    before = [p.detach().clone() for p in fresh.module.parameters()]
    try:
        fresh.load_checkpoint(tmp_path / "backup.pt")
    except Exception as e:  # caught here: not a BaseException
        error = e
    assert isinstance(error, CheckpointError) and not isinstance(error, CheckpointException)
    assert re.match(r"'.*backup\.pt' is damaged: its shards cannot be read", str(error))
    assert "weights_only=False" not in str(error)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.module.parameters(), strict=True))
    assert not fresh.optimizer.state
    with pytest.raises(CheckpointError, match="is damaged: its shards cannot be read"):
        consolidate_weights(tmp_path / "backup.pt", tmp_path / "w.pt")
    assert not (tmp_path / "w.pt").exists()
    with pytest.warns(fitkit.checks.FitkitWarning, match="is damaged, so training resumes from the previous backup"):
        history = fresh.fit(
            *data(16)[:2], batch_size=4, epochs=2, verbose=0, callbacks=[fitkit.callbacks.BackupAndRestore(tmp_path)]
        )
    assert history.epoch == [0, 1] and fresh.global_step == 8


def test_a_failed_sharded_save_is_an_os_error_naming_the_checkpoint(tmp_path, monkeypatch):
    """A write error inside torch's writer (a full disk) is an OSError naming the checkpoint and the
    file, not torch's CheckpointException; the previous checkpoint stays."""
    import errno

    import torch.distributed.checkpoint.filesystem as fs

    model = _trained_folder(tmp_path / "ck")
    files = _files(tmp_path / "ck")

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "__0_0.distcp")

    monkeypatch.setattr(fs, "_write_files_from_queue", full_disk)
    written = r"The sharded checkpoint '.*ck' could not be written \(file '__0_0.distcp'\)"
    with pytest.raises(OSError, match=written) as e:
        model.save_checkpoint(tmp_path / "ck", sharded=True)
    assert e.value.errno == errno.ENOSPC
    assert _files(tmp_path / "ck") == files


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_sharded_save_on_a_really_full_disk_names_a_file_and_keeps_the_previous_checkpoint(tmp_path, async_save):
    """A real tmpfs that the second save overflows: an OSError (ENOSPC) naming a file of the
    folder, raised by the save (sync) or by the wait for it (async), and the first checkpoint
    still at its path, complete."""
    import errno

    from _tmpfs import tmpfs

    from fitkit.distributed import dcp

    with tmpfs(tmp_path / "small", "400k") as folder:  # root only: the monkeypatched ENOSPC tests run everywhere
        first = _trained_folder(folder / "ck")  # fits: a small net and its Adam moments
        expected = {k: v.clone() for k, v in first.module.state_dict().items()}
        big = fitkit.Model(torch.nn.Linear(300, 300), device="cpu")  # 360 kB of weights, 1 MB with Adam
        big.compile(optimizer="adam", loss="mse")
        big.fit(torch.randn(4, 300), torch.randn(4, 300), batch_size=4, verbose=0)
        with pytest.raises(OSError) as excinfo:
            big.save_checkpoint(folder / "ck", sharded=True, async_save=async_save)
            dcp.wait()
        assert excinfo.value.errno == errno.ENOSPC
        assert str(folder) in str(excinfo.value)
        fresh = _plain()
        fresh.load_checkpoint(folder / "ck")  # the first checkpoint, whole
        _equal(fresh.module.state_dict(), expected)
