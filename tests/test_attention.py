"""The fused attention of pace_sdpa equals SDPA, and its column sums equal eager probabilities."""

import pytest
import torch

from pace_hf import attention


def _reference(query, key, value, mask, scaling, last_queries):
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    logits = (query @ k.transpose(-1, -2)) * scaling
    if mask is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        causal = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
        logits = logits.masked_fill(~causal, float("-inf"))
    elif mask.dtype == torch.bool:
        logits = logits.masked_fill(~mask, float("-inf"))
    else:
        logits = logits + mask
    probs = logits.softmax(-1)
    out = (probs @ v).transpose(1, 2)
    rows = probs if last_queries is None else probs[:, :, probs.shape[2] - last_queries:]
    sums = rows.sum(2).view(query.shape[0], key.shape[1], group, -1).mean(2)
    return out, sums


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("last_queries", [None, 5, 0])
def test_fused_attention_matches_reference(monkeypatch, mask_kind, last_queries):
    monkeypatch.setattr(attention, "_BLOCK_ELEMS", 6 * 40 * 7)  # several query blocks, one straddling the window
    torch.manual_seed(0)
    b, hq, hkv, q_len, kv_len, d = 1, 6, 2, 23, 40, 16
    query, key, value = torch.randn(b, hq, q_len, d), torch.randn(b, hkv, kv_len, d), torch.randn(b, hkv, kv_len, d)
    causal = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
    mask = {"none": None, "bool": causal[None, None],
            "float": torch.zeros(q_len, kv_len).masked_fill(~causal, float("-inf"))[None, None]}[mask_kind]
    out, sums = attention.attention_with_column_sums(query, key, value, mask, d ** -0.5, last_queries)
    expected_out, expected_sums = _reference(query, key, value, mask, d ** -0.5, last_queries)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sums, expected_sums, atol=1e-5, rtol=1e-5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=causal[None, None], scale=d ** -0.5, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)


def test_bf16_output_keeps_the_query_dtype():
    q, k, v = (torch.randn(1, 4, 8, 16, dtype=torch.bfloat16) for _ in range(3))
    out, sums = attention.attention_with_column_sums(q, k, v, None, 0.25, None)
    assert out.dtype == torch.bfloat16 and sums.dtype == torch.float32
    assert torch.allclose(sums.sum(-1), torch.full((1, 4), 8.0), atol=1e-4)  # each query's row sums to 1
