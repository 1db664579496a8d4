"""StreamingLLM: no attention needed; newer tokens rank higher (sinks are protected by the cache)."""

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import ScoringPolicy


@dataclass(frozen=True)
class Recency(ScoringPolicy):
    """StreamingLLM: newer tokens rank higher, and no attention is read (``StreamingLLMCache``'s policy;
    the sinks are the cache's own)."""

    needs_attention: ClassVar[bool] = False

    def query_window(self, q_len: int) -> int | None:
        return 0

    def priority(self, logical: torch.Tensor, scores: torch.Tensor, step: int) -> torch.Tensor:
        return logical.to(torch.float32)
