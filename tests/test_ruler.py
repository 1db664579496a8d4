"""The RULER suite: lm-eval's own samples and scores, both settings, several needles per saved context."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_runner import _tiny_model_dir  # noqa: E402

from pace_bench import ruler  # noqa: E402
from pace_bench.runner import main  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="needs lm-eval (the [bench] extra)")

# B // 4 = 288 tokens: two 144-token pages (the needle's, and the task instruction's, which matches too)
SMALL = ["--budget", "1152", "--limit", "1536", "--chunk", "256", "--tool-tokens", "256", "--max-new-tokens", "4"]
NEEDLE_LINE = re.compile(r"^One of the special magic numbers for (.+) is: (\d+)\.$", re.M)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _tiny_model_dir(tmp_path_factory.mktemp("ruler") / "model")


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "niah_single_9"], "unknown task(s) niah_single_9"),
    (["--tasks", "vt", "--lengths", "512"], "vt needs >= 1024"),
    (["--arms", "pace_plan", "--limit", "4096"], "need --limit > --budget + --chunk"),
    (["--lengths", "many"], "comma-separated token counts"),
    (["--needles", "0"], "must be >= 1, got 0"),
    (["--needles", "9"], "a NIAH context carries at most 8 needles"),
])
def test_bad_input_is_an_error_before_anything_loads(nothing_loads, capsys, argv, message):
    with pytest.raises(SystemExit):
        main(["--suite", "ruler", *argv])
    assert message in capsys.readouterr().err


def test_without_lm_eval_the_suite_says_so_before_anything_loads(nothing_loads, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    with pytest.raises(SystemExit):
        main(["--suite", "ruler"])
    assert "lm-eval is not installed" in capsys.readouterr().err


def test_samples_and_scores_are_lm_evals_own(tok):
    sample = ruler.generate("niah_single_1", 1024, 1, tok, seed=0)[0]
    assert sample["max_length"] == 1024 and sample["outputs"][0] in sample["input"]
    [doc] = sample["questions"]  # one needle: the sample's own question
    assert ruler.score(doc, f" {sample['outputs'][0]}.") == 1.0 and ruler.score(doc, " 12.") == 0.0
    context, question = ruler.split_question(sample)
    assert question.startswith("What is the special magic number") and sample["outputs"][0] in context
    # RULER's one-question wording, as this suite writes it for any needle, is lm-eval's own
    asked = ruler.niah_questions(sample)
    assert asked == [{"question": question, "gen_prefix": sample["gen_prefix"], "outputs": sample["outputs"]}]


def test_a_sample_does_not_depend_on_what_the_process_did_before(model_dir):
    """A process's first call imports lm-eval's generator modules, whose import draws from the global random
    state; a resumed run's first call must still give the sample the stopped run answered. Run in a fresh
    process, where nothing has imported them yet."""
    code = f"""
