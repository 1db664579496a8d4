"""Multi-head latent attention (DeepSeek V3) under every pace_hf cache: tiny random model, fp32, CPU.

The model caches ``(latent, k_rot)`` per token, shared by every head; only ``k_rot`` carries a position
(``pace_hf.cache.latent``). DeepSeek V3's own RoPE is used: YaRN with an mscale (stored keys already carry its
attention scaling) and interleaved pairs de-interleaved before rotation.
"""

import pytest
import torch
import transformers as tf
from census import greedy, renumbered_keys_are_the_models_own, same

from pace_hf import H2OCache, PACECache, SnapKVCache, StreamingLLMCache

RANK, ROPE = 16, 8  # kv_lora_rank, qk_rope_head_dim


def deepseek(attn_implementation="sdpa"):
    config = tf.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=RANK, q_lora_rank=32,
        qk_rope_head_dim=ROPE, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=16384,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation).eval()


@pytest.fixture(scope="module")
def model():
    return deepseek()


def ids(n, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_every_cache_with_nothing_evicted_is_dynamic_cache(model):
    """Budget above the length: greedy tokens and every step's scores equal DynamicCache's, for each cache kind
    (PACE bounded), and the layers hold one latent and one rotary key per token, the reference only of the latter."""
    ref = greedy(model, ids(40), tf.DynamicCache(config=model.config), new=4, chunk=16)
    for cache in (H2OCache(model, budget=256), SnapKVCache(model, budget=256), StreamingLLMCache(model, budget=256),
                  PACECache(model, budget=256, limit=512)):
        assert cache.layout == ["full:mla", "full:mla"], cache.layout
        assert same(greedy(model, ids(40), cache, new=4, chunk=16), ref), type(cache).__name__
        layer = cache.layers[0]
        assert layer.keys.shape == (1, 1, 43, ROPE) and layer.values.shape == (1, 1, 43, RANK)
        assert layer.ref_keys is None or layer.ref_keys.shape[-1] == ROPE  # no reference of the latent
        cache.unbind()


def test_scores_are_the_models_attention_averaged_over_heads(model):
    """A token's score is the mean over the heads of the probability mass eager attention gives it."""
    eager = deepseek("eager")
    prompt = ids(48, seed=3)
    cache = H2OCache(model, budget=512)
    with torch.no_grad():
        for chunk in prompt.split(16, dim=1):
            model(chunk, cache=cache)
        attn = eager(prompt, output_attentions=True).attentions
    for i, probs in enumerate(attn):
        expected = probs[0].sum(dim=1).mean(dim=0, keepdim=True)  # [1, kv]: one score per token for every head
        torch.testing.assert_close(cache.layers[i].scores, expected, atol=1e-4, rtol=0)
    cache.unbind()


def test_bounded_positions_reproduce_the_models_rotary_keys(model):
    """H2O under limit, with eviction and renumbers: positions reaching RoPE stay below limit, one budget per
    token holds for every head, and layer 0's resident k_rot equals a plain forward's at the new positions
    (atol 1e-5), its latents unchanged."""
    limit = 48
    cache = H2OCache(model, budget=24, recent=8, limit=limit)
    seen = []
    hook = model.model.rotary_emb.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(int(kwargs.get("position_ids", args[-1]).max())), with_kwargs=True)
    out = model.generate(ids(120, seed=1), max_new_tokens=8, min_new_tokens=8, do_sample=False, cache=cache,
                         prefill_chunk_size=12, pad_token_id=0)
    hook.remove()
    assert cache.renumbers >= 3 and max(seen) < limit
    logical, physical = cache.ledger(0)
    assert logical.shape == (1, 24)  # one row: evicted per token, for every head at once
    own = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=out[:, logical[0]], position_ids=physical, cache=own)
    layer = cache.layers[0]
    torch.testing.assert_close(layer.keys, own.layers[0].values, atol=1e-5, rtol=0)  # k_rot at the new positions
    torch.testing.assert_close(layer.values, own.layers[0].keys, atol=1e-5, rtol=0)  # latents: never rotated
    cache.unbind()


def test_streaming_without_sinks_renumbered_is_the_unbounded_cache(model):
    """StreamingLLM with no sinks shifts every resident token alike at each renumber: the same tokens and scores
    as the unbounded cache (census check; it also compares layer 0's k_rot and latents with the model's own)."""
    renumbered_keys_are_the_models_own(model)


def test_each_row_of_a_batch_equals_the_row_run_alone(model):
    """A left-padded batch of 4, every row evicting and the longest renumbering under limit: each row's tokens,
    scores and ledger equal the row run alone. The model decompresses the rows' latents padded together; each
    row's attention reads only its own."""
    from test_batch import CACHES, assert_rows_equal_alone, prompts

    cache = assert_rows_equal_alone(model, CACHES["pace"], prompts(), None, [None] * 4)
    assert all(row.resident_count() == 24 for row in cache.rows) and cache.rows[2].renumbers >= 1


def test_spilled_tokens_restore_exactly_and_a_session_resumes(model):
    """With a store, evicted (latent, k_rot) pairs spill; a restored span comes back re-rotated to its new
    positions from its reference (the model's own k_rot there, the latent as it was), and a saved session
    resumes to bit-equal logits."""
    from pace_hf import Blueprint, HostTier, Span, TieredStore

    store = TieredStore([HostTier(1 << 30)])
    cache = PACECache(model, Blueprint([Span(10, 20, readers=(2,))]), budget=24, recent=8, limit=64, store=store,
                      session_id="mla")
    with torch.no_grad():
        out = model.generate(ids(100), max_new_tokens=4, do_sample=False, cache=cache, prefill_chunk_size=16,
                             pad_token_id=0)
        assert cache.restore(30, 40) == 10
        logical, physical = cache.ledger(0)
        assert set(range(30, 40)) <= set(logical[0].tolist())
        own = tf.DynamicCache(config=model.config)
        model(input_ids=out[0, logical[0]][None], position_ids=physical, cache=own)
        torch.testing.assert_close(cache.layers[0].keys, own.layers[0].values, atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.layers[0].values, own.layers[0].keys, atol=1e-5, rtol=0)
        cache.save()
        resumed = PACECache.resume("mla", store=store, model=model)
        assert torch.equal(model(out[:, -1:], cache=cache).logits, model(out[:, -1:], cache=resumed).logits)
    resumed.unbind()
    cache.unbind()
    store.close()
