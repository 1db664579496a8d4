"""PACECache and the baselines under plain model.generate (tiny random models, fp32, CPU)."""

import re
import types

import pytest
import torch
import transformers as tf
from conftest import assert_capped_gaps
from tiny_models import tiny_config, tiny_model

from pace_hf import (Blueprint, CumulativeAttention, Foresight, ForesightBonus, H2OCache, ObservationWindow, PACECache,
                     Recency, SnapKVCache, Span,
                     StreamingLLMCache)
from pace_hf.cache import keep_index
from pace_hf.rope import RotaryParams, rerotate, trained_positions

KINDS = ["llama", "qwen2", "qwen3", "mistral"]


def prompt(n, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
def test_full_equivalence_when_nothing_is_evicted(kind):
    model = tiny_model(kind)
    ids = prompt(300)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, cache=tf.DynamicCache(config=model.config), prefill_chunk_size=64)
    for cache in (PACECache(model, Blueprint([Span(0, 20, [1])]), budget=1024, limit=2048),
                  H2OCache(model, budget=1024)):
        out = model.generate(ids, max_new_tokens=24, do_sample=False, cache=cache, prefill_chunk_size=64)
        assert torch.equal(out, ref), type(cache).__name__
        assert cache.get_seq_length() == out.shape[1] - 1
    # sampled decoding and the new `cache=` argument
    torch.manual_seed(3)
    ref = model.generate(ids, max_new_tokens=16, do_sample=True, top_k=20, cache=tf.DynamicCache(config=model.config))
    torch.manual_seed(3)
    out = model.generate(ids, max_new_tokens=16, do_sample=True, top_k=20, cache=PACECache(model, budget=1024, limit=2048))
    assert torch.equal(out, ref)
    # the deprecated keyword (the only one before transformers 5.24) still works
    with pytest.warns(FutureWarning, match="past_key_values"):
        out = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=H2OCache(model, budget=1024), prefill_chunk_size=64)
    assert torch.equal(out[:, :ids.shape[1] + 8], model.generate(ids, max_new_tokens=8, do_sample=False))


def snapshot_layer0(model, cache, log):
    """After every forward (and its eviction), record layer 0's stored keys and ledger."""
    def hook(module, args, kwargs, output):
        layer = cache.layers[0]
        log.append((layer.keys[0].clone(), *(t.clone() for t in cache.ledger(0))))
    return model.model.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_renumbering_is_exact_after_100_renumbers(kind):
    model = tiny_model(kind)
    cache = PACECache(model, Blueprint([Span(40, 60, [2])]), budget=24, limit=30, recent=8)
    log = []
    handle = snapshot_layer0(model, cache, log)
    out = model.generate(prompt(400, seed=1), max_new_tokens=400, min_new_tokens=400, do_sample=False,
                         cache=cache, prefill_chunk_size=6)
    handle.remove()
    assert cache.renumbers >= 100
    # layer 0 keys depend on the token and its position only: take the model's own keys at logical positions
    full = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(out[:, :-1], cache=full)
    own = full.layers[0].keys[0]  # [kv_heads, N, head_dim] at logical positions 0..N-1
    params = RotaryParams.from_config(model.config)
    for keys, logical, physical in log:
        assert physical.max() < 30
        own_resident = own.gather(1, logical[:, :, None].expand(-1, -1, own.shape[-1]))
        expected = rerotate(own_resident, logical, physical, params)
        tol = (1e-5 + 6e-8 * logical.max().item()) * own.abs().max()
        assert (keys - expected).abs().max() <= tol


def test_renumbering_keeps_the_gaps_eviction_left_as_the_limit_allows():
    """H2O's kept set is spread over the whole context: renumbered, its gaps are capped, not collapsed to
    1. A roomy limit keeps more of each gap than a tight one; every full layer's newest resident sits
    just below the next position; decoding renumbers at most once in a quarter of the limit."""
    model = tiny_model("qwen2")
    ids = prompt(600, seed=3)
    caches = {limit: H2OCache(model, budget=48, recent=8, limit=limit) for limit in (96, 160, 400)}
    for limit, cache in caches.items():
        with torch.no_grad():
            for chunk in ids.split(40, dim=1):
                model(chunk, cache=cache)
            before = cache.renumbers
            token = ids[:, -1:]
            for _ in range(limit):
                model(token, cache=cache)
        assert cache.renumbers - before <= 5
        for i in range(len(cache.layers)):
            logical, physical = cache.ledger(i)
            assert_capped_gaps(logical, physical, limit)
            assert int(physical[:, -1].max()) == cache.next_position - 1
    spans = {limit: int((cache.ledger(0)[1][:, -1] - cache.ledger(0)[1][:, 0]).min()) for limit, cache in caches.items()}
    assert spans[96] < spans[160] < spans[400]
    logical = caches[400].ledger(0)[0]
    assert spans[400] > 47 and int((logical[:, -1] - logical[:, 0]).min()) > spans[400]  # gaps kept, and capped


def test_positions_stay_bounded_during_a_long_generate():
    model = tiny_model("qwen3")
    limit, budget, chunk = 96, 40, 32
    cache = PACECache(model, Blueprint([Span(5, 15, [1])]), budget=budget, limit=limit, recent=16)
    seen_positions, resident = [], []
    h1 = model.model.rotary_emb.register_forward_pre_hook(
        lambda m, args, kwargs: seen_positions.append(int(kwargs.get("position_ids", args[-1]).max())), with_kwargs=True)
    h2 = model.model.layers[-1].register_forward_hook(lambda m, a, o: resident.append(cache.layers[0].resident_count))
    model.generate(prompt(3 * limit, seed=2), max_new_tokens=limit, min_new_tokens=limit, do_sample=False,
                   cache=cache, prefill_chunk_size=chunk)
    h1.remove(), h2.remove()
    assert cache.get_seq_length() >= 4 * limit - 1
    assert max(seen_positions) < limit
    assert max(resident) <= budget + chunk
    assert cache.renumbers > 0


