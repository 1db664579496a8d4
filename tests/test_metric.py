import itertools
import json
import math
import re

import pytest

from pace_bench import facts as S
from pace_bench.sessions import build_session, reference_solution
from pace_bench.metrics import PACE_CODING
from pace_bench.metrics.pace_coding import pace_coding as M
from pace_bench.models import load_tokenizer

from host_objects import host_unchanged


pytestmark = pytest.mark.usefixtures("code_eval_allowed")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def rows(tok):
    return [build_session(tok, seed=s, total_tokens=800, secret=f"{s:032x}") for s in range(4)]  # fixed secrets


def _facts(row):
    return {f["name"]: f["value"] for f in row["facts"]}


def _some_alternatives(facts, fact, near=6, spread=12):
    """The other values of ``fact`` that a sandboxed test tries: all of them for a pool of 24 or fewer;
    for a larger one (the base fee, the rate, the class and exception names) the ``near`` nearest on either
    side in the pool's order (the closest numbers, the names that share a qualifier or domain) and
    ``spread`` more drawn at random. ``distinguishes`` and test_no_run_is_given_a_session_fact try all."""
    import random

    alts = S.fact_alternatives(facts, fact)
    if len(alts) <= 24:
        return alts
    pool = sorted(set(alts) | {facts[fact]}, key=(lambda v: float(v)) if fact in ("base_fee", "fee_rate") else None)
    at = pool.index(facts[fact])
    close = [v for v in pool[max(0, at - near):at + near + 1] if v != facts[fact]]
    rest = [v for v in alts if v not in close]
    return close + random.Random(f"{fact}:{facts[fact]}").sample(rest, spread)




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
    """Changing one fact in the reference solution fails the check that fact controls, for every other
    value the fact could have taken (of a large pool, the nearest and a sample: _some_alternatives)."""
    for row in rows[:2]:
        facts = _facts(row)
        probes = {p["name"]: p for p in row["probes"]}
        owners = [(name, c) for name, p in probes.items() for c in json.loads(p["checks"]) if c["fact"] == fact]
        assert owners, f"no check controls {fact}"
        for alt in _some_alternatives(facts, fact):
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


def _recall(code, facts):
    """Recall of ``{fact: value}`` for an answer that is ``code`` in a python block, scored for real."""
    ref = {"probe": "x", "checks": [], "recall": list(facts.values()), "recall_facts": list(facts)}
    out = M.score_answer("```python\n" + code + "```", json.dumps(ref))
    return out["recall_hits"], out["recall_missing"]


def test_recall_counts_values_as_the_code_uses_them():
    """A fact is recalled where the code uses its value as the spec's code does: a class it defines, a
    raised exception, a field, a whole string, a number (by value), a rounding mode it reads. Prose,
    comments, imports and near misses recall nothing."""
    facts = {"class_name": "Invoice", "quantum": "0.05", "rounding_mode": "ROUND_HALF_UP",
             "field_status": "state", "exception_code": "E-417", "base_fee": "1.25"}
    used = ('from decimal import Decimal, ROUND_HALF_UP\nclass Invoice:\n    state: str\n'
            'def f(x):\n    if x.state != "E-417":\n        pass\n'
            '    return (Decimal("1.250") + Decimal(".050")).quantize(Decimal("1"), rounding=ROUND_HALF_UP)\n')
    assert _recall(used, facts) == (6, [])
    mentioned = ('"""Invoice with state, quantum 0.05, base 1.25, E-417, ROUND_HALF_UP."""\n'
                 'from decimal import ROUND_HALF_UP  # Invoice state E-417\nclass Invoices:\n    statement: str\n'
                 'x = ["E-4170", 11.25, 0.5]\n')
    assert _recall(mentioned, facts) == (0, list(facts.values()))
    out = M.score_answer("no code at all, Invoice and 1.25", json.dumps(
        {"probe": "x", "checks": [], "recall": ["Invoice", "1.25"], "recall_facts": ["class_name", "base_fee"]}))
    assert (out["recall_hits"], out["recall_total"]) == (0, 2)  # prose that does not parse: no code uses them


def test_an_answer_that_lists_every_pool_value_recalls_nothing(rows):
    """Issue 54: an answer listing every value of every fact pool (every error code, every name) got recall
    22/22 with no check passed. Recall now needs the value used as the code uses it and no other value of
    its pool used so: the list recalls no more than an answer that lists nothing."""
    pools = {name: [facts[name]] + S.fact_alternatives(facts, name) for facts in [_facts(rows[0])]
             for name in S.FACT_NAMES}
    codes = ["E-%d" % n for n in range(1000, 10000)] + ["%s-%d" % (p, n) for p in S.CODE_PREFIXES
                                                          for n in (1000, 4817, 9999)]
    strings = sorted({v for vs in pools.values() for v in vs} | set(codes))
    listing = ("```python\nfrom decimal import Decimal\n"
               + "".join(f"class {c}(Exception):\n    {f}: str\n" for c, f in zip(
                   sorted(set(S.CLASS_NAMES) | set(S.EXCEPTION_NAMES)),
                   itertools.cycle(sorted({v for k in ("field_id", "field_amount", "field_status") for v in pools[k]}))))
               + "def settle(r):\n" + "".join(f"    raise {e}(r.{f})\n" for e in S.EXCEPTION_NAMES
                                               for f in S.STATUS_FIELDS)
               + "VALUES = " + repr(strings) + "\n"
               + "NUMBERS = [" + ", ".join(f'Decimal("{v}")' for k in ("base_fee", "fee_rate", "quantum")
                                          for v in pools[k]) + "]\n"
               + "MODES = [" + ", ".join(f"__import__('decimal').{m}" for m in S.ROUNDING_MODES) + "]\n```")
    for probe in rows[0]["probes"]:
        listed = M.score_answer(listing, probe["reference"])
        silent = M.score_answer("```python\nx = None\n```", probe["reference"])  # no value at all (a base
        # fee of 1.00 is a use of the numeral 1, as the recall rule counts numbers)
        assert listed["recall_hits"] <= silent["recall_hits"] == 0, (probe["name"], listed["recall_missing"])
        good = M.score_answer(reference_solution(rows[0], probe["name"]), probe["reference"])
        assert good["recall_hits"] == good["recall_total"] > 0, good["recall_missing"]


