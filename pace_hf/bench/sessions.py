"""The benchmark's agent sessions: randomized definitions, long filler, late coding probes.

A session is a chat with one *step* per user turn (steps count user turns from 0; the
system prompt is not a step). Its layout:

==========  ====================================================================
part        content
==========  ====================================================================
definitions three randomized steps of a spec for ``billing.py``, each a short text and
            a code block: (1) the imports and a dataclass with its field names,
            (2) status values, an error code, an exception class and ``settle``,
            (3) the fee rule ``fee_for`` with its constants: base fee, rate, quantum
            and rounding mode
filler      Python standard-library source (see :mod:`pace_hf.bench.filler`), about
            ``chunk_tokens`` tokens per user turn, each answered with a fixed ack
probes      three user turns: write ``fee_for`` (the file already holds steps 1-2),
            write ``settle`` (it holds steps 1 and 3), write the complete module
grading     hidden checks per probe (executed by the ``pace_coding`` metric), and the
            facts that each answer should recall
==========  ====================================================================

With ``distance=None`` all the filler comes after the definitions; with a distance D
(tokens between the end of the definitions and the first probe) the rest of the
``total_tokens`` budget is filler *before* the definitions.

Token ids are built message by message from the tokenizer's own chat template, so
``context_ids`` is exactly what ``apply_chat_template`` gives for the whole conversation,
and every span is exact. How a runner plays a session::

    ids = row["context_ids"]                     # prefill (system, definitions, filler)
    for probe in row["probes"]:
        ids += probe["prompt_ids"]               # user turn + assistant header
        answer = generate(ids)                   # new tokens, without a trailing EOS
        ids += answer + row["turn_end_ids"]      # end the assistant turn
        score(answer_text, probe["reference"])   # pace_coding metric

``turn_end_ids`` (also :func:`answer_suffix_ids`) are the template's end-of-turn tokens
(``<|im_end|>\\n`` for ChatML templates): strip any EOS the model generated (e.g.
``<|im_end|>``) before appending them.

Row schema (one row per session): see :data:`FEATURES`. ``checks`` is a JSON string: a
list of ``{"name", "expr", "expected", "fact"}``; ``expr`` is a Python expression
evaluated in the namespace of the answer's code; ``expected`` is plain data (a
``Decimal`` as ``{"__decimal__": "1.25"}``) for a normal return, or
``{"raises": "ExcName"|null, "args": [...] (optional, exact), "code": "..." (optional:
equal to one of the exception's args or attribute values)}``; ``fact`` names the fact
the check controls (each fact has at least one check that fails when only that fact is
wrong), or null. ``reference`` is the JSON grading record that the metric takes:
``{"probe", "step", "checks", "recall", "preamble", "answer_prefix"}``.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from decimal import ROUND_DOWN, ROUND_HALF_EVEN, ROUND_HALF_UP, ROUND_UP, Decimal
from typing import Any, Iterator

from .filler import FillerFile, filler_identity, stdlib_files

__all__ = [
    "GENERATOR_VERSION",
    "FEATURES",
    "FACT_NAMES",
    "PROBES",
    "load_sessions",
    "build_session",
    "sample_facts",
    "reference_solution",
    "answer_suffix_ids",
    "session_fingerprint",
    "tokenizer_identity",
    "to_parquet",
]

GENERATOR_VERSION = "13"  # bump whenever the generated content changes

SYSTEM_PROMPT = (
    "You are a careful Python coding assistant in a long working session on one repository. "
    "When asked for code, follow the specification given earlier in this conversation exactly."
)
DEFINITION_ACK = "Understood."
FILLER_ACK = "Noted."
FILLER_MODES = ("non-repeating", "repeating")
REPEATING_SET_SIZE = 4
REPEATING_MAX_BYTES = 8_000
MODULE = "billing.py"

# --------------------------------------------------------------------------- facts

CLASS_NAMES = ["Invoice", "Order", "Shipment", "Booking", "Payment", "Ticket", "Parcel", "Rental",
               "Transfer", "Voucher"]
ID_FIELDS = ["{c}_id", "{c}_no", "ref", "reference", "number", "key"]
AMOUNT_FIELDS = ["amount", "subtotal", "total", "price", "net", "gross", "value"]
STATUS_FIELDS = ["status", "state", "phase", "stage"]
BASE_FEES = ["0.25", "0.50", "0.75", "1.00", "1.25", "1.50", "1.75", "2.00", "2.25", "2.50", "3.00"]
FEE_RATES = ["0.015", "0.02", "0.025", "0.029", "0.03", "0.035", "0.04", "0.045"]
EXCEPTION_NAMES = ["LedgerError", "BillingError", "SettlementError", "PaymentError", "ChargeError",
                   "PostingError", "AccountError", "ClearingError"]
CODE_PREFIXES = ["E", "ERR", "LDG", "BIL", "SET", "PAY"]
STATUS_OPEN = ["pending", "open", "new", "draft", "queued", "unpaid", "active"]
STATUS_SETTLED = ["settled", "paid", "closed", "cleared", "done", "posted", "booked"]
QUANTA = ["0.01", "0.05", "0.10", "0.25"]
ROUNDING_MODES = ["ROUND_HALF_UP", "ROUND_HALF_EVEN", "ROUND_DOWN", "ROUND_UP"]
_ROUNDING = {"ROUND_HALF_UP": ROUND_HALF_UP, "ROUND_HALF_EVEN": ROUND_HALF_EVEN,
             "ROUND_DOWN": ROUND_DOWN, "ROUND_UP": ROUND_UP}

# fact name -> definition step (1, 2 or 3)
FACT_STEPS = {
    "class_name": 1, "field_id": 1, "field_amount": 1, "field_status": 1,
    "base_fee": 3, "fee_rate": 3, "status_open": 2, "status_settled": 2,
    "exception_code": 2, "exception_name": 2,
    "quantum": 3, "rounding_mode": 3,
}
FACT_NAMES = tuple(FACT_STEPS)


def sample_facts(rng: random.Random) -> dict[str, str]:
    """One session's randomized facts, all as strings."""
    cls = rng.choice(CLASS_NAMES)
    return {
        "class_name": cls,
        "field_id": rng.choice(ID_FIELDS).format(c=cls.lower()),
        "field_amount": rng.choice(AMOUNT_FIELDS),
        "field_status": rng.choice(STATUS_FIELDS),
        "base_fee": rng.choice(BASE_FEES),
        "fee_rate": rng.choice(FEE_RATES),
        "status_open": rng.choice(STATUS_OPEN),
        "status_settled": rng.choice(STATUS_SETTLED),
        "exception_code": f"{rng.choice(CODE_PREFIXES)}-{rng.randint(100, 999)}",
        "exception_name": rng.choice(EXCEPTION_NAMES),
        "quantum": rng.choice(QUANTA),
        "rounding_mode": rng.choice(ROUNDING_MODES),
    }


