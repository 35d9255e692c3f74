"""Guard rails that CI runs with the tests: ruff (lint and format) on ``fitkit/``, ``tests/`` and
``benchmarks/``, mypy on ``fitkit/``.

The configuration lives in ``pyproject.toml`` (``[tool.ruff]``, ``[tool.mypy]``); both tools
come with the ``test`` extra.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_is_clean_on_the_package_its_tests_and_benchmarks():
    pytest.importorskip("ruff")
    result = _run(sys.executable, "-m", "ruff", "check", "fitkit", "tests", "benchmarks")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_the_package_its_tests_and_benchmarks_are_formatted_by_ruff():
    pytest.importorskip("ruff")
    result = _run(sys.executable, "-m", "ruff", "format", "--check", "fitkit", "tests", "benchmarks")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@pytest.mark.slow
def test_mypy_is_clean_on_the_package():
    pytest.importorskip("mypy")
    result = _run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "Success" in result.stdout
