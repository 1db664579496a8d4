"""Per-chunk bookkeeping that must not grow with the session (issue 43 item 2, ``bench/growth.py``).

Counted, not timed: the elements that aten ops read, through a dispatch mode, so the assertions hold on
any machine under any load."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pace_hf.memory.spill import SpillLog
from pace_hf.tiers import HostTier, TieredStore

PAGE = 64


class ElementsRead(TorchDispatchMode):
    """Counts the elements of every tensor that an aten op is given: the work of a CPU op, without a clock."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.elements += sum(t.numel() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))


def evicted(logical: torch.Tensor, heads: int = 2, head_dim: int = 16) -> dict[str, torch.Tensor]:
    """Evicted tokens at ``logical`` in every KV head, as ``EvictingLayer.tokens_at`` gives them."""
    n = logical.numel()
    return {"head": torch.arange(heads).repeat_interleave(n), "logical": logical.repeat(heads),
            "ref_pos": logical.repeat(heads), "score": torch.rand(heads * n),
            "ref_key": torch.randn(heads * n, head_dim), "value": torch.randn(heads * n, head_dim)}


def elements_to_spill(tokens) -> int:
    store = TieredStore([HostTier()])
    log = SpillLog(store, "growth", "fp", 1, PAGE)
    with ElementsRead() as count:
        log.add(0, tokens)
    assert log.spilled_tokens == tokens["logical"].numel()
    store.close()
    return count.elements


def test_spilling_an_eviction_reads_its_tokens_once_however_many_pages_they_span():
    """A chunk's eviction spans the chunk's pages and those of the old tokens it evicts, which a long
    session spreads over more pages: splitting the evicted tokens by page must cost the tokens, not
    tokens x pages. A mask per page read every evicted token once per page (spill.py before issue 43:
    0.5 s of CPU a layer a 4K chunk with the 1M run's KV shapes)."""
    n = 1024
    together = elements_to_spill(evicted(torch.arange(n)))  # 16 pages
    apart = elements_to_spill(evicted(torch.arange(n) * PAGE))  # 1,024 pages, one token each
    assert apart < 2 * together, (together, apart)
