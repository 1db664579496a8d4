"""Page retrieval: evicted pages found by what a later turn asks, restored exactly."""

import pytest
import torch
import transformers as tf
from conftest import assert_capped_gaps
from session_worker import session_model

from pace_hf import H2OCache
from pace_hf.memory.retrieval import PageRetriever, layer0_projections, words_of
from pace_hf.rope import RotaryParams, rerotate
from pace_hf.session import PACESession
from pace_hf.tiers import HostTier, TieredStore

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 6
FACT = "The courier's password is zebrafinch seven seven three one."
QUESTION = "What is the courier's zebrafinch password?"


def retriever(tokenizer, **kwargs):
    """Pages small enough for a 64-token budget (the default is 128 + 16 for budgets of thousands)."""
    return PageRetriever(tokenizer, **{"page_tokens": 32, "overlap": 16, "share": 96, **kwargs})


@pytest.fixture(scope="module")
def tiny():
    return session_model()


def read_context(model, tokenizer, store, facts=(FACT,), **kwargs):
    """A session that has read tool outputs (the facts among filler) and been prefilled: what it evicted
    is in the store. Returns the session and each fact's token span."""
    session = PACESession(model, tokenizer, budget=64, limit=256, recent=8, chunk=64, store=store,
                          session_id="s", **kwargs)
    session.add("user", "Read these files.")
    spans = []
    for fact in facts:
        session.add("tool", FILLER)
        spans.append(_span_of(session, session.add("tool", FILLER[:90] + fact + " " + FILLER[:90]), fact))
    session.add("tool", FILLER * 2)
    session.generate(max_new_tokens=1)  # the agent reads them: the history is prefilled and evicted
    return session, spans


def _span_of(session, message, fact):
    """The token span of ``fact`` inside ``message``."""
    tok = session.tokenizer
    block = session.template.block(message.role, message.content)
    at = block.index(fact)
    enc = tok(block, add_special_tokens=False, return_offsets_mapping=True)
    toks = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < at + len(fact) and e > at]
    return range(message.start + toks[0], message.start + toks[-1] + 1)


def test_a_later_turn_finds_a_spilled_page_by_a_rare_word(tiny):
    model, tokenizer = tiny
    session, (fact,) = read_context(model, tokenizer, TieredStore([HostTier()]), retrieval=retriever(tokenizer))
    cache = session.cache
    assert cache.residency(fact) < 0.5  # the fact was evicted by the query-agnostic prefill
    seen = cache.get_seq_length()
    session.add("user", QUESTION)
    assert cache.get_seq_length() == seen  # nothing prefilled yet: the restore came before the turn's forward
    assert cache.residency(fact) == 1.0
    stats = cache.tier_stats
    assert stats["retrieval_pages_restored"] >= 1 and stats["retrieval_pages_scored"] >= stats["retrieval_pages_restored"]
    assert stats["retrieval_tokens_restored"] > 0 and stats["retrieval_seconds"] > 0
    assert any(s.start <= fact.start and fact.stop <= s.end and cache.step in s.readers for s in cache.blueprint)
    with pytest.raises(ValueError, match="has seen"):  # the ids must cover what the cache has seen
        cache.retrieve(QUESTION, session.ids[:10])
    reply = session.generate(max_new_tokens=2)  # and the turn is then answered from the restored state
    assert isinstance(reply, str) and cache.residency(fact) == 1.0


CODE_FACT = "COURIER_RETRY_BUDGET = 7"


def test_a_turn_that_writes_an_identifier_as_words_finds_the_page_defining_it(tiny):
    """Agents ask about code in prose ("the courier retry budget"): the identifier's parts are words of
    its page, and the other pages share none of them."""
    model, tokenizer = tiny
    session, (fact,) = read_context(model, tokenizer, TieredStore([HostTier()]), facts=(CODE_FACT,),
                                    retrieval=retriever(tokenizer))
    cache = session.cache
    assert cache.residency(fact) < 0.5
    session.add("user", "What is the courier retry budget?")
    assert cache.residency(fact) == 1.0 and cache.tier_stats["retrieval_pages_restored"] >= 1


