"""Qwen3-Next: three linear-attention layers (gated delta rule: a conv and a recurrent state) to one full
layer with partial rotary. The linear states are carried, saved and resumed unchanged."""

import pytest
import torch
import transformers as tf
from conftest import prefill, random_ids
from hybrid import C, bounded, build, nothing_evicted

from pace_hf import PACECache
from pace_hf.tiers import HostTier, TieredStore

LAYERS = ["linear_attention"] * 3 + ["full_attention"]


def qwen3_next():
    return build(tf.Qwen3NextConfig(**C, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                                    linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32, layer_types=LAYERS))


def test_nothing_evicted_equals_dynamic_cache():
    nothing_evicted(qwen3_next())


def test_bounded_positions_keep_the_plan():
    cache = bounded(qwen3_next())
    assert cache.layout == ["linear"] * 3 + ["full"]
    assert cache.rotary[3].rotary_dim < 16  # partial rotary


def test_linear_states_are_saved_and_resumed_exactly():
    model = qwen3_next()
    store = TieredStore([HostTier()])
    cache = PACECache(model, budget=48, limit=160, recent=16, store=store, session_id="next")
    prefill(model, cache, random_ids(200), 32)
    cache.save()
    saved = {f"{i}/{k}": v.clone() for i, layer in enumerate(cache.layers) for k, v in layer.tensors().items()}
    assert {"0/conv0", "0/recurrent0"} <= saved.keys()
    probe = torch.tensor([[42]])
    with torch.no_grad():
        logits = model(probe, cache=cache).logits
    cache.unbind()
    resumed = PACECache.resume("next", store=store, model=model)
    for i, layer in enumerate(resumed.layers):
        for k, v in layer.tensors().items():
            assert torch.equal(v, saved[f"{i}/{k}"]), f"{i}/{k}"
    with torch.no_grad():
        assert torch.equal(model(probe, cache=resumed).logits, logits)
    store.close()


def test_a_failed_forward_leaves_the_linear_states_as_they_were():
    model = qwen3_next()
    cache = PACECache(model, budget=48, limit=160, recent=16)
    prefill(model, cache, random_ids(100), 50)
    before = {f"{i}/{k}": v.clone() for i, layer in enumerate(cache.layers) for k, v in layer.tensors().items()}
    boom = model.model.layers[3].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        model(random_ids(20, seed=1), cache=cache)
    boom.remove()
    assert cache.get_seq_length() == 100
    for i, layer in enumerate(cache.layers):
        for k, v in layer.tensors().items():
            assert torch.equal(v, before[f"{i}/{k}"]), f"{i}/{k}"
