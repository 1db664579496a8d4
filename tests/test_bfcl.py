"""The BFCL multi-turn suite (pace_bench.bfcl): bfcl-eval's own data, backends and checker, wired so that
they can fail, and one entry played end to end through the agent loop."""

import json

import pytest

pytest.importorskip("bfcl_eval")

from pace_bench import bfcl  # noqa: E402
from pace_bench.runner import main  # noqa: E402
from test_runner import _tiny_model_dir  # noqa: E402


def _entry(category="base", index=0):
    return bfcl.load_entries(category)[index]


@pytest.mark.parametrize("category", ["base", "long_context"])
def test_the_ground_truth_passes_bfcls_checker_and_one_wrong_call_fails_it(category):
    entry = _entry(category)
    truth = entry["ground_truth"]
    backends = bfcl.Backends(entry, "truth")
    try:
        assert backends.check([[turn] for turn in truth], forced=False) == {"valid": True}
    finally:
        backends.close()
    wrong = [list(turn) for turn in truth]
    wrong[0][1] = "mkdir(dir_name='not_temp')"  # the ground truth's mkdir(dir_name='temp'), another name
    backends = bfcl.Backends(entry, "wrong")
    try:
        verdict = backends.check([[turn] for turn in wrong], forced=False)
        assert not verdict["valid"] and verdict["error_type"] == "multi_turn:instance_state_mismatch"
        # stopped early: BFCL's force-terminated failure, whatever was called
        assert backends.check([[turn] for turn in truth[:2]], forced=True)["error_type"] == "multi_turn:force_terminated"
    finally:
        backends.close()
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    assert not [k for k in vars(multi_turn_utils) if k.startswith("pace_bench_")]  # no play's state outlives it


def test_calls_are_read_leniently_and_only_identifiers_reach_eval():
    names = {"cd", "mv", "sort"}
    fenced = 'Sure.\n```json\n{"name": "mv", "arguments": {"source": "a.txt", "destination": "tmp"}}\n```'
    assert [c.source() for c in bfcl.parse_calls(fenced, names)] == ["mv(source='a.txt',destination='tmp')"]
    tagged = '<tool_call>\n{"name": "cd", "arguments": "{\\"folder\\": \\"document\\"}"}\n</tool_call>'
    assert [c.source() for c in bfcl.parse_calls(tagged, names)] == ["cd(folder='document')"]
    listed = '[{"function": "cd", "parameters": {"folder": ".."}}, {"name": "move_file", "arguments": {}}]'
    assert [c.name for c in bfcl.parse_calls(listed, names)] == ["cd", "move_file"]  # a wrong name is still a call
    python = "[cd(folder='temp'), sort('final_report.pdf')] then print(1) and (see above)"
    assert [c.source() for c in bfcl.parse_calls(python, names)] == ["cd(folder='temp')", "sort('final_report.pdf')"]
    assert bfcl.parse_calls("I have moved the file (as asked).", names) == []
    assert bfcl.parse_calls("cd(folder=__import__('os').getcwd())", names) == []  # not a literal: no call
    hostile = bfcl.parse_calls('{"name": "cd", "arguments": {"x) or exit(": 1}}', names)
    assert hostile and hostile[0].source() is None  # a key that is no identifier never reaches eval


def test_calls_kept_counts_only_what_the_full_cache_executed():
    """Fidelity counts a turn where neither arm called anything as equal; calls_kept does not: it counts
    the full cache's calls (a multiset per turn) that the arm executed at the same turn."""
    full = {"calls": [[["cd(folder='a')"], ["ls()"]], [], [["ls()"]]]}
    arm = {"calls": [[["ls()"], ["ls()"]], [], [["cd(folder='a')"]]]}
    assert bfcl.fidelity(arm, full) == (1, 3)  # only the empty turn is "the same"
    assert bfcl.calls_kept(arm, full) == (1, 3)  # one ls() at turn 0; the twin and the wrong turn's call are not
    assert bfcl.calls_kept({"calls": [[]]}, {"calls": [[], []]}) == (0, 0)
    assert bfcl.calls_kept({"calls": [[["ls()"]]]}, {"calls": [[["ls()"]], [["pwd()"]]]}) == (1, 2)  # a turn not reached


