"""The repo suite: renamed real source that compiles, probes scored with no model, bad input, and the suite end
to end on a tiny random model."""

import json
import re
import shutil
import sys
import tokenize
import io
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_runner import _tiny_model_dir  # noqa: E402

from pace_bench import repo, repo_probes  # noqa: E402
from pace_bench.repo_probes import score  # noqa: E402
from pace_bench.repo_rename import Renaming  # noqa: E402
from pace_bench.runner import main  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from pace_bench.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


def _names(source: str) -> list[str]:
    return [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.NAME]


@pytest.mark.parametrize("package", ["requests", "click", "tqdm"])
def test_every_renamed_file_of_a_real_package_compiles_and_is_renamed_consistently(package):
    files = [(p, t) for p, t in repo.package_files(package) if repo._parses(t)]
    renaming = Renaming.for_sources([t for _, t in files], package, seed=0)
    assert len(renaming.mapping) > 100
    assert len(set(renaming.mapping.values())) == len(renaming.mapping)  # one replacement per name
    for path, text in files:
        out = renaming.apply(text, path)
        compile(out, path, "exec")
        before, after = _names(text), _names(out)
        assert len(before) == len(after)  # token for token: every NAME maps through the one mapping
        assert all(renaming.mapping.get(a, a) == b for a, b in zip(before, after))
    # a name defined in one file and imported in another is renamed the same in both
    assert Renaming.for_sources([t for _, t in files], package, seed=0).mapping == renaming.mapping
    assert Renaming.for_sources([t for _, t in files], package, seed=1).mapping != renaming.mapping


def test_renaming_keeps_imports_builtins_and_dunders_and_renames_docstrings():
    src = ('import os\nfrom .util import helper_fn\n\nMAX_SIZE = 10\n\nclass HttpClient:\n'
           '    """Wraps `helper_fn`; see :param max_tries: below."""\n\n'
           '    def __init__(self, max_tries=MAX_SIZE):\n        self.max_tries = max_tries\n\n'
           '    def fetch_all(self, url):\n        # calls helper_fn on url\n'
           '        return [helper_fn(u) for u in os.listdir(url)] + list(f"{self.max_tries!r}")\n\n'
           'def helper_fn(x):\n    return len(x)\n')
    r = Renaming.for_sources([src], "pkg", seed=3)
    assert {"os", "len", "list", "self", "__init__"}.isdisjoint(r.mapping)
    assert {"MAX_SIZE", "HttpClient", "fetch_all", "helper_fn", "max_tries", "url"} <= set(r.mapping)
    out = r.apply(src)
    assert r.mapping["MAX_SIZE"].isupper() and r.mapping["HttpClient"][0].isupper()
    for name in ("MAX_SIZE", "HttpClient", "fetch_all", "helper_fn", "max_tries"):
        assert name not in out, name  # code, docstring, comment, f-string field
    assert "import os" in out and "os.listdir" in out and "!r}" in out


def test_a_rename_that_does_not_compile_is_refused():
    r = Renaming({"value": "lambda"})
    with pytest.raises(SyntaxError):
        r.apply("value = 1\n")


# -- probes ------------------------------------------------------------------------------------------------

SOURCE = '''
RETRY_CODES = (429, 503)


class Pool:
    def fetch(self, url, timeout=30.0, *, retries=RETRY_CODES, verbose=False):
        """Fetch one URL through the pool, retrying on the given codes."""
        for attempt in range(3):
            if attempt in retries:
                return None
        return url, timeout, verbose
'''


def _probe(kind):
    t = next(t for t in repo_probes.targets_in(SOURCE, "pool.py", {"Pool", "fetch", "RETRY_CODES"}) if t.kind == kind)
    return repo_probes.probe_for(t, lambda text: len(text.split()))


