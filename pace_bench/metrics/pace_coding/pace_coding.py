"""pace_coding: hidden-test and fact-recall scoring of the PACE benchmark's coding probes."""

import json
import re
from decimal import Decimal, InvalidOperation

import datasets
import evaluate

from pace_bench.facts import CODE_PREFIXES, in_pool, numeral
from pace_bench.metrics.pace_coding.sandbox import SandboxLimits, decode_value, plain_data_error, run_answer
from pace_bench.stats import sign_test

_CITATION = """\
@software{pace_hf,
  title = {{PACE}: foresight retention and bounded rotary positions as a drop-in {KV} cache for
           {Hugging Face} Transformers},
  note = {pace_hf, the PACE benchmark's pace_coding metric},
  year = {2026},
}
"""

_DESCRIPTION = """\
Scores answers to the PACE benchmark's coding probes (write `fee_for`, write `settle`, write the
module). The code of each answer (its fenced ```python blocks, concatenated; the raw text when it has
none) runs in pace_hf's sandbox against the probe's hidden checks; the parent process compares the
returned plain data with the expected values, which never reach the child. When the probe's prompt
ended with the start of the answer (`answer_prefix`), the answer is read both as a continuation of
that prefix and as standalone code, and the first of the two whose code parses (in the sandbox: the
parent parses nothing; an answer over 65,536 characters is not read) is scored. Each probe says why it
failed (`failure`). A separate recall score counts the session facts (names, values, rounding mode,
quantum, status values, error code) that the code uses as the spec's code does, and no rival value of
the same pool. Given a reference arm's
answers to the same probes, it also reports a paired comparison: probes where this arm passed more /
fewer / as many checks, and a two-sided exact sign test.

Executing model-generated code requires the opt-in environment variable PACE_ALLOW_CODE_EVAL=1
(HF_ALLOW_CODE_EVAL=1, as for HF's code_eval, is accepted too).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of str, the model's answer to each probe.
    references: list of str, each the probe's grading record as JSON:
        {"probe": name, "step": int, "checks": [{"name", "expr", "expected", "fact"}], "recall": [str],
         "recall_facts": [str] (optional: the fact of each recall value; without it recall is not scored),
         "preamble": str (optional: code the file already holds; it runs before the answer's code),
         "answer_prefix": str (optional: the start of the answer, given in the prompt; see "Answer
         forms" in the card)}
        (the `reference` field of a probe in pace_bench.load_sessions rows).
    baseline_predictions: optional list of str, a reference arm's answers to the same probes, for
        the paired comparison.
    timeout_s: optional float, wall-clock limit per answer, in (0, 3600] (default 10 s).
Raises:
    InvalidReference (a ValueError): a grading record that is not a JSON object of the shape above
        (e.g. not JSON, a list, no "checks" list, a check without "expected").
    MetricInputError (a ValueError; InvalidReference's base): other bad arguments (predictions
        that are not str, unequal lengths, a timeout_s outside (0, 3600]).
    pace_bench.metrics.pace_coding.sandbox.CodeExecutionNotAllowed: without the opt-in;
    pace_bench.metrics.pace_coding.sandbox.SandboxUnavailable: where the sandbox cannot wall off the
        host's files (checked once, before the first answer runs). No answer raises anything: one that
        cannot be read, run or reported fails alone, with the reason in its checks' "got".
Returns:
    checks_passed, checks_total, check_pass_rate: hidden checks over all answers.
    probes_passed, probes_total, probe_pass_rate: answers that passed every check.
    recall_hits, recall_total, recall: facts the answers' code uses in their role.
    per_fact: {fact: {"passed", "total"}} for the checks that control each fact.
    details: one record per answer: checks (each with status, outcome and failure), failure (null,
        "too long", "no code", "does not parse", "error", "timeout", "raised" or "wrong value"), answer_form
        ("standalone" or "continuation"), recall hits and misses.
    paired (with baseline_predictions): better, worse, tied, p_value; and baseline: the reference
        arm's own totals.
Examples:
    >>> import evaluate, pace_bench.metrics
    >>> metric = evaluate.load(pace_bench.metrics.PACE_CODING)
    >>> metric.compute(predictions=[answer], references=[probe["reference"]])  # doctest: +SKIP
"""

