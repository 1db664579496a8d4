"""pace-serve's batched decode: the turns of several sessions decoded together, one token each per forward.

Why: one worker ran one turn at a time, so with 16 sessions waiting the last one's first token came
after 15 whole turns. A decode step reads every weight of the model to make one token: it is bound by
memory bandwidth, not by arithmetic, and the same read serves every row of a batch (on this CPU 8
sessions decoded together make about 4x the tokens per second of one at a time). So the worker keeps a
set of active turns, up to ``max_batch``, and every loop runs one forward over all of them
(``pace_hf.cache.CacheRows`` over their sessions' caches: each row keeps exactly its own eviction,
positions and memory, as alone), and between steps admits the turns that wait.

Prefill and decode share the step (chunked prefill, as vLLM and SGLang schedule it): a newly admitted
turn is a row whose prompt is still to be prefilled, and each step's one forward carries every decoding
row's next token and one chunk of the first such row's prompt, packed one after another as one sequence
(``CacheRows(..., packed=...)``: no padding). So a long prompt delays the decoding rows by one chunk a
step, not by its whole prefill, and the chunk's weight read serves the decoding rows too. When a row's
last chunk is in, its first token comes from that chunk's last logits, and it decodes from the next
step on. The chunks are ``generate``'s (``session.chunk`` tokens counted from what the cache holds, each
a forward of its own, eviction at its end), so a prompt's cache and reply are those of the same prompt
prefilled alone. ``chunked_prefill=False``: each admitted turn is prefilled whole (the same chunks, back
to back) between two steps, while the decoding rows wait.

What each turn keeps as its own: its sampling (``Sampler``: greedy, or temperature / top-k / top-p as
``generate`` applies them, after the model's ``repetition_penalty`` and OpenAI's ``logit_bias`` and
presence / frequency penalties, from its own seeded generator when it has a ``seed``), its logprobs, its ``max_tokens``, its stop strings
(``StopStrings``), its stop tokens, and its cancellation. Before and after the generation a turn does exactly what
a turn alone does (``Engine._locate``, ``_lease``, ``_open``; ``_close``), so leases, saves, parking and
the index behave the same. A session is never in two active turns: its next turn waits, taken from the
queue but not admitted, until the first is done and its save has landed. A turn whose prefill or
decode fails fails alone: its session is dropped (the store holds its last turn) and its client gets
the error; the other rows go on.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import queue
import time
from dataclasses import dataclass, field

import torch
from transformers import (EpsilonLogitsWarper, EtaLogitsWarper, LogitsProcessorList, MinPLogitsWarper,
                          RepetitionPenaltyLogitsProcessor, StoppingCriteria, TemperatureLogitsWarper, TopHLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper)

from ..cache import CacheRows
from ..memory.retention import RETAIN_BUSY_S, RETAIN_IDLE_S
from .protocol import APIError

log = logging.getLogger("pace_hf.serve")

IDLE_WAIT_S = 0.5  # how long the worker waits for a turn when it has nothing to do
BLOCKED_WAIT_S = 0.05  # ... when its only turns wait for their session (a turn or save in flight)


@dataclass
class Row:
    """An active turn: its session's next token to feed, the reply so far, and how it ends."""

    opened: object  # engine.Opened
    ids: list[int]  # the prompt (conversation and generation header): stop strings may start in it
    header: list[int]
    streamer: object
    sampler: "Sampler"
    stop_strings: "StopStrings | None"
    stop_ids: set[int]
    started: float
    fed: int  # tokens of ``ids`` the cache holds: the row prefills until it holds them all
    generated: list[int] = field(default_factory=list)

    @property
    def cache(self):
        return self.opened.session.cache

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.ids)

    def next_chunk(self) -> list[int]:
        return self.ids[self.fed:self.fed + self.opened.session.chunk]


def prompt(session) -> tuple[list[int], list[int]]:
    """``(generation header ids, prompt ids)``: what ``PACESession.generate`` does before its prefill, the
    planner run, the cache's step set and the prompt checked against what the cache holds."""
    if not session.messages:
        raise ValueError("generate answers the conversation, and it has no message yet")
    if session.planner is not None:
        session.planner.plan(session)
    cache = session.cache
    cache.step = session.step
    header = session.template.encode(session.template.gen_header)
    ids = session.ids + header
    cache.check_prompt(torch.tensor([ids], dtype=torch.long))
    if cache.get_seq_length() >= len(ids):
        raise RuntimeError("the session's cache already holds the whole prompt, the generation header included")
    return header, ids


