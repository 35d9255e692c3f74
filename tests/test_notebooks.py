"""The tutorials' notebooks run in a real Jupyter kernel, and the progress bar renders there.

The docs offer each executed tutorial as a ``.ipynb`` download, made by sphinx-gallery's
converter from ``docs/tutorials/NN_name.py``; here the same converter makes them and nbclient
runs every cell in an IPython kernel, as a user's Jupyter would. Needs ``nbclient`` and
``ipykernel`` (in the ``test`` extra).

Every script already runs once in the docs' html build (tests/test_docs.py), and a notebook holds
the same code, cell by cell: here every notebook is made and checked, and the tutorials in
``IN_A_KERNEL`` (the first one, and one that draws figures) run in a kernel, where a notebook
differs from a script (the kernel's display, inline figures, no ``__file__``). Running the heavy
tutorials a second time in a kernel would double the suite's time and test nothing new; what a
kernel cannot do (``__file__``, ``sys.argv``, a ``__main__`` guard) is refused in every notebook.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

TUTORIALS = Path(__file__).resolve().parent.parent / "docs" / "tutorials"
SCRIPTS = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))

pytestmark = pytest.mark.skipif(not SCRIPTS, reason="no docs/tutorials next to the tests")


def _run(notebook, cwd: Path) -> None:
    env_device = os.environ.get("FITKIT_DEVICE")
    os.environ["FITKIT_DEVICE"] = "cpu"  # the kernel inherits it: the pages' numbers are CPU numbers
    try:
        nbclient.NotebookClient(
            notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
        ).execute()
    finally:
        if env_device is None:
            os.environ.pop("FITKIT_DEVICE", None)
        else:
            os.environ["FITKIT_DEVICE"] = env_device


def _gallery_notebook(script: Path, tmp_path: Path):
    """The ``.ipynb`` the docs offer for ``script``, made by sphinx-gallery's converter."""
    notebook = pytest.importorskip("sphinx_gallery.notebook")
    from sphinx_gallery.py_source_parser import remove_ignore_blocks

    copy = tmp_path / script.name  # as the docs build does: the ignore blocks out, then converted
    copy.write_text(remove_ignore_blocks(script.read_text(encoding="utf-8")), encoding="utf-8")
    notebook.python_to_jupyter_cli([str(copy)])
    return nbformat.read(copy.with_suffix(".ipynb"), as_version=4)


# The tutorials run in a kernel here (the others run once, in the docs' html build).
IN_A_KERNEL = ("01_loop_to_fit", "02_classifier")
# What a script may use and a notebook's kernel does not have.
_KERNEL_HAZARDS = re.compile(r"__file__|sys\.argv|__name__\s*==\s*['\"]__main__['\"]")


def test_the_kernel_tutorials_exist():
    assert set(IN_A_KERNEL) <= {s.stem for s in SCRIPTS}, IN_A_KERNEL


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_every_tutorial_notebook_runs_in_a_kernel(script, tmp_path):
    notebook = _gallery_notebook(script, tmp_path)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code, script.name
    assert not any("assert " in cell.source for cell in code)  # the tests' lines stay out of the download
    hazards = [m.group() for cell in code for m in _KERNEL_HAZARDS.finditer(cell.source)]
    assert not hazards, f"{script.name}: a notebook's kernel has no {hazards}"
    if script.stem not in IN_A_KERNEL:
        return  # the same code ran in the html build
    _run(notebook, tmp_path)  # raises CellExecutionError, with the cell, on any error
    printed = "".join(out.get("text", "") for cell in code for out in cell.outputs if out.output_type == "stream")
    assert printed.strip(), f"{script.name}: nothing printed"
    assert all(cell.execution_count for cell in code)


@pytest.mark.slow
def test_the_progress_bar_renders_in_a_notebook(tmp_path):
    """verbose=1 in a notebook: one rendered line per epoch (text and HTML), with the epoch's
    loss exactly as History holds it, to the 4 digits shown."""
    cell = nbformat.v4.new_code_cell(
        "import json, torch, fitkit\n"
        "from torch import nn\n"
        "torch.manual_seed(0)\n"
        "model = fitkit.Model(nn.Linear(3, 1))\n"
        "model.compile(optimizer='sgd', loss='mse')\n"
        "x, y = torch.randn(64, 3), torch.randn(64, 1)\n"
        "history = model.fit(x, y, batch_size=8, epochs=2, verbose=1)\n"
        "print(json.dumps(history.history['loss']))"
    )
    notebook = nbformat.v4.new_notebook(cells=[cell])
    _run(notebook, tmp_path)
    shown = [out for out in cell.outputs if out.output_type == "display_data"]
    losses = json.loads("".join(out.text for out in cell.outputs if out.output_type == "stream"))
    assert len(losses) == 2
    assert len(shown) == 2, [out.output_type for out in cell.outputs]
    for epoch, (out, loss) in enumerate(zip(shown, losses, strict=True)):
        text, html = out.data["text/plain"], out.data["text/html"]
        assert text.startswith(f"Epoch {epoch + 1}/2 - 8 steps")
        assert f"loss: {loss:.4f}" in text and f"loss: {loss:.4f}" in html
