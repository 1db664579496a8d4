"""Long BFCL sessions, teacher-forced (pace_bench.bfcl_chain): chains of real entries with real backend outputs
in the model's own call format, a free-running probe that leaves the cache exactly as it was, and NLL taken on
the call tokens only."""

import json

import pytest
import torch

pytest.importorskip("bfcl_eval")

from pace_bench import bfcl, bfcl_chain  # noqa: E402
from pace_bench.runner import main  # noqa: E402
from test_runner import _tiny_model_dir  # noqa: E402

# A ChatML template that renders tools and tool calls itself (SmolLM2's own ignores them): the native path.
TOOL_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role if m.role != 'tool' else 'user' }}\n"
    "{%- if m.role == 'system' %}{{ m.content }}{%- if tools %}\n<tools>{%- for t in tools %}\n{{ t | tojson }}"
    "{%- endfor %}\n</tools>{%- endif %}"
    "{%- elif m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- else %}{{ m.content }}{%- for c in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _tiny_model_dir(tmp_path_factory.mktemp("chain") / "model")


@pytest.fixture(scope="module")
def model_and_tokenizer(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def _pool():
    base, long = bfcl.load_entries("base"), bfcl.load_entries("long_context")
    return base[:3] + long[:1]  # long_context_0 is base_0's twin


@pytest.mark.parametrize("native", [False, True])
def test_a_chain_of_three_real_entries_in_the_models_call_format(model_and_tokenizer, native):
    """Three entries (never beside a twin) in one conversation: the docs of every class they use in the system
    message, ``New task.`` before each entry, the ground truth's calls as the template writes tool calls (or,
    where it ignores them, the ``<tool_call>`` JSON its system prompt asks for), and the backends' real outputs."""
    import copy

    _, tok = model_and_tokenizer
    tok = copy.deepcopy(tok)
    if native:
        tok.chat_template = TOOL_TEMPLATE
    chain, = bfcl_chain.draw_chains(tok, tokens=60000, sessions=1, seed=3, pool=_pool())
    ids = [e["id"] for e in chain.entries]
    assert len(ids) == 3 and len({i.rsplit("_", 1)[1] for i in ids}) == 3  # a twin never joins its twin
    assert chain.native is native
    classes = {c for e in chain.entries for c in e["involved_classes"]}
    assert {t["name"] for t in chain.tools} == {d["name"] for c in classes for d in bfcl_chain.class_docs(c)}
    system = tok.decode(chain.template.system_ids)
    assert all(f'"name": "{t["name"]}"' in system for t in chain.tools)
    entry = next(e for e in chain.entries if e["id"].endswith("_0"))  # base_0 or its long_context twin
    turns = list(bfcl_chain.entry_turns(entry, chain.template, chain.docs, "test"))
    try:
        assert turns[0].user.content.startswith("New task.\nMove 'final_report.pdf'")
        block = turns[0].assistant  # cd(folder='document'), mkdir(dir_name='temp'), mv(...)
        text = tok.decode(block.ids)
        assert text.count("<tool_call>") == 3 and text.startswith(chain.template.gen_header)
        jsons = [tok.decode(block.ids[a:b]).strip() for a, b in block.call_spans]
        assert [json.loads(j) for j in jsons] == [
            {"name": "cd", "arguments": {"folder": "document"}}, {"name": "mkdir", "arguments": {"dir_name": "temp"}},
            {"name": "mv", "arguments": {"source": "final_report.pdf", "destination": "temp"}}]
        outputs = turns[0].outputs(chain.template)
        assert json.loads(outputs[0].content) == {"current_working_directory": "document"}  # the backend's own
        assert "<tool_response>" in tok.decode(outputs[0].ids) or not native
        # the next turn's calls run on the state the first turn left: grep finds the moved file's content
        second = turns[1].outputs(chain.template)
        assert "budget analysis" in second[-1].content.lower() or "matching_lines" in second[-1].content
    finally:
        turns[0].backends.close()
    # the same draw gives the same session: every arm reads one trajectory
    again, = bfcl_chain.draw_chains(tok, tokens=60000, sessions=1, seed=3, pool=_pool())
    assert [e["id"] for e in again.entries] == ids and again.tokens == chain.tokens
    # session j is the same whatever --sessions asks for (drawn in order), so a run can grow its sessions
    first, second = bfcl_chain.draw_chains(tok, tokens=int(0.7 * chain.tokens), sessions=2, seed=3, pool=_pool())
    alone, = bfcl_chain.draw_chains(tok, tokens=int(0.7 * chain.tokens), sessions=1, seed=3, pool=_pool())
    assert [e["id"] for e in alone.entries] == [e["id"] for e in first.entries] and second.entries


def _prefilled(model, tok, arm, budget=256):
    """A cache of ``arm`` holding about 1.5K tokens of a session, and the session's next 200 ids."""
    from pace_hf.tiers import HostTier, TieredStore

    torch.manual_seed(1)
    ids = torch.randint(100, 2000, (1700,)).tolist()
    store = TieredStore([HostTier()]) if arm == "pace" else None
    cache = bfcl.make_cache(arm, model, bfcl.BfclSettings(budget=budget, limit=1024, chunk=256), store, "rollback")
    prefill = bfcl_chain.Prefill(model, cache, 256)
    prefill.targets = {p: 0 for p in range(1500, 1700)}  # every later token is scored
    last = prefill.to(ids, 1500)
    return cache, prefill, ids, last, store


@pytest.mark.parametrize("arm", ["full", "h2o", "pace"])
def test_the_probe_rolls_back_exactly(model_and_tokenizer, arm):
    """A probe decodes on a branch; the cache is then bit-equal to what it was, and the trajectory's later
    logits (their NLL and top-1, summed in the same order) equal a run without the probe, bit for bit."""
    from pace_hf import EvictionCache

    model, tok = model_and_tokenizer
    runs = []
    for with_probe in (False, True):
        cache, prefill, ids, last, store = _prefilled(model, tok, arm)
        before = [{k: v.clone() for k, v in layer.tensors().items()} for layer in cache.layers] \
            if isinstance(cache, EvictionCache) else [(lay.keys.clone(), lay.values.clone()) for lay in cache.layers]
        if with_probe:
            text = bfcl_chain.probe(model, cache, last, max_tokens=40, stop_ids=[], tokenizer=tok)
            assert len(tok.encode(text, add_special_tokens=False)) > 20  # it really decoded past the budget's slack
            if isinstance(cache, EvictionCache):
                assert all(torch.equal(b[k], layer.tensors()[k]) for b, layer in zip(before, cache.layers) for k in b)
                assert cache.get_seq_length() == 1500 and cache.binding is not None
            else:
                assert all(torch.equal(k, lay.keys) and torch.equal(v, lay.values) for (k, v), lay in zip(before, cache.layers))
        prefill.to(ids, len(ids))
        runs.append(prefill.nll[0])
        if isinstance(cache, EvictionCache):
            cache.unbind()
        if store is not None:
            store.close()
    assert runs[0] == runs[1] and runs[0][0] == 200


def test_nll_is_taken_over_the_call_tokens_only(model_and_tokenizer):
    """The full cache's teacher-forced call NLL equals a plain forward of the whole trajectory scored at the
    call tokens' positions: every call token counted once, nothing else."""
    model, tok = model_and_tokenizer
    chain, = bfcl_chain.draw_chains(tok, tokens=8000, sessions=1, seed=0, pool=bfcl.load_entries("base")[:1])
    s = bfcl_chain.ChainSettings(limit=4096, chunk=512, probe_tokens=4)
    record = bfcl_chain.play_chain(model, tok, chain, "full", None, s)
    # the trajectory again, by hand: where each call's JSON tokens are
    template, conversation_ids, spans = chain.template, list(chain.template.system_ids), []
    for entry in chain.entries:
        turns = list(bfcl_chain.entry_turns(entry, template, chain.docs, "ref"))
        for turn in turns:
            conversation_ids += turn.user.ids
            if turn.assistant is not None:
                spans += [(len(conversation_ids) + a, len(conversation_ids) + b) for a, b in turn.assistant.call_spans]
                conversation_ids += turn.assistant.ids
            conversation_ids += [i for out in turn.outputs(template) for i in out.ids]
        turns[0].backends.close()
    assert record["tokens"] == len(conversation_ids)
    with torch.no_grad():
        logits = model(torch.tensor([conversation_ids])).logits[0].float()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(conversation_ids[1:]), reduction="none")
    want = [(b - a, float(nll[a - 1:b - 1].sum())) for a, b in spans]
    got = [(c[3], c[4]) for c in record["calls"]]
    assert [n for n, _ in got] == [n for n, _ in want] and sum(n for n, _ in want) < 0.1 * len(conversation_ids)
    assert [x for _, x in got] == pytest.approx([x for _, x in want], rel=1e-4)
    assert len(record["probes"]) == sum(1 for e in chain.entries for t in e["ground_truth"] if t)


