"""A namesake beside fitkit: another distribution that also installs an import package ``fitkit``.

fitkit is distributed as ``torch-fitkit``; an unrelated project on the package index is named
``fitkit`` and installs a package of the same import name. Installed together, the two write
into one ``fitkit/`` folder: the later one overwrites the earlier one's ``__init__.py``, and
``pip uninstall fitkit`` deletes files that torch-fitkit needs. ``import fitkit`` warns once
when it finds such a distribution, naming it and the fix.

The check asks ``importlib.metadata`` for distributions *named* ``fitkit`` (a lookup by name
reads directory listings only, a few milliseconds), and of those keeps the ones whose
``top_level.txt`` or ``RECORD`` holds the package ``fitkit``, as
``importlib.metadata.packages_distributions()`` decides. The full
``packages_distributions()`` scan reads the metadata of every installed distribution, which
takes seconds on a loaded machine: too slow for every ``import fitkit``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path

__all__ = ["namesakes", "warn_about_namesakes"]

OWN = "torch-fitkit"
NAMESAKE = "fitkit"
_warned = False


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _provides_fitkit(dist: metadata.Distribution) -> bool:
    """Whether ``dist`` installs the import package ``fitkit`` (its top-level names, else its files)."""
    top_level = dist.read_text("top_level.txt")
    if top_level is not None:
        return NAMESAKE in top_level.split()
    return any(file.parts[:1] in ((NAMESAKE,), (f"{NAMESAKE}.py",)) for file in dist.files or ())


def _named_distributions(folders: Iterable[str]) -> list[metadata.Distribution]:
    """The ``.dist-info`` folders named ``fitkit`` (normalized) in ``folders``, read as they are on
    disk now (importlib's own search keeps listings of folders it has seen in this process)."""
    out: list[metadata.Distribution] = []
    for folder in folders:
        try:
            infos = sorted(Path(folder).glob("*.dist-info"))
        except OSError:  # a path entry that is no folder (a zip, a missing one)
            continue
        out += [metadata.PathDistribution(i) for i in infos if _normalized(i.name.split("-")[0]) == NAMESAKE]
    return out


def namesakes(path: Iterable[str] | None = None) -> list[str]:
    """The distributions other than torch-fitkit that install the import package ``fitkit``.

    Args:
        path: the folders to look in; ``None`` looks in ``sys.path``, as ``import`` does.

    Returns:
        One ``"name version (folder)"`` per distribution found, in ``path`` order; ``[]`` when
        torch-fitkit is the only one.

    Example:
        >>> namesakes(path=[])
        []
    """
    found = []
    for dist in _named_distributions(sys.path if path is None else path):
        name = dist.metadata["Name"] or NAMESAKE
        if _normalized(name) != OWN and _provides_fitkit(dist):
            where = getattr(dist, "_path", None)  # the .dist-info folder, for the message
            folder = f" ({where.parent})" if where is not None else ""
            found.append(f"{name} {dist.version}{folder}")
    return list(dict.fromkeys(found))


def warn_about_namesakes(path: Iterable[str] | None = None) -> None:
    """Warn (once per process) when another distribution also installs ``fitkit``; see :func:`namesakes`.

    Warns:
        FitkitWarning: names the other distribution and how to repair the install.
    """
    global _warned
    if _warned:
        return
    others = namesakes(path)
    if not others:
        return
    _warned = True
    from fitkit.checks import FitkitWarning

    warnings.warn(
        f"Another distribution also installs the import package `fitkit`: {', '.join(others)}. "
        "It is an unrelated project, not torch-fitkit; the two write into one `fitkit/` folder, "
        "so one overwrites the other's files and uninstalling it deletes files torch-fitkit needs. "
        "Fix: `pip uninstall -y fitkit torch-fitkit`, then install torch-fitkit again (from a "
        "checkout: `pip install .`); the docs' Install page has the details.",
        FitkitWarning,
        stacklevel=3,
    )
