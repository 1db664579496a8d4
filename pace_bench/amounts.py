"""Amount search: the amounts that the fee checks call ``fee_for`` with.

The amounts are part of what a program sees (the checks' calls), so they are drawn without looking at
the session's facts: amounts chosen to tell a fact apart from its alternatives would tell it to the
program too (an amount whose raw fee is an exact half quantum names the base fee, rate and quantum).
Instead every fee check calls ``fee_for`` on random amounts, and the rounding checks also on
:func:`half_amounts`, one exact half for every (base fee, fee rate, quantum) of the pools: whichever the
session's facts are, one of them tells ROUND_HALF_UP from ROUND_HALF_EVEN.
"""

from __future__ import annotations

import functools
import math
import random
from decimal import Decimal

from .facts import BASE_FEES, FEE_RATES, QUANTA, fact_alternatives, fee

__all__ = ["pick_amounts", "half_amounts", "distinguishes"]

# Random amounts per check: enough that the facts' alternatives are told apart almost always without
# looking at the facts (where they are not, more are drawn: see pick_amounts).
_DRAWS = {"base_fee": 2, "fee_rate": 2, "quantum": 16, "rounding_mode": 12}


@functools.lru_cache(maxsize=1)
def half_amounts() -> tuple[Decimal, ...]:
    """For every (base fee, fee rate, quantum) of the pools, the smallest amount from 100.00 (whole
    cents where one exists, else whole mills) whose raw fee ``base + amount * rate`` is an even multiple
    of the quantum plus a half: there ROUND_HALF_UP and ROUND_HALF_EVEN differ. Sorted, no repeats.

    In millionths the raw fee is ``base * 10**6 + mills * rate * 10**3``, and an even multiple plus a
    half of the quantum ``q`` is ``(4k + 1) * q * 10**6 / 2``: one linear congruence per combination."""
    out = set()
    for base in BASE_FEES:
        for rate in FEE_RATES:
            for q in QUANTA:
                b, r, qu = (int(Decimal(x) * 10**6) for x in (base, rate, q))
                r //= 1000  # the rate per mill, in millionths
                modulus, target = 2 * qu, (qu // 2 - b) % (2 * qu)
                g = math.gcd(r, modulus)
                if target % g:  # pragma: no cover - every combination of the pools has one
                    raise RuntimeError(f"no exact half for base {base}, rate {rate}, quantum {q}")
                period = modulus // g
                first = target // g * pow(r // g, -1, period) % period
                first += (100_000 - first + period - 1) // period * period  # from 100.000
                mills = [first + t * period for t in range(10)]
                m = next((m for m in mills if m % 10 == 0), first)
                out.add(Decimal(m).scaleb(-3).quantize(Decimal("0.01") if m % 10 == 0 else Decimal("0.001")))
    return tuple(sorted(out))


def distinguishes(facts: dict[str, str], name: str, amounts: list[Decimal]) -> bool:
    """Whether the fees for ``amounts`` differ for every other value of fact ``name`` (the others held
    fixed), and take at least two values (so that no constant passes)."""
    want = [fee(facts, a) for a in amounts]
    return len(set(want)) > 1 and all([fee(dict(facts, **{name: alt}), a) for a in amounts] != want
                                      for alt in fact_alternatives(facts, name))


def pick_amounts(facts: dict[str, str], rng: random.Random) -> dict[str, list[Decimal]]:
    """Amounts for each fee check (``{fact: amounts}``) and for settle and the module (``"settle"``,
    ``"module"``: lists of random amounts), drawn from ``rng`` without looking at ``facts``. Only if a
    fee check's amounts fail to tell its fact apart (see :func:`distinguishes`; rarer than one session
    in a thousand) is one more amount drawn, until they do: the choice then depends on the facts, by
    that much."""
    cents = lambda: Decimal(rng.randint(10_000, 99_999)) / 100  # noqa: E731
    out = {}
    for name, n in _DRAWS.items():
        amounts = [cents() for _ in range(n)]
        if name == "rounding_mode":
            amounts += half_amounts()
            rng.shuffle(amounts)
        while not distinguishes(facts, name, amounts):
            amounts.append(cents())
        out[name] = amounts
    out["settle"] = [cents() for _ in range(64)]
    out["module"] = [cents() for _ in range(16)]
    return out