def test_words_are_bm25s_tokens_plus_the_parts_of_compound_identifiers():
    import bm25s

    plain = FILLER + FACT + " It is 1234567, said I: no-one else. A B c."
    assert words_of([plain]) == bm25s.tokenize([plain], stopwords="en", return_ids=False, show_progress=False)
    assert words_of(["parse_version(HTTPAdapter, retryBudget, x2)"]) == [
        ["parse_version", "parse", "version", "httpadapter", "http", "adapter", "retrybudget", "retry", "budget", "x2"]]


def test_a_restored_page_is_resident_and_exactly_rerotated_before_the_first_forward(tiny):
    model, tokenizer = tiny
    session, (fact,) = read_context(model, tokenizer, TieredStore([HostTier()]), retrieval=retriever(tokenizer))
    cache = session.cache
    forwards = []
    handle = model.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        session.add("user", QUESTION)
    finally:
        handle.remove()
    assert not forwards and cache.residency(fact) == 1.0
    full = tf.DynamicCache(config=model.config)  # every token's layer-0 key at its logical position
    with torch.no_grad():
        model(torch.tensor([session.ids[:cache.get_seq_length()]]), cache=full)
    own = full.layers[0].keys[0]
    logical, physical = cache.ledger(0)
    assert_capped_gaps(logical, physical, cache.limit)  # laid out again in logical order
    expected = rerotate(own.gather(1, logical[:, :, None].expand(-1, -1, own.shape[-1])), logical, physical,
                        RotaryParams.from_config(model.config))
    assert (cache.layers[0].keys[0] - expected).abs().max() <= 1e-5 * own.abs().max()


@pytest.mark.parametrize("numbered", [False, True])
def test_a_page_whose_hit_line_opens_a_block_brings_the_rest_of_the_block(tiny, numbered):
    """A function is mostly body, and the page naming it holds little of that: the lines indented under
    the hit line come back too, up to the block's end, whether or not the tool output is `cat -n`."""
    tok = tiny[1]
    body = "".join(f"        total += weight_{i} * price\n" for i in range(12))
    code = ("x = 1\n" * 30 + "def settle_invoice(ledger, price):\n    total = 0\n    for row in ledger:\n" + body
            + "    return total\n" + "y = 2\n" * 30)
    if numbered:
        code = "".join(f"{n:6d}\t{line}\n" for n, line in enumerate(code.splitlines(), 1))
    enc = tok(code, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]

    def at(text):  # the positions of the tokens of the first occurrence of text
        lo = code.index(text)
        return {i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < lo + len(text) and e > lo}

    question = "How does the settle invoice function work?"
    with_blocks = PageRetriever(tok, page_tokens=16, overlap=0).preview(ids, question, 400)
    without = PageRetriever(tok, page_tokens=16, overlap=0, blocks=False).preview(ids, question, 400)
    assert at("def settle_invoice") <= without and not at("return total") <= without
    assert at("return total") <= with_blocks and at("def settle_invoice") <= with_blocks
    assert not at("y = 2") & with_blocks  # the block's rest stops where the block does
    assert len(PageRetriever(tok, page_tokens=16, overlap=0).preview(ids, question, 40)) <= 40  # within the share


def test_the_page_that_defines_a_name_the_turn_names_outranks_its_uses(tiny):
    """A name is used on many pages and defined on one; a turn about it needs the definition."""
    tok = tiny[1]
    use = "    total = retry_budget(attempts) + retry_budget(attempts - 1)\n"
    filler = "x = 1\n" * 12
    code = filler + use * 2 + filler + "def retry_budget(attempts):\n    return 3\n" + filler + use * 2 + filler
    ids = tok(code, add_special_tokens=False)["input_ids"]
    defining = next(k for k, text in enumerate(PageRetriever(tok, page_tokens=16, overlap=0).texts(ids))
                    if "def retry_budget" in text)
    for question in ("What is `retry_budget`?", "What is the retry budget?"):
        plain, _ = PageRetriever(tok, page_tokens=16, overlap=0, definition_boost=1.0).rank(ids, question)
        boosted, _ = PageRetriever(tok, page_tokens=16, overlap=0).rank(ids, question)
        assert plain[0] != defining and boosted[0] == defining, question
    assert PageRetriever(tok, page_tokens=16, overlap=0).defining(ids, "What is the budget?") == set()  # one part: not named
    with pytest.raises(ValueError, match="definition_boost"):
        PageRetriever(tok, definition_boost=0.5)


