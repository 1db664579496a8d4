"""Tier health: which tiers are in use, what each request to them cost, and failures, each logged once.

A tier that raises ``TierUnavailable`` (down, or no answer within the timeout) is marked
unhealthy and skipped until a retry time: 1 s after the first failure, doubling up to 30 s. The first
request after that time is the probe; if it succeeds, the tier is healthy again. Other errors (a disk
that is full or read-only) are counted per request and do not disable reads.

Every request to a tier reports here: ``usable`` before it, ``ok`` or ``failed`` after it, ``add`` for
its counters (``TieredStore.stats``). In strict mode ``failed`` raises the failure, or, for the background
writer (``defer=True``), keeps it for the next ``put`` or ``flush`` to raise (``raise_async``). Its own
module because the store's reads and its writer both report here, and neither needs the other to do so.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

from .errors import IntegrityError, TierError, TierUnavailable

log = logging.getLogger("pace_hf.tiers")

_TIER_COUNTERS = ("bytes_written", "bytes_read", "hits", "misses", "integrity_failures", "errors",
                  "write_seconds", "read_seconds", "evicted", "demoted", "promoted", "skipped")


class _TierState:
    def __init__(self, backoff_s: float):
        self.stats: dict[str, float | int] = {k: (0.0 if k.endswith("seconds") else 0) for k in _TIER_COUNTERS}
        self.healthy = True
        self.retry_at = 0.0
        self.backoff_s = backoff_s
        self.last_error: str | None = None


class TierHealth:
    """Health, backoff and counters of a store's tiers, its once-only warnings and its deferred errors.

    Args:
        names: the tier names.
        strict: raise failures (``TierError``, ``IntegrityError``) instead of counting them and carrying on.
        backoff_s, max_backoff_s: an unavailable tier is retried after ``backoff_s``, doubling up to
            ``max_backoff_s``.
    """

    def __init__(self, names: Sequence[str], *, strict: bool, backoff_s: float, max_backoff_s: float):
        self.strict = strict
        self._backoff0, self._backoff_max = float(backoff_s), float(max_backoff_s)
        self._state = {name: _TierState(self._backoff0) for name in names}
        self._lock = threading.Lock()  # stats, health, log-once set, the deferred error
        self._logged: set[tuple[str, str]] = set()
        self._async_error: TierError | None = None

    def stats(self) -> dict[str, dict]:
        """Per tier name: its counters and whether it is healthy."""
        with self._lock:
            return {name: dict(st.stats, healthy=st.healthy) for name, st in self._state.items()}

    def healthy(self, name: str) -> bool:
        """Whether tier ``name`` is in use now (False while it backs off after a failure)."""
        with self._lock:
            return self._state[name].healthy

    def last_error(self, name: str) -> str | None:
        """Why tier ``name`` last failed."""
        with self._lock:
            return self._state[name].last_error

    def call(self, tier, op: str, *args, defer: bool = False) -> None:
        """``tier.op(*args)``, skipped while the tier backs off, its failure recorded (``failed``)."""
        if not self.usable(tier.name):
            self.add(tier.name, "skipped", 1)
            return
        try:
            getattr(tier, op)(*args)
        except Exception as e:  # noqa: BLE001
            self.failed(tier.name, e, op, defer=defer)
            return
        self.ok(tier.name)

    def usable(self, name: str) -> bool:
        """Whether a request may go to tier ``name``: it is healthy, or its retry time has come (the probe)."""
        with self._lock:
            st = self._state[name]
            return st.healthy or time.monotonic() >= st.retry_at

    def ok(self, name: str) -> None:
        """A request to ``name`` succeeded: a tier that was backing off is healthy again."""
        with self._lock:
            st = self._state[name]
            if st.healthy:
                return
            st.healthy, st.backoff_s, st.retry_at = True, self._backoff0, 0.0
        log.warning("pace_hf.tiers: tier %s is back", name)

    def failed(self, name: str, e: BaseException, op: str, *, defer: bool = False) -> None:
        """A request to ``name`` failed: count it, log it once, back off if the tier is unavailable. In
        strict mode raise it, or with ``defer`` (the background writer) keep it for ``raise_async``."""
        unavailable = isinstance(e, TierUnavailable)
        with self._lock:
            st = self._state[name]
            st.stats["errors"] += 1
            st.last_error = f"{op}: {e!r}"[:500]
            if unavailable:
                st.healthy = False
                st.retry_at = time.monotonic() + st.backoff_s
                st.backoff_s = min(st.backoff_s * 2, self._backoff_max)
        self.log_once(name, "unavailable" if unavailable else f"{op}_error",
                      "tier %s %s failed: %r%s", name, op, e,
                      " (marked unhealthy, backing off)" if unavailable else "")
        if self.strict:
            err = e if isinstance(e, TierError) else TierError(f"tier {name} {op} failed: {e!r}")
            if defer:
                self.async_fail(err)
            else:
                raise err from e

    def integrity(self, name: str, e: IntegrityError) -> None:
        """An entry read from ``name`` failed verification: a miss, counted and logged once (strict: raised)."""
        if name in self._state:
            self.add(name, "integrity_failures", 1)
        self.log_once(name, e.kind, "tier %s: %s entry is a miss (%s)", name, e.kind, e)
        if self.strict:
            raise e

    def add(self, name: str, counter: str, n) -> None:
        """Add ``n`` to tier ``name``'s ``counter``."""
        with self._lock:
            self._state[name].stats[counter] += n

    def log_once(self, name: str, kind: str, msg: str, *args) -> None:
        """Log a warning the first time ``(name, kind)`` happens."""
        with self._lock:
            if (name, kind) in self._logged:
                return
            self._logged.add((name, kind))
        log.warning(msg, *args)

    def async_fail(self, err: TierError) -> None:
        """Strict mode: keep ``err`` (the first one) for the next ``raise_async``."""
        if self.strict:
            with self._lock:
                if self._async_error is None:
                    self._async_error = err

    def raise_async(self) -> None:
        """Raise the error kept by ``async_fail``, if any."""
        with self._lock:
            err, self._async_error = self._async_error, None
        if err is not None:
            raise err

