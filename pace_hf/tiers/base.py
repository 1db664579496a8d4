"""Tier: what a backend implements for the store, and what it says about itself.

A tier stores opaque, already encoded entries (``entry.encode``) under string keys; the store does the
verifying, the ordering, the health and the background writes. Five methods are required (``put``,
``get``, ``delete``, ``delete_prefix``, ``scan``); batched reads and writes (``get_many``,
``put_many``) default to the single operations and are overridden where a backend can do better (one
Valkey pipeline, a thread pool over files).

Capabilities, not types. The store never asks which class a tier is; it reads what the tier says it can
do (class attributes, so a subclass inherits them and a new backend declares its own):

- ``durable``: the entries outlive this process, so a save is durable once written here
  (``TieredStore.durable_tiers``).
- ``shared_across_processes``: another process (a resume, the cleanup command) sees the same entries
  and the same leases.
- ``in_process``: the entries live in this process's memory; reading or writing costs no I/O, so the
  store does it inline (a promotion lands before the next read) instead of on its writer thread.
- ``evicts``: a byte-capped cache. ``put(key, data, clean=...)`` returns the entries it pushed out, as
  ``(key, data, clean)``, and ``mark_clean(key, data)`` records that an entry is stored below; the store
  writes the dirty ones down (demotion). See ``HostTier``.
- ``supports_lease``: ``acquire_lease``/``renew_lease``/``release_lease`` exclude a second writer of a
  session among everyone this tier is shared with (``TieredStore.lease``).

Timeouts. A tier whose requests can hang takes the store's request timeout through
``set_default_timeout`` unless it was given its own; the others ignore it. A tier raises
``TierUnavailable`` when its backend is down or did not answer in time (the store backs off); any other
exception counts as an error of that one request.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from typing import Iterable, Iterator

from .errors import TierUnavailable


def check_number(value, what: str, *, minimum: float = 0, above: bool = False) -> float:
    """``value`` (a size or seconds) as a float, refusing strings, bools, NaN and values below ``minimum``
    (or at it, with ``above``): a wrong one would not fail where it is given but lose entries or hang later."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    if math.isnan(value) or value < minimum or (above and value == minimum):
        raise ValueError(f"{what} must be {'>' if above else '>='} {minimum}, got {value!r}")
    return float(value)


class Tier(ABC):
    """The base of every tier: the operations the store calls and the capabilities it reads.

    Subclasses set ``name`` (unique within a store) and the capability flags below, and implement
    ``put``, ``get``, ``delete``, ``delete_prefix`` and ``scan``.
    """

    name: str
    durable: bool = True
    shared_across_processes: bool = True
    in_process: bool = False
    evicts: bool = False
    supports_lease: bool = False

    @abstractmethod
    def put(self, key: str, data) -> None:
        """Store ``data`` (a bytes-like encoded entry) under ``key``, replacing what was there."""

    @abstractmethod
    def get(self, key: str):
        """The bytes stored under ``key``, or ``None`` when there are none."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` (nothing happens when it is absent)."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Remove every key that starts with ``prefix``; return how many entries went."""

    @abstractmethod
    def scan(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """``(key, stored bytes)`` of every entry whose key starts with ``prefix`` (for size reports and
        cleanup; any order)."""

    def get_many(self, keys: Iterable[str]) -> list:
        """``get`` for each key, in order. A per-key failure is returned in that key's place (the store
        counts it); ``TierUnavailable`` stops the batch, since every further key would wait as long."""
        out = []
        for key in keys:
            try:
                out.append(self.get(key))
            except TierUnavailable:
                raise
            except Exception as e:  # noqa: BLE001 - one bad read is that key's error, not the batch's
                out.append(e)
        return out

    def put_many(self, items: Iterable[tuple[str, object]]) -> list:
        """``put`` for each ``(key, data)``, in order; returns ``None`` (written) or the exception in
        each item's place. ``TierUnavailable`` stops the batch, as in ``get_many``."""
        out: list = []
        for key, data in items:
            try:
                self.put(key, data)
                out.append(None)
            except TierUnavailable:
                raise
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out

    def set_default_timeout(self, timeout_s: float) -> None:
        """The store's request timeout, for a tier that was not given its own (default: no requests
        that can hang, nothing to set)."""

    def acquire_lease(self, name: str, token: str, ttl_s: float) -> bool:
        """Take the lease ``name`` for ``token`` (True), or find another token holding it (False)."""
        raise NotImplementedError(f"tier {self.name} keeps no leases (supports_lease is False)")

    def renew_lease(self, name: str, token: str, ttl_s: float) -> bool:
        """Extend ``token``'s lease; False when it is not ``token``'s any more (it expired)."""
        raise NotImplementedError(f"tier {self.name} keeps no leases (supports_lease is False)")

    def release_lease(self, name: str, token: str) -> None:
        """Give ``token``'s lease back (nothing happens when another token holds it)."""
        raise NotImplementedError(f"tier {self.name} keeps no leases (supports_lease is False)")

    def close(self) -> None:
        """Release connections, files and leases (the store calls it once, on close)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
