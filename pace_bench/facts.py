"""A session's facts: the randomized names and values that its definitions state, and the fee rule.

Each fact is one string, drawn from a public pool: names from lists of plausible words (the class
and exception names composed of two), numbers from wide ranges (:func:`sample_facts`);
:data:`FACT_STEPS` says which definition step states it. :func:`fact_alternatives` lists the values a fact could have taken instead (what the
checks must tell apart), and :func:`fee` is the fee rule of step 3.
"""

from __future__ import annotations

import functools
import random
import re
from decimal import ROUND_DOWN, ROUND_HALF_EVEN, ROUND_HALF_UP, ROUND_UP, Decimal

__all__ = ["FACT_NAMES", "FACT_STEPS", "ROUNDING_MODES", "sample_facts", "snake", "fact_alternatives", "in_pool", "numeral", "fee"]

# The class name is a qualifier and a noun (``FreightInvoice``); its id field may name it in snake case
# (``freight_invoice_id``).
CLASS_QUALIFIERS = ["Freight", "Retail", "Service", "Customer", "Vendor", "Supplier", "Member", "Partner",
                    "Export", "Import", "Wholesale", "Corporate", "Travel", "Hotel", "Cargo", "Utility",
                    "Lease", "Parking", "Event", "Clinic", "Marketplace", "Subscription", "Insurance", "Tuition"]
CLASS_NOUNS = ["Invoice", "Order", "Shipment", "Booking", "Payment", "Ticket", "Parcel", "Rental",
               "Transfer", "Voucher", "Claim", "Refund", "Charge", "Deposit", "Receipt", "Bill"]
CLASS_NAMES = [q + n for q in CLASS_QUALIFIERS for n in CLASS_NOUNS]
ID_FIELDS = ["{c}_id", "{c}_no", "{c}_ref", "ref", "reference", "number", "key", "uid"]
AMOUNT_FIELDS = ["amount", "subtotal", "total", "price", "net", "gross", "value", "cost", "balance", "charge"]
STATUS_FIELDS = ["status", "state", "phase", "stage", "condition", "progress"]
# The base fee: a multiple of 0.25 from 0.25 to 12.50; the rate: whole basis points from 0.50% to 5.99%.
BASE_FEES = [f"{q // 4}.{q % 4 * 25:02d}" for q in range(1, 51)]
FEE_RATES = [f"0.{bp:04d}".rstrip("0") for bp in range(50, 600)]
# The exception is a domain, a kind and "Error" (``LedgerStateError``); its code a prefix and 4 digits.
EXCEPTION_DOMAINS = ["Ledger", "Billing", "Settlement", "Payment", "Charge", "Posting", "Account", "Clearing",
                     "Invoice", "Fee", "Transaction", "Balance"]
EXCEPTION_KINDS = ["State", "Status", "Closed", "Transition", "Workflow", "Lock", "Policy", "Rule"]
EXCEPTION_NAMES = [d + k + "Error" for d in EXCEPTION_DOMAINS for k in EXCEPTION_KINDS]
CODE_PREFIXES = ["E", "ERR", "LDG", "BIL", "SET", "PAY", "CHG", "PST", "ACC", "CLR", "INV", "TXN"]
CODE_NUMBERS = (1000, 9999)  # an error code's number, inclusive
STATUS_OPEN = ["pending", "open", "new", "draft", "queued", "unpaid", "active", "issued", "outstanding",
               "submitted", "due", "billed", "invoiced", "unsettled", "created", "received", "approved",
               "scheduled", "awaiting", "ready"]
STATUS_SETTLED = ["settled", "paid", "closed", "cleared", "done", "posted", "booked", "completed", "reconciled",
                  "finalized", "collected", "archived", "captured", "fulfilled", "redeemed", "remitted",
                  "processed", "resolved", "honored", "credited"]
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


