"""The one generation worker: a bounded queue of turns, the session table, parking and saves.

Why one worker: one model, and every model call on one thread, so sessions need no locks. By default
that worker decodes the turns of several sessions together (``batcher``: one batched forward per token
over up to ``max_batch`` active turns, each session's cache a row of ``pace_hf.cache.CacheRows``,
and one ``chunk`` of an admitted prompt in the same forward);
``batch_decode=False`` runs one turn at a time (``_run``). Both
do the same work before and after the generation (``_locate``, ``_lease``, ``_open``; ``_close``).
Requests wait in a bounded queue; a full queue is a 429 with ``Retry-After``, never a hang. Saves run
on a second thread, behind the reply, and a session's next turn waits for its save.

Sessions. A session is found by a hash chain over its messages: ``h_0`` hashes the model and the
system prompt, ``h_k = H(h_{k-1}, role_k, content_k)``. After each completed turn the hash of the whole
conversation (the reply included, as the client will re-send it) maps to the session id, in memory
and in the store, written before the reply's last event (so a restarted server, or another replica that
gets the next turn at once, finds it; that replica then waits on the session's lease for the save). A request continues the
session of the longest prefix of its messages that is known; ``X-Session-Id`` names one instead.
The session is then synced with the request (``PACESession.sync``): edited history is rewound, never
reused, and only new messages are prefilled. At most ``max_resident`` sessions keep their cache in
memory (LRU); the others, and any idle for ``idle_ttl_s``, are parked: their last turn is already
saved, so parking only waits for that save and frees the layers. A parked session is resumed from the
store; a missing save starts a fresh session from the request's messages, and any other failure to resume
is an error to the client that deletes nothing (another replica may be saving it). Before a resident
session is used, the store's current save is checked against the one it continues: a session another
replica saved since is resumed, never served stale. A turn holds the session's writer lease from before
the session is read until its save lands; the lease lives ``TURN_LEASE_S`` and is renewed while the turn
runs (``LeaseKeeper``), so a replica killed mid-turn frees its sessions within that time. With API keys,
everything above happens inside the tenant's namespace (``tenants``).
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import logging
import math
import queue
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer

from ..chat import DEFAULT_SYSTEM
from ..planner import SymbolPlanner
from ..session import PACESession
from ..memory.retention import RETAIN_BUSY_S, RETAIN_IDLE_S, retain
from ..memory.persist import DamagedSave, current_generation
from ..tiers import TierError, TierUnavailable, WriterConflict
from .prometheus import Metrics
from .protocol import APIError
from ..memory.namespace import SERVE_INDEX, scoped, unscoped
from .tenants import chain_seed

# A session's prefill chunk by default (or the room its limit leaves, if less): the prompt tokens a batched
# step carries beside the decoding rows, and where eviction runs during a prefill. Chosen from measurements
# (docs/guides/pace-serve.md, "One step for prefill and decode").
CHUNK = 128

log = logging.getLogger("pace_hf.serve")

INDEX_SESSION, INDEX_FINGERPRINT = SERVE_INDEX, "pace-serve-chain"  # the index is stored as a session
TURN_LEASE_S = 30.0  # a turn's writer lease: renewed every sixth of it while the turn runs, released once saved
INDEX_WAIT_S = 30.0  # at most this long for the conversation's index entry before the reply ends
MAX_KNOWN = 1 << 16  # conversation hashes kept in memory; the store's index holds them all
MAX_SESSION_NAME = 128


def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library). After a burst, the memory glibc's arenas freed
    stays mapped to the process (the worker, the event loop and the saver each allocate in an arena of
    their own): trimming hands it back to the system."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()


def chain(model_name: str, system: str, messages, seed: str = "") -> list[str]:
    """``[h_0, h_1, ..., h_n]``: ``h_k`` names the conversation of the system prompt and the first k messages,
    in the namespace ``seed`` (a tenant's, see ``tenants.chain_seed``)."""
    h = hashlib.sha256((f"{seed}\0" if seed else "").encode() + f"{model_name}\0{system}".encode()).hexdigest()
    out = [h]
    for role, content in messages:
        h = hashlib.sha256(f"{h}\0{role}\0{content}".encode()).hexdigest()
        out.append(h)
    return out


@dataclass
class Turn:
    """One request's work, and the channel its results go back on (to the event loop that waits)."""

    system: str
    messages: list[tuple[str, str]]
    max_tokens: int | None
    stops: list[str]
    sampling: dict
    session_name: str | None
    loop: asyncio.AbstractEventLoop
    tenant: str | None = None  # None: the keyless server's one namespace
    cache_salt: str | None = None
    logprobs: int | None = None  # None: no logprobs; else how many alternatives each token lists
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    outcome: dict = field(default_factory=dict)  # the request log's: session, tokens, an error's status

    def send(self, kind: str, payload=None) -> None:
        if kind in ("started", "done"):
            self.outcome.update((k, v) for k, v in payload.items() if k != "content")
        elif kind == "error":
            self.outcome["error"] = getattr(payload, "status", 500)
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


@dataclass
class Opened:
    """A turn between its pre-work and its reply (``Engine._open``): what ``Engine._close`` needs."""

    turn: Turn
    system: str
    hashes: list[str]
    sid: str
    lease: object
    session: PACESession
    max_tokens: int
    header: int  # the generation header's length in tokens
    prompt: int  # the prompt's tokens, the header included
    reused: int  # of them, those the session's cache already held
    before: dict  # the cache's tier_stats before the turn
    t0: float  # when the turn started (perf_counter), for the TTFT
    sampler: object = None  # the batched worker's (batcher.Sampler): the reply's logprobs


@dataclass
class Resident:
    session: PACESession
    last_used: float
    saving: Future | None = None


class _Cancelled(StoppingCriteria):
    def __init__(self, flag: threading.Event):
        self.flag = flag

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.flag.is_set(), dtype=torch.bool, device=input_ids.device)


