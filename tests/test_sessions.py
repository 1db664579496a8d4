import json

import pytest

from pace_bench import answer_suffix_ids, build_session, load_sessions, to_parquet
from pace_bench import sessions as S
from pace_bench.models import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


def _ids(x):
    return x["input_ids"] if hasattr(x, "keys") else list(x)


SECRET = "5ec2e7" * 6  # 36 hex digits: a fixed session secret, for the tests that rebuild a session


def test_deterministic_and_seeds_differ(tok):
    a = build_session(tok, seed=7, total_tokens=3000, secret=SECRET)
    b = build_session(tok, seed=7, total_tokens=3000, secret=SECRET)
    c = build_session(tok, seed=8, total_tokens=3000, secret=SECRET)
    assert a == b and a["secret"] == SECRET
    assert a["context_ids"] != c["context_ids"]
    assert [f["value"] for f in a["facts"]] != [f["value"] for f in c["facts"]]


def _facts(row):
    return {f["name"]: f["value"] for f in row["facts"]}


def test_the_seed_and_the_generators_code_do_not_give_the_facts(tok):
    """Issue 41, item 4: a program that knows the generator's code and the seed (from the filler it was
    shown, say) cannot compute its session's facts: they come from a 128-bit secret drawn when the session
    is made, recorded in the row (outside every sandbox) and nowhere in what the metric runs. The same
    seed gives another session each time; the recorded secret gives the same one back."""
    import random

    from pace_bench.build import GENERATOR_VERSION, session_rng
    from pace_bench.facts import sample_facts

    rows = [build_session(tok, seed=0, total_tokens=1200) for _ in range(6)]
    secrets_ = {r["secret"] for r in rows}
    assert len(secrets_) == 6 and all(len(s) == 32 and int(s, 16) >= 0 for s in secrets_)
    assert len({json.dumps(_facts(r), sort_keys=True) for r in rows}) > 1  # the seed alone does not fix them
    # What a program could compute from the code and the seed: the old derivation (no secret), and the
    # new one with every secret it could guess from public data. None gives a row's facts.
    guesses = [sample_facts(random.Random(f"pace-session:{v}:0:0")) for v in ("13", GENERATOR_VERSION)]
    guesses += [sample_facts(session_rng(0, 0, s)) for s in ("0" * 32, "f" * 32, SECRET)]
    for r in rows:
        assert all(_facts(r) != g for g in guesses)
        # what a sandboxed run is given (the grading record: preamble, calls) never holds the secret
        assert all(r["secret"] not in p["reference"] and r["secret"] not in p["prompt"] for p in r["probes"])
        again = build_session(tok, seed=0, total_tokens=1200, secret=r["secret"])
        assert again == r  # reproducible from the recorded secret
    with pytest.raises(ValueError, match="128 bits"):
        build_session(tok, seed=0, total_tokens=1200, secret="1234")


def test_spans_point_at_the_facts(tok):
    for seed in range(6):
        row = build_session(tok, seed=seed, total_tokens=2500, distance=800)
        assert {f["name"] for f in row["facts"]} == set(S.FACT_NAMES)
        for f in row["facts"]:
            text = tok.decode(row["context_ids"][f["start"]:f["end"]])
            assert f["value"] in text, (f, text)
            assert len(text) <= len(f["value"]) + 4  # tight: the value plus a leading space/quote
            # the fact's span lies inside the user turn of its definition step
            turn = next(t for t in row["turns"] if t["step"] == f["step"] and t["role"] == "user")
            assert turn["kind"] == "definition" and turn["start"] <= f["start"] < f["end"] <= turn["end"]


def test_ids_equal_the_chat_template(tok):
    row, messages = build_session(tok, seed=3, total_tokens=4000, distance=1500, return_messages=True)
    assert _ids(tok.apply_chat_template(messages, tokenize=True)) == row["context_ids"]
    convo = list(messages)
    ids = list(row["context_ids"])
    for probe in row["probes"]:
        convo.append({"role": "user", "content": probe["prompt"]})
        full = _ids(tok.apply_chat_template(convo, tokenize=True, add_generation_prompt=True))
        ids += probe["prompt_ids"]
        prefix = probe["answer_prefix"]
        if prefix:  # the start of the answer, given in the prompt
            assert tok.decode(ids) == tok.decode(full) + prefix
            cont = convo + [{"role": "assistant", "content": prefix}]
            assert ids == _ids(tok.apply_chat_template(cont, tokenize=True, continue_final_message=True))
        else:  # after an answer, compare text: generated ids need not be the canonical tokenization
            assert tok.decode(ids) == tok.decode(full)
        if probe is row["probes"][0]:
            assert ids[:len(row["context_ids"])] == row["context_ids"]
        answer = "    return raw\n```" if prefix else "```python\nx = 1\n```"
        convo.append({"role": "assistant", "content": prefix + answer})
        ids += tok(answer, add_special_tokens=False)["input_ids"] + row["turn_end_ids"]
        assert tok.decode(ids) == tok.decode(_ids(tok.apply_chat_template(convo, tokenize=True)))
    assert row["turn_end_ids"] == answer_suffix_ids(tok)
    assert tok.decode(row["turn_end_ids"]) == "<|im_end|>\n"


