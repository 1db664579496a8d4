import json
import math

import pytest

from pace_hf.bench import sessions as S
from pace_hf.bench.sessions import build_session, reference_solution
from pace_hf.metrics import PACE_CODING
from pace_hf.metrics.pace_coding import pace_coding as M
from pace_hf.models import load_tokenizer


@pytest.fixture(autouse=True)
def allow_code_eval(monkeypatch):
    monkeypatch.setenv("PACE_ALLOW_CODE_EVAL", "1")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def rows(tok):
    return [build_session(tok, seed=s, total_tokens=800) for s in range(4)]


def _facts(row):
    return {f["name"]: f["value"] for f in row["facts"]}




def test_reference_solution_passes_every_check(rows):
    for row in rows:
        preds = [reference_solution(row, p["name"]) for p in row["probes"]]
        refs = [p["reference"] for p in row["probes"]]
        out = M.score(preds, refs)
        assert out["checks_passed"] == out["checks_total"] > 0, out["details"]
        assert out["probes_passed"] == 3
        assert out["recall"] == 1.0


@pytest.mark.parametrize("fact", S.FACT_NAMES)
def test_single_fact_mutation_fails_its_check(rows, fact):
    """Changing one fact in the reference solution fails the check that fact controls,
    for every other value the fact could have taken."""
    for row in rows[:2]:
        facts = _facts(row)
        probes = {p["name"]: p for p in row["probes"]}
        owners = [(name, c) for name, p in probes.items() for c in json.loads(p["checks"]) if c["fact"] == fact]
        assert owners, f"no check controls {fact}"
        for alt in S.fact_alternatives(facts, fact):
            mutated = dict(facts, **{fact: alt})
            caught = False
            for probe_name, check in owners:
                out = M.score_answer(reference_solution(mutated, probe_name), probes[probe_name]["reference"])
                row_check = next(c for c in out["checks"] if c["name"] == check["name"])
                caught |= not row_check["passed"]
            assert caught, f"{fact}={alt!r} (was {facts[fact]!r}) passes every check it controls"


def test_mutations_by_hand(rows):
    """A few mutations an LLM would make, on the answer text itself."""
    row = rows[0]
    f = _facts(row)
    probes = {p["name"]: p for p in row["probes"]}
    fee_ref = probes["fee_for"]["reference"]
    good = reference_solution(row, "fee_for")
    other_mode = next(m for m in S.ROUNDING_MODES if m != f["rounding_mode"])
    bad = good.replace(f"rounding={f['rounding_mode']})", f"rounding={other_mode})")
    assert bad != good
    out = M.score_answer(bad, fee_ref)
    assert not next(c for c in out["checks"] if c["name"] == "fee_rounding")["passed"]
    # quantize to the quantum's exponent instead of a multiple of it: fails when quantum != 0.01
    naive = good.replace(f'(raw / quantum).quantize(Decimal("1"), rounding={f["rounding_mode"]}) * quantum',
                         f"raw.quantize(quantum, rounding={f['rounding_mode']})")
    assert naive != good
    out = M.score_answer(naive, fee_ref)
    assert out["checks_passed"] < out["checks_total"] or f["quantum"] == "0.01"
    # module probe with a renamed field
    mod = reference_solution(row, "module").replace(f"    {f['field_status']}: str", "    status_x: str")
    out = M.score_answer(mod, probes["module"]["reference"])
    assert not next(c for c in out["checks"] if c["name"] == "module_fields")["passed"]


