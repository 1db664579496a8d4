"""StreamingLLM: no attention needed; newer tokens rank higher (sinks are protected by the cache)."""

from dataclasses import dataclass

import torch

from .base import ScoringPolicy


@dataclass(frozen=True)
class Recency(ScoringPolicy):
    needs_attention: bool = False

    def query_window(self, q_len: int) -> int | None:
        return 0

    def priority(self, layer, step: int) -> torch.Tensor:
        return layer.logical.to(torch.float32)
