"""Evicted context is searchable: when a turn arrives, find the evicted pages it asks about and
restore them before the turn is prefilled.

The symbol planner brings back messages that *define an identifier* a turn names; a question about a
fact written in prose, or a needle in a document, names none. ``PageRetriever`` ranks the evicted
context itself against the turn's text and restores the best pages through the tiers
(``cache.restore``: exactly re-rotated, planned for the current step so their foresight bonus keeps
them).

Pages. The context seen so far is cut into fixed windows of logical positions: page ``k`` is
``[k * page_tokens, (k + 1) * page_tokens)``, extended by ``overlap`` positions into the next page, so
that a short fact cut by a page edge is still whole in one page. A page is a candidate when some layer
and KV head has evicted some of its positions.

Where the text comes from. A cache holds keys and values, not token ids; the caller owns the
conversation's ids (``PACESession`` keeps every message's ids; a ``generate`` user has the prompt it
passed). So ``cache.retrieve(text, ids=..., tokenizer=...)`` takes them, and a page's text is the
tokenizer's decoding of its ids. Nothing is saved with the session: after ``resume`` the index is
rebuilt from the same ids.

Signals (``signal=``):
- ``"lexical"`` (default): BM25 (the ``bm25s`` package) over the lower-cased words of each page's text
  against the turn's words, English stop words removed (:func:`words_of`). A compound identifier is
  also its parts (``retry_budget``, ``retryBudget``: ``retry``, ``budget``), because a turn about code
  writes names as words as often as it quotes them. A page that shares no word scores 0 and is never
  restored. A page holding the line that *defines* a compound name the turn names, or a name it quotes
  as code (``def``, ``class``, ``NAME =`` and the like), scores ``definition_boost`` (1.5) times as
  much: a name is used on many pages and defined on one, and the definition is what a turn about it
  needs.
- ``"digest"``: Quest-style key digests. For every block of ``digest_tokens`` positions, the
  per-channel min and max of layer 0's keys; a page scores the largest upper bound
  ``sum_d max(q_d * min_d, q_d * max_d)`` of any block, over the turn's layer-0 queries (max over query
  tokens, mean over query heads). Keys and queries are taken *before* rotation: a restored page is
  re-rotated to a new, near position anyway, and scoring rotated keys at their old positions would
  mix the rotary gap into the signal. In layer 0 a key depends on its token alone, so the digests are
  computed from the page's ids (embedding and layer 0's projections, nothing more) and kept.
- ``"both"``: reciprocal-rank fusion of the two rankings.

Following links (``follow=True``, off by default). A question can name only the first link of a chain:
RULER's variable tracking asks for every variable assigned a value, and only ``VAR A = 12345`` holds
that value; ``VAR B = VAR A`` is found through ``A``. With ``follow``, a page taken (or the resident
pages among the first ones ranked) is read for its *hit lines*, the lines that hold the query's rarest
word (on the fewest pages, and of those the one the tokenizer splits most: rare in the language too).
Their words that occur in at most ``link_pages`` other pages are links, and the lines holding them
elsewhere (the next line included) are taken next, before the next page of the ranking, each searched
in turn with the link that led to it. A word found on every page (filler, syntax) or on none (a
needle's value) leads nowhere, so a question with no chain restores what it did without ``follow``; a
page that matches only the question's common words (an instruction, a worked example) leads nowhere
either. A word belongs to the page of its first token, so a value cut by a page edge still counts.

Block rests (``blocks=True``, the default). A ranked page whose hit line opens an indented block (a
``def``, a ``class``, a config section; ``cat -n`` numbers or not) is followed by the block's rest, as
far as the share allows: a function is mostly body, and the page naming it holds little of that.

Budget share. Restores stop at ``share`` tokens per KV head (default ``budget // 4``): a span costs the
largest count, over layers and heads, of its positions that are not resident, and spans are taken in
order while they fit. A turn can therefore never push more than ``share`` planned tokens into the
working set. A share smaller than a page (a budget under 576 with the default pages) takes the best
page's ``share`` positions around the turn's rarest word instead.

No store, or nothing spilled yet: a no-op. Counters go to ``cache.tier_stats``:
``retrieval_pages_scored``, ``retrieval_pages_restored``, ``retrieval_tokens_restored``,
``retrieval_seconds``.
"""

