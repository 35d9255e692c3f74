"""A real small (or read-only) file system for disk-full and read-only tests: a tmpfs mounted
over a folder. Mounting needs root; elsewhere the test is skipped (each such test has a
monkeypatched sibling that runs everywhere)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(folder: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """``folder`` (created) with a tmpfs of ``size`` (``"64k"``) mounted on it, unmounted after
    (lazily: a library may still hold a file open there)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder.mkdir(exist_ok=True)
    options = ("ro," if read_only else "") + f"size={size}"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"mount -t tmpfs is not allowed here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)
