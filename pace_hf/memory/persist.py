"""Save and resume a cache, all or nothing: a session resumes as exactly one save, never a mix of two.

Generations. Each save is a generation (``g17-3fa2c1``: a serial number and a random tag, so no two
saves, writers or retries ever share a key). Its entries -- every layer's state and the caller's
attachments (a ``PACESession``'s conversation) -- are written under keys of their own
(``L3/state@g17-3fa2c1``), never over an older save's. The spill entries a save indexes were written
once, under keys no writer reuses (``pace_hf.memory.spill``: one entry per version of a logical page). The
manifest is written last, under the one key ``manifest``: it names the generation and holds the digest
(``tiers.entry.digest``) of every entry it covers, layer states, attachments and spill page versions.

Order. (1) The attempt's keys, and those of the save it replaces, are recorded under ``save-pending``. (2) The entries are written, and
each is confirmed on every durable tier (``TieredStore.durable_tiers``): a tier that missed one fails the
save with ``SaveFailed`` naming the entry and the tier, before anything names the entry. Spill entries
written while a tier was down are rewritten from a tier that holds them. (3) The manifest is written
and confirmed the same way: a tier that missed only the manifest still holds the previous save whole,
and the error says which tiers took the new one (the disk tier writes a temporary file, fsyncs it, renames it over the old
one and fsyncs the directory; Valkey sets it in one transaction). (4) Only then are the replaced
generation's entries, the spill versions it indexed that the new one does not (retired by a restore
or by the spill cap), and whatever ``save-pending`` lists from attempts that crashed, deleted (on the
store's writer thread, after the save returns: no manifest names them, and reads miss them at once). A crash at
any point leaves the previous manifest and every entry it names whole, and the next save that commits
collects what the crash left.

Resume reads the manifest, fetches every entry it names and checks each digest before it builds
anything: an entry that is missing (a crash, a Valkey eviction, a TTL), damaged, or another save's (an
older generation put back, another writer's) refuses the resume with ``IncompleteSave`` naming it. If a
save committed while resume was reading, resume starts over on the new manifest.

The session's current save is the manifest its first durable tier holds (the first that answers): a
host tier may hold a stale one. A manifest that tier holds but that fails verification is damage, not
absence: resume, save and ``current_generation`` raise ``DamagedSave`` naming it (absence is resume's
``KeyError``, which a caller may answer by starting afresh; a save over a damaged manifest would strand
the entries it names). Nothing deletes them: once the manifest is put back the session resumes, and
``python -m pace_hf.memory gc`` is the one thing that collects generations no manifest names.

One writer per session. A save holds the session's lease (``TieredStore.lease``: flock on disk, SET NX
PX in Valkey, a table in host memory), and refuses with ``WriterConflict`` when the session's current
save is not the one this cache resumed or last saved: a second writer gets an error, and neither
writer's save is lost or mixed.

Format. ``SAVE_FORMAT`` is 3. Format 1 (before generations) tied nothing together, so a format-1 save
cannot be told apart from a mix; format 2 indexed spill entries by time of eviction, which this spill
log (by logical page) cannot read. Resume refuses both, naming the format; a fresh cache may save over
either (its entries are deleted once the new save commits).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from concurrent.futures import Future

from ..scoring import describe
from .spill import versions_of
from ..tiers.entry import digest, digest_algorithm
from ..tiers.errors import IntegrityError, TierError, TierUnavailable, WriterConflict
from ..tiers.store import TieredStore

SAVE_FORMAT = 3
# The manifest of a saved session is readable whatever the model: it says which model saved it.
MANIFEST_KEY, MANIFEST_FINGERPRINT = "manifest", "pace-session-manifest"
PENDING_KEY = "save-pending"
VERIFY_BATCH = 32  # spill entries read at once when resume verifies them


class SaveFailed(TierError):
    """A save did not reach every durable tier. Nothing names its entries: the previous save is whole."""


class IncompleteSave(ValueError):
    """A save's manifest names an entry that is missing or is not the one it wrote: resume refused."""


class DamagedSave(IncompleteSave):
    """The session has a save, but its manifest (or another entry read by name) fails verification: not
    "no save", so nothing may start the session afresh over it. ``key``, ``tier``, ``kind`` say which."""

    def __init__(self, sid: str, key: str, tier: str, error: IntegrityError):
        super().__init__(f"session {sid!r}: entry {key!r} on tier {tier} fails verification ({error}); the "
                         "save is kept as it is: put the entry back, or delete the session to start it over")
        self.key, self.tier, self.kind = key, tier, error.kind


