"""The files a path template owns: only those may be deleted, overwritten or uploaded.

A callback that writes ``runs/ep{epoch:02d}.pt`` owns the files of that pattern inside its
folder ``runs`` (the part of the template before its first field), and nothing else. The
names it keeps across a resume are stored relative to that folder, so a copied run folder
resumes with its own files, and a restored name is checked against the folder and the
pattern before it is used: a crafted checkpoint cannot make a callback delete a file
elsewhere (a checksum guards integrity, not origin).
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import re
import string

__all__ = ["Owned"]


def _literal_prefix(template: str) -> tuple[str, bool]:
    """The template's text before its first field (``{{`` unescaped), and whether it has fields."""
    text = ""
    for literal, field, _, _ in string.Formatter().parse(template):
        text += literal
        if field is not None:
            return text, True
    return text, False


class Owned:
    """The folder and the file pattern of a path template, and the checks that use them.

    Args:
        template: a path, or a ``str.format`` template of paths (``"runs/ep{epoch:02d}.pt"``).
        who: the callback, for warnings.

    Example:
        >>> owned = Owned("runs/ep{epoch:02d}.pt", "ModelCheckpoint")
        >>> owned.root, owned.owns("runs/ep03.pt"), owned.owns("runs/../precious.txt"), owned.owns("other/ep03.pt")
        ('runs', True, False, False)
        >>> owned.relative("runs/ep03.pt"), owned.restore("ep03.pt")
        ('ep03.pt', 'runs/ep03.pt')
    """

    def __init__(self, template: str, who: str):
        self.template, self.who = template, who
        prefix, _ = _literal_prefix(template)
        self.root = os.path.dirname(prefix)
        skip = len(self.root) + 1 if self.root else 0  # the folder and its separator
        pattern = ""
        for text, field, _, _ in string.Formatter().parse(template):
            cut = min(skip, len(text))
            text, skip = text[cut:], skip - cut
            pattern += glob.escape(text) + ("*" if field is not None else "")
        self._pattern = pattern  # relative to the folder

    def owns(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` lies inside the folder (symlinked folders resolved) and its name,
        relative to the folder, matches the template's pattern."""
        text = os.fspath(path)
        if not text or "\0" in text:
            return False
        full = os.path.abspath(text)
        folder = os.path.realpath(os.path.dirname(full))
        root = os.path.realpath(self.root or os.curdir)
        try:
            if os.path.commonpath([root, folder]) != root:
                return False
        except ValueError:  # another drive
            return False
        rel = os.path.relpath(os.path.join(folder, os.path.basename(full)), root)
        return fnmatch.fnmatchcase(rel, os.path.normpath(self._pattern))

    def relative(self, path: str) -> str:
        """The name to store: ``path`` relative to the folder."""
        return os.path.relpath(path, self.root or os.curdir)

    def restore(self, saved: object) -> str | None:
        """The path of a stored name (relative, or absolute from an older fitkit), if this
        template owns it; else ``None`` (the caller warns, with :meth:`refusal`)."""
        if not isinstance(saved, str):
            return None
        path = saved if os.path.isabs(saved) else (os.path.join(self.root, saved) if self.root else saved)
        return path if self.owns(path) else None

    def refusal(self, saved: object, what: str = "a file name") -> str:
        """Why :meth:`restore` refused ``saved``, for a warning."""
        return (
            f"{self.who}: the checkpoint lists {saved!r} as {what}, but that is not a file of "
            f"{self.template!r} inside {str(self.root or os.curdir)!r}; it is ignored (never deleted or "
            "uploaded). A copied or moved run folder, or an edited checkpoint, does this."
        )

    def lock_name(self) -> str:
        """The name of this template's lock file in the folder, e.g. ``.ep_epoch_02d_.pt.1a2b3c4d.lock``."""
        tail = self.template[len(self.root) :].lstrip("/" + os.sep) if self.root else self.template
        digest = hashlib.sha1(tail.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        return f".{re.sub(r'[^A-Za-z0-9._-]', '_', tail)[:80]}.{digest}.lock"
