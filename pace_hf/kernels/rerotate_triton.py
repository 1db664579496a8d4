"""Triton kernel for the fp32 reference-key pass of bounded positions.

Each program moves a block of tokens: it reads reference keys (fp32 or bf16) and their reference
positions, rotates them to their new positions in fp32 (the model's own angles, see
``pace_hf.rope.rerotate``) and writes keys in the output dtype. ``rerotate_reference`` in
``pace_hf.rope`` is the plain torch twin; tests hold them equal under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rerotate_kernel(
    keys_ptr, src_ptr, dst_ptr, inv_freq_ptr, out_ptr,
    n_tokens,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
    PASS: tl.constexpr, PASS_P2: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_tokens
    j = tl.arange(0, HALF_P2)
    j_ok = j < HALF
    src = tl.load(src_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    dst = tl.load(dst_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + j, mask=j_ok, other=0.0)
    a_src = src[:, None] * inv_freq[None, :]
    a_dst = dst[:, None] * inv_freq[None, :]
    cs, ss = tl.cos(a_src), tl.sin(a_src)
    cd, sd = tl.cos(a_dst), tl.sin(a_dst)
    cos = cd * cs + sd * ss
    sin = sd * cs - cd * ss

    if INTERLEAVED:
        x_col = 2 * j
        y_col = 2 * j + 1
    else:
        x_col = j
        y_col = j + HALF
    base = rows[:, None] * HEAD_DIM
    mask = row_ok[:, None] & j_ok[None, :]
    x = tl.load(keys_ptr + base + x_col[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(keys_ptr + base + y_col[None, :], mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + base + x_col[None, :], (x * cos - y * sin).to(out_ty), mask=mask)
    tl.store(out_ptr + base + y_col[None, :], (y * cos + x * sin).to(out_ty), mask=mask)

    if PASS > 0:  # partial rotary: the dims after rotary_dim are copied, rounded once
        p = tl.arange(0, PASS_P2)
        p_mask = row_ok[:, None] & (p < PASS)[None, :]
        cols = 2 * HALF + p
        rest = tl.load(keys_ptr + base + cols[None, :], mask=p_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + base + cols[None, :], rest.to(out_ty), mask=p_mask)


def rerotate_triton(keys, src_positions, dst_positions, params, out_dtype=None, block_n: int = 16):
    """Triton twin of ``pace_hf.rope.rerotate_reference`` (same arguments and result)."""
    out_dtype = out_dtype or keys.dtype
    token_shape = keys.shape[:-1]
    head_dim = keys.shape[-1]
    flat = keys.reshape(-1, head_dim).contiguous()
    src = src_positions.to(keys.device).expand(token_shape).reshape(-1).to(torch.int64).contiguous()
    dst = dst_positions.to(keys.device).expand(token_shape).reshape(-1).to(torch.int64).contiguous()
    inv_freq = params.inv_freq.to(device=keys.device, dtype=torch.float32).contiguous()
    out = torch.empty(flat.shape, dtype=out_dtype, device=keys.device)
    n = flat.shape[0]
    half = inv_freq.numel()
    passthrough = head_dim - 2 * half
    if n:
        grid = (triton.cdiv(n, block_n),)
        _rerotate_kernel[grid](
            flat, src, dst, inv_freq, out, n,
            HEAD_DIM=head_dim, HALF=half, HALF_P2=triton.next_power_of_2(max(half, 1)),
            PASS=passthrough, PASS_P2=triton.next_power_of_2(max(passthrough, 1)),
            INTERLEAVED=params.layout == "interleaved", BLOCK_N=block_n,
        )
    return out.reshape(token_shape + (head_dim,))