def snake(name: str) -> str:
    """A class name in snake case (``FreightInvoice`` -> ``freight_invoice``), as the id field names it."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def sample_facts(rng: random.Random) -> dict[str, str]:
    """One session's randomized facts, all as strings. Each is drawn uniformly from its pool, the class
    name as a qualifier and a noun, the exception's name as a domain and a kind, independently."""
    cls = rng.choice(CLASS_QUALIFIERS) + rng.choice(CLASS_NOUNS)
    return {
        "class_name": cls,
        "field_id": rng.choice(ID_FIELDS).format(c=snake(cls)),
        "field_amount": rng.choice(AMOUNT_FIELDS),
        "field_status": rng.choice(STATUS_FIELDS),
        "base_fee": rng.choice(BASE_FEES),
        "fee_rate": rng.choice(FEE_RATES),
        "status_open": rng.choice(STATUS_OPEN),
        "status_settled": rng.choice(STATUS_SETTLED),
        "exception_code": f"{rng.choice(CODE_PREFIXES)}-{rng.randint(*CODE_NUMBERS)}",
        "exception_name": rng.choice(EXCEPTION_DOMAINS) + rng.choice(EXCEPTION_KINDS) + "Error",
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
        pool = [f.format(c=snake(facts["class_name"])) for f in ID_FIELDS]
    elif name == "exception_code":  # a sample: every prefix with a few numbers, and the next numbers
        prefix, number = facts[name].split("-")
        pool = [f"{p}-{n}" for p in CODE_PREFIXES for n in (CODE_NUMBERS[0], 4817, CODE_NUMBERS[1])]
        pool += [f"{prefix}-{n}" for n in (int(number) - 1, int(number) + 1) if CODE_NUMBERS[0] <= n <= CODE_NUMBERS[1]]
    else:
        pool = pools[name]
    taken = {facts[k] for k in ("field_id", "field_amount", "field_status")} if name.startswith("field_") else set()
    return [v for v in pool if v != facts[name] and v not in taken]


def numeral(text: str) -> str:
    """A decimal numeral without leading or trailing zeros ("1.250" -> "1.25", "1.00" -> "1")."""
    whole, _, frac = text.partition(".")
    whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
    return whole + "." + frac if frac else whole


@functools.lru_cache(maxsize=1)
def _pools() -> dict[str, frozenset[str]]:
    names = {"class_name": CLASS_NAMES, "field_amount": AMOUNT_FIELDS, "field_status": STATUS_FIELDS,
             "status_open": STATUS_OPEN, "status_settled": STATUS_SETTLED, "exception_name": EXCEPTION_NAMES,
             "rounding_mode": ROUNDING_MODES,
             "field_id": [f.format(c=snake(c)) for f in ID_FIELDS for c in CLASS_NAMES]}
    numbers = {"base_fee": BASE_FEES, "fee_rate": FEE_RATES, "quantum": QUANTA}
    return {**{k: frozenset(v) for k, v in names.items()},
            **{k: frozenset(numeral(x) for x in v) for k, v in numbers.items()}}


_CODE = re.compile(r"(?:%s)-[1-9][0-9]{3}" % "|".join(CODE_PREFIXES))


def in_pool(name: str, value: str) -> bool:
    """Whether ``value`` is one that fact ``name`` can take in some session (numbers as numerals without
    leading or trailing zeros: "1" for "1.00"). For the recall score: what an answer that lists a pool
    uses besides the session's value."""
    if name == "exception_code":
        return _CODE.fullmatch(value) is not None
    return value in _pools()[name]


def fee(facts: dict[str, str], amount: Decimal) -> Decimal:
    """The fee rule: ``BASE_FEE + amount * FEE_RATE`` rounded to a multiple of the quantum."""
    q = Decimal(facts["quantum"])
    raw = Decimal(facts["base_fee"]) + amount * Decimal(facts["fee_rate"])
    return (raw / q).quantize(Decimal("1"), rounding=_ROUNDING[facts["rounding_mode"]]) * q
