"""Multi-head latent attention (MLA) layers: what an evicting layer holds when the model caches a latent.

DeepSeek V3 and its kin (Kimi, MiniCPM3, GLM-4 MoE Lite, ...) call ``cache.update(latent, k_rot)``: per token
one compressed latent (``kv_lora_rank`` dims, RMS-normed, no position) and one decoupled rotary key
(``qk_rope_head_dim`` dims, rotated at the token's position), each viewed as a single head shared by every
attention head. Attention decompresses the latent into per-head keys and values on every forward, after the
cache returns it. So per token:

- eviction is one decision for every head: the layer holds one "KV head", under one budget, and the score
  of a token is the mean of its column sums over the attention heads (as GQA averages a KV head's group);
- only ``k_rot`` carries a position: under ``limit`` it alone keeps a reference copy and is re-rotated
  exactly from it; the latent is stored as given and never rotated.

``latent_layer(cls)`` is ``cls`` (an ``EvictingLayer``) with the two tensors swapped inside: the layer's
``keys`` are the rotary keys (so the reference, re-rotation, spill and restore of an evicting layer apply to
them unchanged) and its ``values`` the latents; ``update`` takes and returns them in the model's order.
"""

from __future__ import annotations

import functools

import torch


class _LatentMixin:
    """See the module doc: ``keys`` hold ``k_rot``, ``values`` the latent; scores are averaged over heads."""

    latent = True

    def update(self, key_states, value_states, *args, **kwargs):
        rotary, latent = super().update(value_states, key_states, *args, **kwargs)
        return latent, rotary

    def record_scores(self, fresh: torch.Tensor, policy) -> None:
        """``fresh``: column sums ``[attention heads, resident]`` of the decompressed keys, one row per head
        that reads the shared latent; the token's score is their mean."""
        if fresh.shape[0] != self.logical.shape[0]:
            fresh = fresh.mean(dim=0, keepdim=True)
        super().record_scores(fresh, policy)


@functools.cache
def latent_layer(cls: type) -> type:
    """The MLA variant of an evicting layer class (one class per base, so instances of it compare equal)."""
    return type(f"Latent{cls.__name__}", (_LatentMixin, cls), {"__module__": __name__})


__all__ = ["latent_layer"]