def test_a_one_word_name_quoted_as_code_is_named_and_its_definition_moves_up(tiny):
    """`Ledger.settle` names ``settle`` as code, so the page of its ``def`` is boosted above pages that
    only call it, though "settle" is one word (unquoted, one word is not a name: "settle the bill"
    defines nothing)."""
    tok = tiny[1]
    use, filler = "    total = settle(bill)\n", "x = 1\n" * 12
    definition = "    def settle(self, amount):\n        return 3\n"
    code = filler + use + filler + use + filler + definition + filler + use + filler
    ids = tok(code, add_special_tokens=False)["input_ids"]
    r = PageRetriever(tok, page_tokens=16, overlap=0)
    defining = next(k for k, text in enumerate(r.texts(ids)) if "def settle" in text)
    assert r.defining(ids, "What does `Ledger.settle` compute?") == {defining}
    assert r.defining(ids, "What does `settle` compute?") == {defining}
    assert r.defining(ids, "How do we settle the bill?") == set()
    question = "What does `Ledger.settle` compute?"
    plain, _ = PageRetriever(tok, page_tokens=16, overlap=0, definition_boost=1.0).rank(ids, question)
    boosted, _ = r.rank(ids, question)
    assert boosted.index(defining) < plain.index(defining)


CHAIN = ("\nVAR QUOKKA = 48213\n", "\nVAR WOMBAT = VAR QUOKKA\n")  # RULER's variable tracking, one hop


@pytest.mark.parametrize("follow", [False, True])
def test_following_links_restores_the_chain_a_question_names_only_the_start_of(tiny, follow):
    """The question names the value; only the first assignment holds it, the second is found through
    the first's variable. With ``follow`` both come back (the second as its line); without, only the
    first."""
    model, tokenizer = tiny
    pages = retriever(tokenizer, follow=follow, page_tokens=16, overlap=4, share=40)  # a page and a line
    session, spans = read_context(model, tokenizer, TieredStore([HostTier()]), facts=CHAIN, retrieval=pages)
    first, second = (range(s.start + 1, s.stop - 1) for s in spans)  # the lines, less the newlines around them
    cache = session.cache
    assert cache.residency(first) < 0.5 and cache.residency(second) < 0.5
    session.add("user", "Find all variables that are assigned the value 48213.")
    assert cache.residency(first) == 1.0
    assert (cache.residency(second) == 1.0) is follow
    if follow:  # the link came back as its line, not its page
        link = next(s for s in cache.blueprint if s.start <= second.start and second.stop <= s.end)
        assert link.end - link.start < 16


def test_a_link_is_a_rare_word_of_the_line_holding_the_question_s_rarest_word(tiny):
    tok = tiny[1]
    filler = "alpha var beta " * 8 + "\n"  # 'var' is on every page: no link
    chain = [filler, "VAR QUOKKA = 48213\n", filler, "VAR WOMBAT = VAR QUOKKA\n", filler]
    ids = tok("".join(chain), add_special_tokens=False)["input_ids"]
    r = PageRetriever(tok, page_tokens=16, overlap=0, link_pages=1, follow=True)
    page = next(k for k, w in enumerate(r.core_words(ids)) if "48213" in w)
    span = (page * 16, page * 16 + 16)
    (line, via), = r.links(ids, span, {"48213", "variables"})
    assert via == {"quokka"} and tok.decode(ids[line[0]:line[1]]).strip() == "VAR WOMBAT = VAR QUOKKA"
    assert r.links(ids, span, {"absent"}) == []  # no word of the question on the page: no links
    ids = tok("".join(chain + ["QUOKKA once more\n", filler]), add_special_tokens=False)["input_ids"]
    assert r.links(ids, span, {"48213"}) == []  # QUOKKA is now on two other pages: more than link_pages
    assert len(PageRetriever(tok, page_tokens=16, overlap=0, link_pages=2).links(ids, span, {"48213"})) == 2