def test_h2o_scores_match_eager_attention_column_sums():
    model = tiny_model("qwen2")
    eager = tiny_model("qwen2", attn_implementation="eager")
    ids = prompt(96, seed=4)
    cache = H2OCache(model, budget=512)
    with torch.no_grad():
        for chunk in ids.split(32, dim=1):
            model(chunk, cache=cache)
        attn = eager(ids, output_attentions=True).attentions
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer_idx, probs in enumerate(attn):
        column_sums = probs[0].sum(dim=1)  # [q_heads, kv]
        expected = column_sums.reshape(-1, group, column_sums.shape[-1]).mean(dim=1)
        got = cache.layers[layer_idx].scores
        assert got.dtype == torch.float32
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def resident_logical(cache):
    return [set(cache.ledger(i)[0][h].tolist()) for i in range(len(cache.layers)) for h in range(cache.ledger(i)[0].shape[0])]


def test_foresight_keeps_planned_spans_until_their_last_reader():
    model = tiny_model("llama")
    span = range(200, 230)
    bp = Blueprint([Span(200, 230, readers=[2, 3])])
    pace = PACECache(model, bp, budget=64, limit=160, recent=16)
    h2o = H2OCache(model, budget=64, recent=16)
    ids = prompt(600, seed=5)
    for cache in (pace, h2o):
        cache.step = 1
        with torch.no_grad():
            for chunk in ids.split(32, dim=1):
                model(chunk, cache=cache)
    for heads in resident_logical(pace):  # planned span resident at the reader step, unplanned middle gone
        assert set(span) <= heads
        assert not (set(range(300, 500)) & heads)
    assert any(not set(span) <= heads for heads in resident_logical(h2o))
    # after the last reader the bonus is 0: eviction ranks exactly as H2O's scores alone would
    pace.step = 4
    assert pace.blueprint.bonus(torch.tensor([210]), 4, pace.bonus).item() == 0
    decisions = []
    h2o_only = CumulativeAttention()

    def probe(module, args, output):  # runs before the cache evicts at the end of the forward
        layer = pace.layers[0]
        with_bonus = keep_index(pace.scoring.priority(layer.logical, layer.scores, pace.step), pace.budget, pace.sinks,
                                pace.recent)
        kept = layer.logical.gather(1, with_bonus)
        span_kept = all(set(span) <= set(row.tolist()) for row in kept)
        without = keep_index(h2o_only.priority(layer.logical, layer.scores, pace.step), pace.budget, pace.sinks, pace.recent)
        decisions.append((pace.step, span_kept, torch.equal(with_bonus, without)))

    handle = model.model.layers[-1].register_forward_hook(probe)
    for step in (3, 4):  # step 3: the last reader is ahead, the bonus decides; step 4: it is gone
        pace.step = step
        with torch.no_grad():
            model(prompt(32, seed=step), cache=pace)
    handle.remove()
    assert decisions[0][1] and decisions[1][2]


def test_multi_turn_prefills_only_new_tokens():
    model = tiny_model("llama")
    cache = PACECache(model, budget=64, limit=160, recent=16)
    counted = []
    handle = model.model.embed_tokens.register_forward_hook(lambda m, args, out: counted.append(args[0].shape[1]))
    first = model.generate(prompt(200), max_new_tokens=10, min_new_tokens=10, do_sample=False, cache=cache, prefill_chunk_size=32)
    counted.clear()
    turn2 = torch.cat([first, prompt(50, seed=9)], dim=1)
    second = model.generate(turn2, max_new_tokens=10, min_new_tokens=10, do_sample=False, cache=cache, prefill_chunk_size=32)
    handle.remove()
    assert sum(counted) == 50 + 1 + 9  # the last generated token of turn 1, the new message, then decode
    assert second.shape[1] == turn2.shape[1] + 10


@pytest.mark.parametrize("chunk", [0, -16, 16.0, True])
def test_a_prefill_chunk_size_that_is_not_a_token_count_is_refused_before_any_forward(chunk):
    model = tiny_model("llama")
    cache = PACECache(model, budget=32, limit=80, recent=8)
    with pytest.raises(ValueError, match="prefill_chunk_size must be a whole number of tokens >= 1"):
        model.generate(prompt(100), max_new_tokens=2, do_sample=False, cache=cache, prefill_chunk_size=chunk)
    assert cache.get_seq_length() == 0


def test_a_numpy_prefill_chunk_size_is_a_token_count():
    """``np.int64(32)`` (from a config array, a sweep) is an integer: the same forwards as ``32``."""
    import numpy as np

    model = tiny_model("llama")
    outs = []
    for chunk in (32, np.int64(32)):
        counted = []
        cache = PACECache(model, budget=32, limit=80, recent=8)  # before the hook: binding probes the model once
        handle = model.model.embed_tokens.register_forward_hook(lambda m, args, out: counted.append(args[0].shape[1]))
        outs.append(model.generate(prompt(100), max_new_tokens=2, do_sample=False, cache=cache, prefill_chunk_size=chunk))
        handle.remove()
        assert counted == [32, 32, 32, 4, 1]
        cache.unbind()
    assert torch.equal(*outs)


def test_model_works_normally_after_a_pace_cache():
    model = tiny_model("llama")
    ids = prompt(100)
    before = model.generate(ids, max_new_tokens=8, do_sample=False)
    PACECache(model, budget=32, limit=80, recent=8)
    model.generate(ids, max_new_tokens=8, do_sample=False,
                   cache=PACECache(model, budget=32, limit=80, recent=8), prefill_chunk_size=16)
    after = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(before, after)