def test_needle_is_scored_by_repoqa_similarity_at_its_threshold():
    p = _probe("needle")
    assert "fetch" not in p["prompt"] and "Fetch one URL" in p["prompt"]
    exact = SOURCE.split("class Pool:\n")[1]
    right = score(exact + "```", p["reference"], p["answer_prefix"])
    assert right["passed"] and right["similarity"] == 1.0 and right["recall_hits"] == right["recall_total"]
    reformatted = score('    def fetch(self, url, timeout=30.0, *, retries=RETRY_CODES, verbose=False):\n'
                        '        for attempt in range(3):\n            if attempt in retries: return None  # early\n'
                        '        return (url, timeout, verbose)\n```', p["reference"], p["answer_prefix"])
    assert reformatted["passed"]  # comments, docstrings and layout do not count
    wrong = score("def fetch(self, url):\n    return requests.get(url)\n```", p["reference"], p["answer_prefix"])
    assert not wrong["passed"] and wrong["similarity"] < 0.8 and "similarity" in wrong["failure"]


def test_signature_is_scored_against_the_definitions_parameters_and_defaults():
    p = _probe("signature")
    assert p["answer_prefix"] == "" and "`Pool.fetch`" in p["prompt"]  # a forced prefix derails a small model
    ref = json.loads(p["reference"])
    assert ref["defaults"] == {"timeout": "30.0", "retries": "RETRY_CODES", "verbose": "False"}
    ok = score("Here it is:\n```python\nPool.fetch(timeout=30.0, retries=RETRY_CODES, verbose=False)\n```", p["reference"])
    assert ok["passed"] and ok["recall_hits"] == 3
    assert score("fetch(verbose = False, timeout=3e1, retries=RETRY_CODES)", p["reference"])["passed"]
    wrong = score("pool.fetch(timeout=10, retries=RETRY_CODES)", p["reference"])
    assert not wrong["passed"] and wrong["recall_hits"] == 1
    assert "missing: verbose" in wrong["failure"] and "wrong default: timeout" in wrong["failure"]
    extra = score("Pool.fetch(timeout=30.0, retries=RETRY_CODES, verbose=False, url='x')", p["reference"])
    assert not extra["passed"] and "not a parameter with a default: url" in extra["failure"]
    assert score("Pool.fetch(timeout=30.0,, oops", p["reference"])["failure"] == "does not parse"
    # Qwen often writes the signature out instead of a call: the same defaults, so the same answer
    written = score("```python\nPool.fetch(\n    self, url: str,\n    timeout: float = 30.0,\n    *, retries=RETRY_CODES,"
                    "\n    verbose: bool = False,\n) -> tuple\n```", p["reference"])
    assert written["passed"], written
    assert not score("Pool.fetch(url: str, timeout: float = 3.0)", p["reference"])["passed"]


def test_constant_is_compared_exactly():
    p = _probe("constant")
    assert p["answer_prefix"] == "" and "`RETRY_CODES`" in p["prompt"] and "`pool.py`" in p["prompt"]
    assert score("```python\nRETRY_CODES = (429, 503)\n```", p["reference"])["passed"]
    assert score("RETRY_CODES = (429,503)", p["reference"])["passed"]  # the value, not its spacing
    wrong = score("RETRY_CODES = (429, 500)", p["reference"])
    assert not wrong["passed"] and wrong["recall_hits"] == 1 and wrong["recall_total"] == 2
    assert not score("RETRY_CODES = [429, 503]", p["reference"])["passed"]
    assert score("OTHER = (429, 503)", p["reference"])["failure"] == "no assignment to RETRY_CODES"


def test_a_name_the_module_binds_twice_is_never_asked_about():
    # requests/compat.py: `has_simplejson = False` at the top level, then `has_simplejson = True` in a try
    source = ("has_simplejson = False\ntry:\n    import simplejson as json\n    has_simplejson = True\n"
              "except ImportError:\n    import json\nTIMEOUT = 300\n\nif json:\n    def load(path, strict=False, "
              "limit=10):\n        \"\"\"Read one JSON document from the path.\"\"\"\n        return json.load(open(path))"
              "\nelse:\n    pass\n\ndef load(path, strict=True, limit=5):\n    \"\"\"Read one JSON document from "
              "the given path.\"\"\"\n    return None\n")
    names = {t.qualname for t in repo_probes.targets_in(source, "compat.py", {"has_simplejson", "TIMEOUT", "load"})}
    assert names == {"TIMEOUT"}


