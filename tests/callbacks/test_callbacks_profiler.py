"""Profiler: the schedule in optimizer steps, the trace files and the table of aten operators."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fitkit
from fitkit.callbacks import Profiler


def _fit(prof, accumulation=1, rows=24):
    model = fitkit.Model(torch.nn.Linear(4, 1), device="cpu")
    model.compile(optimizer="sgd", loss="mse", gradient_accumulation_steps=accumulation)
    model.fit(torch.ones(rows, 4), torch.ones(rows, 1), batch_size=2, verbose=0, callbacks=[prof])
    return model


def _profiled_steps(path):
    events = json.loads(Path(path).read_text())["traceEvents"]
    return sorted({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")})


def test_chrome_traces_hold_the_active_steps_of_each_cycle(tmp_path, capsys):
    prof = Profiler(tmp_path, wait=1, warmup=1, active=2, repeat=2, trace="chrome", row_limit=40)
    _fit(prof)  # 12 optimizer steps: cycles at steps 2-3 and 6-7 (0-based)
    assert prof.traces == [str(tmp_path / "trace_0.json"), str(tmp_path / "trace_1.json")]
    assert _profiled_steps(prof.traces[0]) == ["ProfilerStep#2", "ProfilerStep#3"]
    assert _profiled_steps(prof.traces[1]) == ["ProfilerStep#6", "ProfilerStep#7"]
    assert "aten::addmm" in prof.table and "aten::mse_loss" in prof.table
    assert prof.table in capsys.readouterr().out  # printed (rank 0, verbose=1)


def test_tensorboard_trace_and_steps_counted_in_optimizer_steps(tmp_path):
    prof = Profiler(tmp_path / "tb", wait=0, warmup=1, active=3, trace="tensorboard", verbose=0)
    _fit(prof, accumulation=3)  # 12 batches, 4 optimizer steps: warm-up at 0, recorded 1-3
    assert len(prof.traces) == 1 and prof.traces[0].endswith(".pt.trace.json")
    assert _profiled_steps(prof.traces[0]) == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]


def test_without_a_folder_only_the_table(tmp_path):
    prof = Profiler(wait=0, warmup=1, active=1, verbose=0)
    _fit(prof, rows=4)
    assert prof.traces == [] and "aten::" in prof.table


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"active": 0}, ValueError, "active"),
        ({"wait": -1}, ValueError, "wait"),
        ({"repeat": 1.0}, TypeError, "repeat"),
        ({"trace": "perfetto"}, ValueError, "'tensorboard' or 'chrome'"),
        ({"dirpath": 3}, TypeError, "dirpath"),
    ],
)
def test_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        Profiler(**kwargs)


def test_a_file_as_folder_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        Profiler(tmp_path / "f")
