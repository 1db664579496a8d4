"""gpt-oss: sliding (first) and full layers alternating, learned per-head sinks, mixture of experts, YaRN."""

import torch
import transformers as tf
from hybrid import C, bounded, build, nothing_evicted

from pace_hf import attention

LAYERS = ["sliding_attention", "full_attention"] * 2


def gpt_oss():
    config = tf.GptOssConfig(**{**C, "intermediate_size": 64}, head_dim=16, sliding_window=48, num_local_experts=4,
                             num_experts_per_tok=2, layer_types=LAYERS)
    model = build(config, attn="eager")
    with torch.no_grad():  # learned sinks of a visible size (random init leaves them near 0)
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2, 3, layer.self_attn.sinks.numel()))
    return model


def test_nothing_evicted_equals_dynamic_cache_with_sinks():
    nothing_evicted(gpt_oss())


def test_bounded_positions_keep_the_plan_and_the_window():
    cache = bounded(gpt_oss())
    assert cache.layout == ["sliding:48", "full"] * 2
    assert cache.rotary[1].rope_type == "yarn"


def test_a_sink_is_no_cached_token():
    """The sink takes its share of each row's softmax, but it has no column: the column sums have one
    entry per key, and they add up to the rows' mass less the sinks' share."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    causal = torch.arange(8)[None, :] <= torch.arange(5)[:, None] + 3
    logits = (q * 0.25) @ k.repeat_interleave(2, 1).transpose(-1, -2)
    logits = logits.masked_fill(~causal, float("-inf"))
    full = torch.cat([logits, sinks.view(1, 4, 1, 1).expand(1, 4, 5, 1)], -1).softmax(-1)
    probs = full[..., :-1]
    expected_out = (probs @ v.repeat_interleave(2, 1)).transpose(1, 2)
    for fn in (attention.attention_with_column_sums, attention.attention_with_column_sums_reference):
        out, sums = fn(q, k, v, None, 0.25, None, sinks=sinks)
        assert sums.shape == (1, 2, 8)
        torch.testing.assert_close(out, expected_out)
        torch.testing.assert_close(sums, probs.sum(2).view(1, 2, 2, 8).mean(2))
        assert float(sums.sum()) < 5 * 2  # less than one unit of mass per query and KV head: the sinks took theirs
