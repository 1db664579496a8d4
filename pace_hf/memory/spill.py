"""The spill log: every token a cache evicts goes to a ``TieredStore``, addressed by logical page, so a
restore reads only the pages of the span it brings back.

Pages. Page ``p`` of a layer holds the evicted tokens of logical positions ``[p * page_tokens, (p + 1) *
page_tokens)``, every KV head in one entry (a restore brings every head back). Grouping by time of
eviction, as this log first did, put scattered tokens in every entry (H2O evicts the newest unprotected
token *and* old heavy hitters): every entry overlapped every span, and a restore of 18 tokens read the
whole log (313 MB on SmolLM2). Now a restore of ``[start, end)`` reads the pages it covers and nothing
else: the tokens it returns plus, at each edge, at most one page per layer and head.

Why 64 positions per page by default: we measured 32, 64, 128 and 256 (``spill_pages.py``, a
random-weight model of SmolLM2's attention shape, 3.3K tokens, budget 256). Bytes read per restored byte,
for spans of 128 / 32 positions: 1.2 / 1.8 (32), 1.3 / 3.0 (64), 1.6 / 4.5 (128), 2.1 / 8.8 (256); the
time-grouped log read 3.7 / 22 on that session, and its cost grows with the session. 32 reads least but
makes a 128-span restore read 19 entries (64: 11), each a request and a ~700-byte header; 64 is the
balance.

Versions. A page that receives more evictions later gets a new *version*: a new entry under a new key
(``L3/spill/p17/<writer>-42``), never a rewrite of one a save may index. Each version holds only the
tokens evicted since the last one, and a restore merges the page's versions, the newest copy winning.
Writing each version as the page's whole evicted set instead would rewrite the page on every flush:
a page that H2O keeps evicting old heavy hitters from is flushed many times, and each flush would cost
a whole page (on that random-weight session pages got one version each, so both wrote the same;
in the worst case every flush rewrites the whole page). Merging at read costs nothing extra as long
as no token has two copies, and that holds: a restore *consumes* the pages it read. The tokens it made
resident leave the spill (a new version of the page holds what it read but did not make resident, and
the old versions are retired); when they are evicted again they are spilled again, with the score they
have then. So every token has at most one copy, and a restore reads each byte once.

Buffering. Evicted tokens are buffered per layer and page, and a page is written when its buffer holds a
full page (``page_tokens`` per KV head), when the layer's buffers pass two pages (largest pages first,
down to one), and at ``flush()`` (``cache.save()``). Not per eviction: a decode step evicts one token per
layer and head, and an entry per step would mean a write per layer per token. Buffered tokens are
readable at once. Ledger fields are stored as int32 (positions fit; 12 bytes a token saved).

Cap. ``cap_bytes`` bounds the spilled bytes a session holds (payload bytes; the store adds a header per
entry): past it, the least recently used logical page (written to or restored last) is dropped from every
layer. A restore that asks for a dropped page brings back what is left, counts the page in
``stats["capped_requests"]`` and warns once; it never fails. The dropped pages are kept as runs of
consecutive pages (``PageRuns``), not one entry a page: a save writes them whole, and by page they grew
with the session. A dropped version that the session's current
save indexes stays in the store until the next save replaces that one (``pace_hf.memory.persist`` deletes it
then): the save stays whole. So between saves the store can hold up to twice the cap (what the last save
indexes, plus what was written since), and more by the entries' headers: the 1M run's spill folder
reached 1.8 GB against a 1 GiB cap, with a save every 32K tokens.

Saves. ``state()`` is the index a save's manifest holds: per layer, each version's key, page, sequence
number, tokens, bytes and digest, and the runs of pages the cap dropped. Keys are never reused (``writer`` is new for every log: every cache,
every resume). Each written version's confirmation (``TieredStore.put``) is kept in ``unconfirmed``
until a save has checked that it reached every durable tier: the manifest indexes only durable versions.
"""

from __future__ import annotations

import bisect
import secrets
import warnings
from collections import OrderedDict
from concurrent.futures import Future

import torch

from ..tiers.entry import digest

