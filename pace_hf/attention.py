"""Attention that also yields the per-key scores eviction needs, without eager attention.

We register an attention function, ``pace_attention``, with transformers' ``AttentionInterface`` (and the
SDPA mask function under the same name). With any other cache it is plain SDPA. While a pace_hf cache
is in a forward of the model, it returns the attention output and H2O's column sums: the softmax
probabilities summed over the scored queries, averaged over each KV head's query group, in fp32.

Two passes, because a flash kernel never holds the probabilities but does return each row's
logsumexp (lse), and ``p_ij = exp(q_i.k_j*scale - lse_i)``:

1. the output and the lse from the fastest flash kernel at hand (CPU: torch's own; CUDA: ours, in
   ``pace_hf.kernels.attention_scores_triton``);
2. the column sums, which never touch V and only read the queries the scoring policy asks for
   (``last_queries``; none at all when it is 0).

On CPU, pass 2 reuses torch's flash kernel with the roles of queries and keys swapped: the lse of
key ``j`` over the queries, with ``-lse_i`` appended to each query as one more dimension, is
``log(sum_i p_ij)``. Reversing both sequences turns the causal mask, aligned to the end of the keys,
into the top-left one that kernel skips blocks for. Other masks take a blocked torch pass.
Decode (one query) is one pass instead: its probabilities are the column sums, so logits, softmax
and the values' matmul give both, reading the keys once. In bf16/fp16 the logits come out of that
matmul in the cache's dtype, as torch's math SDPA computes them, so one step's scores are within about
1% of the fp32 reference's; the softmax and the sums are fp32.
``attention_with_column_sums_reference`` is the plain one-pass torch twin the tests hold all to.
"""

from __future__ import annotations

import contextvars
import warnings
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "pace_attention"
_BLOCK_ELEMS = 1 << 24  # reference pass: probabilities per block, 64 MiB of fp32
_SCORE_BLOCK_ELEMS = 1 << 22  # masked column pass: logits per block, 16 MiB of fp32
_DIRECT_ROWS = 64  # scored queries up to which the plain blocked pass beats the swapped kernel (decode, SnapKV)
_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class ScoreSink(Protocol):
    """What ``pace_attention`` asks of the running cache: how many queries to score, and where the
    column sums go."""

    def scores_layer(self, layer_idx: int) -> bool:
        """Whether this layer's attention is scored at all (a sliding window's never is)."""

    def score_query_window(self, q_len: int) -> int | None:
        """How many of the forward's last queries feed the scores: None = all, 0 = none."""

    def record_attention(self, layer_idx: int, column_sums: torch.Tensor) -> None:
        """Take one layer's column sums ``[batch, kv_heads, kv_len]`` (fp32)."""


# The score sink whose forward is running: set by the binding's pre-hook (``enter_forward``), reset
# by the post-hook (which runs even when the forward raises).
ACTIVE_CACHE: contextvars.ContextVar[ScoreSink | None] = contextvars.ContextVar("pace_active_cache", default=None)


def attention_with_column_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    last_queries: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and the column sums of its probabilities (fast path; see the module doc).

    Same arguments and results as ``attention_with_column_sums_reference``. CUDA tensors go through
    the Triton kernels, CPU tensors through torch's flash kernel. Soft-capped logits (Gemma 2) take the
    reference pass: no flash kernel here caps them. Learned sinks (gpt-oss) take the flash pass, each
    row's logsumexp widened by its head's sink logit: a sink is no cached token, so it gets no column.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    score_from = 0 if last_queries is None else max(0, q_len - last_queries)
    if softcap is not None or (sinks is not None and query.is_cuda):
        return attention_with_column_sums_reference(query, key, value, attention_mask, scaling, last_queries,
                                                    softcap=softcap, sinks=sinks)
    mask = _causal_or_mask(attention_mask, q_len, kv_len)
    if query.is_cuda:
        if value.shape[-1] != query.shape[-1] or query.shape[-1] > 256:  # MLA's values are narrower than its keys
            return attention_with_column_sums_reference(query, key, value, attention_mask, scaling, last_queries,
                                                        sinks=sinks)
        from pace_hf.kernels import attention_with_column_sums_triton

        return attention_with_column_sums_triton(query, key, value, mask, scaling, last_queries)
    if value.shape[-1] != query.shape[-1] or query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return attention_with_column_sums_reference(query, key, value, attention_mask, scaling, last_queries,
                                                    sinks=sinks)
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    if mask is None and q_len == 1 and score_from == 0 and sinks is None:
        return _decode_one_pass(query, key, value, scaling)
    output, lse = _flash_attention_lse(query, key, value, mask, scaling)
    if sinks is not None:  # p_ij = exp(s_ij - lse_i') with lse_i' = log(exp(lse_i) + exp(sink_h))
        widened = torch.logaddexp(lse, sinks.float().view(1, hq, 1))
        output = output.float().mul_((lse - widened).exp_()[..., None]).to(query.dtype)
        lse = widened
    if score_from >= q_len:
        sums = torch.zeros(b, hkv, kv_len, dtype=torch.float32, device=key.device)
    elif mask is None and q_len - score_from > _DIRECT_ROWS:
        sums = _column_sums_causal(query, key, lse, scaling, score_from)
    else:
        sums = _column_sums_masked(query, key, lse, mask, scaling, score_from)
    return output.transpose(1, 2).contiguous(), sums


