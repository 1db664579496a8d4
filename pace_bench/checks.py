"""The hidden checks of each probe (the format is in :mod:`pace_bench.sessions`).

A check's call is part of what the program sees, so no call names a session fact: a program that
controls its interpreter can answer any call it can read the answer off. So the calls are built from
the facts' public pools and from random draws that do not look at the facts (see
:mod:`pace_bench.amounts`), and only the expected values, which never leave the parent, carry facts:

* ``settle`` gets one record per possible open status, each with every possible amount field (each a
  different amount) and every possible status field set to that status: only the session's open status
  settles, and only its amount field gives the expected total; and a grid of records, one per (status
  field, open status), that field set to that status and the others to settled statuses: only the
  session's status field and open status settle;
* where ``settle`` raises, the checks see the exception class's name (``_pace_each``), so checking which
  records it settles needs the exception's name too;
* the module's dataclass is found as the module's own dataclass, not by name, and built by position; its
  classes are listed by what they are (dataclasses, exceptions), not by name.

Every check fails when the fact it controls is wrong, and sees at least two different expected values
(so no constant passes it). Each needs two facts or more, but the error code (one of 108,000), so that
a fixed guess passes about 3 checks in 10,000 sessions (:func:`chance_levels`).
"""

from __future__ import annotations

import random
from decimal import ROUND_HALF_UP, Decimal

from .amounts import pick_amounts
from .facts import (AMOUNT_FIELDS, BASE_FEES, CLASS_NAMES, CODE_NUMBERS, CODE_PREFIXES, EXCEPTION_NAMES, FEE_RATES, ID_FIELDS,
                    QUANTA, ROUNDING_MODES, STATUS_FIELDS, STATUS_OPEN, STATUS_SETTLED, fee)

__all__ = ["build_checks", "stand_in_rate", "stand_in_fee", "CHECK_FACTS", "chance_levels"]

# The facts that a program must hold to pass each check (the rounding checks' tie amounts tell every
# rounding mode apart, and 16 amounts every quantum; the base and rate checks' few amounts may not, so they
# count neither). Where settle rejects a record, the settle checks expect the name of the exception it
# raises, so that each needs two facts or more. tests/test_metric.py checks these sets against a fixed
# guess over simulated sessions.
_FEE = ("base_fee", "fee_rate", "quantum")
CHECK_FACTS = {
    "fee_base": _FEE[:2], "fee_rate": _FEE[:2], "fee_quantum": _FEE, "fee_rounding": _FEE + ("rounding_mode",),
    "settle_total": ("field_amount", "status_open", "exception_name"),
    "settle_accepts_open": ("field_status", "status_open", "exception_name"),
    "settle_sets_status": ("field_status", "status_open", "status_settled", "exception_name"),
    "settle_rejects": ("exception_name", "exception_code"), "settle_error_code": ("exception_code",),
    "module_dataclass": ("class_name", "exception_name"),
    "module_fields": ("class_name", "field_id", "field_amount", "field_status"),
    "module_fee": _FEE[:2], "module_settle": ("field_id", "field_amount", "field_status", "status_open", "status_settled"),
    "module_fee_rounding": _FEE + ("rounding_mode",), "module_rejects": ("exception_name", "exception_code"),
}


