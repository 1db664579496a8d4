"""Amount search: the amounts that the fee checks call ``fee_for`` with.

The amounts are part of what a program sees (the checks' calls), so they are drawn without looking at
the session's facts: amounts chosen to tell a fact apart from its alternatives would tell it to the
program too (an amount whose raw fee is an exact half quantum names the base fee, rate and quantum).
Instead every fee check calls ``fee_for`` on random amounts, and the rounding checks also on
:func:`half_amounts`, an exact half for every (base fee, fee rate, quantum) of the pools: whichever the
session's facts are, one of them tells ROUND_HALF_UP from ROUND_HALF_EVEN.

The amounts are from 2,500.00: the rates are whole basis points apart and the base fees a quarter apart,
so on such an amount two rates' (or two base fees') raw fees differ by at least the largest quantum,
and so do their fees, almost always (always, but where the two raw fees are halves a quantum apart and
round half to even): two random amounts tell every rate and every base fee of the pools apart.
"""

from __future__ import annotations

import functools
import math
import random
from decimal import Decimal
from fractions import Fraction

from .facts import AMOUNT_FIELDS, BASE_FEES, FEE_RATES, QUANTA, STATUS_OPEN, fact_alternatives, fee

__all__ = ["pick_amounts", "half_amounts", "distinguishes"]

# Random amounts per check: enough that the facts' alternatives are told apart almost always without
# looking at the facts (where they are not, more are drawn: see pick_amounts).
_DRAWS = {"base_fee": 2, "fee_rate": 2, "quantum": 16, "rounding_mode": 12}


LOW, HIGH = 2_500, 25_000  # the random amounts: whole cents from LOW to below HIGH


@functools.lru_cache(maxsize=1)
def half_amounts() -> tuple[Decimal, ...]:
    """Amounts from :data:`LOW` such that for every (base fee, fee rate, quantum) of the pools one of them
    makes the raw fee ``base + amount * rate`` an even multiple of the quantum plus a half: there
    ROUND_HALF_UP and ROUND_HALF_EVEN differ. Sorted, no repeats.

    With the rate ``2**v * odd`` basis points and the quantum ``q``, the amount ``q * 10**4 * x / 2**v``
    (``2x`` an integer) adds ``x * odd`` to the raw fee over the quantum, ``base / q``; the sum is an even
    number plus a half exactly when ``2x = (1 - 2 * base / q) * odd`` modulo 4 (``odd * odd`` is 1 modulo
    4). So one amount serves every combination with the same quantum, power of two ``v`` and residue
    ``2x`` modulo 4, the smallest such from LOW: at most 4 * 10 * 4 of them, whatever the pools' sizes.
    Every base fee is a multiple of a quarter, so ``2 * base / q`` is a whole number for every quantum."""
    rates = set()  # (v, odd modulo 4) of every rate: all that decides the amount
    for rate in FEE_RATES:
        bp = int(Fraction(rate) * 10**4)
        v = (bp & -bp).bit_length() - 1
        rates.add((v, (bp >> v) % 4))
    out = set()
    for q in map(Fraction, QUANTA):
        twice = {(1 - 2 * Fraction(b) / q) for b in BASE_FEES}
        if any(t.denominator != 1 for t in twice):  # pragma: no cover - the pools are built so
            raise RuntimeError(f"a base fee is no multiple of half the quantum {q}")
        for v, odd in rates:
            for t in twice:
                c = int(t) * odd % 4
                unit = q * 10**4 / 2 ** (v + 1)  # the amount for 2x = 1
                k = c + 4 * max(0, math.ceil((LOW / unit - c) / 4))
                amount = unit * k
                out.add(Decimal(amount.numerator) / Decimal(amount.denominator))
    return tuple(sorted(a if a.as_tuple().exponent <= -2 else a.quantize(Decimal("0.01")) for a in out))


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
    cents = lambda: Decimal(rng.randint(LOW * 100, HIGH * 100 - 1)) / 100  # noqa: E731
    out = {}
    for name, n in _DRAWS.items():
        amounts = [cents() for _ in range(n)]
        if name == "rounding_mode":
            amounts += half_amounts()
            rng.shuffle(amounts)
        while not distinguishes(facts, name, amounts):
            amounts.append(cents())
        out[name] = amounts
    out["settle"] = [cents() for _ in range((len(STATUS_OPEN) + 1) * len(AMOUNT_FIELDS))]
    out["module"] = [cents() for _ in range(len(STATUS_OPEN) + 1)]
    return out
