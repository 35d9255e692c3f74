"""Every nested field of every registered part of a checkpoint, crafted.

The registry (:class:`fitkit.training.state.RunState`) is enumerated; each field of each part's
saved state (dict values, list items, tensors, numbers, strings, recursively) is replaced by a
wrong type, an out-of-range value or a value that disagrees with the others, the file written
again with its checksum recomputed (as whoever can write the file would). Each crafted file is
refused with a ``ValueError`` / ``TypeError`` / ``RuntimeError`` that names the field (its
innermost key) and the fix, before anything changed (the module, the optimizer, the scheduler,
the step count, the callbacks' states, nothing left for the next fit), or the value is
harmless for the reason :data:`_HARMLESS` gives. The callbacks' states are loaded inside a fit,
where they are checked against its callbacks.
"""

from __future__ import annotations

import copy
import math
import re
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitkit
from fitkit.callbacks import LambdaCallback
from fitkit.files import safe_load
from fitkit.files.payload import CHECKSUM_KEY, payload_checksum
from fitkit.training.state import RunState

Path = tuple[Any, ...]


# -- the fields and their crafted values --------------------------------------------------------------
def _fields(value: Any, path: Path) -> Iterator[tuple[Path, Any]]:
    """``(path, value)`` of a value and of everything nested in it (of a long list: its first and
    last items, e.g. 2 of the 625 words of Python's RNG state)."""
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _fields(item, (*path, key))
    elif isinstance(value, (list, tuple)):
        indices = range(len(value)) if len(value) <= 8 else (0, len(value) - 1)
        for i in indices:
            yield from _fields(value[i], (*path, i))


def _crafts(value: Any) -> dict[str, Any]:
    """The wrong values to try in place of ``value``: a type no field has (a complex number),
    and by kind an out-of-range or disagreeing one."""
    out: dict[str, Any] = {"complex": 1j}
    if isinstance(value, bool):
        out["flipped"] = not value
    elif isinstance(value, int):
        out["-2"], out["2**64"] = -2, 2**64
    elif isinstance(value, float):
        out["nan"], out["-1.0"], out["inf"] = math.nan, -1.0, math.inf
    elif isinstance(value, str):
        out["'x'"] = "x"
    elif isinstance(value, torch.Tensor):
        out["complex dtype"] = value.to(torch.complex64)
        out["one more element"] = torch.cat([value.reshape(-1), value.reshape(-1)[:1]])
        if value.dtype.is_floating_point:
            out["nan"] = torch.full_like(value, math.nan)
    elif isinstance(value, (list, tuple)):
        out["one item fewer" if value else "one item"] = type(value)(value[:-1] if value else [1j])
    return out


def _replaced(state: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(state, dict):
        return {**state, key: _replaced(state[key], rest, value)}
    items = list(state)
    items[key] = _replaced(items[key], rest, value)
    return type(state)(items)


def _name(path: Path) -> str:
    return "".join(f"[{p!r}]" for p in path)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        return same and bool(((a == b) | (a.isnan() & b.isnan())).all())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b or (a != a and b != b)


# -- the runs that wrote the checkpoints ------------------------------------------------------------
def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _scheduled(seed: int) -> fitkit.Model:
    torch.manual_seed(seed)
    model = fitkit.Model(_net(), device="cpu")
    model.compile(
        optimizer="adam",
        loss="mse",
        metrics=["mae"],
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
    )
    return model


def _plain(seed: int) -> fitkit.Model:
    torch.manual_seed(seed)
    model = fitkit.Model(_net(), device="cpu")
    model.compile(optimizer="adam", loss="mse")
    return model


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 3, generator=g)
    return x, x.sum(1, keepdim=True)


def _loader():
    return DataLoader(TensorDataset(*_data()), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))