def fact_alternatives(facts: dict[str, str], name: str) -> list[str]:
    """Other values that fact ``name`` could have taken (for mutation tests)."""
    pools = {
        "class_name": CLASS_NAMES, "field_amount": AMOUNT_FIELDS, "field_status": STATUS_FIELDS,
        "base_fee": BASE_FEES, "fee_rate": FEE_RATES, "status_open": STATUS_OPEN,
        "status_settled": STATUS_SETTLED, "exception_name": EXCEPTION_NAMES, "quantum": QUANTA,
        "rounding_mode": ROUNDING_MODES,
    }
    if name == "field_id":
        pool = [f.format(c=facts["class_name"].lower()) for f in ID_FIELDS]
    elif name == "exception_code":
        pool = [f"{p}-{n}" for p in CODE_PREFIXES for n in (100, 417, 999)]
    else:
        pool = pools[name]
    taken = {facts[k] for k in ("field_id", "field_amount", "field_status")} if name.startswith("field_") else set()
    return [v for v in pool if v != facts[name] and v not in taken]


def fee(facts: dict[str, str], amount: Decimal) -> Decimal:
    """The fee rule: ``BASE_FEE + amount * FEE_RATE`` rounded to a multiple of the quantum."""
    q = Decimal(facts["quantum"])
    raw = Decimal(facts["base_fee"]) + amount * Decimal(facts["fee_rate"])
    return (raw / q).quantize(Decimal("1"), rounding=_ROUNDING[facts["rounding_mode"]]) * q


# ------------------------------------------------------------- definitions text


def _code(lines: list) -> list:
    return ["```python\n", *lines, "```"]


def _plain(pieces: list) -> str:
    return "".join(p[1] if isinstance(p, tuple) else p for p in pieces)


ROUNDING_IMPORT = "from decimal import Decimal, " + ", ".join(sorted(ROUNDING_MODES)) + "\n"


def code_pieces(facts: dict[str, str]) -> dict[str, list]:
    """The module's code, in parts; each part a list of pieces (a str, or ``(fact, text)``
    for the occurrence of a fact whose token span is recorded). The definitions show
    these parts and the reference solutions reproduce them. The functions carry their
    values inline, so that writing a function means recalling its facts."""
    f = facts
    F = lambda name: (name, f[name])  # noqa: E731
    status, amount = f["field_status"], f["field_amount"]
    return {
        # Step 1 imports every rounding mode, so the import does not tell which one step 3 uses.
        "imports": ["from dataclasses import dataclass\n", ROUNDING_IMPORT],
        "dataclass": [
            "@dataclass\nclass ", F("class_name"), ":\n    ",
            F("field_id"), ": str\n    ",
            F("field_amount"), ": Decimal\n    ",
            F("field_status"), ": str\n",
        ],
        "error": [
            "class ", F("exception_name"), "(Exception):\n",
            "    def __init__(self, code):\n        super().__init__(code)\n        self.code = code\n",
        ],
        "settle": [
            "def settle(record):\n",
            f"    if record.{status} != \"", F("status_open"), "\":\n",
            f"        raise {f['exception_name']}(\"", F("exception_code"), "\")\n",
            f"    total = record.{amount} + fee_for(record.{amount})\n",
            f"    record.{status} = \"", F("status_settled"), "\"\n",
            "    return total\n",
        ],
        "fee_for": [
            "def fee_for(amount):\n",
            '    base_fee = Decimal("', F("base_fee"), '")\n',
            '    fee_rate = Decimal("', F("fee_rate"), '")\n',
            '    quantum = Decimal("', F("quantum"), '")\n',
            "    raw = base_fee + amount * fee_rate\n",
            '    return (raw / quantum).quantize(Decimal("1"), rounding=', F("rounding_mode"), ") * quantum\n",
        ],
    }


