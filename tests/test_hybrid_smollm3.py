"""SmolLM3: full attention everywhere, some layers without a rotary embedding (NoPE)."""

import torch
import transformers as tf
from conftest import prefill, random_ids
from hybrid import C, TOKENS, bounded, build, nothing_evicted

from pace_hf import Blueprint, PACECache, Span


def smollm3():
    return build(tf.SmolLM3Config(**C, no_rope_layers=[0, 1, 1, 0], **TOKENS))


def test_nothing_evicted_equals_dynamic_cache():
    nothing_evicted(smollm3())


def test_bounded_positions_keep_the_plan():
    cache = bounded(smollm3())
    assert cache.layout == ["full:nope", "full", "full", "full:nope"]
    assert cache.rotary[0] is None and cache.layers[0].ref_keys is None  # nothing to re-rotate: no reference kept


def test_nope_keys_are_never_re_rotated():
    """Layer 0 has no rotary embedding, so its keys depend on the token alone: after every renumber they
    are still the model's own keys, whatever their new physical positions."""
    model = smollm3()
    cache = PACECache(model, Blueprint([Span(10, 30, [1])]), budget=48, limit=160, recent=16)
    ids = random_ids(400, seed=5)
    prefill(model, cache, ids, 24)
    assert cache.renumbers >= 3
    own = tf.DynamicCache()
    with torch.no_grad():
        model(ids, cache=own)
    layer = cache.layers[0]
    expected = own.layers[0].keys[0].gather(1, layer.logical[:, :, None].expand(-1, -1, layer.keys.shape[-1]))
    torch.testing.assert_close(layer.keys[0], expected, atol=1e-6, rtol=0)
    assert int(layer.physical.max()) < 160 and not torch.equal(layer.physical, layer.logical)
