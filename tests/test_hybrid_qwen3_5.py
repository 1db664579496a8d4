"""Qwen3.5 (text): three linear-attention layers to one full layer whose rotary embedding is M-RoPE
(three rows of positions over interleaved sections). For text the three rows are one position, so
re-rotating by the plain frequencies is exact; the positions pace_hf hands the model are text positions."""

import transformers as tf
from hybrid import C, bounded, build, nothing_evicted

LAYERS = ["linear_attention"] * 3 + ["full_attention"]
MROPE = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5, "mrope_section": [6, 5, 5],
         "mrope_interleaved": True}


def qwen3_5():
    return build(tf.Qwen3_5TextConfig(**C, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
                                      linear_key_head_dim=16, linear_value_head_dim=16, layer_types=LAYERS,
                                      rope_parameters=MROPE))


def test_nothing_evicted_equals_dynamic_cache():
    nothing_evicted(qwen3_5())


def test_bounded_positions_keep_the_plan():
    cache = bounded(qwen3_5())
    assert cache.layout == ["linear"] * 3 + ["full"] and cache.rotary[3].rotary_dim == 32
