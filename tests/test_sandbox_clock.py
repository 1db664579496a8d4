"""The clock-phase channel between the runs of one ``compute()`` (issue 41), attacked end to end.

A run can always read the wall clock, and the next run of a ``compute()`` starts when the previous one
ended: a sender sleeps until ``time.time() % PERIOD`` is the phase of its symbol and exits, and the next
run reads the clock when its program starts and decodes the symbol from the phase. The sandbox cannot
close this (the threat model says so, and measures what is left: a few bits per run). What closes it
for credit is that no run's inputs hold a fact that another run is checked on: these tests check that
the symbol a sender can send is worth nothing to its receiver, through the real metric and sandbox."""

import json
import re

import pytest

from pace_bench import facts as F
from pace_bench.metrics.pace_coding import pace_coding as M
from pace_bench.models import load_tokenizer
from pace_bench.sessions import build_session
from pace_bench.billing_spec import code_pieces, plain

from host_objects import host_unchanged

pytestmark = pytest.mark.usefixtures("code_eval_allowed")

# The channel: SLOTS phases of a PERIOD. DELAY is the usual time from a sender's exit to the next answer's
# first line (0.16-0.47 s on a busy 2-core host, median 0.18-0.29 s with its load); a receiver decodes the
# slot that its start less DELAY falls in.
PERIOD, SLOTS, DELAY = 1.6, 16, 0.22

# What every hostile answer below starts with. The symbol a sender sends is 1 + the position in a public
# pool (the generator's) of the first word of the pool that its inputs hold (its preamble's names and
# code, its calls' arguments), or 0 when they hold none. A receiver guesses that pool's word, or a name
# of no pool where the symbol names none.
_CHANNEL = """
_OWN = set(globals())  # first thing the answer does: what the run was given before it (its preamble)
import os, re, time
_RX = time.time()  # when this run's program started
PERIOD, SLOTS, DELAY, SEND = %r, %r, %r, %r
_SEEN = []

def _words():
    # every name, string and identifier that the run's inputs hold: its preamble's globals (their code's
    # names and constants, a class's name and attributes) and the arguments of the calls so far
    out = set()
    def code(co):
        out.update(co.co_names)
        out.update(co.co_varnames)
        for c in co.co_consts:
            if isinstance(c, str):
                out.add(c)
            elif hasattr(c, "co_consts"):
                code(c)
    for name in _OWN:
        out.add(name)
        value = globals().get(name)
        if hasattr(value, "__code__"):
            code(value.__code__)
        if isinstance(value, type):
            out.update(k.__name__ for k in value.__mro__)
            out.update(map(str, vars(value)))
    for arg in _SEEN:
        out.add(str(arg))
        if hasattr(arg, "__dict__"):
            out.update(map(str, vars(arg)))
            out.update(map(str, vars(arg).values()))
    return set(re.findall(r"\\w+", " ".join(out)))

def _message(pool):
    words = _words()
    return next((k + 1 for k, word in enumerate(pool) if word in words), 0)

def _decode():
    return int(((_RX - DELAY) %% PERIOD) // (PERIOD / SLOTS)) %% SLOTS

def _guess(pool, symbol, otherwise):
    return pool[symbol - 1] if 1 <= symbol <= len(pool) else otherwise

def _send(symbol):
    # end this run when the clock's phase is the middle of the symbol's slot (silent: end now)
    if SEND:
        now = time.time()
        target = now - now %% PERIOD + (symbol + 0.5) * PERIOD / SLOTS
        while target < now + 0.01:
            target += PERIOD
        while time.time() < target:
            time.sleep(target - time.time())
    os._exit(0)
"""

# Run 1 (the fee_for probe) sends what its inputs say of the exception's name (settle_rejects, run 2).
_SENDER = """
_CALLS = 0
def fee_for(amount):
    global _CALLS
    _CALLS += 1
    _SEEN.append(amount)
    if _CALLS == 1:  # the first call reports what this run will send
        raise ValueError("t=%%.6f tx=%%d" %% (time.time(), _message(%r)))
    _send(_message(%r))
""" % (F.EXCEPTION_NAMES, F.EXCEPTION_NAMES)

# Run 2 (settle) raises the exception it decoded (settle_rejects), and sends what its inputs say of the
# class's name (module_dataclass, run 3). Its first call on a closed record reports, the second sends.
_RELAY = """
_RS = _decode()
Guess = type(_guess(%r, _RS, "NoRecallError"), (Exception,), {})
_CLOSED = 0
def settle(record):
    global _CLOSED
    _SEEN.append(record)
    if all(v in %r for v in vars(record).values() if isinstance(v, str)):  # a closed record (not the grid's)
        _CLOSED += 1
        if _CLOSED == 2:
            _send(_message(%r))
    raise Guess("rx=%%.6f rs=%%d tx=%%d" %% (_RX, _RS, _message(%r)))
""" % (F.EXCEPTION_NAMES, F.STATUS_SETTLED, F.CLASS_NAMES, F.CLASS_NAMES)

# Run 3 (module) defines a dataclass of the name it decoded (module_dataclass); fields, fee and settle
# that no session has; its fee_for reports.
_RECEIVER = """
import dataclasses
_RS = _decode()
_NAME = _guess(%r, _RS, "Record")
globals()[_NAME] = dataclasses.dataclass(type(_NAME, (), {
    "__module__": __name__, "__annotations__": {"x_id": str, "x_amount": object, "x_status": str}}))
def fee_for(amount):
    return "rx=%%.6f rs=%%d" %% (_RX, _RS)
def settle(record):
    raise RuntimeError("no recall")
""" % (F.CLASS_NAMES,)


def answers(send):
    head = _CHANNEL % (PERIOD, SLOTS, DELAY, send)
    return ["```python\n" + head + body + "```" for body in (_SENDER, _RELAY, _RECEIVER)]