import random, sys
from transformers import AutoTokenizer
from pace_bench import ruler
tok = AutoTokenizer.from_pretrained({str(model_dir)!r})
assert not any(m.startswith("lm_eval.tasks.ruler.") for m in sys.modules)
for task in ("niah_single_1", "vt"):
    first = ruler.generate(task, 1024, 1, tok, seed=0)
    random.random()
    assert ruler.generate(task, 1024, 1, tok, seed=0) == first, task
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_contexts_are_kept_and_read_back_without_lm_evals_generators(tok, model_dir, tmp_path):
    """A stage resumed, or another stage on the same contexts, reads its samples (questions formed) from
    OUT/contexts instead of importing lm-eval's generators again; another seed is another entry, and a
    damaged entry, or one that holds another key, is generated again, the same."""
    made = ruler.kept_or_generated(tmp_path, "niah_single_1", 1024, 2, tok, seed=0, needles=2)
    assert made == ruler.generate("niah_single_1", 1024, 2, tok, seed=0, needles=2)
    [path] = tmp_path.glob("niah_single_1-1024-*.json")
    code = f"""
import json, sys
from pathlib import Path
from transformers import AutoTokenizer
from pace_bench import ruler
tok = AutoTokenizer.from_pretrained({str(model_dir)!r})
print(json.dumps(ruler.kept_or_generated(Path({str(tmp_path)!r}), "niah_single_1", 1024, 2, tok, seed=0, needles=2)))
print(sorted(m for m in sys.modules if m.startswith("lm_eval.tasks.ruler.")))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    read, imported = done.stdout.splitlines()[-2:]
    assert json.loads(read) == made and imported == "[]"
    other = ruler.kept_or_generated(tmp_path, "niah_single_1", 1024, 2, tok, seed=1, needles=2)
    assert other != made and len(list(tmp_path.glob("niah_single_1-1024-*.json"))) == 2
    for damage in (path.read_text()[:100], json.dumps({"key": {"task": "vt"}, "samples": []})):
        path.write_text(damage)
        assert ruler.kept_or_generated(tmp_path, "niah_single_1", 1024, 2, tok, seed=0, needles=2) == made
        assert json.loads(path.read_text())["samples"] == made
    assert not list(tmp_path.glob("*.part"))


def test_a_context_carries_k_needles_from_lm_evals_generator_each_asked_and_scored_alone(tok):
    from pace_hf.chat import DEFAULT_SYSTEM, ChatTemplate

    sample = ruler.generate("niah_single_1", 1024, 1, tok, seed=0, needles=3)[0]
    context, _ = ruler.split_question(sample)
    assert context.startswith("Some special magic numbers are hidden")  # lm-eval's template, K needles
    needles = dict(NEEDLE_LINE.findall(context))  # the repeat haystack has no other line of that form
    docs = sample["questions"]
    assert len(needles) == 3 and sorted(d["outputs"][0] for d in docs) == sorted(needles.values())
    for doc in docs:
        key = re.fullmatch(r"What is the special magic number for (.+) mentioned in the provided text\?",
                           doc["question"]).group(1)
        assert needles[key] == doc["outputs"][0] and doc["gen_prefix"].endswith(f"for {key} mentioned in the provided text is")
        # lm-eval's metric, against this question's needle only
        others = [v for v in needles.values() if v != doc["outputs"][0]]
        assert ruler.score(doc, f" {doc['outputs'][0]}.") == 1.0 and ruler.score(doc, f" {others[0]}.") == 0.0
    # niah_multikey_2: the haystack is needles too; each question still finds the one its key names
    multi = ruler.generate("niah_multikey_2", 1024, 1, tok, seed=0, needles=2)[0]
    lines = dict(NEEDLE_LINE.findall(multi["input"]))
    assert len(lines) > 10 and [lines[re.search(r"for (.+) mentioned", d["question"]).group(1)] for d in
                                multi["questions"]] == multi["outputs"]
    # each question's needle is its own span of the conversation's tokens
    template = ChatTemplate(tok, DEFAULT_SYSTEM)
    prompt = ruler.build_prompt(sample, "session", template, ruler.RulerSettings(tool_tokens=128))
    for doc, positions in zip(docs, prompt["needles"]):
        text = tok.decode([prompt["context"][p] for p in positions])
        assert doc["outputs"][0] in text and text.strip().startswith("One of the special magic") and len(positions) < 40
    with pytest.raises(ValueError, match="vt carries one needle"):
        ruler.generate("vt", 1024, 1, tok, seed=0, needles=2)


def _answer_fresh(model, tokenizer, template, sample, j, arm, s, stop_ids):
    """Question ``j`` answered without save and resume: a fresh prefill of the context, (retrieve,) answer."""
    from pace_hf.memory.retrieval import PageRetriever
    from pace_hf.tiers import HostTier, TieredStore

    prompt = ruler.build_prompt(sample, "session", template, s)
    cache = ruler.make_cache(arm, model, s, TieredStore([HostTier()]) if arm != "full" else None, "fresh")
    if arm != "full":
        cache.step = 1
    ruler.prefill(model, cache, prompt["context"], s.chunk)
    if arm == "pace_retrieval":
        cache.retrieve(prompt["docs"][j]["question"], prompt["context"], retriever=PageRetriever(tokenizer))
    tokens, _ = ruler.answer(model, cache, prompt["context"] + prompt["questions"][j], 12, stop_ids, s.chunk,
                             prompt["needles"][j])
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_save_then_answer_equals_a_fresh_prefill_token_for_token(model_dir, tok):
    """Two needles in one context: each question answered from the one saved state is the answer of a
    fresh prefill of the context and that question, for the full cache and for evicting arms."""
    from transformers import AutoModelForCausalLM

    from pace_hf.chat import DEFAULT_SYSTEM, ChatTemplate
    from pace_hf.tiers import HostTier, TieredStore

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    template = ChatTemplate(tok, DEFAULT_SYSTEM)
    s = ruler.RulerSettings(budget=640, limit=1024, chunk=256, tool_tokens=256, max_new_tokens=12)
    sample = ruler.generate("niah_single_1", 1536, 1, tok, seed=1, needles=2)[0]
    for arm in ("full", "h2o", "pace_retrieval"):
        saved = ruler.play(model, tok, template, sample, "session", arm, s, template.stop_ids(), TieredStore([HostTier()]))
        assert [r["probe"] for r in saved] == [0, 1] and saved[0]["outputs"] != saved[1]["outputs"]
        for j, r in enumerate(saved):
            assert r["answer"] == _answer_fresh(model, tok, template, sample, j, arm, s, template.stop_ids()), (arm, j)
    # each question's turn brought its own needle's page back
    assert all(r["retrieval_tokens_restored"] > 0 and r["residency"] == 1.0 for r in saved)


def test_the_suite_runs_at_two_lengths_with_two_needles_and_resumes(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--suite", "ruler", "--model", model_dir, "--tasks", "niah_single_1", "--lengths", "2048,2560",
            "--samples", "1", "--needles", "2", "--arms", "snapkv_bounded,pace_retrieval,pace_plan",
            "--settings", "question_last,session", *SMALL, "--out", str(out)]
    assert main(argv) == 0
    assert "prefill context" in capsys.readouterr().err  # the context's prefill has its own bar
    records = [json.loads(x) for x in (out / "probes.jsonl").read_text().splitlines()]
    # lengths x arms x (one RULER question in question-last, a question per needle in session)
    assert len(records) == 2 * 3 * (1 + 2)
    assert {(r["setting"], r["probes"]) for r in records} == {("question_last", 1), ("session", 2)}
    for r in records:
        assert {"score", "residency", "rotary_gap", "answer", "session_id", "probe"} <= set(r) and 0.0 <= r["score"] <= 1.0
        if r["rotary_gap"] is not None:
            assert r["rotary_gap"] < 1536  # bounded arms stay below the limit
    # retrieval (session), or the plan, kept each question's needle; in question-last nothing is evicted
    # before the question's forward (the arms hold the prompt), so retrieval has nothing to bring back
    planned = [r for r in records if r["arm"] == "pace_plan" or (r["arm"], r["setting"]) == ("pace_retrieval", "session")]
    assert len(planned) == 2 * (1 + 2 + 2) and all(r["residency"] == 1.0 for r in planned), planned
    assert all(r["retrieval_tokens_restored"] == 0 for r in records
               if (r["arm"], r["setting"]) == ("pace_retrieval", "question_last"))
    assert all(set(r["needle_page_rank"]) == {"lexical", "digest", "both"} for r in records if r["arm"] == "pace_retrieval")
    table = (out / "table.md").read_text()
    assert "**question_last**" in table and "**session**" in table and "| niah_single_1 | 2,560 |" in table
    assert table.count("(n=2)") == 2 * 3 and table.count("(n=1)") == 2 * 3  # n counts questions
    assert table.count("Needle when the answer's first query runs") == 2  # a residency / gap table per setting
    ledger = table.split("Needle when the answer's first query runs (session)")[1].split("Retrieval: ")[0]
    cells = re.search(r"\| niah_single_1 \| 2,560 \| (.*) \|", ledger).group(1).split(" | ")
    for arm, cell in zip(("snapkv_bounded", "pace_retrieval", "pace_plan"), cells):  # the records' own means
        got = [r for r in records if (r["setting"], r["length"], r["arm"]) == ("session", 2560, arm)]
        gap = sum(r["rotary_gap"] for r in got) / len(got)
        assert cell == f"{sum(r['residency'] for r in got) / len(got):.2f} / {gap:,.0f}", (arm, cell)
    recall = table.split("Retrieval: ")[1]  # pace_retrieval's pages: one row per session length
    assert "| session | niah_single_1 | 2,048 | 2 |" in recall and "| session | niah_single_1 | 2,560 | 2 |" in recall
    assert (out / "ruler_session.png").stat().st_size > 0 and (out / "ruler_question_last.png").stat().st_size > 0
    (out / "table.md").unlink()
    (out / "ruler_session.png").unlink()
    assert main(["--suite", "ruler", "--report", "--out", str(out)]) == 0  # plays nothing: the same table again
    assert (out / "table.md").read_text() == table and (out / "ruler_session.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="holds no answered questions"):
        main(["--suite", "ruler", "--report", "--out", str(tmp_path / "nothing")])
    # as a stopped two-process run leaves it: rank 0 holds all but the last question, rank 1 nothing yet
    (out / "probes.jsonl").unlink()
    (out / "probes.rank0.jsonl").write_text("".join(json.dumps(dict(r, answer="KEPT")) + "\n" for r in records[:-1]))
    (out / "probes.rank1.jsonl").write_text("")
    assert main(argv + ["--resume"]) == 0  # one question left: its context is prefilled again, it alone answered
    resumed = [json.loads(x) for x in (out / "probes.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in resumed[:-1]] == ["KEPT"] * (len(records) - 1)
    timing = ("seconds", "prefill_seconds")
    assert {k: v for k, v in resumed[-1].items() if k not in timing} == {k: v for k, v in records[-1].items() if k not in timing}
    assert not list(out.glob("probes.rank*.jsonl"))
    # another --needles asks other questions of the same contexts: refused, the log kept
    with pytest.raises(SystemExit, match="other questions of context"):
        main([a if a != "2" else "3" for a in argv] + ["--resume"])
    assert len((out / "probes.jsonl").read_text().splitlines()) == len(records)


@pytest.mark.slow  # two processes, each importing lm-eval
def test_two_processes_share_the_contexts_and_the_main_one_merges(model_dir, tmp_path):
    """`accelerate launch` with 2 CPU processes: the two contexts go to the processes as they ask, each
    played whole (both its questions, from one saved state) by one process into its shard, and the main
    process merges them in the contexts' order."""
    import socket
    import subprocess

    out = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
              str(port), "-m", "pace_bench", "--suite", "ruler", "--model", model_dir, "--tasks", "niah_single_1",
              "--lengths", "2048", "--samples", "2", "--needles", "2", "--arms", "pace_retrieval", *SMALL,
              "--no-ranks", "--no-progress", "--out", str(out)]
    done = subprocess.run(launch, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes" in done.stdout
    merged = [json.loads(x) for x in (out / "probes.jsonl").read_text().splitlines()]
    assert [(r["index"], r["probe"]) for r in merged] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert merged[0]["process"] == merged[1]["process"] and merged[2]["process"] == merged[3]["process"]
    assert {r["process"] for r in merged} <= {0, 1}
    assert not list(out.glob("probes.rank*.jsonl")) and not (out / "claims").exists() and json.loads((out / "run.json").read_text())["num_processes"] == 2
    assert "(n=4)" in (out / "table.md").read_text()


def test_wilson_interval_of_a_mean_score():
    """RULER's cells are mean scores (a partial score is that fraction of a success): the interval of
    ``p`` over ``n`` questions is the one interval of ``p * n`` successes (``pace_bench.stats``)."""
    from pace_bench.stats import wilson

    lo, hi = wilson(0.5 * 10, 10)
    assert 0.23 < lo < 0.24 and 0.76 < hi < 0.77
    assert wilson(5, 5)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)
    assert torch.isclose(torch.tensor(sum(wilson(0.3 * 50, 50))), torch.tensor(2 * 0.3), atol=0.05)
    _p, n, lo, hi = ruler.accuracy([{"setting": "s", "task": "t", "length": 8, "arm": "a", "score": x}
                                    for x in (1.0, 0.0, 0.5, 0.5)])[("s", "t", 8, "a")]
    assert n == 4 and (lo, hi) == wilson(2.0, 4)


