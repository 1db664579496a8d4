"""PACECache and the baselines under plain model.generate (tiny random models, fp32, CPU)."""

import pytest
import torch
import transformers as tf
from tiny_models import tiny_config, tiny_model

from pace_hf import Blueprint, H2OCache, PACECache, SnapKVCache, Span, StreamingLLMCache
from pace_hf.rope import RotaryParams, rerotate

KINDS = ["llama", "qwen2", "qwen3", "mistral"]


def prompt(n, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
def test_full_equivalence_when_nothing_is_evicted(kind):
    model = tiny_model(kind)
    ids = prompt(300)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=tf.DynamicCache(config=model.config), prefill_chunk_size=64)
    for cache in (PACECache(Blueprint([Span(0, 20, [1])]), model=model, budget=1024, limit=2048),
                  H2OCache(model, budget=1024)):
        out = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=cache, prefill_chunk_size=64)
        assert torch.equal(out, ref), type(cache).__name__
        assert cache.get_seq_length() == out.shape[1] - 1
    # sampled decoding and the new `cache=` argument
    torch.manual_seed(3)
    ref = model.generate(ids, max_new_tokens=16, do_sample=True, top_k=20, cache=tf.DynamicCache(config=model.config))
    torch.manual_seed(3)
    out = model.generate(ids, max_new_tokens=16, do_sample=True, top_k=20, cache=PACECache(Blueprint(), model=model, budget=1024, limit=2048))
    assert torch.equal(out, ref)


def snapshot_layer0(model, cache, log):
    """After every forward (and its eviction), record layer 0's stored keys and ledger."""
    def hook(module, args, kwargs, output):
        layer = cache.layers[0]
        log.append((layer.keys[0].clone(), *(t.clone() for t in cache.ledger(0))))
    return model.model.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_renumbering_is_exact_after_100_renumbers(kind):
    model = tiny_model(kind)
    cache = PACECache(Blueprint([Span(40, 60, [2])]), model=model, budget=24, limit=30, recent=8)
    log = []
    handle = snapshot_layer0(model, cache, log)
    out = model.generate(prompt(400, seed=1), max_new_tokens=400, min_new_tokens=400, do_sample=False,
                         past_key_values=cache, prefill_chunk_size=6)
    handle.remove()
    assert cache.renumbers >= 100
    # layer 0 keys depend on the token and its position only: take the model's own keys at logical positions
    full = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(out[:, :-1], past_key_values=full)
    own = full.layers[0].keys[0]  # [kv_heads, N, head_dim] at logical positions 0..N-1
    params = RotaryParams.from_config(model.config)
    for keys, logical, physical in log:
        assert physical.max() < 30
        own_resident = own.gather(1, logical[:, :, None].expand(-1, -1, own.shape[-1]))
        expected = rerotate(own_resident, logical, physical, params)
        tol = (1e-5 + 6e-8 * logical.max().item()) * own.abs().max()
        assert (keys - expected).abs().max() <= tol


def test_positions_stay_bounded_during_a_long_generate():
    model = tiny_model("qwen3")
    limit, budget, chunk = 96, 40, 32
    cache = PACECache(Blueprint([Span(5, 15, [1])]), model=model, budget=budget, limit=limit, recent=16)
    seen_positions, resident = [], []
    h1 = model.model.rotary_emb.register_forward_pre_hook(
        lambda m, args, kwargs: seen_positions.append(int(kwargs.get("position_ids", args[-1]).max())), with_kwargs=True)
    h2 = model.model.layers[-1].register_forward_hook(lambda m, a, o: resident.append(cache.layers[0].stored))
    model.generate(prompt(3 * limit, seed=2), max_new_tokens=limit, min_new_tokens=limit, do_sample=False,
                   past_key_values=cache, prefill_chunk_size=chunk)
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
            model(chunk, past_key_values=cache)
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
    pace = PACECache(bp, model=model, budget=64, limit=160, recent=16)
    h2o = H2OCache(model, budget=64, recent=16)
    ids = prompt(600, seed=5)
    for cache in (pace, h2o):
        cache.step = 1
        with torch.no_grad():
            for chunk in ids.split(32, dim=1):
                model(chunk, past_key_values=cache)
    for heads in resident_logical(pace):  # planned span resident at the reader step, unplanned middle gone
        assert set(span) <= heads
        assert not (set(range(300, 500)) & heads)
    assert any(not set(span) <= heads for heads in resident_logical(h2o))
    # after the last reader the bonus is 0: eviction ranks exactly as H2O's scores alone would
    pace.step = 4
    assert pace.blueprint.bonus(torch.tensor([210]), 4, pace.bonus).item() == 0
    decisions = []

    def probe(module, args, output):  # runs before the cache evicts at the end of the forward
        layer = pace.layers[0]
        with_bonus = pace._keep_index(layer)
        kept = layer.logical.gather(1, with_bonus)
        span_kept = all(set(span) <= set(row.tolist()) for row in kept)
        pace.foresight = False
        decisions.append((pace.step, span_kept, torch.equal(with_bonus, pace._keep_index(layer))))
        pace.foresight = True

    handle = model.model.layers[-1].register_forward_hook(probe)
    for step in (3, 4):  # step 3: the last reader is ahead, the bonus decides; step 4: it is gone
        pace.step = step
        with torch.no_grad():
            model(prompt(32, seed=step), past_key_values=pace)
    handle.remove()
    assert decisions[0][1] and decisions[1][2]