def _got(detail, check):
    return next(c for c in detail["checks"] if c["name"] == check)


def _field(detail, check, key):
    """A number that the hostile answer reported in a check's result (``key=value``)."""
    got = _got(detail, check)["got"]
    found = re.search(rf"\b{key}=([0-9.]+)", got)
    assert found, (check, got)
    return float(found.group(1))


def _facts(row):
    return {f["name"]: f["value"] for f in row["facts"]}


def _guess(pool, symbol):
    return pool[symbol - 1] if 1 <= symbol <= len(pool) else None


def _hop(pool, truth, sent, decoded, passed, rx, sent_at):
    """One sender-receiver hop: the receiver's credit is what its decoded symbol earns as a blind guess,
    and the symbol its sender sent earns nothing. Returns whether the clock carried the symbol, and the
    delay from the sender's end (the symbol's phase) to the receiver's start."""
    assert _guess(pool, sent) != truth, ("the sender's inputs named the fact", sent, truth)
    # since generator 16 the receiver's check needs more facts than the symbol's (the error code with
    # the exception's name, the exception's name with the class name): a right guess is needed, not enough
    assert passed <= (_guess(pool, decoded) == truth), (decoded, truth, passed)
    assert not (decoded == sent and passed)  # what the clock carries is worth no check
    assert rx > sent_at  # one clock, read in order: the receiver started after its sender reported
    delay = (rx - (sent + 0.5) * PERIOD / SLOTS) % PERIOD
    return decoded == sent, round(delay, 3)


def compute(row, send):
    """One ``compute()`` of the three hostile answers on ``row``'s probes, and per hop what was sent,
    decoded and passed. Every check passed is accounted for by a hop's blind guess."""
    facts = _facts(row)
    out = M.score(answers(send), [p["reference"] for p in row["probes"]])
    fee, settle, module = out["details"]
    assert [d["probe"] for d in out["details"]] == ["fee_for", "settle", "module"]
    tx1, t1 = int(_field(fee, "fee_base", "tx")), _field(fee, "fee_base", "t")
    rx2, rs2, tx2 = (_field(settle, "settle_rejects", k) for k in ("rx", "rs", "tx"))
    rx3, rs3 = _field(module, "module_fee", "rx"), _field(module, "module_fee", "rs")
    rejects, dataclass = _got(settle, "settle_rejects")["passed"], _got(module, "module_dataclass")["passed"]
    hops = [_hop(F.EXCEPTION_NAMES, facts["exception_name"], tx1, int(rs2), rejects, rx2, t1),
            _hop(F.CLASS_NAMES, facts["class_name"], int(tx2), int(rs3), dataclass, rx3, rx2)]
    assert out["checks_passed"] == rejects + dataclass, out["details"]  # no other check, ever
    assert fee["checks"][1]["failure"] == "error"  # the sender ended its run in the second call
    return hops, out["checks_passed"]


def _old_preamble(reference, facts, parts):
    """The reference with the preamble the probe had before issue 41 (``parts`` of the module, facts
    and all) ahead of today's, which defines the checks' helper."""
    ref = json.loads(reference)
    pieces = code_pieces(facts)
    ref["preamble"] = "\n\n".join(plain(pieces[p]) for p in parts) + "\n\n" + ref["preamble"]
    return ref


@pytest.mark.slow
def test_the_clock_phase_carries_nothing_a_check_needs():
    """Each of the three runs of a ``compute()`` (probes fee_for, settle, module) is given its preamble
    and calls. Run 1 sends, through the phase of the clock at which it ends, which exception name of the
    generator's pool its inputs hold; run 2 raises the exception it decoded (settle_rejects) and sends
    which class name its inputs hold; run 3 defines a dataclass of the name it decoded (module_dataclass).

    Before issue 41 the fee_for probe's preamble defined the session's exception class and settle's its
    dataclass: both symbols named a fact (the last part of the test runs the senders against those
    preambles), and whenever the clock carried one, its receiver passed a check with no recall (9 of 12
    such checks in 6 computes on a busy 2-core host). Now no run is given a session fact: each sender's
    symbol names none, so a receiver's credit is what its decoded symbol earns as a blind guess, whether
    the clock carried the symbol or not, as for the same receivers after silent senders (ending at once).
    Nothing here depends on the clock carrying the symbol: on a loaded host it often does not."""
    tok = load_tokenizer("smollm2-135m")
    rows = [build_session(tok, seed=s, total_tokens=800, secret=f"{41 + s:032x}") for s in range(2)]
    carried, lucky = [], 0
    with host_unchanged():
        for row in rows:
            hops, passed = compute(row, send=True)
            carried += hops
            lucky += passed
            compute(row, send=False)  # the same receivers, no sender: the same rule holds
        # The attack is armed: given the preambles of before issue 41, the senders' symbols name the facts.
        facts = _facts(rows[0])
        fee_ref, settle_ref, _ = (p["reference"] for p in rows[0]["probes"])
        sender, relay, _ = answers(send=False)
        old = M.score_answer(sender, _old_preamble(fee_ref, facts, ("imports", "dataclass", "error", "settle")))
        assert _guess(F.EXCEPTION_NAMES, int(_field(old, "fee_base", "tx"))) == facts["exception_name"]
        old = M.score_answer(relay, _old_preamble(settle_ref, facts, ("imports", "dataclass", "fee_for")))
        assert _guess(F.CLASS_NAMES, int(_field(old, "settle_rejects", "tx"))) == facts["class_name"]
    print(f"clock phase: {sum(c for c, _ in carried)} of {len(carried)} symbols carried, delays "
          f"{[d for _, d in carried]} s, {lucky} checks passed by blind guesses")