FIELDS = ("head", "logical", "ref_pos", "score", "ref_key", "value")
LEDGER = ("head", "logical", "ref_pos")  # stored as int32, handed back as int64
BUFFER_PAGES = 2  # a layer's buffers are flushed past this many pages' worth of tokens
# A version in the index (JSON, in the manifest): [key, page, seq, tokens, bytes, digest]
KEY, PAGE, SEQ, TOKENS, BYTES, DIGEST = range(6)


def empty_tokens() -> dict[str, torch.Tensor]:
    return {k: torch.empty(0, dtype=torch.long) for k in FIELDS}


def concat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    parts = [p for p in parts if p["logical"].numel()]
    return {k: torch.cat([p[k] for p in parts]) for k in FIELDS} if parts else empty_tokens()


def select(tokens: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    inside = (tokens["logical"] >= start) & (tokens["logical"] < end)
    return {k: v[inside] for k, v in tokens.items()}


def nbytes(tokens: dict[str, torch.Tensor]) -> int:
    return sum(v.nbytes for v in tokens.values())


def _widen(tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.long() if k in LEDGER else v for k, v in tokens.items()}


def versions_of(state: dict) -> list[tuple[str, int, int, str]]:
    """``(key, layer, page, digest)`` of every version a saved spill index names."""
    return [(v[KEY], layer_idx, v[PAGE], v[DIGEST]) for layer_idx, layer in enumerate(state["index"]) for v in layer]


class PageRuns:
    """A set of logical pages kept as sorted runs of consecutive pages, ``[[start, end), ...]``.

    Why runs: the pages the spill cap dropped were a dict with an entry per page, so it grew with the
    session (15,564 entries after a 1M-token session), and every save wrote it whole into
    the manifest and read it back (the manifest grew from 181 KB to 439 KB a save). The cap drops the
    least recently used pages, which in a long session are nearly every page behind the ones the spill
    still holds: as runs, the set costs one run per gap, and a gap is a page held, never spilled, or
    still resident, so its size is bounded by the cap and the cache, not by the session's length (one
    run at the end of that session)."""

    def __init__(self, runs=()):
        self.starts: list[int] = []
        self.ends: list[int] = []
        for start, end in sorted((int(start), int(end)) for start, end in runs):
            if end <= start:
                raise ValueError(f"a run of pages is [start, end) with start < end, got [{start}, {end})")
            if self.ends and start <= self.ends[-1]:  # overlapping or adjacent: one run
                self.ends[-1] = max(self.ends[-1], end)
            else:
                self.starts.append(start)
                self.ends.append(end)

    def __contains__(self, page: int) -> bool:
        i = bisect.bisect_right(self.starts, page) - 1
        return i >= 0 and page < self.ends[i]

    def add(self, page: int) -> None:
        i = bisect.bisect_right(self.starts, page) - 1  # the run starting at or before page
        if i >= 0 and page < self.ends[i]:
            return
        joins_left = i >= 0 and self.ends[i] == page
        joins_right = i + 1 < len(self.starts) and self.starts[i + 1] == page + 1
        if joins_left and joins_right:
            self.ends[i] = self.ends[i + 1]
            del self.starts[i + 1], self.ends[i + 1]
        elif joins_left:
            self.ends[i] = page + 1
        elif joins_right:
            self.starts[i + 1] = page
        else:
            self.starts.insert(i + 1, page)
            self.ends.insert(i + 1, page + 1)

    def __len__(self) -> int:
        """Runs, not pages: the size a save writes."""
        return len(self.starts)

    def pages(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends))

    def runs(self) -> list[list[int]]:
        return [[s, e] for s, e in zip(self.starts, self.ends)]