def check_store(store, session_id) -> None:
    """Refuse what cannot hold a session before anything uses it: a tier passed bare, a path, no session id."""
    if not isinstance(store, TieredStore):
        raise TypeError(f"store must be a pace_hf.tiers.TieredStore, e.g. TieredStore([DiskTier(\"runs/kv\")]); "
                        f"got {type(store).__name__}")
    if not (isinstance(session_id, str) and session_id):
        raise ValueError(f"a cache with a store needs a session_id (a non-empty str) to name its entries, "
                         f"got {session_id!r}")


# -- save --------------------------------------------------------------------------------------------
def save(cache, attachments: dict | None = None, lease=None) -> str:
    """Write a new generation of ``cache``'s session (see the module docstring); return its id.

    ``attachments``: ``{name: (tensors, meta)}`` saved in the same generation (resume returns them).
    ``lease``: the session's writer lease, already held by the caller (a server holds it for a whole
    turn); the save renews it and leaves it held. Without one, the save takes and releases its own."""
    if cache.spill is None:
        raise ValueError("save needs a cache with a store (store=..., session_id=...) bound to a model")
    if cache.in_forward:
        raise RuntimeError("save cannot run inside a forward")
    store, sid, fp, spill = cache.store, cache.session_id, cache.fingerprint, cache.spill
    if lease is None:
        with _fails_the_save(sid):
            lease = store.lease(sid)
        held = lease
    else:
        with _fails_the_save(sid):
            lease.renew()
        held = contextlib.nullcontext()  # the caller's: it releases it
    with held:
        with _fails_the_save(sid):
            current = _read(store, sid, MANIFEST_KEY)
            try:
                pending = (_read(store, sid, PENDING_KEY) or {}).get("pending", [])
            except DamagedSave:  # bookkeeping only: what it listed is named by no manifest, and gc finds it
                pending = []
        # a save of an older format cannot be continued: any new cache may replace it
        current_gen = None if current is None or current.get("format") != SAVE_FORMAT else current.get("generation")
        if current_gen != spill.generation:
            if current is None:  # deleted, or another store: the spill entries our index names may be gone too
                raise WriterConflict(f"session {sid!r} has no save in this store any more, but this cache continues "
                                     f"{spill.generation}: it was deleted or the store lost it; start a new session")
            raise WriterConflict(
                f"session {sid!r} is at save {current_gen}, but this cache continues "
                f"{spill.generation or 'no save (it is new)'}: another writer saved it. Resume it to continue "
                f"that save, or delete it first (store.delete_session({sid!r})) to start over")
        serial = int(current.get("serial", 0)) + 1 if current is not None else 1
        gen = f"g{serial}-{secrets.token_hex(3)}"
        layers = [i for i, layer in enumerate(cache.layers) if layer.is_initialized]
        attachments = dict(attachments or {})
        keys = [f"L{i}/state@{gen}" for i in layers] + [f"{name}@{gen}" for name in attachments]
        spill.flush()  # the index is final now (a flush may retire versions past the spill cap)
        # What to delete once some later save commits: this attempt's entries and the ones it replaces
        # (the spill versions the current save indexes and this one no longer does).
        pending = pending + [keys + sorted(set(_entry_keys(current)) - set(spill.entries()))]
        _confirm(store, sid, {PENDING_KEY: _put(store, sid, PENDING_KEY, {}, {"pending": pending})})

        parts = {f"L{i}/state@{gen}": (_on_cpu(cache.layers[i].tensors()), {"seen": cache.get_seq_length(i)})
                 for i in layers}
        parts.update({f"{name}@{gen}": part for name, part in attachments.items()})
        entries = {key: digest(*part) for key, part in parts.items()}
        writes = {key: _put(store, sid, key, *part, fingerprint=fp) for key, part in parts.items()}
        store.flush()
        _confirm(store, sid, writes)
        _confirm_spill(store, sid, spill)
        with _fails_the_save(sid):
            lease.renew()

        manifest = {
            "format": SAVE_FORMAT, "generation": gen, "serial": serial, "class": type(cache).__name__,
            "model_fingerprint": fp, "layers": [layer.is_initialized for layer in cache.layers],
            "layout": cache.layout,
            "entries": entries, "attachments": sorted(attachments), "budget": cache.budget,
            "sinks": cache.sinks, "recent": cache.recent, "limit": cache.limit,
            "scoring": describe(cache.scoring), "step": cache.step, "renumbers": cache.renumbers,
            "next_physical": cache.next_physical, "prefetch_steps": cache.prefetch_steps, "spill": spill.state(),
            "saved_at": time.time(),  # what retention (pace_hf.memory.retention) orders sessions by
        }
        done = _put(store, sid, MANIFEST_KEY, {}, manifest)
        store.flush()
        written = [t for t, why in done.result().items() if why is None]
        if store.durable_tiers[0] in written:  # the session is at what its first durable tier holds
            spill.saved(gen)
        missed = _missed(store, done.result())
        if missed:
            raise SaveFailed(f"save of session {sid!r} failed: the manifest of {gen} reached {written or 'no tier'} but "
                             f"not every durable tier ({'; '.join(f'{t}: {w}' for t, w in missed.items())}); each tier "
                             "holds one whole save, the new one or the previous")

        # The new save is durable: the one it replaces and attempts that never committed can go. No save
        # names them, so the writer deletes them after the save returns (TieredStore.delete's background),
        # and only then clears the list (a job goes before a put): a crash before that leaves them listed.
        doomed = {key for attempt in pending for key in attempt}
        for key in sorted(doomed - set(entries) - spill.saved_keys):
            store.delete(key, session_id=sid, background=True)
        _put(store, sid, PENDING_KEY, {}, {"pending": []})
    return gen