@pytest.mark.parametrize("make", [
    lambda m: SnapKVCache(m, budget=48, recent=8),
    lambda m: StreamingLLMCache(m, budget=48),
    lambda m: H2OCache(m, budget=48, limit=120, recent=8),  # positions-only
    lambda m: PACECache(m, Blueprint([Span(0, 10, [1])]), budget=48, recent=8, limit=None),  # retention-only
    lambda m: PACECache(m, Blueprint([Span(0, 10, [1])]), budget=48, recent=8, scorer=ObservationWindow()),
    lambda m: StreamingLLMCache(m, budget=48, limit=120),
])
def test_baselines_and_ablation_arms_run_under_generate(make):
    model = tiny_model("mistral")
    cache = make(model)
    out = model.generate(prompt(300), max_new_tokens=20, min_new_tokens=20, do_sample=False, cache=cache, prefill_chunk_size=32)
    assert out.shape[1] == 320
    assert cache.resident_count() == 48
    logical, physical = cache.ledger(0)
    assert (logical[:, :-1] < logical[:, 1:]).all()  # logical order per head
    if not cache.bounded:
        assert torch.equal(logical, physical)


def test_streaming_keeps_sinks_and_the_most_recent_tokens():
    model = tiny_model("llama")
    cache = StreamingLLMCache(model, budget=20, sinks=4)
    model.generate(prompt(100), max_new_tokens=5, do_sample=False, cache=cache, prefill_chunk_size=16)
    logical = cache.ledger(0)[0][0].tolist()
    assert logical == [0, 1, 2, 3] + list(range(104 - 16, 104))


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="end must be > start"):
        Span(10, 10, [1])
    with pytest.raises(ValueError, match=">= 0"):
        Span(-1, 5, [1])
    with pytest.raises(ValueError, match="reader"):
        Span(0, 5, [-2])
    with pytest.raises(TypeError, match="Span"):
        Blueprint([(0, 5, [1])])
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="sinks"):
        PACECache(model, budget=100, limit=400, sinks=4, recent=128)
    with pytest.raises(ValueError, match="limit"):
        PACECache(model, budget=256, limit=256, recent=16)
    torch.manual_seed(0)
    dynamic = tf.AutoModelForCausalLM.from_config(  # dynamic NTK switches past 128 positions: limit 160 is refused
        tf.LlamaConfig(**{**tiny_config("llama").to_dict(), "max_position_embeddings": 128,
                          "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}))
    with pytest.raises(ValueError, match="dynamic"):
        PACECache(dynamic, budget=64, limit=160, recent=16)


def test_a_refused_budget_or_limit_names_each_number_and_what_would_do():
    """A newcomer met ``(got 0, 4, 128)`` and could not tell which number was which, and ``limit 1024 must
    be at least budget 2048 plus the chunk size`` without knowing which chunk size or what limit would do."""
    from pace_hf.memory.retrieval import PageRetriever
    from pace_hf.memory.wing import KVMemory

    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"\(got budget=0, sinks=4, recent=128\)"):
        H2OCache(model, budget=0)
    with pytest.raises(ValueError, match=r"budget=100 cannot hold .* = 4 \+ 128 = 132 tokens.*recent=25, or budget >= 132"):
        PACECache(model, budget=100, limit=400)
    with pytest.raises(ValueError) as refused:
        PACECache(model, budget=2048, limit=1024)
    said = str(refused.value)
    assert "limit=1024" in said and "budget=2048" in said and "prefill_chunk_size" in said, said
    suggested = re.search(r"limit=(\d+) for prefill_chunk_size=(\d+)", said)
    assert int(suggested[1]) == 2048 + int(suggested[2]), said
    PACECache(model, budget=2048, limit=int(suggested[1])).unbind()  # what it suggests is taken
    cache = PACECache(model, budget=32, limit=48, recent=8)
    with torch.no_grad(), pytest.raises(ValueError, match=r"use limit >= 0 \+ 49 = 49, or prefill_chunk_size <= 48"):
        model(prompt(49), cache=cache)
    with pytest.raises(ValueError, match=r"got prefetch_steps=-1, spill_tokens=64\)"):
        KVMemory(prefetch_steps=-1)
    with pytest.raises(ValueError, match=r"got page_tokens=0, digest_tokens=16, overlap=0\)"):
        PageRetriever(None, page_tokens=0, overlap=0)
    with pytest.raises(ValueError, match=r"got window=0, kernel=7"):
        ObservationWindow(window=0)


def test_a_chunk_that_cannot_fit_under_the_limit_raises_and_loses_nothing():
    model = tiny_model("llama")
    cache = PACECache(model, budget=32, limit=64, recent=8)
    with torch.no_grad():
        model(prompt(30), cache=cache)
        before = (cache.get_seq_length(), cache.layers[0].keys.clone(), cache.ledger(0)[0].clone())
        with pytest.raises(ValueError, match="prefill_chunk_size"):
            model(prompt(40, seed=1), cache=cache)
        assert cache.get_seq_length() == before[0]
        assert torch.equal(cache.layers[0].keys, before[1]) and torch.equal(cache.ledger(0)[0], before[2])
        model(prompt(20, seed=1), cache=cache)  # a fitting chunk still works
    assert cache.get_seq_length() == 50


def test_beams_are_refused_clearly():
    """Batches run (tests/test_batch.py); beams would reorder rows that each keep their own tokens."""
    model = tiny_model("llama")
    with pytest.raises(NotImplementedError, match="num_beams"):
        model.generate(prompt(40), max_new_tokens=4, num_beams=2, do_sample=False, cache=H2OCache(model, budget=32, recent=8))


def test_dynamic_rope_is_refused_only_when_positions_are_bounded():
    torch.manual_seed(0)
    dynamic = tf.AutoModelForCausalLM.from_config(
        tf.LlamaConfig(**{**tiny_config("llama").to_dict(), "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}))
    for cache in (H2OCache(dynamic, budget=32, recent=8), SnapKVCache(dynamic, budget=32, recent=8),
                  StreamingLLMCache(dynamic, budget=32), PACECache(dynamic, budget=32, recent=8, limit=None)):
        out = dynamic.generate(prompt(80), max_new_tokens=4, do_sample=False, cache=cache, prefill_chunk_size=16)
        assert out.shape[1] == 84
        cache.unbind()


def test_layer_kinds_that_are_not_handled_are_refused_by_name():
    """Llama 4's chunked attention restarts at chunk boundaries of the positions: refused, naming it, and
    the model is left as loaded. (A RoPE that cannot be re-rotated exactly: see the dynamic-RoPE test.)"""
    config = tf.Llama4TextConfig(**{**tiny_config("llama").to_dict(), "head_dim": 16, "num_local_experts": 2,
                                    "intermediate_size_mlp": 128, "attention_chunk_size": 32, "pad_token_id": 0})
    assert "chunked_attention" in config.layer_types
    torch.manual_seed(0)
    llama4 = tf.AutoModelForCausalLM.from_config(config)
    for make in (lambda: H2OCache(llama4, budget=32, recent=8), lambda: PACECache(llama4, budget=32, recent=8, limit=96)):
        with pytest.raises(NotImplementedError, match="chunked_attention"):
            make()
    assert llama4.config._attn_implementation == "sdpa" and not llama4.model._forward_pre_hooks  # nothing left behind


@pytest.mark.parametrize("readers, error", [
    ([1.7], TypeError), ("12", TypeError), (5, TypeError), ([True], TypeError), ([-1], ValueError),
])
def test_span_readers_are_validated(readers, error):
    with pytest.raises(error, match="reader|step"):
        Span(0, 5, readers)


def test_boundary_inputs_get_specific_errors():
    with pytest.raises(TypeError, match="span start"):
        Span(0.0, 5, [1])
    with pytest.raises(TypeError, match="span end"):
        Blueprint.from_dicts([{"start": 0, "end": 5.9, "readers": [1]}])
    with pytest.raises(ValueError, match="'start' and 'end'"):
        Blueprint.from_dicts([{"start": 0}])
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="budget"):
        H2OCache(model, budget=64.0)
    with pytest.raises(TypeError, match="limit"):
        PACECache(model, budget=64, limit="256", recent=8)
    cache = PACECache(model, Blueprint([Span(0, 4, [1])]), budget=32, limit=96, recent=8)
    for bad, error in ((-1, ValueError), (1.5, TypeError), ("3", TypeError), (None, TypeError)):
        with pytest.raises(error, match="cache.step"):
            cache.step = bad
    assert cache.step == 0



def test_a_blueprint_takes_a_list_of_spans():
    for bad in (Span(0, 5, [1]), None, 3):
        with pytest.raises(TypeError, match="list of Span objects"):
            Blueprint(bad)



def test_store_must_be_a_tiered_store(tmp_path):
    from pace_hf.tiers import DiskTier

    model = tiny_model("llama")
    for bad in (DiskTier(tmp_path / "kv"), str(tmp_path / "kv")):  # a tier passed bare, or a path
        with pytest.raises(TypeError, match="store must be a pace_hf.tiers.TieredStore"):
            H2OCache(model, budget=32, recent=8, store=bad, session_id="s")
    assert not (tmp_path / "kv").exists() and model.config._attn_implementation == "sdpa"  # nothing bound


def test_bounded_positions_on_a_model_without_rotary_embeddings_name_the_fix():
    torch.manual_seed(0)
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256)).eval()
    with pytest.raises(ValueError, match="reads absolute positions.*with limit=None the cache keeps positions unbounded"):
        PACECache(gpt2, budget=32, limit=96, recent=8)
    out = gpt2.generate(prompt(80), max_new_tokens=2, do_sample=False, prefill_chunk_size=32,
                        cache=PACECache(gpt2, budget=32, limit=None, recent=8))
    assert out.shape[1] == 82


def test_a_filled_cache_refuses_another_model_and_kv_of_another_kind():
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    cache = PACECache(model, budget=32, limit=96, recent=8)
    with torch.no_grad():
        model(prompt(40), cache=cache)
    before = {k: v.clone() for k, v in cache.layers[0].tensors().items()}
    unchanged = lambda: cache.get_seq_length() == 40 and all(  # noqa: E731
        torch.equal(v, cache.layers[0].tensors()[k]) for k, v in before.items())
    cache.unbind()
    with pytest.raises(ValueError, match="holds 40 tokens of another model's KV.*reset"):
        cache.bind(other)  # same config, other weights: its KV means nothing to this model
    assert cache.binding is None and other.config._attn_implementation == "sdpa" and unchanged()
    cache.bind(model)
    model.to(torch.bfloat16)  # cast after the cache was filled
    with pytest.raises(ValueError, match="holds KV as torch.float32 .* now gives torch.bfloat16"), torch.no_grad():
        model(prompt(8, seed=1), cache=cache)
    assert unchanged()
    cache.reset()  # an empty cache takes the new kind
    with torch.no_grad():
        model(prompt(8, seed=1), cache=cache)
    assert cache.layers[0].keys.dtype == torch.bfloat16 and cache.get_seq_length() == 8
    cache.unbind()
    cache.reset()
    cache.bind(other)


def test_a_prompt_no_longer_than_what_the_cache_saw_gets_a_clear_error():
    model = tiny_model("llama")
    cache = PACECache(model, budget=32, limit=96, recent=8)
    ids = prompt(64)
    model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False, prefill_chunk_size=32)
    seen = cache.get_seq_length()
    with pytest.raises(ValueError, match=fr"already seen these 20 tokens \(it holds {seen}\).*conversation so far"):
        model.generate(ids[:, :20], cache=cache, max_new_tokens=3, do_sample=False, prefill_chunk_size=32)
    assert cache.get_seq_length() == seen and not cache.in_forward
    with pytest.raises(ValueError, match=f"no new tokens: this cache has seen {seen} tokens.*whole conversation"), torch.no_grad():
        model(ids[:, :0], cache=cache)  # a forward of nothing, not through generate
    assert cache.get_seq_length() == seen and not cache.in_forward


def test_reset_then_save_replaces_the_last_save(tmp_path):
    from pace_hf.tiers import DiskTier, TieredStore

    model = tiny_model("llama")
    store = TieredStore([DiskTier(tmp_path)])
    cache = PACECache(model, budget=32, limit=96, recent=8, store=store, session_id="s")
    with torch.no_grad():
        model(prompt(80), cache=cache)
        cache.save()
        cache.reset()  # the same writer starts over: not a second writer
        model(prompt(20, seed=1), cache=cache)
    cache.save()
    assert PACECache.resume("s", store=TieredStore([DiskTier(tmp_path)]), model=model).get_seq_length() == 20

def test_unbind_leaves_the_model_exactly_as_loaded():
    model, fresh = tiny_model("qwen2"), tiny_model("qwen2")
    ids = prompt(120, seed=7)

    def state(m):
        d = m.model
        return (m.config._attn_implementation, dict(d._forward_pre_hooks), dict(d._forward_hooks),
                sorted(k for k in m.__dict__ if k in ("generate", "_get_stopping_criteria")),
                hasattr(d, "_pace_hf_binding"))

    a = PACECache(model, budget=32, limit=96, recent=8)
    b = H2OCache(model, budget=32, recent=8)
    assert model.config._attn_implementation == "pace_attention"
    model.generate(ids, max_new_tokens=4, do_sample=False, cache=a, prefill_chunk_size=32)
    a.unbind()
    assert model.config._attn_implementation == "pace_attention"  # b still holds the model
    del b
    import gc
    gc.collect()
    assert state(model) == state(fresh)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)
    with H2OCache(budget=32, recent=8).bound_to(model) as c:
        model.generate(ids, max_new_tokens=2, do_sample=False, cache=c, prefill_chunk_size=32)
    assert state(model) == state(fresh)


