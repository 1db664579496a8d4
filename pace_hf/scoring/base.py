"""The contract every eviction scoring policy meets.

A cache keeps, per layer and KV head, the ``budget`` tokens of highest priority (sinks and the most
recent tokens are always kept). A policy says two things, from plain tensors (as kvpress's
``ScorerPress.score`` does), so it knows nothing of the cache that calls it:
- how attention feeds its per-token state (``needs_attention``, ``query_window``, ``accumulate``);
- the priority of each resident token when the cache evicts (``priority``).

Policies are small frozen dataclasses, one per file, whose fields are only their knobs. Wrappers
(``Foresight``) compose with any of them and pass the inner policy's attributes through, so the
ablation arms are compositions rather than flags.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


class ScoringPolicy(ABC):
    """Turns attention into per-token state, and per-token state into eviction priority."""

    #: whether the attention pass must compute column sums for this policy at all
    needs_attention: ClassVar[bool] = True
    #: the plan this policy gives a bonus to (``Foresight``'s field; wrappers pass theirs through)
    blueprint: ClassVar = None

    def query_window(self, q_len: int) -> int | None:
        """How many of a forward's last queries feed the scores: None = all, 0 = none."""
        return None

    def accumulate(self, scores: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """The new per-token state ``[kv_heads, n]`` from ``scores``, the state of the ``n`` stored
        tokens (the tokens this forward added start at 0), and ``fresh``, this forward's column sums
        over the same ``n`` keys. ``scores`` is the cache's own buffer: updating it in place and
        returning it saves a copy per token."""
        raise NotImplementedError(f"{type(self).__name__} does not score from attention")

    @abstractmethod
    def priority(self, logical: torch.Tensor, scores: torch.Tensor, step: int) -> torch.Tensor:
        """Eviction priority ``[kv_heads, n]`` (fp32) of the resident tokens at logical positions
        ``logical`` with per-token state ``scores`` (both ``[kv_heads, n]``) at agent step ``step``:
        the highest ``budget`` are kept."""