@contextlib.contextmanager
def _fails_the_save(sid: str):
    """A tier that fails (down, timed out, refusing a command) before the manifest is written fails the
    save with ``SaveFailed``, the one error a caller handles for it; a second writer stays ``WriterConflict``."""
    try:
        yield
    except (SaveFailed, WriterConflict):
        raise
    except TierError as e:
        raise SaveFailed(f"save of session {sid!r} failed: {e}; the previous save is unchanged") from e


def _on_cpu(tensors: dict) -> dict:
    """One host copy that both the digest and the store read (the store copies nothing already there)."""
    return {k: v.detach().to("cpu") for k, v in tensors.items()}


def _put(store, sid: str, key: str, tensors, meta, *, fingerprint: str = MANIFEST_FINGERPRINT) -> Future:
    return store.put(key, tensors, meta, fingerprint=fingerprint, session_id=sid, through=True)


def _read(store, sid: str, key: str) -> dict | None:
    """The meta under ``key`` on the first durable tier that answers: the session's save is the one that
    tier holds (host memory may hold a stale one, e.g. after another process saved). Raises
    ``TierUnavailable`` when none answers, and ``DamagedSave`` when it holds one that fails verification:
    neither is "there is none", which would start the session over."""
    failed = []
    for tier in store.durable_tiers:
        errors, damaged = store.stats[tier]["errors"], {}
        try:
            got = store.get(key, fingerprint=MANIFEST_FINGERPRINT, session_id=sid, tiers=[tier], damaged=damaged)
        except IntegrityError:  # a strict store raises what a lenient one records
            got = None
        if got is not None:
            return got[1]
        if key in damaged:
            raise DamagedSave(sid, key, *damaged[key])
        if store.healthy(tier) and store.stats[tier]["errors"] == errors:
            return None  # it answered: there is none
        failed.append(tier)
    raise TierUnavailable(f"no durable tier answered a read of {key!r} (failed or backing off: {', '.join(failed)}), "
                          "so whether the session has it is unknown")


def _entry_keys(manifest: dict | None) -> list[str]:
    """Every entry a manifest names that its replacement may not: its own entries and spill entries
    (for format 1, its fixed keys: a fresh cache saving over an old save cleans them up)."""
    if manifest is None:
        return []
    spills = [e[0] for layer in manifest.get("spill", {}).get("index", []) for e in layer]
    if manifest.get("format", 1) >= 2:
        return list(manifest.get("entries", {})) + spills
    n = len(manifest.get("layers", []))
    return [f"L{i}/state" for i in range(n)] + ["session"] + spills