def test_a_cache_used_on_a_model_it_is_not_bound_to_gets_a_clear_error():
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    stale = H2OCache(model, budget=32, recent=8)
    stale.unbind()
    live = H2OCache(model, budget=32, recent=8)  # another cache hooks the model again  # noqa: F841
    with pytest.raises(RuntimeError, match="unbound"):
        model.generate(prompt(40), max_new_tokens=2, cache=stale)
    foreign = H2OCache(other, budget=32, recent=8)
    with pytest.raises(RuntimeError, match="another model"):
        model.generate(prompt(40), max_new_tokens=2, cache=foreign)
    with pytest.raises(RuntimeError, match="not bound"):
        tiny_model("qwen2").generate(prompt(40), max_new_tokens=2, cache=H2OCache(budget=32, recent=8))


def test_max_length_reminder_is_dropped_only_for_bounded_caches(caplog):
    import logging

    from transformers.generation import stopping_criteria

    model = tiny_model("llama")
    model.config.max_position_embeddings = 64
    ids = prompt(100)

    def reminded(cache):
        stopping_criteria.logger.warning_once.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="transformers.generation.stopping_criteria"):
            model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache, prefill_chunk_size=16)
        return "predefined maximum length" in caplog.text

    assert not reminded(PACECache(model, budget=24, limit=48, recent=4))
    assert not reminded(PACECache(model, budget=24, recent=4))  # limit "auto": the model's 64 positions
    assert reminded(H2OCache(model, budget=24, recent=4))  # unbounded: positions pass 64
    assert reminded(PACECache(model, budget=24, limit=96, recent=4))  # limit above the maximum
    assert reminded(tf.DynamicCache(config=model.config))


