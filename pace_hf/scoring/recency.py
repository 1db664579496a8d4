"""StreamingLLM: no attention needed; newer tokens rank higher (sinks are protected by the cache)."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Recency:
    needs_attention: bool = False

    def query_window(self, q_len: int) -> int | None:
        return 0

    def update(self, old: torch.Tensor, fresh: torch.Tensor, n_new: int) -> torch.Tensor:
        raise RuntimeError("Recency scores come from positions, not attention")

    def static_scores(self, logical: torch.Tensor) -> torch.Tensor:
        return logical.to(torch.float32)
