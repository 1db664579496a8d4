"""Batches under plain ``generate``: every row of a left-padded batch equals the same sequence run alone.

Tiny random models in fp32 (a full-attention Llama and Gemma 3's sliding/full layout), four prompts of
different lengths, budgets small enough that every row evicts during prefill and decode, and a ``limit``
that makes the longest row renumber. Alone means a fresh cache of the same settings and ``generate`` on
the row's unpadded prompt."""

import pytest
import torch
from transformers.cache_utils import Cache

from pace_hf import Blueprint, H2OCache, PACECache, SnapKVCache, Span, StreamingLLMCache, TieredStore, HostTier
from pace_hf.cache import CacheRows

from tiny_models import tiny_model

LENGTHS = [60, 45, 80, 30]
NEW = 24
GREEDY = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
BLUEPRINTS = [Blueprint([Span(5, 12, readers=(2,))]), Blueprint([Span(20, 28, readers=(1,))]), Blueprint(),
              Blueprint([Span(2, 9, readers=(3,))])]


def prompts(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g) for n in lengths]


def left_padded(rows):
    width = max(len(p) for p in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(rows):
        ids[r, width - len(p):], mask[r, width - len(p):] = p, 1
    return ids, mask


CACHES = {
    "h2o": lambda model, blueprint: H2OCache(model, budget=24, recent=4, limit=90),
    "pace": lambda model, blueprint: PACECache(model, blueprint, budget=24, recent=4, limit=90),
    "snapkv": lambda model, blueprint: SnapKVCache(model, budget=24, recent=4, window=4),
    "streaming": lambda model, blueprint: StreamingLLMCache(model, budget=24, limit=90),
}


def assert_rows_equal_alone(model, make, rows, batch_blueprint, row_blueprints, **kwargs):
    """Greedy tokens equal and scores within 1e-4 per row; each row holds the same ledger as alone."""
    ids, mask = left_padded(rows)
    cache = make(model, batch_blueprint)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, **GREEDY, **kwargs)
    assert len(cache.rows) == len(rows)
    for r, p in enumerate(rows):
        alone_cache = make(model, row_blueprints[r])
        with torch.no_grad():
            alone = model.generate(p[None], cache=alone_cache, **GREEDY, **kwargs)
        assert torch.equal(out.sequences[r, ids.shape[1]:], alone.sequences[0, len(p):]), f"row {r}"
        torch.testing.assert_close(torch.stack(out.scores)[:, r], torch.stack(alone.scores)[:, 0], atol=1e-4, rtol=0)
        row = cache.rows[r]
        assert row.get_seq_length() == alone_cache.get_seq_length() == len(p) + NEW - 1
        for i, _ in row.evicting_layers:
            assert all(torch.equal(a, b) for a, b in zip(row.ledger(i), alone_cache.ledger(i))), f"row {r} layer {i}"
        assert row.renumbers == alone_cache.renumbers
        alone_cache.unbind()
    return cache


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("name", list(CACHES))
def test_each_row_of_a_batch_equals_the_row_run_alone(kind, name):
    model = tiny_model(kind)
    rows = prompts()
    cache = assert_rows_equal_alone(model, CACHES[name], rows, BLUEPRINTS[0], [BLUEPRINTS[0]] * len(rows))
    assert all(row.resident_count() == 24 for row in cache.rows)
    if name in ("h2o", "pace", "streaming"):  # the longest row passed limit=90 and renumbered
        assert cache.rows[2].renumbers >= 1


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_one_blueprint_per_row(kind):
    model = tiny_model(kind)
    cache = assert_rows_equal_alone(model, CACHES["pace"], prompts(), BLUEPRINTS, BLUEPRINTS)
    for row, blueprint in zip(cache.rows, BLUEPRINTS):
        assert row.blueprint is blueprint
    # the planned span of each row is held whole, in every KV head, while its reader step is ahead
    assert cache.rows[0].residency(range(5, 12)) == 1.0 and cache.rows[1].residency(range(20, 28)) == 1.0