def test_the_default_limit_is_the_models_trained_positions():
    """PACECache's ``limit="auto"`` reads the model's ``max_position_embeddings`` when it binds: the positions
    that reach RoPE stay below them, so every distance is one the model was trained on. Too few of them for
    the budget is refused by name, and a config that states none leaves positions unbounded."""
    model = tiny_model("llama")
    assert PACECache(model, budget=64, recent=8).limit == model.config.max_position_embeddings
    unbound = PACECache(budget=64, recent=8)
    assert unbound.limit == "auto" and unbound.bounded
    with unbound.bound_to(model):
        assert unbound.limit == model.config.max_position_embeddings

    model.config.max_position_embeddings = 96
    cache = PACECache(model, budget=24, recent=4)
    seen = []
    hook = model.model.rotary_emb.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(int(kwargs.get("position_ids", args[-1]).max())), with_kwargs=True)
    model.generate(prompt(150), max_new_tokens=8, do_sample=False, cache=cache, prefill_chunk_size=16)
    hook.remove()
    assert cache.limit == 96 and cache.renumbers >= 1 and max(seen) < 96
    cache.unbind()

    model.config.max_position_embeddings = 32
    with pytest.raises(ValueError, match="limit=32 \\(limit=\"auto\": the model's 32 trained positions\\) leaves no room "
                                         "above budget=64"):
        PACECache(model, budget=64, recent=8)
    assert model.config._attn_implementation != "pace_attention"  # a refused bind leaves the model as it was
    with pytest.raises(TypeError, match='limit must be an int, None \\(unbounded\\) or "auto", got \'8192\''):
        PACECache(model, budget=64, recent=8, limit="8192")
    assert trained_positions(types.SimpleNamespace(hidden_size=64)) is None  # "auto" leaves it unbounded


def test_public_readings():
    model = tiny_model("llama")
    cache = PACECache(model, Blueprint([Span(10, 20, [1])]), budget=32, limit=96, recent=8)
    cache.step = 1
    with torch.no_grad():
        for chunk in prompt(200).split(40, dim=1):
            model(chunk, cache=cache)
    assert cache.residency(range(10, 20)) == 1.0
    assert cache.residency(range(100, 150)) < 0.2
    logical, physical = cache.ledger(0)
    assert cache.rotary_gap(range(10, 20)) == cache.next_position - int(physical[logical == 10].min())
    assert cache.rotary_gap([]) is None and int(physical.max()) < 96 and cache.next_position <= 96
    assert cache.renumbers > 0
    for reading in (cache.residency, cache.rotary_gap):  # 10.5 would be read as position 10
        with pytest.raises(TypeError, match="positions are ints"):
            reading([10.5, 11.5])


