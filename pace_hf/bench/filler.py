"""Filler for benchmark sessions: Python standard-library source, read at run time.

The files come from the running interpreter's own standard library
(``sysconfig.get_paths()["stdlib"]``); nothing is copied into this repository. Test
suites, demos, GUI and packaging helpers and ``site-packages`` are left out, and so are
files on the benchmark's own topic (``Decimal`` arithmetic, rounding modes, dataclasses,
fees), so that the filler never restates or contradicts a definition ("non-topic").
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
import sysconfig
from dataclasses import dataclass

__all__ = ["FillerFile", "stdlib_files", "filler_identity"]

_SKIP_DIRS = {
    "site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
    "ensurepip", "tkinter", "pydoc_data", "__pycache__", "venv", "msilib",
}
_SKIP_DIR_PREFIXES = ("config-",)
_TOPIC = re.compile(r"Decimal|decimal|ROUND_|dataclass|\b[Ff]ees?\b|FEE|[Ss]ettle|[Ll]edger|[Ii]nvoice")
MIN_BYTES = 2_000
MAX_BYTES = 120_000
MAX_LINE_CHARS = 240


@dataclass(frozen=True)
class FillerFile:
    relpath: str  # relative to the stdlib directory, with "/" separators
    size: int  # bytes

    def read(self) -> str:
        with open(os.path.join(stdlib_dir(), self.relpath), encoding="utf-8") as f:
            return f.read()


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


@functools.lru_cache(maxsize=None)
def stdlib_files() -> tuple[FillerFile, ...]:
    """Usable filler files, sorted by path (deterministic for a given Python install)."""
    root = stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(_SKIP_DIR_PREFIXES)
        )
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith(("test_", "_test")):
                continue
            path = os.path.join(dirpath, name)
            try:
                size = os.path.getsize(path)
                if not MIN_BYTES <= size <= MAX_BYTES:
                    continue
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            if _TOPIC.search(text) or not text.isascii():
                continue
            if max(len(line) for line in text.splitlines()) > MAX_LINE_CHARS:
                continue
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            out.append(FillerFile(rel, size))
    out.sort(key=lambda f: f.relpath)
    if not out:
        raise RuntimeError(f"no usable standard-library source files under {root}")
    return tuple(out)


@functools.lru_cache(maxsize=None)
def filler_identity() -> str:
    """A hash of the filler source: Python version and the list of files with sizes."""
    h = hashlib.sha256(sys.version.encode())
    for f in stdlib_files():
        h.update(f"{f.relpath}\0{f.size}\n".encode())
    return h.hexdigest()