def test_a_chunked_prefill_equals_alone_when_the_padding_keeps_chunk_boundaries():
    """Eviction runs at the end of each forward, per row. With ``prefill_chunk_size``, a row's forwards are
    the columns generate gives it less its pads: when every row's padding is a whole number of chunks,
    each row gets the chunks it gets alone, and equals it."""
    model = tiny_model("llama")
    assert_rows_equal_alone(model, CACHES["h2o"], prompts([80, 64, 48, 32]), None, [None] * 4, prefill_chunk_size=16)


def test_pads_are_never_stored_spilled_or_counted():
    model = tiny_model("llama")
    rows = prompts()
    ids, mask = left_padded(rows)
    store = TieredStore([HostTier(1 << 30)])
    cache = H2OCache(model, budget=24, recent=4, limit=90, store=store, session_id="batch")
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, cache=cache, **GREEDY)
    assert cache.get_seq_length() == ids.shape[1] + NEW - 1  # the columns generate gave it
    for r, (row, p) in enumerate(zip(cache.rows, rows)):
        seen = len(p) + NEW - 1
        assert row.session_id == f"batch-row{r}"
        assert row.tokens.ids(len(p)).tolist() == p.tolist()  # the row's own ids, no pad among them
        spilled = row.spill.collect(0, seen, row.spill.fetch(0, seen))[0]
        for i, layer in row.evicting_layers:
            heads = layer.logical.shape[0]
            got = spilled[i]["head"].long() * seen + spilled[i]["logical"].long()
            held = (torch.arange(heads)[:, None] * seen + layer.logical).flatten()
            # every token the row saw, in every KV head, is resident or spilled, exactly once: no pad is either
            assert sorted(torch.cat([got, held]).tolist()) == list(range(heads * seen)), f"row {r} layer {i}"


def test_steps_shared_or_per_row_and_wrong_counts_are_clear_errors():
    model = tiny_model("llama")
    rows = prompts()
    ids, mask = left_padded(rows)
    cache = PACECache(model, BLUEPRINTS, budget=24, recent=4, limit=90)
    cache.step = [0, 1, 2, 3]
    assert cache.step == [0, 1, 2, 3]
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert [row.step for row in cache.rows] == [0, 1, 2, 3]
    cache.step = 5
    assert cache.step == 5 and all(row.step == 5 for row in cache.rows)
    with pytest.raises(ValueError, match="3 steps for a batch of 4"):
        cache.step = [1, 2, 3]
    with pytest.raises(ValueError, match="cache.rows"):
        cache.ledger()
    with pytest.raises(ValueError, match="batch of 4 rows, but the input has 2"):
        model.generate(ids[:2], attention_mask=mask[:2], cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
    cache.reset()  # a reset cache takes another batch size
    with torch.no_grad():
        model.generate(ids[:1, -60:], cache=PACECache(model, BLUEPRINTS[:1], budget=24, recent=4, limit=90),
                       max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match="4 per-row settings"):
        model.generate(ids[:2], attention_mask=mask[:2], cache=PACECache(model, BLUEPRINTS, budget=24, recent=4),
                       max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(TypeError, match="list of them"):
        PACECache(model, [BLUEPRINTS[0], "plan"], budget=24, recent=4)


def test_refusals_name_what_is_refused():
    model = tiny_model("llama")
    ids, mask = left_padded(prompts())
    with pytest.raises(NotImplementedError, match="num_beams"):
        model.generate(ids, attention_mask=mask, num_beams=2, max_new_tokens=2, do_sample=False, pad_token_id=0,
                       cache=H2OCache(model, budget=24, recent=4))
    filled = H2OCache(model, budget=24, recent=4)
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=1, do_sample=False, pad_token_id=0, cache=filled)
    with pytest.raises(ValueError, match="holds one sequence"):
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0, cache=filled)
    with pytest.raises(ValueError, match="every row needs its own cache"):
        CacheRows([filled, filled])
    assert isinstance(CacheRows([filled]), Cache)


