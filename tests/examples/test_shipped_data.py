"""The example data ships inside the package: tiny Shakespeare is the GPT example's default."""

import hashlib
from pathlib import Path

import pytest

from fitkit.examples import shakespeare


def test_default_text_is_a_file_inside_the_package():
    path = shakespeare.default_text_path()
    package = Path(shakespeare.__file__).resolve().parent
    assert path.is_file()
    assert path.resolve().is_relative_to(package)
    text = path.read_text(encoding="utf-8")
    assert len(text) == 1_115_394 and text.startswith("First Citizen:\nBefore we proceed")


def test_default_text_is_karpathys_file_byte_for_byte():
    # SHA-256 of char-rnn's tinyshakespeare/input.txt (the file nanoGPT's prepare.py fetches).
    digest = hashlib.sha256(shakespeare.default_text_path().read_bytes()).hexdigest()
    assert digest == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def test_pyproject_ships_the_text():
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("not a checkout of the repository")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["setuptools"]["package-data"]
    assert "examples/data/*.txt" in data["fitkit"]


def test_the_example_runs_without_a_path(tmp_path, capsys):
    result = shakespeare.main(
        [
            "--steps",
            "2",
            "--eval-interval",
            "2",
            "--eval-batches",
            "1",
            "--sample-tokens",
            "5",
            "--out",
            str(tmp_path),
            "--verbose",
            "0",
        ]
    )
    assert len(result["sample"]) == 5 and result["val_loss"] > 0
    assert (tmp_path / "best.pt").is_file()
    # A path argument still works (and names the file it could not find).
    with pytest.raises(FileNotFoundError, match="No text file at"):
        shakespeare.main([str(tmp_path / "none.txt"), "--steps", "1"])