def _missed(store, outcome: dict) -> dict[str, str]:
    """The durable tiers a write's confirmation says it did not reach, with why."""
    return {t: outcome.get(t) or "not written" for t in store.durable_tiers if outcome.get(t, "not written") is not None}


def _confirm(store, sid: str, writes: dict[str, Future]) -> None:
    store.flush()
    for key, done in writes.items():
        missed = _missed(store, done.result())
        if missed:
            why = "; ".join(f"{t}: {reason}" for t, reason in missed.items())
            raise SaveFailed(f"save of session {sid!r} failed: {key!r} was not written to every durable tier "
                             f"({why}); the previous save is unchanged and is still the one resumed")


def _confirm_spill(store, sid: str, spill) -> None:
    """Every spill entry the manifest will index is on every durable tier: entries written while a tier
    was down (or only to the top tier) are rewritten from a tier that holds them, and so is every entry
    when a durable tier failed since the last save (it may have come back without them). An entry no tier
    holds is lost: it leaves the index (its tokens cannot be restored by anyone) and the save fails,
    naming it. (A tier that loses entries without a failure the store sees, such as a Valkey restarted
    empty between two requests, is caught by resume, which refuses naming the entry.)"""
    entries = spill.entries()
    stats = store.stats
    errors = {t: stats[t]["errors"] for t in store.durable_tiers}
    if any(n > spill.tier_errors.get(t, 0) for t, n in errors.items()):
        resync = {key: Future() for key in entries if key not in spill.unconfirmed}
        for done in resync.values():
            done.set_result({})  # written nowhere known: rewrite it below
        spill.unconfirmed.update(resync)
    lost = []
    for key, done in list(spill.unconfirmed.items()):
        if _missed(store, done.result()):
            layer_idx, dig = entries[key]
            got = store.get(key, fingerprint=spill.fingerprint, session_id=sid)
            if got is None or digest(*got) != dig:
                lost.append(key)
                continue
            again = _put(store, sid, key, *got, fingerprint=spill.fingerprint)
            _confirm(store, sid, {key: again})
        del spill.unconfirmed[key]
    if lost:
        spill.forget(lost)
        raise SaveFailed(f"save of session {sid!r} failed: spill entries {lost} reached no durable tier and no "
                         "tier holds them now: their evicted tokens are lost and were dropped from the spill "
                         "index. The previous save is unchanged; save again to save the rest")
    spill.tier_errors = {t: store.stats[t]["errors"] for t in store.durable_tiers}


# -- resume ------------------------------------------------------------------------------------------
def resume(cls, session_id: str, *, store, model, scoring=None):
    """``(cache, attachments)``: the session's current save, every entry verified against the manifest's
    digests before anything is built (see the module docstring). ``cls._from_manifest`` builds the cache."""
    from ..tiers import model_fingerprint

    check_store(store, session_id)
    fingerprint = model_fingerprint(model)
    for attempt in range(3):
        try:
            manifest = _read(store, session_id, MANIFEST_KEY)
        except TierUnavailable as e:  # not a KeyError: a caller that starts afresh on "no save" would overwrite it
            raise TierUnavailable(f"session {session_id!r} cannot be resumed now: {e}; its save may exist, "
                                  "try again once the tier is back") from e
        if manifest is None:
            raise KeyError(f"no saved session {session_id!r} in this store")
        check_manifest(manifest, session_id, fingerprint)
        policy = manifest["scoring"]["type"]
        if scoring is not None and type(scoring).__name__ != policy:  # the save's own policy would be lost
            raise ValueError(f"session {session_id!r} was saved with a {policy} policy; scoring= replaces it with "
                             f"one of the same kind or, left out, the saved one is rebuilt (got {type(scoring).__name__})")
        saved = manifest.get("class")
        if saved not in _names(cls):
            raise ValueError(f"session {session_id!r} was saved from {saved}, not {cls.__name__}: resume it with "
                             f"{saved}.resume ({cls.__name__} would be a name on another policy)")
        try:
            states, attachments = _verified(store, session_id, manifest, fingerprint)
            break
        except IncompleteSave:
            try:
                again = _read(store, session_id, MANIFEST_KEY)
            except (TierUnavailable, DamagedSave):
                again = None
            if attempt == 2 or again is None or again.get("generation") == manifest.get("generation"):
                raise
            # a save committed (and dropped the entries we were reading) meanwhile: resume that one
    cache = cls._from_manifest(manifest, states, store=store, session_id=session_id, model=model, scoring=scoring)
    return cache, attachments