def chance_levels() -> dict[str, float]:
    """For each check, the chance that a fixed guess passes it in a session drawn by the generator: the
    largest probability that the facts deciding it (:data:`CHECK_FACTS`) take any one set of values. Facts
    are drawn independently and uniformly from their pools (the class and exception names as two parts each,
    every composition once), but the id field, which may name the class (``freight_invoice_id``): its
    likeliest value is one of the class-free ones (``ref``), 1 in ``len(ID_FIELDS)``, and with the class
    given it is 1 in ``len(ID_FIELDS)`` too, so the product holds for checks that need both."""
    pool = {"base_fee": len(BASE_FEES), "fee_rate": len(FEE_RATES), "quantum": len(QUANTA),
            "rounding_mode": len(ROUNDING_MODES), "field_amount": len(AMOUNT_FIELDS),
            "field_status": len(STATUS_FIELDS), "status_open": len(STATUS_OPEN), "status_settled": len(STATUS_SETTLED),
            "exception_name": len(EXCEPTION_NAMES), "exception_code": len(CODE_PREFIXES) * (CODE_NUMBERS[1] - CODE_NUMBERS[0] + 1),
            "class_name": len(CLASS_NAMES), "field_id": len(ID_FIELDS)}
    out = {}
    for check, facts in CHECK_FACTS.items():
        chance = 1.0
        for name in facts:
            chance /= pool[name]
        out[check] = chance
    return out


def _dec(x) -> dict:
    return {"__decimal__": str(x)}


def _D(x) -> str:
    return f'__import__("decimal").Decimal("{x}")'


def stand_in_rate(rng: random.Random) -> str:
    """The rate of the settle probe's stand-in ``fee_for`` (``_pace_fee_for`` in its preamble): random, and
    no session fact (the settle run must not hold the fee facts that the other probes are checked on)."""
    return f"0.{rng.randint(11, 99):03d}"


def stand_in_fee(rate: str, amount: Decimal) -> Decimal:
    """What the stand-in ``fee_for`` returns: ``amount * rate`` to the cent, half up."""
    return (amount * Decimal(rate)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)


def _records(rows: list[dict]) -> str:
    """The call text of ``settle``'s records: one ``SimpleNamespace`` per row (every amount field, a
    ``Decimal``, and every status field), built from a compact list of the rows' values."""
    names = list(AMOUNT_FIELDS) + list(STATUS_FIELDS)
    values = [tuple(str(r[k]) for k in names) for r in rows]
    return ('(lambda D, T: [T(**{k: D(v) if i < %d else v for i, (k, v) in enumerate(zip(%r, r))}) for r in %r])'
            '(__import__("decimal").Decimal, __import__("types").SimpleNamespace)' % (len(AMOUNT_FIELDS), names, values))