def _step_code(c: dict, step: int) -> list:
    """The code block of a definition step, as pieces."""
    if step == 1:
        return [*c["imports"], "\n\n", *c["dataclass"]]
    if step == 2:
        return [*c["error"], "\n\n", *c["settle"]]
    return [*c["fee_for"]]


def step_code(facts: dict[str, str], step: int) -> str:
    """The code block of definition step 1, 2 or 3, as plain text."""
    return _plain(_step_code(code_pieces(facts), step))


def definition_pieces(facts: dict[str, str]) -> list[list]:
    """The three definition messages, as lists of pieces (see :func:`code_pieces`)."""
    f = facts
    c = code_pieces(facts)
    step1 = [
        f"Step 1 of the spec for `{MODULE}`: the imports and the data model. Each record is this dataclass:\n\n",
        *_code(_step_code(c, 1)),
        f"\n\n`{f['field_id']}` is the identifier, `{f['field_amount']}` is the amount (a Decimal) and "
        f"`{f['field_status']}` is the status. Use exactly these names.",
    ]
    step2 = [
        f"Step 2 of the spec for `{MODULE}`: the error class and settlement. A record can "
        "be settled only while it is open; settling marks it settled and returns its amount plus its fee; "
        "otherwise it raises the error with its error code.\n\n",
        *_code(_step_code(c, 2)),
    ]
    step3 = [
        f"Step 3 of the spec for `{MODULE}`: the fee rule and its constants. The fee for an amount is the "
        "base fee plus the amount times the fee rate, rounded to a multiple of the quantum with the rounding "
        "mode below.\n\n",
        *_code(_step_code(c, 3)),
    ]
    return [step1, step2, step3]


# ------------------------------------------------------------------ probes / checks

PROBES = ("fee_for", "settle", "module")
_COPY = "Reply with one ```python block only, no explanation."
_PROBE_TEXT = {
    "fee_for": (
        f"Back to `{MODULE}`. It already contains the code of steps 1 and 2. Now write the function "
        "`fee_for(amount)` of step 3 (the fee rule), exactly as specified in step 3. " + _COPY
    ),
    "settle": (
        f"`{MODULE}` already contains the code of steps 1 and 3. Now write the error class and the function "
        "`settle(record)` of step 2, exactly as specified. " + _COPY
    ),
    "module": (
        f"Now write the complete `{MODULE}` module, in this order: step 1 (the imports and the dataclass), "
        "step 2 (the error class and `settle`) and step 3 (`fee_for`), exactly as specified. " + _COPY
    ),
}
# The start of the assistant's answer, given as part of the prompt (it names no fact):
# it anchors the small model on the right definition. The metric prepends it to the
# generated text before scoring.
ANSWER_PREFIX = {
    "fee_for": '```python\ndef fee_for(amount):\n    base_fee = Decimal("',
    "settle": "",
    "module": "",
}
# Code parts that the file already holds when a probe is asked: the metric runs them
# before the answer (they never define what the probe asks for).
PROBE_PREAMBLE = {
    "fee_for": ("imports", "dataclass", "error", "settle"),
    "settle": ("imports", "dataclass", "fee_for"),
    "module": (),
}
# Facts whose values each probe's answer should state (recall).
_PROBE_RECALL = {
    "fee_for": ["base_fee", "fee_rate", "quantum", "rounding_mode"],
    "settle": ["field_amount", "field_status", "status_open", "status_settled", "exception_name",
               "exception_code"],
    "module": list(FACT_NAMES),
}
# Definition steps (1-3) that each probe reads: the oracle blueprint.
PROBE_READS = {"fee_for": (3,), "settle": (1, 2), "module": (1, 2, 3)}
MAX_NEW_TOKENS = {"fee_for": 128, "settle": 192, "module": 384}


def _dec(x) -> dict:
    return {"__decimal__": str(x)}


def _D(x) -> str:
    return f'__import__("decimal").Decimal("{x}")'


def _record_ns(facts, amount, status) -> str:
    return (f'__import__("types").SimpleNamespace({facts["field_id"]}="R-1", '
            f'{facts["field_amount"]}={_D(amount)}, {facts["field_status"]}="{status}")')


