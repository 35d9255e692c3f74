"""The documentation builds with warnings as errors, and every tutorial example runs.

`sphinx-build -W -b html` catches broken markup and broken docstrings in the API reference
(``nitpicky`` is on in ``conf.py``: a cross-reference that resolves to nothing is an error),
the test checks that every link between the built pages reaches an existing page and anchor,
and the build runs the tutorial scripts (``docs/tutorials/NN_name.py``, sphinx-gallery), each
once: they assert their own numbers, and their pages must show what they printed and drew;
`sphinx-build -W -b doctest` runs every ``.. testcode::`` / ``.. doctest::`` block of the
``.rst`` pages and compares what it prints with the output written on the page (every digit:
no ``...``). Needs the
``docs`` extra (``pip install -e ".[docs]"``); skipped without Sphinx or furo.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urldefrag

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(
    p
    for p in DOCS.rglob("*.rst")
    if "_build" not in p.parts
    and "gallery" not in p.parts
    and p.name not in ("GALLERY_HEADER.rst", "sg_execution_times.rst")
)
# The executed tutorials: sphinx-gallery scripts, run by the html build (generated into gallery/).
SCRIPTS = sorted((DOCS / "tutorials").glob("[0-9][0-9]_*.py"))

pytestmark = pytest.mark.skipif(not DOCS.is_dir(), reason="no docs/ next to the tests")


# Public modules with a reference page in docs/api/ (the page is named after the last part).
REFERENCE = (
    "fitkit.callbacks",
    "fitkit.layers",
    "fitkit.data",
    "fitkit.text",
    "fitkit.losses",
    "fitkit.metrics",
    "fitkit.devices",
    "fitkit.distributed",
    "fitkit.files",
    "fitkit.tools.export",
)


def _public_callables(module_name: str) -> list[str]:
    """Names in ``__all__`` that are classes or functions defined in fitkit."""
    module = importlib.import_module(module_name)
    names = []
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name)
        if (
            (inspect.isclass(obj) or inspect.isfunction(obj))
            and obj.__module__.startswith("fitkit")
            and not (module_name == "fitkit.data" and obj.__module__ == "fitkit.text")
        ):
            names.append(name)  # fitkit.data re-exports the text helpers, documented there
    return names


def _sphinx(builder: str, out: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("sphinx_gallery")
    pytest.importorskip("sphinx")
    pytest.importorskip("furo")
    env = dict(os.environ, FITKIT_DEVICE="cpu", PYTHONHASHSEED="0", COLUMNS="100")
    # -E: read every source again; -q: only warnings and errors on stderr.
    cmd = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-E",
        "-q",
        "-b",
        builder,
        "-d",
        str(out / "doctrees"),
        str(DOCS),
        str(out / builder),
    ]
    # From the repository root, as a user runs sphinx-build.
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=DOCS.parent)


@pytest.mark.slow
def test_html_builds_without_warnings(tmp_path):
    result = _sphinx("html", tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    for page in ("index.html", "gallery/01_loop_to_fit.html", "tutorials/03_layers.html", "api/fitkit.html"):
        assert (tmp_path / "html" / page).is_file(), page
    # The site renders offline: no page loads a script or stylesheet from the network
    # (e.g. MathJax from a CDN, which `:math:` would pull in).
    for page in (tmp_path / "html").rglob("*.html"):
        remote = re.findall(r'<(?:script|link)[^>]*(?:src|href)="https?://[^"]*"', page.read_text(encoding="utf-8"))
        assert not remote, (page.name, remote)
    # The reference is generated from the code: the Model's methods must be on the page...
    api = (tmp_path / "html" / "api" / "fitkit.html").read_text(encoding="utf-8")
    for name in (
        "fitkit.Model.compile",
        "fitkit.Model.fit",
        "fitkit.Model.evaluate",
        "fitkit.Model.predict",
        "fitkit.Model.summary",
        "fitkit.Model.train_step",
        "fitkit.Model.save_checkpoint",
    ):
        assert f'id="{name}"' in api, name
    # The page opens with the Model's verbs, in the order a user calls them.
    members = re.findall(r'id="fitkit\.Model\.([A-Za-z_]+)"', api)
    assert members[:4] == ["compile", "fit", "evaluate", "predict"], members[:8]
    # One sidebar entry per page: the executed tutorials are listed once, under "Tutorials".
    index = (tmp_path / "html" / "index.html").read_text(encoding="utf-8")
    start = index.index('class="sidebar-tree"')
    sidebar = index[start : index.index("<article", start)]
    assert sidebar.count('href="gallery/01_loop_to_fit.html"') == 1
    assert "Executed tutorials" not in sidebar
    # Test asserts run but stay out of the rendered code (sphinx-gallery's ignore markers).
    for script in SCRIPTS:
        code = (tmp_path / "html" / "gallery" / f"{script.stem}.html").read_text(encoding="utf-8")
        assert '<span class="k">assert</span>' not in code, script.stem
    # ... and every public class and function of every module on its module's page.
    missing = []
    for module in REFERENCE:
        page = (tmp_path / "html" / "api" / f"{module.split('.')[-1]}.html").read_text(encoding="utf-8")
        for name in _public_callables(module):
            if f'id="{module}.{name}"' not in page:
                missing.append(f"{module}.{name}")
    assert not missing, f"not in the API reference: {missing}"
    _check_executed_tutorials(tmp_path / "html")
    broken = broken_internal_links(tmp_path / "html")
    assert not broken, "links to no page or no anchor:\n" + "\n".join(broken[:40])


_HREF = re.compile(r'<a\b[^>]*?\bhref="([^"]*)"')
_ID = re.compile(r'\bid="([^"]*)"')


def broken_internal_links(html: Path) -> list[str]:
    """Every link of the built site to a page of its own that does not exist, or to an anchor
    that the page does not have (``page.html: href (why)``); external links are not followed."""
    pages = sorted(html.rglob("*.html"))
    ids = {page.resolve(): set(_ID.findall(page.read_text(encoding="utf-8"))) for page in pages}
    bad = []
    for page in pages:
        for href in _HREF.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z][a-z0-9+.-]*:|//", href):  # http:, mailto:, ... : another site
                continue
            target, anchor = urldefrag(unquote(href.replace("&amp;", "&")))
            dest = (page.parent / target).resolve() if target else page.resolve()
            dest = dest / "index.html" if dest.is_dir() else dest
            if not dest.exists():
                bad.append(f"{page.relative_to(html)}: {href} (no such file)")
            elif anchor and dest.suffix == ".html" and anchor not in ids.get(dest, ()):
                bad.append(f"{page.relative_to(html)}: {href} (no such anchor)")
    return bad


def test_the_link_check_finds_a_missing_page_and_a_missing_anchor(tmp_path):
    (tmp_path / "api").mkdir()
    (tmp_path / "index.html").write_text(
        '<a href="api/a.html#f">ok</a><a href="api/a.html#g">no anchor</a><a href="b.html">no page</a>'
        '<a href="#top">here</a><a href="https://example.org/x.html#y">external</a><p id="top"></p>'
    )
    (tmp_path / "api" / "a.html").write_text('<dt id="f"></dt><a href="../index.html#top">back</a>')
    assert broken_internal_links(tmp_path) == [
        "index.html: api/a.html#g (no such anchor)",
        "index.html: b.html (no such file)",
    ]


# The figures each executed tutorial must show (sphinx-gallery numbers them per script).
FIGURES = {"02_classifier": 2, "04_microgpt": 1, "05_callbacks": 2}
_OUTPUT_BLOCK = re.compile(r'<div class="sphx-glr-script-out[^"]*".*?<pre>(.*?)</pre>', re.S)
_ELISION = re.compile(r"(?<![\[(])\.\.\.(?![\])])")
_TESTOUTPUT_BLOCK = re.compile(r'<div class="highlight-none[^"]*"><div class="highlight"><pre>(.*?)</pre>', re.S)


def _check_executed_tutorials(html: Path) -> None:
    """Every tutorial script ran: its page holds its output, its figures (PNG files that were
    written) and its downloads; no output block of any tutorial elides a value with ``...``."""
    assert SCRIPTS, "no tutorial scripts"
    for script in SCRIPTS:
        page = html / "gallery" / f"{script.stem}.html"
        assert page.is_file(), page
        text = page.read_text(encoding="utf-8")
        assert _OUTPUT_BLOCK.search(text), f"{script.stem}: no captured output"
        images = re.findall(r'<img src="\.\./_images/(sphx_glr_[^"]+\.png)"', text)
        assert len(images) >= FIGURES.get(script.stem, 0), (script.stem, images)
        for image in images:
            assert (html / "_images" / image).stat().st_size > 5000, image  # a drawn figure, not an empty one
        for download in (f"{script.stem}.py", f"{script.stem}.ipynb"):
            assert download in text, (script.stem, download)
    for page in [*(html / "gallery").glob("*.html"), *(html / "tutorials").glob("*.html")]:
        text = page.read_text(encoding="utf-8")
        for block in [*_OUTPUT_BLOCK.findall(text), *_TESTOUTPUT_BLOCK.findall(text)]:
            elided = _ELISION.search(block.replace("&#8230;", "..."))  # "[...]" in a message is text
            assert elided is None, (page.name, block[max(0, elided.start() - 200) : elided.end() + 50])


@pytest.mark.slow
def test_tutorial_examples_run_and_print_what_the_pages_show(tmp_path):
    result = _sphinx("doctest", tmp_path)
    report = tmp_path / "doctest" / "output.txt"
    text = report.read_text(encoding="utf-8") if report.is_file() else ""
    assert result.returncode == 0, text[-8000:] + result.stderr[-4000:]
    ran = sum(int(n) for n in re.findall(r"^\s*(\d+) tests$", text, flags=re.M)[-1:])
    assert ran > 0, text[-2000:]
    assert "0 failures in tests" in text, text[-8000:]
    # Every tutorial and guide ran (a page whose blocks were all skipped would not show).
    for page in PAGES:
        rel = page.relative_to(DOCS).with_suffix("").as_posix()
        if rel.startswith(("tutorials/", "guides/")):
            assert f"Document: {rel}\n" in text, f"no example of {rel} ran"


# Code shown on a page must be code that runs: these checks need no Sphinx.
_UNTESTED_CODE = re.compile(r"^\s*\.\. (code-block|code|sourcecode)::\s*(python|py|pycon)?\s*$")
_CAPTION = re.compile(r"^\s+:caption:\s*(.*)$")


def _untested_python_blocks(page: Path) -> list[str]:
    """Python code blocks that no builder runs, except side-by-side code of other libraries.

    A page may show Keras or Lightning code (which is not installed), or Ray Train code (which
    needs a cluster), in a ``code-block`` whose caption names that library; every other Python
    example must be a
    ``testcode`` / ``doctest`` block. ``::`` literal blocks are allowed for shell output.
    """
    lines = page.read_text(encoding="utf-8").splitlines()
    bad = []
    for i, line in enumerate(lines):
        m = _UNTESTED_CODE.match(line)
        if not m:
            continue
        language = m.group(2)
        if language is None:
            continue  # bash, text, ... are given a language explicitly below
        caption = next((c.group(1) for c in map(_CAPTION.match, lines[i + 1 : i + 4]) if c), "")
        if not re.match(r"(Keras|Lightning|PyTorch Lightning|TensorFlow|timm|Ray Train)\b", caption):
            bad.append(f"{page.relative_to(DOCS)}:{i + 1}: {line.strip()} (caption {caption!r})")
    return bad


def test_every_python_block_on_a_page_is_executed():
    bad = [b for page in PAGES for b in _untested_python_blocks(page)]
    assert not bad, "Python shown but never run; use `.. testcode::`:\n" + "\n".join(bad)


def test_no_bare_interpreter_examples_outside_doctest_blocks():
    # `doctest_test_doctest_blocks` is off (the API docstrings run under pytest instead), so a
    # bare `>>>` paragraph in a page would be shown but never run.
    bad = []
    for page in PAGES:
        inside, indent = False, 0
        for i, line in enumerate(page.read_text(encoding="utf-8").splitlines()):
            if re.match(r"^\.\. (doctest|testcode|testoutput|code-block|code)::", line.strip()):
                inside = True
                indent = len(line) - len(line.lstrip())
                continue
            if inside and line.strip() and len(line) - len(line.lstrip()) <= indent:
                inside = False
            if not inside and line.lstrip().startswith(">>> "):
                bad.append(f"{page.relative_to(DOCS)}:{i + 1}")
    assert not bad, "bare `>>>` outside `.. doctest::`: " + ", ".join(bad)


def test_every_public_module_has_a_reference_page():
    for target in ("fitkit", *REFERENCE):
        page = DOCS / "api" / f"{target.split('.')[-1]}.rst"
        assert page.is_file(), page
        assert f":: {target}" in page.read_text(encoding="utf-8"), page


def test_intersphinx_never_needs_the_network():
    conf = (DOCS / "conf.py").read_text(encoding="utf-8")
    mapping = re.search(r"intersphinx_mapping = \{(.*?)\n\}", conf, flags=re.S)
    if mapping is None:
        return
    for target, inventory in re.findall(r'\(\s*"([^"]+)",\s*"?([^")]+)"?\s*\)', mapping.group(1)):
        assert "://" not in inventory, f"{target}: inventory {inventory} would be downloaded"
        assert (DOCS / inventory).is_file(), inventory