@pytest.mark.slow  # the whole RULER script at small sizes: about 8 minutes on 2 busy cores
def test_the_ruler_script_plays_its_stages_into_one_table(model_dir, tmp_path):
    """bench/run_ruler.sh's own stages (its nine pace-bench invocations into one folder, each --resume),
    scaled down to the tiny model: the table covers every stage, and each setting has its own table."""
    out, results = tmp_path / "run", tmp_path / "results"
    env = dict(os.environ, MODEL=model_dir, NIAH="niah_single_1", OTHER="vt", LONGEST_TASKS="niah_single_1",
               SHORT="2048", LONG="2560", LONGEST="3072", ARMS="full,pace_retrieval", BOUNDED_ARMS="pace_retrieval",
               MORE_ARMS="h2o", QUESTION_LAST_ARMS="pace_plan", VT_SAMPLES="2", QL_SAMPLES="2",
               NEEDLES="2", EXTRA=" ".join(SMALL + ["--no-ranks"]), OUT=str(out), RESULTS=str(results),
               PY=sys.executable, NICE="0")
    done = subprocess.run(["bash", "bench/run_ruler.sh", "--foreground"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("stage: ") == 9 and "done: " in done.stdout
    question_last, session = (results / "table.md").read_text().split("**session**")  # question-last's table first
    for row in ("| niah_single_1 | 2,048 |", "| vt | 2,048 |", "| niah_single_1 | 2,560 |", "| niah_single_1 | 3,072 |"):
        assert row in session, session
    assert "| niah_single_1 | 2,048 |" in question_last and "pace_plan" in question_last, question_last
    records = [json.loads(line) for line in (results / "probes.jsonl").read_text().splitlines()]
    # session: niah at 2K, 3 arms x 2 needles; vt at 2K, 2 arms x 1; niah at 2.5K and 3K, 1 arm x 2 needles
    # each; pace_follow on niah (2 needles) and vt at 2K; vt's second context for pace_retrieval and pace_follow;
    # question-last: niah at 2K, 1 arm x 2 one-question prompts (QL_SAMPLES; the stage of the second length,
    # here the same, resumes them)
    assert sum(r["setting"] == "session" for r in records) == 6 + 2 + 2 + 2 + 3 + 2
    assert {r["index"] for r in records if r["task"] == "vt" and r["arm"] == "pace_follow"} == {0, 1}
    assert sum(r["setting"] == "question_last" for r in records) == 2
    # A new checkout, with OUT gone: the script resumes from what RESULTS holds and answers nothing again.
    kept = (results / "probes.jsonl").read_text()
    shutil.rmtree(out)
    again = subprocess.run(["bash", "bench/run_ruler.sh", "--foreground"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not re.search(r" score \d\.\d\d residency ", again.stdout + again.stderr), again.stdout[-3000:]
    assert (results / "probes.jsonl").read_text() == kept
    # --bank, as before a session ends mid-stage: RESULTS gets what OUT holds, and nothing is played
    (results / "table.md").unlink()
    banked = subprocess.run(["bash", "bench/run_ruler.sh", "--bank"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert banked.returncode == 0, banked.stderr[-3000:]
    assert (results / "table.md").read_text() == (out / "table.md").read_text()
