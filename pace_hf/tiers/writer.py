"""The background writer: one thread that encodes and writes what ``TieredStore.put`` queued, and moves
entries between tiers (demotion, promotion).

Writes. ``put`` does no I/O and no encoding: it records the tensors as *pending* (``get`` serves them from
there until they are written) and queues them for one background writer thread, which encodes the entry
(checksum included) and writes it. The writer takes up to ``WRITE_BATCH`` queued puts at once and hands
each tier that is not an evicting cache all of them in one ``put_many`` (Valkey: one transaction). With
``write_policy="through"`` (the default) the entry goes to every tier, top first: the host copy serves
fast reads, the lower copies make ``flush()`` a durable save point (a session can resume in another
process) and survive a failing tier. With ``"top"`` it goes to the first tier only and reaches the others
by demotion (cheaper, not durable until pushed out).

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

Demotion. Entries pushed out of an evicting tier (``HostTier``) by its byte cap are written to the next
tier(s) by the writer (and stay readable until they are), unless they are known to be there already
("clean"); only when there is no tier below are they dropped, counted as ``evicted``. Promotion: a hit
read below the top is copied into an in-process tier above at once, into the others by the writer.

Errors of the writer thread surface in strict mode as a ``TierError`` from the next ``put`` or ``flush``.

Deletes in the background. ``delete_later`` queues the deletion of an entry from the tiers outside this
process as a job (jobs go before puts, so a put queued after it is not undone by it): a disk's unlink
costs about 3 ms on this project's disk, and a 16K-token pace-serve turn retires hundreds of spill
versions. Until the job has run the entry is *deleting*: ``lookup`` says so and the store's reads miss it.

Confirmation. ``put`` returns a ``Future`` that resolves, once the writer is done with the entry, to
``{tier name: None if written, else why not}``: what a save needs to know that its entries reached every
durable tier (``durable_tiers``: every tier but host memory) before it writes the manifest that names them.
``put(..., through=True)`` writes to every tier whatever the write policy.

The store owns one ``Writer``; the writer owns its queue, its thread and its counters (``puts``,
``failures``), and reports every request to a tier into the store's ``TierHealth`` (``health``). The
store's reads touch it only to find a pending write, to promote a hit and to cancel what is deleted.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Sequence

import torch

from . import entry as _entry
from .base import Tier
from .errors import TierError
from .health import TierHealth

log = logging.getLogger("pace_hf.tiers")

WRITE_BATCH = 16  # queued puts the writer takes at once

# Every writer not yet closed. Its thread holds it, so it stays here while it runs even when its store is
# gone: a script that drops its cache without closing drops the store, never the thread (issue 71).
_RUNNING: "weakref.WeakSet[Writer]" = weakref.WeakSet()


def finish_running_writers(timeout_s: float) -> None:
    """Land what every running writer has queued and stop its thread (at exit: a daemon thread still
    encoding a tensor when the runtime is torn down aborts the process)."""
    for writer in list(_RUNNING):
        try:
            writer.flush(timeout_s)
        except TierError as e:
            log.warning("pace_hf.tiers: a writer still had work at exit: %s", e)
        finally:
            writer.close()


class _Write:
    __slots__ = ("fk", "key", "tensors", "meta", "fingerprint", "session_id", "cancelled", "through", "done")

    def __init__(self, fk, key, tensors, meta, fingerprint, session_id, through):
        self.fk, self.key, self.tensors, self.meta = fk, key, tensors, meta
        self.fingerprint, self.session_id = fingerprint, session_id
        self.cancelled, self.through = False, through
        self.done: Future = Future()  # {tier name: None if written, else why not}


class Writer:
    """The store's background writer (see the module docstring).

    Args:
        tiers: the store's tiers, fastest first.
        health: where every request to a tier is reported (and strict-mode errors kept).
        timeout_s: the writer's time per entry of a batch before a waiting ``put`` gives up.
        queue_size: queued puts before ``put`` waits.
        write_policy: ``"through"`` or ``"top"``.
    """

    def __init__(self, tiers: Sequence[Tier], health: TierHealth, *, timeout_s: float, queue_size: int,
                 write_policy: str):
        self.tiers, self.health = list(tiers), health
        self.timeout_s, self.queue_size, self.write_policy = timeout_s, queue_size, write_policy
        self.counts = {"puts": 0, "failures": 0}
        self._cv = threading.Condition()  # queue, pending, demoting, inflight, counts
        self._puts: deque[_Write] = deque()
        self._jobs: deque[tuple] = deque()
        self._pending: dict[str, _Write] = {}
        self._demoting: dict[str, Any] = {}
        self._deleting: dict[str, int] = {}  # full key -> its delete jobs still queued or running
        self._inflight = 0
        self._stall_at = 0.0  # when the writer's work in hand, at timeout_s per entry, counts as stalled
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="pace-tier-writer", daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    def put(self, fk: str, key: str, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None,
            fingerprint: str, session_id: str, through: bool) -> Future:
        """Record ``tensors`` as pending and queue them, waiting for room while the writer makes progress
        (see the module docstring). Returns the write's confirmation."""
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
                self.counts["failures"] += 1
                self.health.log_once("store", "queue_full", "%s; dropped a put (%s)", why, fk)
                if self.health.strict:
                    raise TierError(f"{why}; put {fk!r} not stored")
                item.done.set_result({t.name: why for t in self.tiers})
                return item.done
            self._pending[fk] = item
            self._puts.append(item)
            self.counts["puts"] += 1
            self._cv.notify_all()
        return item.done

    def lookup(self, fk: str) -> tuple[_Write | None, Any, bool]:
        """The pending write of ``fk``, the bytes of its demotion in flight (``None`` for none), and
        whether a delete of it is queued (a pending write queued after the delete wins)."""
        with self._cv:
            return self._pending.get(fk), self._demoting.get(fk), fk in self._deleting

    def delete_later(self, fk: str, tiers: Sequence[int]) -> None:
        """Delete ``fk`` from the tiers at indices ``tiers`` on the writer thread (see the module docstring)."""
        with self._cv:
            if self._closed:
                raise TierError("the store is closed")
            self._deleting[fk] = self._deleting.get(fk, 0) + 1
            self._jobs.append(("delete", fk, list(tiers)))
            self._cv.notify_all()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued write (and demotion/promotion) is done; TierError on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self._puts or self._jobs or self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TierError(f"flush: {len(self._puts) + len(self._jobs) + self._inflight} writes "
                                    f"still queued after {timeout_s} s")
                self._cv.wait(left)

    @property
    def closed(self) -> bool:
        return self._closed

    def stop(self) -> None:
        """Let the thread end once it has drained the queue, without waiting for it (its store is gone)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def close(self) -> None:
        """Stop the thread once it has drained the queue (``flush`` first to wait for that)."""
        self.stop()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            _RUNNING.discard(self)

    def stats(self) -> dict:
        """``puts`` (queued), ``failures`` (puts and moves that reached no tier) and ``pending``."""
        with self._cv:
            return dict(self.counts, pending=len(self._pending))

    def promote(self, ti: int, fk: str, data) -> None:
        """Promote a hit read from tier ``ti`` to the tiers above it: into an in-process tier now, into the
        others through the writer."""
        uppers = []
        for j in range(ti):
            t = self.tiers[j]
            if not self.health.usable(t.name):
                continue
            if t.in_process:
                pushed = self._put_into(t, fk, data, clean=True)
                self.health.add(t.name, "promoted", 1)
                self._queue_demotions(j, [p for p in pushed if p[0] != fk])
            else:
                uppers.append(j)
        if uppers:
            with self._cv:
                self._jobs.append(("promote", fk, data, uppers))
                self._cv.notify_all()

    def cancel(self, match: Callable[[str], bool]) -> None:
        """Drop the pending writes and demotions whose full key ``match``es (deleted before written)."""
        with self._cv:
            for fk in [k for k in self._pending if match(k)]:
                self._pending.pop(fk).cancelled = True
            for fk in [k for k in self._demoting if match(k)]:
                del self._demoting[fk]

    # -- the writer thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
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
                elif job[0] == "delete":
                    self._do_delete(*job[1:])
            except Exception as e:  # noqa: BLE001 - the writer must survive anything
                log.exception("pace_hf.tiers writer: unexpected error")
                self.health.async_fail(TierError(f"writer: {e!r}"))
            finally:
                with self._cv:
                    self._inflight -= 1
                    self._cv.notify_all()

    def _do_delete(self, fk: str, tiers: list[int]) -> None:
        try:
            for j in tiers:
                self.health.call(self.tiers[j], "delete", fk, defer=True)
        finally:
            with self._cv:
                self._deleting[fk] -= 1
                if not self._deleting[fk]:
                    del self._deleting[fk]

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
                    self._count_failure()
                    self.health.log_once("store", "encode", "cannot encode %s: %r", item.fk, e)
                    self.health.async_fail(TierError(f"cannot encode {item.fk!r}: {e!r}"))
                    outcomes[n] = {t.name: f"cannot encode: {e!r}" for t in self.tiers}
            for j, tier in enumerate(self.tiers):
                group = [n for n, item in enumerate(items) if datas[n] is not None and not item.cancelled
                         and (j == 0 or self.write_policy == "through" or item.through)]
                if len(group) > 1 and not tier.evicts and self.health.usable(tier.name):
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
                    self._count_failure()
                    self.health.log_once("store", "lost", "%s could not be written to any tier", item.fk)
                    self.health.async_fail(TierError(f"{item.fk!r} could not be written to any tier"))
                if item.cancelled:
                    outcomes[n] = {}
                    for tier in self.tiers:
                        self.health.call(tier, "delete", item.fk, defer=True)
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
            self.health.failed(name, e, "write", defer=True)
            self.health.add(name, "skipped", len(group) - 1)
            errors = [e] * len(group)
        else:
            self.health.add(name, "write_seconds", time.perf_counter() - t0)
            if any(err is None for err in errors):
                self.health.ok(name)
            for err in errors:
                if err is not None:
                    self.health.failed(name, err, "write", defer=True)
        written = []
        for (item, data, outcome), err in zip(group, errors):
            if err is None:
                self.health.add(name, "bytes_written", len(data))
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
        if not self.health.usable(name):
            self.health.add(name, "skipped", 1)
            outcome[name] = f"skipped: unavailable since {self.health.last_error(name)}"
            if own and self.write_policy == "top":
                return self._write_below(j, fk, data, outcome)
            return False
        t0 = time.perf_counter()
        try:
            pushed = self._put_into(tier, fk, data, clean=False)
        except Exception as e:  # noqa: BLE001
            outcome[name] = f"write failed: {e!r}"[:500]
            self.health.failed(name, e, "write", defer=True)
            if own and self.write_policy == "top":
                return self._write_below(j, fk, data, outcome)
            return False
        self.health.ok(name)
        self.health.add(name, "write_seconds", time.perf_counter() - t0)
        if pushed:
            mine = [p for p in pushed if p[0] == fk]
            others = [p for p in pushed if p[0] != fk]
            self._queue_demotions(j, others)
            if mine:  # larger than the whole cap: not kept here
                outcome[name] = "not kept: larger than the tier's byte cap"
                if self.write_policy == "top":
                    return self._write_below(j, fk, data, outcome)
                return False
        self.health.add(name, "bytes_written", len(data))
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
        self._count_failure()
        self.health.async_fail(TierError(f"{fk!r} could not be written to any tier"))
        return False

    def _queue_demotions(self, j: int, pushed: list) -> None:
        name = self.tiers[j].name
        for k, d, clean in pushed:
            if clean:
                continue  # already stored below
            if j + 1 >= len(self.tiers):
                self.health.add(name, "evicted", 1)
                continue
            self.health.add(name, "demoted", 1)
            with self._cv:
                self._demoting[k] = d
                self._jobs.append(("demote", k, d, j))
                self._cv.notify_all()

    def _do_demote(self, fk: str, data, j: int) -> None:
        try:
            for k in range(j + 1, len(self.tiers)):
                if self._write_to(k, fk, data):
                    return
            self.health.add(self.tiers[j].name, "evicted", 1)
            self._count_failure()
            self.health.log_once(self.tiers[j].name, "demote", "could not demote %s: no tier below took it", fk)
        finally:
            with self._cv:
                if self._demoting.get(fk) is data:
                    del self._demoting[fk]

    def _do_promote(self, fk: str, data, uppers: list[int]) -> None:
        for j in uppers:
            if self._write_to(j, fk, data):
                self.health.add(self.tiers[j].name, "promoted", 1)

    def _count_failure(self) -> None:
        with self._cv:
            self.counts["failures"] += 1
