"""H2O: a token's score is the attention it has received from every query so far."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import ScoringPolicy


@dataclass(frozen=True)
class CumulativeAttention(ScoringPolicy):
    def accumulate(self, old: torch.Tensor, fresh: torch.Tensor, n_new: int) -> torch.Tensor:
        return F.pad(old, (0, n_new)) + fresh

    def priority(self, layer, step: int) -> torch.Tensor:
        return layer.scores