# -- sessions ------------------------------------------------------------------------------------------------


def test_a_session_is_real_renamed_source_with_exact_oracle_spans(tokenizer):
    row = repo.build_repo_session(tokenizer, total_tokens=6000, packages=["click", "packaging"], per_kind=1)
    assert row["context_len"] <= 6000 and row["context_len"] >= 0.9 * 6000
    kinds = {p["kind"] for p in row["probes"]}
    assert kinds and kinds <= set(repo_probes.KINDS)
    originals = {n for _, t in repo.package_files(row["package"]) if repo._parses(t) for n in _names(t)}
    for p in row["probes"]:
        leaf = p["target"].split(".")[-1]
        assert leaf not in originals  # the model cannot know the name from pretraining
        assert p["prompt_ids"] and p["reference"]
        spans = [b for b in row["blueprint"] if p["step"] in b["readers"]]
        text = "".join(tokenizer.decode(row["context_ids"][b["start"]:b["end"]]) for b in spans)
        assert leaf in text  # the oracle span holds the definition
    for turn in row["turns"]:
        if turn["kind"] == "listing":
            assert turn["content"] in tokenizer.decode(row["context_ids"][turn["start"]:turn["end"]])


def test_a_file_that_does_not_parse_is_read_as_text(tokenizer, monkeypatch):
    files = repo.package_files("click")
    broken = ("click/legacy.py", "def old(x):\n    print echo(x)  # Python 2\n" * 40)
    monkeypatch.setattr(repo, "package_files", lambda name: [broken] + files)
    row = None
    for index in range(6):  # a seeded order that reads it
        row = repo.build_repo_session(tokenizer, session_index=index, total_tokens=8000, packages=["click"], per_kind=1)
        if row["text_files"]:
            break
    assert row["text_files"] == ["click/legacy.py"]
    shown = next(t for t in row["turns"] if t["path"] == "click/legacy.py" and t["kind"] == "listing")
    assert "def old(" in shown["content"] and "print " in shown["content"]  # read as text,
    assert "echo" not in shown["content"]  # renamed word by word (click defines echo)
    assert all(p["path"] != "click/legacy.py" for p in row["probes"])


def test_bad_input_gets_a_clear_error(tokenizer):
    with pytest.raises(repo.RepoSourceError, match="'no_such_pkg_xyz' is not installed"):
        repo.package_files("no_such_pkg_xyz")
    with pytest.raises(ValueError, match="shorter than the system prompt and the task"):
        repo.build_repo_session(tokenizer, total_tokens=40, packages=["click"])
    with pytest.raises(ValueError, match="no package of packaging has source enough"):
        repo.build_repo_session(tokenizer, total_tokens=10_000_000, packages=["packaging"])
    with pytest.raises(ValueError, match="listing must be one of"):
        repo.build_repo_session(tokenizer, total_tokens=4000, packages=["click"], listing_style="less")


@pytest.mark.parametrize("argv, message", [
    (["--packages", "no_such_pkg_xyz"], "'no_such_pkg_xyz' is not installed"),
    (["--arms", "pace_nothing"], "unknown arm(s) pace_nothing"),
    (["--arms", "pace_oracle", "--limit", "4096"], "need --limit > --budget + --chunk"),
])
def test_bad_arguments_are_an_error_before_anything_loads(monkeypatch, capsys, argv, message):
    from pace_bench import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(models, "load_tokenizer", lambda *a, **k: pytest.fail("a tokenizer was loaded"))
    with pytest.raises(SystemExit):
        main(["--suite", "repo", *argv])
    assert message in capsys.readouterr().err