@pytest.mark.parametrize("share", [40, None])
def test_the_budget_share_is_respected(tiny, share):
    model, tokenizer = tiny
    facts = [FACT.replace("seven", w) for w in ("one", "two", "four", "five", "six")]
    pages = retriever(tokenizer, share=share, page_tokens=8 if share is None else 32, overlap=4)
    session, spans = read_context(model, tokenizer, TieredStore([HostTier()]), facts=facts, retrieval=pages)
    cache = session.cache
    cap = share if share is not None else cache.budget // 4  # the default: budget // 4 = 16
    before = [cache.ledger(i)[0].clone() for i in range(len(cache.layers))]
    matching = [s for s in spans if cache.residency(s) < 1.0]
    assert len(matching) >= 3
    session.add("user", QUESTION)
    for i, old in enumerate(before):  # per layer and KV head, at most `share` tokens came back
        for new_h, old_h in zip(cache.ledger(i)[0], old):
            assert int((~torch.isin(new_h, old_h)).sum()) <= cap
    restored = cache.tier_stats["retrieval_pages_restored"]
    assert 1 <= restored < len(matching)  # the share stopped it before every matching page came back


def test_a_share_smaller_than_a_page_restores_the_window_around_the_rarest_word(tiny):
    """The default pages (144 positions) do not fit a 64-token budget's share (16): the best page's 16
    positions around the turn's rarest word come back instead of nothing."""
    model, tokenizer = tiny
    session, (fact,) = read_context(model, tokenizer, TieredStore([HostTier()]), retrieval=True)
    cache = session.cache
    word = [p for p in fact if "zebra" in tokenizer.decode(session.ids[p:p + 1])]
    assert cache.residency(word) == 0.0
    before = [cache.ledger(i)[0].clone() for i in range(len(cache.layers))]
    session.add("user", QUESTION)
    assert cache.residency(word) == 1.0 and cache.tier_stats["retrieval_pages_restored"] == 1
    for i, old in enumerate(before):  # within the share: budget // 4 = 16 per layer and KV head
        for new_h, old_h in zip(cache.ledger(i)[0], old):
            assert int((~torch.isin(new_h, old_h)).sum()) <= 16


def test_no_store_or_nothing_spilled_is_a_no_op_and_a_cache_without_foresight_is_refused(tiny):
    model, tokenizer = tiny
    session = PACESession(model, tokenizer, budget=64, limit=256, recent=8, chunk=64, retrieval=True)
    session.add("tool", FILLER * 3)
    session.generate(max_new_tokens=1)
    session.add("user", QUESTION)  # no store: nothing to restore from, and no error
    assert session.cache.tier_stats["retrieval_pages_restored"] == 0
    stored = PACESession(model, tokenizer, budget=64, limit=256, recent=8, chunk=64, retrieval=True,
                         store=TieredStore([HostTier()]), session_id="t")
    assert stored.cache.retrieve(QUESTION, [], tokenizer) == []  # nothing seen, nothing spilled
    h2o = H2OCache(model, budget=32, recent=8, store=TieredStore([HostTier()]), session_id="h")
    ids = tokenizer(FILLER * 3, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        model(torch.tensor([ids]), cache=h2o)
    with pytest.raises(ValueError, match="Foresight"):
        h2o.retrieve(QUESTION, ids, tokenizer)
    with pytest.raises(ValueError, match="unknown signal"):
        PageRetriever(tokenizer, signal="semantic")


def test_layer0_projections_are_the_unrotated_keys_and_the_digest_bounds_attention(tiny):
    model, tokenizer = tiny
    ids = tokenizer(FILLER + FACT, add_special_tokens=False)["input_ids"][:96]
    q, k = layer0_projections(model, torch.tensor([ids]))
    full = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([ids]), cache=full)
    rotated = full.layers[0].keys[0]  # [kv, n, d], rotated at 0..n-1
    n = len(ids)
    mine = rerotate(k[0].transpose(0, 1), torch.zeros(2, n, dtype=torch.long), torch.arange(n).expand(2, n),
                    RotaryParams.from_config(model.config))
    assert (mine - rotated).abs().max() <= 1e-5 * rotated.abs().max()
    retriever = PageRetriever(tokenizer, page_tokens=32, overlap=0, signal="digest", digest_tokens=8)
    scores = retriever.digest_scores(model, ids, QUESTION)
    qq, _ = layer0_projections(model, torch.tensor([tokenizer(QUESTION, add_special_tokens=False)["input_ids"]]))
    group = qq.shape[2] // k.shape[2]
    exact = torch.einsum("thd,nhd->tnh", qq[0], k[0].repeat_interleave(group, dim=1)).mean(-1)  # [t, n]
    for page, (s, e) in enumerate(retriever.pages(n)):
        assert scores[page] >= exact[:, s:e].max() - 1e-4  # Quest's bound is an upper bound
    fused = PageRetriever(tokenizer, page_tokens=32, overlap=0, signal="both")
    order, _ = fused.rank(ids, QUESTION, model)
    assert sorted(order) == list(range(len(retriever.pages(n))))


