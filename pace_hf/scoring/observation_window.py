"""SnapKV: score tokens by the attention of the last ``window`` queries of each forward, pooled.

The scores are recomputed at every forward from the observation window (not accumulated), and
max-pooled over neighbouring tokens so that a kept token keeps its immediate context.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import ScoringPolicy


@dataclass(frozen=True)
class ObservationWindow(ScoringPolicy):
    """SnapKV: each forward's last ``window`` queries score the tokens afresh, max-pooled over ``kernel``
    neighbours (an odd number) so that a kept token keeps its context (``SnapKVCache``'s policy)."""

    window: int = 32
    kernel: int = 7

    def __post_init__(self):
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"window must be >= 1 and kernel an odd number >= 1, got window={self.window}, "
                             f"kernel={self.kernel}")

    def query_window(self, q_len: int) -> int | None:
        return min(self.window, q_len)

    def accumulate(self, scores: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        if self.kernel <= 1:
            return fresh
        flat = fresh.reshape(-1, 1, fresh.shape[-1])
        pooled = F.max_pool1d(flat, self.kernel, stride=1, padding=self.kernel // 2)
        return pooled.reshape(fresh.shape)

    def priority(self, logical: torch.Tensor, scores: torch.Tensor, step: int) -> torch.Tensor:
        return scores
