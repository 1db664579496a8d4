"""TieredStore: verified entries over a stack of tiers, written in the background, read in order.

Writes. ``put`` does no I/O and no encoding: it records the tensors as *pending* (``get`` serves them from
there until they are written) and queues them for one background writer thread, which encodes the entry
(checksum included) and writes it. The writer takes up to ``WRITE_BATCH`` queued puts at once and hands
each tier that is not an evicting cache all of them in one ``put_many`` (Valkey: one transaction). With ``write_policy="through"`` (the default) the entry goes to every
tier, top first: the host copy serves fast reads, the lower copies make ``flush()`` a durable save point
(a session can resume in another process) and survive a failing tier. With ``"top"`` it goes to the
first tier only and reaches the others by demotion (cheaper, not durable until pushed out).

Backpressure, not dropping. The queue is bounded (``queue_size``). When it is full, ``put`` waits for
room -- a stalled forward is visible in timings, silently lost KV is not -- for as long as the writer
makes progress: each batch it takes from the queue (which frees room) gives it ``timeout_s`` per entry
of that batch to finish, so a slow but healthy tier (a slow disk, a big batch) loses nothing. Only when
the writer has made no progress for that long (a stalled or hung tier) is the put given up, counted in
``failures`` and logged (``strict=True`` raises ``TierError``). A tier that fails with a timeout is
marked unhealthy and skipped, so the queue drains and ``put`` stays non-blocking. Progress does not
always free room for *this* caller (other threads' puts may take it first; promotions and demotions go
before puts), so the wait is also capped at ``(queue_size + WRITE_BATCH) * timeout_s``: the time to
write everything that can be ahead of a put at the slowest rate that still counts as progress.

Reads. ``get`` tries the pending writes, then each healthy tier in order. Every value is verified
(``entry.decode``: format version, checksum, fingerprint, session, key, tensor bounds) on every read. A
value that fails is a miss for that tier: counted in ``integrity_failures``, logged once per tier and kind
(``logging.getLogger("pace_hf.tiers")``), and the next tier is tried; ``strict=True`` raises
``IntegrityError`` instead. A hit below the top is promoted to the tiers above (the host synchronously,
the others through the writer). ``get_many`` reads each tier once for all remaining keys: a Valkey
pipeline, a thread pool for the disk. ``get(..., tiers=[name])`` reads only what those tiers hold (a
save reads its session's manifest from the first durable tier, never from a host copy that may be stale).

Tiers are ``Tier`` subclasses (``base``), and the store reads their capabilities, never their class:
``evicts`` (a byte-capped cache whose pushed-out entries are demoted), ``in_process`` (promoted into
inline), ``durable`` (what a save must reach), ``supports_lease``; ``set_default_timeout`` hands a tier
the store's request timeout unless it was given its own.

Demotion. Entries pushed out of an evicting tier (``HostTier``) by its byte cap are written to the next tier(s) by the
writer (and stay readable until they are), unless they are known to be there already ("clean"); only
when there is no tier below are they dropped, counted as ``evicted``.

Health. A tier that raises ``TierUnavailable`` (down, or no answer within the timeout) is marked
unhealthy and skipped until a retry time: 1 s after the first failure, doubling up to 30 s. The first
request after that time is the probe; if it succeeds, the tier is healthy again. Other errors (a disk
that is full or read-only) are counted per request and do not disable reads.

Errors of the writer thread surface in strict mode as a ``TierError`` from the next ``put`` or ``flush``.

Confirmation. ``put`` returns a ``Future`` that resolves, once the writer is done with the entry, to
``{tier name: None if written, else why not}``: what a save needs to know that its entries reached every
durable tier (``durable_tiers``: every tier but host memory) before it writes the manifest that names them.
``put(..., through=True)`` writes to every tier whatever the write policy.

Keys are namespaced by session before a tier sees them (``keys``); ``lease`` is the session's writer lease.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import torch

from . import entry as _entry
from .base import Tier, check_number
from .errors import IntegrityError, TierError, TierUnavailable
from .health import _TierState
from .keys import KEY_PREFIX, _serial, full_key, generation_of, split_key
from .lease import Lease

log = logging.getLogger("pace_hf.tiers")

WRITE_BATCH = 16  # queued puts the writer takes at once
_STORE_KEYS = ("puts", "gets", "pending", "failures")


class _Write:
    __slots__ = ("fk", "key", "tensors", "meta", "fingerprint", "session_id", "cancelled", "through", "done")

    def __init__(self, fk, key, tensors, meta, fingerprint, session_id, through):
        self.fk, self.key, self.tensors, self.meta = fk, key, tensors, meta
        self.fingerprint, self.session_id = fingerprint, session_id
        self.cancelled, self.through = False, through
        self.done: Future = Future()  # {tier name: None if written, else why not}


_OPEN: "weakref.WeakSet[TieredStore]" = weakref.WeakSet()


def _close_open_stores() -> None:
    """At interpreter exit, close every store still open: its queued writes land, and its writer thread
    stops before the runtime is torn down under it (a daemon thread inside a tensor copy at that moment
    aborted the process with SIGABRT: 'terminate called without an active exception')."""
    for store in list(_OPEN):
        try:
            store.close(timeout_s=30)
        except Exception as e:  # noqa: BLE001 - exiting: report, never raise
            log.warning("pace_hf.tiers: closing a store at exit failed: %s", e)


atexit.register(_close_open_stores)  # runs while daemon threads still run, before the runtime goes


class TieredStore:
    """Verified KV entries over a stack of tiers, written in the background, read top first.

    Args:
        tiers: ``Tier`` objects, fastest first (e.g. ``[HostTier(), DiskTier("runs/kv"), ValkeyTier(url)]``);
            names must be unique.
        timeout_s: the most one request may cost: a tier that does not answer within it (and has no
            timeout of its own) is marked unhealthy and skipped while it backs off; a ``put`` that finds
            the write queue full gives up once the writer has spent this long per entry of its batch
            without finishing it (see the module docstring).
        strict: raise ``TierError`` (or ``IntegrityError``) where a lenient store counts the failure,
            logs it once and carries on.
        queue_size: writes queued for the background writer before ``put`` waits (backpressure).
        write_policy: ``"through"`` writes every entry to every tier (durable at ``flush``); ``"top"``
            writes the first tier only, the others get entries when it pushes them out.
        promote: copy a hit from a lower tier into the tiers above it.
        backoff_s, max_backoff_s: an unhealthy tier is retried after ``backoff_s``, doubling up to
            ``max_backoff_s``.

    See the module docstring for keys, reads, demotion, health, confirmations and leases.
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
        self._backoff0, self._backoff_max = float(backoff_s), float(max_backoff_s)
        for t in self.tiers:  # tiers with a request timeout take the store's unless given their own
            t.set_default_timeout(self.timeout_s)
        self._state = {t.name: _TierState(self._backoff0) for t in self.tiers}
        self._counts = {"puts": 0, "gets": 0, "failures": 0}
        self._lock = threading.Lock()  # stats, health, log-once set
        self._logged: set[tuple[str, str]] = set()
        self._unreleased: dict[tuple[str, str], str] = {}  # leases a tier failed to release (see Lease)
        self._cv = threading.Condition()  # queue, pending, demoting, inflight
        self._puts: deque[_Write] = deque()
        self._jobs: deque[tuple] = deque()
        self._pending: dict[str, _Write] = {}
        self._demoting: dict[str, Any] = {}
        self._inflight = 0
        self._stall_at = 0.0  # when the writer's work in hand, at timeout_s per entry, counts as stalled
        self._closed = False
        self._async_error: TierError | None = None
        self._prefetch_pool = ThreadPoolExecutor(2, thread_name_prefix="pace-tier-prefetch")
        self._writer = threading.Thread(target=self._write_loop, name="pace-tier-writer", daemon=True)
        self._writer.start()
        _OPEN.add(self)

    # -- public API --------------------------------------------------------------------------------
    def put(self, key: str, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None = None, *,
            fingerprint: str, session_id: str, through: bool = False) -> Future:
        """Queue ``tensors`` + ``meta`` under ``key`` for the background writer (see module docstring).
        Returns the write's confirmation: a future of ``{tier name: None if written, else why not}``."""
        self._raise_async()
        fk = full_key(key, session_id)
        tensors = {n: t.detach().contiguous().cpu() for n, t in tensors.items()}
        item = _Write(fk, key, tensors, dict(meta or {}), fingerprint, session_id, through)
        t0 = time.monotonic()
        cap = t0 + (self.queue_size + WRITE_BATCH) * self.timeout_s
        with self._cv:
            if self._closed:
                raise TierError("the store is closed")
            while len(self._puts) >= self.queue_size and not self._closed:
                # at least timeout_s of our own: _stall_at is stale if the writer has not woken yet
                left = min(cap, max(t0 + self.timeout_s, self._stall_at)) - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            if len(self._puts) >= self.queue_size:
                why = f"write queue full for {time.monotonic() - t0:.1f} s"
                with self._lock:
                    self._counts["failures"] += 1
                self._log_once("store", "queue_full", "%s; dropped a put (%s)", why, fk)
                if self.strict:
                    raise TierError(f"{why}; put {fk!r} not stored")
                item.done.set_result({t.name: why for t in self.tiers})
                return item.done
            self._pending[fk] = item
            self._puts.append(item)
            with self._lock:
                self._counts["puts"] += 1
            self._cv.notify_all()
        return item.done

    def get(self, key: str, *, fingerprint: str, session_id: str,
            tiers: Sequence[str] | None = None) -> tuple[dict[str, torch.Tensor], dict] | None:
        """The verified ``(tensors, meta)`` under ``key``, or ``None`` (see module docstring)."""
        return self.get_many([key], fingerprint=fingerprint, session_id=session_id, tiers=tiers)[0]

    def get_many(self, keys: Sequence[str], *, fingerprint: str, session_id: str,
                 tiers: Sequence[str] | None = None) -> list:
        """``get`` for many keys; each tier is read once for all keys it still has to answer. ``tiers``
        (names): read only those, and not the pending writes (what a tier itself holds)."""
        fks = [full_key(k, session_id) for k in keys]
        if tiers is not None:
            return self._read_tiers(fks, [i for i, t in enumerate(self.tiers) if t.name in tiers],
                                    list(range(len(fks))), [None] * len(fks), fingerprint, session_id)
        with self._lock:
            self._counts["gets"] += len(fks)
        out: list = [None] * len(fks)
        todo = []
        for i, fk in enumerate(fks):
            with self._cv:
                item = self._pending.get(fk)
                dem = self._demoting.get(fk)
            if item is not None:
                if item.fingerprint == fingerprint:
                    out[i] = (dict(item.tensors), dict(item.meta))
                    continue
                self._integrity("pending", IntegrityError("foreign", f"pending write of {fk!r} has "
                                                                       "another fingerprint"))
                continue
            if dem is not None:
                try:
                    out[i] = _entry.decode(dem, key=fk, fingerprint=fingerprint, session_id=session_id)
                    continue
                except IntegrityError as e:
                    self._integrity("host", e)
            todo.append(i)
        return self._read_tiers(fks, range(len(self.tiers)), todo, out, fingerprint, session_id)

    def _read_tiers(self, fks, tier_indices, todo, out, fingerprint, session_id) -> list:
        """Fill ``out[i]`` for each ``i`` in ``todo`` from the tiers at ``tier_indices``, in order."""
        for ti in tier_indices:
            tier = self.tiers[ti]
            if not todo:
                break
            name = tier.name
            if not self._usable(name):
                self._add(name, "skipped", len(todo))
                continue
            t0 = time.perf_counter()
            try:
                datas = tier.get_many([fks[i] for i in todo])
            except Exception as e:  # noqa: BLE001 - every backend failure is classified and counted
                self._tier_failed(name, e, "read")
                continue
            self._tier_ok(name)
            self._add(name, "read_seconds", time.perf_counter() - t0)
            still = []
            for i, data in zip(todo, datas):
                if isinstance(data, Exception):
                    self._tier_failed(name, data, "read")
                    still.append(i)
                    continue
                if data is None:
                    self._add(name, "misses", 1)
                    still.append(i)
                    continue
                try:
                    t1 = time.perf_counter()
                    snapshot = bytes(data) if (self.promote and ti > 0 and not memoryview(data).readonly) else data
                    out[i] = _entry.decode(data, key=fks[i], fingerprint=fingerprint, session_id=session_id)
                    self._add(name, "read_seconds", time.perf_counter() - t1)
                except IntegrityError as e:
                    self._integrity(name, e)
                    still.append(i)
                    continue
                self._add(name, "hits", 1)
                self._add(name, "bytes_read", len(data))
                if self.promote and ti > 0:
                    self._promote(ti, fks[i], snapshot)
            todo = still
        return out

    def prefetch(self, keys: Sequence[str], *, fingerprint: str, session_id: str) -> Future:
        """Fetch ``keys`` in the background; the future's result is what ``get_many`` returns."""
        return self._prefetch_pool.submit(self.get_many, list(keys), fingerprint=fingerprint,
                                          session_id=session_id)

    def delete(self, key: str, *, session_id: str | None = None) -> None:
        """Delete one entry everywhere. With ``session_id``, ``key`` is a caller key of that session;
        without it, ``key`` is a full key (``full_key(...)``)."""
        fk = full_key(key, session_id) if session_id is not None else key
        self._cancel(lambda k: k == fk)
        for tier in self.tiers:
            self._tier_call(tier, "delete", fk)

    def delete_prefix(self, prefix: str, *, session_id: str | None = None) -> None:
        """Delete every entry whose key starts with ``prefix`` (a caller-key prefix within ``session_id``
        when given, else a full-key prefix)."""
        fp = full_key(prefix, session_id) if session_id is not None else prefix
        self._cancel(lambda k: k.startswith(fp))
        for tier in self.tiers:
            self._tier_call(tier, "delete_prefix", fp)

    def delete_session(self, session_id: str) -> None:
        """Drop every entry of ``session_id``."""
        self.delete_prefix("", session_id=session_id)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued write (and demotion/promotion) is done. Raises TierError on timeout
        (and, in strict mode, for a writer failure since the last check)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self._puts or self._jobs or self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TierError(f"flush: {len(self._puts) + len(self._jobs) + self._inflight} writes "
                                    f"still queued after {timeout_s} s")
                self._cv.wait(left)
        self._raise_async()

    def close(self, timeout_s: float | None = None) -> None:
        """Flush, stop the writer and close the tiers. Idempotent."""
        if self._closed:
            return
        try:
            self.flush(timeout_s)
        except TierError:
            if self.strict:
                raise
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self._writer.join(timeout=5)
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
        with self._lock:
            out: dict[str, Any] = {name: dict(st.stats, healthy=st.healthy) for name, st in self._state.items()}
            out.update(self._counts)
        with self._cv:
            out["pending"] = len(self._pending)
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
                     self._unreleased, lambda name: self._add(name, "errors", 1))

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
                row["generations"] = sorted(row["generations"], key=_serial)
        return dict(sorted(out.items(), key=lambda kv: -max(r["bytes"] for r in kv[1].values())))

    def healthy(self, tier_name: str) -> bool:
        """Whether ``tier_name`` is in use now (False while it backs off after a failure)."""
        with self._lock:
            return self._state[tier_name].healthy

    # -- reading helpers ---------------------------------------------------------------------------
    def _promote(self, ti: int, fk: str, data) -> None:
        uppers = []
        for j in range(ti):
            t = self.tiers[j]
            if not self._usable(t.name):
                continue
            if t.in_process:
                pushed = self._put_into(t, fk, data, clean=True)
                self._add(t.name, "promoted", 1)
                self._queue_demotions(j, [p for p in pushed if p[0] != fk])
            else:
                uppers.append(j)
        if uppers:
            with self._cv:
                self._jobs.append(("promote", fk, data, uppers))
                self._cv.notify_all()

    # -- writer --------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._puts and not self._jobs and not self._closed:
                    self._cv.wait()
                if self._jobs:
                    job = self._jobs.popleft()
                elif self._puts:  # the queued puts, up to a batch: each tier gets them in one put_many
                    job = [self._puts.popleft() for _ in range(min(len(self._puts), WRITE_BATCH))]
                else:
                    return  # closed and drained
                self._inflight += 1
                self._stall_at = time.monotonic() + self.timeout_s * (len(job) if isinstance(job, list) else 1)
                self._cv.notify_all()  # room in the queue, and a later deadline for a waiting put
            try:
                if isinstance(job, list):
                    self._do_writes(job)
                elif job[0] == "demote":
                    self._do_demote(*job[1:])
                elif job[0] == "promote":
                    self._do_promote(*job[1:])
            except Exception as e:  # noqa: BLE001 - the writer must survive anything
                log.exception("pace_hf.tiers writer: unexpected error")
                self._async_fail(TierError(f"writer: {e!r}"))
            finally:
                with self._cv:
                    self._inflight -= 1
                    self._cv.notify_all()

    def _do_writes(self, items: list[_Write]) -> None:
        """Encode ``items`` and write them tier by tier: a tier that is not an evicting cache gets all
        of them in one ``put_many`` (one Valkey transaction instead of one per entry)."""
        outcomes: list[dict[str, str | None]] = [{} for _ in items]
        datas: list = [None] * len(items)
        wrote_host: list[int | None] = [None] * len(items)
        wrote_below = [False] * len(items)
        try:
            for n, item in enumerate(items):
                if item.cancelled:
                    continue
                try:
                    datas[n] = _entry.encode(item.tensors, item.meta, key=item.fk, fingerprint=item.fingerprint,
                                             session_id=item.session_id)
                except Exception as e:  # noqa: BLE001 - bad tensors/meta: the put fails, the store lives
                    with self._lock:
                        self._counts["failures"] += 1
                    self._log_once("store", "encode", "cannot encode %s: %r", item.fk, e)
                    self._async_fail(TierError(f"cannot encode {item.fk!r}: {e!r}"))
                    outcomes[n] = {t.name: f"cannot encode: {e!r}" for t in self.tiers}
            for j, tier in enumerate(self.tiers):
                group = [n for n, item in enumerate(items) if datas[n] is not None and not item.cancelled
                         and (j == 0 or self.write_policy == "through" or item.through)]
                if len(group) > 1 and not tier.evicts and self._usable(tier.name):
                    written = self._write_many_to(j, [(items[n], datas[n], outcomes[n]) for n in group])
                else:
                    written = [self._write_to(j, items[n].fk, datas[n], own=not items[n].through,
                                              outcome=outcomes[n]) for n in group]
                for n, ok in zip(group, written):
                    if ok and tier.evicts and wrote_host[n] is None:
                        wrote_host[n] = j
                    elif ok:
                        wrote_below[n] = True
            for n, item in enumerate(items):
                if datas[n] is None:
                    continue
                if wrote_host[n] is not None and wrote_below[n]:
                    self.tiers[wrote_host[n]].mark_clean(item.fk, datas[n])
                if (self.write_policy == "through" and wrote_host[n] is None and not wrote_below[n]
                        and not item.cancelled):
                    with self._lock:
                        self._counts["failures"] += 1
                    self._log_once("store", "lost", "%s could not be written to any tier", item.fk)
                    self._async_fail(TierError(f"{item.fk!r} could not be written to any tier"))
                if item.cancelled:
                    outcomes[n] = {}
                    for tier in self.tiers:
                        self._tier_call(tier, "delete", item.fk)
        finally:
            with self._cv:
                for item in items:
                    if self._pending.get(item.fk) is item:
                        del self._pending[item.fk]
                self._cv.notify_all()
            for item, outcome in zip(items, outcomes):
                for t in self.tiers:
                    outcome.setdefault(t.name, "not written (write policy 'top' or cancelled)")
                item.done.set_result(outcome)

    def _write_many_to(self, j: int, group: list) -> list[bool]:
        """``_write_to`` for many ``(item, data, outcome)`` at once, through ``put_many``. A failure of
        the whole batch (the tier is down) counts as one error, like the first of single writes would."""
        tier = self.tiers[j]
        name = tier.name
        t0 = time.perf_counter()
        try:
            errors = tier.put_many([(item.fk, data) for item, data, _ in group])
        except Exception as e:  # noqa: BLE001
            self._tier_failed(name, e, "write")
            self._add(name, "skipped", len(group) - 1)
            errors = [e] * len(group)
        else:
            self._add(name, "write_seconds", time.perf_counter() - t0)
            if any(err is None for err in errors):
                self._tier_ok(name)
            for err in errors:
                if err is not None:
                    self._tier_failed(name, err, "write")
        written = []
        for (item, data, outcome), err in zip(group, errors):
            if err is None:
                self._add(name, "bytes_written", len(data))
                outcome[name] = None
                written.append(True)
                continue
            outcome[name] = f"write failed: {err!r}"[:500]
            own = not item.through
            written.append(self._write_below(j, item.fk, data, outcome) if own and self.write_policy == "top"
                           else False)
        return written

    def _write_to(self, j: int, fk: str, data, *, own: bool = False, outcome: dict | None = None) -> bool:
        """Write ``data`` to tier ``j``; demote what a host tier pushes out. True if written. ``outcome``
        gets ``{tier name: None or why not}`` for every tier tried."""
        outcome = {} if outcome is None else outcome
        tier = self.tiers[j]
        name = tier.name
        if not self._usable(name):
            self._add(name, "skipped", 1)
            with self._lock:
                outcome[name] = f"skipped: unavailable since {self._state[name].last_error}"
            if own and self.write_policy == "top":
                return self._write_below(j, fk, data, outcome)
            return False
        t0 = time.perf_counter()
        try:
            pushed = self._put_into(tier, fk, data, clean=False)
        except Exception as e:  # noqa: BLE001
            outcome[name] = f"write failed: {e!r}"[:500]
            self._tier_failed(name, e, "write")
            if own and self.write_policy == "top":
                return self._write_below(j, fk, data, outcome)
            return False
        self._tier_ok(name)
        self._add(name, "write_seconds", time.perf_counter() - t0)
        if pushed:
            mine = [p for p in pushed if p[0] == fk]
            others = [p for p in pushed if p[0] != fk]
            self._queue_demotions(j, others)
            if mine:  # larger than the whole cap: not kept here
                outcome[name] = "not kept: larger than the tier's byte cap"
                if self.write_policy == "top":
                    return self._write_below(j, fk, data, outcome)
                return False
        self._add(name, "bytes_written", len(data))
        outcome[name] = None
        return True

    @staticmethod
    def _put_into(tier: Tier, fk: str, data, *, clean: bool) -> list:
        """``tier.put``; the entries an evicting tier pushed out (``[]`` for any other tier)."""
        if tier.evicts:
            return tier.put(fk, data, clean=clean)
        tier.put(fk, data)
        return []

    def _write_below(self, j: int, fk: str, data, outcome: dict | None = None) -> bool:
        for k in range(j + 1, len(self.tiers)):
            if self._write_to(k, fk, data, outcome=outcome):
                return True
        with self._lock:
            self._counts["failures"] += 1
        self._async_fail(TierError(f"{fk!r} could not be written to any tier"))
        return False

    def _queue_demotions(self, j: int, pushed: list) -> None:
        name = self.tiers[j].name
        for k, d, clean in pushed:
            if clean:
                continue  # already stored below
            if j + 1 >= len(self.tiers):
                self._add(name, "evicted", 1)
                continue
            self._add(name, "demoted", 1)
            with self._cv:
                self._demoting[k] = d
                self._jobs.append(("demote", k, d, j))
                self._cv.notify_all()

    def _do_demote(self, fk: str, data, j: int) -> None:
        try:
            for k in range(j + 1, len(self.tiers)):
                if self._write_to(k, fk, data):
                    return
            self._add(self.tiers[j].name, "evicted", 1)
            with self._lock:
                self._counts["failures"] += 1
            self._log_once(self.tiers[j].name, "demote", "could not demote %s: no tier below took it", fk)
        finally:
            with self._cv:
                if self._demoting.get(fk) is data:
                    del self._demoting[fk]

    def _do_promote(self, fk: str, data, uppers: list[int]) -> None:
        for j in uppers:
            if self._write_to(j, fk, data):
                self._add(self.tiers[j].name, "promoted", 1)

    def _cancel(self, match) -> None:
        with self._cv:
            for fk in [k for k in self._pending if match(k)]:
                self._pending.pop(fk).cancelled = True
            for fk in [k for k in self._demoting if match(k)]:
                del self._demoting[fk]

    # -- health, errors, stats -------------------------------------------------------------------
    def _tier_call(self, tier, op: str, *args) -> None:
        if not self._usable(tier.name):
            self._add(tier.name, "skipped", 1)
            return
        try:
            getattr(tier, op)(*args)
        except Exception as e:  # noqa: BLE001
            self._tier_failed(tier.name, e, op)
            return
        self._tier_ok(tier.name)

    def _usable(self, name: str) -> bool:
        with self._lock:
            st = self._state[name]
            return st.healthy or time.monotonic() >= st.retry_at

    def _tier_ok(self, name: str) -> None:
        with self._lock:
            st = self._state[name]
            if st.healthy:
                return
            st.healthy, st.backoff_s, st.retry_at = True, self._backoff0, 0.0
        log.warning("pace_hf.tiers: tier %s is back", name)

    def _tier_failed(self, name: str, e: BaseException, op: str) -> None:
        unavailable = isinstance(e, TierUnavailable)
        with self._lock:
            st = self._state[name]
            st.stats["errors"] += 1
            st.last_error = f"{op}: {e!r}"[:500]
            if unavailable:
                st.healthy = False
                st.retry_at = time.monotonic() + st.backoff_s
                st.backoff_s = min(st.backoff_s * 2, self._backoff_max)
        self._log_once(name, "unavailable" if unavailable else f"{op}_error",
                       "tier %s %s failed: %r%s", name, op, e,
                       " (marked unhealthy, backing off)" if unavailable else "")
        if self.strict:
            err = e if isinstance(e, TierError) else TierError(f"tier {name} {op} failed: {e!r}")
            if op == "write" or threading.current_thread() is self._writer:
                self._async_fail(err)
            else:
                raise err from e

    def _integrity(self, name: str, e: IntegrityError) -> None:
        if name in self._state:
            self._add(name, "integrity_failures", 1)
        self._log_once(name, e.kind, "tier %s: %s entry is a miss (%s)", name, e.kind, e)
        if self.strict:
            raise e

    def _add(self, name: str, counter: str, n) -> None:
        with self._lock:
            self._state[name].stats[counter] += n

    def _log_once(self, name: str, kind: str, msg: str, *args) -> None:
        with self._lock:
            if (name, kind) in self._logged:
                return
            self._logged.add((name, kind))
        log.warning(msg, *args)

    def _async_fail(self, err: TierError) -> None:
        if self.strict:
            with self._lock:
                if self._async_error is None:
                    self._async_error = err

    def _raise_async(self) -> None:
        with self._lock:
            err, self._async_error = self._async_error, None
        if err is not None:
            raise err