def _callbacks(folder) -> list:
    from fitkit.callbacks import (
        EMA,
        SWA,
        BackupAndRestore,
        CSVLogger,
        EarlyStopping,
        ModelCheckpoint,
        ReduceLROnPlateau,
        Timer,
    )

    return [
        EarlyStopping(monitor="loss", patience=5, restore_best_weights=True),
        ReduceLROnPlateau(monitor="loss", patience=5),
        EMA(),
        SWA(swa_lrs=0.01, swa_epoch_start=1),
        ModelCheckpoint(folder / "ck" / "m{epoch}.pt", monitor="loss", save_top_k=2),
        BackupAndRestore(folder / "backup", delete_checkpoint=False),
        CSVLogger(folder / "log.csv"),
        Timer(3600, clock=lambda: 0.0),
    ]


def _tokens(seed: int) -> fitkit.Model:
    torch.manual_seed(seed)
    model = fitkit.Model(nn.Sequential(nn.Embedding(10, 2), nn.Flatten(), nn.Linear(10, 1)), device="cpu")
    model.compile(optimizer="adam", loss="mse")
    return model


def _token_data():
    x = torch.randint(0, 10, (24, 5), generator=torch.Generator().manual_seed(3))
    return x, x.float().mean(1, keepdim=True)


def _token_callbacks(folder) -> list:
    from fitkit.callbacks import LearningRateScheduler, TensorBoard, TokensSeen

    return [LearningRateScheduler(lambda epoch, lr: lr * 0.5), TokensSeen(), TensorBoard(folder / "tb")]


