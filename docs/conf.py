"""Sphinx configuration for the fitkit docs.

Build the site:     sphinx-build -W -b html docs docs/_build/html
Run every example:  sphinx-build -W -b doctest docs docs/_build/doctest

The tutorials with pictures are Python scripts in ``tutorials/`` (``NN_name.py``, sphinx-gallery's
format): the html build runs each once, captures what it prints and the figures it draws, and
writes the pages, with a download as ``.py`` and ``.ipynb``, to ``gallery/`` (generated, not in
git). The doctest build runs the ``.. testcode::`` blocks of the ``.rst`` pages only: the
scripts assert their own numbers, and run in the html build alone.

The build never touches the network: intersphinx reads the small inventories in
``_inventories/`` (hand-written, Sphinx inventory format version 1) instead of downloading
``objects.inv`` from docs.python.org and docs.pytorch.org.
"""

from __future__ import annotations

import doctest
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the fitkit next to these docs, installed or not
sys.path.insert(0, str(HERE))  # _gallery.py, the set-up of the executed tutorials

import fitkit  # noqa: E402

project = "fitkit"
author = "the fitkit authors"
copyright = "the fitkit authors, Apache-2.0"
release = version = fitkit.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "matplotlib.sphinxext.plot_directive",
]

exclude_patterns = ["_build", "_inventories", "Thumbs.db", ".DS_Store", "tutorials/GALLERY_HEADER.rst"]

# -- executed tutorials (sphinx-gallery) --------------------------------------------------------
# The doctest builder leaves the scripts alone (they run in the html build, once).
_DOCTEST = any(arg in ("doctest", "-bdoctest") for arg in sys.argv)  # -b doctest, -M doctest
if _DOCTEST:
    exclude_patterns += ["gallery", "sg_execution_times.rst"]
    suppress_warnings = ["toc.not_readable"]  # the toctree's gallery/ pages: html builds only
else:
    extensions.append("sphinx_gallery.gen_gallery")
    # sphinx-gallery's own index of the scripts: the "Tutorials" toctree lists them already, and a
    # second entry in the sidebar would list every executed tutorial twice.
    exclude_patterns += ["gallery/index.rst"]
# sphinx-gallery reads every attribute a script names, to link it; Tensor.T warns on 0-d tensors.
warnings.filterwarnings("ignore", message="Tensor.T is deprecated", category=UserWarning)
sphinx_gallery_conf = {
    "examples_dirs": ["tutorials"],
    "gallery_dirs": ["gallery"],
    "filename_pattern": r"/\d\d_[a-z_]+\.py$",  # every tutorial script runs
    "ignore_pattern": r"(/scripts/|__init__\.py)",
    "run_stale_examples": True,  # always run: a page shows what the code of today prints
    "download_all_examples": False,
    "remove_config_comments": True,
    "show_memory": False,
    "min_reported_time": 3600,  # no "Total running time" line on the pages
    "write_computation_times": False,
    "within_subsection_order": "FileNameSortKey",
    "capture_repr": ("_repr_html_",),
    "reset_modules": ("matplotlib", "_gallery.reset"),
    "plot_gallery": "True",
    "image_scrapers": ("matplotlib",),
    "abort_on_example_error": True,
    "only_warn_on_example_error": False,
}


# -- autodoc / napoleon -----------------------------------------------------------------------
autodoc_typehints = "signature"  # hints in the signature; the prose says what they mean
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True}
autoclass_content = "both"  # class docstring + __init__ docstring
autosummary_generate = False  # the API pages are written by hand, the content is autodoc's
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_admonition_for_examples = False
python_use_unqualified_type_names = True

# -- cross-references: every one resolves (nitpicky; tests/test_docs.py builds with -W) --------
nitpicky = True
# Names of other libraries whose docs have no inventory here (the build stays offline): shown as
# code, unlinked. fitkit's own names resolve through _xref.py.
nitpick_ignore_regex = [
    ("py:.*", r"(transformers|rich|torchmetrics)\..*"),
    ("py:.*", r"torch\._C\..*|torch\.jit\.Future|torch\.utils\.flop_counter\..*|torch\.optim\.swa_utils\..*"),
    ("py:class", r"fitkit\.checks\.declared\._F"),  # the decorator's TypeVar
]

# -- intersphinx, offline ---------------------------------------------------------------------
# Each entry names a local inventory file, so `sphinx-build` never fetches anything.
intersphinx_mapping = {
    "python": ("https://docs.python.org/3", "_inventories/python.inv"),
    "torch": ("https://docs.pytorch.org/docs/stable", "_inventories/torch.inv"),
}
intersphinx_timeout = 1