def test_cache_rows_over_filled_sessions_decode_as_each_alone():
    """What pace-serve does: sessions prefilled one by one, then decoded together, one step a forward."""
    model = tiny_model("gemma3")
    rows = prompts()
    sessions = [PACECache(model, BLUEPRINTS[r], budget=24, recent=4, limit=90) for r in range(4)]
    alone = [PACECache(model, BLUEPRINTS[r], budget=24, recent=4, limit=90) for r in range(4)]
    with torch.no_grad():
        firsts = []
        for p, a, b in zip(rows, sessions, alone):
            logits = model(p[None], cache=a).logits
            model(p[None], cache=b)
            firsts.append(logits[0, -1].argmax())
        tokens = torch.stack(firsts)[:, None]
        alone_tokens = tokens.clone()
        for _ in range(12):
            logits = model(tokens, cache=CacheRows(sessions)).logits
            tokens = logits[:, -1].argmax(-1, keepdim=True)
            for r in range(4):
                one = model(alone_tokens[r:r + 1], cache=alone[r]).logits
                torch.testing.assert_close(logits[r, -1], one[0, -1], atol=1e-4, rtol=0)
                alone_tokens[r] = one[0, -1].argmax()
        assert torch.equal(tokens, alone_tokens)
    for a, b in zip(sessions, alone):
        assert a.get_seq_length() == b.get_seq_length() and torch.equal(a.ledger()[0], b.ledger()[0])


def test_a_row_saves_and_resumes_as_the_session_run_alone():
    """Spill, save and resume of one row of a batch equal those of the same session run alone."""
    model = tiny_model("llama")
    rows = prompts()
    ids, mask = left_padded(rows)
    store = TieredStore([HostTier(1 << 30)])
    batch = PACECache(model, BLUEPRINTS, budget=24, recent=4, limit=90, store=store, session_id="b")
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, cache=batch, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    r = 1
    alone = PACECache(model, BLUEPRINTS[r], budget=24, recent=4, limit=90, store=store, session_id="alone")
    with torch.no_grad():
        model.generate(rows[r][None], cache=alone, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert batch.rows[r].spill.spilled_tokens == alone.spill.spilled_tokens > 0
    batch.rows[r].save(), alone.save()
    with pytest.raises(ValueError, match=r"cache.rows\[i\].save"):
        batch.save()
    resumed = [PACECache.resume(sid, store=store, model=model) for sid in ("b-row1", "alone")]
    for a, b in zip(resumed[0].layers, resumed[1].layers):  # the ledgers equal, the keys and scores to fp32 noise
        for (name, x), y in zip(a.tensors().items(), b.tensors().values()):
            if x.is_floating_point():
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(x, y), name
    token = torch.tensor([[7]])
    with torch.no_grad():
        for _ in range(6):  # both continue to the same logits, restoring and evicting as they go
            logits = [model(token, cache=c).logits[0, -1] for c in resumed]
            torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=0)
            token = logits[0].argmax().view(1, 1)


def test_pads_anywhere_in_a_row_are_dropped_not_only_on_the_left():
    """A mask with a gap inside a row (right padding, or a hole): the row is its tokens, in order, as alone."""
    model = tiny_model("llama")
    rows = prompts([50, 40])
    ids = torch.zeros(2, 60, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0, :20], ids[0, 30:60], mask[0, :20], mask[0, 30:60] = rows[0][:20], rows[0][20:], 1, 1  # a hole of 10
    ids[1, 20:60], mask[1, 20:60] = rows[1], 1
    cache = H2OCache(model, budget=24, recent=4)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, cache=cache).logits
    for r, p in enumerate(rows):
        alone = H2OCache(model, budget=24, recent=4)
        with torch.no_grad():
            expected = model(p[None], cache=alone).logits[0, -1]
        torch.testing.assert_close(logits[r, -1], expected, atol=1e-4, rtol=0)
        assert cache.rows[r].get_seq_length() == len(p)
        assert torch.equal(cache.rows[r].ledger()[0], alone.ledger()[0])


