"""TieredStore: verified entries over a stack of tiers, written in the background, read in order.

Reads. ``get`` tries the pending writes, then each healthy tier in order. Every value is verified
(``entry.decode``: format version, checksum, fingerprint, session, key, tensor bounds) on every read. A
value that fails is a miss for that tier: counted in ``integrity_failures``, logged once per tier and kind
(``logging.getLogger("pace_hf.tiers")``), and the next tier is tried; ``strict=True`` raises
``IntegrityError`` instead. A hit below the top is promoted to the tiers above (the host synchronously,
the others through the writer). ``get_many`` reads each tier once for all remaining keys: a Valkey
pipeline, a thread pool for the disk. ``get(..., tiers=[name])`` reads only what those tiers hold (a
save reads its session's manifest from the first durable tier, never from a host copy that may be stale).
``get(..., damaged={})`` also says which misses were entries that failed verification, and why: a caller
that must tell a damaged entry from an absent one (a save's manifest) reads that, never the counters.

Tiers are ``Tier`` subclasses (``base``), and the store reads their capabilities, never their class:
``evicts`` (a byte-capped cache whose pushed-out entries are demoted), ``in_process`` (promoted into
inline), ``durable`` (what a save must reach), ``supports_lease``; ``set_default_timeout`` hands a tier
the store's request timeout unless it was given its own.

The rest is in modules of its own: ``writer`` (the background writer: writes, backpressure, demotion,
confirmations), ``health`` (a failing tier backs off), ``keys`` (a session's namespace), ``lease`` (one
writer per session).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import torch

from . import entry as _entry
from .base import Tier, check_number
from .errors import IntegrityError, TierError
from .health import TierHealth
from .keys import KEY_PREFIX, full_key, generation_of, generation_order, split_key
from .lease import Lease
from .writer import Writer, finish_running_writers

log = logging.getLogger("pace_hf.tiers")

_STORE_KEYS = ("puts", "gets", "pending", "failures")


_OPEN: "weakref.WeakSet[TieredStore]" = weakref.WeakSet()


def _close_open_stores() -> None:
    """At interpreter exit, close every store still open, then finish the writers of stores dropped
    unclosed (a script that returns from ``main`` drops its cache and store; their writer thread runs on):
    queued writes land, and every writer thread stops before the runtime is torn down under it (a daemon
    thread inside a tensor copy at that moment aborts the process with SIGABRT: 'terminate called without
    an active exception')."""
    for store in list(_OPEN):
        try:
            store.close(timeout_s=30)
        except Exception as e:  # noqa: BLE001 - exiting: report, never raise
            log.warning("pace_hf.tiers: closing a store at exit failed: %s", e)
    finish_running_writers(timeout_s=30)


# atexit, not threading's earlier hook: the program's own non-daemon threads have finished with their
# stores by then, and daemon threads still run (the writer among them) until the runtime goes.
atexit.register(_close_open_stores)


class TieredStore:
    """Verified KV entries over a stack of tiers, written in the background, read top first.

    Args:
        tiers: ``Tier`` objects, fastest first (e.g. ``[HostTier(), DiskTier("runs/kv"), ValkeyTier(url)]``);
            names must be unique.
        timeout_s: the most one request may cost: a tier that does not answer within it (and has no
            timeout of its own) is marked unhealthy and skipped while it backs off; a ``put`` that finds
            the write queue full gives up once the writer has spent this long per entry of its batch
            without finishing it (see ``pace_hf.tiers.writer``).
        strict: raise ``TierError`` (or ``IntegrityError``) where a lenient store counts the failure,
            logs it once and carries on.
        queue_size: writes queued for the background writer before ``put`` waits (backpressure).
        write_policy: ``"through"`` writes every entry to every tier (durable at ``flush``); ``"top"``
            writes the first tier only, the others get entries when it pushes them out.
        promote: copy a hit from a lower tier into the tiers above it.
        backoff_s, max_backoff_s: an unhealthy tier is retried after ``backoff_s``, doubling up to
            ``max_backoff_s``.

    See the docstrings of the modules ``store`` (reads), ``writer`` (writes, backpressure, demotion,
    confirmations), ``health``, ``keys`` and ``lease``.
    """

    def __init__(self, tiers: Sequence[Tier], *, timeout_s: float = 2.0, strict: bool = False,
                 queue_size: int = 64, write_policy: str = "through", promote: bool = True,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0):
        if isinstance(tiers, (Tier, str)):
            raise TypeError(f"tiers is a list of Tier objects, e.g. TieredStore([DiskTier(\"runs/kv\")]); got one "
                            f"{type(tiers).__name__} (a spec string such as 'disk:runs/kv' goes to parse_store)")
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        wrong = [type(t).__name__ for t in tiers if not isinstance(t, Tier)]
        if wrong:
            raise TypeError(f"tiers must be pace_hf.tiers.Tier objects (HostTier, DiskTier, ValkeyTier or a "
                            f"subclass of Tier), got {wrong}")
        if write_policy not in ("through", "top"):
            raise ValueError("write_policy is 'through' or 'top'")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names} (pass name=...)")
        if set(names) & set(_STORE_KEYS):
            raise ValueError(f"tier names must not be one of {_STORE_KEYS}")
        check_number(backoff_s, "backoff_s")
        check_number(max_backoff_s, "max_backoff_s")
        self.tiers = list(tiers)
        self.timeout_s = check_number(timeout_s, "timeout_s", above=True)
        self.strict = strict
        self.queue_size = max(1, int(queue_size))
        self.write_policy = write_policy
        self.promote = promote
        for t in self.tiers:  # tiers with a request timeout take the store's unless given their own
            t.set_default_timeout(self.timeout_s)
        self._health = TierHealth(names, strict=strict, backoff_s=backoff_s, max_backoff_s=max_backoff_s)
        self._lock = threading.Lock()  # gets
        self._gets = 0
        self._unreleased: dict[tuple[str, str], str] = {}  # leases a tier failed to release (see Lease)
        self._prefetch_pool = ThreadPoolExecutor(2, thread_name_prefix="pace-tier-prefetch")
        self._writer = Writer(self.tiers, self._health, timeout_s=self.timeout_s, queue_size=self.queue_size,
                              write_policy=write_policy)
        _OPEN.add(self)
        # dropped unclosed: the writer lands what is queued, then its thread ends (it would wait forever)
        self._dropped = weakref.finalize(self, self._writer.stop)
        self._dropped.atexit = False  # at exit, _close_open_stores flushes and joins it

    # -- public API --------------------------------------------------------------------------------
    def put(self, key: str, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None = None, *,
            fingerprint: str, session_id: str, through: bool = False) -> Future:
        """Queue ``tensors`` + ``meta`` under ``key`` for the background writer (see ``writer``).
        Returns the write's confirmation: a future of ``{tier name: None if written, else why not}``."""
        self._health.raise_async()
        fk = full_key(key, session_id)
        return self._writer.put(fk, key, tensors, meta, fingerprint, session_id, through)

    def get(self, key: str, *, fingerprint: str, session_id: str, tiers: Sequence[str] | None = None,
            damaged: dict | None = None) -> tuple[dict[str, torch.Tensor], dict] | None:
        """The verified ``(tensors, meta)`` under ``key``, or ``None`` (see module docstring)."""
        return self.get_many([key], fingerprint=fingerprint, session_id=session_id, tiers=tiers, damaged=damaged)[0]

    def get_many(self, keys: Sequence[str], *, fingerprint: str, session_id: str,
                 tiers: Sequence[str] | None = None, damaged: dict | None = None) -> list:
        """``get`` for many keys; each tier is read once for all keys it still has to answer. ``tiers``
        (names): read only those, and not the pending writes (what a tier itself holds). ``damaged``: a
        dict that gets ``{key: (tier name, IntegrityError)}`` for each entry a tier held but that failed
        verification (a lenient store's ``None`` does not tell it from a missing entry)."""
        fks = [full_key(k, session_id) for k in keys]
        if tiers is not None:
            return self._read_tiers(fks, [i for i, t in enumerate(self.tiers) if t.name in tiers],
                                    list(range(len(fks))), [None] * len(fks), fingerprint, session_id,
                                    damaged, keys)
        with self._lock:
            self._gets += len(fks)
        out: list = [None] * len(fks)
        todo = []
        for i, fk in enumerate(fks):
            item, dem, deleting = self._writer.lookup(fk)
            if item is None and deleting:
                continue
            if item is not None:
                if item.fingerprint == fingerprint:
                    out[i] = (dict(item.tensors), dict(item.meta))
                    continue
                self._health.integrity("pending", IntegrityError("foreign", f"pending write of {fk!r} has "
                                                                               "another fingerprint"))
                continue
            if dem is not None:
                try:
                    out[i] = _entry.decode(dem, key=fk, fingerprint=fingerprint, session_id=session_id)
                    continue
                except IntegrityError as e:
                    self._health.integrity("host", e)
            todo.append(i)
        return self._read_tiers(fks, range(len(self.tiers)), todo, out, fingerprint, session_id, damaged, keys)

    def _read_tiers(self, fks, tier_indices, todo, out, fingerprint, session_id, damaged=None, keys=()) -> list:
        """Fill ``out[i]`` for each ``i`` in ``todo`` from the tiers at ``tier_indices``, in order."""
        for ti in tier_indices:
            tier = self.tiers[ti]
            if not todo:
                break
            name = tier.name
            if not self._health.usable(name):
                self._health.add(name, "skipped", len(todo))
                continue
            t0 = time.perf_counter()
            try:
                datas = tier.get_many([fks[i] for i in todo])
            except Exception as e:  # noqa: BLE001 - every backend failure is classified and counted
                self._health.failed(name, e, "read")
                continue
            self._health.ok(name)
            self._health.add(name, "read_seconds", time.perf_counter() - t0)
            still = []
            for i, data in zip(todo, datas):
                if isinstance(data, Exception):
                    self._health.failed(name, data, "read")
                    still.append(i)
                    continue
                if data is None:
                    self._health.add(name, "misses", 1)
                    still.append(i)
                    continue
                try:
                    t1 = time.perf_counter()
                    snapshot = bytes(data) if (self.promote and ti > 0 and not memoryview(data).readonly) else data
                    out[i] = _entry.decode(data, key=fks[i], fingerprint=fingerprint, session_id=session_id)
                    self._health.add(name, "read_seconds", time.perf_counter() - t1)
                except IntegrityError as e:
                    if damaged is not None:
                        damaged.setdefault(keys[i], (name, e))
                    self._health.integrity(name, e)
                    still.append(i)
                    continue
                self._health.add(name, "hits", 1)
                self._health.add(name, "bytes_read", len(data))
                if self.promote and ti > 0:
                    self._writer.promote(ti, fks[i], snapshot)
            todo = still
        return out

    def prefetch(self, keys: Sequence[str], *, fingerprint: str, session_id: str) -> Future:
        """Fetch ``keys`` in the background; the future's result is what ``get_many`` returns."""
        return self._prefetch_pool.submit(self.get_many, list(keys), fingerprint=fingerprint,
                                          session_id=session_id)

    def delete(self, key: str, *, session_id: str | None = None, background: bool = False) -> None:
        """Delete one entry everywhere. With ``session_id``, ``key`` is a caller key of that session;
        without it, ``key`` is a full key (``full_key(...)``). With ``background``, the tiers outside this
        process delete it on the writer thread (``Writer.delete_later``) and reads miss it at once: for
        the entries a session retires by the hundred (spill versions, a replaced save's), whose unlinks
        would otherwise hold up the turn."""
        fk = full_key(key, session_id) if session_id is not None else key
        self._writer.cancel(lambda k: k == fk)
        later = []
        for i, tier in enumerate(self.tiers):
            if background and not tier.in_process:
                later.append(i)
            else:
                self._health.call(tier, "delete", fk)
        if later:
            self._writer.delete_later(fk, later)

    def delete_prefix(self, prefix: str, *, session_id: str | None = None) -> None:
        """Delete every entry whose key starts with ``prefix`` (a caller-key prefix within ``session_id``
        when given, else a full-key prefix)."""
        fp = full_key(prefix, session_id) if session_id is not None else prefix
        self._writer.cancel(lambda k: k.startswith(fp))
        for tier in self.tiers:
            self._health.call(tier, "delete_prefix", fp)

    def delete_session(self, session_id: str) -> None:
        """Drop every entry of ``session_id``."""
        self.delete_prefix("", session_id=session_id)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued write (and demotion/promotion) is done. Raises TierError on timeout
        (and, in strict mode, for a writer failure since the last check)."""
        self._writer.flush(timeout_s)
        self._health.raise_async()

    def close(self, timeout_s: float | None = None) -> None:
        """Flush, stop the writer and close the tiers. Idempotent."""
        if self._writer.closed:
            return
        self._dropped.detach()
        try:
            self.flush(timeout_s)
        except TierError:
            if self.strict:
                raise
        finally:
            self._writer.close()
            self._prefetch_pool.shutdown(wait=True)
            for t in self.tiers:
                try:
                    t.close()
                except Exception:  # noqa: BLE001
                    pass

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def stats(self) -> dict:
        """Per tier name: byte/hit/miss/error counters and seconds; plus puts, gets, pending, failures."""
        out: dict[str, Any] = self._health.stats()
        writer = self._writer.stats()
        with self._lock:
            out.update(puts=writer["puts"], gets=self._gets, failures=writer["failures"])
        out["pending"] = writer["pending"]
        return out

    @property
    def durable_tiers(self) -> list[str]:
        """The tiers that outlive this process (all but host memory; every tier if there is no other):
        a save is durable once its entries are written to each of them."""
        durable = [t.name for t in self.tiers if t.durable]
        return durable or [t.name for t in self.tiers]

    def lease(self, session_id: str, *, ttl_s: float = 60.0) -> Lease:
        """Take ``session_id``'s writer lease on every tier that keeps leases (``acquire_lease``); raises
        ``LeaseHeld`` naming the tier where another writer holds it. Use as a context manager."""
        return Lease([t for t in self.tiers if t.supports_lease], full_key("lease", session_id), ttl_s,
                     self._unreleased, lambda name: self._health.add(name, "errors", 1))

    def scan(self, session_id: str | None = None):
        """``(session_id, tier name, key, stored bytes)`` of every entry the tiers hold, of one session
        or of all (what is written: pending writes are not there yet; leases are not entries). Raises
        ``TierUnavailable`` when a tier cannot be listed."""
        prefix = f"{KEY_PREFIX}:" if session_id is None else full_key("", session_id)
        for tier in self.tiers:
            for fk, nbytes in tier.scan(prefix):
                parts = split_key(fk)
                if parts is not None and parts[1] != "lease":
                    yield parts[0], tier.name, parts[1], nbytes

    def usage(self, session_id: str | None = None) -> dict[str, dict[str, dict]]:
        """The size report: ``{session_id: {tier name: {"entries", "bytes", "generations"}}}``, largest
        session first. ``generations`` are the save generations found in the keys (``persist``); a
        session keeps one, more are what crashed saves left (the next save deletes them). Spill entries
        (evicted KV, the bulk of a long session) belong to no generation (``pace_hf.memory.spill`` says what
        bounds them). A session's entries go with ``delete_session`` (``python -m pace_hf.memory delete``)
        or expire with ``ValkeyTier(ttl_s=...)``."""
        out: dict[str, dict[str, dict]] = {}
        for sid, tier, key, nbytes in self.scan(session_id):
            row = out.setdefault(sid, {}).setdefault(tier, {"entries": 0, "bytes": 0, "generations": set()})
            row["entries"] += 1
            row["bytes"] += nbytes
            if (gen := generation_of(key)) is not None:
                row["generations"].add(gen)
        for tiers in out.values():
            for row in tiers.values():
                row["generations"] = sorted(row["generations"], key=generation_order)
        return dict(sorted(out.items(), key=lambda kv: -max(r["bytes"] for r in kv[1].values())))

    def healthy(self, tier_name: str) -> bool:
        """Whether ``tier_name`` is in use now (False while it backs off after a failure)."""
        return self._health.healthy(tier_name)