class MetricInputError(ValueError):
    """An argument the metric cannot score (the message says which and why)."""


class InvalidReference(MetricInputError):
    """A grading record that is not valid JSON of the documented shape."""


_TAG = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")
_PY_TAGS = {"python", "py", "python3", "py3"}
_NUMERAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
# An answer longer than this is not read at all (failure "too long"): the longest of 1,078 stored answers
# is 2,073 characters (the module probe's 384 new tokens), so no real answer comes near it, and the
# parent's work on a hostile one stays bounded.
MAX_ANSWER_CHARS = 65_536


def extract_code(text):
    """The code of an answer: its ```python (or ```py) blocks joined by blank lines; else
    its untagged ``` blocks; else the raw text. An unclosed last fence runs to the end
    (a truncated answer). One pass over the text (``str.find``), linear in its length."""
    blocks, at = [], 0
    while (start := text.find("```", at)) >= 0:
        eol = text.find("\n", start + 3)
        if eol < 0:
            break
        tag = _TAG.match(text, start + 3, eol).group(1).lower()
        end = text.find("```", eol + 1)
        blocks.append((tag, text[eol + 1:] if end < 0 else text[eol + 1:end]))
        if end < 0:
            break
        at = end + 3
    tagged = [code for tag, code in blocks if tag in _PY_TAGS]
    if tagged:
        return "\n\n".join(tagged)
    untagged = [code for tag, code in blocks if not tag]
    if untagged:
        return "\n\n".join(untagged)
    return text


# How the code must use each fact's value to recall it (the kinds of ``sandbox.run_answer``'s ``uses``).
RECALL_USES = {
    "class_name": ("classes",), "exception_name": ("classes", "raised"),
    "field_id": ("fields",), "field_amount": ("fields",), "field_status": ("fields",),
    "status_open": ("strings",), "status_settled": ("strings",), "exception_code": ("strings",),
    "base_fee": ("numbers",), "fee_rate": ("numbers",), "quantum": ("numbers",),
    "rounding_mode": ("names", "strings"),
}


def recall_hits(uses, facts):
    """For each ``(fact name, value)``, whether the code uses the value as the code of the spec does
    (:data:`RECALL_USES`: a class it defines, an exception it raises, a field or attribute, a whole string
    constant, a numeric constant, a name it reads) and uses no other value of that fact's pool in the same
    way (values that another fact of the probe holds aside). So an answer that lists a pool recalls
    nothing from it, and prose, comments and imports recall nothing. ``uses`` is what the sandbox's parse
    of the answer's code reported (:func:`pace_bench.metrics.pace_coding.sandbox.run_answer`); each test
    is a lookup in a set of str, so the work is linear in the answer."""
    numeric = {name for name, kinds in RECALL_USES.items() if kinds == ("numbers",)}
    numbers = {numeral(x) for x in uses.get("numbers", ()) if _NUMERAL.fullmatch(x)}
    own = {numeral(v) if n in numeric else v for n, v in facts}
    hits = []
    for name, value in facts:
        kinds = RECALL_USES.get(name, ())
        used = numbers if name in numeric else set().union(*(uses.get(k, ()) for k in kinds))
        want = numeral(value) if name in numeric else value
        rivals = [u for u in used if u != want and u not in own and in_pool(name, u)]
        hits.append(want in used and not rivals)
    return hits


def values_equal(expected, got):
    """Compare decoded plain data. A Decimal expected value equals any number of the same
    value (Decimal, int, or a float whose shortest repr has that value); bools only equal
    bools; lists and dicts compare element by element; other values by type and ==."""
    if isinstance(expected, Decimal):
        if type(got) is Decimal:
            return got == expected
        if type(got) in (int, float):
            try:
                return Decimal(repr(got)) == expected
            except InvalidOperation:
                return False
        return False
    if type(expected) is bool or type(got) is bool:
        return type(expected) is type(got) and expected == got
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(
            values_equal(e, g) for e, g in zip(expected, got))
    if isinstance(expected, dict):
        return isinstance(got, dict) and set(got) == set(expected) and all(
            values_equal(v, got[k]) for k, v in expected.items())
    if type(expected) in (int, float) and type(got) in (int, float):
        return expected == got
    return type(expected) is type(got) and expected == got