def test_extract_code():
    assert M.extract_code("Sure:\n```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "a = 1\n\n\nb = 2\n"
    assert M.extract_code("```\nc = 3\n```") == "c = 3\n"
    assert M.extract_code("x = 4") == "x = 4"
    assert M.extract_code("```python\nd = 5\ne = 6") == "d = 5\ne = 6"  # truncated answer
    assert M.extract_code("```python\na = 1\n```\n```\nnot python\n```") == "a = 1\n"


def test_recall_on_handcrafted_answers():
    facts = ["Invoice", "0.05", "ROUND_HALF_UP", "state", "E-417", "1.25"]
    assert M.recall_hits('class Invoice: ...\nQ = Decimal("0.050")  # ROUND_HALF_UP\nx.state\nE-417 1.25',
                         facts) == [True] * 6
    assert M.recall_hits("invoice statement 0.5 ROUND_HALF_UPPER E-4170 11.25 Invoices", facts) == [False] * 6
    assert M.recall_hits('BASE = Decimal("1.250"); QUANTUM = .05', ["1.25", "0.05"]) == [True, False]
    out = M.score_answer("no code at all, Invoice and 1.25", json.dumps(
        {"probe": "x", "checks": [], "recall": ["Invoice", "1.25", "E-417", "state"]}))
    assert (out["recall_hits"], out["recall_total"], out["recall_missing"]) == (2, 4, ["E-417", "state"])


def test_expected_value_matching():
    from pace_hf.sandbox import CallResult

    dec = {"__decimal__": "1.30"}
    assert M.check_passed(dec, CallResult("ok", value={"__decimal__": "1.3"}))
    assert M.check_passed(dec, CallResult("ok", value=1.3))
    assert not M.check_passed(dec, CallResult("ok", value=1.35))
    assert not M.check_passed(dec, CallResult("ok", value="1.30"))
    assert not M.check_passed(True, CallResult("ok", value=1))
    assert M.check_passed([dec, "paid"], CallResult("ok", value=[{"__decimal__": "1.300"}, "paid"]))
    raise_spec = {"raises": "LedgerError", "code": "E-417"}
    assert M.check_passed(raise_spec, CallResult("raised", exc_type="LedgerError", exc_args=["E-417"], exc_attrs={}))
    assert M.check_passed(raise_spec, CallResult("raised", exc_type="LedgerError", exc_args=["no"],
                                                 exc_attrs={"code": "E-417"}))
    assert not M.check_passed(raise_spec, CallResult("raised", exc_type="ValueError", exc_args=["E-417"]))
    assert not M.check_passed(raise_spec, CallResult("ok", value=None))
    assert M.check_passed({"raises": None, "code": "E-1"}, CallResult("raised", exc_type="X", exc_args=["E-1"]))
    assert M.check_passed({"raises": "X", "args": ["a", 1]}, CallResult("raised", exc_type="X", exc_args=["a", 1]))
    assert not M.check_passed({"raises": "X", "args": ["a"]}, CallResult("raised", exc_type="X", exc_args=["a", 1]))
    assert not M.check_passed(dec, CallResult("error", detail="boom"))


def test_sign_test_and_paired_comparison():
    assert M.sign_test(0, 0) == 1.0
    assert M.sign_test(5, 5) == 1.0
    assert M.sign_test(10, 0) == pytest.approx(2 / 1024)
    # 22 better, 0 worse (the paper's PACE vs H2O): p = 2 / 2^22 < 1e-6
    assert M.sign_test(22, 0) == pytest.approx(2 / 2**22) and M.sign_test(22, 0) < 1e-6
    assert M.sign_test(8, 2) == pytest.approx(2 * sum(math.comb(10, i) for i in range(3)) / 1024)
    a = [{"checks_passed": n} for n in (3, 2, 5, 1, 4)]
    b = [{"checks_passed": n} for n in (1, 2, 4, 1, 5)]
    assert M.paired_comparison(a, b) == {"better": 2, "worse": 1, "tied": 2, "p_value": 1.0}


def test_preamble_runs_before_the_answer(rows):
    """The fee_for probe's file already holds steps 1 and 2: an answer with only step 3 passes,
    an empty file does not."""
    row = rows[0]
    f = _facts(row)
    probe = row["probes"][0]
    ref = json.loads(probe["reference"])
    assert "def settle" in ref["preamble"] and "def fee_for" not in ref["preamble"]
    assert M.score_answer(reference_solution(row, "fee_for"), ref)["checks_passed"] == 4
    assert M.score_answer("```python\npass\n```", ref)["checks_passed"] == 0
    # the settle probe's file holds fee_for: an answer with only the error class and settle passes
    ref2 = json.loads(row["probes"][1]["reference"])
    assert "def fee_for" in ref2["preamble"] and "def settle" not in ref2["preamble"]
    assert M.score_answer(reference_solution(row, "settle"), ref2)["checks_passed"] == 5
    # the answer prefix given in the prompt is prepended to the generated text
    full = reference_solution(row, "fee_for")
    assert full.startswith(ref["answer_prefix"])
    assert M.score_answer(full[len(ref["answer_prefix"]):], ref)["checks_passed"] == 4
    assert json.loads(row["probes"][2]["reference"])["preamble"] == ""


def test_paired_through_score(rows):
    row = rows[1]
    refs = [p["reference"] for p in row["probes"]]
    good = [reference_solution(row, p["name"]) for p in row["probes"]]
    bad = ["```python\ndef fee_for(a):\n    return a\n```", "nothing", good[2]]
    out = M.score(good, refs, baseline_predictions=bad)
    assert out["paired"]["better"] == 2 and out["paired"]["worse"] == 0 and out["paired"]["tied"] == 1
    assert out["paired"]["p_value"] == 0.5
    assert out["baseline"]["probes_passed"] == 1


def test_no_opt_in_refuses(monkeypatch, rows):
    from pace_hf.sandbox import CodeExecutionNotAllowed

    monkeypatch.delenv("PACE_ALLOW_CODE_EVAL")
    p = rows[0]["probes"][0]
    with pytest.raises(CodeExecutionNotAllowed):
        M.score_answer(reference_solution(rows[0], 0), p["reference"])


def test_loads_with_evaluate_offline(monkeypatch, rows, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    import evaluate

    metric = evaluate.load(PACE_CODING)
    row = rows[2]
    preds = [reference_solution(row, p["name"]) for p in row["probes"]]
    refs = [p["reference"] for p in row["probes"]]
    out = metric.compute(predictions=preds, references=refs, baseline_predictions=["", "", ""])
    assert out["check_pass_rate"] == 1.0 and out["recall"] == 1.0
    assert out["paired"] == {"better": 3, "worse": 0, "tied": 0, "p_value": 0.25}
    assert out["baseline"]["checks_passed"] == 0