def test_expected_value_matching():
    from pace_bench.metrics.pace_coding.sandbox import CallResult

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
    """What the file already holds runs first, without a session fact: the fee_for probe gets the
    imports (an answer with only step 3 passes, an empty one does not); the settle probe gets a stand-in
    fee_for (an answer with only the error class and settle passes, with its own fee_for too)."""
    row = rows[0]
    probe = row["probes"][0]
    ref = json.loads(probe["reference"])
    assert "from decimal import" in ref["preamble"] and "def settle" not in ref["preamble"]
    assert M.score_answer(reference_solution(row, "fee_for"), ref)["checks_passed"] == 4
    assert M.score_answer("```python\npass\n```", ref)["checks_passed"] == 0
    ref2 = json.loads(row["probes"][1]["reference"])
    assert "def _pace_fee_for" in ref2["preamble"] and "def settle" not in ref2["preamble"]
    assert M.score_answer(reference_solution(row, "settle"), ref2)["checks_passed"] == 5
    both = reference_solution(row, "settle") + "\n" + reference_solution(row, "fee_for")
    assert M.score_answer(both, ref2)["checks_passed"] == 5  # scored with the file's fee_for
    # the answer prefix given in the prompt is prepended to the generated text
    full = reference_solution(row, "fee_for")
    assert full.startswith(ref["answer_prefix"])
    assert M.score_answer(full[len(ref["answer_prefix"]):], ref)["checks_passed"] == 4
    assert "class " not in json.loads(row["probes"][2]["reference"])["preamble"]


def _inputs(probe_reference):
    """What a run of the probe is given: its preamble and every check's call (the prompt names no fact)."""
    ref = json.loads(probe_reference)
    return [ref["preamble"]] + [c["expr"] for c in ref["checks"]]


def test_no_run_is_given_a_session_fact(rows):
    """Issue 41, items 1 and 3: no probe's preamble or calls hold a fact, so no run holds what another
    run of the session is checked on (whatever channel joins them), and no check can be answered from
    what its run is given. For every fact and every other value it could take, the session built from
    the same random draws gives every run the same inputs, and every check of the fact expects another
    value: a program that knows only its prompt, preamble and calls passes each check for at most one of
    the fact's values."""
    import random

    from pace_bench.checks import build_checks
    from pace_bench.billing_spec import probe_preamble

    for row in rows[:2]:
        facts = _facts(row)
        for probe in row["probes"]:
            preamble, *calls = _inputs(probe["reference"])
            rate = re.search(r'amount \* Decimal\("([0-9.]+)"\)', preamble)
            assert preamble == probe_preamble(probe["name"], rate.group(1) if rate else "")  # takes no fact
            for name, value in facts.items():
                pattern = rf"(?<![\w.-]){re.escape(value)}(?![\w-])"
                assert not re.search(pattern, _strip_pools("\n".join(calls))), (probe["name"], name)
        for fact in S.FACT_NAMES:
            for alt in S.fact_alternatives(facts, fact):
                mutated = dict(facts, **{fact: alt})
                if fact == "class_name":  # the id field's name follows the class name
                    mutated["field_id"] = facts["field_id"].replace(S.snake(facts["class_name"]), S.snake(alt))
                a = build_checks(facts, random.Random(f"draws:{row['secret']}"), "0.042")
                b = build_checks(mutated, random.Random(f"draws:{row['secret']}"), "0.042")
                for probe in a:
                    assert [c["expr"] for c in a[probe]] == [c["expr"] for c in b[probe]], (fact, alt, probe)
                    for x, y in zip(a[probe], b[probe]):
                        if x["fact"] == fact:
                            assert x["expected"] != y["expected"], (fact, alt, x["name"])


def _strip_pools(text):
    """The call text less what every session's calls hold: the public pools of field names and statuses
    (a record carries all of them) and the rounding modes the imports name."""
    for pool in (S.AMOUNT_FIELDS, S.STATUS_FIELDS, S.STATUS_OPEN, S.STATUS_SETTLED, S.ROUNDING_MODES):
        for word in pool:
            text = re.sub(rf"(?<![\w]){word}(?![\w])", "_", text)
    return re.sub(r'__import__\("decimal"\)\.Decimal\("[0-9.]+"\)', "_", text)


