"""DiskTier: one file per entry under a root directory, written atomically.

Atomic write: the entry goes to a temporary file in the *same* directory (``.tmp-*``), is fsynced, and
replaces the final name with ``os.replace`` (atomic on POSIX), then the directory is fsynced. A reader
therefore sees either the old entry or the new one, never a torn one; a crash leaves at most a stray
``.tmp-*`` file, which readers ignore. A directory it creates is fsynced into its parent too, so an entry
that ``put`` returned from survives a power cut with its path. (Whatever happens to the bytes later, the
checksum in the entry catches it on read.)

Group commit: ``put_many`` (the writer's batches) writes every file of the batch to its temporary name,
makes them all durable with one ``syncfs(2)`` of the root's file system, renames them, and makes the names
durable with a second one. A spill writes a thousand small entries a turn (an entry per layer and page),
and a file and directory fsync per entry cost 5.5 ms each on this project's ext4 disk, against 0.22 ms
a file for a batch with ``syncfs``: on a 16K-token pace-serve turn, seconds of the writer's time. The
guarantee is the same (every entry durable, under its final name, before the write is confirmed); the
price is that ``syncfs`` also flushes what other writers left dirty on that file system. Where the C
library has no ``syncfs`` (not Linux), or it fails, the batch fsyncs each file, then each directory once.

Leases: ``acquire_lease`` takes an exclusive ``flock`` on ``<escaped name>.lock`` under the root and keeps
the file open until ``release_lease``. The kernel drops the lock when the holder exits, however it
exits (SIGKILL included), so a crashed writer never leaves a stale lease and no TTL is needed; a second
writer, in this process or another, gets ``False`` at once. Releasing unlinks the file while it is still
locked, so sessions leave no lock files behind; a taker that opened the old file checks, once it holds
the flock, that the file is still the one under that name, and otherwise takes the new one.

File names: strict escaping, not hashing, so ``delete_prefix`` (drop a session) can work from names alone
and a directory listing stays readable. Every byte of the UTF-8 key outside ``[A-Za-z0-9_-]`` becomes
``%XX`` -- ``/``, ``.``, ``~`` and ``%`` included -- so a key can never name a path outside the root
("../x" becomes ``%2E%2E%2Fx``), a hidden file or a temporary file. Escaped names longer than 200 bytes
are split into directory levels (``<200 bytes>~d/.../<rest>.kv``; ``~`` and ``.`` never occur in an
escaped name, so a level can never collide with a file).

Reads of many keys (``get_many``) go through a small thread pool of the tier's own (``read_threads``):
a restore reads dozens of files, and their system calls overlap.

Failures (disk full, read-only file system, permission denied, the root not being a directory) raise
``OSError`` from ``put``; the store counts them and generation goes on. A missing file is a miss
(``None``), not an error.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import string
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

from .base import Tier

_SAFE = frozenset((string.ascii_letters + string.digits + "_-").encode())
_SEGMENT = 200
_DIR_SUFFIX = "~d"
_FILE_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"
_LOCK_SUFFIX = ".lock"


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(d: str) -> None:
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # some file systems refuse fsync on a directory; the data is already synced
        pass


def _load_syncfs():
    """Linux's ``syncfs(2)`` from the C library, or None where there is none."""
    try:
        syncfs = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    syncfs.argtypes, syncfs.restype = [ctypes.c_int], ctypes.c_int
    return syncfs


_SYNCFS = _load_syncfs()


def _sync_files(fds: list[int]) -> None:
    """Make the open files ``fds`` (on one file system) durable: one ``syncfs``, or else an fsync each."""
    if _SYNCFS is not None and _SYNCFS(fds[0]) == 0:
        return
    for fd in fds:
        os.fsync(fd)


def _sync_dirs(dirs: list[str]) -> None:
    """Make the names in ``dirs`` (on one file system) durable: one ``syncfs``, or else an fsync each."""
    if _SYNCFS is not None:
        fd = os.open(dirs[0], os.O_RDONLY)
        try:
            if _SYNCFS(fd) == 0:
                return
        finally:
            os.close(fd)
    for d in dirs:
        _fsync_dir(d)