# An error code's shape: a prefix of the pool and digits (4 of them from generator 16 on, 3 before).
_CODE_SHAPE = re.compile(r"(?:%s)-[0-9]+" % "|".join(CODE_PREFIXES))


def _is_code(value, code):
    """Whether ``value``, a str the exception carries, is a candidate for its error code ``code``: the code
    itself, or any value shaped like an error code."""
    return value == code or _CODE_SHAPE.fullmatch(value) is not None


def _is_raise_spec(expected):
    return isinstance(expected, dict) and "raises" in expected


def check_passed(expected, result):
    """Whether a CallResult meets a check's expected outcome (see pace_bench.sessions). A check passes on
    one answer, not on a list of candidates: an expected error code must be the only code among the
    exception's args and attributes (the str values shaped like a code), so an exception that carries
    several codes passes no code check; every other expected value is compared whole (:func:`values_equal`)."""
    if _is_raise_spec(expected):
        if result.status != "raised":
            return False
        if expected.get("raises") is not None and result.exc_type != expected["raises"]:
            return False
        args = [decode_value(a) for a in (result.exc_args or [])]
        if "args" in expected and not values_equal(decode_value(expected["args"]), args):
            return False
        if "code" in expected:
            values = args + [decode_value(v) for v in (result.exc_attrs or {}).values()]
            if {v for v in values if type(v) is str and _is_code(v, expected["code"])} != {expected["code"]}:
                return False
        return True
    return result.status == "ok" and values_equal(decode_value(expected), decode_value(result.value))


def _short(result):
    if result.status == "ok":
        text = json.dumps(result.value)
    elif result.status == "raised":
        text = f"{result.exc_type}{tuple(result.exc_args or [])}"
    else:
        text = result.detail or ""
    return text if len(text) <= 200 else text[:197] + "..."


_RAISE_KEYS = {"raises", "args", "code"}


def parse_reference(reference):
    """The grading record (a JSON string or dict) as a dict, checked against the documented shape
    so that scoring cannot fail halfway; raises InvalidReference naming what is wrong."""
    if isinstance(reference, str):
        try:
            ref = json.loads(reference)
        except (ValueError, RecursionError) as e:
            raise InvalidReference(f"reference is not JSON: {str(e)[:200]}") from None
    else:
        ref = reference
    if type(ref) is not dict:
        raise InvalidReference(f"reference must be a JSON object, got {type(ref).__name__}")
    checks, recall = ref.get("checks"), ref.get("recall", [])
    if type(checks) is not list:
        raise InvalidReference("reference needs a 'checks' list (see the metric's description)")
    if type(recall) is not list or not all(type(f) is str for f in recall):
        raise InvalidReference("reference's 'recall' must be a list of str")
    names = ref.get("recall_facts")
    if names is not None and not (type(names) is list and len(names) == len(recall)
                                  and all(type(n) is str and n in RECALL_USES for n in names)):
        raise InvalidReference(f"reference's 'recall_facts' must name the fact of each 'recall' value, one of "
                               f"{sorted(RECALL_USES)}")
    if not checks and not recall:
        raise InvalidReference("reference has neither checks nor recall facts: nothing to score")
    for key in ("preamble", "answer_prefix"):
        if ref.get(key) is not None and type(ref[key]) is not str:
            raise InvalidReference(f"reference's {key!r} must be a str")
    for k, c in enumerate(checks):
        if type(c) is not dict:
            raise InvalidReference(f"check {k} must be an object")
        for key in ("name", "expr"):
            if type(c.get(key)) is not str:
                raise InvalidReference(f"check {k} needs a str {key!r}")
        if c.get("fact") is not None and type(c["fact"]) is not str:
            raise InvalidReference(f"check {c['name']!r}: 'fact' must be a str or null")
        if "expected" not in c:
            raise InvalidReference(f"check {c['name']!r} has no 'expected' value")
        expected = c["expected"]
        why = plain_data_error(expected)
        if why is not None:
            raise InvalidReference(f"check {c['name']!r}: 'expected' is not plain data: {why}")
        if _is_raise_spec(expected) and not (
                set(expected) <= _RAISE_KEYS and type(expected["raises"]) in (str, type(None))
                and type(expected.get("args", [])) is list and type(expected.get("code", "")) is str):
            raise InvalidReference(f"check {c['name']!r}: a raise spec is {{\"raises\": str or null, "
                                   f"\"args\"?: list, \"code\"?: str}}")
    return ref


