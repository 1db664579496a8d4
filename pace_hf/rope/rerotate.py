"""Exact re-rotation of post-RoPE keys from one position to another.

A key rotated at position p is moved to p' by undoing the model's angle ``p * inv_freq`` and applying
``p' * inv_freq``, both computed in fp32 exactly as the model computes them. Working from the model's
own angles (not from the delta ``p' - p``) reproduces the model's key at p' up to fp32 arithmetic.
The result is rounded once to ``out_dtype``: callers keep a reference copy of each key with its
reference position and always start from it, so rounding never compounds over renumbers.
"""

from __future__ import annotations

import torch

from .params import RotaryParams


def _check_args(keys: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, params: RotaryParams):
    if keys.shape[-1] != params.head_dim:
        raise ValueError(f"keys have head_dim {keys.shape[-1]} but the rotary params expect {params.head_dim}")
    if not keys.is_floating_point():
        raise TypeError(f"keys must be a floating tensor, got {keys.dtype}")
    for name, pos in (("src_positions", src), ("dst_positions", dst)):
        if not isinstance(pos, torch.Tensor) or pos.is_floating_point() or pos.is_complex():
            raise TypeError(f"{name} must be an integer tensor")
        try:
            torch.broadcast_shapes(pos.shape, keys.shape[:-1])
        except RuntimeError as err:
            raise ValueError(
                f"{name} of shape {tuple(pos.shape)} does not broadcast to the keys' token shape "
                f"{tuple(keys.shape[:-1])} (keys are [..., n, head_dim])"
            ) from err
    if torch.broadcast_shapes(src.shape, dst.shape, keys.shape[:-1]) != keys.shape[:-1]:
        raise ValueError(
            f"positions of shapes {tuple(src.shape)} and {tuple(dst.shape)} would broadcast the keys "
            f"{tuple(keys.shape)} to a larger shape"
        )


def rotation_cos_sin(src: torch.Tensor, dst: torch.Tensor, inv_freq: torch.Tensor):
    """cos and sin of the angle that moves a pair from src to dst, from the model's own fp32 angles."""
    inv_freq = inv_freq.to(device=src.device, dtype=torch.float32)
    a_src = src[..., None].float() * inv_freq
    a_dst = dst[..., None].float() * inv_freq
    cs, ss, cd, sd = a_src.cos(), a_src.sin(), a_dst.cos(), a_dst.sin()
    # R(a_dst) @ R(-a_src), expanded so each angle is the one the model itself used.
    return cd * cs + sd * ss, sd * cs - cd * ss


def rerotate_reference(
    keys: torch.Tensor,
    src_positions: torch.Tensor,
    dst_positions: torch.Tensor,
    params: RotaryParams,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain torch re-rotation (the reference the Triton kernel is tested against)."""
    out_dtype = out_dtype or keys.dtype
    cos, sin = rotation_cos_sin(src_positions, dst_positions, params.inv_freq)  # [..., n, r/2]
    k = keys.float()
    r = params.rotary_dim
    rot, rest = k[..., :r], k[..., r:]
    if params.layout == "half":
        x, y = rot[..., : r // 2], rot[..., r // 2 :]
    else:
        x, y = rot[..., 0::2], rot[..., 1::2]
    nx, ny = x * cos - y * sin, y * cos + x * sin
    if params.layout == "half":
        rot = torch.cat((nx, ny), dim=-1)
    else:
        rot = torch.stack((nx, ny), dim=-1).flatten(-2)
    return torch.cat((rot, rest.expand(*rot.shape[:-1], rest.shape[-1])), dim=-1).to(out_dtype)


def rerotate(
    keys: torch.Tensor,
    src_positions: torch.Tensor,
    dst_positions: torch.Tensor,
    params: RotaryParams,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Return ``keys`` (post-RoPE, rotated at ``src_positions``) as the model would have rotated them
    at ``dst_positions``.

    keys: ``[..., n, head_dim]``; positions: integer tensors broadcastable to ``[..., n]``.
    Computed in fp32 and cast once to ``out_dtype`` (default: the keys' dtype). CUDA tensors go
    through the Triton kernel, everything else through the torch reference.
    """
    _check_args(keys, src_positions, dst_positions, params)
    if keys.is_cuda:
        from pace_hf.kernels import rerotate_triton

        return rerotate_triton(keys, src_positions, dst_positions, params, out_dtype)
    return rerotate_reference(keys, src_positions, dst_positions, params, out_dtype)
