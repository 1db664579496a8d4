"""Filler for benchmark sessions: Python standard-library source, read at run time, cut into turns.

The files come from the running interpreter's own standard library
(``sysconfig.get_paths()["stdlib"]``); nothing is copied into this repository. Test
suites, demos, GUI and packaging helpers and ``site-packages`` are left out, and so are
files on the benchmark's own topic (``Decimal`` arithmetic, rounding modes, dataclasses,
fees), so that the filler never restates or contradicts a definition ("non-topic").
:class:`FillerStream` cuts them into chat turns of about ``chunk_tokens`` tokens.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import re
import sys
import sysconfig
from dataclasses import dataclass

from pace_hf.chat import ChatTemplate

__all__ = ["FillerFile", "FillerStream", "FILLER_MODES", "stdlib_files", "filler_identity"]

FILLER_ACK = "Noted."  # the assistant's reply to every filler turn
FILLER_MODES = ("non-repeating", "repeating")
REPEATING_SET_SIZE = 4  # "repeating" cycles this many small files
REPEATING_MAX_BYTES = 8_000

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


class FillerStream:
    """Filler exchanges (a user turn holding a part of a stdlib file, and a fixed ack) of about
    ``chunk_tokens`` tokens each, from the files in a seeded order."""

    def __init__(self, chat: ChatTemplate, rng: random.Random, mode: str, chunk_tokens: int):
        if mode not in FILLER_MODES:
            raise ValueError(f"filler_mode must be one of {FILLER_MODES}, got {mode!r}")
        self.chat, self.chunk_tokens, self.mode = chat, chunk_tokens, mode
        files = list(stdlib_files())
        rng.shuffle(files)
        if mode == "repeating":  # a small set of small files, cycled
            files = [f for f in files if f.size <= REPEATING_MAX_BYTES][:REPEATING_SET_SIZE]
        self.files = files
        self.next_file = 0
        self.lines: list[str] = []
        self.line_tokens: list[int] = []
        self.pos = 0
        self.current: FillerFile | None = None
        self.part = 0
        self.used: list[str] = []
        self.ack_ids = chat.encode(chat.assistant_block(FILLER_ACK))

    def _open_next(self) -> None:
        if self.next_file >= len(self.files):
            if self.mode == "repeating":
                self.next_file = 0
            else:
                raise RuntimeError(
                    f"ran out of standard-library filler ({len(self.files)} files): ask for fewer tokens "
                    "or use filler_mode='repeating'")
        self.current = self.files[self.next_file]
        self.next_file += 1
        text = self.current.read()
        self.lines = text.splitlines(keepends=True)
        # Token count of each line, from one tokenization of the whole file.
        enc = self.chat.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        starts, acc = [], 0
        for line in self.lines:
            starts.append(acc)
            acc += len(line)
        counts = [0] * len(self.lines)
        li = 0
        for s, _ in enc["offset_mapping"]:
            while li + 1 < len(starts) and starts[li + 1] <= s:
                li += 1
            counts[li] += 1
        self.line_tokens = counts
        self.pos, self.part = 0, 0
        self.used.append(self.current.relpath)

    def _header(self) -> str:
        more = f" (part {self.part + 1})" if self.part else ""
        return f"Here is the next file of the repo: `{self.current.relpath}`{more}\n\n```python\n"

    def take(self, budget: int) -> tuple[list[int], list[int], str]:
        """One filler exchange of at most about ``budget`` tokens (user + ack): returns
        (user block ids, ack ids, content)."""
        if self.current is None or self.pos >= len(self.lines):
            self._open_next()
        overhead = len(self.chat.encode(self.chat.user_block(self._header() + "```"))) + len(self.ack_ids)
        target = max(1, min(self.chunk_tokens, budget) - overhead)
        end, n = self.pos, 0
        while end < len(self.lines) and n + self.line_tokens[end] <= target:
            n += self.line_tokens[end]
            end += 1
        if end == self.pos:
            end += 1  # always make progress
        code = "".join(self.lines[self.pos:end])
        if not code.endswith("\n"):
            code += "\n"
        content = self._header() + code + "```"
        self.pos = end
        self.part += 1
        if self.mode == "non-repeating" and budget <= self.chunk_tokens and self.pos < len(self.lines):
            self.pos = len(self.lines)  # the region ends here: never resume this file later
        return self.chat.encode(self.chat.user_block(content)), self.ack_ids, content