# ASCII: one character is one UTF-8 byte, so one str.translate escapes the key (issue 68: a generator step
# and a chr() a byte were ~90 Python calls a spill file, for every write and delete)
_ASCII_ESCAPES = str.maketrans({chr(b): f"%{b:02X}" for b in range(128) if b not in _SAFE})


def escape_key(key: str) -> str:
    """The file-name-safe form of ``key`` (prefix preserving: escape(a + b) == escape(a) + escape(b))."""
    if not isinstance(key, str):
        raise TypeError("keys are str")
    if key.isascii():
        return key.translate(_ASCII_ESCAPES)
    return "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in key.encode("utf-8"))


def unescape_key(name: str) -> str:
    out = bytearray()
    i = 0
    while i < len(name):
        if name[i] == "%":
            out.append(int(name[i + 1:i + 3], 16))
            i += 3
        else:
            out.append(ord(name[i]))
            i += 1
    return out.decode("utf-8")


class DiskTier(Tier):
    """Entries as files under ``root`` (created on first write).

    Args:
        root: the directory that holds the entries (one file each; created with its parents on first
            write). Two stores, in one process or several, may share it.
        name: the tier's name in the store's stats and confirmations (unique within a store).
        fsync: fsync every file and directory it writes (default), so an entry that ``put`` returned
            from survives a power cut; ``False`` trades that for speed.
        read_threads: threads that read the files of one ``get_many`` in parallel.
    """

    durable = True
    shared_across_processes = True
    supports_lease = True

    def __init__(self, root: str | os.PathLike, *, name: str = "disk", fsync: bool = True, read_threads: int = 4):
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"DiskTier's root is a directory path (str or Path), got {type(root).__name__}")
        if not os.fspath(root):  # "" would be the working directory
            raise ValueError("DiskTier's root is empty; name a directory, e.g. DiskTier(\"runs/kv\")")
        self.name = name
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = fsync
        self.read_threads = max(1, int(read_threads))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._leases: dict[str, tuple[str, int, str]] = {}  # name -> (token, fd holding the flock, its path)

    def _make_dirs(self, d: str) -> None:
        """``os.makedirs``, fsyncing each new directory's parent so the new name is durable."""
        if os.path.isdir(d):
            return
        parent = os.path.dirname(d)
        if parent != d:
            self._make_dirs(parent)
        try:
            os.mkdir(d)
        except FileExistsError:
            return
        if self.fsync:
            _fsync_dir(parent)

    def path_for(self, key: str) -> str:
        esc = escape_key(key)
        parts = [esc[i:i + _SEGMENT] for i in range(0, len(esc), _SEGMENT)] or [""]
        dirs = [p + _DIR_SUFFIX for p in parts[:-1]]
        return os.path.join(self.root, *dirs, parts[-1] + _FILE_SUFFIX)

    def put(self, key: str, data) -> None:
        path = self.path_for(key)
        d = os.path.dirname(path)
        self._make_dirs(d)
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=d)
        try:
            mv = memoryview(data).cast("B")
            done = 0
            while done < len(mv):
                done += os.write(fd, mv[done:])
            if self.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if self.fsync:
            _fsync_dir(d)

    def put_many(self, items: Iterable[tuple[str, object]]) -> list:
        """``put`` of a batch, as one group commit (see the module docstring): ``None`` or the exception
        in each item's place."""
        items = list(items)
        if not self.fsync or len(items) < 2:
            return super().put_many(items)
        out: list = [None] * len(items)
        staged = []  # (index in items, fd, temporary path, final path)
        for n, (key, data) in enumerate(items):
            fd = -1
            try:
                path = self.path_for(key)
                self._make_dirs(os.path.dirname(path))
                fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=os.path.dirname(path))
                mv = memoryview(data).cast("B")
                done = 0
                while done < len(mv):
                    done += os.write(fd, mv[done:])
                staged.append((n, fd, tmp, path))
            except Exception as e:  # noqa: BLE001 - this item fails, the batch goes on
                out[n] = e
                if fd >= 0:
                    os.close(fd)
                    _unlink_quietly(tmp)
        try:
            if staged:
                _sync_files([fd for _, fd, _, _ in staged])
        except OSError:  # which file failed is not known: fsync each, and fail only those that fail
            for n, fd, _, _ in staged:
                try:
                    os.fsync(fd)
                except OSError as e:
                    out[n] = e
        for n, fd, tmp, path in staged:
            os.close(fd)
            if out[n] is None:
                try:
                    os.replace(tmp, path)
                    continue
                except OSError as e:
                    out[n] = e
            _unlink_quietly(tmp)
        renamed = {os.path.dirname(path) for n, _, _, path in staged if out[n] is None}
        if renamed:
            _sync_dirs(sorted(renamed))
        return out

    def get(self, key: str) -> bytearray | None:
        try:
            f = open(self.path_for(key), "rb", buffering=0)
        except FileNotFoundError:
            return None
        with f:
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)
            mv = memoryview(buf)
            got = 0
            while got < size:
                n = f.readinto(mv[got:])
                if not n:
                    break
                got += n
        return buf if got == size else buf[:got]

    def get_many(self, keys: Iterable[str]) -> list:
        keys = list(keys)
        if len(keys) <= 1 or self.read_threads == 1:
            return super().get_many(keys)
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix=f"pace-{self.name}-read")
            pool = self._pool
        try:
            parts = pool.map(super().get_many, [[k] for k in keys])
        except RuntimeError:  # the pool is shut down (the tier closing, or the interpreter exiting under a
            return super().get_many(keys)  # prefetch still queued): read in this thread, never fail the read
        return [x for part in parts for x in part]

    def delete(self, key: str) -> None:
        try:
            os.unlink(self.path_for(key))
        except FileNotFoundError:
            pass

    def _walk(self):
        """(escaped key, path) of every entry file under the root."""
        if not os.path.isdir(self.root):
            return
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            levels = [] if rel == "." else rel.split(os.sep)
            if not all(p.endswith(_DIR_SUFFIX) for p in levels):
                dirnames[:] = []
                continue
            dirnames[:] = [n for n in dirnames if n.endswith(_DIR_SUFFIX)]
            stem = "".join(p[:-len(_DIR_SUFFIX)] for p in levels)
            for fn in filenames:
                if fn.endswith(_FILE_SUFFIX) and not fn.startswith(_TMP_PREFIX):
                    yield stem + fn[:-len(_FILE_SUFFIX)], os.path.join(dirpath, fn)

    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        ep = escape_key(prefix)
        for k, path in self._walk():
            if k.startswith(ep):
                try:
                    yield unescape_key(k), os.stat(path).st_size
                except FileNotFoundError:  # deleted meanwhile
                    continue

    def delete_prefix(self, prefix: str) -> int:
        ep = escape_key(prefix)
        n = 0
        for k, path in list(self._walk()):
            if k.startswith(ep):
                try:
                    os.unlink(path)
                    n += 1
                except FileNotFoundError:
                    pass
        # drop the (now possibly empty) split-name levels, deepest first
        if os.path.isdir(self.root):
            for dirpath, _dirs, _files in sorted(os.walk(self.root), key=lambda w: -len(w[0])):
                if dirpath != self.root and dirpath.endswith(_DIR_SUFFIX):
                    try:
                        os.rmdir(dirpath)
                    except OSError:
                        pass
        return n

    def acquire_lease(self, name: str, token: str, ttl_s: float) -> bool:
        """An exclusive flock on the lease's file (see the module docstring); ``ttl_s`` is not needed."""
        if name in self._leases:
            return self._leases[name][0] == token
        path = self.path_for(name)[:-len(_FILE_SUFFIX)] + _LOCK_SUFFIX
        self._make_dirs(os.path.dirname(path))
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                mine = os.fstat(fd)
                try:
                    now = os.stat(path)
                    if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                        break
                except FileNotFoundError:
                    pass
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # the holder released (and unlinked) the file we opened: lock the one there now
        self._leases[name] = (token, fd, path)
        return True

    def renew_lease(self, name: str, token: str, ttl_s: float) -> bool:
        return self._leases.get(name, (None,))[0] == token

    def release_lease(self, name: str, token: str) -> None:
        held = self._leases.get(name)
        if held is not None and held[0] == token:
            del self._leases[name]
            try:  # unlinked while still locked: a taker that opened it retries on a new file
                os.unlink(held[2])
            except FileNotFoundError:
                pass
            os.close(held[1])  # closing the only descriptor drops the flock

    def close(self) -> None:
        for name, (token, *_held) in list(self._leases.items()):
            self.release_lease(name, token)
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
