"""The hidden checks of each probe (the format is in :mod:`pace_bench.sessions`).

Every check calls the answer's code with values chosen so that it fails when the fact it controls is
wrong (see :mod:`pace_bench.amounts`) and fails for a stub that returns a constant: each one sees
at least two different expected values.
"""

from __future__ import annotations

import random

from .amounts import pick_amounts
from .facts import fee

__all__ = ["build_checks"]


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



def build_checks(facts: dict[str, str], rng: random.Random) -> dict[str, list[dict]]:
    """The hidden checks of each probe (see the module docstring for the format)."""
    f = facts
    am = pick_amounts(facts, rng)
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
    # A check's answer must carry its fact and its call must not: a program that controls its own
    # interpreter can forge any answer it can guess ("True"), or copy out of the call's text. So the
    # class check asks for the names of the module's own dataclasses, and the parent compares them
    # with the class name, which the call never shows.
    module_checks = [
        {"name": "module_dataclass",
         "expr": ('sorted(n for n, v in vars(__import__("solution")).items() if isinstance(v, type) '
                  'and v.__module__ == "solution" and __import__("dataclasses").is_dataclass(v))'),
         "expected": [f["class_name"]], "fact": "class_name"},
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