def build_checks(facts: dict[str, str], rng: random.Random, stand_in: str) -> dict[str, list[dict]]:
    """The hidden checks of each probe (see the module docstring for the format); ``stand_in`` is the
    rate of the settle probe's stand-in ``fee_for`` (:func:`stand_in_rate`)."""
    f = facts
    am = pick_amounts(facts, rng)

    def fees(amounts):
        return {"expr": "[" + ", ".join(f"fee_for({_D(x)})" for x in amounts) + "]",
                "expected": [_dec(fee(f, x)) for x in amounts]}

    fee_checks = [{"name": f"fee_{short}", **fees(am[name]), "fact": name}
                  for short, name in (("base", "base_fee"), ("rate", "fee_rate"), ("quantum", "quantum"),
                                      ("rounding", "rounding_mode"))]

    # One record per open status, every status field set to it; and the grid: one record per (status
    # field, open status), that field set to that status and the others to settled statuses.
    n = len(AMOUNT_FIELDS)
    opens = rng.sample(STATUS_OPEN, len(STATUS_OPEN))
    amounts = [dict(zip(AMOUNT_FIELDS, am["settle"][k * n:(k + 1) * n])) for k in range(len(opens))]
    simple = [{**amounts[k], **{name: status for name in STATUS_FIELDS}} for k, status in enumerate(opens)]
    grid = [(field, status) for field in STATUS_FIELDS for status in STATUS_OPEN]
    rng.shuffle(grid)
    grid = [{**amounts[k % len(amounts)], **{name: status if name == field else rng.choice(STATUS_SETTLED)
                                             for name in STATUS_FIELDS}} for k, (field, status) in enumerate(grid)]
    is_open = lambda r: r[f["field_status"]] == f["status_open"]  # noqa: E731
    error = f["exception_name"]
    each = f"_pace_each(settle, {_records(simple)}, fee_for=_pace_fee_for)"
    totals = [_dec(r[f["field_amount"]] + stand_in_fee(stand_in, r[f["field_amount"]])) if is_open(r) else error
              for r in simple]
    settled = [dict(r, **{f["field_status"]: f["status_settled"]}) if is_open(r) else r for r in simple]
    closed = _records([{**dict(zip(AMOUNT_FIELDS, am["settle"][-n:])),
                        **dict.fromkeys(STATUS_FIELDS, rng.choice(STATUS_SETTLED))}])
    settle_checks = [
        {"name": "settle_total", "expr": each, "expected": totals, "fact": "field_amount"},
        {"name": "settle_accepts_open",
         "expr": f"[x if isinstance(x, str) else True for x in _pace_each(settle, {_records(grid)}, fee_for=_pace_fee_for)]",
         "expected": [True if is_open(r) else error for r in grid], "fact": "status_open"},
        {"name": "settle_sets_status",
         "expr": f"(lambda rs: [[x if isinstance(x, str) else None for x in _pace_each(settle, rs, fee_for=_pace_fee_for)], "
                 f"[{{k: getattr(r, k) for k in {list(STATUS_FIELDS)!r}}} for r in rs]])({_records(simple)})",
         "expected": [[None if is_open(r) else error for r in simple], [{k: r[k] for k in STATUS_FIELDS} for r in settled]],
         "fact": "status_settled"},
        {"name": "settle_rejects", "expr": f"settle({closed}[0])",
         "expected": {"raises": error, "code": f["exception_code"]}, "fact": "exception_name"},
        {"name": "settle_error_code", "expr": f"settle({closed}[0])",
         "expected": {"raises": None, "code": f["exception_code"]}, "fact": "exception_code"},
    ]

    # The module's own dataclass, found without its name, and records of it built by position (id, amount,
    # status): one per possible open status, and one settled.
    own = 'sorted(n for n, v in vars(__import__("solution")).items() if isinstance(v, type) and v.__module__ == "solution" and %s)'
    cls = ('next(v for n, v in sorted(vars(__import__("solution")).items()) if isinstance(v, type) '
           'and v.__module__ == "solution" and __import__("dataclasses").is_dataclass(v))')
    m = am["module"]
    built = "(lambda C: [%s])(%s)" % (", ".join(f'C("R-{k}", {_D(m[k])}, "{s}")' for k, s in enumerate(opens)), cls)
    names = [f["field_id"], f["field_amount"], f["field_status"]]
    after = [{names[0]: f"R-{k}", names[1]: _dec(m[k]),
              names[2]: f["status_settled"] if s == f["status_open"] else s} for k, s in enumerate(opens)]
    module_checks = [
        {"name": "module_dataclass",
         "expr": "[%s, %s]" % (own % '__import__("dataclasses").is_dataclass(v)', own % "issubclass(v, BaseException)"),
         "expected": [[f["class_name"]], [error]], "fact": "class_name"},
        {"name": "module_fields", "expr": f'(lambda C: [C.__name__, [x.name for x in __import__("dataclasses").fields(C)]])({cls})',
         "expected": [f["class_name"], names], "fact": "field_id"},
        {"name": "module_fee", **fees(am["base_fee"] + am["fee_rate"]), "fact": None},
        {"name": "module_settle",
         "expr": f'(lambda rs: (_pace_each(settle, rs), [vars(r) for r in rs])[1])({built})',
         "expected": after, "fact": "field_status"},
        {"name": "module_fee_rounding", **fees(am["rounding_mode"]), "fact": "rounding_mode"},
        {"name": "module_rejects",
         "expr": f'settle((lambda C: C("R-9", {_D(m[-1])}, "{rng.choice(STATUS_SETTLED)}"))({cls}))',
         "expected": {"raises": f["exception_name"], "code": f["exception_code"]}, "fact": "exception_code"},
    ]
    return {"fee_for": fee_checks, "settle": settle_checks, "module": module_checks}