# Programs that know only their prompt and preamble: the best each can do without a session fact.
_FREE = {
    "fee_for": """
def fee_for(amount):  # the imports name every rounding mode: take one
    return (Decimal("1.00") + amount * Decimal("0.03")).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
""",
    # issue 41: any settle that returns amount + fee_for(amount) passed settle_total and
    # settle_accepts_open, reading the amount and the open status off the record it was given
    "settle": """
from decimal import Decimal
class Err(Exception):
    def __init__(self, code):
        super().__init__(code)
        self.code = code
def settle(record):
    fields = vars(record)
    amount = next(v for v in fields.values() if isinstance(v, Decimal))
    for k, v in fields.items():
        if isinstance(v, str) and k != "ref":
            setattr(record, k, "paid")
    return amount + fee_for(amount)
""",
    "module": """
from dataclasses import dataclass
from decimal import Decimal
@dataclass
class Record:
    ref: str
    amount: Decimal
    status: str
class Err(Exception):
    pass
def settle(record):
    record.status = "paid"
    return record.amount + fee_for(record.amount)
def fee_for(amount):
    return (Decimal("1.00") + amount * Decimal("0.03")).quantize(Decimal("0.01"))
""",
}


def test_a_program_without_recall_passes_no_check(rows):
    """Issue 41, item 3, in the real sandbox: the programs above know no session fact, and fail every
    check of every probe (each check's verdict needs a fact that neither the prompt, the preamble nor
    the calls hold). A guess can be right by chance (the module's guessed field names are the session's
    in one session of 168): these sessions' facts are not the guesses."""
    with host_unchanged():
        for row in rows:
            for probe in row["probes"]:
                out = M.score_answer("```python\n" + _FREE[probe["name"]] + "```", probe["reference"])
                passed = [c["name"] for c in out["checks"] if c["passed"]]
                assert out["checks_total"] > 0 and not passed, (row["session_id"], passed)


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
    from pace_bench.metrics.pace_coding.sandbox import CodeExecutionNotAllowed

    monkeypatch.delenv("PACE_ALLOW_CODE_EVAL")
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
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
    with pytest.raises(ValueError, match="timeout_s"):  # not quietly the 10 s default
        metric.compute(predictions=preds, references=refs, timeout_s=0)


# --------------------------------------------------------------------------------------------
# Issue 13: weak checks, silent inputs, a scoring failure in the runner, random shapes.


def _as_plain(x):
    """A value as the sandbox child returns it."""
    from decimal import Decimal

    if isinstance(x, Decimal):
        return {"__decimal__": str(x)}
    if isinstance(x, (list, tuple)):
        return [_as_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _as_plain(v) for k, v in x.items()}
    return x


def test_no_check_passes_for_functions_that_return_a_constant(rows):
    """Defect 5: every check fails when fee_for and settle return one fixed value, whatever it
    is: a usual stub value, or any value some check of the probe expects (the weak
    settle_accepts_open passed for any non-None value). The checks are our own expressions, so
    they are evaluated here, without the sandbox."""
    from decimal import Decimal

    from pace_bench.metrics.pace_coding.sandbox import CallResult, decode_value

    for row in rows:
        for probe in row["probes"]:
            checks = json.loads(probe["reference"])["checks"]
            constants = [None, True, False, 0, 1, Decimal("0"), "", "x", [], {}]
            for c in checks:
                expected = decode_value(c["expected"])
                constants += [expected] + (expected if isinstance(expected, list) else [])
            for constant in constants:
                for c in checks:
                    ns = {"fee_for": lambda *a, **k: constant, "settle": lambda *a, **k: constant}
                    try:
                        result = CallResult("ok", value=_as_plain(eval(c["expr"], ns)))
                    except Exception as e:  # noqa: BLE001
                        result = CallResult("raised", exc_type=type(e).__name__, exc_args=list(e.args))
                    assert not M.check_passed(c["expected"], result), (c["name"], constant)


def test_bad_inputs_get_specific_documented_errors(rows):
    """Defect 6: no input is silently reinterpreted or scored as a failed probe."""
    good = reference_solution(rows[0], 0)
    ref = rows[0]["probes"][0]["reference"]
    check = {"name": "a", "expr": "1", "expected": 1}
    bad_references = {
        "{}": "'checks' list",
        "not json": "not JSON",
        "[1, 2]": "JSON object",
        "null": "JSON object",
        json.dumps({"checks": [{"name": "a", "expr": "1"}]}): "'expected'",
        json.dumps({"checks": "fee_for(1)"}): "'checks' list",
        json.dumps({"checks": [], "recall": []}): "nothing to score",
        json.dumps({"checks": [dict(check, expected={"__decimal__": "1,5"})]}): "plain data",
        json.dumps({"checks": [dict(check, expected={"raises": 5})]}): "raise spec",
        json.dumps({"checks": [dict(check, expr=None)]}): "'expr'",
        json.dumps({"checks": [check], "recall": "Invoice"}): "'recall'",
        json.dumps({"checks": [check], "preamble": 3}): "'preamble'",
    }
    for reference, message in bad_references.items():
        with pytest.raises(M.InvalidReference, match=message):
            M.score_answer(good, reference)
        with pytest.raises(M.InvalidReference):  # checked before any answer's code runs
            M.score([good, good], [ref, reference])
    with pytest.raises(M.InvalidReference):
        M.score_answer(good, [check])
    for bad in (0, -1, 0.0, 3601, float("nan"), "10", True):
        with pytest.raises(M.MetricInputError, match="timeout_s"):
            M.limits_for(bad)
    assert M.limits_for(None) is None and M.limits_for(2).timeout_s == 2.0
    with pytest.raises(M.MetricInputError, match="must be a str"):
        M.score([None], [ref])
    with pytest.raises(M.MetricInputError, match="2 predictions for 1 references"):
        M.score([good, good], [ref])
    with pytest.raises(M.MetricInputError, match="must be a list"):
        M.score(good, ref)
    assert issubclass(M.InvalidReference, M.MetricInputError) and issubclass(M.MetricInputError, ValueError)