def test_policies_keep_what_they_promise():
    # a hand-built attention pattern: scores and positions of 12 tokens, one head
    logical = torch.arange(12)[None]
    scores = torch.tensor([[9., 1, 1, 8, 1, 1, 7, 1, 1, 1, 1, 1]])

    kept = lambda policy, budget: keep_index(policy.priority(logical, scores, 0), budget, 1, 2)[0].tolist()  # noqa: E731
    assert kept(CumulativeAttention(), 5) == [0, 3, 6, 10, 11]  # heavy hitters + sink + recent
    assert kept(Recency(), 5) == [0, 8, 9, 10, 11]
    pooled = ObservationWindow(window=4, kernel=3).accumulate(torch.zeros_like(scores), scores)
    assert pooled[0].tolist() == [9, 9, 8, 8, 8, 7, 7, 7, 1, 1, 1, 1]  # a heavy token keeps its neighbours
    assert ObservationWindow(window=4).query_window(100) == 4
    bp = Blueprint([Span(7, 9, [3])])
    assert kept(Foresight(CumulativeAttention(), bp), 5) == [0, 7, 8, 10, 11]
    assert kept(Foresight(Recency(), bp), 5) == [0, 7, 8, 10, 11]


@pytest.mark.parametrize("n, budget", [(4097, 4096), (300, 290), (300, 150), (300, 40), (64, 64)])
def test_keep_index_keeps_the_top_budget_tokens_whichever_side_it_counts_from(n, budget):
    # decode drops few tokens (it picks them), a prefill chunk drops many (it picks what stays); both
    # must give the sorted top-`budget` set, the protected sinks and recent tokens in it
    g = torch.Generator().manual_seed(n + budget)
    priority = torch.rand(3, n, generator=g)
    protected = torch.cat([torch.arange(2), torch.arange(n - 8, n)])
    top = priority.clone()
    top[:, protected] = float("inf")
    expected = top.topk(budget, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(keep_index(priority, budget, 2, 8), expected)


def test_foresight_bonus_formula():
    bonus = ForesightBonus(phi=1e5)
    assert bonus(5, 5) == 1e5  # the reader is now
    assert bonus(6, 5) == 0.75e5
    assert bonus(14, 5) == pytest.approx(1e5 * (1 + 1 / 10) / 2)
    assert all(bonus(5 + d, 5) > bonus(6 + d, 5) > 0.5e5 for d in range(100))  # decreasing, above the floor
    bp = Blueprint([Span(0, 4, [2, 6])])
    values = [bp.bonus(torch.tensor([1]), t, bonus).item() for t in range(8)]
    assert values[:3] == pytest.approx([bonus(2, 0), bonus(2, 1), 1e5]) and values[3] == pytest.approx(bonus(6, 3))
    assert values[7] == 0
    with pytest.raises(ValueError, match="phi"):
        ForesightBonus(phi=0)


def ledgers_after_every_forward(model, cache, log):
    """After every forward (and its eviction), record every layer's per-token tensors."""
    def hook(module, args, kwargs, output):
        log.append([{k: v.clone() for k, v in layer.tensors().items()} for layer in cache.layers])
    return model.model.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("make", [
    lambda: H2OCache(budget=40, recent=8),
    lambda: PACECache(blueprint=Blueprint([Span(30, 50, [1]), Span(100, 140, [1])]), budget=40, limit=80, recent=8),  # renumbers
    lambda: SnapKVCache(budget=40, recent=8),  # max-pooled scores: ties, so the order topk sees matters
])
def test_in_place_eviction_keeps_exactly_what_plain_compaction_keeps(make):
    from pace_hf.cache import CompactingLayer, EvictingLayer

    model = tiny_model("qwen2")
    runs = []
    for layer_class in (EvictingLayer, CompactingLayer):
        cache = make()
        cache.layer_class = layer_class
        cache.bind(model)
        log = []
        handle = ledgers_after_every_forward(model, cache, log)
        out = model.generate(prompt(150, seed=11), max_new_tokens=160, min_new_tokens=160, do_sample=False,
                             cache=cache, prefill_chunk_size=32)
        handle.remove()
        cache.unbind()
        assert all(type(layer) is layer_class for layer in cache.layers)
        runs.append((out, log, cache))
    (out, log, cache), (ref_out, ref_log, ref_cache) = runs
    assert torch.equal(out, ref_out)
    assert len(log) == len(ref_log) == 5 + 159  # 5 prefill chunks, then one forward per later token
    for step, (layers, ref_layers) in enumerate(zip(log, ref_log)):  # kept sets, keys, scores: bit for bit
        for layer, ref in zip(layers, ref_layers):
            assert layer.keys() == ref.keys()
            for name in layer:
                assert torch.equal(layer[name], ref[name]), (step, name)
    assert cache.renumbers == ref_cache.renumbers
    if cache.bounded:
        assert cache.renumbers > 5
    # in place: the buffers were not reallocated during decode, and an eviction moved few tokens
    layer = cache.layers[0]
    assert layer.capacity <= 40 + 32 and layer.keys.untyped_storage().nbytes() == layer._buffers["keys"].untyped_storage().nbytes()


def test_reset_forgets_every_token():
    model = tiny_model("llama")
    ids = prompt(120, seed=3)
    fresh = PACECache(model, Blueprint([Span(10, 20, [1])]), budget=32, limit=96, recent=8)
    want = model.generate(ids, max_new_tokens=12, do_sample=False, cache=fresh, prefill_chunk_size=16)
    cache = PACECache(model, Blueprint([Span(10, 20, [1])]), budget=32, limit=96, recent=8)
    model.generate(prompt(200, seed=4), max_new_tokens=5, do_sample=False, cache=cache, prefill_chunk_size=16)
    assert cache.get_seq_length() > 0 and cache.renumbers > 0
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.resident_count() == 0 and cache.next_position == 0
    assert cache.renumbers == 0 and cache.step == 0
    again = model.generate(ids, max_new_tokens=12, do_sample=False, cache=cache, prefill_chunk_size=16)
    assert torch.equal(again, want)
    assert cache.get_seq_length() == fresh.get_seq_length() and torch.equal(cache.ledger(0)[0], fresh.ledger(0)[0])


@pytest.mark.parametrize("drops", [1, 2, 3, 40])  # runs over 3 heads: 3, 6 (slices), 9, many (rows)
def test_keep_moves_runs_by_slices_or_rows_to_what_compaction_keeps(drops):
    # few runs of moved tokens go by slices (decode), many by a gather and scatter (a prefill chunk);
    # both must leave every per-token tensor as plain compaction does, for every head
    from pace_hf.cache import CompactingLayer, EvictingLayer

    g = torch.Generator().manual_seed(drops)
    keys, values = torch.randn(1, 3, 200, 8, generator=g), torch.randn(1, 3, 200, 8, generator=g)
    layers = [cls(True, 200 - drops) for cls in (EvictingLayer, CompactingLayer)]
    for layer in layers:
        layer.update(keys, values, logical_start=0, physical_start=0)
        layer.scores.copy_(torch.rand(3, 200, generator=torch.Generator().manual_seed(7)))
    index = keep_index(layers[0].scores, 200 - drops, 2, 4)
    evicted = [layer.keep(index) for layer in layers]
    for name, t in layers[0].tensors().items():
        assert torch.equal(t, layers[1].tensors()[name]), name
    assert all(torch.equal(evicted[0][k], evicted[1][k]) for k in evicted[0])
    assert layers[0].moved == int(sum((200 - drops) - int((row != torch.arange(200 - drops)).int().argmax())
                                      for row in index if (row != torch.arange(200 - drops)).any()))


def test_a_decode_eviction_finds_each_heads_run_from_the_rank_it_dropped():
    """One token a head goes (decode): its run starts at the dropped rank, which the kept index's sum lacks;
    the last token dropped means no run at all. As plain compaction keeps, per head."""
    from pace_hf.cache import CompactingLayer, EvictingLayer

    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(1, 3, 50, 8, generator=g), torch.randn(1, 3, 50, 8, generator=g)
    layers = [cls(True, 49) for cls in (EvictingLayer, CompactingLayer)]
    for layer in layers:
        layer.update(keys, values, logical_start=0, physical_start=0)
    gone = [49, 20, 0]  # the last, one inside, the first
    index = torch.stack([torch.tensor([p for p in range(50) if p != d]) for d in gone])
    evicted = [layer.keep(index) for layer in layers]
    for name, t in layers[0].tensors().items():
        assert torch.equal(t, layers[1].tensors()[name]), name
    assert evicted[0]["logical"].tolist() == gone and all(torch.equal(evicted[0][k], evicted[1][k]) for k in evicted[0])
    assert layers[0].moved == 0 + 29 + 49
    assert torch.equal(keep_index(torch.tensor([[5.0, 1.0, 3.0, 0.5]]), 3, 0, 0), torch.tensor([[0, 1, 2]]))


@pytest.mark.parametrize("limit", [None, 96])
def test_a_held_prompt_is_compressed_once_by_its_question(limit):
    """holding(): a prompt prefilled in chunks keeps every token, and the forward after the block (the
    question) compresses it as SnapKV compresses a prompt prefilled in one forward: its observation
    window is the question. A bounded cache renumbers at once, so the answer's queries are in bounds."""
    model = tiny_model("qwen2")
    ids = prompt(240, seed=4)
    context, question = ids[:, :200], ids[:, 200:]
    whole = SnapKVCache(model, budget=48, recent=8)
    with torch.no_grad():
        model(ids, cache=whole)
    held = SnapKVCache(model, budget=48, recent=8, limit=limit)
    with torch.no_grad(), held.holding():
        for s in range(0, 200, 50):
            model(context[:, s:s + 50], cache=held)
        assert held.resident_count() == 200  # nothing evicted inside the block
    with torch.no_grad():
        model(question, cache=held)
    for i in range(len(whole.layers)):
        assert torch.equal(held.ledger(i)[0], whole.ledger(i)[0]), i
    # chunked without holding, each chunk's end chose: another selection (the question came too late)
    chunked = SnapKVCache(model, budget=48, recent=8)
    with torch.no_grad():
        for s in range(0, 240, 40):
            model(ids[:, s:s + 40], cache=chunked)
    assert not torch.equal(chunked.ledger(0)[0], whole.ledger(0)[0])
    if limit is not None:  # laid out again right after compressing: the answer's queries are in bounds
        logical, physical = held.ledger(0)
        assert_capped_gaps(logical, physical, limit)
        assert held.rotary_gap(range(240)) <= held.next_position <= limit - limit // 4
    turn = torch.cat([ids, prompt(8, seed=5)], dim=1)  # and a next turn decodes on
    out = model.generate(turn, max_new_tokens=4, min_new_tokens=4, do_sample=False, cache=held)
    assert out.shape[1] == 252 and held.resident_count() == 48 and held.get_seq_length() == 251


def test_holding_refuses_a_nested_hold_and_a_save_before_the_compressing_forward(tmp_path):
    from pace_hf.tiers import DiskTier, TieredStore

    model = tiny_model("qwen2")
    cache = SnapKVCache(model, budget=48, recent=8, store=TieredStore([DiskTier(tmp_path)]), session_id="s")
    with torch.no_grad(), cache.holding():
        model(prompt(100), cache=cache)
        with pytest.raises(RuntimeError, match="another hold"), cache.holding():
            pass
    with pytest.raises(RuntimeError, match="not yet compressed"):
        cache.save()
    with torch.no_grad():
        model(prompt(40, seed=1), cache=cache)
    assert cache.resident_count() == 48 and cache.tier_stats["spilled_tokens"] > 0
    cache.save()
    with cache.holding():  # a hold with nothing over the budget leaves nothing pending
        pass
    cache.save()


def test_a_repeated_or_edited_prompt_is_refused_not_prefilled_again():
    """A re-run notebook cell or a retried turn gives generate the same prompt again: the cache would
    prefill it on top of itself (515 -> 1,023 tokens seen) and answer differently. Refused, naming why;
    an edited earlier token is refused too (its old KV would be reused); a continuation goes on."""
    model = tiny_model("llama")
    ids = prompt(200)
    cache = PACECache(model, budget=64, limit=400, recent=16)
    out = model.generate(ids, cache=cache, max_new_tokens=5, do_sample=False, prefill_chunk_size=64)
    seen = cache.get_seq_length()
    for again in (ids, ids[:, :150], out[:, :-1]):
        with pytest.raises(ValueError, match="already seen these"):
            model.generate(again, cache=cache, max_new_tokens=5, do_sample=False)
    edited = out.clone()
    edited[0, 17] = (edited[0, 17] + 1) % 128
    with pytest.raises(ValueError, match="differs from what this cache holds at token 17"):
        model.generate(torch.cat([edited, prompt(5, seed=1)], 1), cache=cache, max_new_tokens=5, do_sample=False)
    assert cache.get_seq_length() == seen  # nothing was prefilled by the refused calls
    more = model.generate(torch.cat([out, prompt(5, seed=1)], 1), cache=cache, max_new_tokens=5, do_sample=False)
    assert cache.get_seq_length() == more.shape[1] - 1
    cache.reset()
    assert model.generate(ids, cache=cache, max_new_tokens=5, do_sample=False).shape[1] == 205  # a reset cache starts over


def test_a_compiled_model_gets_pace_hfs_own_error():
    """torch.compile(model.forward) crashed deep inside torch ('sources must not be empty for symbol'),
    with a large log: now a bound cache says it does not run compiled, at bind and at generate."""
    model = tiny_model("llama")
    cache = PACECache(model, budget=64, limit=400, recent=16)
    model.forward = torch.compile(model.forward, backend="eager")
    with pytest.raises(NotImplementedError, match="do not run under torch.compile"):
        model.generate(prompt(50), cache=cache, max_new_tokens=3, do_sample=False)
    assert cache.get_seq_length() == 0
    with pytest.raises(NotImplementedError, match="do not run under torch.compile"):
        H2OCache(model, budget=64, recent=16)
    del model.forward  # uncompiled again: it runs
    assert model.generate(prompt(50), cache=cache, max_new_tokens=3, do_sample=False).shape[1] == 53


def test_pace_cache_takes_the_model_first_and_the_old_order_still_works_with_a_warning():
    """PACECache(model, blueprint) as every other cache takes its model; PACECache(blueprint, model) (and
    PACECache(blueprint, model=...), PACECache(None, model)) builds the same cache for one more release,
    with a DeprecationWarning pointing at the caller; a model or blueprint given twice is a TypeError."""
    import warnings

    model = tiny_model("llama")
    bp = Blueprint([Span(0, 10, [1])])
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))

    def logits(cache):
        with torch.no_grad():
            out = model(ids, cache=cache, use_cache=True).logits
        cache.unbind()
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected = logits(PACECache(model, bp, budget=32, limit=96, recent=8))
        assert torch.equal(logits(PACECache(model=model, blueprint=bp, budget=32, limit=96, recent=8)), expected)
    for old in (lambda: PACECache(bp, model, budget=32, limit=96, recent=8),
                lambda: PACECache(bp, model=model, budget=32, limit=96, recent=8)):
        with pytest.warns(DeprecationWarning, match="model comes first") as caught:
            cache = old()
        assert caught[0].filename == __file__ and cache.scoring.blueprint is bp
        assert torch.equal(logits(cache), expected)
    with pytest.warns(DeprecationWarning):
        PACECache(None, model, budget=32, limit=96, recent=8).unbind()
    for twice in (lambda: PACECache(model, bp, blueprint=bp), lambda: PACECache(model, model=model),
                  lambda: PACECache(bp, model, model=model), lambda: PACECache(model, bp, 3)):
        with pytest.raises(TypeError):
            twice()