def test_arms_are_compared_with_h2o_entry_by_entry_and_twins_are_found():
    """The paired line counts entries, not calls (an entry's calls hang together), and says the sign test's p;
    the twins line finds long_context entries that played exactly as their base twins."""
    def rec(sid, arm, calls, tokens=100):
        return {"session_id": sid, "arm": arm, "category": sid.rsplit("_", 1)[0].removeprefix("multi_turn_"),
                "calls": calls, "tokens": tokens}
    two = [[["ls()"], ["cd(folder='a')"]]]
    records = [rec(f"multi_turn_base_{i}", "full", two) for i in range(6)]
    records += [rec(f"multi_turn_base_{i}", "h2o", [[]]) for i in range(6)]
    records += [rec(f"multi_turn_base_{i}", "pace", two if i < 5 else [[]]) for i in range(6)]
    records += [rec(f"multi_turn_base_{i}", "pace_retrieval", [[]]) for i in range(6)]
    line = bfcl.against_h2o(records)
    assert "pace more on 5, fewer on 0, as many on 1 (sign test p = 0.062)" in line
    assert "pace_retrieval more on 0, fewer on 0, as many on 6 (sign test p = 1)" in line
    assert bfcl.long_context_twins(records) == ""  # no long_context entries
    records += [rec("multi_turn_long_context_0", "full", two), rec("multi_turn_long_context_1", "full", two, tokens=900)]
    assert bfcl.long_context_twins(records).startswith("Under the full cache, 1 of 2 long_context entries")


def test_held_out_categories_are_refused_before_anything_loads(nothing_loads, capsys):
    for held in ("miss_param", "multi_turn_composite"):
        with pytest.raises(SystemExit):
            main(["--suite", "bfcl", "--categories", held])
        assert "held out" in capsys.readouterr().err
    with pytest.raises(ValueError, match="held out"):
        bfcl.load_entries("miss_param")


