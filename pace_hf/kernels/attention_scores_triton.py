"""Triton kernels for attention plus H2O's column sums on GPUs, in two passes.

1. ``_attention_fwd_kernel``: flash attention forward (online softmax in base 2), which also stores
   each row's logsumexp. One program per (query block, query head).
2. ``_column_sums_kernel``: one program per (key block, KV head). It loops over the query heads of
   its group and over query blocks, recomputes ``exp2(q.k*scale*log2e - lse)`` and sums over rows.
   Each program owns its output columns, so no atomics; it never reads V.

Masks: ``None`` is causal aligned to the end of the keys (blocks past the diagonal are skipped), or
a bool (True = attend) or additive mask broadcastable to ``[b, heads, q_len, kv_len]``. Inputs may be
fp16, bf16 or fp32; products accumulate in fp32 (fp32 inputs use IEEE dots, not TF32). The plain
torch twin is ``pace_hf.attention.attention_with_column_sums_reference``; tests hold them equal under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Triton's CPU interpreter multiplies bf16 tiles wrongly (tl.dot on bf16 gives garbage), so under it
# the kernels widen every tile to fp32 after loading; on a GPU the dots take the input dtype.
_WIDEN = os.environ.get("TRITON_INTERPRET") == "1"
_CAUSAL, _BOOL, _ADDITIVE = 0, 1, 2


@triton.jit
def _masked_logits(s, offs_m, offs_n, q_len, kv_len, m_ptrs, MASK: tl.constexpr):
    """Base-2 logits ``s`` [BLOCK_M, BLOCK_N] with out-of-range and masked entries set to -inf."""
    valid = (offs_m[:, None] < q_len) & (offs_n[None, :] < kv_len)
    if MASK == 0:
        valid = valid & (offs_n[None, :] <= offs_m[:, None] + (kv_len - q_len))
    if MASK == 1:
        valid = valid & (tl.load(m_ptrs, mask=valid, other=0) != 0)
    if MASK == 2:
        s = s + tl.load(m_ptrs, mask=valid, other=0.0).to(tl.float32) * 1.4426950408889634
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _block(pid, BLOCK: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's ``BLOCK`` rows along axis 0, the head dimension's offsets and which are real."""
    offs_d = tl.arange(0, BLOCK_D)
    return pid * BLOCK + tl.arange(0, BLOCK), offs_d, offs_d < HEAD_D


