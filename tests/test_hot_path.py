"""The Python a steady training step runs: ``fit(tensors)`` against a hand-written loop.

Counted (not timed) by ``benchmarks/hot_path.py``: ``sys.setprofile`` call events from one
loss call to the next, and the aten ops of the same steps. Deterministic on any machine.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def counts():
    path = Path(__file__).parents[1] / "benchmarks" / "hot_path.py"
    spec = importlib.util.spec_from_file_location("hot_path", path)
    assert spec is not None and spec.loader is not None
    hot_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hot_path)
    return hot_path.counts()


@pytest.mark.slow
def test_fit_runs_the_same_aten_ops_as_the_hand_loop(counts):
    fit, hand = counts
    assert fit["aten"] == hand["aten"] > 0


@pytest.mark.slow
def test_fit_adds_at_most_15_python_calls_per_step_to_the_hand_loop(counts):
    fit, hand = counts
    extra = fit["python_functions"] - hand["python_functions"]
    assert 0 < extra <= 15, dict(fit["fitkit_by_function"])
    assert fit["fitkit_functions"] <= 15