# Why a probe failed, most telling first: a probe's failure is the first of these among its checks.
FAILURES = ("too long", "no code", "does not parse", "error", "timeout", "raised", "wrong value")
_PARSE_ERRORS = ("SyntaxError", "IndentationError", "TabError")


def answer_forms(answer, prefix):
    """The readings of an answer, in the order they are tried: ``[(form, text)]``. With a prefix
    (the start of the answer, given at the end of the prompt) that the answer does not already
    start with, first the ``"continuation"`` (prefix + answer), then the answer ``"standalone"``;
    otherwise only the answer, standalone."""
    if prefix and not answer.startswith(prefix):
        return [("continuation", prefix + answer), ("standalone", answer)]
    return [("standalone", answer)]


def check_failure(expected, result):
    """Why a check failed (one of :data:`FAILURES`), or None if it passed."""
    if check_passed(expected, result):
        return None
    if result.status == "timeout":
        return "timeout"
    if result.status == "error":
        detail = result.detail or ""
        if detail.startswith(tuple(f"program failed: {e}" for e in _PARSE_ERRORS)):
            return "does not parse"
        return "raised" if detail.startswith("program failed:") else "error"
    if result.status == "raised" and not _is_raise_spec(expected):
        return "raised"
    return "wrong value"


def score_answer(answer, reference, limits=None):
    """Score one answer (a str) against one grading record (a JSON string or dict).

    An answer over :data:`MAX_ANSWER_CHARS` is not read ("too long"). Otherwise its readings
    (:func:`answer_forms`, the code of each by :func:`extract_code`) go to the sandbox, which parses them,
    confined, and runs the first that parses and compiles (if none does, the first, whose load then fails:
    "does not parse"); the parent parses nothing. Recall is scored on how that code uses each fact
    (:func:`recall_hits`), for records that name their recall facts (``recall_facts``, from generator 15 on);
    on older records it is not scored (``recall_total`` 0)."""
    if type(answer) is not str:
        raise MetricInputError(f"a prediction must be a str, got {type(answer).__name__}")
    ref = parse_reference(reference)
    checks, recall = ref["checks"], ref.get("recall", [])
    facts = list(zip(ref["recall_facts"], recall)) if ref.get("recall_facts") is not None else []
    preamble = ref.get("preamble") or ""
    forms = answer_forms(answer, ref.get("answer_prefix") or "") if len(answer) <= MAX_ANSWER_CHARS else []
    codes = [extract_code(text) for _, text in forms]
    form, uses, rows = forms[0][0] if forms else "standalone", {}, []
    if any(code.strip() for code in codes) and answer.strip():
        run = run_answer(codes, [c["expr"] for c in checks], limits or SandboxLimits(), preamble)
        form, uses = forms[run.chosen or 0][0], run.uses
        for c, r in zip(checks, run.results):
            parsed = run.chosen is not None or run.failed is not None  # failed: the reason is the call's detail
            failure = check_failure(c["expected"], r) if parsed else "does not parse"
            rows.append({"name": c["name"], "fact": c.get("fact"), "passed": failure is None, "status": r.status,
                         "failure": failure, "got": _short(r)})
    else:  # nothing to run: too long, or no code
        status, failure = ("too_long", "too long") if not forms else ("no_code", "no code")
        got = f"the answer is longer than {MAX_ANSWER_CHARS} characters" if not forms else ""
        rows = [{"name": c["name"], "fact": c.get("fact"), "passed": False, "status": status, "failure": failure,
                 "got": got} for c in checks]
    hits = recall_hits(uses, facts)
    n_passed = sum(r["passed"] for r in rows)
    failures = {r["failure"] for r in rows}
    return {
        "probe": ref.get("probe"),
        "step": ref.get("step"),
        "answer_form": form,
        "checks": rows,
        "checks_passed": n_passed,
        "checks_total": len(rows),
        "passed": bool(rows) and n_passed == len(rows),
        "failure": next((f for f in FAILURES if f in failures), None),
        "recall_hits": sum(hits),
        "recall_total": len(hits),
        "recall_missing": [v for (_, v), h in zip(facts, hits) if not h],
    }