def _record_cls(facts, amount, status) -> str:
    return (f'{facts["class_name"]}({facts["field_id"]}="R-2", {facts["field_amount"]}={_D(amount)}, '
            f'{facts["field_status"]}="{status}")')


def _pick_amounts(facts: dict[str, str], rng: random.Random) -> dict[str, Any]:
    """Amounts for the fee checks such that each fee fact's check tells its value apart
    from every alternative value of that fact (the others held fixed)."""

    def distinguishes(name: str, amounts: list[Decimal]) -> bool:
        want = [fee(facts, a) for a in amounts]
        for alt in fact_alternatives(facts, name):
            mutated = dict(facts, **{name: alt})
            if [fee(mutated, a) for a in amounts] == want:
                return False
        return True

    cents = lambda lo, hi: Decimal(rng.randint(lo, hi)) / 100  # noqa: E731
    out: dict[str, Any] = {}
    for name, lo, hi, k in (("base_fee", 0, 0, 1), ("fee_rate", 50_000, 99_999, 1),
                            ("quantum", 1_000, 99_999, 1)):
        for _ in range(5000):
            amounts = [cents(lo, hi) for _ in range(k)]
            if distinguishes(name, amounts):
                break
        else:
            for _ in range(5000):
                amounts = [cents(1_000, 99_999) for _ in range(k)]
                if distinguishes(name, amounts):
                    break
            else:
                raise RuntimeError(f"no distinguishing amount for {name} with {facts}")
        out[name] = amounts[0]
    # Rounding: one amount whose raw fee is an exact half quantum with an even quotient
    # below, one whose fraction is below a half, one above.
    q = Decimal(facts["quantum"])
    picks: dict[str, Decimal] = {}
    for scale in (100, 1000, 10_000):  # cents first; a finer grid when no exact half exists
        lo, hi = 10 * scale, 1000 * scale
        start = rng.randrange(lo, hi)
        for i in range(hi - lo):  # every amount on this grid, from a random start
            a = Decimal(lo + (start - lo + i) % (hi - lo)) / scale
            x = (Decimal(facts["base_fee"]) + a * Decimal(facts["fee_rate"])) / q
            whole = x.to_integral_value(rounding=ROUND_DOWN)
            frac = x - whole
            kind = ("half" if frac == Decimal("0.5") and whole % 2 == 0
                    else "low" if Decimal("0.1") < frac < Decimal("0.4")
                    else "high" if Decimal("0.6") < frac < Decimal("0.9") else None)
            if kind and kind not in picks:
                picks[kind] = a
                if len(picks) == 3:
                    break
        if len(picks) == 3:
            break
    amounts = [picks[k] for k in ("half", "low", "high") if k in picks]
    if len(picks) < 3 or not distinguishes("rounding_mode", amounts):
        raise RuntimeError(f"no distinguishing amounts for the rounding mode with {facts}")
    out["rounding_mode"] = amounts
    # Plain settle amounts: any.
    out["settle"] = cents(10_000, 99_999)
    out["module"] = cents(10_000, 99_999)
    return out


def build_checks(facts: dict[str, str], rng: random.Random) -> dict[str, list[dict]]:
    """The hidden checks of each probe (see the module docstring for the format)."""
    f = facts
    am = _pick_amounts(facts, rng)
    a, m, st = am["settle"], am["module"], f["field_status"]

    def fees(*amounts):
        """A check on ``fee_for`` over ``amounts``, plus an amount with another fee if they all
        have the same one: every check sees two different values, so no constant passes it."""
        amounts = list(amounts)
        if len({fee(f, x) for x in amounts}) == 1:
            amounts.append(next(y for y in (a, a + 100, a + 1000) if fee(f, y) != fee(f, amounts[0])))
        return {"expr": "[" + ", ".join(f"fee_for({_D(x)})" for x in amounts) + "]",
                "expected": [_dec(fee(f, x)) for x in amounts]}

    def totals(*amounts):
        """``settle`` on an open record of each amount: their totals differ, so no constant passes."""
        return {"expr": "[" + ", ".join(f"settle({_record_ns(f, x, f['status_open'])})" for x in amounts) + "]",
                "expected": [_dec(x + fee(f, x)) for x in amounts]}

    rounding = am["rounding_mode"]
    fee_checks = [
        {"name": "fee_base", **fees(am["base_fee"]), "fact": "base_fee"},
        {"name": "fee_rate", **fees(am["fee_rate"]), "fact": "fee_rate"},
        {"name": "fee_quantum", **fees(am["quantum"]), "fact": "quantum"},
        {"name": "fee_rounding", **fees(*rounding), "fact": "rounding_mode"},
    ]
    open_ns = _record_ns(f, a, f["status_open"])
    done_ns = _record_ns(f, a, f["status_settled"])
    settle_checks = [
        {"name": "settle_total", **totals(a, a + 100), "fact": "field_amount"},
        {"name": "settle_accepts_open", **totals(m, m + 100), "fact": "status_open"},
        {"name": "settle_sets_status", "expr": f"(lambda r: (settle(r), r.{st})[1])({open_ns})",
         "expected": f["status_settled"], "fact": "status_settled"},
        {"name": "settle_rejects", "expr": f"settle({done_ns})",
         "expected": {"raises": f["exception_name"]}, "fact": "exception_name"},
        {"name": "settle_error_code", "expr": f"settle({done_ns})",
         "expected": {"raises": None, "code": f["exception_code"]}, "fact": "exception_code"},
    ]
    # The class name is evaluated first: nothing of the program runs (a replaced __import__, say)
    # before a program that does not define the class fails.
    module_checks = [
        {"name": "module_dataclass",
         "expr": f'(lambda c: __import__("dataclasses").is_dataclass(c))({f["class_name"]})',
         "expected": True, "fact": "class_name"},
        {"name": "module_fields",
         "expr": f'(lambda c: [x.name for x in __import__("dataclasses").fields(c)])({f["class_name"]})',
         "expected": [f["field_id"], f["field_amount"], f["field_status"]], "fact": "field_id"},
        {"name": "module_fee", **fees(am["base_fee"], am["fee_rate"]), "fact": None},
        {"name": "module_settle",
         "expr": f"(lambda r: (settle(r), r.{st})[1])({_record_cls(f, m, f['status_open'])})",
         "expected": f["status_settled"], "fact": "field_status"},
        {"name": "module_fee_rounding", **fees(*rounding), "fact": "rounding_mode"},
        {"name": "module_rejects", "expr": f"settle({_record_cls(f, m, f['status_settled'])})",
         "expected": {"raises": f["exception_name"], "code": f["exception_code"]}, "fact": "exception_code"},
    ]
    return {"fee_for": fee_checks, "settle": settle_checks, "module": module_checks}