def _random_json(rng, depth=0):
    roll = rng.random()
    if depth > 6 or roll < 0.45:
        return rng.choice([None, True, False, 0, -1, 2**70, 1.5, float("inf"), float("nan"), "", "x",
                           "E-417", {"__decimal__": rng.choice(["1.25", "x", "sNaN", "NaN", "1e999999", ""])}])
    if roll < 0.6:
        nested = []
        for _ in range(rng.choice([50, 99, 100, 101, 700])):  # json.dumps itself recurses
            nested = [nested]
        return nested
    if roll < 0.8:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["raises", "args", "code", "__decimal__", "name", "expr", "expected", "checks", "recall", "k"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def _random_reference(rng):
    roll = rng.random()
    if roll < 0.1:
        return rng.choice(["", "{", "[]", "null", "1", '"x"'])
    if roll < 0.3:
        return json.dumps(_random_json(rng))
    checks = [{"name": f"c{k}", "expr": "f()", "expected": _random_json(rng), "fact": rng.choice([None, "x"])}
              for k in range(rng.randrange(4))]
    for c in checks:
        if rng.random() < 0.3:
            c["expected"] = {"raises": rng.choice([None, "E", 1]), "code": rng.choice(["E-1", 2]),
                             "args": _random_json(rng)}
        if rng.random() < 0.1:
            del c[rng.choice(["name", "expr", "expected"])]
    ref = {"checks": checks, "recall": rng.choice([[], ["x", "1.5"], [1], "x"])}
    if rng.random() < 0.3:
        ref["recall_facts"] = rng.choice([["class_name", "base_fee"], ["class_name", "base_fee"], ["x", "y"], [1, 2]])
    return json.dumps(ref) if rng.random() < 0.8 else ref


def _random_report(rng, nonce):
    msg = {"c": nonce, "status": rng.choice(["ok", "raised", "error", "bogus"])}
    for key in rng.sample(["value", "exc_type", "exc_args", "exc_attrs", "detail"], rng.randrange(6)):
        msg[key] = _random_json(rng)
    if rng.random() < 0.5:
        msg["exc_type"] = "E"
    return json.dumps(msg).encode()


def test_random_results_and_references_raise_only_documented_errors(monkeypatch):
    """Property test (fixed seed): random JSON shapes as the child's report lines (through the
    parent's own parsing) and as references never make the metric raise anything but its own
    MetricInputError (InvalidReference included)."""
    import os
    import random

    from pace_bench.metrics.pace_coding import sandbox as S

    rng = random.Random(13)

    def fake_run_answer(codes, calls, limits, preamble):
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        run = S._Run(list(calls), os.getpid(), wfd, parse=True)

        def asked():
            return os.read(rfd, 1 << 16).split(b" ")[0].decode()  # the nonce of the request just sent

        try:
            uses = rng.choice([{}, {"strings": ["E-417", 3, None]}, {"numbers": ["1.25", "x", "1e5", ""]}, [1],
                               {"names": "ROUND_UP"}, {k: ["Invoice", "0.05"] for k in ("classes", "numbers", "x")}])
            run.feed(json.dumps({"setup": ["landlock v7"]}).encode())
            run.feed(json.dumps({"chosen": rng.choice([0, None, "0"]), "uses": uses}).encode())
            while not run.finished():  # the load, then each call (a protocol break ends the run: no more requests)
                run.feed(json.dumps({"c": asked(), "ready": True}).encode() if run.phase == "load"
                         else _random_report(rng, asked()))
            return S.AnswerRun(run.chosen, run.uses, run.results(None, 1.0, ""), run.failed)
        finally:
            os.close(rfd)
            run.close_calls()

    monkeypatch.setattr(M, "run_answer", fake_run_answer)
    outcomes = {"scored": 0, "refused": 0}
    for _ in range(600):
        try:
            out = M.score_answer("```python\nx = 1\n```", _random_reference(rng))
        except M.MetricInputError:
            outcomes["refused"] += 1
            continue
        json.dumps(out)  # the details stay plain data
        outcomes["scored"] += 1
    assert outcomes["scored"] > 50 and outcomes["refused"] > 50, outcomes


def test_random_values_through_the_real_sandbox():
    """The same property end to end, for a few programs returning random values."""
    import random

    rng = random.Random(7)
    for _ in range(3):
        values = [_random_json(rng) for _ in range(8)]
        program = "import json\nVALUES = json.loads(%r)\ndef f(k):\n    return VALUES[k]\n" % json.dumps(values)
        checks = [{"name": f"c{k}", "expr": f"f({k})", "expected": _random_json(rng)} for k in range(8)]
        checks = [c for c in checks if M.plain_data_error(c["expected"]) is None]
        out = M.score_answer("```python\n" + program + "```", json.dumps({"checks": checks}))
        assert out["checks_total"] == len(checks)
        json.dumps(out)


def test_runner_records_a_probe_whose_scoring_fails_and_goes_on(monkeypatch, rows):
    """Defect 2: one probe's scoring failure is recorded with every check failed; the run goes on."""
    from pace_bench import runner

    class Handle:
        def remove(self):
            pass

    class Decoder:
        def register_forward_pre_hook(self, *args, **kwargs):
            return Handle()

    class Model:
        def get_decoder(self):
            return Decoder()

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "answer"

    class Metric:
        def __init__(self):
            self.calls = 0

        def compute(self, predictions, references):
            self.calls += 1
            if self.calls == 2:
                raise RecursionError("maximum recursion depth exceeded while decoding")
            return {"details": [{"checks_passed": 1, "checks_total": 1, "recall_hits": 0, "recall_total": 0,
                                 "checks": [{"name": "c", "fact": None, "passed": True}]}]}

    monkeypatch.setattr(runner, "Blueprint", type("B", (), {"from_dicts": staticmethod(lambda d: None)}))
    monkeypatch.setattr(runner, "make_cache", lambda *a, **k: object())
    monkeypatch.setattr(runner, "generate_reply", lambda *a, **k: [])
    row = rows[0]
    records = runner.play_session(Model(), Tokenizer(), row, "h2o", None, Metric(), 16, [])
    assert len(records) == len(row["probes"]) == 3
    failed = records[1]
    assert "RecursionError" in failed["scoring_error"] and failed["checks_passed"] == 0
    assert failed["checks_total"] == len(json.loads(row["probes"][1]["reference"])["checks"]) > 0
    assert "scoring_error" not in records[0] and records[2]["checks_passed"] == 1

    class Refusing(Metric):
        def compute(self, predictions, references):
            from pace_bench.metrics.pace_coding.sandbox import CodeExecutionNotAllowed
            raise CodeExecutionNotAllowed("opt in")

    with pytest.raises(Exception, match="opt in"):  # no probe can be scored: stop at once
        runner.play_session(Model(), Tokenizer(), row, "h2o", None, Refusing(), 16, [])


def _fee_for_shapes(row):
    """A correct fee_for answer in each shape a model or another prompt may give it."""
    full = reference_solution(row, "fee_for")  # "```python\ndef fee_for(amount):\n    base_fee = ..."
    code = full[len("```python\n"):-len("```")]
    prefix = json.loads(row["probes"][0]["reference"])["answer_prefix"]
    return {
        "continuation of the prompt's prefix": full[len(prefix):],
        "fenced block (repeating the prefix)": full,
        "prose, then a fenced block": "Here is the function you asked for:\n\n" + full + "\n\nIt rounds as specified.",
        "bare code": code,
        "bare code after a blank line": "\n" + code,
        "untagged fence": "```\n" + code + "```",
        "py tag, unclosed fence (truncated)": "```py\n" + code,
    }


def test_correct_answers_in_every_shape_pass(rows):
    """Issue 14: a correct fee_for scored 0/4 ('unterminated string literal') when it did not continue
    the prompt's answer prefix. Every shape of a correct answer now passes every check."""
    row = rows[0]
    ref = row["probes"][0]["reference"]
    for shape, answer in _fee_for_shapes(row).items():
        out = M.score_answer(answer, ref)
        assert (out["checks_passed"], out["failure"]) == (4, None), (shape, out)
        assert out["recall_hits"] == out["recall_total"] == 4, shape
        want = "continuation" if shape.startswith("continuation") else "standalone"
        assert out["answer_form"] == want, shape


def test_the_sandbox_chooses_the_reading():
    """The first reading whose code parses is run; if none parses, the first, whose load fails. The parse
    happens in the sandbox (``run_answer``), never in the parent."""
    prefix = 'def f():\n    return "'
    assert M.answer_forms("x", "") == [("standalone", "x")]
    assert M.answer_forms(prefix + "a\"", prefix) == [("standalone", prefix + "a\"")]
    ref = json.dumps({"probe": "x", "checks": [{"name": "f", "expr": "f()", "expected": "a"}], "answer_prefix": prefix})
    out = M.score_answer('a"\n', ref)
    assert (out["answer_form"], out["passed"]) == ("continuation", True)
    out = M.score_answer('def f():\n    return "a"\n', ref)  # the continuation does not parse
    assert (out["answer_form"], out["passed"]) == ("standalone", True)
    out = M.score_answer("x = (\n", ref)  # neither parses: the first reading, with its error
    assert (out["answer_form"], out["failure"]) == ("continuation", "does not parse"), out
    assert "SyntaxError" in out["checks"][0]["got"]
    assert M.score_answer("  \n", ref)["failure"] == "no code"
    assert M.score_answer("(" * 300, ref)["failure"] == "does not parse"  # the parser's own limit
    assert M.score_answer("-" * 60_000 + "1", ref)["failure"] == "does not parse"


def test_the_parents_work_on_a_hostile_answer_is_bounded(rows):
    """Issue 54: the parent parsed the answer itself (``ast.parse`` of 1.5 MB: +1 GiB and 10 s of its CPU)
    and put every number of the answer into a set of Decimals (50,000 numbers whose hashes collide: 44 s,
    quadratic in the text). Now an answer over MAX_ANSWER_CHARS is not read, the sandbox parses the rest,
    and recall looks values up in sets of str. Measured in this process: CPU time (the child's is its own)
    and the peak of Python's allocations, for 10 MB of hostile text and for the worst texts under the cap."""
    import time
    import tracemalloc

    ref = rows[0]["probes"][2]["reference"]  # the module probe: every fact
    collide = 2**61 - 1  # Decimal(k * collide) all hash alike
    under = M.MAX_ANSWER_CHARS - 100
    hostile = {
        "10 MB of code": "```python\nx = [" + "1, " * 3_500_000 + "]\n```",
        "colliding numbers": "```python\nX = [" + ", ".join(str(collide * k) for k in range(1, 3000))[:under] + "]\n```",
        "colliding numbers in prose": " ".join(str(collide * k) for k in range(1, 3000))[:under],
        "fences without a newline": "```python" * (under // 9),
        "deep nesting": "```python\nx = " + "[" * 90 + "]" * 90 + "\n" + "y = " + "-" * (under - 200) + "1\n```",
    }
    for name, answer in hostile.items():
        tracemalloc.start()
        cpu = time.process_time()
        out = M.score_answer(answer, ref)
        cpu = time.process_time() - cpu
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert out["checks_passed"] == out["recall_hits"] == 0, (name, out["failure"])
        assert cpu < 1.0 and peak < 4 * len(answer) + (8 << 20), (name, cpu, peak)


def test_failure_says_why_a_probe_failed(rows):
    row = rows[0]
    fee_ref = row["probes"][0]["reference"]
    facts = _facts(row)
    code = reference_solution(row, "fee_for")
    wrong = code.replace(f'"{facts["base_fee"]}"', '"99"')
    cases = {
        "": "no code",
        "Sorry, I cannot recall step 3.": "does not parse",
        "```python\ndef fee_for(amount):\n    return (\n```": "does not parse",
        "```python\nreturn 1\n```": "does not parse",  # parses, but the compiler refuses it
        wrong: "wrong value",
        "```python\ndef fee_for(amount):\n    raise ValueError('no')\n```": "raised",
        "```python\nraise SystemExit(3)\n```": "raised",
    }
    for answer, failure in cases.items():
        out = M.score_answer(answer, fee_ref)
        assert out["failure"] == failure, (answer, out)
        assert out["checks_passed"] < out["checks_total"]
        assert all(c["failure"] in M.FAILURES for c in out["checks"] if not c["passed"])
    slow = "```python\ndef fee_for(amount):\n    while True:\n        pass\n```"
    out = M.score_answer(slow, fee_ref, M.limits_for(1.0))
    assert out["failure"] == "timeout" and out["checks_passed"] == 0
    ok = M.score_answer(code, fee_ref)
    assert ok["failure"] is None and all(c["failure"] is None for c in ok["checks"])


def test_hf_code_eval_opt_in(monkeypatch, rows):
    monkeypatch.delenv("PACE_ALLOW_CODE_EVAL")
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    assert M.score_answer(reference_solution(rows[0], 0), rows[0]["probes"][0]["reference"])["passed"]


def test_card_follows_evaluate_conventions_and_its_example_runs(capsys):
    import re
    from pathlib import Path

    import yaml

    card = (Path(PACE_CODING) / "README.md").read_text()
    front, body = re.match(r"^---\n(.*?)\n---\n(.*)$", card, re.DOTALL).groups()
    meta = yaml.safe_load(front)
    assert meta["title"] == "pace_coding" and "metric" in meta["tags"] and "HF_ALLOW_CODE_EVAL" in meta["description"]
    for section in ("## Metric Description", "## How to Use", "### Inputs", "### Output Values", "### Examples",
                    "## Limitations and Bias", "## Citation"):
        assert section in body, section
    assert M._CITATION.strip() in body and "drop-in {KV} cache" in M._CITATION
    example = body.split("### Examples", 1)[1].split("```python\n", 1)[1].split("\n```", 1)[0]
    exec(compile(example, "README example", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    promised = [line.split("# ", 1)[1].strip() for line in example.splitlines() if line.startswith("print(")]
    assert printed == promised


def test_chance_levels_match_a_fixed_guess_over_simulated_sessions(monkeypatch):
    """Issue 54: one fixed guess passed 0.43 checks per session. ``chance_levels`` computes each check's
    chance from the generator's pools and the facts that decide it; a fixed guess (the reference program of
    one fixed set of facts) over 4,000 sessions of the generator passes no check more often than that, and
    all checks together no more often than the fifth round's bound, 1e-3 per session (with the spread of
    4,000 sessions: 12 passes at most; the generator before, 15, passed 1,635 here: 0.41 per session). The checks are built
    twice from the same draws, once with the session's facts and once with the guess's, so the guess passes
    exactly where the expected values agree."""
    import random

    from pace_bench.checks import CHECK_FACTS, build_checks, chance_levels, stand_in_rate

    import pace_bench.checks as C

    levels, n = chance_levels(), 4000
    assert set(levels) == set(CHECK_FACTS)
    guess = S.sample_facts(random.Random("guess"))
    passed = dict.fromkeys(levels, 0)
    for k in range(n):
        rng = random.Random(f"session {k}")
        drawn = S.sample_facts(rng)
        stand_in = stand_in_rate(rng)
        start = rng.getstate()
        amounts = C.pick_amounts(drawn, rng)  # the session's calls, for the guess too
        after = rng.getstate()
        built = []
        for facts in (drawn, guess):
            rng.setstate(start)
            with monkeypatch.context() as m:
                m.setattr(C, "pick_amounts", lambda f, r: (r.setstate(after), amounts)[1])
                built.append(build_checks(facts, rng, stand_in))
        for probe, checks in built[0].items():
            for real, guessed in zip(checks, built[1][probe]):
                assert real["expr"] == guessed["expr"]
                passed[real["name"]] += real["expected"] == guessed["expected"]
    for name, level in levels.items():
        rate, spread = passed[name] / n, 4 * math.sqrt(level * (1 - level) / n) + 1 / n
        assert rate <= level + spread, (name, rate, level)
        if len(CHECK_FACTS[name]) == 1 and level > 0.01:
            assert rate >= level - spread, (name, rate, level)
    bound = 1e-3
    assert sum(levels.values()) <= bound, sum(levels.values())
    assert sum(passed.values()) / n <= bound + 4 * math.sqrt(bound / n) + 1 / n, passed


def test_half_amounts_tell_half_up_from_half_even_for_every_rate_and_quantum():
    """The rounding checks' fixed amounts (drawn without the facts) hold, for every rate and quantum of the
    pools and base fees of every residue that matters (a multiple of 1.00 plus 0, 0.25, 0.50, 0.75; the
    largest), an amount where ROUND_HALF_UP and ROUND_HALF_EVEN give different fees."""
    from pace_bench.amounts import LOW, half_amounts

    halves = half_amounts()
    assert min(halves) >= LOW and len(halves) <= 160
    for base in ("0.25", "0.50", "0.75", "1.00", "12.50"):
        for rate in S.FEE_RATES:
            for q in S.QUANTA:
                up = {"base_fee": base, "fee_rate": rate, "quantum": q, "rounding_mode": "ROUND_HALF_UP"}
                even = dict(up, rounding_mode="ROUND_HALF_EVEN")
                assert any(S.fee(up, a) != S.fee(even, a) for a in halves), (base, rate, q)


def test_the_card_publishes_the_chance_levels():
    from pathlib import Path

    from pace_bench.checks import chance_levels

    card = (Path(PACE_CODING) / "README.md").read_text()
    for name, level in chance_levels().items():
        assert f"| `{name}` | {level:.2g} |" in card, name
    assert f"**{sum(chance_levels().values()):.2g}**" in card


# --------------------------------------------------------------------------------------------
# Issue 66: an answer that answers the harness's calls, answers that abort the batch, candidate lists


_ANSWERS_THE_CALLS = '''
import json, os, sys, threading
CODES = ["%%s-%%d" %% (p, n) for p in %r for n in range(1000, 10000)]
seen = []

def _forge(read_fd, write_fd):
    """Wait on the call channel; answer each request read off it with its nonce and every error code."""
    buf = b""
    while True:
        try:
            chunk = os.read(read_fd, 1 << 16)
        except OSError:
            return
        if not chunk:
            return
        buf += chunk
        while b"\\n" in buf:
            line, buf = buf.split(b"\\n", 1)
            if len(line) > 33 and line[32:33] == b" ":
                seen.append(line[:32])
                reply = json.dumps({"c": line[:32].decode(), "violations": [], "status": "raised",
                                    "exc_type": "LedgerError", "exc_args": CODES, "exc_attrs": {}})
                view = memoryview(reply.encode() + b"\\n")
                while view:
                    view = view[os.write(write_fd, view):]

def _by_path():
    try:
        _forge(os.open(".pace-call", os.O_RDONLY), os.open(".pace-report", os.O_WRONLY))
    except OSError:
        pass

threading.Thread(target=_forge, args=(int(sys.argv[2]), int(sys.argv[3])), daemon=True).start()
threading.Thread(target=_by_path, daemon=True).start()

def settle(record):
    raise ValueError("no code")

def calls_read():
    return len(seen)
'''


def test_an_answers_thread_cannot_answer_the_harnesss_calls():
    """Issue 66, attack 1: a thread of the answer waited on the call FIFO (its number is in ``sys.argv``,
    its path in the scratch folder), got the next request (a reader that waits first is woken first) and
    answered it with the right nonce and all 108,000 error codes: ``settle_error_code`` passed in every
    session. Now the harness's descriptors are in a table of its own and the FIFOs' paths are gone before
    the answer runs, the parent refuses a reply over the harness's caps, and a check needs exactly one
    code."""
    ref = {"checks": [{"name": "settle_error_code", "expr": "settle(None)", "expected": {"raises": None, "code": "PAY-4817"}},
                      {"name": "no_request_read", "expr": "calls_read()", "expected": 0}]}
    out = M.score_answer("```python\n" + _ANSWERS_THE_CALLS % S.CODE_PREFIXES + "```", json.dumps(ref))
    error_code, read = out["checks"]
    assert not error_code["passed"] and error_code["got"] == "ValueError('no code',)", error_code
    assert read["passed"], read  # no request ever reached the answer's threads


def test_an_answer_that_cannot_be_described_fails_alone(rows):
    """Issue 66, attack 2: a module holding an integer literal of 4,470 decimal digits made the child's
    description of the answer raise (``repr``: "Exceeds the limit (4300 digits)"); the child reported a
    failed setup, and ``compute`` raised SandboxUnavailable for the whole batch. Now that answer scores 0
    with the reason, and the next answer of the batch is scored as usual."""
    ref = rows[0]["probes"][0]["reference"]
    good = reference_solution(rows[0], "fee_for")
    literal = good.replace("```python\n", "```python\nBIG = 0x" + "f" * 3712 + "\n", 1)
    out = M.score([literal, good], [ref, ref])
    hostile, honest = out["details"]
    assert hostile["checks_passed"] == 0 and hostile["failure"] == "error", hostile
    assert all("4300" in c["got"] for c in hostile["checks"]), hostile["checks"][0]
    assert honest["passed"], honest


_READS_REPORTS_BACK = '''
import os, sys, threading
reached = []

def _steal(fd):
    """Read back what the harness writes to the report FIFO, and write it again."""
    while True:
        try:
            data = os.read(fd, 1 << 16)
            reached.append(1)
            os.write(fd, data)
        except OSError:
            return

threading.Thread(target=_steal, args=(int(sys.argv[3]),), daemon=True).start()

def channel_reached():
    return len(reached)
'''


def test_a_report_fifo_read_back_does_not_abort_the_batch(rows):
    """Issue 66, attack 3: the child held the report FIFO read-write, and a thread of the answer read each
    reply back (and wrote it again); where it won the race between the parent's ``select`` and ``read``, the
    parent's read of the non-blocking FIFO raised BlockingIOError out of ``compute``. Now the answer's
    threads hold no descriptor of the FIFO, and the parent takes an empty read as nothing to read (an error
    reading a FIFO fails that answer alone: ``test_sandbox.py``)."""
    ref = json.loads(rows[0]["probes"][0]["reference"])
    ref["checks"].append({"name": "no_channel", "expr": "channel_reached()", "expected": 0, "fact": None})
    good = reference_solution(rows[0], "fee_for")
    hostile = good.replace("```python\n", "```python\n" + _READS_REPORTS_BACK, 1)
    out = M.score([hostile] * 3 + [good], [json.dumps(ref)] * 3 + [rows[0]["probes"][0]["reference"]])
    assert all(d["passed"] for d in out["details"]), [d["failure"] for d in out["details"]]


def _every_candidate(value, pools):
    """``value`` with each leaf that a session fact could be replaced by every value of that fact's pool
    (a name, a status: all of ``pools``' values; a number: it and its neighbours; a bool: both)."""
    from decimal import Decimal

    if isinstance(value, dict) and set(value) == {"__decimal__"}:
        x = Decimal(value["__decimal__"])
        return [{"__decimal__": str(x + d)} for d in (Decimal("-0.05"), Decimal("-0.01"), 0, Decimal("0.01"), Decimal("0.05"))]
    if isinstance(value, dict):
        return {k: _every_candidate(v, pools) for k, v in value.items()}
    if isinstance(value, list):
        return [_every_candidate(v, pools) for v in value]
    if isinstance(value, bool):
        return [True, False]
    if isinstance(value, str):
        return next((pool for pool in pools if value in pool), value)
    return value


def test_an_answer_offering_every_candidate_passes_no_check(rows):
    """Issue 66: ``settle_error_code`` passed when any one of the exception's values equalled the code, so an
    exception carrying every code passed it. For every check of every probe, a result that offers every
    candidate value of the pools its expected value is drawn from (every code among the exception's args or
    attributes, beside the right one; every name, status or neighbouring amount in place of each) passes
    nothing, while the result that offers only the right values passes."""
    from pace_bench.metrics.pace_coding.sandbox import CallResult, decode_value

    codes = ["%s-%d" % (p, n) for p in S.CODE_PREFIXES for n in range(S.CODE_NUMBERS[0], S.CODE_NUMBERS[1] + 1)]
    pools = [S.CLASS_NAMES, S.EXCEPTION_NAMES, S.STATUS_OPEN, S.STATUS_SETTLED, S.AMOUNT_FIELDS, S.STATUS_FIELDS,
             [f.format(c=S.snake(c)) for f in S.ID_FIELDS for c in S.CLASS_NAMES]]
    seen = set()
    for row in rows:
        for probe in row["probes"]:
            for c in json.loads(probe["reference"])["checks"]:
                seen.add(c["name"])
                expected = c["expected"]
                if isinstance(expected, dict) and "raises" in expected:
                    name, code = expected["raises"] or "LedgerError", expected["code"]
                    right = CallResult("raised", exc_type=name, exc_args=[code, "the record is settled"], exc_attrs={})
                    offers = [CallResult("raised", exc_type=name, exc_args=codes, exc_attrs={}),
                              CallResult("raised", exc_type=name, exc_args=[code, codes[0]], exc_attrs={}),
                              CallResult("raised", exc_type=name, exc_args=[code], exc_attrs={"alternative": codes[-1]}),
                              CallResult("raised", exc_type=name, exc_args=[], exc_attrs={"code": code, "old": "E-417"})]
                else:
                    right = CallResult("ok", value=expected)
                    offers = [CallResult("ok", value=_every_candidate(expected, pools))]
                assert M.check_passed(expected, right), c["name"]
                for offer in offers:
                    assert not M.check_passed(expected, offer), (c["name"], decode_value(offer.exc_args or [])[:3])
    from pace_bench.checks import CHECK_FACTS
    assert seen == set(CHECK_FACTS)