def test_a_right_padded_batch_is_refused_by_name_where_dynamic_cache_runs_it_wrong():
    """Right padding was taken silently and a row differed from its prompt run alone. DynamicCache does the
    same with it (generate continues a row that ends in pads from a pad's logits; only transformers' warning
    hints why), so pace_hf refuses it before any forward, naming the fix; pads on the left run as alone."""
    model = tiny_model("llama")
    rows = prompts([60, 45])
    ids = torch.zeros(2, 60, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(rows):
        ids[r, :len(p)], mask[r, :len(p)] = p, 1
    with torch.no_grad():
        dynamic = model.generate(ids, attention_mask=mask, **GREEDY)  # transformers' own DynamicCache
        alone = [model.generate(p[None], **GREEDY) for p in rows]
    torch.testing.assert_close(dynamic.scores[0][0], alone[0].scores[0][0], atol=1e-4, rtol=0)  # no pad: as alone
    assert (dynamic.scores[0][1] - alone[1].scores[0][0]).abs().max() > 0.1  # ends in pads: another continuation
    for make in CACHES.values():
        cache = make(model, None)
        with pytest.raises(ValueError, match=r"right-padded: row\(s\) 1 of attention_mask end in padding.*"
                                             r"tokenizer.padding_side = 'left'"):
            model.generate(ids, attention_mask=mask, cache=cache, **GREEDY)
        assert cache.get_seq_length() == 0  # refused before the first forward
    assert_rows_equal_alone(model, CACHES["h2o"], rows, None, [None, None])  # the same prompts, padded on the left


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_packed_rows_equal_each_row_alone(kind):
    """``CacheRows(..., packed=...)``: one row's prefill chunk and the other rows' decode tokens as one
    sequence (pace-serve's step) give each row the logits and the cache it gets alone, step after step,
    through evictions and a renumber."""
    model = tiny_model(kind)
    rows = prompts()
    make = CACHES["pace"]
    batched = [make(model, BLUEPRINTS[0]) for _ in rows]
    alone = [make(model, BLUEPRINTS[0]) for _ in rows]
    with torch.no_grad():
        for caches in (batched, alone):  # rows 1-3 prefilled; row 0 prefills in chunks of 16 in the packed steps
            for cache, p in zip(caches[1:], rows[1:]):
                model(p[None], cache=cache)
        nexts = [p[-1:] for p in rows]
        for step in range(12):  # four chunks of row 0's prompt beside three decoding rows, then all four decode
            parts = ([rows[0][16 * step:16 * step + 16]] if step < 4 else nexts[:1]) + nexts[1:]
            out = model(torch.cat(parts)[None], cache=CacheRows(batched, packed=[len(p) for p in parts])).logits[0]
            ends = torch.tensor([len(p) for p in parts]).cumsum(0) - 1
            for r, (cache, part) in enumerate(zip(alone, parts)):
                solo = model(part[None], cache=cache).logits[0, -1]
                torch.testing.assert_close(out[ends[r]], solo, atol=1e-5, rtol=0)
                nexts[r] = solo.argmax()[None]
    for a, b in zip(batched, alone):
        assert a.get_seq_length() == b.get_seq_length() and a.renumbers == b.renumbers
        for i, _ in a.evicting_layers:
            assert all(torch.equal(x, y) for x, y in zip(a.ledger(i), b.ledger(i))), i
    assert batched[2].renumbers >= 1 and all(c.resident_count() == 24 for c in batched)
    with pytest.raises(ValueError, match="packed rows hold"):
        model(torch.ones(1, 5, dtype=torch.long), cache=CacheRows(batched, packed=[1, 1, 1, 1]))