def test_the_planner_reads_only_the_conversation():
    """Tool docs the turn's words match, and windows of earlier messages that name what the turn names."""
    from pace_bench.models import load_tokenizer
    from pace_hf.chat import DEFAULT_SYSTEM, ChatTemplate

    tok = load_tokenizer("smollm2-135m")
    entry = _entry()
    tools, _ = bfcl.tool_docs(entry)
    content, native = bfcl.system_with_tools(tok, DEFAULT_SYSTEM, tools)
    assert not native and '"name": "mkdir"' in content  # SmolLM2's template ignores tools: Qwen's tool section
    template = ChatTemplate(tok, content)
    spans = bfcl.tool_spans(template, tools)
    assert all(s is not None for s in spans)
    mv = spans[[t["name"] for t in tools].index("mv")]
    assert '"name": "mv"' in tok.decode(template.system_ids[mv[0]:mv[1]])
    planner = bfcl.TurnPlanner(tools, spans, budget=1024)
    conversation = bfcl.Conversation(template)
    conversation.add("user", "List the files here.")
    conversation.add("tool", "['notes.txt', 'final_report.pdf', 'archive']")
    turn = conversation.add("user", entry["question"][0][0]["content"])  # "Move 'final_report.pdf' ... 'temp'"
    assert {"mv", "mkdir"} <= {planner.names[i] for i in planner.tools_for(turn.content)[:3]}
    (start, end), = planner.mentions(conversation, turn)  # the tool output that names the file
    assert conversation.messages[1].start <= start < end <= conversation.messages[1].end
    assert "final_report" in tok.decode(conversation.ids[start:end])
    assert planner.thread(conversation, turn) == []  # thread_share 0: the free-running suite plans none
    sizes = [m.end - m.start for m in conversation.messages]
    room = sizes[2] + sizes[1] + sizes[0] - 1  # the turn and the tool output fit, the first turn does not
    threaded = bfcl.TurnPlanner(tools, spans, budget=room, tool_share=0, mention_share=0, thread_share=1.0)
    assert threaded.thread(conversation, turn) == [(m.start, m.end) for m in conversation.messages[:0:-1]]
    conversation.add("user", "And now?")
    assert threaded.thread(conversation, conversation.messages[2]) == [(m.start, m.end) for m in conversation.messages[2:0:-1]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _tiny_model_dir(tmp_path_factory.mktemp("bfcl") / "model")


def test_one_entry_plays_end_to_end_and_resumes(model_dir, tmp_path, monkeypatch):
    """A tiny random model prefills every step through each arm's cache; its replies are replaced by the
    ground truth's calls (in BFCL's own Python form) and then a reply with no call, so the backends really
    run and bfcl-eval's checker passes both arms; the records, the table, a resume and --report follow."""
    import pace_hf.session as session
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    truth = _entry()["ground_truth"]
    script = []
    for turn in truth:
        script += ["[" + ", ".join(turn) + "]", "Done."]
    played = {"replies": 0}
    real = session.generate_reply

    def scripted(model, ids, cache, **kw):
        real(model, ids, cache, **dict(kw, max_new_tokens=1))  # the real prefill; the one new token is not fed
        text = script[played["replies"] % len(script)]
        played["replies"] += 1
        return tok.encode(text, add_special_tokens=False)

    monkeypatch.setattr(session, "generate_reply", scripted)
    out = tmp_path / "run"
    argv = ["--suite", "bfcl", "--model", model_dir, "--categories", "base", "--entries", "1", "--arms", "full,pace",
            "--budget", "256", "--limit", "1024", "--chunk", "512", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    records = [json.loads(x) for x in (out / "probes.jsonl").read_text().splitlines()]
    assert [r["arm"] for r in records] == ["full", "pace"] and played["replies"] == 2 * len(script)
    for r in records:
        assert r["valid"] and r["turns_played"] == len(truth) and r["steps"] == [2] * len(truth)
        assert bfcl.turn_calls(r) == [[c.replace(", ", ",") for c in turn] for turn in truth]  # bfcl-eval's spelling
        assert r["tokens"] > r["system_tokens"] > 3000 and r["peak_cache_bytes"] > 0
    full, pace = records
    assert pace["peak_cache_bytes"] < full["peak_cache_bytes"]  # B=256 of about 6K tokens
    assert all(p["planned_tool_tokens"] > 0 for p in pace["planned"])
    table = (out / "table.md").read_text()
    assert "**multi_turn_base**" in table and "| pace | 1 | 1/1 = 100%" in table
    calls = sum(len(turn) for turn in truth)
    assert f"| {len(truth)}/{len(truth)} (100%) | {calls}/{calls} (100%) | 1/1 |" in table  # fidelity, calls, passes kept
    assert main(argv + ["--resume"]) == 0  # both pairs kept: nothing played
    assert played["replies"] == 2 * len(script)
    (out / "table.md").unlink()
    assert main(["--suite", "bfcl", "--report", "--out", str(out)]) == 0  # plays nothing: the same table again
    assert (out / "table.md").read_text() == table and played["replies"] == 2 * len(script)
    with pytest.raises(SystemExit, match="bfcl --report: .* holds no played entries"):
        main(["--suite", "bfcl", "--report", "--out", str(tmp_path / "nothing")])
    with pytest.raises(SystemExit, match="other budget"):
        main([a if a != "256" else "384" for a in argv] + ["--resume"])
    other = "bfloat16" if json.loads((out / "run.json").read_text())["dtype"] == "float32" else "float32"
    with pytest.raises(SystemExit, match="other dtype"):  # --dtype auto picks by CPU: a run never mixes them
        main(argv + ["--resume", "--dtype", other])


def test_stop_repeats_ends_a_looping_turn_without_running_the_repeat(model_dir, tmp_path, monkeypatch):
    """With --stop-repeats, a reply equal to the turn's previous one ends the turn: it is not executed again
    (the ground truth's calls ran once, so the entry still passes) and the record counts the loop."""
    import pace_hf.session as session
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    truth = _entry()["ground_truth"]
    script = [r for turn in truth for r in ["[" + ", ".join(turn) + "]"] * 2]
    played = {"replies": 0}
    real = session.generate_reply

    def scripted(model, ids, cache, **kw):
        real(model, ids, cache, **dict(kw, max_new_tokens=1))
        text = script[played["replies"]]
        played["replies"] += 1
        return tok.encode(text, add_special_tokens=False)

    monkeypatch.setattr(session, "generate_reply", scripted)
    out = tmp_path / "run"
    assert main(["--suite", "bfcl", "--model", model_dir, "--categories", "base", "--entries", "1", "--arms", "full",
                 "--budget", "256", "--limit", "1024", "--chunk", "512", "--no-progress", "--stop-repeats",
                 "--out", str(out)]) == 0
    (r,) = [json.loads(x) for x in (out / "probes.jsonl").read_text().splitlines()]
    assert r["valid"] and r["looped"] == len(truth) and r["steps"] == [2] * len(truth)
    assert bfcl.turn_calls(r) == [[c.replace(", ", ",") for c in turn] for turn in truth]
    assert "(--stop-repeats)" in (out / "table.md").read_text()