def test_steps_turns_and_blueprint(tok):
    row = build_session(tok, seed=1, total_tokens=6000, distance=2000)
    users = [t for t in row["turns"] if t["role"] == "user"]
    assert [t["step"] for t in users] == list(range(len(users)))
    kinds = [t["kind"] for t in users]
    assert kinds.count("definition") == 3 and kinds[0] == "filler" and kinds[-1] == "filler"
    assert [p["step"] for p in row["probes"]] == [len(users), len(users) + 1, len(users) + 2]
    assert [p["name"] for p in row["probes"]] == ["fee_for", "settle", "module"]
    fee, settle, module = (p["step"] for p in row["probes"])
    bp = row["blueprint"]
    assert [b["readers"] for b in bp] == [[settle, module], [settle, module], [fee, module]]
    assert bp[0]["start"] == row["definitions_start"] and bp[-1]["end"] == row["definitions_end"]
    for f in row["facts"]:
        assert any(b["start"] <= f["start"] and f["end"] <= b["end"] for b in bp)
    # turns tile the context
    pos = 0
    for t in row["turns"]:
        assert t["start"] == pos
        pos = t["end"]
    assert pos == row["context_len"] == len(row["context_ids"])
    for p in row["probes"]:
        ref = json.loads(p["reference"])
        assert ref["probe"] == p["name"] and ref["checks"] == json.loads(p["checks"])
        assert ref["recall"] == p["recall"]


@pytest.mark.parametrize("total,distance", [(8192, None), (8192, 2000), (6000, 500), (12000, 6000)])
def test_total_and_distance_honoured(tok, total, distance):
    row = build_session(tok, seed=2, total_tokens=total, distance=distance)
    assert abs(row["context_len"] - total) <= 64
    if distance is None:
        assert row["definitions_start"] == row["turns"][0]["end"]  # right after the system prompt
        assert row["distance"] == row["context_len"] - row["definitions_end"]
    else:
        assert abs(row["distance"] - distance) <= 64
    assert row["distance"] == row["context_len"] - row["definitions_end"]
    users = [t for t in row["turns"] if t["role"] == "user" and t["kind"] == "filler"]
    assert all(t["end"] - t["start"] <= 2000 for t in users)


def test_filler_modes(tok):
    non = build_session(tok, seed=4, total_tokens=20000, filler_mode="non-repeating")
    rep = build_session(tok, seed=4, total_tokens=20000, filler_mode="repeating")
    assert len(set(non["filler_files"])) == len(non["filler_files"])
    assert len(set(rep["filler_files"])) <= S.REPEATING_SET_SIZE < len(rep["filler_files"])
    assert non["context_ids"] != rep["context_ids"]
    with pytest.raises(ValueError):
        build_session(tok, filler_mode="sometimes")