def test_the_loader_is_a_cached_dataset(tokenizer, tmp_path):
    a = repo.load_repo_sessions(tokenizer, total_tokens=4000, packages=["click"], per_kind=1, cache_dir=str(tmp_path))
    b = repo.load_repo_sessions(tokenizer, total_tokens=4000, packages=["click"], per_kind=1, cache_dir=str(tmp_path))
    assert a[0]["context_ids"] == b[0]["context_ids"] and a._fingerprint == b._fingerprint
    with pytest.raises(ValueError, match="shorter than the system prompt"):
        repo.load_repo_sessions(tokenizer, total_tokens=40, packages=["click"], cache_dir=str(tmp_path))


def test_the_suite_runs_end_to_end_on_a_tiny_model_and_resumes(tmp_path):
    model = _tiny_model_dir(tmp_path / "model")
    out = tmp_path / "run"
    arms = "full,h2o,snapkv,pace_oracle,pace_literal,pace_prose,pace_probe,pace_rehydrate,pace_retrieval"
    argv = ["--suite", "repo", "--model", model, "--arms", arms, "--tokens", "3000", "--probes-per-kind", "1",
            "--packages", "click", "--budget", "1024", "--limit", "2048", "--chunk", "512", "--max-new-tokens", "4",
            "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    records = [json.loads(x) for x in (out / "probes.jsonl").read_text().splitlines()]
    probes = len({r["probe"] for r in records})
    assert len(records) == 9 * probes and probes >= 1
    for r in records:
        assert {"residency", "rotary_gap", "plan_tokens", "plan_recall", "checks_passed", "answer"} <= set(r)
    oracle = [r for r in records if r["arm"] == "pace_oracle"]
    assert all(r["residency"] == 1.0 and r["plan_recall"] == 1.0 for r in oracle)  # the oracle plan is kept
    assert any(r["plan_tokens"] > 0 for r in records if r["arm"] == "pace_literal")  # the planner planned
    retrieved = [r for r in records if r["arm"] == "pace_retrieval"]  # pages the probes' words matched came back
    assert any(r["retrieved_tokens"] > 0 and r["plan_tokens"] > 0 for r in retrieved)  # and are planned for the step
    assert all("rehydrated_tokens" in r for r in records if r["arm"] == "pace_rehydrate")  # one word per act
    table = (out / "table.md").read_text()
    assert "plan footprint" in table and "| pace_rehydrate |" in table
    assert main(argv + ["--resume"]) == 0  # nothing left to play: the records are kept as they were
    assert [json.loads(x) for x in (out / "probes.jsonl").read_text().splitlines()] == records
    # a stored grade is graded again from its answer (a scoring fix reaches old records; no model runs)
    forged = [{**r, "checks_passed": 1, "failure": None} for r in records]
    (out / "probes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in forged))
    assert main(argv + ["--resume"]) == 0
    assert [json.loads(x) for x in (out / "probes.jsonl").read_text().splitlines()] == records


def test_with_tiers_planned_spans_the_budget_pushed_out_come_back_before_their_step(tmp_path):
    # six probes whose plans together exceed B = 384 many times over: without a tier the later probes'
    # definitions are gone by their step; with one, each step's plan is fetched back before it runs
    model = _tiny_model_dir(tmp_path / "model")
    runs = {}
    for tiers in ([], ["--tiers"]):
        out = tmp_path / f"run{len(tiers)}"
        argv = ["--suite", "repo", "--model", model, "--arms", "pace_oracle", "--tokens", "8000", "--probes-per-kind",
                "3", "--packages", "click", "--budget", "384", "--limit", "1024", "--chunk", "256",
                "--max-new-tokens", "4", "--no-progress", "--out", str(out), *tiers]
        assert main(argv) == 0
        runs[bool(tiers)] = [json.loads(x) for x in (out / "probes.jsonl").read_text().splitlines()]
    without, with_tiers = runs[False], runs[True]
    assert [r["probe"] for r in without] == [r["probe"] for r in with_tiers] and len(without) >= 4
    assert all("tier" not in r for r in without)
    assert all(b["residency"] >= a["residency"] for a, b in zip(without, with_tiers))
    back = [b for a, b in zip(without, with_tiers) if a["residency"] < 1.0 and b["plan_tokens"] <= 384 // 2]
    assert back and all(b["residency"] == 1.0 for b in back)  # a plan that fits comes back whole
    assert with_tiers[-1]["tier"]["restored_tokens"] > 0
    assert "evicting arms spill to a host tier" in (tmp_path / "run1" / "table.md").read_text()


@pytest.mark.slow  # the whole repository script at small sizes: about 3 minutes
def test_the_repo_script_plays_its_stages_and_a_tier_changes_none_of_h2os_answers(tmp_path):
    """bench/run_repo.sh's own stages, scaled down to the tiny model. The tier stage copies H2O's records from
    the 64K run without tiers (H2O never restores); here ``COPY_H2O=0`` plays H2O again with a tier, and the
    answers must be those of stage 2, without one, which is what the copy relies on. The more-sessions stage
    copies stage 1's session and plays the others."""
    import os
    import subprocess

    repo_root = Path(__file__).resolve().parents[1]
    runs, results = tmp_path / "runs", tmp_path / "results"
    small = "--packages click --budget 384 --limit 1024 --chunk 256 --max-new-tokens 4"
    env = dict(os.environ, MODEL=_tiny_model_dir(tmp_path / "model"), SHORT="4000", LONG="5000", LONGEST="6000",
               LONG_SESSIONS="1", TIER_ARMS="pace_oracle", SHORT_ARMS="pace_rehydrate", LONG_ARMS="pace_rehydrate",
               LONGEST_ARMS="pace_oracle", MORE_SESSIONS="2", MORE_ARMS="h2o", PROBES="1", RUNS=str(runs),
               RESULTS=str(results), EXTRA=small, PY=sys.executable, NICE="0", COPY_H2O="0")
    done = subprocess.run(["bash", "bench/run_repo.sh", "--foreground"], cwd=repo_root, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("stage: ") == 5 and "done" in done.stdout
    arms = {}
    for result in ("repo64k-tiers", "repo32k", "repo32k-more", "repo64k", "repo128k-tiers"):
        records = [json.loads(x) for x in (results / result / "probes.jsonl").read_text().splitlines()]
        arms[result] = {r["arm"] for r in records}
        assert (results / result / "table.md").exists()
    assert arms["repo32k"] == {"h2o", "snapkv", "pace_oracle", "pace_prose", "pace_rehydrate"}
    assert arms["repo64k-tiers"] == {"h2o", "pace_oracle"} and arms["repo128k-tiers"] == {"pace_oracle"}
    answers = {run: [(r["probe"], r["answer"]) for r in map(json.loads, (results / run / "probes.jsonl").read_text()
                                                               .splitlines()) if r["arm"] == "h2o"]
               for run in ("repo64k-tiers", "repo64k")}
    assert answers["repo64k-tiers"] == answers["repo64k"] and answers["repo64k"]
    # the more-sessions stage starts from stage 1's session (copied) and plays the second
    more = [json.loads(x) for x in (results / "repo32k-more" / "probes.jsonl").read_text().splitlines()]
    first = [json.loads(x) for x in (results / "repo32k" / "probes.jsonl").read_text().splitlines()]
    assert arms["repo32k-more"] == {"h2o"} and len({r["session_id"] for r in more}) == 2
    assert [r for r in more if r["session_id"] == first[0]["session_id"]] == [r for r in first if r["arm"] == "h2o"]
    # A new checkout, with RUNS gone: every stage resumes from what RESULTS holds and plays nothing again.
    kept = {result: (results / result / "probes.jsonl").read_text() for result in arms}
    shutil.rmtree(runs)
    again = subprocess.run(["bash", "bench/run_repo.sh", "--foreground"], cwd=repo_root, env=env, capture_output=True,
                           text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not re.search(r"recall \d+/\d+ residency", again.stdout + again.stderr), again.stdout[-3000:]
    assert {result: (results / result / "probes.jsonl").read_text() for result in arms} == kept