def reference_solution(facts: dict[str, str] | dict, probe: str | int) -> str:
    """A correct answer to ``probe`` (a name in :data:`PROBES` or its index) for a
    session's facts (a ``{name: value}`` dict, or a dataset row with a ``facts`` list):
    the parts of the definitions that the probe asks for, in a ```python block."""
    if "facts" in facts and isinstance(facts["facts"], list):
        facts = {x["name"]: x["value"] for x in facts["facts"]}
    if isinstance(probe, int):
        probe = PROBES[probe]
    c = {k: _plain(v) for k, v in code_pieces(facts).items()}
    if probe == "fee_for":
        parts = [c["fee_for"]]
    elif probe == "settle":
        parts = [c["error"], c["settle"]]
    elif probe == "module":
        parts = [step_code(facts, k) for k in (1, 2, 3)]
    else:
        raise KeyError(f"unknown probe {probe!r}; probes: {PROBES}")
    return "```python\n" + "\n\n".join(parts) + "```"


# ------------------------------------------------------------------- tokenization


class _ChatBlocks:
    """Token blocks of single messages under the tokenizer's chat template.

    Each block is the text the template adds for one message, found by rendering a
    conversation with and without it, then tokenized alone. Blocks start with a special
    token (e.g. ``<|im_start|>``), so concatenating them gives the same ids as
    tokenizing the whole rendered conversation; a test checks this."""

    def __init__(self, tokenizer, system: str):
        self.tok = tokenizer
        self.system = {"role": "system", "content": system}
        self._base = self._render([self.system])
        u, a = {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}
        with_gen = self._render([self.system, u], add_generation_prompt=True)
        without = self._render([self.system, u])
        full = self._render([self.system, u, a])
        self.gen_header = self._suffix(with_gen, without)
        reply = self._suffix(full, with_gen)
        if not reply.startswith("A"):
            raise ValueError("chat template: the assistant reply does not follow the generation prompt")
        self.turn_end = reply[1:]
        self.system_ids = self.encode(self._base)

    def _render(self, messages, add_generation_prompt=False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    @staticmethod
    def _suffix(longer: str, prefix: str) -> str:
        if not longer.startswith(prefix):
            raise ValueError("chat template is not prefix-stable: messages cannot be tokenized one by one")
        return longer[len(prefix):]

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def user_block(self, content: str) -> str:
        return self._suffix(self._render([self.system, {"role": "user", "content": content}]), self._base)

    def assistant_block(self, content: str) -> str:
        u = {"role": "user", "content": "U"}
        before = self._render([self.system, u])
        after = self._render([self.system, u, {"role": "assistant", "content": content}])
        return self._suffix(after, before)

    def user_pieces(self, pieces: list) -> tuple[list[int], str, dict[str, tuple[int, int]]]:
        """Tokenize a user message made of pieces; returns its ids, its content, and the
        token span (relative to the block) of each marked fact."""
        content, marks = "", {}
        for p in pieces:
            if isinstance(p, tuple):
                name, text = p
                marks[name] = (len(content), len(content) + len(text))
                content += text
            else:
                content += p
        block = self.user_block(content)
        at = block.index(content)
        enc = self.tok(block, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        spans = {}
        for name, (cs, ce) in marks.items():
            cs, ce = cs + at, ce + at
            toks = [i for i, (s, e) in enumerate(offsets) if s < ce and e > cs and e > s]
            spans[name] = (toks[0], toks[-1] + 1)
        return ids, content, spans


def answer_suffix_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn after its content (``<|im_end|>\\n`` for ChatML):
    append them after a generated answer (without its EOS) before the next probe."""
    blocks = _ChatBlocks(tokenizer, SYSTEM_PROMPT)
    return blocks.encode(blocks.turn_end)


# ----------------------------------------------------------------------- filler


class _FillerStream:
    """Yields filler messages of about ``chunk_tokens`` tokens from stdlib files."""

    def __init__(self, blocks: _ChatBlocks, rng: random.Random, mode: str, chunk_tokens: int):
        if mode not in FILLER_MODES:
            raise ValueError(f"filler_mode must be one of {FILLER_MODES}, got {mode!r}")
        self.blocks, self.chunk_tokens, self.mode = blocks, chunk_tokens, mode
        files = list(stdlib_files())
        rng.shuffle(files)
        if mode == "repeating":  # a small set of small files, cycled
            files = [f for f in files if f.size <= REPEATING_MAX_BYTES][:REPEATING_SET_SIZE]
        self.files = files
        self.next_file = 0
        self.lines: list[str] = []
        self.line_tokens: list[int] = []
        self.pos = 0
        self.current: FillerFile | None = None
        self.part = 0
        self.used: list[str] = []
        self.ack_ids = blocks.encode(blocks.assistant_block(FILLER_ACK))

    def _open_next(self) -> None:
        if self.next_file >= len(self.files):
            if self.mode == "repeating":
                self.next_file = 0
            else:
                raise RuntimeError(
                    f"ran out of standard-library filler ({len(self.files)} files): ask for fewer tokens "
                    "or use filler_mode='repeating'")
        self.current = self.files[self.next_file]
        self.next_file += 1
        text = self.current.read()
        self.lines = text.splitlines(keepends=True)
        # Token count of each line, from one tokenization of the whole file.
        enc = self.blocks.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        starts, acc = [], 0
        for line in self.lines:
            starts.append(acc)
            acc += len(line)
        counts = [0] * len(self.lines)
        li = 0
        for s, e in enc["offset_mapping"]:
            while li + 1 < len(starts) and starts[li + 1] <= s:
                li += 1
            counts[li] += 1
        self.line_tokens = counts
        self.pos, self.part = 0, 0
        self.used.append(self.current.relpath)

    def _header(self) -> str:
        more = f" (part {self.part + 1})" if self.part else ""
        return f"Here is the next file of the repo: `{self.current.relpath}`{more}\n\n```python\n"

    def take(self, budget: int) -> tuple[list[int], list[int], str]:
        """One filler exchange of at most about ``budget`` tokens (user + ack): returns
        (user block ids, ack ids, content)."""
        if self.current is None or self.pos >= len(self.lines):
            self._open_next()
        overhead = len(self.blocks.encode(self.blocks.user_block(self._header() + "```"))) + len(self.ack_ids)
        target = max(1, min(self.chunk_tokens, budget) - overhead)
        end, n = self.pos, 0
        while end < len(self.lines) and n + self.line_tokens[end] <= target:
            n += self.line_tokens[end]
            end += 1
        if end == self.pos:
            end += 1  # always make progress
        code = "".join(self.lines[self.pos:end])
        if not code.endswith("\n"):
            code += "\n"
        content = self._header() + code + "```"
        self.pos = end
        self.part += 1
        if self.mode == "non-repeating" and budget <= self.chunk_tokens and self.pos < len(self.lines):
            self.pos = len(self.lines)  # the region ends here: never resume this file later
        return self.blocks.encode(self.blocks.user_block(content)), self.ack_ids, content


# --------------------------------------------------------------------- sessions


def build_session(
    tokenizer,
    seed: int = 0,
    total_tokens: int = 8192,
    distance: int | None = None,
    filler_mode: str = "non-repeating",
    chunk_tokens: int = 2000,
    session_index: int = 0,
    return_messages: bool = False,
):
    """Build one session row (see :data:`FEATURES`). With ``return_messages``, return
    ``(row, messages)`` where ``messages`` is the chat (system, definitions, filler) that
    ``context_ids`` tokenizes, as ``[{"role", "content"}]``."""
    rng = random.Random(f"pace-session:{GENERATOR_VERSION}:{seed}:{session_index}")
    facts = sample_facts(rng)
    checks = build_checks(facts, rng)
    blocks = _ChatBlocks(tokenizer, SYSTEM_PROMPT)
    filler = _FillerStream(blocks, rng, filler_mode, chunk_tokens)
    def_ack_ids = blocks.encode(blocks.assistant_block(DEFINITION_ACK))

    ids: list[int] = list(blocks.system_ids)
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
    turns: list[dict] = [{"step": -1, "role": "system", "kind": "system", "start": 0, "end": len(ids)}]
    step = 0

    def add_filler(region_tokens: int) -> None:
        nonlocal step
        goal = len(ids) + region_tokens
        while goal - len(ids) >= 32:
            user_ids, ack_ids, content = filler.take(goal - len(ids))
            messages.extend([{"role": "user", "content": content}, {"role": "assistant", "content": FILLER_ACK}])
            turns.append({"step": step, "role": "user", "kind": "filler", "start": len(ids),
                          "end": len(ids) + len(user_ids)})
            ids.extend(user_ids)
            turns.append({"step": step, "role": "assistant", "kind": "filler", "start": len(ids),
                          "end": len(ids) + len(ack_ids)})
            ids.extend(ack_ids)
            step += 1

    # Definitions, tokenized first so that their length is known.
    defs = [blocks.user_pieces(p) for p in definition_pieces(facts)]
    defs_len = sum(len(u) + len(def_ack_ids) for u, _, _ in defs)
    budget = max(0, total_tokens - len(ids) - defs_len)
    if distance is None:
        pre, post = 0, budget
    else:
        post = max(0, min(int(distance), budget))
        pre = budget - post
    add_filler(pre)

    fact_rows: list[dict] = []
    def_steps: dict[int, int] = {}
    def_spans: dict[int, tuple[int, int]] = {}
    for k, (user_ids, content, spans) in enumerate(defs, start=1):
        start = len(ids)
        for name, (s, e) in spans.items():
            fact_rows.append({"name": name, "value": facts[name], "step": step,
                              "start": start + s, "end": start + e})
        turns.append({"step": step, "role": "user", "kind": "definition", "start": start,
                      "end": start + len(user_ids)})
        ids.extend(user_ids)
        turns.append({"step": step, "role": "assistant", "kind": "definition", "start": len(ids),
                      "end": len(ids) + len(def_ack_ids)})
        ids.extend(def_ack_ids)
        messages.extend([{"role": "user", "content": content}, {"role": "assistant", "content": DEFINITION_ACK}])
        def_steps[k] = step
        def_spans[k] = (start, len(ids))
        step += 1
    defs_end = len(ids)
    add_filler(post)

    probes = []
    code = {part: _plain(pieces) for part, pieces in code_pieces(facts).items()}
    for k, name in enumerate(PROBES):
        text = _PROBE_TEXT[name]
        prompt = blocks.user_block(text) + blocks.gen_header + ANSWER_PREFIX[name]
        recall = [facts[x] for x in _PROBE_RECALL[name]]
        preamble = "\n\n".join(code[part] for part in PROBE_PREAMBLE[name])
        reference = {"probe": name, "step": step + k, "checks": checks[name], "recall": recall,
                     "preamble": preamble, "answer_prefix": ANSWER_PREFIX[name]}
        probes.append({
            "name": name, "step": step + k, "prompt": text, "prompt_ids": blocks.encode(prompt),
            "checks": json.dumps(checks[name]), "recall": recall, "reference": json.dumps(reference),
            "max_new_tokens": MAX_NEW_TOKENS[name], "answer_prefix": ANSWER_PREFIX[name],
        })
    probe_steps = {p["name"]: p["step"] for p in probes}
    blueprint = [
        {"start": def_spans[k][0], "end": def_spans[k][1],
         "readers": sorted(probe_steps[p] for p in PROBES if k in PROBE_READS[p])}
        for k in (1, 2, 3)
    ]
    fact_rows.sort(key=lambda r: r["start"])
    row = {
        "session_id": f"s{seed}-{session_index}",
        "seed": int(seed),
        "session_index": int(session_index),
        "total_tokens": int(total_tokens),
        "filler_mode": filler_mode,
        "system_prompt": SYSTEM_PROMPT,
        "context_ids": ids,
        "context_len": len(ids),
        "definitions_start": def_spans[1][0],
        "definitions_end": defs_end,
        "distance": len(ids) - defs_end,
        "turn_end_ids": blocks.encode(blocks.turn_end),
        "turns": turns,
        "facts": fact_rows,
        "probes": probes,
        "blueprint": blueprint,
        "filler_files": list(filler.used),
        "generator_version": GENERATOR_VERSION,
    }
    return (row, messages) if return_messages else row


# ----------------------------------------------------------------------- loader


def _features():
    from datasets import Features, Sequence, Value

    span = {"start": Value("int64"), "end": Value("int64")}
    return Features({
        "session_id": Value("string"),
        "seed": Value("int64"),
        "session_index": Value("int64"),
        "total_tokens": Value("int64"),
        "filler_mode": Value("string"),
        "system_prompt": Value("string"),
        "context_ids": Sequence(Value("int32")),
        "context_len": Value("int64"),
        "definitions_start": Value("int64"),
        "definitions_end": Value("int64"),
        "distance": Value("int64"),
        "turn_end_ids": Sequence(Value("int32")),
        "turns": [{"step": Value("int64"), "role": Value("string"), "kind": Value("string"), **span}],
        "facts": [{"name": Value("string"), "value": Value("string"), "step": Value("int64"), **span}],
        "probes": [{
            "name": Value("string"), "step": Value("int64"), "prompt": Value("string"),
            "prompt_ids": Sequence(Value("int32")), "checks": Value("string"),
            "recall": Sequence(Value("string")), "reference": Value("string"),
            "max_new_tokens": Value("int64"), "answer_prefix": Value("string"),
        }],
        "blueprint": [{**span, "readers": Sequence(Value("int64"))}],
        "filler_files": Sequence(Value("string")),
        "generator_version": Value("string"),
    })


def __getattr__(name):  # FEATURES is built lazily: importing datasets is slow
    if name == "FEATURES":
        return _features()
    raise AttributeError(name)


def tokenizer_identity(tokenizer) -> str:
    """A hash of what matters about a tokenizer here: its class, vocabulary size, chat
    template and how it tokenizes a fixed sample."""
    sample = "def fee_for(amount):\n    return Decimal('0.05')  # <|im_end|> naïve"
    h = hashlib.sha256()
    for part in (type(tokenizer).__name__, str(len(tokenizer)), str(tokenizer.chat_template or ""),
                 json.dumps(tokenizer(sample, add_special_tokens=False)["input_ids"])):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def session_fingerprint(tokenizer, n_sessions: int = 3, total_tokens: int = 8192, distance: int | None = None,
                        seed: int = 0, filler_mode: str = "non-repeating", chunk_tokens: int = 2000) -> str:
    """The dataset fingerprint: the knobs, :data:`GENERATOR_VERSION`, the filler source
    (Python version, files and sizes) and the tokenizer."""
    knobs = {"n_sessions": int(n_sessions), "total_tokens": int(total_tokens),
             "distance": None if distance is None else int(distance), "seed": int(seed),
             "filler_mode": filler_mode, "chunk_tokens": int(chunk_tokens)}
    payload = json.dumps({"generator": GENERATOR_VERSION, "knobs": knobs, "filler": filler_identity(),
                          "tokenizer": tokenizer_identity(tokenizer)}, sort_keys=True)
    return "pace-sessions-" + hashlib.sha256(payload.encode()).hexdigest()[:32]


_TOKENIZERS: dict[str, Any] = {}


def _generate(fingerprint: str, n_sessions: int, seed: int, total_tokens: int, distance, filler_mode: str,
              chunk_tokens: int) -> Iterator[dict]:
    tokenizer = _TOKENIZERS[fingerprint]
    for i in range(n_sessions):
        yield build_session(tokenizer, seed=seed, total_tokens=total_tokens, distance=distance,
                            filler_mode=filler_mode, chunk_tokens=chunk_tokens, session_index=i)


def load_sessions(
    tokenizer,
    n_sessions: int = 3,
    total_tokens: int = 8192,
    distance: int | None = None,
    seed: int = 0,
    filler_mode: str = "non-repeating",
    chunk_tokens: int = 2000,
    cache_dir: str | None = None,
    keep_in_memory: bool = False,
):
    """Generate (or load from the datasets cache) ``n_sessions`` sessions as a
    :class:`datasets.Dataset`, one row per session (see :data:`FEATURES`).

    ``total_tokens``: about the length of the context before the first probe.
    ``distance``: tokens of filler between the end of the definitions and the first
    probe (default: all the filler); the rest of the budget goes before the definitions.
    ``filler_mode``: ``"non-repeating"`` (no file is used twice) or ``"repeating"``
    (cycles a set of four small files). Deterministic for a seed; the cache is keyed on
    :func:`session_fingerprint`. Export with :func:`to_parquet` (``dataset.to_parquet``).
    """
    from datasets import Dataset

    if filler_mode not in FILLER_MODES:
        raise ValueError(f"filler_mode must be one of {FILLER_MODES}, got {filler_mode!r}")
    if distance is not None and distance < 0:
        raise ValueError("distance must be >= 0")
    fp = session_fingerprint(tokenizer, n_sessions, total_tokens, distance, seed, filler_mode, chunk_tokens)
    _TOKENIZERS[fp] = tokenizer
    try:
        return Dataset.from_generator(
            _generate,
            features=_features(),
            cache_dir=cache_dir,
            keep_in_memory=keep_in_memory,
            gen_kwargs={"fingerprint": fp, "n_sessions": int(n_sessions), "seed": int(seed),
                        "total_tokens": int(total_tokens), "distance": distance,
                        "filler_mode": filler_mode, "chunk_tokens": int(chunk_tokens)},
            fingerprint=fp,
        )
    finally:
        _TOKENIZERS.pop(fp, None)


def to_parquet(dataset, path) -> str:
    """Write the sessions to one Parquet file (``dataset.to_parquet``); returns the path."""
    dataset.to_parquet(str(path))
    return str(path)