def prefill(session) -> tuple[list[int], torch.Tensor]:
    """``(generation header ids, logits of the prompt's last token)``: the prompt prefilled in chunks of
    ``session.chunk`` counted from what the cache holds (``generate``'s chunks, so the cache ends the same)."""
    header, ids = prompt(session)
    for start in range(session.cache.get_seq_length(), len(ids), session.chunk):
        logits = chunk_forward(session.model, session.cache, ids[start:start + session.chunk], start)
    return header, logits


def chunk_forward(model, cache, tokens: list[int], start: int) -> torch.Tensor:
    """One prefill chunk of a session alone (``tokens``, after the ``start`` it has seen): its last token's
    logits."""
    extra = {"logits_to_keep": 1} if _takes_logits_to_keep(model) else {}
    x = torch.tensor([tokens], dtype=torch.long, device=model.device)
    with torch.no_grad():
        return model(input_ids=x, attention_mask=torch.ones(1, start + len(tokens), dtype=torch.long,
                                                            device=model.device),
                     cache=cache, **extra).logits[0, -1]


def _takes_logits_to_keep(model) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


class StopStrings(StoppingCriteria):
    """OpenAI's ``stop``: the reply ends at the first token after which its text contains one of ``stops``.

    Why not ``transformers.StopStringCriteria``: it maps every stop string over the whole vocabulary
    first, in Python (2.0 s for 4 stop strings of 256 characters over Qwen's 152K tokens, up to 313 MiB
    for 4 strings of 128 "a"), and it holds the GIL while it does, so even off the worker thread it
    slowed every row (a thread running Python made a forward 3x slower). This checks the decoded text,
    as vLLM does, and builds nothing. Only the reply's last ``window`` tokens are decoded each step: a
    stop string of L characters is at most 4L bytes, and a token at least one byte."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.window = 4 * max(len(s) for s in self.stops) + 8
        self.start = None  # generate's: where the reply begins in its input_ids

    def hit(self, reply: list[int]) -> bool:
        text = self.tokenizer.decode(reply[-self.window:], skip_special_tokens=True)
        return any(s in text for s in self.stops)

    def __call__(self, input_ids, scores, **kwargs):
        """As a ``generate`` stopping criterion (the one-turn worker): its first call sees one new token."""
        if self.start is None:
            self.start = input_ids.shape[1] - 1
        return torch.tensor([self.hit(row[self.start:].tolist()) for row in input_ids], dtype=torch.bool,
                            device=input_ids.device)


# The model's generation_config fields whose logits processors ``generate`` would apply and the batched
# worker does not, each with when it is set (a neutral value is not): a model that sets one is refused at
# startup (``unapplied``), never served with it silently dropped. The batched worker applies
# ``repetition_penalty`` and the sampling warpers (``warpers``); beams, guidance, forced and suppressed
# tokens, n-gram bans and the rest are ``generate``'s alone (``--no-batch-decode``).
UNAPPLIED = {
    "num_beams": lambda v: v is not None and v > 1,
    "guidance_scale": lambda v: v is not None and v != 1,
    "sequence_bias": bool,
    "encoder_repetition_penalty": lambda v: v is not None and v != 1.0,
    "no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "encoder_no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "bad_words_ids": bool,
    "min_length": lambda v: v is not None and v > 0,
    "min_new_tokens": lambda v: v is not None and v > 0,
    "forced_bos_token_id": lambda v: v is not None,
    "forced_eos_token_id": lambda v: v is not None,
    "remove_invalid_values": lambda v: v is True,
    "exponential_decay_length_penalty": lambda v: v is not None,
    "suppress_tokens": bool,
    "begin_suppress_tokens": bool,
    "watermarking_config": lambda v: v is not None,
    "renormalize_logits": lambda v: v is True,
}


def unapplied(generation_config) -> list[str]:
    """The fields of ``generation_config`` (the model's) whose processors the batched worker would not apply."""
    if generation_config is None:
        return []
    return [name for name, active in UNAPPLIED.items() if active(getattr(generation_config, name, None))]


class Sampler:
    """A row's way from its logits to its next token, with OpenAI's parameters as OpenAI defines them:
    the model's own ``repetition_penalty`` first (its ``generation_config``'s, over the prompt and the reply
    so far, as ``generate`` applies it), then ``logit_bias`` (token id -> bias) added to the logits, then ``frequency_penalty`` times each token's
    count in the reply so far and ``presence_penalty`` once for each token in it subtracted, then
    greedy or ``generate``'s warpers and a draw, from the row's own ``torch.Generator`` when it has a
    ``seed`` (the process-wide one otherwise), so a seeded reply repeats whatever rows it is batched
    with. ``logprobs`` (when ``top`` is not None): each token's log-probability, and its ``top`` most
    likely alternatives', under the model's own distribution (log_softmax of its logits, before bias,
    penalties and temperature: vLLM's default)."""

    def __init__(self, sampling: dict, generation_config, tokenizer, device, top: int | None = None,
                 prompt: list[int] = ()):
        self.warpers = warpers(sampling, generation_config)
        penalty = getattr(generation_config, "repetition_penalty", None)
        self.repetition = None  # (generate's processor, which tokens the prompt and the reply hold so far)
        if penalty is not None and penalty != 1.0:
            # the processor reads which tokens occur, not how often: a mask stands for the whole ids
            seen = torch.zeros(max(len(tokenizer), max(prompt, default=0) + 1), dtype=torch.bool, device=device)
            seen[torch.tensor(list(prompt), dtype=torch.long, device=device)] = True
            self.repetition = (RepetitionPenaltyLogitsProcessor(float(penalty)), seen)
        bias = sampling.get("logit_bias") or {}
        self.bias = (torch.tensor(list(bias), dtype=torch.long, device=device),
                     torch.tensor(list(bias.values()), dtype=torch.float32, device=device)) if bias else None
        self.presence = float(sampling.get("presence_penalty") or 0.0)
        self.frequency = float(sampling.get("frequency_penalty") or 0.0)
        self.counts = None  # the reply's token counts, made on first use (vocabulary-sized)
        seed = sampling.get("seed")
        self.generator = None
        if seed is not None and self.warpers is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed % (1 << 64))
        self.tokenizer, self.top = tokenizer, top
        self.logprobs: list[dict] = []  # one entry a token, OpenAI's shape
        self.offsets: list[int] = []  # where each token's text begins in the reply's
        self._text = [0, 0, 0]  # the reply's text length so far, and the window it is decoded over (_length)

    @property
    def plain(self) -> bool:
        """Greedy on the model's logits: the batch's one argmax is this row's token."""
        return (self.warpers is None and self.bias is None and not (self.presence or self.frequency)
                and self.repetition is None)

    def __call__(self, logits: torch.Tensor, generated: list[int], last: int, greedy: int | None = None) -> int:
        """The next token after ``generated`` (``last``: the token fed to get ``logits``)."""
        if self.plain:
            token = greedy if greedy is not None else int(logits.argmax(-1))
        else:
            scores = logits.to(dtype=torch.float32)
            if self.repetition is not None:
                processor, seen = self.repetition
                if seen.shape[0] < scores.shape[0]:  # an output layer wider than the tokenizer's vocabulary
                    seen = torch.cat([seen, seen.new_zeros(scores.shape[0] - seen.shape[0])])
                    self.repetition = processor, seen
                scores = processor(seen.nonzero().T, scores[None])[0]
            if self.bias is not None:
                scores = scores.index_add(0, self.bias[0], self.bias[1])
            if (self.presence or self.frequency) and generated:
                if self.counts is None:
                    self.counts = torch.zeros_like(scores)
                    self.counts.index_add_(0, torch.tensor(generated, device=scores.device),
                                           torch.ones(len(generated), device=scores.device))
                scores = scores - self.frequency * self.counts - self.presence * (self.counts > 0)
            if self.warpers is None:
                token = int(scores.argmax(-1))
            else:  # these warpers read the scores only
                scores = self.warpers(torch.tensor([[last]], dtype=torch.long, device=scores.device), scores[None])
                token = int(torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1,
                                              generator=self.generator))
        if self.counts is not None:
            self.counts[token] += 1
        if self.repetition is not None:
            self.repetition[1][token] = True
        if self.top is not None:
            self._log(logits, generated, token)
        return token

    def _log(self, logits: torch.Tensor, generated: list[int], token: int) -> None:
        lp = torch.log_softmax(logits.to(dtype=torch.float32), dim=-1)
        top = torch.topk(lp, self.top) if self.top else None
        ids = [token] + (top.indices.tolist() if top is not None else [])
        values = [float(lp[token])] + (top.values.tolist() if top is not None else [])
        texts = self.tokenizer.batch_decode([[i] for i in ids])
        entries = [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))}
                   for t, v in zip(texts, values)]
        self.logprobs.append({**entries[0], "top_logprobs": entries[1:]})
        self.offsets.append(self._length(generated))

    def _length(self, generated: list[int]) -> int:
        """``len(decode(generated))`` without decoding it all each token (O(n^2) over a long reply: 18 ms a
        step at 8K tokens): vLLM's incremental detokenization, which decodes from a few tokens back and
        waits while the text ends in part of a character."""
        length, start, read = self._text
        if len(generated) > read:
            before = self.tokenizer.decode(generated[start:read], skip_special_tokens=True)
            after = self.tokenizer.decode(generated[start:], skip_special_tokens=True)
            if not after.endswith("\ufffd"):
                self._text = [length + len(after) - len(before), read, len(generated)]
        return self._text[0]

    def kept(self, tokens: int, content: str, stopped: bool) -> list[dict]:
        """The entries of the reply's first ``tokens`` tokens (its stop tokens dropped) whose text begins in
        ``content`` (a stop string's cut drops the tokens after it)."""
        return [e for e, at in zip(self.logprobs[:tokens], self.offsets) if not stopped or at < len(content)]


