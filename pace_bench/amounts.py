"""Amount search: the amounts that the fee checks call ``fee_for`` with.

An amount is useful only if it tells a fact's value apart from every alternative value of that fact
(the others held fixed): otherwise a wrong fact could pass the check. The rounding mode needs an
exact half quantum with an even quotient below, a fraction below a half and one above.
"""

from __future__ import annotations

import random
from decimal import ROUND_DOWN, Decimal
from typing import Any

from .facts import fact_alternatives, fee

__all__ = ["pick_amounts"]


def pick_amounts(facts: dict[str, str], rng: random.Random) -> dict[str, Any]:
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