class SpillLog:
    """Per-layer, per-page buffers of evicted tokens, their versions in the store, and the index to find them."""

    def __init__(self, store, session_id: str, fingerprint: str, n_layers: int, page_tokens: int = 64,
                 cap_bytes: int | None = None):
        self.store, self.session_id, self.fingerprint = store, session_id, fingerprint
        self.page_tokens, self.cap_bytes = page_tokens, cap_bytes
        self.pages: list[dict[int, list[list]]] = [{} for _ in range(n_layers)]  # page -> versions, oldest first
        self.buffers: list[dict[int, list[dict]]] = [{} for _ in range(n_layers)]  # page -> evicted tokens
        self.buffered = [0] * n_layers  # tokens in each layer's buffers
        self.heads = [1] * n_layers  # KV heads seen per layer (a full page is page_tokens per head)
        self.writer = secrets.token_hex(4)
        self.next_seq = 0
        self.spilled_tokens = 0
        self.held_bytes = 0  # payload bytes of the versions in the index
        self.recent: OrderedDict[int, None] = OrderedDict()  # logical pages, least recently used first
        self.capped = PageRuns()  # pages the cap dropped tokens from (runs: bounded, see PageRuns)
        self.unconfirmed: dict[str, Future] = {}  # key -> its write's confirmation, until a save checks it
        self.saved_keys: set[str] = set()  # versions the session's current save indexes (deleted only after the next)
        self.generation: str | None = None  # the save this log continues (set by save and resume)
        self.tier_errors: dict[str, int] = {}  # each durable tier's error count when a save last confirmed it
        self.stats = {"bytes_written": 0, "versions_written": 0, "bytes_read": 0, "versions_read": 0,
                      "bytes_returned": 0, "capped_pages": 0, "capped_bytes": 0, "capped_requests": 0}
        self._warned = False

    # -- writing ---------------------------------------------------------------------------------------
    def add(self, layer_idx: int, tokens: dict[str, torch.Tensor]) -> None:
        """Buffer evicted tokens (copied to the CPU) by page; write the pages that are full."""
        if tokens["logical"].numel() == 0:
            return
        tokens = {k: v.detach().to("cpu", dtype=torch.int32 if k in LEDGER else v.dtype) for k, v in tokens.items()}
        self.spilled_tokens += tokens["logical"].numel()
        self.heads[layer_idx] = max(self.heads[layer_idx], int(tokens["head"].max()) + 1)
        full = self.page_tokens * self.heads[layer_idx]
        buffers = self.buffers[layer_idx]
        # One stable sort by page, then a split: a mask per page would read every evicted token once per
        # page (a prefill chunk evicts tokens of ~chunk/page_tokens pages per layer).
        page_of, order = torch.sort(tokens["logical"] // self.page_tokens, stable=True)
        pages, counts = (t.tolist() for t in torch.unique_consecutive(page_of, return_counts=True))
        split = {k: v[order].split(counts) for k, v in tokens.items()}  # v[order] is a copy: the caller's stays
        for page in pages:  # in use: the cap drops other pages first
            self._touch(page)
        for i, page in enumerate(pages):
            part = {k: parts[i].clone() for k, parts in split.items()}  # a buffered part holds only its own tokens
            buffers.setdefault(page, []).append(part)
            self.buffered[layer_idx] += part["logical"].numel()
            if sum(p["logical"].numel() for p in buffers[page]) >= full:
                self.flush_page(layer_idx, page)
        if self.buffered[layer_idx] > BUFFER_PAGES * full:
            sizes = sorted(((sum(p["logical"].numel() for p in parts), page) for page, parts in buffers.items()),
                           reverse=True)
            for _, page in sizes:
                if self.buffered[layer_idx] <= full:
                    break
                self.flush_page(layer_idx, page)

    def flush_page(self, layer_idx: int, page: int) -> None:
        parts = self.buffers[layer_idx].pop(page, None)
        if parts:
            tokens = concat(parts)
            self.buffered[layer_idx] -= tokens["logical"].numel()
            self._write(layer_idx, page, tokens)

    def flush(self) -> None:
        for layer_idx, buffers in enumerate(self.buffers):
            for page in sorted(buffers):
                self.flush_page(layer_idx, page)

    def _write(self, layer_idx: int, page: int, tokens: dict[str, torch.Tensor]) -> None:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        key = f"L{layer_idx}/spill/p{page}/{self.writer}-{seq}"
        meta = {"layer": layer_idx, "page": page, "seq": seq}
        self.unconfirmed[key] = self.store.put(key, tokens, meta, fingerprint=self.fingerprint,
                                               session_id=self.session_id)
        size = nbytes(tokens)
        self.pages[layer_idx].setdefault(page, []).append(
            [key, page, seq, tokens["logical"].numel(), size, digest(tokens, meta)])
        self.held_bytes += size
        self.stats["bytes_written"] += size
        self.stats["versions_written"] += 1
        self._touch(page)
        self._enforce_cap()

    # -- the cap ---------------------------------------------------------------------------------------
    def _touch(self, page: int) -> None:
        self.recent[page] = None
        self.recent.move_to_end(page)

    def _enforce_cap(self) -> None:
        """Drop least recently used pages (every layer) until the held bytes fit the cap; the page used
        last always stays."""
        while self.cap_bytes is not None and self.held_bytes > self.cap_bytes and len(self.recent) > 1:
            page, _ = self.recent.popitem(last=False)
            dropped = 0
            for layer_idx in range(len(self.pages)):
                versions = self.pages[layer_idx].pop(page, [])
                dropped += sum(v[TOKENS] for v in versions)
                self.stats["capped_bytes"] += sum(v[BYTES] for v in versions)
                self._retire(versions)
                for part in self.buffers[layer_idx].pop(page, []):
                    dropped += part["logical"].numel()
                    self.buffered[layer_idx] -= part["logical"].numel()
            if dropped:
                self.capped.add(page)
                self.stats["capped_pages"] += 1

    def _retire(self, versions: list[list]) -> None:
        """Versions that left the index: deleted now, unless the current save names them (then the next
        save deletes them once it replaces that one)."""
        for v in versions:
            self.held_bytes -= v[BYTES]
            self.unconfirmed.pop(v[KEY], None)
            if v[KEY] not in self.saved_keys:  # no save names it: nothing reads it again
                self.store.delete(v[KEY], session_id=self.session_id, background=True)

    # -- reading ---------------------------------------------------------------------------------------
    def _span_pages(self, start: int, end: int) -> range:
        return range(start // self.page_tokens, (end - 1) // self.page_tokens + 1)

    def keys_for(self, start: int, end: int) -> list[str]:
        """Every version of every page that ``[start, end)`` covers, in every layer."""
        pages = self._span_pages(start, end)
        return [v[KEY] for layer in self.pages for page in pages for v in layer.get(page, [])]

    def fetch(self, start: int, end: int) -> tuple[list, Future]:
        """Start fetching the pages of ``[start, end)`` in the background. Pass the result to
        :meth:`collect`, which adds what was written or buffered since."""
        wanted = self.keys_for(start, end)
        return wanted, self.store.prefetch(wanted, fingerprint=self.fingerprint, session_id=self.session_id)

    def collect(self, start: int, end: int, fetch: tuple[list, Future]):
        """``(tokens, pages)``: the evicted tokens of ``[start, end)`` per layer, oldest copy first, and
        every page read whole, ``{(layer, page): its tokens}``, for :meth:`settle`. Versions retired
        since the prefetch are ignored (what they held is resident or in a newer version); a version that
        is missing or fails verification is left out (the store counts it), so a restore brings back what
        it can, and its page is not settled."""
        wanted, future = fetch
        got = dict(zip(wanted, future.result()))
        late = [key for key in self.keys_for(start, end) if key not in got]
        if late:
            got.update(zip(late, self.store.get_many(late, fingerprint=self.fingerprint, session_id=self.session_id)))
        pages = self._span_pages(start, end)
        asked = [p for p in pages if p in self.capped]
        if asked:
            self.stats["capped_requests"] += len(asked)
            if not self._warned:
                self._warned = True
                warnings.warn(f"restore of [{start}, {end}) asks for {len(asked)} spill page(s) that the spill cap "
                              f"({self.cap_bytes} bytes) dropped: only what is left comes back (counted in "
                              "tier_stats['spill']['capped_requests'])", stacklevel=4)
        tokens, whole = {}, {}
        for layer_idx, layer in enumerate(self.pages):
            parts = []
            for page in pages:
                values = [got.get(v[KEY]) for v in layer.get(page, [])]
                read = [value[0] for value in values if value is not None]
                self.stats["versions_read"] += len(read)
                self.stats["bytes_read"] += sum(nbytes(t) for t in read)
                merged = concat(read + self.buffers[layer_idx].get(page, []))
                if merged["logical"].numel() == 0:
                    continue
                if all(value is not None for value in values):
                    whole[(layer_idx, page)] = merged
                parts.append(select(merged, start, end))
            tokens[layer_idx] = _widen(concat(parts))
            self.stats["bytes_returned"] += nbytes(tokens[layer_idx])
        return tokens, whole

    def settle(self, layer_idx: int, pages: dict, resident: torch.Tensor) -> None:
        """After a restore inserted a layer's tokens (``resident``: its logical positions, ``[kv_heads,
        n]``), the pages read whole keep only what is not resident: one new version holds the rest, and
        the page's older versions and buffer are retired."""
        resident = resident.cpu()
        for (layer, page), merged in pages.items():
            if layer != layer_idx:
                continue
            head, logical = merged["head"].long(), merged["logical"].long()
            hit = torch.zeros(logical.numel(), dtype=torch.bool)
            for h in head.unique().tolist():
                mine = head == h
                hit[mine] = torch.isin(logical[mine], resident[h])
            self._touch(page)
            if not hit.any():
                continue
            self._retire(self.pages[layer_idx].pop(page, []))
            for part in self.buffers[layer_idx].pop(page, []):
                self.buffered[layer_idx] -= part["logical"].numel()
            if not hit.all():
                self._write(layer_idx, page, {k: v[~hit] for k, v in merged.items()})

    # -- saves -----------------------------------------------------------------------------------------
    @property
    def index(self) -> list[list[list]]:
        """Per layer, every version in the index, in the order written."""
        return [sorted((v for versions in layer.values() for v in versions), key=lambda v: v[SEQ])
                for layer in self.pages]

    def entries(self) -> dict[str, tuple[int, str]]:
        """Every version in the index: key -> (layer, digest)."""
        return {v[KEY]: (layer_idx, v[DIGEST]) for layer_idx, layer in enumerate(self.pages)
                for versions in layer.values() for v in versions}

    def forget(self, keys) -> None:
        """Take ``keys`` out of the index (versions no tier holds any more: their tokens are lost)."""
        keys = set(keys)
        for layer in self.pages:
            for page in list(layer):
                kept = [v for v in layer[page] if v[KEY] not in keys]
                self.held_bytes -= sum(v[BYTES] for v in layer[page] if v[KEY] in keys)
                if kept:
                    layer[page] = kept
                else:
                    del layer[page]
        for key in keys:
            self.unconfirmed.pop(key, None)

    def saved(self, generation: str) -> None:
        """A save of ``generation`` committed with the current index."""
        self.generation = generation
        self.saved_keys = set(self.entries())

    def state(self) -> dict:
        """The index and counters a save records (the writer is not: a resumed log writes under a new one)."""
        return {"index": self.index, "spilled_tokens": self.spilled_tokens, "page_tokens": self.page_tokens,
                "cap_bytes": self.cap_bytes, "capped": self.capped.runs(), "heads": self.heads}

    def load(self, state: dict, generation: str) -> None:
        self.pages = [{} for _ in state["index"]]
        for layer_idx, layer in enumerate(state["index"]):
            for v in sorted(layer, key=lambda v: v[SEQ]):
                self.pages[layer_idx].setdefault(v[PAGE], []).append(list(v))
        every = sorted((v for layer in state["index"] for v in layer), key=lambda v: v[SEQ])
        self.next_seq = every[-1][SEQ] + 1 if every else 0
        self.held_bytes = sum(v[BYTES] for v in every)
        for v in every:
            self._touch(v[PAGE])
        self.spilled_tokens, self.page_tokens = state["spilled_tokens"], state["page_tokens"]
        self.cap_bytes, self.heads = state["cap_bytes"], list(state["heads"])
        capped = state["capped"]  # runs; a save before issue 68 wrote {page: tokens dropped}
        self.capped = PageRuns((int(p), int(p) + 1) for p in capped) if isinstance(capped, dict) else PageRuns(capped)
        self.saved(generation)