class _Deltas(TextStreamer):
    """Sends each decoded piece of the reply to the turn's channel."""

    def __init__(self, tokenizer, turn: Turn, on_first):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.turn, self.on_first = turn, on_first

    def on_finalized_text(self, text: str, stream_end: bool = False):
        if text:
            if self.on_first is not None:
                self.on_first()
                self.on_first = None
            self.turn.send("delta", text)


class LeaseKeeper:
    """Renews the writer leases of the turns in flight every sixth of their life: a lease outlives a long
    prefill or save, but not its replica (a SIGKILLed replica's sessions are free within ``TURN_LEASE_S``,
    not after a fixed turn-length guess). Five renewals can be missed before a lease lapses: on a host so
    loaded that this thread or the store does not run for 25 s, one did lapse at a third. A lease that
    cannot be renewed is dropped and logged; the turn's save then fails on its own renewal, and the next
    response says it was not saved."""

    def __init__(self, ttl_s: float):
        self.every_s = ttl_s / 6
        self._held: set = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pace-serve-leases", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def hold(self, lease) -> None:
        with self._lock:
            self._held.add(lease)

    def release(self, lease) -> None:
        with self._lock:
            self._held.discard(lease)
        lease.release()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            with self._lock:
                leases = list(self._held)
            for lease in leases:
                try:
                    lease.renew()
                except Exception as e:  # noqa: BLE001 - expired, or the store is down: the save will say so
                    log.warning("pace-serve: lease %s could not be renewed (%s)", lease.name, e)
                    with self._lock:
                        self._held.discard(lease)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Engine:
    """The worker (see the module docstring). ``start()`` it; ``submit(turn)`` from the event loop."""

    def __init__(self, model, tokenizer, store, model_name: str, *, budget: int = 2048, limit: int | str | None = "auto",
                 chunk: int | None = None, max_context: int = 32768, max_tokens: int = 512, max_resident: int = 8,
                 idle_ttl_s: float = 600.0, queue_size: int = 16, spill_cap_bytes: int | None = 512 << 20,
                 retrieval: bool = True, retain_bytes: int | None = None, retain_age_s: float | None = None,
                 batch_decode: bool = True, max_batch: int = 8, chunked_prefill: bool = True):
        if store is None:
            raise ValueError("pace-serve needs a store: sessions are saved and parked there")
        self.model, self.tokenizer, self.store, self.model_name = model, tokenizer, store, model_name
        # the spill cap: without one, a long conversation keeps every evicted token (GBs per session)
        self.session_kwargs = dict(budget=budget, limit=limit, chunk=chunk, spill_cap_bytes=spill_cap_bytes)
        # a budget, limit or chunk the cache cannot take fails here, at startup, not as a 500 on every turn
        probe = PACESession(model, tokenizer, planner=SymbolPlanner(), **self.session_kwargs)
        probe.cache.unbind()
        if chunk is None:  # the session's own default is the room the limit leaves (up to 4,096): at most CHUNK
            self.session_kwargs["chunk"] = min(CHUNK, probe.chunk)
        self.max_context, self.max_tokens = max_context, max_tokens
        self.retrieval = retrieval  # each user turn restores the evicted pages its text matches (pace_hf.memory.retrieval)
        self.max_resident, self.idle_ttl_s = max_resident, idle_ttl_s
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.metrics = Metrics()
        self.metrics.queue_depth.set_function(self.queue.qsize)
        self.resident: OrderedDict[str, Resident] = OrderedDict()
        self.parked: set[str] = set()
        self.known: OrderedDict[str, str] = OrderedDict()  # conversation hash -> session id (the newest MAX_KNOWN)
        # retention: whole sessions go, least recently saved first, past this many bytes or this age
        self.retain_bytes, self.retain_age_s = retain_bytes, retain_age_s
        self._retained_at = -math.inf
        self.unsaved: set[str] = set()  # sessions whose last turn's save failed, until their next turn says so
        self.secret = self._secret()  # seeds every tenant's hash chain (tenants.chain_seed)
        self.metrics.resident.set_function(lambda: len(self.resident))
        self.metrics.parked.set_function(lambda: len(self.parked))
        self.saver = ThreadPoolExecutor(1, thread_name_prefix="pace-serve-save")
        self.leases = LeaseKeeper(TURN_LEASE_S)
        self.turn_seconds = 1.0  # a running mean, for Retry-After
        self.active: set[str] = set()  # sessions in a turn of the batched worker: never parked or dropped by another
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch (turns decoded together) must be an int >= 1, got {max_batch!r}")
        self.batcher = None
        if batch_decode:
            from .batcher import Batcher, unapplied

            dropped = unapplied(getattr(model, "generation_config", None))
            if dropped:  # a model served without what its generation config asks for would answer otherwise
                raise ValueError(f"the model's generation_config sets {', '.join(dropped)}, whose logits "
                                 f"processor{'s' * (len(dropped) > 1)} the batched decode does not apply; serve it "
                                 "with --no-batch-decode (generate applies them), or unset "
                                 f"{'them' if len(dropped) > 1 else 'it'} in its generation_config.json")
            self.batcher = Batcher(self, max_batch, chunked_prefill)
        self.worked = False  # whether a turn ran or a session was dropped since freed memory was given back (_trim)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="pace-serve-worker", daemon=True)

    def start(self) -> None:
        self.leases.start()
        self._thread.start()

    def _secret(self) -> bytes:
        """The server's secret, kept in its store so that a restarted server (or another replica) finds the
        same sessions: made once, at random, and never sent to a client."""
        got = self.store.get("secret", fingerprint=INDEX_FINGERPRINT, session_id=INDEX_SESSION)
        if got is not None and "secret" in got[0]:
            return bytes(got[0]["secret"].tolist())
        secret = torch.tensor(list(secrets.token_bytes(32)), dtype=torch.uint8)
        self.store.put("secret", {"secret": secret}, {}, fingerprint=INDEX_FINGERPRINT, session_id=INDEX_SESSION,
                       through=True).result()
        return bytes(secret.tolist())

    def close(self) -> None:
        """Stop the worker, finish the saves, close the store."""
        self._stop.set()
        self._thread.join(timeout=30)
        self.saver.shutdown(wait=True)
        self.leases.close()
        self.store.close()

    # -- the queue ----------------------------------------------------------------------------------
    def submit(self, turn: Turn) -> None:
        name = turn.session_name
        if name is not None and not (0 < len(name) <= MAX_SESSION_NAME and name != INDEX_SESSION):
            # a longer name outgrows the disk tier's file names (its saves would all fail); the index's
            # name would share, and on a restart delete, the entries that find every session
            raise APIError(400, f"X-Session-Id takes 1 to {MAX_SESSION_NAME} characters other than "
                                f"{INDEX_SESSION!r}, got {len(name)}", param="X-Session-Id", code="invalid_session_id")
        try:
            self.queue.put_nowait(turn)
        except queue.Full:
            self.metrics.rejected.inc()
            wait = max(1, math.ceil(self.turn_seconds * (self.queue.qsize() + 1)))
            raise APIError(429, f"the server is busy: {self.queue.qsize()} requests are waiting; retry later",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": str(wait)}) from None

    def _work(self) -> None:
        if self.batcher is not None:
            self.batcher.run()
            return
        while not self._stop.is_set():
            try:
                turn = self.queue.get(timeout=0.5)
            except queue.Empty:
                self._park_idle()
                self._retain(every_s=RETAIN_IDLE_S)
                self._trim()
                continue
            if turn.cancelled.is_set():  # the client left while it waited
                continue
            started = time.perf_counter()
            self.worked = True
            try:
                self._run(turn)
            except Exception as e:  # noqa: BLE001 - one bad turn never kills the server
                self._fail(turn, e)
            self.turn_seconds = 0.8 * self.turn_seconds + 0.2 * (time.perf_counter() - started)
            self._park_idle()
            self._retain(every_s=RETAIN_BUSY_S)

    def _retain(self, every_s: float) -> None:
        """Keep the store under its cap and age (``pace_hf.memory.retention``): parked sessions whose
        saves are done may go, the resident ones and the index stay. A retired session's index entries go
        with it, so a later turn of its conversation starts afresh instead of finding a deleted save.
        It scans the store and waits for the saves in flight, so it runs when the queue is idle (at most
        every ``RETAIN_IDLE_S``) and, under steady load, between turns at most every ``RETAIN_BUSY_S``."""
        if self.retain_bytes is None and self.retain_age_s is None:
            return
        now = time.monotonic()
        if now - self._retained_at < every_s:
            return
        self._retained_at = now
        for held in self.resident.values():  # a save still in flight would be counted half
            if held.saving is not None:
                held.saving.result()
        try:
            gone = set(retain(self.store, max_bytes=self.retain_bytes, max_age_s=self.retain_age_s,
                              keep={INDEX_SESSION, *self.resident}))
        except TierError as e:
            log.warning("pace-serve: retention could not run: %s", e)
            return
        if gone:
            self.metrics.retired.inc(len(gone))
            self.parked -= gone
            for digest in [h for h, sid in self.known.items() if sid in gone]:
                del self.known[digest]
                self.store.delete(f"chain/{digest}", session_id=INDEX_SESSION)

    # -- sessions -----------------------------------------------------------------------------------
    def _new(self, system: str, session_id: str) -> PACESession:
        return PACESession(self.model, self.tokenizer, system=system, store=self.store, session_id=session_id,
                           planner=SymbolPlanner(), rehydrate=True, retrieval=self.retrieval, **self.session_kwargs)

    def _find(self, turn: Turn, hashes: list[str]) -> str:
        """The id of the session this turn continues (or a new id), in the turn's tenant's namespace."""
        if turn.session_name:
            return scoped(turn.tenant, turn.session_name)
        for k in range(len(turn.messages), 0, -1):
            if hashes[k] in self.known:
                return self.known[hashes[k]]
        for k in range(len(turn.messages), 0, -1):  # after a restart: the store's index
            if turn.messages[k - 1][0] != "assistant":
                continue
            got = self.store.get(f"chain/{hashes[k]}", fingerprint=INDEX_FINGERPRINT, session_id=INDEX_SESSION)
            if got is not None:
                return got[1]["session"]
        return scoped(turn.tenant, uuid.uuid4().hex)

    def _session(self, session_id: str, system: str) -> PACESession:
        """The session, resident, resumed from the store, or new."""
        held = self.resident.get(session_id)
        if held is not None:
            if held.saving is not None:
                held.saving.result()  # its previous turn is still being written
            try:
                fresh = self._fresh(session_id, held.session)
            except DamagedSave as e:  # whether another replica saved since cannot be read: serve nothing
                raise self._unavailable(session_id, e) from None
            if fresh:
                self.resident.move_to_end(session_id)
                return held.session
            self.metrics.stale.inc()  # another replica saved it since: never serve the copy in memory
            self._drop(session_id)
        try:
            session = PACESession.resume(session_id, self.model, self.tokenizer, store=self.store,
                                         planner=SymbolPlanner(), rehydrate=True, retrieval=self.retrieval)
            self.metrics.resumes.inc()
        except KeyError:  # no such session (a damaged manifest is DamagedSave): a new one, from the messages
            session = self._new(system, session_id)
        except TierUnavailable as e:  # the save may be whole behind a tier that is down: keep it, serve afresh
            log.warning("pace-serve: session %s cannot be resumed now (%s); serving it afresh", session_id, e)
            self.metrics.resume_failures.inc()
            session = self._new(system, session_id)
        except WriterConflict as e:
            self.metrics.resume_failures.inc()
            raise APIError(409, f"session busy: {e}", type="server_error", code="session_busy",
                           headers={"Retry-After": "1"}) from None
        except Exception as e:  # noqa: BLE001 - corrupt, foreign, a save in flight: never delete it, say so
            raise self._unavailable(session_id, e) from None
        return self._admit(session_id, session)

    def _unavailable(self, session_id: str, e: Exception) -> APIError:
        """The 503 for a save that exists but cannot be served (a damaged manifest or entry, another model's):
        counted and logged, and nothing is deleted, so it resumes once repaired."""
        log.warning("pace-serve: session %s could not be resumed (%s); it is kept as it is", session_id, e)
        self.metrics.resume_failures.inc()
        return APIError(503, f"this conversation's saved session could not be resumed ({type(e).__name__}: {e}); "
                             "nothing was deleted: retry, or start a new conversation",
                        type="server_error", code="session_unavailable", headers={"Retry-After": "1"})

    def _fresh(self, session_id: str, session: PACESession) -> bool:
        """Whether the store's current save of ``session_id`` is the one this copy last wrote or resumed
        (a session never saved must have none). Unknown (a tier down) counts as fresh: nothing newer can be
        read either. A damaged manifest raises ``DamagedSave``: a save is there, but not which."""
        try:
            return current_generation(self.store, session_id) == session.cache.spill.generation
        except TierError:
            return True

    def _trim(self) -> None:
        """Once the worker is idle after turns ran: the saves landed, then the memory freed since goes back to
        the system (``malloc_trim``), so a burst does not leave the server at its peak."""
        if not self.worked or MALLOC_TRIM is None:
            return
        for held in list(self.resident.values()):
            if held.saving is not None and not held.saving.done():
                return  # a save still allocates; the next idle pass trims
        self.worked = False
        MALLOC_TRIM(0)

    def _admit(self, session_id: str, session: PACESession) -> PACESession:
        """Make ``session`` resident, parking the least recently used first: the cap holds at every moment."""
        while len(self.resident) >= self.max_resident:
            idle = next((s for s in self.resident if s not in self.active), None)
            if idle is None:  # every resident session is in a turn (the batched worker admits no more than fit)
                break
            self._park(idle)
        self.parked.discard(session_id)
        self.resident[session_id] = Resident(session, time.monotonic())
        return session

    def _drop(self, session_id: str) -> None:
        held = self.resident.pop(session_id, None)
        if held is not None:
            held.session.cache.unbind()
            self.worked = True  # its layers were freed: the next idle pass trims

    def _park(self, session_id: str) -> None:
        """Free a resident session's layers; its last completed turn is (being) saved."""
        held = self.resident[session_id]
        if held.saving is not None:
            held.saving.result()
        self._drop(session_id)
        self.parked.add(session_id)

    def _park_idle(self, keep: str | None = None) -> None:
        now = time.monotonic()
        for sid in [s for s, r in self.resident.items()
                    if s != keep and s not in self.active and now - r.last_used > self.idle_ttl_s]:
            self._park(sid)
        while len(self.resident) > self.max_resident:
            sid = next((s for s in self.resident if s != keep and s not in self.active), None)
            if sid is None:
                break
            self._park(sid)

    # -- one turn -----------------------------------------------------------------------------------
    # A turn is: ``_locate`` (its session id), ``_lease`` (the session's writer lease), ``_open`` (the
    # session synced with the request, the "started" event), the generation, ``_close`` (the reply
    # appended and sent, indexed, the save queued). ``_run`` does them in a row; the batched worker
    # (``batcher``) runs the same steps around its own prefill and batched decode.
    def _run(self, turn: Turn) -> None:
        """One turn under the session's writer lease, held from before the session is read until its save
        lands: a second replica that gets a turn of it meanwhile answers 409, and never serves, saves or
        deletes it at the same time. A store that cannot take leases now serves the turn without one
        (its save then fails, and the next response says so)."""
        system, hashes, sid = self._locate(turn)
        lease = self._lease(sid)
        handed = False
        try:
            opened = self._open(turn, system, hashes, sid, lease)
            text = self._generate(opened)
            handed = self._close(opened, text)
        finally:
            if not handed:
                self._release_lease(lease)

    def _locate(self, turn: Turn) -> tuple[str, list[str], str]:
        """``(system prompt, hash chain, session id)`` of a turn."""
        system = turn.system if turn.system is not None else DEFAULT_SYSTEM
        hashes = chain(self.model_name, system, turn.messages, chain_seed(self.secret, turn.tenant, turn.cache_salt))
        return system, hashes, self._find(turn, hashes)

    def _saving(self, sid: str) -> Future | None:
        """This replica's save of ``sid`` still in flight, if any."""
        held = self.resident.get(sid)
        return held.saving if held is not None and held.saving is not None and not held.saving.done() else None

    def _lease(self, sid: str):
        """The session's writer lease, held (renewed) until released; None where the store takes none now."""
        held = self.resident.get(sid)
        if held is not None and held.saving is not None:
            held.saving.result()  # this replica's previous turn of it releases the lease when saved
        try:
            lease = self.store.lease(sid, ttl_s=TURN_LEASE_S)
        except WriterConflict:
            self.metrics.busy.inc()
            raise APIError(409, "session busy: another replica is serving a turn of this conversation; retry",
                           type="server_error", code="session_busy", headers={"Retry-After": "1"}) from None
        except TierError as e:
            log.warning("pace-serve: session %s: no writer lease (%s); serving the turn without one", sid, e)
            lease = None
        if lease is not None:
            self.leases.hold(lease)
        return lease

    def _release_lease(self, lease) -> None:
        if lease is not None:
            self.leases.release(lease)

    def _fail(self, turn: Turn, e: Exception) -> None:
        """Tell the client why its turn failed: an ``APIError`` as it is, anything else as a logged 500."""
        if isinstance(e, APIError):
            turn.send("error", e)
            return
        log.error("pace-serve: a turn failed", exc_info=e)
        turn.send("error", APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    def _open(self, turn: Turn, system: str, hashes: list[str], sid: str, lease) -> "Opened":
        """Everything before the generation: the session found, resumed or started, checked against
        ``max_context``, synced with the request; then the "started" event."""
        session = self._session(sid, system)
        if session.system != system:  # a named session with another system prompt: start it over
            fresh = self._new(system, sid)
            try:
                max_tokens, header = self._fit(fresh, turn)  # a request that cannot fit deletes nothing
            except BaseException:
                fresh.cache.unbind()
                raise
            self._drop(sid)
            self.store.delete_session(sid)
            session = self._admit(sid, fresh)
        else:
            max_tokens, header = self._fit(session, turn)
        held = len(session.messages)
        try:
            keep = session.sync(turn.messages)
        except ValueError:  # the edit reaches evicted tokens: start over from the messages
            self.metrics.rebuilds.inc()
            self._drop(sid)
            self.store.delete_session(sid)
            session = self._session(sid, system)
            keep = session.sync(turn.messages)
        else:
            if keep < held:
                session.planner = SymbolPlanner()  # the old one tracks spans the rewind dropped
                self.metrics.rewinds.inc()
        prompt = len(session.ids) + header
        reused = session.cache.get_seq_length()
        before = dict(session.cache.tier_stats)
        saved = sid not in self.unsaved  # the previous turn's save (waited for by _session) landed
        self.unsaved.discard(sid)
        turn.send("started", {"session": unscoped(turn.tenant, sid), "prompt_tokens": prompt,
                              "previous_turn_saved": saved})
        return Opened(turn, system, hashes, sid, lease, session, max_tokens, header, prompt, reused, before,
                      time.perf_counter())

    def _deltas(self, opened: "Opened") -> "_Deltas":
        """The turn's streamer: each decoded piece goes to the client; the first one times the TTFT."""
        t0 = opened.t0
        return _Deltas(self.tokenizer, opened.turn, lambda: self.metrics.ttft.observe(time.perf_counter() - t0))

    def _generate(self, opened: "Opened") -> str:
        """The reply, one turn alone: ``PACESession.generate`` (prefill, decode, the reply appended)."""
        from .batcher import StopStrings

        turn, session = opened.turn, opened.session
        criteria = [_Cancelled(turn.cancelled)] + ([StopStrings(self.tokenizer, turn.stops)] if turn.stops else [])
        try:
            return session.generate(max_new_tokens=opened.max_tokens, streamer=self._deltas(opened),
                                    stopping_criteria=StoppingCriteriaList(criteria), **turn.sampling)
        except Exception:
            self._drop(opened.sid)  # its cache may be half-written; the store still holds its last turn
            raise

    def _close(self, opened: "Opened", text: str) -> bool:
        """Everything after the generation (the reply is the session's last message, ``text``): metrics, a
        cancelled turn forgotten, the stop-string cut, the index, the "done" event, the save queued.
        True once the save (which releases the lease) is queued."""
        turn, sid, session, header = opened.turn, opened.sid, opened.session, opened.header
        prompt, reused, before, max_tokens = opened.prompt, opened.reused, opened.before, opened.max_tokens
        self.metrics.prefill.inc(prompt - reused)
        self.metrics.reused.inc(reused)
        after = session.cache.tier_stats
        self.metrics.restores.inc(after["restores"] - before["restores"])
        self.metrics.stall.inc(max(0.0, after["stall_seconds"] - before["stall_seconds"]))
        reply = session.messages[-1]
        out_tokens = reply.end - reply.start - header - len(session.template.turn_end_ids())
        self.metrics.generated.inc(out_tokens)
        if turn.cancelled.is_set():  # the client left mid-stream: forget the partial reply
            self.metrics.cancelled.inc()
            try:
                session.rewind(len(session.messages) - 1)
            except ValueError:
                self._drop(sid)  # the store holds the last completed turn
            return False
        content, stopped = text, False
        for stop in turn.stops:
            if stop in content:
                content, stopped = content[:content.index(stop)], True
        finish = "stop" if stopped or out_tokens < max_tokens else "length"
        full = chain(self.model_name, opened.system, turn.messages + [("assistant", content)],
                     chain_seed(self.secret, turn.tenant, turn.cache_salt))[-1]
        self.known[full] = sid
        self.known.move_to_end(full)
        while len(self.known) > MAX_KNOWN:  # older conversations are found through the store's index
            self.known.popitem(last=False)
        self._index(full, sid)
        logprobs = opened.sampler.kept(out_tokens, content, stopped) if turn.logprobs is not None else None
        turn.send("done", {"session": unscoped(turn.tenant, sid), "content": content, "finish_reason": finish, "prompt_tokens": prompt,
                           "completion_tokens": out_tokens, "reused_tokens": reused,
                           "prefilled_tokens": prompt - reused, "logprobs": logprobs})
        held = self.resident[sid]
        held.last_used = time.monotonic()
        held.saving = self.saver.submit(self._save, sid, session, opened.lease)
        self._park_idle(keep=sid)
        return True

    def _fit(self, session: PACESession, turn: Turn) -> tuple[int, int]:
        """``(max_tokens, generation header length)``, or a 400 if the prompt and the reply exceed
        ``max_context``. Counted before the session is synced, so a refused request leaves it as it was
        and never runs the planner over messages that cannot fit."""
        t = session.template
        keep = session.kept(turn.messages)
        start = session.messages[keep].start if keep < len(session.messages) else len(session.ids)
        header = len(t.encode(t.gen_header))
        prompt = start + header + sum(len(t.encode(t.block(role, content))) for role, content in turn.messages[keep:])
        room = self.max_context - prompt
        max_tokens = turn.max_tokens if turn.max_tokens is not None else min(self.max_tokens, room)
        if not 1 <= max_tokens <= room:  # a prompt that fills the context leaves no room for a default either
            over = "max_tokens" if turn.max_tokens is not None and room >= 1 else "messages"
            asks = f"max_tokens asks for {max_tokens}" if turn.max_tokens is not None else "leave no room for a reply"
            raise APIError(400, f"this model's maximum context length is {self.max_context} tokens; the messages "
                                f"take {prompt} and {asks}",
                           code="context_length_exceeded", param=over)
        return max_tokens, header

    def _index(self, full: str, sid: str) -> None:
        """The store's entry that finds the session from the whole conversation, written before the reply
        ends: the client may send the next turn to another replica at once. A store that cannot take it
        is logged: that replica then starts the conversation afresh, from its messages."""
        try:
            done = self.store.put(f"chain/{full}", {}, {"session": sid}, fingerprint=INDEX_FINGERPRINT,
                                  session_id=INDEX_SESSION, through=True).result(timeout=INDEX_WAIT_S)
            failed = {tier: why for tier, why in done.items() if why is not None}
            if failed:
                log.warning("pace-serve: session %s: its index entry did not reach %s", sid, failed)
        except Exception as e:  # noqa: BLE001 - the reply still goes out
            log.warning("pace-serve: session %s: its index entry was not written (%s)", sid, e)

    def _save(self, sid: str, session: PACESession, lease=None) -> None:
        """Behind the reply: the turn; then the turn's lease goes."""
        try:
            session.save(lease=lease)
            self.metrics.saves.inc()
        except Exception:  # noqa: BLE001 - the reply is out; the next turn resumes from the last good save
            log.exception("pace-serve: saving session %s failed", sid)
            self.metrics.save_failures.inc()
            self.unsaved.add(sid)  # the next turn's response says so (X-Pace-Previous-Turn-Saved: false)
        finally:
            if lease is not None:
                self.leases.release(lease)