def _totals(details):
    checks_passed = sum(d["checks_passed"] for d in details)
    checks_total = sum(d["checks_total"] for d in details)
    probes_passed = sum(d["passed"] for d in details)
    recall_hits_ = sum(d["recall_hits"] for d in details)
    recall_total = sum(d["recall_total"] for d in details)
    per_fact = {}
    for d in details:
        for c in d["checks"]:
            if c["fact"]:
                pf = per_fact.setdefault(c["fact"], {"passed": 0, "total": 0})
                pf["passed"] += int(c["passed"])
                pf["total"] += 1
    return {
        "checks_passed": checks_passed,
        "checks_total": checks_total,
        "check_pass_rate": checks_passed / checks_total if checks_total else 0.0,
        "probes_passed": probes_passed,
        "probes_total": len(details),
        "probe_pass_rate": probes_passed / len(details) if details else 0.0,
        "recall_hits": recall_hits_,
        "recall_total": recall_total,
        "recall": recall_hits_ / recall_total if recall_total else 0.0,
        "per_fact": per_fact,
    }


def paired_comparison(details, baseline_details):
    """Per probe, compare checks passed by this arm and by the reference arm."""
    better = worse = tied = 0
    for a, b in zip(details, baseline_details):
        if a["checks_passed"] > b["checks_passed"]:
            better += 1
        elif a["checks_passed"] < b["checks_passed"]:
            worse += 1
        else:
            tied += 1
    return {"better": better, "worse": worse, "tied": tied, "p_value": sign_test(better, worse)}


def score(predictions, references, baseline_predictions=None, limits=None):
    """The metric's computation, usable without ``evaluate``. Every reference is checked before
    any code runs."""
    for name, value in (("predictions", predictions), ("references", references),
                        ("baseline_predictions", baseline_predictions)):
        if type(value) not in (list, tuple) and not (value is None and name == "baseline_predictions"):
            raise MetricInputError(f"{name} must be a list, got {type(value).__name__}")
    if len(predictions) != len(references):
        raise MetricInputError(f"{len(predictions)} predictions for {len(references)} references")
    references = [parse_reference(r) for r in references]
    details = [score_answer(p, r, limits) for p, r in zip(predictions, references)]
    out = _totals(details)
    out["details"] = details
    if baseline_predictions is not None:
        if len(baseline_predictions) != len(references):
            raise MetricInputError(f"{len(baseline_predictions)} baseline predictions for {len(references)} references")
        base = [score_answer(p, r, limits) for p, r in zip(baseline_predictions, references)]
        out["paired"] = paired_comparison(details, base)
        out["baseline"] = {k: v for k, v in _totals(base).items() if k != "per_fact"}
    return out


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class PaceCoding(evaluate.Metric):
    """Hidden checks and fact recall for the PACE benchmark's coding probes."""

    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({
                "predictions": datasets.Value("string"),
                "references": datasets.Value("string"),
            }),
            reference_urls=[],
        )

    def _compute(self, predictions, references, baseline_predictions=None, timeout_s=None):
        return score(predictions, references, baseline_predictions=baseline_predictions,
                     limits=limits_for(timeout_s))


def limits_for(timeout_s):
    """Sandbox limits for a ``timeout_s`` argument: None (the default, 10 s) or a number of
    seconds in (0, 3600]; anything else (0 included) is a MetricInputError, not a silent default."""
    if timeout_s is None:
        return None
    if type(timeout_s) not in (int, float) or not 0 < timeout_s <= 3600:
        raise MetricInputError(f"timeout_s must be a number of seconds in (0, 3600], got {timeout_s!r}")
    return SandboxLimits(timeout_s=float(timeout_s))
