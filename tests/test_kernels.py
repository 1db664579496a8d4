"""The Triton re-rotation kernel equals the torch reference (interpreter on CPU)."""

import pytest
import torch

from pace_hf.rope import RotaryParams, rerotate_reference

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
    got = rerotate_triton(keys, src, dst, p, out_dtype)
    assert got.dtype == out_dtype and got.shape == want.shape
    if out_dtype == torch.float32:
        assert torch.allclose(got, want, atol=2e-5, rtol=0)
    else:  # at most one bf16 rounding apart (cos/sin may differ in the last fp32 bit)
        ulp = want.float().abs().clamp_min(1e-3) * 2 ** -7
        assert ((got.float() - want.float()).abs() <= ulp).all()
    # the non-rotated dims of partial rotary are copied exactly
    assert torch.equal(got[..., rotary_dim:], keys[..., rotary_dim:].to(out_dtype))
