"""SymbolPlanner: identifier extraction, span mapping on hand-written sessions, plan() updates, rehydration."""

from types import SimpleNamespace

import pytest

from pace_hf.blueprint import Blueprint, Span
from pace_hf.cache import Quotas
from pace_hf.planner import SymbolPlanner
from pace_hf.session import Message

CODE = "```python\n{}\n```"


def session_of(*turns):
    """Messages from (role, content) pairs: a user message starts a step (1, 2, ...), 100 tokens each."""
    messages, step = [], 0
    for role, content in turns:
        step += role == "user"
        i = len(messages)
        messages.append(Message(i, role, content, 10 + 100 * i, 10 + 100 * (i + 1), step))
    return messages


def edges(blueprint):
    """{(message index, reader step)} of a blueprint over session_of() messages (a span that covers
    neighbouring messages, merged, counts for each)."""
    return {(k, r) for s in blueprint for k in range((s.start - 10) // 100, (s.end - 10 + 99) // 100)
            for r in s.readers}


# ------------------------------------------------------------------------------------------ extraction

def test_identifiers_in_code_and_prose():
    p = SymbolPlanner()
    text = ("Call `settle(record)` from 'billing' with the LedgerError, MAX_RETRIES and fee_rate; an Invoice "
            "is fine. The plan is ready.\n" + CODE.format("total = fee_for(amount) + BASE"))
    assert p.identifiers(text) == {"settle", "record", "billing", "LedgerError", "MAX_RETRIES", "fee_rate",
                                   "Invoice", "total", "fee_for", "amount", "BASE"}
    # keywords, builtins, stopwords, self and one-letter names are not identifiers
    assert p.identifiers(CODE.format("def f(self, x):\n    return len(x) if x else None")) == set()
    assert p.identifiers("Noted.") == set() and p.identifiers("Understood.") == set()


def test_definitions_in_code():
    p = SymbolPlanner()
    code = CODE.format(
        "from decimal import Decimal\n\n"
        "@dataclass\nclass Invoice:\n    invoice_id: str\n    amount: Decimal\n\n"
        "class LedgerError(Exception):\n    def __init__(self, code):\n        self.code = code\n\n"
        "RATE, QUANTUM = 2, 5\nBASE_FEE: int = 3\n\n"
        "def settle(record):\n    total = record.amount\n    return total\n")
    # imports and locals (total, record) are not definitions; fields, methods' self.X and constants are
    assert p.definitions(code) == {"Invoice", "invoice_id", "amount", "LedgerError", "__init__", "code", "RATE",
                                   "QUANTUM", "BASE_FEE", "settle"}


def test_definitions_in_prose_and_fragments():
    p = SymbolPlanner()
    prose = "`invoice_id` is the identifier. The VaultCode is 4471, MAX_RETRIES = 5 and it is fine. Status is open."
    assert p.definitions(prose) == {"invoice_id", "VaultCode", "MAX_RETRIES"}
    # a fragment cut mid-function: the parsable blocks still give their definitions
    fragment = CODE.format("        return value\n\n\ndef parse_header(line):\n    return line\n\nLIMIT = 10\n"
                           "def broken(a,\n")
    assert p.definitions(fragment) == {"parse_header", "LIMIT", "broken"}


# ------------------------------------------------------------------------------------------ span mapping

def test_code_and_prose_definitions_are_read_by_the_steps_that_name_them():
    msgs = session_of(
        ("user", "The spec. " + CODE.format("class Invoice:\n    amount: int\n\ndef fee_for(amount):\n    return 2")),
        ("assistant", "Understood."),
        ("user", "`vault_code` is 4471."),
        ("assistant", "Noted."),
    )
    planner = SymbolPlanner({3: "Write `fee_for` again.", 4: "Print the vault_code and the Invoice.",
                             5: "Say hello."})
    assert edges(planner.blueprint_for(msgs)) == {(0, 3), (2, 4), (0, 4)}
    bp = planner.blueprint_for(msgs)
    assert [s.to_dict() for s in bp] == [{"start": 10, "end": 110, "readers": [3, 4]},
                                         {"start": 210, "end": 310, "readers": [4]}]


def test_a_later_definition_wins_for_later_readers():
    msgs = session_of(
        ("user", CODE.format("LIMIT = 10")),          # 0, step 1
        ("user", "filler"),                           # 1, step 2
        ("user", CODE.format("LIMIT = 20")),          # 2, step 3
    )
    planner = SymbolPlanner({2: "Use LIMIT.", 5: "Use LIMIT again."})
    assert edges(planner.blueprint_for(msgs)) == {(0, 2), (2, 5)}


def test_a_local_that_shadows_a_top_level_name_is_no_definition():
    msgs = session_of(
        ("user", CODE.format("total = 100")),                                             # 0
        ("user", CODE.format("def report(items):\n    total = sum(items)\n    return total")),  # 1
    )
    planner = SymbolPlanner({5: "What is `total`?", 6: "Call report()."})
    # step 5 reads the top-level total only; report's local total is no dependency of report either
    assert edges(planner.blueprint_for(msgs)) == {(0, 5), (1, 6)}


def test_an_identifier_only_in_filler_makes_no_edge():
    msgs = session_of(
        ("user", "Here is a file:\n" + CODE.format("def helper(cache_key):\n    return lookup(cache_key)")),  # 0
        ("user", "The cache_key and the lookup() are mentioned here, never defined."),                     # 1
        ("user", CODE.format("def unrelated_thing():\n    pass")),                                           # 2
    )
    # cache_key/lookup are only mentioned (and a parameter); unrelated_thing is defined but no step names it
    planner = SymbolPlanner({9: "Use cache_key with lookup."})
    assert len(planner.blueprint_for(msgs)) == 0


def test_dependency_closure_follows_uses_as_the_definer_saw_them():
    msgs = session_of(
        ("user", CODE.format("@dataclass\nclass Invoice:\n    status: str")),                    # 0
        ("user", CODE.format("def settle(record):\n    record.status = 'paid'\n    return fee_for(1)")),  # 1
        ("user", CODE.format("def fee_for(amount):\n    return amount")),                         # 2
    )
    steps = {7: "Write `settle(record)`."}
    # record.status -> the dataclass that declares the field (message 0); calls such as fee_for are not followed
    assert edges(SymbolPlanner(steps).blueprint_for(msgs)) == {(1, 7), (0, 7)}
    assert edges(SymbolPlanner(steps, depth=0).blueprint_for(msgs)) == {(1, 7)}


# ------------------------------------------------------------------------------------------ plan()

def test_plan_is_idempotent_and_follows_new_messages_and_steps():
    bp = Blueprint([Span(0, 5, [1])])  # someone else's span: never touched
    session = SimpleNamespace(messages=session_of(("user", CODE.format("LIMIT = 10"))),
                              cache=SimpleNamespace(blueprint=bp))
    planner = SymbolPlanner({4: "Use LIMIT."})
    planner.plan(session)
    planner.plan(session)
    assert [s.to_dict() for s in bp] == [{"start": 0, "end": 5, "readers": [1]},
                                         {"start": 10, "end": 110, "readers": [4]}]
    planner.add_steps({6: "LIMIT again."})
    planner.plan(session)
    assert [s.to_dict() for s in bp][1:] == [{"start": 10, "end": 110, "readers": [4, 6]}]
    # a redefinition at step 3 takes both later readers
    session.messages = session_of(("user", CODE.format("LIMIT = 10")), ("user", "x"), ("user", CODE.format("LIMIT = 20")))
    planner.plan(session)
    planner.plan(session)
    assert [s.to_dict() for s in bp] == [{"start": 0, "end": 5, "readers": [1]},
                                         {"start": 210, "end": 310, "readers": [4, 6]}]


def test_plan_does_not_repeat_a_span_the_blueprint_already_holds():
    bp = Blueprint([Span(10, 110, [4])])  # e.g. a resumed session's saved plan
    session = SimpleNamespace(messages=session_of(("user", CODE.format("LIMIT = 10"))),
                              cache=SimpleNamespace(blueprint=bp))
    SymbolPlanner({4: "Use LIMIT."}).plan(session)
    assert [s.to_dict() for s in bp] == [{"start": 10, "end": 110, "readers": [4]}]


def test_plan_needs_a_foresight_cache():
    session = SimpleNamespace(messages=[], cache=SimpleNamespace(blueprint=None))
    with pytest.raises(ValueError, match="Foresight"):
        SymbolPlanner().plan(session)


def test_bad_steps_are_refused():
    with pytest.raises(TypeError):
        SymbolPlanner({"3": "x"})
    with pytest.raises(TypeError):
        SymbolPlanner({3: 5})
    with pytest.raises(ValueError):
        SymbolPlanner(depth=-1)


# ------------------------------------------------------------------------------------------ rehydrate()

class FakeCache:
    """Records restores; positions in ``resident`` are resident."""

    def __init__(self, resident, seen, budget=1000):
        self.resident, self.seen, self.budget, self.step, self.restored = set(resident), seen, budget, 0, []
        self.quotas = Quotas(budget, sinks=0, recent=0)
        self.blueprint = Blueprint()

    def get_seq_length(self):
        return self.seen

    def residency(self, positions):
        positions = list(positions)
        return sum(p in self.resident for p in positions) / len(positions)

    def restore(self, start, end):
        self.restored.append((start, end, self.step))
        self.resident |= set(range(start, end))
        self.blueprint.add(Span(start, end, [self.step]))
        return end - start


def test_rehydrate_restores_evicted_definitions_the_turn_names():
    msgs = session_of(
        ("user", CODE.format("VAULT_CODE = 4471")),   # 0: evicted
        ("user", CODE.format("OTHER_CODE = 1")),      # 1: evicted, not named
        ("user", CODE.format("PORT_NUMBER = 80")),    # 2: resident
        ("user", "What are VAULT_CODE, PORT_NUMBER and NEW_NAME?"),  # 3: the new turn (step 4)
    )
    cache = FakeCache(resident=range(210, 310), seen=310)
    session = SimpleNamespace(messages=msgs, cache=cache, step=4)
    spans = SymbolPlanner().rehydrate(session, msgs[3])
    assert spans == [Span(10, 110, [4])] and cache.restored == [(10, 110, 4)] and cache.step == 4
    # a cap on restored tokens
    cache = FakeCache(resident=(), seen=310)
    session = SimpleNamespace(messages=msgs, cache=cache, step=4)
    assert SymbolPlanner(max_restore_tokens=150).rehydrate(session, msgs[3]) == [Span(210, 310, [4])]
    # messages not prefilled yet: the evicted prefix is restored, the rest is planned for this step
    cache = FakeCache(resident=(), seen=60)
    session = SimpleNamespace(messages=msgs, cache=cache, step=4)
    assert SymbolPlanner().rehydrate(session, msgs[3]) == [Span(210, 310, [4]), Span(10, 110, [4])]
    assert cache.restored == [(10, 60, 4)]
    assert sorted((s.start, s.end, s.readers) for s in cache.blueprint) == [(10, 60, (4,)), (60, 110, (4,)),
                                                                             (210, 310, (4,))]


# ------------------------------------------------------------------------------------------ real model

@pytest.mark.slow
def test_rehydration_restores_a_missed_span_before_the_turns_first_forward():
    from pace_bench.models import load_model
    from pace_hf.session import PACESession
    from pace_hf.tiers import HostTier, TieredStore

    import inspect
    import json

    model, tokenizer = load_model("smollm2-135m")
    planner = SymbolPlanner({50: "An unrelated step."})  # the plan misses the edge
    session = PACESession(model, tokenizer, budget=64, limit=256, store=TieredStore([HostTier()]),
                          session_id="rehydrate", planner=planner, rehydrate=True, recent=16)
    fact = session.add("user", "Keep this constant:\n" + CODE.format("VAULT_CODE = 4471"))
    session.generate(max_new_tokens=4)
    source = inspect.getsource(json.decoder).splitlines()
    for k in range(3):
        session.add("user", "More code:\n" + CODE.format("\n".join(source[12 * k:12 * (k + 1)])))
        session.generate(max_new_tokens=4)
    offsets, _, at = session.template.content_offsets("user", fact.content)
    a = fact.content.index("VAULT_CODE = 4471")
    first, last = offsets.span(a + at, a + at + len("VAULT_CODE = 4471"))
    span = range(fact.start + first, fact.start + last)  # the definition, not its whole message
    assert session.cache.residency(span) < 1.0  # evicted (spilled to the host tier)

    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(session.cache.residency(span)))
    try:
        turn = session.add("user", "What is VAULT_CODE?")
        assert session.cache.tier_stats["restored_tokens"] > 0
        session.generate(max_new_tokens=4)
    finally:
        hook.remove()
    assert seen and seen[0] == 1.0  # resident before the turn's first forward
    assert any(s.start <= span.start and span.stop <= s.end and s.readers == (turn.step,)
               for s in session.cache.blueprint)


def test_building_an_index_logs_nothing_below_the_roots_level():
    """bm25s sets its logger to DEBUG at import: pace-serve's WARNING log (a root handler, as
    ``logging.basicConfig`` installs) printed a DEBUG line per turn."""
    import logging

    from pace_hf.planner.prose import bm25_index

    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    try:
        bm25_index([["a", "b"], ["b", "c"]])
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    assert not [r for r in seen if r.name.startswith("bm25s")]