def test_the_bonus_table_gives_every_token_its_largest_spans_bonus():
    """``Blueprint.bonus`` (one table per step, a searchsorted per call) against the plain per-span pass,
    on random overlapping spans, steps before, between and after readers, and a span added mid-step."""
    g = torch.Generator().manual_seed(3)
    bonus = ForesightBonus()

    def plain(blueprint, logical, step):
        out = torch.zeros(logical.shape, dtype=torch.float32)
        for span in blueprint.spans:
            reader = span.next_reader(step)
            if reader is not None:
                inside = (logical >= span.start) & (logical < span.end)
                out = torch.where(inside, out.clamp_min(float(bonus(reader, step))), out)
        return out

    for _ in range(20):
        spans = []
        for _ in range(int(torch.randint(1, 12, (1,), generator=g))):
            start = int(torch.randint(0, 300, (1,), generator=g))
            length = int(torch.randint(1, 80, (1,), generator=g))
            readers = sorted({int(r) for r in torch.randint(0, 10, (3,), generator=g)})
            spans.append(Span(start, start + length, readers))
        bp = Blueprint(spans)
        logical = torch.randint(0, 400, (2, 257), generator=g)
        for step in range(0, 11, 2):
            assert torch.equal(bp.bonus(logical, step, bonus), plain(bp, logical, step))
            assert torch.equal(bp.bonus(logical[:, :100], step, bonus), plain(bp, logical[:, :100], step))
        bp.add(Span(0, 400, [10]))  # a span planned later: the cached table must not hide it
        assert torch.equal(bp.bonus(logical, 10, bonus), plain(bp, logical, 10))
    assert torch.equal(Blueprint().bonus(logical, 0, bonus), torch.zeros(logical.shape))