def warpers(sampling: dict, generation_config) -> LogitsProcessorList | None:
    """The logits warpers ``generate`` applies for ``sampling`` (``do_sample``, ``temperature``, ``top_p``) over
    the model's own generation config (its ``top_k``, ``top_h``, ``min_p``, ``typical_p``, ``epsilon_cutoff``,
    ``eta_cutoff``), in ``generate``'s order; None: greedy."""
    if not sampling.get("do_sample"):
        return None
    out = LogitsProcessorList()
    temperature = sampling.get("temperature", getattr(generation_config, "temperature", None))
    if temperature is not None and temperature != 1.0:
        out.append(TemperatureLogitsWarper(float(temperature)))
    top_h = getattr(generation_config, "top_h", None)
    if top_h is not None:
        out.append(TopHLogitsWarper(top_h=float(top_h)))
    top_k = sampling.get("top_k", getattr(generation_config, "top_k", None))
    if top_k is not None and top_k != 0:
        out.append(TopKLogitsWarper(top_k=int(top_k), min_tokens_to_keep=1))
    top_p = sampling.get("top_p", getattr(generation_config, "top_p", None))
    if top_p is not None and top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=float(top_p), min_tokens_to_keep=1))
    config = {name: getattr(generation_config, name, None) for name in ("min_p", "typical_p", "epsilon_cutoff",
                                                                        "eta_cutoff")}
    if config["min_p"] is not None:
        out.append(MinPLogitsWarper(min_p=float(config["min_p"]), min_tokens_to_keep=1))
    if config["typical_p"] is not None and config["typical_p"] < 1.0:
        out.append(TypicalLogitsWarper(mass=float(config["typical_p"]), min_tokens_to_keep=1))
    if config["epsilon_cutoff"] is not None and 0.0 < config["epsilon_cutoff"] < 1.0:
        out.append(EpsilonLogitsWarper(epsilon=float(config["epsilon_cutoff"]), min_tokens_to_keep=1))
    if config["eta_cutoff"] is not None and 0.0 < config["eta_cutoff"] < 1.0:
        out.append(EtaLogitsWarper(epsilon=float(config["eta_cutoff"]), min_tokens_to_keep=1))
    return out