#: The stateful callbacks, in two runs (a LearningRateScheduler and a ReduceLROnPlateau would
#: both set the rate; TokensSeen needs token inputs): ``{part: (model, data, callbacks, file)}``.
_CALLBACK_RUNS = {
    "callbacks": (_plain, _data, _callbacks, "callbacks.pt"),
    "callbacks of a token run": (_tokens, _token_data, _token_callbacks, "tokens.pt"),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The checkpoints: inside epoch 2 of a scheduled run with metrics (every part but the
    callbacks), and after epoch 2 of each run of :data:`_CALLBACK_RUNS` (their states)."""
    folder = tmp_path_factory.mktemp("crafted")
    model = _scheduled(0)
    inside = LambdaCallback(
        on_train_batch_end=lambda b, logs: model.epoch == 1 and b == 0 and model.save_checkpoint(folder / "inside.pt")
    )
    model.fit(_loader(), epochs=2, verbose=0, callbacks=[inside])
    for make, data, callbacks, name in _CALLBACK_RUNS.values():
        run = make(0)
        after = LambdaCallback(
            on_epoch_end=lambda e, logs, run=run, name=name: e == 1 and run.save_checkpoint(folder / name)
        )
        run.fit(*data(), batch_size=8, epochs=2, verbose=0, callbacks=[*callbacks(folder), after])
    return folder


def _cases(state: dict, keys) -> Iterator[tuple[str, str, Path, Any]]:
    for key in keys:
        for path, value in _fields(state[key], (key,)):
            for craft, crafted in _crafts(value).items():
                yield _name(path), craft, path, crafted


def _everything(model: fitkit.Model, callbacks=()) -> tuple:
    return (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(model.optimizer.state_dict()),
        copy.deepcopy(model.scheduler.state_dict()) if model.scheduler is not None else None,
        model.global_step,
        [copy.deepcopy(cb.state_dict()) for cb in callbacks],
    )


def _outcome(model, path, where: Path, callbacks=()) -> str:
    """``"named: ..."`` (a ``ValueError`` / ``TypeError`` / ``RuntimeError`` naming the field
    and the fix, nothing changed), ``"raw: ..."``, ``"... after a change: ..."`` or ``"accepted"``."""
    before = _everything(model, callbacks)
    try:
        model.load_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - which type, and what it says, is what is checked
        unchanged = _same(_everything(model, callbacks), before) and model._core.pop_resume() is None
        clear = isinstance(e, (ValueError, TypeError, RuntimeError)) and "Fix:" in str(e) and _names(str(e), where)
        return f"{'named' if clear else 'raw'}{'' if unchanged else ' after a change'}: {type(e).__name__}: {e}"
    return "accepted"


def _names(message: str, where: Path) -> bool:
    """The message names the field: its innermost key (``'exp_avg'``, ``'0.bias'``, ``'wait'``)."""
    key = [k for k in where if isinstance(k, str)][-1]
    # or as a difference names it: "decoupled_weight_decay=True in the file", "parameters: 3 in the
    # file" ('params'), "scheduler: x in the file" ('scheduler_class')
    forms = (repr(key), key, key.replace("_", " "), key.split("_")[0].rstrip("s"))
    return any(form in message for form in forms)


#: Crafted values a part takes, each harmless for its reason: ``{reason: [(field pattern, craft)]}``
#: (a pattern is a regular expression over the field's path, matched whole).
_HARMLESS: dict[str, list[tuple[str, str]]] = {
    "a value a diverged run writes itself (fitkit saves the weights and statistics it has): "
    "loading it restores that run as it was": [
        (r"\['module'\]\['[^']+'\]", "nan"),
        (r"\['optimizer'\]\['state'\]\[\d\]\['exp_avg(_sq)?'\]", "nan"),
        (r"\['callbacks'\]\['(EMA|SWA)'\]\['averaged'\]\['module\.[^']+'\]", "nan"),
        (r"\['callbacks'\]\['EarlyStopping'\]\['best_weights'\]\['[^']+'\]", "nan"),
        (r"\['trackers'\]\['loss_total'\]", "nan"),
        (r"\['trackers'\]\['metrics'\]\['mae'\]\['sum_abs_error'\]", "nan"),
    ],
    "a kernel switch: fused, foreach and the plain loop compute the same update": [
        (r"\['optimizer'\]\['param_groups'\]\[0\]\['fused'\]", "flipped"),
    ],
    "a Gaussian numpy cached: any finite float is one (used once, when has_gauss is 1)": [
        (r"\['rng'\]\['numpy'\]\[4\]", "-1.0"),
    ],
    "a value a monitored key can take (a negative score; inf, where a best starts)": [
        (r"\['callbacks'\]\['(EarlyStopping|ReduceLROnPlateau|ModelCheckpoint)'\]\['best'\]", "-1.0"),
        (r"\['callbacks'\]\['(EarlyStopping|ReduceLROnPlateau|ModelCheckpoint)'\]\['best'\]", "inf"),
        (r"\['callbacks'\]\['ModelCheckpoint'\]\['kept'\]\[\d\]\[0\]", "-1.0"),
        (r"\['callbacks'\]\['ModelCheckpoint'\]\['kept'\]\[\d\]\[0\]", "inf"),
    ],
    "file names resolve inside ModelCheckpoint's folder, and a name not of its pattern is "
    "dropped with a warning (restore_name), never deleted; a shorter list forgets a file, which "
    "stays on disk": [
        (r"\['callbacks'\]\['ModelCheckpoint'\]\['best_path'\]", "'x'"),
        (r"\['callbacks'\]\['ModelCheckpoint'\]\['kept'\]\[\d\]\[1\]", "'x'"),
        (r"\['callbacks'\]\['ModelCheckpoint'\]\['kept'\]", "one item fewer"),
    ],
    "CSVLogger cuts its file to min(size, the file's size): a larger size cuts nothing": [
        (r"\['callbacks'\]\['CSVLogger'\]\['size'\]", "2**64"),
    ],
    "a callback without state: Callback.load_state_dict ignores what it is given": [
        (r"\['callbacks'\]\['LambdaCallback'\]", "complex"),
    ],
    "a callback saved watching another key or mode warns and keeps its own state (ResumePoint.apply_callbacks)": [
        (r"\['callback_config'\]\['[A-Za-z]+'\]\['(monitor|mode)'\]", "'x'"),
    ],
    "the History is a record nothing trains from: a key logged in fewer epochs than ran is "
    "what validation_freq writes, and a logged value may be nan or inf (a diverged loss) or "
    "negative (a score)": [
        (r"\['history'\]\['history'\]\['[a-z_]+'\]", "one item fewer"),
        (r"\['history'\]\['history'\]\['[a-z_]+'\]\[0\]", "nan"),
        (r"\['history'\]\['history'\]\['[a-z_]+'\]\[0\]", "-1.0"),
        (r"\['history'\]\['history'\]\['[a-z_]+'\]\[0\]", "inf"),
    ],
    "the loader's order is checked against the next fit's DataLoader, which load_checkpoint "
    "does not know: that fit refuses it before its first step (checked below)": [
        (r"\['data_order'\]\['generators'\]", "one item fewer"),
        (r"\['data_order'\]\['samplers'\]", "one item"),
    ],
}


def _harmless(name: str, craft: str) -> str | None:
    for reason, fields in _HARMLESS.items():
        if any(c == craft and re.fullmatch(pattern, name) for pattern, c in fields):
            return reason
    return None


PARTS = [p.name for p in RunState(_plain(0)).parts]


def _load_each(model, good: dict, keys: list[str], path, callbacks=()) -> list[tuple[str, str, str]]:
    out = []
    for name, craft, where, crafted in _cases(good, keys):
        _write(_replaced(good, where, crafted), path)
        outcome = _outcome(model, path, where, callbacks)
        if outcome == "accepted" and where[0] == "data_order":
            _refused_by_the_next_fit(model)
        model._core.pop_resume()  # what an accepted file left for the next fit
        out.append((name, craft, outcome))
    return out


def _write(state: dict, path) -> None:
    """``state`` with its checksum recomputed, as whoever can write the file can (``atomic_save``
    without its fsync: the files live as long as the test)."""
    torch.save({**state, CHECKSUM_KEY: payload_checksum(state)}, path)


def _refused_by_the_next_fit(model) -> None:
    """The next fit refuses the loaded order of another DataLoader before its first step."""
    weights, step = copy.deepcopy(model.state_dict()), model.global_step
    with pytest.raises(ValueError, match=r"data generator\(s\) and .* Fix: resume with a DataLoader built as before"):
        model.fit(_loader(), epochs=3, initial_epoch=1, verbose=0)
    assert model.global_step == step and _same(model.state_dict(), weights)


def _keys(model, part: str, good: dict) -> list[str]:
    """The file's keys that ``part`` owns (those it writes now, and those it writes only inside
    an epoch or for some loaders: the running totals, the epoch's RNG state, the loader's order)."""
    owned = {k for p in RunState(model).parts if p.name == part for k in (*p.state_dict(), *p.spec, *p.optional)}
    return [k for k in good if k in owned]


def _callback_results(written, tmp_path, part: str) -> list[tuple[str, str, str]]:
    """Each crafted callback state loaded inside a fit (the states are checked against the
    running fit's callbacks), by the callbacks of a run like the one that wrote the file."""
    make, data, make_callbacks, name = _CALLBACK_RUNS[part]
    good, path = safe_load(written / name, "cpu"), tmp_path / "c.pt"
    if (written / "log.csv").exists():
        shutil.copy(written / "log.csv", tmp_path / "log.csv")  # the log a resume continues
    model, callbacks, results = make(1), make_callbacks(tmp_path), []
    keys = _keys(model, "callbacks", good)
    inside = LambdaCallback(on_train_begin=lambda logs: results.extend(_load_each(model, good, keys, path, callbacks)))
    model.fit(*data(), batch_size=8, epochs=1, verbose=0, callbacks=[*callbacks, inside])
    return results


@pytest.mark.parametrize("part", [*PARTS, "callbacks of a token run"])
def test_every_nested_field_of_every_part_crafted_is_refused_before_anything_changes(written, tmp_path, part):
    path = tmp_path / "c.pt"
    if part in _CALLBACK_RUNS:
        results = _callback_results(written, tmp_path, part)
    else:
        good = safe_load(written / "inside.pt", "cpu")
        model = _scheduled(1)
        model.fit(_loader(), epochs=1, verbose=0)  # an optimizer and a scheduler state to keep
        results = _load_each(model, good, _keys(model, part, good), path)
    assert results, part
    unnamed = [(n, c, o) for n, c, o in results if not o.startswith("named: ") and _harmless(n, c) is None]
    assert unnamed == [], unnamed
    harmless = [(n, c) for n, c, o in results if _harmless(n, c) is not None and o != "accepted"]
    assert harmless == [], harmless  # an entry of _HARMLESS that is refused now: drop it
