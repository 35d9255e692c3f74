"""Cross-references to fitkit's own objects, for a build with ``nitpicky`` (``-n``): none broken.

The docstrings name objects where they are defined (``fitkit.callbacks.misc.TerminateOnNaN``,
``:func:`resolve_mode``` inside ``fitkit.callbacks.monitor``), while the reference pages
document many of them where they are exported (``fitkit.callbacks.TerminateOnNaN``). A
reference Sphinx cannot resolve by name is resolved here by the object it names:

- documented under another name: a link to that entry of the reference;
- an internal module, or an object of one, that has a source page (``viewcode``): a link to
  that page, at the object's block where the page has one;
- otherwise (an internal helper with no page of its own): its name as code, without a link.

A name that imports to nothing is left to Sphinx, which reports it: a typo still fails the build.

``viewcode`` also writes one back-link per object of a source page, built from the first name
under which any object of that module was documented; for an object documented under another
module's name (``fitkit.callbacks.SwapEMAWeights``, defined in ``fitkit.callbacks.swap_ema``)
that anchor does not exist. :func:`fix_source_backlinks` points those links at the entry that
does.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from sphinx.util.nodes import make_refnode


def _import(name: str) -> Any:
    """The object a dotted name imports to, else ``None``."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = inspect.getattr_static(obj, attr)
        except AttributeError:
            return None
        return getattr(obj, "__func__", obj)  # staticmethod / classmethod: the function
    return None


def _source(obj: Any) -> tuple[str, str] | None:
    """``(module, qualified name)`` where ``obj`` is defined; ``("fitkit.x", "")`` for a module."""
    if inspect.ismodule(obj):
        return obj.__name__, ""
    obj = obj.fget if isinstance(obj, property) else obj
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str)) or "<" in qualname:
        return None
    return module, qualname


def _module_of(name: str) -> str | None:
    """The longest importable module prefix of a dotted name."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:i])).__name__
        except ImportError:
            continue
    return None


def _where(name: str, role: str | None) -> tuple[str, str] | None:
    """Where the object ``name`` is defined; a constant (``:data:``) or an instance attribute
    (``:attr:``, set in ``__init__``) is placed at its module, resp. at its class."""
    obj = _import(name)
    if obj is None and role == "attr" and "." in name:
        obj = _import(name.rpartition(".")[0])
    if obj is None:
        return None
    where = _source(obj)
    if where is None and role in ("data", "attr", "const"):
        module = _module_of(name)
        where = (module, "") if module else None
    return where


def _documented(env: Any) -> dict[tuple[str, str], tuple[str, str]]:
    """``(module, qualname)`` of each documented fitkit class, function and module -> its entry
    ``(docname, anchor)``; computed once per build."""
    index = getattr(env, "_fitkit_documented", None)
    if index is None:
        index = {}
        for name, entry in env.get_domain("py").objects.items():
            if not name.startswith("fitkit") or entry.objtype in ("attribute", "data"):
                continue
            obj = _import(name)
            where = _source(obj) if obj is not None else None
            if where is not None and where[0].startswith("fitkit"):
                index.setdefault(where, (entry.docname, entry.node_id))
        env._fitkit_documented = index
    return index


_DOCSTRING_OF = re.compile(r"docstring of ([\w.]+)")


def _candidates(node: Any) -> list[str]:
    """The names a reference may mean: as written, then inside its class and module, where
    documented and where defined (a docstring names its own module's helpers briefly)."""
    target = node.get("reftarget", "").lstrip("~.")
    module, cls = node.get("py:module"), node.get("py:class")
    names = [target]
    if module and cls:
        names.append(f"{module}.{cls}.{target}")
    if module:
        names.append(f"{module}.{target}")
    of = _DOCSTRING_OF.search(node.source or "")
    owner = _import(of.group(1)) if of else None
    where = _source(owner) if owner is not None else None
    if where is not None:
        outer = where[1].split(".")[0] if where[1] else ""
        names += [f"{where[0]}.{outer}.{target}"] if outer else []
        names.append(f"{where[0]}.{target}")
    return [n for n in names if n.startswith("fitkit")]


def resolve(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """``missing-reference`` handler: a fitkit name, resolved by the object it imports to."""
    if node.get("refdomain") != "py":
        return None
    for name in _candidates(node):
        where = _where(name, node.get("reftype"))
        if where is None or not where[0].startswith("fitkit"):
            continue
        builder, here = app.builder, node["refdoc"]
        entry = _documented(env).get(where)
        if entry is not None:
            return make_refnode(builder, here, entry[0], entry[1], contnode, name)
        source = getattr(env, "_viewcode_modules", {}).get(where[0])
        if builder.format == "html" and source and source[2]:  # a source page is written
            anchor = where[1] if where[1] in source[2] else ""  # viewcode's block id: the qualname
            return make_refnode(builder, here, "_modules/" + where[0].replace(".", "/"), anchor, contnode, name)
        return contnode  # an internal helper with no page: its name as code
    return None


_BACKLINK = re.compile(r'(<a class="viewcode-back" href=")([^"#]*)#([^"]+)(")')


def fix_source_backlinks(app: Any, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    """``html-page-context`` handler: a source page's "[docs]" links point at existing entries."""
    if not pagename.startswith("_modules/") or "body" not in context:
        return
    objects = app.env.get_domain("py").objects
    module = pagename[len("_modules/"):].replace("/", ".")

    def fix(match: re.Match) -> str:
        anchor = match.group(3)
        known = objects.get(anchor)  # a canonical name autodoc recorded is an alias of the entry
        qualname = anchor[len(module) + 1:] if anchor.startswith(module + ".") else anchor.split(".", 1)[-1]
        entry = (known.docname, known.node_id) if known else _documented(app.env).get((module, qualname))
        if entry is None:
            return match.group(0)
        return match.group(1) + app.builder.get_relative_uri(pagename, entry[0]) + "#" + entry[1] + match.group(4)

    context["body"] = _BACKLINK.sub(fix, context["body"])


def follow_imported(app: Any, modname: str, attribute: str) -> str | None:
    """``viewcode-follow-imported`` handler: an attribute bound to another library's function
    (``clock = staticmethod(time.monotonic)``) gets no source page of that library."""
    obj = _import(f"{modname}.{attribute}")
    where = _source(obj) if obj is not None else None
    if where is None:
        return None
    return where[0] if where[0].startswith("fitkit") else modname