def test_the_recall_bench_measures_rulers_prompts_and_following_links(tmp_path):
    """bench/retrieval_recall.py on RULER's own vt prompts (lm-eval's generator): following links restores
    more of the chain than the ranking alone, and the records say so."""
    import importlib.util
    import json
    from pathlib import Path

    pytest.importorskip("lm_eval")
    path = Path(__file__).parents[1] / "bench" / "retrieval_recall.py"
    spec = importlib.util.spec_from_file_location("retrieval_recall", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "recall.json"
    table = bench.main(["--split", "ruler", "--ruler-tasks", "vt", "--lengths", "2048", "--seeds", "2",
                        "--model", "smollm2-135m", "--follow", "off,on", "--json", str(out)])
    plain, linked = table["ruler/lexical/vt/probe"], table["ruler/lexical+follow/vt/probe"]
    assert plain["n"] == linked["n"] == 2
    assert linked["covered"] > plain["covered"] > 0, table
    records = json.loads(out.read_text())["records"]
    assert {r["package"] for r in records} == {"vt@2048"} and len(records) == 4


def test_page_words_read_again_only_where_the_ids_changed_equal_a_fresh_read(tiny):
    tok = tiny[1]
    text = "".join(f"line {i} holds word{i % 7} and token{i}\n" for i in range(60))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    r = PageRetriever(tok, page_tokens=16, overlap=0)
    histories = [ids[:100], ids[:150], ids, ids[:40] + tok("rewritten history\n")["input_ids"] + ids[60:], ids[:33]]
    for h in histories:  # grows, grows, is rewritten in the middle, shrinks
        fresh = PageRetriever(tok, page_tokens=16, overlap=0)
        assert r.core_words(h) == fresh.core_words(h) and r.page_counts(h) == fresh.page_counts(h)


def test_a_worked_example_that_matches_the_question_s_words_leads_nowhere_and_a_chain_goes_on_on_its_page(tiny):
    """RULER's vt prompt opens with a worked example whose question shares every word of the real one
    but its value: a ranked page anchors links only with the question's rarest word (fewest pages, then
    most tokenizer pieces), so the example's chain is not followed. The real chain's next link can be
    the next line, on the linked line's own page."""
    tok = tiny[1]
    filler = "the grass is green and the sky is blue here we go\n"
    example = ("VAR ALPHA = 11111\n" + filler * 3 + "VAR BETA = VAR ALPHA\n" + filler * 3
               + "Question: find all variables that are assigned the value 11111 in the text above.\n")
    context = (example + filler * 6 + "VAR QUOKKA = 48213\n" + filler * 6
               + "VAR WOMBAT = VAR QUOKKA\nVAR NUMBAT = VAR WOMBAT\n" + filler * 6)
    ids = tok(context, add_special_tokens=False)["input_ids"]
    r = PageRetriever(tok, page_tokens=16, overlap=8, follow=True)
    taken = r.preview(ids, "Find all variables that are assigned the value 48213.", 96)

    def covered(line):
        start = context.index(line)
        span = {i for i, (a, b) in enumerate(tok(context, add_special_tokens=False, return_offsets_mapping=True)
                                              ["offset_mapping"]) if a < start + len(line) and b > start}
        return len(span & taken) / len(span)

    assert [covered(line) for line in ("QUOKKA = 48213", "VAR WOMBAT = VAR QUOKKA", "VAR NUMBAT = VAR WOMBAT")] \
        == [1.0, 1.0, 1.0]  # the ranked page starts just after the first line's "VAR"
    assert covered("VAR BETA = VAR ALPHA") == 0.0
