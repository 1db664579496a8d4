"""Attention scores for eviction without eager attention.

We register an attention function, ``pace_sdpa``, with transformers' ``AttentionInterface`` (and the
SDPA mask function under the same name). Its output is exactly SDPA's. When a pace_hf cache is in a
forward of the model, it also computes, block by block over queries, the softmax probabilities in
fp32 and reduces them to per-key column sums averaged over the GQA group. No (session x session)
matrix is ever built: a block is at most ``_BLOCK_ELEMS`` probabilities.
"""

from __future__ import annotations

import contextvars

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "pace_sdpa"
_BLOCK_ELEMS = 1 << 24  # probabilities per block: 64 MiB of fp32

# The cache whose forward is running (set by its forward hooks on the bound model).
ACTIVE_CACHE: contextvars.ContextVar = contextvars.ContextVar("pace_active_cache", default=None)


def attention_column_sums(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float, last_queries: int | None
) -> torch.Tensor:
    """Sum of softmax(q k^T) over the (last ``last_queries``) queries, averaged over each KV head's
    query group: ``[batch, kv_heads, kv_len]`` in fp32.

    ``query``: [b, q_heads, q_len, d]; ``key``: [b, kv_heads, kv_len, d] (not repeated for GQA);
    ``attention_mask``: bool (True = attend) or additive float, broadcastable to [b, 1, q_len, kv_len],
    or None for plain causal attention aligned to the end of the keys.
    """
    b, hq, q_len, d = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    group = hq // hkv
    first = 0 if last_queries is None else q_len - last_queries
    key_t = key.float().transpose(-1, -2)  # [b, kv_heads, d, kv]
    out = torch.zeros(b, hkv, 1, kv_len, dtype=torch.float32, device=key.device)
    rows = max(1, _BLOCK_ELEMS // max(1, hq * kv_len))
    for start in range(first, q_len, rows):
        stop = min(q_len, start + rows)
        n = stop - start
        # the query heads of one KV head share its keys: one matmul per KV head, no repeat_kv
        q = (query[:, :, start:stop].float() * scaling).reshape(b, hkv, group * n, d)
        logits = torch.matmul(q, key_t)  # [b, kv_heads, group * n, kv]
        grouped = logits.view(b, hkv, group, n, kv_len)
        if attention_mask is None:
            q_pos = torch.arange(start, stop, device=key.device)[:, None] + (kv_len - q_len)
            grouped.masked_fill_(torch.arange(kv_len, device=key.device)[None, :] > q_pos, float("-inf"))
        else:
            m = attention_mask[:, :, start:stop, :kv_len].unsqueeze(2)  # [b, 1, 1, n, kv]
            grouped.masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else grouped.add_(m.float())
        # softmax in place; the row normalisation is folded into the column sum (one mat-vec)
        torch.exp(logits.sub_(logits.amax(dim=-1, keepdim=True)), out=logits)
        inv_row_sums = logits.sum(dim=-1, keepdim=True).reciprocal_().nan_to_num_(0.0, posinf=0.0)
        out += torch.matmul(inv_row_sums.transpose(-1, -2), logits)
    return out[:, :, 0] / group


def pace_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA attention that also reports column sums to the active pace_hf cache."""
    output = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    cache = ACTIVE_CACHE.get()
    layer_idx = getattr(module, "layer_idx", None)
    if cache is not None and layer_idx is not None:
        window = cache.score_query_window(query.shape[2])
        if window is None or window > 0:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            sums = attention_column_sums(query, key, attention_mask, scale, window)
            cache.record_attention(layer_idx, sums)
    return output


def register() -> str:
    """Register ``pace_sdpa`` (idempotent) and return its name."""
    AttentionInterface.register(ATTN_NAME, pace_sdpa_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME
