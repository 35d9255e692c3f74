"""The distribution builds (sdist + wheel) and the wheel installs and imports on its own."""

import email
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import fitkit

pytest.importorskip("build")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_build_makes_an_sdist_and_a_wheel_that_install_and_import(tmp_path):
    # Build from a copy, so the checkout gets no build/ or egg-info; no isolation, so nothing is
    # downloaded (the test env's setuptools satisfies the build requirement).
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "fitkit", src / "fitkit", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                   check=True, capture_output=True, text=True)
    version = fitkit.__version__
    wheel = out / f"torch_fitkit-{version}-py3-none-any.whl"
    sdist = out / f"torch_fitkit-{version}.tar.gz"
    assert sorted(p.name for p in out.iterdir()) == sorted([wheel.name, sdist.name])

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = email.message_from_bytes(zf.read(f"torch_fitkit-{version}.dist-info/METADATA"))
    assert meta["Name"] == "torch-fitkit"
    assert meta["Version"] == version
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["License-File"] == "LICENSE"
    assert meta["Author"] == "fitkit developers"
    requires = meta.get_all("Requires-Dist")
    assert {"torch<3,>=2.4", "numpy>=1.24", "rich>=13", "torchmetrics>=1.4"} <= set(requires)
    assert 'wandb>=0.17; extra == "wandb"' in requires and 'peft>=0.10; extra == "peft"' in requires
    assert {"fitkit/py.typed", "fitkit/examples/data/tinyshakespeare.txt",
            f"torch_fitkit-{version}.dist-info/licenses/LICENSE"} <= names
    with tarfile.open(sdist) as tf:
        members = set(tf.getnames())
    assert f"torch_fitkit-{version}/LICENSE" in members
    assert f"torch_fitkit-{version}/fitkit/examples/data/tinyshakespeare.txt" in members

    # Install the wheel alone (no deps, no index) into an empty target and import it from there:
    # the dependencies come from this environment, fitkit itself only from the wheel.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                    "--target", str(target), str(wheel)], check=True, capture_output=True, text=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    code = ("import fitkit, importlib.metadata as m, importlib.resources as r; "
            "print(fitkit.__file__); print(fitkit.__version__); print(m.version('torch-fitkit')); "
            "print(len(r.files('fitkit').joinpath('examples/data/tinyshakespeare.txt').read_text()))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True)
    file, imported, installed, chars = run.stdout.split()
    assert Path(file).resolve() == (target / "fitkit" / "__init__.py").resolve()
    assert imported == installed == version
    assert int(chars) == len((ROOT / "fitkit/examples/data/tinyshakespeare.txt").read_text())
