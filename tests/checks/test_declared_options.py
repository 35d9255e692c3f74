"""Every declared option fuzzed: wrong types, out-of-range values and excluded partners.

The options come from :data:`fitkit.checks.declared.TABLES` (``Model``, ``compile``, ``fit``,
``evaluate``, ``predict``, every callback, the tools). Each value is tried against a compiled
classifier whose Adam optimizer already holds state and whose scheduler has stepped; a callback
is built and then passed to ``fit``. The call must raise a ``TypeError`` or ``ValueError`` that
names the option, before step 1: the module's tensors, the optimizer's state and param groups,
the scheduler, the step count and the files of the tmp folder are as before.

Values per option: a complex number (a type no option takes: every option, ``"custom"`` ones
included, gets a wrong-type case), fixed edge values for its kind (``None`` where not allowed,
a bool for an int, NaN, one below the minimum, one above the maximum, a str), its declared
``bad`` values, and hypothesis draws (derandomized: the same cases on every run).
"""

from __future__ import annotations

import copy
import importlib
import math
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fitkit
import fitkit.callbacks as C
from fitkit.checks import FitkitWarning
from fitkit.checks.declared import TABLES, Option
from fitkit.tools import batch_size_finder, export, lr_finder

N, FEATURES, CLASSES = 12, 4, 3
for _name in (
    "fitkit.training.options",
    "fitkit.tools.lr_finder",
    "fitkit.tools.batch_size_finder",
    "fitkit.tools.export",
):
    importlib.import_module(_name)


def _x() -> torch.Tensor:
    return torch.randn(N, FEATURES, generator=torch.Generator().manual_seed(7))


def _y() -> torch.Tensor:
    return torch.arange(N) % CLASSES


def _model() -> fitkit.Model:
    torch.manual_seed(0)
    model = fitkit.Model(nn.Linear(FEATURES, CLASSES), device="cpu")
    model.compile(
        optimizer="adam", loss="cross_entropy", scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    )
    model.train_on_batch(_x(), _y())  # optimizer state to protect
    model.scheduler.step()
    return model