from __future__ import annotations

import itertools
import re
import time
from typing import NamedTuple

import torch
from bm25s.stopwords import STOPWORDS_EN

from ..blueprint import Span, as_index
from ..binding import decoder_of
from ..planner.prose import bm25_index, split_name

SIGNALS = ("lexical", "digest", "both")
STAT_KEYS = ("retrieval_pages_scored", "retrieval_pages_restored", "retrieval_tokens_restored",
             "retrieval_seconds")
RRF_K = 60  # reciprocal-rank fusion's usual constant
_WORD = re.compile(r"(?u)\b\w\w+\b")  # bm25s's own token pattern and English stop words
_WORD_CHAR = re.compile(r"\w")
_WORD_REACH = 16  # the most tokens one word is looked for past a page edge
_STOPWORDS = frozenset(STOPWORDS_EN)


def words_of(texts: list[str]) -> list[list[str]]:
    """Each text's lower-cased words of two or more characters, English stop words removed, and for a
    compound identifier its parts too: ``RETRY_BUDGET`` and ``retryBudget`` are also ``retry`` and
    ``budget``, so a turn that writes a name as words ("the retry budget") finds the page defining it.
    A text with no compound word gives exactly bm25s's own tokens."""
    out = []
    for text in texts:
        doc = []
        for word in _WORD.findall(text):
            low = word.lower()
            if low not in _STOPWORDS:
                doc.append(low)
            parts = split_name(word)
            if len(parts) > 1:
                doc += [p for p in parts if len(p) > 1 and p not in _STOPWORDS]
        out.append(doc)
    return out


_CAT_N = r" *\d+\t"  # `cat -n`'s prefix of a line
_LINE_NUMBER = re.compile("^" + _CAT_N)
# A line that defines a name: a keyword of a common language before it, or an assignment to it at the
# line's start (`cat -n` numbers allowed).
_DEFINITION = re.compile(
    rf"^(?:{_CAT_N})?[ \t]*(?:(?:(?:async|export|pub|public|private|static)\s+)*"
    r"(?:def|class|function|func|fn|struct|interface|enum|type|const|let|var)\s+(?P<kw>\w+)"
    r"|(?P<assigned>\w+)\s*(?::[^=\n]*)?=(?!=))", re.MULTILINE)
_QUOTED_NAME = re.compile(r"`([A-Za-z_][\w.]*)`")  # a name quoted as code, `name` or `Class.method`


def _indent(text: str) -> int:
    """A line's indentation in columns (a tab counts as 4), after a `cat -n` line number if it has one."""
    text = _LINE_NUMBER.sub("", text, count=1).expandtabs(4)
    return len(text) - len(text.lstrip(" "))


class _StopAfterProjections(Exception):
    """Raised from a hook once layer 0's query and key projections have run: nothing after them is needed."""


