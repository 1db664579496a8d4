"""The Triton kernels equal their torch references: on the GPU where CUDA is present, else on the
CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest). No test needs a GPU; the
kernels need triton (the ``cuda`` extra), so without it these tests are skipped."""

import pytest
import torch

from pace_hf.rope import RotaryParams, rerotate_reference

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(*tensors):
    """The kernels' inputs where they run (the torch references take the CPU originals)."""
    return tuple(t if t is None else t.to(DEVICE) for t in tensors)


def params(head_dim, rotary_dim, layout):
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    return RotaryParams(inv_freq=inv_freq, head_dim=head_dim, layout=layout)


@pytest.mark.parametrize("head_dim,rotary_dim,layout", [(64, 64, "half"), (64, 16, "half"), (32, 16, "interleaved"), (24, 24, "interleaved")])
@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_triton_equals_torch(head_dim, rotary_dim, layout, in_dtype, out_dtype):
    from pace_hf.kernels import rerotate_triton

    p = params(head_dim, rotary_dim, layout)
    g = torch.Generator().manual_seed(head_dim + rotary_dim)
    keys = torch.randn(2, 3, 41, head_dim, generator=g).to(in_dtype)
    src = torch.randint(0, 60000, (2, 3, 41), generator=g)
    dst = torch.randint(0, 8192, (41,), generator=g)
    want = rerotate_reference(keys, src, dst, p, out_dtype)
    got = rerotate_triton(*on_device(keys, src, dst), p, out_dtype).cpu()
    assert got.dtype == out_dtype and got.shape == want.shape
    if out_dtype == torch.float32:
        assert torch.allclose(got, want, atol=2e-5, rtol=0)
    else:  # at most one bf16 rounding apart (cos/sin may differ in the last fp32 bit)
        ulp = want.float().abs().clamp_min(1e-3) * 2 ** -7
        assert ((got.float() - want.float()).abs() <= ulp).all()
    # the non-rotated dims of partial rotary are copied exactly
    assert torch.equal(got[..., rotary_dim:], keys[..., rotary_dim:].to(out_dtype))


def _attention_inputs(q_len, kv_len, dtype, d=16, hq=4, hkv=2):
    g = torch.Generator().manual_seed(q_len * 100 + kv_len)
    return tuple(torch.randn(1, h, n, d, generator=g).to(dtype) for h, n in ((hq, q_len), (hkv, kv_len), (hkv, kv_len)))


def _attention_mask(kind, q_len, kv_len):
    causal = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
    if kind == "causal":
        return None
    if kind == "bool":  # a sliding window: not causal, and the first row sees only itself
        return (causal & (torch.arange(kv_len)[None, :] >= torch.arange(q_len)[:, None] + (kv_len - q_len) - 5))[None, None]
    bias = torch.randn(q_len, kv_len, generator=torch.Generator().manual_seed(3))
    return bias.masked_fill(~causal, float("-inf"))[None, None]  # additive, with -inf


# Interpreter runs are slow (about 1 s each): small shapes, blocks of 16 so several blocks are crossed.
@pytest.mark.parametrize("q_len,kv_len,mask_kind,last_queries,dtype", [
    (21, 37, "causal", None, torch.float32),
    (21, 37, "bool", 5, torch.float32),
    (21, 37, "additive", None, torch.float32),
    (1, 37, "causal", None, torch.float32),  # decode
    (21, 37, "causal", 0, torch.bfloat16),
    (18, 18, "bool", None, torch.bfloat16),
])
def test_triton_attention_equals_torch_reference(q_len, kv_len, mask_kind, last_queries, dtype):
    from pace_hf.attention import attention_with_column_sums_reference
    from pace_hf.kernels import attention_with_column_sums_triton

    query, key, value = _attention_inputs(q_len, kv_len, dtype)
    mask = _attention_mask(mask_kind, q_len, kv_len)
    want_out, want_sums = attention_with_column_sums_reference(query, key, value, mask, 0.25, last_queries)
    out, sums = attention_with_column_sums_triton(*on_device(query, key, value, mask), 0.25, last_queries,
                                                  block_m=16, block_n=16)
    out, sums = out.cpu(), sums.cpu()
    assert out.dtype == dtype and out.shape == want_out.shape and sums.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output is one rounding apart; fp32 dots are IEEE
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(sums, want_sums, atol=1e-6, rtol=1e-5)