def test_a_killed_full_session_resumes_where_it_saved(model_and_tokenizer, tmp_path, monkeypatch, capsys):
    """The full cache saves its progress at each entry's end; a play killed in the third entry takes up from
    the second's end, and its record equals an uninterrupted play's (NLL, top-1 and probes, bit for bit). A
    file of other settings, or a damaged one, is said and ignored: the session starts over, nothing is lost."""
    model, tok = model_and_tokenizer
    chain, = bfcl_chain.draw_chains(tok, tokens=60000, sessions=1, seed=3, pool=_pool())
    s = bfcl_chain.ChainSettings(limit=4096, chunk=512, probe_tokens=4)
    whole = bfcl_chain.play_chain(model, tok, chain, "full", None, s)
    same = lambda r: {k: r[k] for k in ("calls", "probes", "trajectory", "tokens", "peak_cache_bytes")}  # noqa: E731
    real = bfcl_chain.entry_turns

    def killed(settings):
        def in_the_third_entry(entry, *args):
            if entry is chain.entries[2]:
                raise KeyboardInterrupt
            return real(entry, *args)

        monkeypatch.setattr(bfcl_chain, "entry_turns", in_the_third_entry)
        with pytest.raises(KeyboardInterrupt):
            bfcl_chain.play_chain(model, tok, chain, "full", None, settings, progress_dir=tmp_path, progress_every=0)
        monkeypatch.setattr(bfcl_chain, "entry_turns", real)
        saved, = tmp_path.glob("*.pt")
        return saved

    killed(s)
    resumed = bfcl_chain.play_chain(model, tok, chain, "full", None, s, progress_dir=tmp_path, progress_every=0)
    assert resumed["resumed_after_entries"] == 2 and same(resumed) == same(whole)
    assert not list(tmp_path.iterdir())  # the record is whole: its progress is gone
    capsys.readouterr()

    killed(bfcl_chain.ChainSettings(limit=4096, chunk=512, probe_tokens=5))  # another run's file
    again = bfcl_chain.play_chain(model, tok, chain, "full", None, s, progress_dir=tmp_path, progress_every=0)
    assert "ignored: written for another session, arm or settings" in capsys.readouterr().err
    assert "resumed_after_entries" not in again and same(again) == same(whole)

    killed(s).write_bytes(b"not a checkpoint")  # a damaged file
    again = bfcl_chain.play_chain(model, tok, chain, "full", None, s, progress_dir=tmp_path, progress_every=0)
    assert "ignored: unreadable" in capsys.readouterr().err
    assert "resumed_after_entries" not in again and same(again) == same(whole)


