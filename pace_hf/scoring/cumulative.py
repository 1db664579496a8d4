"""H2O: a token's score is the attention it has received from every query so far."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class CumulativeAttention:
    needs_attention: bool = True

    def query_window(self, q_len: int) -> int | None:
        return None  # every query of every forward adds to the sum

    def update(self, old: torch.Tensor, fresh: torch.Tensor, n_new: int) -> torch.Tensor:
        return F.pad(old, (0, n_new)) + fresh
