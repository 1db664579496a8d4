"""H2O: a token's score is the attention it has received from every query so far."""

from dataclasses import dataclass

import torch

from .base import ScoringPolicy


@dataclass(frozen=True)
class CumulativeAttention(ScoringPolicy):
    """H2O: a token's score is the attention it has received from every query so far (``H2OCache``'s
    policy, and the one under PACE's foresight bonus by default)."""

    def accumulate(self, scores: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        return scores.add_(fresh)

    def priority(self, logical: torch.Tensor, scores: torch.Tensor, step: int) -> torch.Tensor:
        return scores
