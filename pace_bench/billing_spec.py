"""The session's text: the three definition steps of the ``billing.py`` spec, the probes that ask
for the code back, and the correct answers.

The code of the module is built in parts (:func:`code_pieces`), each a list of pieces: a str, or
``(fact, text)`` for an occurrence of a fact whose token span the session records. The definitions
show these parts, the probes' preambles are made of them, and :func:`reference_solution` reproduces
them.
"""

from __future__ import annotations

from .facts import FACT_NAMES, ROUNDING_MODES

__all__ = [
    "MODULE", "PROBES", "PROBE_TEXT", "ANSWER_PREFIX", "probe_preamble", "PROBE_RECALL", "PROBE_READS",
    "MAX_NEW_TOKENS", "code_pieces", "plain", "step_code", "definition_pieces", "reference_solution",
]

MODULE = "billing.py"


def _code(lines: list) -> list:
    return ["```python\n", *lines, "```"]


def plain(pieces: list) -> str:
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
    return plain(_step_code(code_pieces(facts), step))


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


PROBES = ("fee_for", "settle", "module")
_COPY = "Reply with one ```python block only, no explanation."
PROBE_TEXT = {
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
# What the metric runs before each probe's answer (``preamble``). It holds no session fact: what one run
# holds, another run of the same session is checked on, and runs can talk to each other through the host
# (see docs/benchmarks/threat-model.md). So the fee_for probe gets only the imports, although the file it
# names holds steps 1 and 2; the settle probe gets a stand-in ``fee_for`` whose rate is random, not the
# session's (its checks expect totals with it); every preamble defines ``_pace_each``, which the checks
# call. (An answer that names the session's class outside a function, as an annotation say, fails to
# load: no preamble defines it.)
_PACE_EACH = (
    "def _pace_each(f, items, **names):\n"
    '    """f(x) for each x (where it raised, the name of the exception\'s class), with ``names`` bound\n'
    '    in this module first: the checks\' helper, not part of the spec."""\n'
    "    globals().update(names)\n"
    "    out = []\n"
    "    for x in items:\n"
    "        try:\n"
    "            out.append(f(x))\n"
    "        except Exception as exc:\n"
    "            out.append(type(exc).__name__)\n"
    "    return out\n"
)


def probe_preamble(probe: str, stand_in_rate: str) -> str:
    """The code the metric runs before the answer to ``probe`` (see above); ``stand_in_rate`` is the
    settle probe's stand-in fee rate (:func:`pace_bench.checks.stand_in_rate`)."""
    if probe == "module":  # the answer is the whole module: its own imports
        return _PACE_EACH
    parts = [ROUNDING_IMPORT, _PACE_EACH]
    if probe == "settle":
        parts.append("def _pace_fee_for(amount):\n"
                     f'    return (amount * Decimal("{stand_in_rate}")).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)\n'
                     "\n\nfee_for = _pace_fee_for\n")
    return "\n\n".join(parts)


# Facts whose values each probe's answer should state (recall).
PROBE_RECALL = {
    "fee_for": ["base_fee", "fee_rate", "quantum", "rounding_mode"],
    "settle": ["field_amount", "field_status", "status_open", "status_settled", "exception_name",
               "exception_code"],
    "module": list(FACT_NAMES),
}
# Definition steps (1-3) that each probe reads: the oracle blueprint.
PROBE_READS = {"fee_for": (3,), "settle": (1, 2), "module": (1, 2, 3)}
MAX_NEW_TOKENS = {"fee_for": 128, "settle": 192, "module": 384}


def reference_solution(facts: dict[str, str] | dict, probe: str | int) -> str:
    """A correct answer to ``probe`` (a name in :data:`PROBES` or its index) for a
    session's facts (a ``{name: value}`` dict, or a dataset row with a ``facts`` list):
    the parts of the definitions that the probe asks for, in a ```python block."""
    if "facts" in facts and isinstance(facts["facts"], list):
        facts = {x["name"]: x["value"] for x in facts["facts"]}
    if isinstance(probe, int):
        probe = PROBES[probe]
    c = {k: plain(v) for k, v in code_pieces(facts).items()}
    if probe == "fee_for":
        parts = [c["fee_for"]]
    elif probe == "settle":
        parts = [c["error"], c["settle"]]
    elif probe == "module":
        parts = [step_code(facts, k) for k in (1, 2, 3)]
    else:
        raise KeyError(f"unknown probe {probe!r}; probes: {PROBES}")
    return "```python\n" + "\n\n".join(parts) + "```"
