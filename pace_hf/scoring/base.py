"""The contract every eviction scoring policy meets.

A cache keeps, per layer and KV head, the ``budget`` tokens of highest priority (sinks and the most
recent tokens are always kept). A policy says two things:
- how attention feeds its per-token state (``needs_attention``, ``query_window``, ``accumulate``);
- the priority of each resident token when the cache evicts (``priority``).

Policies are small frozen dataclasses, one per file. Wrappers (``Foresight``) compose with any of
them, so the ablation arms are compositions rather than flags.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..cache import EvictingLayer


class ScoringPolicy(ABC):
    """Turns attention into per-token state, and per-token state into eviction priority."""

    #: whether the attention pass must compute column sums for this policy at all
    needs_attention: bool = True

    def query_window(self, q_len: int) -> int | None:
        """How many of a forward's last queries feed the scores: None = all, 0 = none."""
        return None

    def accumulate(self, old: torch.Tensor, fresh: torch.Tensor, n_new: int) -> torch.Tensor:
        """New per-token state from the old state of the stored tokens (``[kv_heads, n_old]``) and the
        fresh column sums over all ``n_old + n_new`` keys of this forward."""
        raise NotImplementedError(f"{type(self).__name__} does not score from attention")

    @abstractmethod
    def priority(self, layer: "EvictingLayer", step: int) -> torch.Tensor:
        """Eviction priority ``[kv_heads, n]`` (fp32) of ``layer``'s resident tokens at agent step
        ``step``: the highest ``budget`` are kept."""