class Batcher:
    """The batched worker loop of an ``Engine`` (see the module docstring); ``run()`` on its worker thread."""

    def __init__(self, engine, max_batch: int = 8, chunked_prefill: bool = True):
        self.engine, self.max_batch, self.chunked_prefill = engine, max_batch, chunked_prefill
        self.rows: list[Row] = []
        self.waiting: list = []  # turns taken from the queue whose session is busy (a turn or save in flight)

    @property
    def room(self) -> int:
        """How many turns may be active: ``max_batch``, and no more than may be resident at once (an active
        session is never parked)."""
        return min(self.max_batch, self.engine.max_resident)

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self) -> None:
        engine = self.engine
        while not engine._stop.is_set():
            took = self._fill()
            if self.rows:
                engine.worked = True
                self._step()
                engine._retain(every_s=RETAIN_BUSY_S)
            elif not took and not self.waiting:
                engine._park_idle()
                engine._retain(every_s=RETAIN_IDLE_S)
                engine._trim()
        for row in list(self.rows):  # stopping: the clients of the turns in flight hear so
            self._drop(row, APIError(503, "the server is shutting down", type="server_error"))
        for turn in self.waiting:
            turn.send("error", APIError(503, "the server is shutting down", type="server_error"))

    def _fill(self) -> bool:
        """Admit waiting turns, then queued ones, while there is room; whether any turn was admitted."""
        took = False
        for turn in list(self.waiting):
            if len(self.rows) >= self.room:
                return took
            if turn.cancelled.is_set():  # the client left while it waited
                self.waiting.remove(turn)
                continue
            located = self._ready(turn)
            if located is not None:
                self.waiting.remove(turn)
                self._start(turn, located)
                took = True
        while len(self.rows) < self.room and len(self.waiting) < self.room:
            try:
                if self.rows or took:
                    turn = self.engine.queue.get_nowait()
                else:
                    turn = self.engine.queue.get(timeout=BLOCKED_WAIT_S if self.waiting else IDLE_WAIT_S)
            except queue.Empty:
                return took
            if turn.cancelled.is_set():
                continue
            located = self._ready(turn)
            if located is None:
                self.waiting.append(turn)
                continue
            self._start(turn, located)
            took = True
        return took

    def _ready(self, turn):
        """``Engine._locate``'s answer if the turn's session is free now (in no active turn, no save of it in
        flight), else None (the turn waits). A turn that cannot be located (the store's index is down)
        is ready too, as ``("failed", error)``: ``_start`` answers it with the error."""
        try:
            located = self.engine._locate(turn)
        except Exception as e:  # noqa: BLE001 - the store's index may be down
            return ("failed", e)
        sid = located[2]
        if sid in self.engine.active or self.engine._saving(sid) is not None:
            return None
        return located

    # -- one turn ----------------------------------------------------------------------------------------
    def _start(self, turn, located) -> None:
        """The turn's pre-work (``_lease``, ``_open``), its prefill and its first token; then it is a row."""
        engine = self.engine
        engine.worked = True
        if located[0] == "failed":
            engine._fail(turn, located[1])
            return
        system, hashes, sid = located
        started = time.perf_counter()
        try:
            lease = engine._lease(sid)
        except Exception as e:  # noqa: BLE001 - one bad turn never kills the server
            engine._fail(turn, e)
            return
        try:
            opened = engine._open(turn, system, hashes, sid, lease)
        except Exception as e:  # noqa: BLE001
            engine._release_lease(lease)
            engine._fail(turn, e)
            return
        engine.active.add(sid)
        try:
            session = opened.session
            if self.chunked_prefill:
                header, ids = prompt(session)
                logits = None
            else:
                header, logits = prefill(session)
                ids = session.ids + header
            stops = StopStrings(engine.tokenizer, turn.stops) if turn.stops else None
            sampler = Sampler(turn.sampling, getattr(engine.model, "generation_config", None), engine.tokenizer,
                              engine.model.device, turn.logprobs, prompt=ids)
            opened.sampler = sampler  # _close reads its logprobs
            row = Row(opened, ids, header, engine._deltas(opened), sampler, stops, set(session.template.stop_ids()),
                      started, fed=len(ids) if logits is not None else session.cache.get_seq_length())
            row.streamer.put(torch.tensor([row.ids[-1:]]))  # the prompt, which the streamer skips, as generate's
        except Exception as e:  # noqa: BLE001
            engine.active.discard(sid)
            engine._drop(sid)  # its cache may be half-written; the store still holds its last turn
            engine._release_lease(lease)
            engine._fail(turn, e)
            return
        self.rows.append(row)
        if logits is not None:
            self._advance(row, logits)

    def _step(self) -> None:
        """One forward over every decoding row's next token and one chunk of the first prefilling row's
        prompt (packed: the chunk first); each decoding row then takes its token, and so does the prefilling
        row when that chunk was its last."""
        model = self.engine.model
        decoding = [row for row in self.rows if not row.prefilling]
        filling = next((row for row in self.rows if row.prefilling), None)
        rows = ([filling] if filling is not None else []) + decoding
        parts = [filling.next_chunk()] if filling is not None else []
        parts += [row.generated[-1:] for row in decoding]
        logits: list[torch.Tensor | None]
        try:
            with torch.no_grad():
                if len(rows) == 1 and filling is not None:  # the path a prompt alone takes
                    out = chunk_forward(model, filling.cache, parts[0], filling.fed)[None]
                elif len(rows) == 1:  # the path a turn alone takes
                    out = model(input_ids=torch.tensor([parts[0]], device=model.device), cache=rows[0].cache).logits[0]
                else:
                    x = torch.tensor([sum(parts, [])], dtype=torch.long, device=model.device)
                    extra = {"logits_to_keep": len(rows)} if _takes_logits_to_keep(model) else {}
                    out = model(input_ids=x, cache=CacheRows([row.cache for row in rows],
                                                             packed=[len(p) for p in parts]), **extra).logits[0]
                    ends = torch.tensor(list(itertools.accumulate(map(len, parts)))) - 1  # each row's last token
                    out = out[ends - (x.shape[1] - out.shape[0])]  # logits_to_keep kept only the last len(rows)
            logits = list(out)
            greedy = out.argmax(-1).tolist()  # one device sync for every greedy row
        except Exception:  # noqa: BLE001 - which row? each runs alone (the batch's writes were undone)
            log.warning("pace-serve: a batched step of %d rows failed; running them one by one", len(rows),
                        exc_info=True)
            logits, greedy = [], [None] * len(rows)
            for row, part in zip(rows, parts):
                try:
                    if row is filling:
                        logits.append(chunk_forward(model, row.cache, part, row.fed))
                    else:
                        with torch.no_grad():
                            logits.append(model(input_ids=torch.tensor([part], device=model.device),
                                                cache=row.cache).logits[0, -1])
                except Exception as e:  # noqa: BLE001
                    logits.append(None)
                    self._drop(row, e)
        if decoding:
            self.engine.metrics.decode_steps.inc()
            self.engine.metrics.decode_rows.inc(len(decoding))
        if filling is not None and logits[0] is not None:
            filling.fed += len(parts[0])
            if filling.prefilling:  # not its last chunk: no token yet
                logits[0] = None
        for row, row_logits, token in zip(rows, logits, greedy):
            if row_logits is not None:
                self._advance(row, row_logits, token)

    def _advance(self, row: Row, logits: torch.Tensor, greedy: int | None = None) -> None:
        """The row's next token from its logits (``greedy``: their argmax, when known): chosen, streamed; the
        turn ends on a stop token, its ``max_tokens``, a stop string or its client leaving (``generate``'s
        criteria, in its order)."""
        try:
            turn = row.opened.turn
            token = row.sampler(logits, row.generated, (row.generated[-1:] or row.ids[-1:])[0], greedy)
            if row.sampler.top is not None and token not in row.stop_ids:  # streamed before its text
                turn.send("logprob", (row.sampler.offsets[-1], row.sampler.logprobs[-1]))
            row.generated.append(token)
            row.streamer.put(torch.tensor([token]))
            done = (token in row.stop_ids or len(row.generated) >= row.opened.max_tokens
                    or turn.cancelled.is_set())
            if not done and row.stop_strings is not None:
                done = row.stop_strings.hit(row.generated)
        except Exception as e:  # noqa: BLE001
            self._drop(row, e)
            return
        if done:
            self._finish(row)

    def _finish(self, row: Row) -> None:
        """The reply appended to the session (as ``PACESession.generate`` does), then ``Engine._close``."""
        engine, opened = self.engine, row.opened
        self.rows.remove(row)
        engine.active.discard(opened.sid)
        handed = False
        try:
            row.streamer.end()
            session = opened.session
            reply = list(row.generated)
            while reply and reply[-1] in row.stop_ids:
                reply.pop()
            text = engine.tokenizer.decode(reply, skip_special_tokens=True)
            session._append("assistant", text, row.header + reply + session.template.turn_end_ids())
            handed = engine._close(opened, text)
        except Exception as e:  # noqa: BLE001
            engine._fail(opened.turn, e)
        finally:
            if not handed:
                engine._release_lease(opened.lease)
        spent = time.perf_counter() - row.started
        engine.turn_seconds = 0.8 * engine.turn_seconds + 0.2 * spent / max(1, len(self.rows) + 1)
        engine._park_idle()

    def _drop(self, row: Row, e: Exception) -> None:
        """A row that failed: its session dropped (the store holds its last turn), its client told."""
        engine, opened = self.engine, row.opened
        if row in self.rows:
            self.rows.remove(row)
        engine.active.discard(opened.sid)
        engine._drop(opened.sid)
        engine._release_lease(opened.lease)
        engine._fail(opened.turn, e)