def test_pace_plans_its_thread_and_says_which_plan(model_and_tokenizer):
    """The chained suite's plan (tool docs, mentions, thread) is the record's, and each turn's thread is
    planned within its share of B."""
    model, tok = model_and_tokenizer
    chain, = bfcl_chain.draw_chains(tok, tokens=8000, sessions=1, seed=0, pool=bfcl.load_entries("base")[:1])
    s = bfcl_chain.ChainSettings(limit=4096, chunk=512, probe_tokens=4, plan=(0.25, 0.0, 0.5))
    record = bfcl_chain.play_chain(model, tok, chain, "pace", 512, s, probes=False)
    turns = sum(1 for e in chain.entries for _ in e["question"]) + len(chain.entries)  # each entry's "New task." too
    assert record["plan"] == [0.25, 0.0, 0.5] and record["probes"] == [] and record["layout"] == bfcl_chain.LAYOUT
    assert 0 < record["planned"]["planned_thread_tokens"] <= turns * 256
    assert record["planned"]["planned_mention_tokens"] == 0


def test_a_bounded_baseline_renumbers_under_the_limit_where_its_baseline_does_not(model_and_tokenizer, monkeypatch):
    """The ablation's arms (a baseline with PACE's bounded positions) play a chain like any arm; their
    next position stays under L, their record names the layout, and the plain baseline's runs past L."""
    model, tok = model_and_tokenizer
    chain, = bfcl_chain.draw_chains(tok, tokens=8000, sessions=1, seed=0, pool=bfcl.load_entries("base")[:1])
    s = bfcl_chain.ChainSettings(limit=2048, chunk=512, probe_tokens=4, plan=bfcl_chain.PLAN)
    made = []
    make_cache = bfcl.make_cache
    monkeypatch.setattr(bfcl, "make_cache", lambda *a, **k: made.append(make_cache(*a, **k)) or made[-1])
    records = {arm: bfcl_chain.play_chain(model, tok, chain, arm, 512, s, probes=False)
               for arm in ("positions_only", "h2o")}
    bounded, plain = made
    assert records["positions_only"]["tokens"] == records["h2o"]["tokens"] > 2048
    assert bounded.bounded and bounded.next_position < 2048 and bounded.get_seq_length() == records["h2o"]["tokens"]
    assert not plain.bounded and plain.next_position == records["h2o"]["tokens"]
    assert records["positions_only"]["layout"] == bfcl_chain.LAYOUT and "layout" not in records["h2o"]
    assert records["positions_only"]["trajectory"] == records["h2o"]["trajectory"]
    assert "| positions_only | 1 |" in bfcl_chain.table(list(records.values()))


