"""The RULER suite: lm-eval's own samples and scores, both settings, the save-then-answer protocol."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_runner import _tiny_model_dir  # noqa: E402

from pace_bench import ruler  # noqa: E402
from pace_bench.runner import main  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="needs lm-eval (the [bench] extra)")

# B // 4 = 288 tokens: two 144-token pages (the needle's, and the task instruction's, which matches too)
SMALL = ["--budget", "1152", "--limit", "1536", "--chunk", "256", "--tool-tokens", "256", "--max-new-tokens", "4"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _tiny_model_dir(tmp_path_factory.mktemp("ruler") / "model")


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "niah_single_9"], "unknown task(s) niah_single_9"),
    (["--tasks", "vt", "--lengths", "512"], "vt needs >= 1024"),
    (["--arms", "pace_plan", "--limit", "4096"], "need --limit > --budget + --chunk"),
    (["--lengths", "many"], "comma-separated token counts"),
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


def test_samples_and_scores_are_lm_evals_own(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    sample = dict(ruler.generate("niah_single_1", 1024, 1, tok, seed=0)[0], task="niah_single_1")
    assert sample["max_length"] == 1024 and sample["outputs"][0] in sample["input"]
    assert ruler.score(sample, f" {sample['outputs'][0]}.") == 1.0 and ruler.score(sample, " 12.") == 0.0
    context, question = ruler.split_question(sample)
    assert question.startswith("What is the special magic number") and sample["outputs"][0] in context


def _answer_fresh(model, tokenizer, template, sample, arm, s, stop_ids):
    """The same sample answered without save and resume: prefill, (retrieve,) answer."""
    from pace_hf.retrieval import PageRetriever
    from pace_hf.tiers import HostTier, TieredStore

    prompt = ruler.build_prompt(sample, "session", template, s)
    store = TieredStore([HostTier()])
    cache = ruler.make_cache(arm, model, s, store if arm != "full" else None, "fresh")
    if arm != "full":
        cache.step = 1
    ruler.prefill(model, cache, prompt["context"], s.chunk)
    if arm == "pace_retrieval":
        cache.rehydrate(prompt["question_text"], prompt["context"], retriever=PageRetriever(tokenizer))
    tokens, _ = ruler.answer(model, cache, prompt["context"] + prompt["question"], 12, stop_ids, s.chunk,
                             prompt["needle"])
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_save_then_answer_equals_a_fresh_prefill_token_for_token(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pace_hf.chat import DEFAULT_SYSTEM, ChatTemplate
    from pace_hf.tiers import HostTier, TieredStore

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    template = ChatTemplate(tok, DEFAULT_SYSTEM)
    s = ruler.RulerSettings(budget=640, limit=1024, chunk=256, tool_tokens=256, max_new_tokens=12)
    sample = dict(ruler.generate("niah_single_1", 1536, 1, tok, seed=1)[0], task="niah_single_1")
    for arm in ("full", "h2o", "pace_retrieval"):
        saved = ruler.play(model, tok, template, sample, "session", arm, s, template.stop_ids(), f"saved-{arm}",
                           TieredStore([HostTier()]))
        assert saved["answer"] == _answer_fresh(model, tok, template, sample, arm, s, template.stop_ids()), arm
    assert saved["retrieval_tokens_restored"] > 0 and saved["residency"] == 1.0  # the needle's page came back


def test_the_suite_runs_on_a_tiny_model_at_two_lengths_and_resumes(model_dir, tmp_path):
    out = tmp_path / "run"
    argv = ["--suite", "ruler", "--model", model_dir, "--tasks", "niah_single_1", "--lengths", "2048,2560",
            "--samples", "1", "--arms", "snapkv_bounded,pace_retrieval,pace_plan",
            "--settings", "question_last,session", *SMALL, "--out", str(out)]
    assert main(argv) == 0
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 3 * 2  # lengths x arms x settings
    for r in records:
        assert {"score", "residency", "rotary_gap", "answer"} <= set(r) and 0.0 <= r["score"] <= 1.0
        if r["rotary_gap"] is not None:
            assert r["rotary_gap"] < 1536  # bounded arms stay below the limit
    planned = [r for r in records if r["arm"] in ("pace_retrieval", "pace_plan")]
    assert all(r["residency"] == 1.0 for r in planned)  # retrieval, or the plan, kept the needle
    assert all(set(r["needle_page_rank"]) == {"lexical", "digest", "both"} for r in records if r["arm"] == "pace_retrieval")
    table = (out / "table.md").read_text()
    assert "**question_last**" in table and "**session**" in table and "| niah_single_1 | 2,560 |" in table
    assert (out / "ruler_session.png").stat().st_size > 0 and (out / "ruler_question_last.png").stat().st_size > 0
    assert main(argv + ["--resume"]) == 0  # nothing left to play: the records are kept as they were
    assert [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()] == records


def test_wilson_interval():
    lo, hi = ruler.wilson(0.5, 10)
    assert 0.23 < lo < 0.24 and 0.76 < hi < 0.77
    assert ruler.wilson(1.0, 5)[1] == 1.0 and ruler.wilson(0.0, 0) == (0.0, 1.0)
    assert torch.isclose(torch.tensor(sum(ruler.wilson(0.3, 50))), torch.tensor(2 * 0.3), atol=0.05)