def current_generation(store, session_id: str) -> str | None:
    """The generation of ``session_id``'s current save in ``store`` (None: it has none). Raises
    ``TierUnavailable`` when no durable tier answers, and ``DamagedSave`` when its manifest fails
    verification (a save whose generation cannot be read, not none). A process that holds the session in
    memory compares it with the generation its cache continues (``cache.spill.generation``): another
    writer (a second replica) saved in between when they differ, and the copy in memory is stale."""
    manifest = _read(store, session_id, MANIFEST_KEY)
    return None if manifest is None else manifest.get("generation")


def _names(cls) -> set[str]:
    """``cls`` and its subclasses, by name: the saves ``cls.resume`` continues (a base class continues any of them)."""
    return {cls.__name__}.union(*(_names(sub) for sub in cls.__subclasses__()))


def check_manifest(m: dict, session_id: str, fingerprint: str) -> None:
    """Refuse a manifest of another format or another model, naming what differs."""
    if m.get("format") != SAVE_FORMAT:
        why = {1: "format 1 has no generations or digests, so it cannot be told from a mix of two saves",
               2: "format 2 indexed spilled tokens by time of eviction; this pace_hf reads them by logical page"}
        raise ValueError(
            f"session {session_id!r} was saved in save format {m.get('format')}; this pace_hf resumes format "
            f"{SAVE_FORMAT} only ({why.get(m.get('format'), 'an unknown format')}). Start the session again; "
            "saving from a new cache replaces the old save")
    if m.get("model_fingerprint") != fingerprint:
        raise ValueError(f"session {session_id!r} was saved by another model, config or dtype "
                         f"(fingerprint {m.get('model_fingerprint')}, this model {fingerprint}): its KV cannot be restored")
    if not isinstance(m.get("entries"), dict) or not isinstance(m.get("spill", {}).get("index"), list):
        raise IncompleteSave(f"session {session_id!r}: its manifest is malformed (no entry digests)")


def _verified(store, sid: str, m: dict, fingerprint: str):
    """Every entry ``m`` names, fetched and checked against its digest. Returns the layer states
    ``{layer: (tensors, meta)}`` and the attachments; the spill entries are checked, not kept."""
    gen, damaged = m["generation"], {}
    keys = list(m["entries"])
    got = dict(zip(keys, store.get_many(keys, fingerprint=fingerprint, session_id=sid, damaged=damaged)))
    for key in keys:
        _check_entry(sid, gen, key, got[key], m["entries"][key], damaged)
    spill = versions_of(m["spill"])
    for start in range(0, len(spill), VERIFY_BATCH):
        batch = spill[start:start + VERIFY_BATCH]
        values = store.get_many([key for key, *_ in batch], fingerprint=fingerprint, session_id=sid, damaged=damaged)
        for (key, layer_idx, page, dig), value in zip(batch, values):
            _check_entry(sid, gen, key, value, dig, damaged)
            held = (value[1].get("layer"), value[1].get("page"))
            if held != (layer_idx, page):
                raise IncompleteSave(f"session {sid!r}, save {gen}: spill entry {key!r} is indexed for layer "
                                     f"{layer_idx}, page {page} but holds layer {held[0]}, page {held[1]}")
    states = {int(k[1:].split("/", 1)[0]): got[k] for k in keys if "/state@" in k}
    attachments = {name: got[f"{name}@{gen}"] for name in m.get("attachments", [])}
    return states, attachments


def _check_entry(sid: str, gen: str, key: str, value, expected: str, damaged: dict) -> None:
    if value is None and key in damaged:
        raise DamagedSave(sid, key, *damaged[key])
    if value is None:
        raise IncompleteSave(f"session {sid!r}, save {gen}: entry {key!r} is missing from every tier; "
                             "refusing to resume part of a save")
    try:
        actual = digest(*value, algorithm=digest_algorithm(expected))
    except IntegrityError as e:
        raise IncompleteSave(f"session {sid!r}, save {gen}: entry {key!r} cannot be checked ({e})") from None
    if actual != expected:
        raise IncompleteSave(f"session {sid!r}, save {gen}: entry {key!r} is not the one this save wrote "
                             f"(digest {actual}, the manifest says {expected}): it belongs to another save; "
                             "refusing to resume a mix")