def test_resume_plays_again_what_another_plan_or_layout_played():
    plan, layout = (0.0, 0.0, 0.25), bfcl_chain.LAYOUT
    records = [{"arm": "pace", "plan": list(plan), "layout": layout}, {"arm": "pace", "plan": [0.5, 0.25, 0.0], "layout": layout},
               {"arm": "pace", "plan": list(plan)}, {"arm": "pace_retrieval", "layout": layout}, {"arm": "pace_retrieval"},
               {"arm": "h2o"}, {"arm": "full"}]
    assert bfcl_chain.stale(records, ["pace", "pace_retrieval", "h2o"], plan) == [records[1], records[2], records[4]]
    assert bfcl_chain.stale(records, ["h2o", "full"], plan) == []  # an arm not played keeps its records


def rec(arm, budget, nlls, rights):
    """A session's record of 8 entries, one call each: ``nlls`` its calls' summed NLL, ``rights`` its probes."""
    return {"session_id": "chain0-0", "arm": arm, "budget": budget, "trajectory": "t", "tokens": 1000, "probe": 0,
            "entries": [f"multi_turn_{'long_context' if e >= 6 else 'base'}_{e}" for e in range(8)],
            "calls": [[e, 0, 0, 10, nll, 5, 1.0] for e, nll in enumerate(nlls)],
            "probes": [[e, 0, {"name": True, "args": bool(ok), "exec": bool(ok), "text": ""}] for e, ok in enumerate(rights)],
            "peak_cache_bytes": 1 << 20, "full_cache_bytes": 2 << 20, "prefill_seconds": 1, "probe_seconds": 1, "cpu_seconds": 2}


def test_the_table_pairs_entries_and_tests_them():
    """NLL ratio to the full cache over paired entries with its bootstrap interval; sign tests by entry."""
    records = [rec("full", None, [10.0] * 8, [1] * 8), rec("h2o", 2048, [20.0] * 8, [0] * 8),
               rec("pace", 2048, [11.0] * 7 + [30.0], [1] * 7 + [0])]
    ratio, lo, hi = bfcl_chain.bootstrap_ratio([11.0] * 7 + [30.0], [10.0] * 8)
    assert ratio == pytest.approx(107 / 80) and lo < ratio < hi
    text = bfcl_chain.table(records)
    assert "| pace | 1 | 8 | 80 |" in text and "7/8" in text
    assert "pace against h2o, 8 entries: call NLL: better on 7, worse on 1, tied 0 (p = 0.07)" in text
    assert "H2O's NLL excess over the full cache is 3.0x PACE's (+1.000 against +0.337)" in text
    assert ("pace base 1.10, long_context 2.05, first half 1.10, second half 1.57" in text  # 66 / 60, 41 / 20, 63 / 40
            and "h2o base 2.00, long_context 2.00" in text)


def test_bad_settings_are_refused_before_anything_loads(nothing_loads, capsys):
    for argv, said in ((["--budgets", "64"], "cannot hold"), (["--budgets", "2048,x"], "integers"),
                       (["--budgets", "4096", "--limit", "6000"], "--limit > the largest of --budgets + --chunk"),
                       (["--arms", "snapkv_bounded", "--budgets", "4096", "--limit", "6000"], "(snapkv_bounded) need --limit"),
                       (["--plan", "0.5,0.25"], "three shares"), (["--plan", "0.5,0.5,0.5"], "at most 1"),
                       (["--plan", "a,b,c"], "three shares")):
        with pytest.raises(SystemExit):
            main(["--suite", "bfcl-chain", *argv])
        assert said in capsys.readouterr().err


def test_a_run_of_two_budgets_keeps_both_budgets_records(tmp_path):
    """Records were told apart by arm, session and probe: the merge of a ``--budgets 2048,4096`` run's shards
    (and its resume, and ``--report``) kept each arm's B = 2,048 record of a session and dropped its B = 4,096
    one. The budget is part of what a record is."""
    from pace_bench.records import read_jsonl
    from pace_bench.suite import played

    records = [rec("full", None, [10.0] * 8, [1] * 8), rec("h2o", 2048, [20.0] * 8, [0] * 8),
               rec("h2o", 4096, [12.0] * 8, [1] * 8)]
    (tmp_path / "probes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    (tmp_path / "probes.rank1.jsonl").write_text(json.dumps(records[2]) + "\n" + json.dumps(records[1]) + "\n")
    (tmp_path / "run.json").write_text("{}")
    kept, _ = played(tmp_path, "bfcl-chain", "records")
    assert kept == records and read_jsonl(tmp_path / "probes.rank1.jsonl") == [records[2], records[1]]
    text = bfcl_chain.table(kept)
    assert "**B = 2,048**" in text and "**B = 4,096**" in text and "| h2o | 1 | 8 | 80 | 1.200 | 1.200 [" in text
