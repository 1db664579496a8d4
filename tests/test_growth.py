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


def _spill_saved(store, session_id: str) -> tuple[int, int]:
    """The JSON bytes of the spill's dropped pages and of the whole spill state in the session's manifest."""
    import json

    from pace_hf.memory.persist import MANIFEST_FINGERPRINT, MANIFEST_KEY

    _, manifest = store.get(MANIFEST_KEY, fingerprint=MANIFEST_FINGERPRINT, session_id=session_id)
    spill = manifest["spill"]
    return len(json.dumps(spill["capped"])), len(json.dumps(spill))


def test_what_a_save_writes_of_a_capped_spill_stays_bounded_as_the_session_grows(tmp_path):
    """Issue 68: the spill cap's dropped pages were kept one entry a page and written whole into every
    save's manifest, so the manifest grew with the session (15,628 entries at 1M tokens) while every
    other structure stayed flat. After 2N chunks a save must hold what it held after N, plus a constant."""
    from conftest import prefill, random_ids
    from tiny_models import tiny_model

    from pace_hf import PACECache
    from pace_hf.tiers import DiskTier

    model = tiny_model("llama")
    page, chunk, n = 16, 32, 12
    config = model.config
    token_bytes = 16 + 2 * (config.hidden_size // config.num_attention_heads) * model.dtype.itemsize
    store = TieredStore([DiskTier(tmp_path)])
    cache = PACECache(model, budget=48, limit=160, recent=8, store=store, session_id="bounded", spill_tokens=page,
                      spill_cap_bytes=6 * page * 2 * len(model.model.layers) * token_bytes)
    saved = []
    for seed in range(2):
        prefill(model, cache, random_ids(n * chunk, seed), chunk)
        cache.save()
        saved.append(_spill_saved(store, "bounded"))
    store.close()
    (capped_n, spill_n), (capped_2n, spill_2n) = saved
    assert cache.tier_stats["spill"]["capped_pages"] > 2 * n  # the cap dropped pages all along
    assert capped_2n <= capped_n + 16, saved
    assert spill_2n <= spill_n + 256, saved


def test_page_runs_hold_exactly_the_pages_added_and_round_trip_through_a_save():
    """The runs that replaced the dict of dropped pages must answer membership as the dict did (a restore
    counts and warns on exactly the dropped pages), and a save's runs (or an older save's dict) load back."""
    from pace_hf.memory.spill import PageRuns

    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        pages = set(torch.randint(0, 200, (150,), generator=gen).tolist())
        runs = PageRuns()
        for p in torch.randperm(len(pages), generator=gen).tolist():
            runs.add(sorted(pages)[p])
        assert [p for p in range(-1, 202) if p in runs] == sorted(pages)
        assert runs.pages() == len(pages)
        assert all(e < s for (_, e), (s, _) in zip(runs.runs(), runs.runs()[1:]))  # disjoint, not adjacent
        assert PageRuns(runs.runs()).runs() == runs.runs()
    store = TieredStore([HostTier()])
    log = SpillLog(store, "runs", "fp", 1, PAGE)
    state = dict(log.state(), capped={"3": 64, "4": 10, "9": 1})  # a save before issue 68: {page: tokens}
    log.load(state, "g1-000000")
    assert log.capped.runs() == [[3, 5], [9, 10]]
    store.close()