def layer0_projections(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's query and key projections (before rotation) of ``ids`` ([batch, n]): ``q`` as
    ``[batch, n, heads, head_dim]`` and ``k`` as ``[batch, n, kv_heads, head_dim]``. The model runs only
    up to those projections."""
    decoder = decoder_of(model)
    layers = getattr(decoder, "layers", None)
    attn = getattr(layers[0], "self_attn", None) if layers is not None and len(layers) else None
    if attn is None or not all(hasattr(attn, name) for name in ("q_proj", "k_proj")):
        raise NotImplementedError("the digest signal needs a decoder whose first layer has self_attn.q_proj and "
                                  "self_attn.k_proj (fused projections are not supported); use signal='lexical'")
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    got: dict[str, torch.Tensor] = {}

    def grab(name):
        def hook(module, args, output):
            got[name] = output
            if len(got) == 2:
                raise _StopAfterProjections

        return hook

    handles = [attn.q_proj.register_forward_hook(grab("q")), attn.k_proj.register_forward_hook(grab("k"))]
    try:
        with torch.no_grad():
            decoder(input_ids=ids.to(model.device), use_cache=False)
    except _StopAfterProjections:
        pass
    finally:
        for h in handles:
            h.remove()
    b, n = ids.shape
    return (got["q"].float().reshape(b, n, -1, head_dim).cpu(), got["k"].float().reshape(b, n, -1, head_dim).cpu())


class Line(NamedTuple):
    """One line of the context: its positions ``[start, end)``, its words and its text."""
    start: int
    end: int
    words: set[str]
    text: str


class PageRetriever:
    """The page index of one session (see the module docstring).

    Args:
        tokenizer: decodes page ids to text and encodes the turn's text.
        page_tokens / overlap: page width and how far a page reaches into the next one.
        share: the most tokens per KV head one turn restores (default: the cache's ``budget // 4``).
        signal: ``"lexical"``, ``"digest"`` or ``"both"``.
        digest_tokens: positions per key digest (Quest's page).
        definition_boost: the factor on the lexical score of a page that defines a name the turn names
            (:meth:`defining`; 1: off).
        blocks: after a ranked page whose hit line opens an indented block, restore the block's rest.
        follow / link_pages: follow links from the pages taken (see the module docstring), to words that
            occur in at most ``link_pages`` other pages.
    """

    def __init__(self, tokenizer, *, page_tokens: int = 128, overlap: int = 16, share: int | None = None,
                 signal: str = "lexical", digest_tokens: int = 16, blocks: bool = True, follow: bool = False,
                 link_pages: int = 2, definition_boost: float = 1.5):
        self.page_tokens, self.overlap = as_index(page_tokens, "page_tokens"), as_index(overlap, "overlap")
        self.digest_tokens = as_index(digest_tokens, "digest_tokens")
        if self.page_tokens < 1 or self.overlap < 0 or self.digest_tokens < 1:
            raise ValueError(f"page_tokens and digest_tokens must be >= 1 and overlap >= 0 (got page_tokens={page_tokens}, "
                             f"digest_tokens={digest_tokens}, overlap={overlap})")
        self.share = None if share is None else as_index(share, "share")
        if self.share is not None and self.share < 1:
            raise ValueError(f"share must be >= 1, got {share}")
        if signal not in SIGNALS:
            raise ValueError(f"unknown signal {signal!r}; choose from {', '.join(SIGNALS)}")
        if tokenizer is None:
            raise ValueError("a PageRetriever needs the tokenizer of the model (to read page text)")
        self.link_pages = as_index(link_pages, "link_pages")
        if self.link_pages < 1:
            raise ValueError(f"link_pages must be >= 1, got {link_pages}")
        self.tokenizer, self.signal, self.blocks, self.follow = tokenizer, signal, bool(blocks), bool(follow)
        self.definition_boost = float(definition_boost)
        if not self.definition_boost >= 1.0:
            raise ValueError(f"definition_boost must be >= 1 (1: off), got {definition_boost}")
        self._texts: list[str] = []  # page k's text, for the pages complete when it was decoded
        self._ids: list[int] = []  # the ids the texts were decoded from (a different history re-decodes)
        self._digests: list[torch.Tensor] = []  # per block: [2, kv_heads, head_dim] (min, max)
        self._digest_ids: list[int] = []
        self._cores: list[set[str]] = []  # page k's words over its own positions (see core_words)
        self._core_ids: list[int] = []
        self._counts: dict[str, int] = {}  # word -> on how many pages of _cores it is

    # -- the index ------------------------------------------------------------------------------------
    def pages(self, seen: int) -> list[tuple[int, int]]:
        """The spans ``[start, end)`` of the pages of the first ``seen`` positions."""
        p = self.page_tokens
        return [(s, min(s + p + self.overlap, seen)) for s in range(0, seen, p)]

    def texts(self, ids: list[int]) -> list[str]:
        """Page texts of ``ids``, decoding only what changed since the last call."""
        spans = self.pages(len(ids))
        keep = 0  # pages decoded before whose ids (overlap included) are unchanged
        while (keep < len(self._texts) and keep < len(spans) and spans[keep][1] <= len(self._ids)
               and self._ids[spans[keep][0]:spans[keep][1]] == ids[spans[keep][0]:spans[keep][1]]
               and spans[keep][1] - spans[keep][0] == self.page_tokens + self.overlap):
            keep += 1
        self._texts = self._texts[:keep] + [self.tokenizer.decode(ids[s:e], skip_special_tokens=True)
                                            for s, e in spans[keep:]]
        self._ids = list(ids)
        return self._texts

    def defining(self, ids: list[int], query: str) -> set[int]:
        """Pages holding a line that defines a name the query names: a compound name, quoted or as its
        words (``bevo_kigo``, "the bevo kigo method"), or any name it quotes as code (`settle`,
        `Ledger.settle`; a plain one-word name could be any word). A definition outranks its uses."""
        words = set(words_of([query])[0])
        quoted = {m.group(1).split(".")[-1].lower() for m in _QUOTED_NAME.finditer(query)}
        out = set()
        for k, text in enumerate(self.texts(ids)):
            for m in _DEFINITION.finditer(text):
                name = m.group("kw") or m.group("assigned")
                parts = [p for p in split_name(name) if len(p) > 1]
                compound = len(parts) >= 2 and (name.lower() in words or all(p in words for p in parts))
                if compound or name.lower() in quoted:
                    out.add(k)
                    break
        return out

    def lexical_scores(self, ids: list[int], query: str) -> torch.Tensor:
        """BM25 score of every page of ``ids`` against ``query`` (0 where they share no word)."""
        texts = self.texts(ids)
        words = words_of(texts)
        query_words = words_of([query])[0]
        if not query_words or not any(words):
            return torch.zeros(len(texts))
        return torch.as_tensor(bm25_index(words).get_scores(query_words), dtype=torch.float32)

    def digest_scores(self, model, ids: list[int], query: str) -> torch.Tensor:
        """Quest-style upper bound of layer-0 attention from the turn's queries to every page."""
        d = self.digest_tokens
        full = len(ids) // d
        done = min(len(self._digests), full)
        if self._digest_ids[: done * d] != ids[: done * d]:  # another history: recompute
            done = 0
        self._digests, self._digest_ids = self._digests[:done], list(ids)
        blocks = [ids[i * d:(i + 1) * d] for i in range(done, full)]
        for at in range(0, len(blocks), 256):
            _, k = layer0_projections(model, torch.tensor(blocks[at:at + 256], dtype=torch.long))
            self._digests += list(torch.stack([k.amin(1), k.amax(1)], 1))  # [blocks, 2, kv, hd]
        tail = ids[full * d:]
        digests = list(self._digests)
        if tail:
            _, k = layer0_projections(model, torch.tensor([tail], dtype=torch.long))
            digests.append(torch.stack([k.amin(1), k.amax(1)], 1)[0])
        q_ids = self.tokenizer(query, add_special_tokens=False)["input_ids"]
        if not q_ids or not digests:
            return torch.zeros(len(self.pages(len(ids))))
        q, _ = layer0_projections(model, torch.tensor([q_ids], dtype=torch.long))
        q = q[0]  # [t, heads, hd]
        dig = torch.stack(digests)  # [blocks, 2, kv, hd]
        group = q.shape[1] // dig.shape[2]
        lo, hi = (dig[:, i].repeat_interleave(group, dim=1) for i in (0, 1))  # [blocks, heads, hd]
        bound = torch.maximum(q[:, None] * lo[None], q[:, None] * hi[None]).sum(-1)  # [t, blocks, heads]
        per_block = bound.mean(-1).amax(0)  # [blocks]
        scores = []
        for s, e in self.pages(len(ids)):
            scores.append(per_block[s // d: (e + d - 1) // d].max())
        return torch.stack(scores)

    def rank(self, ids: list[int], query: str, model=None) -> tuple[list[int], torch.Tensor]:
        """Page numbers in rank order (best first) and the scores of the chosen signal (for ``"both"``,
        the fused score). Lexically, pages that share no word with ``query`` are left out."""
        if self.signal == "lexical":
            scores = self.lexical_scores(ids, query)
            if self.definition_boost != 1.0:
                for k in self.defining(ids, query):
                    scores[k] *= self.definition_boost
            order = [int(i) for i in scores.argsort(descending=True, stable=True) if scores[i] > 0]
            return order, scores
        if model is None:
            raise ValueError(f"signal={self.signal!r} needs the model (for layer 0's keys and queries)")
        digest = self.digest_scores(model, ids, query)
        if self.signal == "digest":
            return [int(i) for i in digest.argsort(descending=True, stable=True)], digest
        lexical = self.lexical_scores(ids, query)
        fused = torch.zeros_like(digest)
        lexical_order = [int(i) for i in lexical.argsort(descending=True, stable=True) if lexical[i] > 0]
        for order in (lexical_order, digest.argsort(descending=True, stable=True).tolist()):
            for r, i in enumerate(order):
                fused[i] += 1.0 / (RRF_K + r + 1)
        return [int(i) for i in fused.argsort(descending=True, stable=True)], fused

    # -- choosing -------------------------------------------------------------------------------------
    def choose(self, ids: list[int], query: str, share: int, cost, model=None):
        """The spans to restore for ``query``, in order: yields each ``(start, end)`` whose ``cost(start,
        end)`` (tokens per KV head not resident, read when the span comes up, so the caller restores each
        span before the next is costed) fits what is left of ``share``. Ranked pages come in rank order;
        with ``follow``, the lines linked from each span taken come right after it (module docstring)."""
        order, _ = self.rank(ids, query, model)
        pages = self.pages(len(ids))
        query_words = set(words_of([query])[0])
        # a ranked page anchors links only with the question's rarest words: a page matching only the
        # question's common words (an instruction, a worked example) leads nowhere
        counts = self.page_counts(ids) if self.follow else {}
        rarest = self.rarest(ids, {w for w in query_words if w in counts})
        queue = [(pages[page], query_words, rank) for rank, page in enumerate(order)]  # rank: None for a link
        top = max(1, share // (self.page_tokens + self.overlap))  # ranked pages read on even if resident
        visited, used = set(), 0
        while queue:
            span, words, rank = queue.pop(0)
            if span in visited:
                continue
            visited.add(span)
            c = cost(*span)
            if c > 0 and used + c > share:
                if used == 0 and rank is not None:  # a share smaller than a page: the best page's window instead
                    window = self.window(ids, span, words, share)
                    c = cost(*window) if window is not None else 0
                    if 0 < c <= share:
                        used += c
                        yield window
                continue
            if c > 0:
                used += c
                yield span
            elif rank is not None and rank >= top:
                continue  # a resident page far down the ranking: its block and links are not read
            after = []
            if self.blocks and rank is not None:
                rest = self.block_rest(ids, span, words, share - used)
                c = cost(*rest) if rest is not None else 0
                if c > 0:  # the rest of a block is taken only as far as it fits
                    used += c
                    yield rest
            if self.follow and used < share:
                anchors = rarest if rank is not None else None
                after = [(link, via, None) for link, via in self.links(ids, span, words, anchors)
                         if link not in visited]
            queue[0:0] = after

    def preview(self, ids: list[int], query: str, share: int, model=None) -> set[int]:
        """The positions ``query`` would restore within ``share`` were every position of ``ids`` evicted:
        what a turn reaches, measured offline without a cache."""
        taken: set[int] = set()
        for a, b in self.choose(ids, query, share, lambda a, b: len(set(range(a, b)) - taken), model):
            taken |= set(range(a, b))
        return taken

    def window(self, ids: list[int], span: tuple[int, int], words: set[str], size: int) -> tuple[int, int] | None:
        """``size`` positions of ``span`` around its rarest word of ``words`` (where a share too small
        for a whole page is best spent), or None if the span holds none of them."""
        text = self.texts(ids)[span[0] // self.page_tokens].lower()
        found = {w for w in words if w in text}
        if not found:
            return None
        word, recent = min(self.rarest(ids, found)), []
        for i in range(span[0], span[1]):
            recent = (recent + [self.tokenizer.decode([ids[i]], skip_special_tokens=True).lower()])[-8:]
            if word in "".join(recent):
                start = max(span[0], min(i - size // 2, span[1] - size))
                return start, min(span[1], start + size)
        return None

    def links(self, ids: list[int], span: tuple[int, int], words: set[str],
              anchors: set[str] | None = None) -> list[tuple[tuple[int, int], set[str]]]:
        """The lines ``span`` links to, with the link words that lead to each, best first: the words of its
        hit lines (those holding its rarest word of ``words``, or of ``anchors`` when given, if that word
        is on at most ``link_pages`` pages) found on at most ``link_pages`` other pages; each link is a line
        outside the span holding the word (on another page, or on the same page: a chain's next link can be
        the next line)."""
        cores = self.core_words(ids)
        p = self.page_tokens
        df = self.page_counts(ids)
        lines = [line for line in self.lines(ids, max(0, span[0] - p), min(len(ids), span[1] + p))
                 if line.start < span[1] and line.end > span[0]]  # whole lines, where they cross the span's edges
        anchors = self.rarest(ids, {w for w in (words if anchors is None else words & anchors)
                                    if any(w in line.words for line in lines)})
        if not anchors or df.get(next(iter(anchors)), 0) > self.link_pages:
            return []  # the span holds no word rare enough to anchor a link
        hits = [line for line in lines if line.words & anchors]
        hit = set().union(*(line.words for line in hits)) - words
        read = [span, *((line.start, line.end) for line in hits)]
        own = {k for a, b in read for k in range(a // p, (b - 1) // p + 1)}  # the pages of the span and its hit lines
        targets: dict[tuple[int, int], set[str]] = {}
        for w in hit:
            holders = [j for j, core in enumerate(cores) if w in core]
            if len([j for j in holders if j not in own]) > self.link_pages:
                continue
            for j in holders:  # its lines elsewhere, on other pages or on the rest of a linked line's page
                for line in self.lines(ids, max(0, j * p - p), min(len(ids), (j + 2) * p)):
                    if (w in line.words and line.start < (j + 1) * p and line.end > j * p
                            and all(line.end <= a or line.start >= b for a, b in read)):
                        start, end = line.start, line.end
                        if end - start > p + self.overlap:  # a long line: its page instead
                            start, end = j * p, min(len(ids), (j + 1) * p + self.overlap)
                        targets.setdefault((start, end), set()).add(w)
        return sorted(targets.items(), key=lambda item: (-len(item[1]), item[0]))

    def lines(self, ids: list[int], start: int, end: int) -> list["Line"]:
        """The lines of positions ``[start, end)``, cut after each token whose text holds a newline. A
        line's text starts with what such a token holds after its last newline (its indentation: BPE
        tokenizers merge a newline with the spaces after it)."""
        out, first, text = [], start, []
        for i in range(start, end):
            piece = self.tokenizer.decode([ids[i]], skip_special_tokens=True)
            if "\n" in piece:
                out.append((first, i + 1, "".join(text) + piece.split("\n", 1)[0]))
                first, text = i + 1, [piece.rsplit("\n", 1)[1]]
            else:
                text.append(piece)
        if first < end:
            out.append((first, end, "".join(text)))
        return [Line(a, b, set(w), t) for (a, b, t), w in zip(out, words_of([t for _, _, t in out]))]

    def core_words(self, ids: list[int]) -> list[set[str]]:
        """Each page's words over its own positions only (no overlap): where a link word *is*. A word
        belongs to the page of its first token (``48213`` cut by a page edge is still one word, on one
        page). Like :meth:`texts`, only pages whose ids changed since the last call are decoded again."""
        p, reach = self.page_tokens, _WORD_REACH
        keep = 0  # pages read before whose ids (and the next page's first tokens) are unchanged
        while (keep < len(self._cores) and (keep + 1) * p + reach <= min(len(ids), len(self._core_ids))
               and self._core_ids[keep * p:(keep + 1) * p + reach] == ids[keep * p:(keep + 1) * p + reach]):
            keep += 1
        if keep < len(self._cores) or keep * p < len(ids):
            edges = [self._word_start(ids, s) for s in range(keep * p, len(ids), p)] + [len(ids)]
            edges = list(itertools.accumulate(edges, max))  # a long word can reach past a whole page
            fresh = words_of([self.tokenizer.decode(ids[a:b], skip_special_tokens=True)
                              for a, b in zip(edges, edges[1:])])
            self._cores = self._cores[:keep] + [set(w) for w in fresh]
            self._counts = {}
            for core in self._cores:
                for w in core:
                    self._counts[w] = self._counts.get(w, 0) + 1
        self._core_ids = list(ids)
        return self._cores

    def _word_start(self, ids: list[int], i: int) -> int:
        """The first position from ``i`` (within ``_WORD_REACH``) whose token does not go on with a word
        that the token before it began."""
        for j in range(i, min(len(ids), i + _WORD_REACH)):
            if j == 0 or not (_WORD_CHAR.match(self.tokenizer.decode([ids[j]], skip_special_tokens=True)[:1])
                              and _WORD_CHAR.match(self.tokenizer.decode([ids[j - 1]], skip_special_tokens=True)[-1:])):
                return j
        return min(len(ids), i + _WORD_REACH)

    def rarest(self, ids: list[int], words: set[str]) -> set[str]:
        """The rarest of ``words`` in ``ids``: those on the fewest pages, and of those the ones the tokenizer
        splits into the most pieces (rare in the language too: a needle's value or a made-up name, not
        "assigned"). A link is anchored, a window centred and a block opened on such a word."""
        if not words:
            return set()
        counts = self.page_counts(ids)
        fewest = min(counts.get(w, 0) for w in words)
        pieces = {w: len(self.tokenizer(w, add_special_tokens=False)["input_ids"])
                  for w in words if counts.get(w, 0) == fewest}
        return {w for w, n in pieces.items() if n == max(pieces.values())}

    def page_counts(self, ids: list[int]) -> dict[str, int]:
        """On how many pages (their own positions) each word is."""
        self.core_words(ids)
        return self._counts

    def block_rest(self, ids: list[int], span: tuple[int, int], words: set[str], most: int) -> tuple[int, int] | None:
        """Where the indented block that ``span``'s hit line opens runs on past the span: ``(span end,
        block end)``, at most ``most`` positions, or None. The hit line is the line of the span holding
        its rarest word of ``words``; its block is the lines after it indented 2 or more columns deeper
        (blank lines included), as a ``def``, a ``class`` or a config section is."""
        p = self.page_tokens
        lines = self.lines(ids, max(0, span[0] - p), min(len(ids), span[1] + most))
        inside = [i for i, line in enumerate(lines)
                  if line.start < span[1] and line.end > span[0] and line.words & words]
        if not inside or most < 1:
            return None
        rarest = self.rarest(ids, set().union(*(lines[i].words & words for i in inside)))
        at = next(i for i in inside if lines[i].words & rarest)
        base, end = _indent(lines[at].text), None
        for line in lines[at + 1:]:
            if line.text.strip():
                if _indent(line.text) < base + 2:  # a block is indented 2 or more columns deeper
                    break
                end = line.end
        if end is None or end <= span[1]:
            return None
        return span[1], min(end, span[1] + most)

    # -- restoring ------------------------------------------------------------------------------------
    @staticmethod
    def resident_prefix(cache, seen: int) -> list[torch.Tensor]:
        """Per layer, ``[kv_heads, seen + 1]`` counts of resident positions before each position: the cost
        of any span is read off it (:meth:`missing`)."""
        out = []
        for _, layer in cache.evicting_layers:
            if layer.logical is None:
                continue
            logical = layer.logical.cpu()
            resident = torch.zeros(logical.shape[0], seen + 1, dtype=torch.long)
            resident.scatter_(1, logical.clamp(max=seen), 1)
            out.append(torch.nn.functional.pad(resident[:, :seen].cumsum(1), (1, 0)))
        return out

    @staticmethod
    def missing(prefix: list[torch.Tensor], start: int, end: int) -> int:
        """The largest count, over layers and KV heads, of the positions of ``[start, end)`` not resident."""
        return max((int(((end - start) - (p[:, end] - p[:, start])).max()) for p in prefix), default=0)

    def retrieve(self, cache, text: str, ids) -> list[Span]:
        """Restore the evicted pages that ``text`` (the new turn) asks about, best first, within the share;
        returns the spans restored (each planned for ``cache.step``)."""
        if not isinstance(text, str):
            raise TypeError(f"the turn's text must be a str, got {type(text).__name__}")
        ensure_stats(cache)
        if cache.spill is None or not cache.spill.spilled_tokens:
            return []  # no store, or nothing evicted: nothing to find
        if cache.blueprint is None:
            raise ValueError("restored pages stay resident through their foresight bonus: retrieval needs a "
                             "cache with a Foresight policy (PACECache)")
        if cache.in_forward:
            raise RuntimeError("retrieve cannot run inside a forward")
        ids = ids.flatten().tolist() if torch.is_tensor(ids) else list(ids)
        seen = cache.get_seq_length()
        if len(ids) < seen:
            raise ValueError(f"ids holds {len(ids)} tokens but the cache has seen {seen}: pass the ids of "
                             "everything the cache has seen (the whole conversation so far)")
        started = time.perf_counter()
        ids = ids[:seen]
        prefix = self.resident_prefix(cache, seen)
        scored = sum(self.missing(prefix, s, e) > 0 for s, e in self.pages(seen))
        model = cache.binding.model_ref() if cache.binding is not None else None
        share = self.share if self.share is not None else cache.quotas.retrieval_share
        spans = []
        for start, end in self.choose(ids, text, share, lambda s, e: self.missing(prefix, s, e), model):
            cache.restores.stats["retrieval_tokens_restored"] += cache.restore(start, end)
            prefix = self.resident_prefix(cache, seen)  # overlapping spans now cost less
            spans.append(Span(start, end, [cache.step]))
        stats = cache.restores.stats
        stats["retrieval_pages_scored"] += scored
        stats["retrieval_pages_restored"] += len(spans)
        stats["retrieval_seconds"] += time.perf_counter() - started
        return spans


def ensure_stats(cache) -> None:
    """Start the retrieval counters of ``cache.tier_stats`` at 0."""
    for key in STAT_KEYS:
        cache.restores.stats.setdefault(key, 0.0 if key.endswith("seconds") else 0)


__all__ = ["PageRetriever", "SIGNALS", "layer0_projections"]