def _snapshot(model: fitkit.Model) -> Any:
    return copy.deepcopy(
        (model.module.state_dict(), model.optimizer.state_dict(), model.scheduler.state_dict(), model.global_step)
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _fit(model: fitkit.Model, callback: Any) -> None:
    model.fit(_x(), _y(), epochs=2, batch_size=4, verbose=0, callbacks=[callback])


class _Trial:
    """What OptunaPruning calls on a trial."""

    def report(self, value, step):
        pass

    def should_prune(self):
        return False


# What each owner needs besides the fuzzed option: required arguments, and how it runs.
_REQUIRED: dict[str, Callable[[Path], dict[str, Any]]] = {
    "ModelCheckpoint": lambda tmp: {"filepath": tmp / "ck" / "ep{epoch}.pt"},
    "BackupAndRestore": lambda tmp: {"backup_dir": tmp / "backup"},
    "CSVLogger": lambda tmp: {"filename": tmp / "log.csv"},
    "TensorBoard": lambda tmp: {"log_dir": tmp / "tb"},
    "Timer": lambda tmp: {"duration": 3600},
    "GradientAccumulationScheduler": lambda tmp: {"scheduling": {0: 2}},
    "LearningRateScheduler": lambda tmp: {"schedule": lambda epoch, lr: lr},
    "SWA": lambda tmp: {"swa_lrs": 0.01},
    "find_lr": lambda tmp: {"num_steps": 3},
    "OptunaPruning": lambda tmp: {"trial": _Trial()},
    "find_batch_size": lambda tmp: {"max_trials": 2},
}


def _call(owner: str, model: fitkit.Model, tmp: Path, given: dict[str, Any]) -> None:
    kwargs = {**_REQUIRED.get(owner, lambda tmp: {})(tmp), **given}
    x, y = kwargs.pop("x", _x()), kwargs.pop("y", _y())
    if owner == "Model":
        fitkit.Model(kwargs.pop("module", nn.Linear(FEATURES, CLASSES)), **{"device": "cpu", **kwargs})
    elif owner == "Model.compile":
        model.compile(**{"optimizer": "adam", "loss": "cross_entropy", **kwargs})
    elif owner == "Model.fit":
        model.fit(x, y, **{"epochs": 2, "batch_size": 4, "verbose": 0, **kwargs})
    elif owner == "Model.evaluate":
        model.evaluate(x, y, **{"verbose": 0, **kwargs})
    elif owner == "Model.predict":
        model.predict(x, **{"verbose": 0, **kwargs})
    elif owner == "find_lr":
        lr_finder.find_lr(model, x, y, **kwargs)
    elif owner == "find_batch_size":
        batch_size_finder.find_batch_size(model, x, y, **kwargs)
    elif owner == "export":
        export.export(model.module, kwargs.pop("path", tmp / "m.pt2"), kwargs.pop("example_input", x[:2]), **kwargs)
    else:
        _fit(model, getattr(C, owner)(**kwargs))


class _Guarded:
    """One compiled model and tmp folder per option; every refused call must leave both as they were."""

    def __init__(self, owner: str):
        self.owner, self.model, self.tmp = owner, _model(), Path(tempfile.mkdtemp())
        self.before, self.files = _snapshot(self.model), sorted(self.tmp.rglob("*"))

    def refused(self, given: dict[str, Any]) -> None:
        with pytest.raises((TypeError, ValueError)) as info:
            _call(self.owner, self.model, self.tmp, given)
        message = str(info.value)
        # the message names the option (a plural option may be named in the singular: "Unknown metric")
        assert any(name.rstrip("s") in message for name in given), (self.owner, given, message)
        assert _same(_snapshot(self.model), self.before), (self.owner, given)
        assert sorted(self.tmp.rglob("*")) == self.files, (self.owner, given)

    def close(self) -> None:
        shutil.rmtree(self.tmp)


#: A type no option takes: every option, ``"custom"`` ones included, gets one wrong-type case.
ALIEN = 1j


def _edges(o: Option) -> list[Any]:
    """Fixed wrong values for ``o``'s kind, and :data:`ALIEN`."""
    values: list[Any] = [ALIEN] + ([] if o.allow_none or o.kind == "custom" else [None])
    if o.kind in ("int", "number"):
        values += ["1", [1]]
        values += [True] if o.kind == "int" else [math.nan]
        if o.kind == "int":
            values += [1.5]
        if o.minimum is not None:
            values += [o.minimum - 1]
        if o.positive:
            values += [0, -1.0]
        if o.maximum is not None:
            values += [o.maximum + 1]
    elif o.kind == "bool":
        values += ["yes", 2]
    elif o.kind == "choice":
        values += ["not-a-choice", 3.5]
    elif o.kind in ("text", "path"):
        values += [5, [1]]
    elif o.kind == "callable":
        values += [5, "f"]
    return values + list(o.bad)


def _strategy(o: Option) -> st.SearchStrategy | None:
    """Hypothesis draws of wrong values for ``o``'s kind (``None`` for ``"custom"``)."""
    junk = st.one_of(
        st.text(max_size=4),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
    )
    if o.kind == "int":
        low = st.integers(max_value=int(o.minimum) - 1) if o.minimum is not None else st.nothing()
        high = st.integers(min_value=int(o.maximum) + 1) if o.maximum is not None else st.nothing()
        return st.one_of(junk, st.floats(), st.booleans(), low, high)
    if o.kind == "number":
        low = st.floats(max_value=o.minimum, exclude_max=True) if o.minimum is not None else st.nothing()
        pos = st.floats(max_value=0.0) if o.positive else st.nothing()
        high = st.floats(min_value=o.maximum, exclude_min=True) if o.maximum is not None else st.nothing()
        return st.one_of(junk, st.just(math.nan), st.booleans(), low, pos, high)
    if o.kind == "bool":
        return st.one_of(junk, st.integers(), st.floats())
    if o.kind == "choice":
        return st.one_of(st.text(max_size=6).filter(lambda v: v not in o.choices), st.integers(), st.floats())
    if o.kind in ("text", "path"):
        return st.one_of(st.integers(), st.floats(), st.lists(st.integers(), max_size=2))
    if o.kind == "callable":
        return st.one_of(st.integers(), st.text(max_size=4), st.floats())
    return None


OPTIONS = sorted((owner, name) for owner, table in TABLES.items() for name in table)
PAIRS = sorted(
    (owner, name, other) for owner, table in TABLES.items() for name, o in table.items() for other in o.excludes
)
DRAWS = 3  # hypothesis draws per option


@pytest.mark.parametrize(("owner", "name"), OPTIONS, ids=[f"{o}.{n}" for o, n in OPTIONS])
def test_every_declared_option_refuses_wrong_values_before_step_1(owner, name):
    option, guarded = TABLES[owner][name], _Guarded(owner)
    try:
        for value in _edges(option):
            guarded.refused({name: value})
        strategy = _strategy(option)
        if strategy is not None:

            @settings(
                max_examples=DRAWS,
                derandomize=True,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(strategy)
            def fuzz(value):
                guarded.refused({name: value})

            fuzz()
    finally:
        guarded.close()


@pytest.mark.parametrize(("owner", "name", "other"), PAIRS, ids=[f"{o}.{a}+{b}" for o, a, b in PAIRS])
def test_every_excluded_pair_is_refused_before_step_1(owner, name, other):
    table = TABLES[owner]
    assert table[name].has_example and table[other].has_example, "a pair needs a legal example of each"
    guarded = _Guarded(owner)
    try:
        guarded.refused({name: table[name].example, other: table[other].example})
    finally:
        guarded.close()


POINTLESS = sorted((owner, name) for owner, table in TABLES.items() for name, o in table.items() if o.pointless)


@pytest.mark.parametrize(("owner", "name"), POINTLESS, ids=[f"{o}.{n}" for o, n in POINTLESS])
def test_every_declared_pointless_value_warns_with_the_fix(owner, name):
    value, why = TABLES[owner][name].pointless
    model, tmp = _model(), Path(tempfile.mkdtemp())
    try:
        with pytest.warns(FitkitWarning, match=re.escape(f"{owner}({name}={value!r}): {why}")):
            _call(owner, model, tmp, {name: value})
    finally:
        shutil.rmtree(tmp)
    assert "Fix: " in why


def test_the_fuzz_covers_every_public_option():
    """Every keyword of every public entry point is declared, and the sweep is large."""
    import inspect

    entry = {
        "Model": fitkit.Model.__init__,
        "Model.compile": fitkit.Model.compile,
        "Model.fit": fitkit.Model.fit,
        "Model.evaluate": fitkit.Model.evaluate,
        "Model.predict": fitkit.Model.predict,
        "find_lr": lr_finder.find_lr,
        "find_batch_size": batch_size_finder.find_batch_size,
        "export": export.export,
    }
    entry |= {
        n: getattr(C, n).__init__
        for n in C.__all__
        if isinstance(getattr(C, n), type)
        and issubclass(getattr(C, n), C.Callback)
        and getattr(C, n).__init__ is not C.Callback.__init__
        and n not in ("LambdaCallback",)
    }
    skip = {"self", "model", "kwargs", "init_kwargs", "hooks", "console", "trial"}
    missing = {
        owner: sorted(n for n in inspect.signature(f).parameters if n not in skip and n not in TABLES.get(owner, {}))
        for owner, f in entry.items()
    }
    assert {k: v for k, v in missing.items() if v} == {}
    cases = sum(len(_edges(TABLES[o][n])) + (DRAWS if _strategy(TABLES[o][n]) is not None else 0) for o, n in OPTIONS)
    assert len(OPTIONS) >= 100 and cases + len(PAIRS) >= 500 and POINTLESS, (len(OPTIONS), cases)