@triton.jit
def _attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, lse_ptr,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, smb, smh, smm, smn, sob, som, soh,
    q_len, kv_len, heads, group, scale2,
    MASK: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)  # axis 1 of the grid runs over batch x heads
    b, h = bh // heads, bh % heads
    hk = h // group
    offs_m, offs_d, d_ok = _block(pid_m, BLOCK_M, HEAD_D, BLOCK_D)
    q = tl.load(q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=(offs_m[:, None] < q_len) & d_ok[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = kv_len
    if MASK == 0:  # keys past the last row's diagonal are masked for the whole block
        hi = tl.minimum(kv_len, kv_len - q_len + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ok = (offs_n[None, :] < kv_len) & d_ok[:, None]
        k = tl.load(k_ptr + b * skb + hk * skh + offs_n[None, :] * skn + offs_d[:, None], mask=kv_ok, other=0.0)
        if WIDEN:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * scale2
        m_ptrs = m_ptr + b * smb + h * smh + offs_m[:, None] * smm + offs_n[None, :] * smn
        s = _masked_logits(s, offs_m, offs_n, q_len, kv_len, m_ptrs, MASK)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far stays at zero
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :],
                    mask=(offs_n[:, None] < kv_len) & d_ok[None, :], other=0.0)
        if WIDEN:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    row_ok = offs_m < q_len
    tl.store(o_ptr + b * sob + offs_m[:, None] * som + h * soh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    # base-2 lse; +inf for a fully masked row, so its probabilities come out as exactly zero
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("inf"))
    tl.store(lse_ptr + bh * q_len + offs_m, lse, mask=row_ok)


@triton.jit
def _column_sums_kernel(
    q_ptr, k_ptr, m_ptr, lse_ptr, out_ptr,
    sqb, sqh, sqm, skb, skh, skn, smb, smh, smm, smn,
    q_len, kv_len, kv_heads, group, score_from, scale2,
    MASK: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bk = tl.program_id(1)  # batch x KV heads
    b, hk = bk // kv_heads, bk % kv_heads
    offs_n, offs_d, d_ok = _block(pid_n, BLOCK_N, HEAD_D, BLOCK_D)
    k = tl.load(k_ptr + b * skb + hk * skh + offs_n[None, :] * skn + offs_d[:, None],
                mask=(offs_n[None, :] < kv_len) & d_ok[:, None], other=0.0)
    if WIDEN:
        k = k.to(tl.float32)
    acc = tl.zeros([BLOCK_N], tl.float32)
    lo = score_from
    if MASK == 0:  # queries before this block's first key's diagonal cannot see it
        lo = tl.maximum(score_from, pid_n * BLOCK_N - (kv_len - q_len))
    for g in range(group):
        h = hk * group + g
        for start_m in range(lo, q_len, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = tl.load(q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                        mask=(offs_m[:, None] < q_len) & d_ok[None, :], other=0.0)
            if WIDEN:
                q = q.to(tl.float32)
            lse = tl.load(lse_ptr + (b * kv_heads * group + h) * q_len + offs_m, mask=offs_m < q_len, other=float("inf"))
            s = tl.dot(q, k, input_precision=PRECISION) * scale2
            m_ptrs = m_ptr + b * smb + h * smh + offs_m[:, None] * smm + offs_n[None, :] * smn
            s = _masked_logits(s, offs_m, offs_n, q_len, kv_len, m_ptrs, MASK)
            acc += tl.sum(tl.exp2(s - lse[:, None]), 0)
    tl.store(out_ptr + bk * kv_len + offs_n, acc / group, mask=offs_n < kv_len)


def _mask_args(mask, shape, device):
    """(kind, tensor, strides over [b, heads, q, kv]) for the kernels; bool masks are read as bytes."""
    if mask is None:
        return _CAUSAL, torch.empty(1, device=device), (0, 0, 0, 0)
    kind = _BOOL if mask.dtype == torch.bool else _ADDITIVE
    m = mask.expand(shape)
    if kind == _BOOL:
        m = m.view(torch.uint8)
    return kind, m, tuple(m.stride())


def attention_with_column_sums_triton(query, key, value, attention_mask, scaling, last_queries,
                                      block_m: int = 64, block_n: int = 64):
    """Triton twin of ``attention_with_column_sums_reference`` (same arguments and results)."""
    b, hq, q_len, d = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    group = hq // hkv
    if value.shape[-1] != d or d > 256:
        raise NotImplementedError(f"the Triton attention needs equal q/k/v head sizes <= 256 (got q/k {d}, "
                                  f"v {value.shape[-1]})")
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    if key.dtype != query.dtype or value.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    kind, mask, ms = _mask_args(attention_mask, (b, hq, q_len, kv_len), query.device)
    precision = "ieee" if query.dtype == torch.float32 or _WIDEN else "tf32"
    block_d = max(16, triton.next_power_of_2(d))
    block_m = min(block_m, max(16, triton.next_power_of_2(q_len)))
    scale2 = float(scaling) * LOG2E
    output = torch.empty(b, q_len, hq, d, dtype=query.dtype, device=query.device)
    lse = torch.empty(b, hq, q_len, dtype=torch.float32, device=query.device)
    sums = torch.zeros(b, hkv, kv_len, dtype=torch.float32, device=query.device)
    if q_len == 0 or kv_len == 0:
        return output.zero_(), sums
    _attention_fwd_kernel[(triton.cdiv(q_len, block_m), b * hq)](
        query, key, value, mask, output, lse,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), *ms, output.stride(0), output.stride(1), output.stride(2),
        q_len, kv_len, hq, group, scale2,
        MASK=kind, HEAD_D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, WIDEN=_WIDEN,
    )
    score_from = 0 if last_queries is None else max(0, q_len - last_queries)
    if score_from < q_len:
        _column_sums_kernel[(triton.cdiv(kv_len, block_n), b * hkv)](
            query, key, mask, lse, sums,
            query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2), *ms,
            q_len, kv_len, hkv, group, score_from, scale2,
            MASK=kind, HEAD_D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, WIDEN=_WIDEN,
        )
    return output, sums