def test_filler_is_stdlib_source(tok):
    import sysconfig
    from pathlib import Path

    row, messages = build_session(tok, seed=5, total_tokens=5000, return_messages=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for rel in row["filler_files"]:
        assert (stdlib / rel).is_file()
    filler = [m for m in messages if m["role"] == "user" and m["content"].startswith("Here is the next file")]
    assert filler
    first = filler[0]["content"]
    code = first.split("```python\n", 1)[1].rsplit("```", 1)[0]
    assert code in (stdlib / row["filler_files"][0]).read_text()


def test_fingerprint_changes_with_every_knob(tok):
    base = dict(n_sessions=3, total_tokens=8192, distance=None, seed=0, filler_mode="non-repeating",
                chunk_tokens=2000)
    fp = S.session_fingerprint(tok, **base)
    assert fp == S.session_fingerprint(tok, **base)
    changes = dict(n_sessions=4, total_tokens=8000, distance=1000, seed=1, filler_mode="repeating",
                   chunk_tokens=1000, secret=SECRET)
    seen = {fp}
    for k, v in changes.items():
        other = S.session_fingerprint(tok, **dict(base, **{k: v}))
        assert other not in seen, k
        seen.add(other)


def test_fingerprint_changes_with_tokenizer_and_version(tok, monkeypatch):
    fp = S.session_fingerprint(tok)
    monkeypatch.setattr(S, "GENERATOR_VERSION", "test-bump")
    assert S.session_fingerprint(tok) != fp
    monkeypatch.undo()
    monkeypatch.setattr(S, "tokenizer_identity", lambda t: "another tokenizer")
    assert S.session_fingerprint(tok) != fp
    monkeypatch.undo()
    monkeypatch.setattr(S, "filler_identity", lambda: "another python")
    assert S.session_fingerprint(tok) != fp


def test_load_sessions_dataset_and_parquet(tok, tmp_path):
    ds = load_sessions(tok, n_sessions=2, total_tokens=2500, seed=11, cache_dir=str(tmp_path / "cache"), secret=SECRET)
    assert len(ds) == 2
    assert ds._fingerprint == S.session_fingerprint(tok, n_sessions=2, total_tokens=2500, seed=11, secret=SECRET)
    row = ds[0]
    assert row == build_session(tok, seed=11, total_tokens=2500, session_index=0, secret=SECRET)
    assert ds[1]["context_ids"] != row["context_ids"]
    # cached: a second call with the same secret reads the same data back; without one, new sessions
    again = load_sessions(tok, n_sessions=2, total_tokens=2500, seed=11, cache_dir=str(tmp_path / "cache"), secret=SECRET)
    assert again[0] == row
    fresh = load_sessions(tok, n_sessions=1, total_tokens=2500, seed=11, cache_dir=str(tmp_path / "cache"))
    assert fresh[0]["secret"] != SECRET and fresh[0]["secret"] == fresh[0]["secret"].lower()
    path = to_parquet(ds, tmp_path / "s.parquet")
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    assert table.num_rows == 2 and "context_ids" in table.column_names and "probes" in table.column_names


def test_checks_are_well_formed(tok):
    row = build_session(tok, seed=0, total_tokens=1200)
    facts_with_checks = set()
    for p in row["probes"]:
        for c in json.loads(p["checks"]):
            assert set(c) == {"name", "expr", "expected", "fact"}
            compile(c["expr"], "<check>", "eval")
            json.dumps(c["expected"])
            if c["fact"]:
                facts_with_checks.add(c["fact"])
    assert facts_with_checks == set(S.FACT_NAMES)


@pytest.mark.parametrize("knobs,match", [
    (dict(total_tokens=10), "shorter than the system prompt and the definitions"),
    (dict(total_tokens=-500), "total_tokens must be a positive int"),
    (dict(total_tokens=3000.0), "total_tokens must be a positive int"),
    (dict(total_tokens=3000, distance=10**6), "distance=1000000 does not fit"),
    (dict(total_tokens=3000, distance=-1), "distance must be None or an int >= 0"),
    (dict(total_tokens=3000, distance=1.5), "distance must be None or an int >= 0"),
    (dict(total_tokens=3000, chunk_tokens=0), "chunk_tokens must be an int >= 128"),
])
def test_silent_inputs_get_clear_errors(tok, knobs, match):
    """Issue 13, item 10: a knob that would make another session than asked is an error, not a clip."""
    with pytest.raises(ValueError, match=match):
        build_session(tok, **knobs)


def test_load_sessions_checks_its_knobs_before_generating(tok, tmp_path):
    for n in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match="n_sessions must be an int >= 1"):
            load_sessions(tok, n_sessions=n, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="shorter than the system prompt"):
        load_sessions(tok, n_sessions=2, total_tokens=10, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="does not fit"):
        load_sessions(tok, n_sessions=2, total_tokens=3000, distance=10**6, cache_dir=str(tmp_path))
    assert not list(tmp_path.rglob("*.arrow"))  # nothing was generated
    # the largest distance that fits is honoured, not clipped
    fixed = S.fixed_tokens(tok, 0, 0, SECRET)
    row = build_session(tok, total_tokens=3000, distance=3000 - fixed, secret=SECRET)
    assert row["definitions_start"] == row["turns"][0]["end"]


def test_a_run_of_the_old_generator_is_refused_by_name_and_the_secret_is_kept(tmp_path):
    """A run made before the secret (generator 13: run.json without one) is refused on --resume with a
    message that names its format; a new run records its secret, and --resume reads it back."""
    from types import SimpleNamespace

    from pace_bench.runner import run_secret

    (tmp_path / "run.json").write_text(json.dumps({"seed": 0, "model": "smollm2-135m"}))
    with pytest.raises(SystemExit, match="generator 13 or older"):
        run_secret(SimpleNamespace(resume=True, secret=None), tmp_path, True)
    fresh = run_secret(SimpleNamespace(resume=False, secret=None), tmp_path, True)
    assert len(fresh) == 32 and (tmp_path / "secret").read_text().strip() == fresh
    assert run_secret(SimpleNamespace(resume=False, secret=None), tmp_path, False) == fresh  # another process
    (tmp_path / "run.json").write_text(json.dumps({"secret": fresh}))
    assert run_secret(SimpleNamespace(resume=True, secret=None), tmp_path, True) == fresh
    with pytest.raises(SystemExit, match="128 bits"):
        run_secret(SimpleNamespace(resume=False, secret="abc"), tmp_path, True)
