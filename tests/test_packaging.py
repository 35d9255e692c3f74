"""The release check: the sdist and wheel build and pass ``twine check``; the wheel installs into a
fresh virtual environment that has only its declared dependencies, and the README's first job
runs from it. And ``import fitkit`` warns about a namesake installed beside it."""

import email
import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import venv
import warnings
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import fitkit

pytest.importorskip("build")
pytest.importorskip("twine")

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
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
        check=True,
        capture_output=True,
        text=True,
    )
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
    assert {
        "fitkit/py.typed",
        "fitkit/examples/data/tinyshakespeare.txt",
        f"torch_fitkit-{version}.dist-info/licenses/LICENSE",
    } <= names
    with tarfile.open(sdist) as tf:
        members = set(tf.getnames())
    assert f"torch_fitkit-{version}/LICENSE" in members
    assert f"torch_fitkit-{version}/fitkit/examples/data/tinyshakespeare.txt" in members

    # The release check of the package index: both files' metadata render (README as the long
    # description) and pass twine's checks.
    twine = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)], capture_output=True, text=True
    )
    assert twine.returncode == 0, twine.stdout + twine.stderr
    assert twine.stdout.count("PASSED") == 2, twine.stdout

    # A fresh virtual environment that holds the wheel and what it declares it needs, nothing
    # more: the runtime dependencies and the `examples` extra, linked from this environment
    # (no index, no download; no pytest, no test extra). The README's first job runs from it.
    python = _fresh_venv(tmp_path / "venv", wheel, meta.get_all("Requires-Dist"), extras={"examples"})
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONNOUSERSITE="1", FITKIT_DEVICE="cpu", OMP_NUM_THREADS="1")
    code = (
        "import fitkit, importlib.metadata as m, importlib.resources as r, importlib.util as u; "
        "print(fitkit.__file__); print(fitkit.__version__); print(m.version('torch-fitkit')); "
        "print(len(r.files('fitkit').joinpath('examples/data/tinyshakespeare.txt').read_text())); "
        "print(u.find_spec('pytest') is None, u.find_spec('torchvision') is None)"
    )
    run = subprocess.run([str(python), "-c", code], cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    file, imported, installed, chars, no_pytest, no_torchvision = run.stdout.split()
    assert Path(file).parent.parent == python.parent.parent / SITE_PACKAGES
    assert imported == installed == version
    assert int(chars) == len((ROOT / "fitkit/examples/data/tinyshakespeare.txt").read_text())
    assert no_pytest == no_torchvision == "True"  # only what the wheel declares is there
    job = subprocess.run(
        [str(python), "-m", "fitkit.examples.digits", "--epochs", "1", "--verbose", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert re.fullmatch(r"test accuracy 0\.\d{4} - test loss \d\.\d{4} - trained in \d+\.\ds on cpu\n", job.stdout), (
        job.stdout
    )


SITE_PACKAGES = Path("lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages")


def _fresh_venv(root: Path, wheel: Path, requires: list[str], extras: set[str]) -> Path:
    """A venv without pip holding ``wheel`` (installed by this pip) and, linked from this
    environment's site-packages, the distributions ``requires`` needs, recursively; returns its python."""
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    site = root / SITE_PACKAGES
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--quiet",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
        # without PYTHONPATH: a checkout on it (its .egg-info) would look installed to pip
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")},
    )
    deps = root / "deps"  # the linked dependencies, one folder on the venv's path (a .pth line)
    deps.mkdir()
    (site / "dependencies.pth").write_text(f"{deps}\n")
    todo, seen = [(Requirement(r), extras) for r in requires], set()
    while todo:
        req, wanted = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in wanted or {""}):
            continue
        if canonicalize_name(req.name) in seen:
            continue
        dist = metadata.distribution(req.name)
        seen.add(canonicalize_name(req.name))
        for top in {f.parts[0] for f in dist.files or () if f.parts[0] != ".."}:
            if not (deps / top).exists() and (Path(dist.locate_file(top))).exists():
                (deps / top).symlink_to(Path(dist.locate_file(top)))
        todo += [(Requirement(r), req.extras) for r in dist.requires or ()]
    return python


# -- a namesake: the unrelated `fitkit` distribution installs the same import package ----------------
def _fake_dist(site: Path, name: str, version: str, files: list[str], top_level: str | None = None) -> None:
    """A ``.dist-info`` as pip writes it (METADATA, RECORD, top_level.txt), with no package files."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    if top_level is not None:
        (info / "top_level.txt").write_text(top_level)


@pytest.mark.parametrize(
    "name, files, top_level, expected",
    [
        ("fitkit", ["fitkit/__init__.py", "fitkit/core.py"], None, ["fitkit 0.3.1"]),  # RECORD only
        ("fitkit", ["fitkit/__init__.py"], "fitkit\n", ["fitkit 0.3.1"]),  # top_level.txt, as setuptools writes
        ("FitKit", ["fitkit.py"], None, ["FitKit 0.3.1"]),  # a module, and a name that normalizes to fitkit
        ("fitkit", ["other/__init__.py"], "other\n", []),  # named fitkit, installs something else
        ("torch-fitkit", ["fitkit/__init__.py"], "fitkit\n", []),  # this library itself
        ("fitkit-extras", ["fitkit/__init__.py"], None, []),  # another name: not looked up (see the module)
    ],
)
def test_namesakes_names_another_distribution_that_installs_fitkit(tmp_path, name, files, top_level, expected):
    from fitkit.checks.namesake import namesakes

    _fake_dist(tmp_path, name, "0.3.1", files, top_level)
    assert namesakes(path=[str(tmp_path)]) == [f"{e} ({tmp_path})" for e in expected]


def test_namesake_warning_is_given_once_with_the_fix(tmp_path, monkeypatch):
    from fitkit.checks import namesake

    _fake_dist(tmp_path, "fitkit", "0.3.1", ["fitkit/__init__.py"])
    monkeypatch.setattr(namesake, "_warned", False)
    with pytest.warns(fitkit.FitkitWarning) as caught:
        namesake.warn_about_namesakes(path=[str(tmp_path)])
        namesake.warn_about_namesakes(path=[str(tmp_path)])
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(
        f"Another distribution also installs the import package `fitkit`: fitkit 0.3.1 ({tmp_path})."
    )
    assert "Fix: `pip uninstall -y fitkit torch-fitkit`, then install torch-fitkit again" in message
    monkeypatch.setattr(namesake, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        namesake.warn_about_namesakes(path=[str(tmp_path / "empty")])  # nothing there: silent
    assert namesake._warned is False


def test_import_fitkit_warns_once_when_the_namesake_is_on_the_path(tmp_path):
    # A fresh interpreter whose path holds the namesake's dist-info: `import fitkit` itself warns,
    # a second import (cached) and a second check do not.
    site = tmp_path / "site"
    _fake_dist(site, "fitkit", "0.3.1", ["fitkit/__init__.py", "fitkit/core.py"])
    code = (
        "import sys, warnings; warnings.simplefilter('always'); sys.path.insert(0, sys.argv[1]); "
        "import fitkit; import fitkit; fitkit.checks.namesake.warn_about_namesakes()"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", code, str(site)], cwd=tmp_path, env=env, check=True, capture_output=True, text=True
    )
    assert run.stderr.count("FitkitWarning: Another distribution also installs the import package") == 1
    assert f"fitkit 0.3.1 ({site})" in run.stderr