def _flash_attention_lse(query, key, value, mask, scaling):
    """torch's CPU flash kernel: output ``[b, hq, q, d]`` and the row logsumexp ``[b, hq, q]`` (fp32).

    A causal mask aligned to the end of the keys is split in two calls, the keys every query sees
    (no mask) and the last ``q_len`` keys (``is_causal``, which skips the masked blocks), merged by
    their lse: cheaper than one call with an explicit mask, which computes every block."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if mask is not None:
        additive = mask if mask.dtype != torch.bool else torch.zeros(
            mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return _flash_cpu(query, key, value, 0.0, False, attn_mask=additive.to(query.dtype), scale=scaling)
    past = kv_len - q_len
    if q_len == 1:  # decode: the one query sees every key
        return _flash_cpu(query, key, value, 0.0, False, scale=scaling)
    if past == 0:
        return _flash_cpu(query, key, value, 0.0, True, scale=scaling)
    out_past, lse_past = _flash_cpu(query, key[:, :, :past], value[:, :, :past], 0.0, False, scale=scaling)
    out_new, lse_new = _flash_cpu(query, key[:, :, past:], value[:, :, past:], 0.0, True, scale=scaling)
    lse = torch.logaddexp(lse_past, lse_new)
    out = out_past.float().mul_((lse_past - lse).exp_()[..., None])
    out.addcmul_(out_new.float(), (lse_new - lse).exp_()[..., None])
    return out.to(query.dtype), lse


def _column_sums_causal(query, key, lse, scaling, score_from):
    """Column sums under the causal mask aligned to the end of the keys, from torch's flash kernel
    with queries and keys swapped (see the module doc): ``[b, kv_heads, kv]`` fp32."""
    b, hq, q_len, d = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    group = hq // hkv
    # swapped keys: the scored queries, reversed, scaled, with -lse as one more dimension (fp32)
    rows = query[:, :, score_from:].flip(2).float().mul_(scaling)
    rows = torch.cat((rows, lse[:, :, score_from:].flip(2).neg().unsqueeze(-1)), dim=-1)
    # swapped queries: the keys, reversed, with a 1 to pick up -lse; one copy per query head
    cols = torch.cat((key.flip(2).float(), key.new_ones(b, hkv, kv_len, 1, dtype=torch.float32)), dim=-1)
    cols = cols.repeat_interleave(group, dim=1)
    zeros = rows.new_zeros(1, 1, 1, 1).expand(rows.shape)
    _, log_sums = _flash_cpu(cols, rows, zeros.contiguous(), 0.0, True, scale=1.0)  # [b, hq, kv]
    return log_sums.exp_().view(b, hkv, group, kv_len).mean(2).flip(-1)


def _decode_one_pass(query, key, value, scaling):
    """Decode: one query sees every key, so its probabilities are the column sums themselves. One
    matmul for the logits (in the cache's dtype), the softmax in fp32, one matmul with the
    values: the keys and values are read once each, where the flash kernel and then a score pass read
    the keys twice (and torch's CPU flash kernel is slower than two matmuls for one query). A bf16 or
    fp16 cache is never copied to fp32: only the ``[kv_heads, group, kv]`` logits are. Output
    ``[b, 1, hq, dv]`` in the query's dtype, sums ``[b, kv_heads, kv]`` fp32."""
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    logits = torch.matmul((query * scaling).reshape(b, hkv, group, d), key.transpose(-1, -2))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # one fused op: 5 in place took 2x its time on CPU
    output = torch.matmul(probs.to(value.dtype), value)  # [b, kv_heads, group, dv]: the query heads in order
    return output.view(b, 1, hq, value.shape[-1]), probs.sum(dim=-2).div_(group)


def _column_sums_masked(query, key, lse, mask, scaling, score_from):
    """Column sums a block of queries at a time, under an explicit bool or additive mask, or the
    causal one aligned to the end of the keys when ``mask`` is None (a few scored queries: decode,
    SnapKV's window; copying the keys for the swapped kernel would cost more there)."""
    b, hq, q_len, d = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    group = hq // hkv
    key_t = key.float().transpose(-1, -2)  # [b, kv_heads, d, kv]
    sums = torch.zeros(b, hkv, 1, kv_len, dtype=torch.float32, device=key.device)
    rows = max(1, _SCORE_BLOCK_ELEMS // max(1, hq * kv_len))
    for start in range(score_from, q_len, rows):
        stop = min(q_len, start + rows)
        n = stop - start
        q = (query[:, :, start:stop].float() * scaling).reshape(b, hkv, group * n, d)
        logits = torch.matmul(q, key_t).sub_(lse[:, :, start:stop].reshape(b, hkv, group * n, 1))
        grouped = logits.view(b, hkv, group, n, kv_len)
        if mask is None:
            first = kv_len - q_len + start + 1  # keys before this one are seen by every row of the block
            if first < kv_len:
                late = torch.arange(first, kv_len, device=key.device)[None, :] > (
                    torch.arange(start, stop, device=key.device)[:, None] + (kv_len - q_len))
                grouped[..., first:].masked_fill_(late, float("-inf"))
            sums += logits.exp_().sum(dim=-2, keepdim=True)
            continue
        m = mask[:, :, start:stop].unsqueeze(2)  # [b, 1, 1, n, kv]
        if m.dtype == torch.bool:
            grouped.masked_fill_(~m, float("-inf"))
        else:
            grouped.add_(m.float())
        sums += logits.exp_().sum(dim=-2, keepdim=True)
    return sums[:, :, 0] / group


# The mask check's answers in the running forward, set and reset with ACTIVE_CACHE (``enter_forward``):
# transformers builds one mask per forward and hands it to every layer, so the check runs once a forward.
# Scoped to the forward, not to the tensor's version counter, which inference tensors
# (``torch.inference_mode()``) do not have.
_MASK_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar("pace_mask_memo", default=None)


def enter_forward(cache: ScoreSink):
    """Make ``cache`` the running score sink, with a fresh mask memo; returns what ``exit_forward`` takes."""
    return ACTIVE_CACHE.set(cache), _MASK_MEMO.set({})


def exit_forward(tokens) -> None:
    """Undo ``enter_forward``: the previous sink and memo (none outside a forward) come back."""
    active, memo = tokens
    _MASK_MEMO.reset(memo)
    ACTIVE_CACHE.reset(active)


def _causal_or_mask(attention_mask, q_len: int, kv_len: int):
    """``None`` when ``attention_mask`` is None or exactly the causal mask aligned to the end of the
    keys (bool, or additive with 0 / -inf), else the mask cut to ``kv_len`` keys.

    Inside a forward the answer is kept for the rest of it (``_MASK_MEMO``); outside one, it is
    computed every call."""
    if attention_mask is None:
        return None
    memo = _MASK_MEMO.get()
    key = (id(attention_mask), q_len, kv_len)
    if memo is not None and key in memo and memo[key][0] is attention_mask:
        return memo[key][1]
    mask = attention_mask[..., :kv_len]
    causal = torch.arange(kv_len, device=mask.device)[None, :] <= (
        torch.arange(q_len, device=mask.device)[:, None] + (kv_len - q_len))
    if mask.dtype == torch.bool:
        is_causal = mask.shape[-2] == q_len and bool((mask == causal).all())
    else:
        is_causal = mask.shape[-2] == q_len and bool(((mask == 0) == causal).all()) and bool(
            (mask.masked_fill(causal, float("-inf")) <= torch.finfo(mask.dtype).min).all())
    answer = None if is_causal else mask.expand(*mask.shape[:-2], q_len, kv_len)
    if memo is not None:
        memo[key] = (attention_mask, answer)  # the mask is held, so its id cannot be reused in this forward
    return answer


def attention_with_column_sums_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    last_queries: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and the column sums of its probabilities.

    ``query``: [b, q_heads, q_len, d]; ``key``/``value``: [b, kv_heads, kv_len, d] (not repeated for
    GQA); ``attention_mask``: bool (True = attend) or additive float, broadcastable to
    [b, 1, q_len, kv_len], or None for causal attention aligned to the end of the keys.

    Returns the output ``[b, q_len, q_heads, d_v]`` in the query's dtype (transformers' layout) and
    the probabilities summed over the last ``last_queries`` queries (all when None, none when 0),
    averaged over each KV head's query group: ``[b, kv_heads, kv_len]`` in fp32.

    ``softcap``: logits become ``softcap * tanh(logits / softcap)`` before the mask (Gemma 2).
    ``sinks``: one learned logit per query head ``[q_heads]`` that joins every row's softmax and takes
    its share of the probability, but is no key: it has no column and no output (gpt-oss).
    """
    b, hq, q_len, d = query.shape
    hkv, kv_len, dv = key.shape[1], key.shape[2], value.shape[-1]
    group = hq // hkv
    score_from = 0 if last_queries is None else q_len - last_queries
    key_t = key.float().transpose(-1, -2)  # [b, kv_heads, d, kv]
    value = value.float()
    output = torch.empty(b, q_len, hq, dv, dtype=query.dtype, device=query.device)
    sums = torch.zeros(b, hkv, 1, kv_len, dtype=torch.float32, device=key.device)
    rows = max(1, _BLOCK_ELEMS // max(1, hq * kv_len))
    for start in range(0, q_len, rows):
        stop = min(q_len, start + rows)
        n = stop - start
        # the query heads of one KV head share its keys: one matmul per KV head, no repeat_kv
        q = (query[:, :, start:stop].float() * scaling).reshape(b, hkv, group * n, d)
        probs = torch.matmul(q, key_t)  # logits for now: [b, kv_heads, group * n, kv]
        if softcap is not None:
            probs.div_(softcap).tanh_().mul_(softcap)
        grouped = probs.view(b, hkv, group, n, kv_len)
        _apply_mask(grouped, attention_mask, start, stop, q_len)
        # softmax in place, unnormalised; each row's 1/sum scales the output and the column sums
        top = probs.amax(dim=-1, keepdim=True)
        if sinks is not None:
            sink = sinks.float().view(1, hkv, group, 1, 1).expand(b, hkv, group, n, 1).reshape(b, hkv, group * n, 1)
            top = torch.maximum(top, sink)
        torch.exp(probs.sub_(top), out=probs)
        row_sums = probs.sum(dim=-1, keepdim=True)
        if sinks is not None:
            row_sums += (sink - top).exp()
        inv_row_sums = row_sums.reciprocal_().nan_to_num_(0.0, posinf=0.0)
        block_out = torch.matmul(probs, value).mul_(inv_row_sums)  # [b, kv_heads, group * n, dv]
        output[:, start:stop] = block_out.view(b, hq, n, dv).transpose(1, 2)
        if stop > score_from:
            weights = inv_row_sums.view(b, hkv, group, n, 1)
            if start < score_from:
                weights = weights.clone()
                weights[:, :, :, : score_from - start] = 0
            sums += torch.matmul(weights.view(b, hkv, 1, group * n), probs)
    return output, sums[:, :, 0] / group


def _apply_mask(logits: torch.Tensor, attention_mask: torch.Tensor | None, start: int, stop: int, q_len: int) -> None:
    """Mask the logits ``[b, kv_heads, group, n, kv]`` of queries ``start:stop`` in place. Only the
    columns from the first masked one on are touched: under a causal mask, the tail of the keys."""
    kv_len = logits.shape[-1]
    if attention_mask is None:  # causal, aligned to the end of the keys
        first = kv_len - q_len + start + 1
        q_pos = torch.arange(start, stop, device=logits.device)[:, None] + (kv_len - q_len)
        cols = torch.arange(first, kv_len, device=logits.device)[None, :]
        logits[..., first:].masked_fill_(cols > q_pos, float("-inf"))
        return
    m = attention_mask[:, :, start:stop, :kv_len]  # [b or 1, 1, n, kv]
    blocked = ~m if m.dtype == torch.bool else m != 0
    hit = blocked.flatten(0, -2).any(dim=0).nonzero()
    if hit.numel() == 0:
        return
    first = int(hit[0])
    tail = m[..., first:].unsqueeze(2)  # [b, 1, 1, n, kv - first]
    if m.dtype == torch.bool:
        logits[..., first:].masked_fill_(~tail, float("-inf"))
    else:
        logits[..., first:].add_(tail.float())


_warned_attentions = False


@torch.compiler.disable(recursive=True)
def pace_attention_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA outside our caches; inside, attention computed with its column sums (see module doc).

    Opaque to ``torch.compile`` on purpose: it reads the running cache from a context variable and
    writes scores into it, and its mask check depends on data, so a compiled model breaks its graph
    here once per layer instead of tracing (and recompiling) through the cache."""
    cache = ACTIVE_CACHE.get()
    layer_idx = getattr(module, "layer_idx", None)
    softcap, sinks = kwargs.pop("softcap", None), kwargs.pop("s_aux", None)
    if cache is not None and layer_idx is not None and hasattr(cache, "attend_rows"):  # a batch: row by row
        return cache.attend_rows(module, query, layer_idx, scaling, dropout, softcap, sinks, kwargs,
                                 key=key, value=value), None
    return attend(cache, module, layer_idx, query, key, value, attention_mask, dropout, scaling, softcap, sinks,
                  kwargs), None


def attend(cache, module, layer_idx, query, key, value, attention_mask, dropout, scaling, softcap, sinks, kwargs):
    """One sequence's attention output ``[b, q, q_heads, d_v]``; its column sums go to ``cache`` where
    it scores this layer. A batch of caches (``pace_hf.cache.batch``) calls it once per row."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if cache is None or layer_idx is None or not cache.scores_layer(layer_idx):
        if softcap is None and sinks is None:
            if _one_query_packs(query, key, attention_mask, dropout, module):
                return _one_query_packed(query, key, value, scale)
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          **kwargs)[0]
        # SDPA has no soft-capping and no sinks: the models that use them run eager attention, and this is it
        return attention_with_column_sums(query, key, value, attention_mask, scale, 0, softcap=softcap, sinks=sinks)[0]
    if kwargs.get("output_attentions"):
        _warn_no_attentions()
    window = cache.score_query_window(query.shape[2])
    output, sums = attention_with_column_sums(query, key, value, attention_mask, scale, window, softcap=softcap,
                                              sinks=sinks)
    if window is None or window > 0:
        cache.record_attention(layer_idx, sums)
    return output


def _one_query_packs(query, key, attention_mask, dropout: float, module) -> bool:
    """Whether to run a lone query with its KV head's query heads packed as that head's queries: on the
    CPU, with no mask, several query heads per KV head, and no dropout to apply. transformers gives
    torch's SDPA ``enable_gqa`` there, and torch's CPU flash kernel runs that about 10x slower in bf16
    than the packed call (53 ms against 5 ms a layer at 32K keys, Qwen2.5's 14 heads over 2, one
    thread); transformers packs this way itself when a mask is given."""
    return (query.shape[2] == 1 and query.device.type == "cpu" and attention_mask is None
            and query.shape[1] > key.shape[1] and not (dropout and getattr(module, "training", False)))


def _one_query_packed(query, key, value, scale: float) -> torch.Tensor:
    """SDPA of one query ``[b, hq, 1, d]`` over ``[b, hkv, kv, d]`` keys, as ``[b, 1, hq, dv]``: the
    ``group`` query heads of each KV head (consecutive, as ``repeat_kv`` pairs them) are its queries."""
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, hkv, hq // hkv, d), key, value,
                                                           scale=scale)
    return out.reshape(b, 1, hq, value.shape[-1])


def _warn_no_attentions() -> None:
    """``output_attentions=True`` gets no weights from a flash kernel: say so once, as SDPA does."""
    global _warned_attentions
    if not _warned_attentions:
        _warned_attentions = True
        warnings.warn(
            "output_attentions=True returns no attention weights while a pace_hf cache is in use: its "
            "attention is a flash kernel that never holds the probability matrix. The per-token scores "
            "eviction uses are the cache's column sums (layer.scores); for full weights, run the model "
            "without a pace_hf cache and with attn_implementation='eager'.",
            UserWarning,
            stacklevel=3,
        )


def register() -> str:
    """Register ``pace_attention`` (idempotent) and return its name."""
    AttentionInterface.register(ATTN_NAME, pace_attention_attention)
    AttentionMaskInterface.register(ATTN_NAME, _mask)
    return ATTN_NAME


def _mask(*args, **kwargs):
    """transformers' SDPA mask, except under a batch of pace_hf caches: each row's attention builds its
    own there (``attend_rows``), so the batch's padded ``[b, 1, q, columns]`` mask is never made."""
    if hasattr(ACTIVE_CACHE.get(), "attend_rows"):
        return None
    return sdpa_mask(*args, **kwargs)
