"""HostTier: encoded entries in process memory, an LRU with a byte cap.

It holds the *encoded* entry (header + checksum + payload), not tensors, so a host hit is verified like
any other read and the store has one code path for every tier. A get returns a read-only view; decoding
copies it once, so a caller that modifies restored tensors never modifies the stored value.

Entries pushed out by the byte cap are returned from ``put`` (with whether they are "clean", i.e. known
to be stored in a lower tier already); the store writes the dirty ones down to the next tier (demotion)
and counts the rest as evicted only when there is no next tier. An entry larger than the whole cap is
not kept at all and comes straight back as pushed out.

Leases live in a table of this tier: they exclude writers within the process that shares it (host memory
is not shared across processes, so there is nothing further to exclude).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterator

from .base import Tier, check_number


class HostTier(Tier):
    """An in-memory LRU of encoded entries, at most ``max_bytes`` in total.

    Args:
        max_bytes: the byte cap over all encoded entries (default 4 GiB); the least recently used are
            pushed out beyond it (and demoted by the store to the next tier).
        name: the tier's name in the store's stats and confirmations (unique within a store).
    """

    durable = False  # gone with the process: never what makes a save durable
    shared_across_processes = False
    in_process = True
    evicts = True
    supports_lease = True  # within this process, which is all that shares it

    def __init__(self, max_bytes: int = 4 << 30, *, name: str = "host"):
        self.name = name
        self.max_bytes = int(check_number(max_bytes, "HostTier max_bytes"))
        self._entries: OrderedDict[str, tuple[bytes | bytearray, bool]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._leases: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        with self._lock:
            found = [(k, len(d)) for k, (d, _clean) in self._entries.items() if k.startswith(prefix)]
        return iter(found)

    def put(self, key: str, data, *, clean: bool = False) -> list[tuple[str, bytes | bytearray, bool]]:
        """Store ``data``; return the entries pushed out by the cap as ``(key, data, clean)``.

        ``data`` must not be modified afterwards (the store never does).
        """
        pushed = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old[0])
            if len(data) > self.max_bytes:
                return [(key, data, clean)]
            self._entries[key] = (data, clean)
            self._bytes += len(data)
            while self._bytes > self.max_bytes:
                k, (d, c) = self._entries.popitem(last=False)
                self._bytes -= len(d)
                pushed.append((k, d, c))
        return pushed

    def mark_clean(self, key: str, data) -> None:
        """Record that ``data`` (the value now under ``key``, if still the same) is stored below."""
        with self._lock:
            cur = self._entries.get(key)
            if cur is not None and cur[0] is data:
                self._entries[key] = (data, True)

    def get(self, key: str):
        with self._lock:
            item = self._entries.get(key)
            if item is None:
                return None
            self._entries.move_to_end(key)
            return memoryview(item[0]).toreadonly()

    def delete(self, key: str) -> None:
        with self._lock:
            item = self._entries.pop(key, None)
            if item is not None:
                self._bytes -= len(item[0])

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            doomed = [k for k in self._entries if k.startswith(prefix)]
            for k in doomed:
                self._bytes -= len(self._entries.pop(k)[0])
        return len(doomed)

    def acquire_lease(self, name: str, token: str, ttl_s: float) -> bool:
        with self._lock:
            return self._leases.setdefault(name, token) == token

    def renew_lease(self, name: str, token: str, ttl_s: float) -> bool:
        with self._lock:
            return self._leases.get(name) == token

    def release_lease(self, name: str, token: str) -> None:
        with self._lock:
            if self._leases.get(name) == token:
                del self._leases[name]

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