# Type hints are stringified from where a class is defined (``torch.nn.modules.module.Module``);
# the docs of PyTorch list the public path. These aliases point the former to the latter.
_TYPE_ALIASES = {
    "torch.nn.modules.module.Module": "torch.nn.Module",
    "torch.optim.optimizer.Optimizer": "torch.optim.Optimizer",
    "torch.utils.data.dataloader.DataLoader": "torch.utils.data.DataLoader",
    "torch.utils.data.dataset.Dataset": "torch.utils.data.Dataset",
    "torch.amp.grad_scaler.GradScaler": "torch.amp.GradScaler",
    "nn.Module": "torch.nn.Module",
    "torch._C.Generator": "torch.Generator",
    # the training core's own annotations name these classes as their modules import them
    "FitLoop": "fitkit.training.loop.FitLoop",
    "Stepper": "fitkit.training.stepper.Stepper",
    "_distributed.Parallel": "fitkit.distributed.Parallel",
}


def _resolve_alias(app, env, node, contnode):
    target = node.get("reftarget")
    if node.get("refdomain") != "py" or target not in _TYPE_ALIASES:
        return None
    from sphinx.ext import intersphinx

    node["reftarget"] = _TYPE_ALIASES[target]
    return intersphinx.missing_reference(app, env, node, contnode)


# -- doctest ----------------------------------------------------------------------------------
# Every example in the tutorials runs under `sphinx-build -b doctest`, seeded, on the CPU.
# One CPU thread: the printed numbers then do not depend on the core count, and a loaded
# machine does not slow the build down with oversubscribed thread pools.
doctest_global_setup = f"""
import os
os.environ.setdefault("FITKIT_DEVICE", "cpu")
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
DOCS_DIR = {str(HERE)!r}
"""
# No ELLIPSIS: a page shows what its code prints, every digit of it.
doctest_default_flags = doctest.NORMALIZE_WHITESPACE | doctest.DONT_ACCEPT_TRUE_FOR_1
# Only `.. doctest::` / `.. testcode::` blocks run here. The `>>>` examples of the API
# docstrings (shown in the reference pages) run under `pytest --doctest-modules`, in the
# namespace of their own module.
doctest_test_doctest_blocks = ""

# -- figures drawn at build time (matplotlib's plot directive) ------------------------------
plot_formats = [("png", 110)]
plot_html_show_formats = False
plot_html_show_source_link = False
plot_rcparams = {"figure.dpi": 110}

# -- HTML -------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"fitkit {release}"
html_static_path = ["_static"]
html_css_files = ["fitkit.css"]
html_show_sourcelink = False
html_theme_options = {
    "sidebar_hide_name": False,
    "navigation_with_keys": True,
}
pygments_style = "friendly"
pygments_dark_style = "monokai"


# The reference page of ``Model`` opens with its verbs, in the order a user calls them; the
# other members follow in source order (a stable sort after autodoc's own). autodoc has no
# option for a per-class order, so its sort is wrapped: Sphinx 9's member finder, or the
# documenter classes of earlier versions. tests/test_docs.py checks the order on the page.
_MODEL_VERBS = ("compile", "fit", "evaluate", "predict")


def _verb_rank(entry) -> int:
    item = entry[0]
    name = str(getattr(item, "dotted_parts", None) or getattr(item, "name", "")).replace("::", ".")
    owner, _, member = name.rpartition(".")
    verbs = _MODEL_VERBS if owner.split(".")[-1] == "Model" else ()
    return verbs.index(member) if member in verbs else len(_MODEL_VERBS)


def _verbs_first(sort_members):
    def sort(*args, **kwargs):
        return sorted(sort_members(*args, **kwargs), key=_verb_rank)

    return sort


def _patch_member_order() -> None:
    try:
        from sphinx.ext.autodoc._dynamic import _member_finder  # Sphinx >= 9
    except ImportError:
        from sphinx.ext.autodoc import Documenter

        Documenter.sort_members = _verbs_first(Documenter.sort_members)
    else:
        _member_finder._sort_members = _verbs_first(_member_finder._sort_members)


def setup(app):
    import _xref

    _patch_member_order()
    app.connect("missing-reference", _resolve_alias)
    app.connect("missing-reference", _xref.resolve)
    app.connect("html-page-context", _xref.fix_source_backlinks)
    app.connect("viewcode-follow-imported", _xref.follow_imported)