def test_multi_turn_prefills_only_new_tokens():
    model = tiny_model("llama")
    cache = PACECache(Blueprint(), model=model, budget=64, limit=160, recent=16)
    counted = []
    handle = model.model.embed_tokens.register_forward_hook(lambda m, args, out: counted.append(args[0].shape[1]))
    first = model.generate(prompt(200), max_new_tokens=10, min_new_tokens=10, do_sample=False, past_key_values=cache, prefill_chunk_size=32)
    counted.clear()
    turn2 = torch.cat([first, prompt(50, seed=9)], dim=1)
    second = model.generate(turn2, max_new_tokens=10, min_new_tokens=10, do_sample=False, past_key_values=cache, prefill_chunk_size=32)
    handle.remove()
    assert sum(counted) == 50 + 1 + 9  # the last generated token of turn 1, the new message, then decode
    assert second.shape[1] == turn2.shape[1] + 10


def test_model_works_normally_after_a_pace_cache():
    model = tiny_model("llama")
    ids = prompt(100)
    before = model.generate(ids, max_new_tokens=8, do_sample=False)
    PACECache(Blueprint(), model=model, budget=32, limit=80, recent=8)
    model.generate(ids, max_new_tokens=8, do_sample=False,
                   past_key_values=PACECache(Blueprint(), model=model, budget=32, limit=80, recent=8), prefill_chunk_size=16)
    after = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(before, after)


@pytest.mark.parametrize("make", [
    lambda m: SnapKVCache(m, budget=48, recent=8),
    lambda m: StreamingLLMCache(m, budget=48),
    lambda m: PACECache(Blueprint([Span(0, 10, [1])]), model=m, budget=48, limit=120, recent=8, foresight=False),
    lambda m: PACECache(Blueprint([Span(0, 10, [1])]), model=m, budget=48, recent=8, foresight=True, bounded=False),
])
def test_baselines_and_ablation_arms_run_under_generate(make):
    model = tiny_model("mistral")
    cache = make(model)
    out = model.generate(prompt(300), max_new_tokens=20, min_new_tokens=20, do_sample=False, past_key_values=cache, prefill_chunk_size=32)
    assert out.shape[1] == 320
    assert cache.resident_count() == 48
    logical, physical = cache.ledger(0)
    assert (logical[:, :-1] < logical[:, 1:]).all()  # logical order per head
    if not cache.bounded:
        assert torch.equal(logical, physical)


def test_streaming_keeps_sinks_and_the_most_recent_tokens():
    model = tiny_model("llama")
    cache = StreamingLLMCache(model, budget=20, sinks=4)
    model.generate(prompt(100), max_new_tokens=5, do_sample=False, past_key_values=cache, prefill_chunk_size=16)
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
        PACECache(Blueprint(), model=model, budget=100, limit=400, sinks=4, recent=128)
    with pytest.raises(ValueError, match="limit"):
        PACECache(Blueprint(), model=model, budget=256, limit=256, recent=16)
    torch.manual_seed(0)
    dynamic = tf.AutoModelForCausalLM.from_config(
        tf.LlamaConfig(**{**tiny_config("llama").to_dict(), "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}))
    with pytest.raises(ValueError, match="dynamic"):
        PACECache(Blueprint(), model=dynamic, budget=64, limit=160, recent=16)


def test_a_chunk_that_cannot_fit_under_the_limit_raises_and_loses_nothing():
    model = tiny_model("llama")
    cache = PACECache(Blueprint(), model=model, budget=32, limit=64, recent=8)
    with torch.no_grad():
        model(prompt(30), past_key_values=cache)
        before = (cache.get_seq_length(), cache.layers[0].keys.clone(), cache.ledger(0)[0].clone())
        with pytest.raises(ValueError, match="prefill_chunk_size"):
            model(prompt(40, seed=1), past_key_values=cache)
        assert cache.get_seq_length() == before[0]
        assert torch.equal(cache.layers[0].keys, before[1]) and torch.equal(cache.ledger(0)[0], before[2])
        model(prompt(20, seed=1), past_key_values=cache)  # a fitting chunk still works
    assert cache.get_seq_length() == 50


def test_batches_and_beams_are_refused_clearly():
    model = tiny_model("llama")
    with pytest.raises(NotImplementedError, match="batch"):
        model.generate(prompt(40).repeat(2, 1), max_new_tokens=2, past_key_values=H2OCache(model, budget=32, recent=8))
    with pytest.raises(NotImplementedError, match="num_beams"):
        model.generate(prompt(40), max_new_tokens=4, num_beams=2, do_sample=False, past_key_values=H2OCache(model, budget=32, recent=8))
