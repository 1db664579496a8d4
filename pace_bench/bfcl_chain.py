"""Long agent sessions: BFCL v4 entries chained into one conversation, teacher-forced along the ground truth.

    pace-bench --suite bfcl-chain --tokens 32768 --sessions 12 --budgets 2048,4096 --limit 8192 \\
        --arms full,h2o,snapkv,streaming,pace,pace_retrieval --chain-seed 0 --out runs/bfcl_chain_32k

Why: a model too weak to finish BFCL's tasks (Qwen2.5-Coder-0.5B passes none with any cache) cannot tell
caches apart by accuracy, and one BFCL entry (about 5.6K tokens) is not the long session PACE is for. So
every arm's cache reads the same, correct trajectory of a long session, and at each of the ground truth's
calls we measure how well the model could still write that call from what the cache kept.

A session (:func:`draw_chains`, :class:`ChainSession`):
- the system message holds the docs of every class its entries use, rendered by the model's chat template
  as ``pace-bench --suite bfcl`` renders them (:func:`pace_bench.bfcl.system_with_tools`);
- then K entries of ``base`` and ``long_context``, drawn by ``--chain-seed`` from both categories shuffled
  together, one after another in one conversation: each starts with the user line ``New task.`` before its
  first turn, and its backends start from its own ``initial_config``. An entry appears in at most one
  session, and never beside its twin (``base_N`` and ``long_context_N`` ask the same questions). K is as many
  as fit in ``--tokens``;
- after each user turn, the ground truth's calls, written as the chat template writes an assistant's
  ``tool_calls`` (Qwen's ``<tool_call>`` JSON; a template without tool support gets that same format, as its
  system prompt asks for), then each call's real output from bfcl-eval's backends
  (``execute_multi_turn_func_call``) as a tool message (one message block per output, as the free-running
  suite adds them).

What is measured, per arm, at every ground-truth call (:func:`play_chain`):
- the NLL and top-1 accuracy of the call's tokens (its JSON object: never the tags, the tool outputs or
  the prompt), from the logits of the trajectory's own prefill: the session is prefilled up to each turn's
  assistant header, then on to the next one, ``--chunk`` tokens per forward, and only the logits that
  predict call tokens are computed;
- the free-running first call of each turn: from the cache just before the turn's calls, the model decodes
  greedily (at most ``--probe-tokens``) on a branch (``EvictionCache.fork``; a ``DynamicCache`` is cropped
  back), so the trajectory goes on exactly as without the probe. The decoded first call is scored against
  the ground truth's: its name, its name with arguments (compared parsed), and whether running it on a copy
  of the backends gives the ground truth's result and state (bfcl-eval's ``state_checker``);
- how much of the ground truth tool's doc is resident at the call (a diagnostic: what the planner's share
  kept), tokens, prefill and probe seconds, and peak KV bytes against DynamicCache at the same length.

Arms are ``pace-bench --suite bfcl``'s (the registry's caches; ``pace`` plans with :class:`TurnPlanner`
from the conversation alone, ``pace_retrieval`` restores what each turn's words match), each at every
budget of ``--budgets`` (the full cache reads none, so it is played once). One record per (session, arm,
budget) in ``probes.jsonl``; ``--resume`` plays only what is missing, under ``accelerate launch`` too, and
the full cache, whose 64K session costs hours, takes up a killed session where it saved its progress
(``OUT/progress``, :class:`Progress`).
``table.md`` (:func:`table`): per budget, every arm's call NLL ratio to the full cache with a bootstrap 95%
interval over entries, top-1 accuracy, free-running call accuracy, the full cache's correct calls kept, the
tool docs resident, the entry-by-entry sign tests of PACE against H2O and SnapKV, and the cost.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pace_bench import arms as registry
from pace_bench import bfcl
from pace_bench.stats import sign_test
from pace_bench.suite import check_budget, check_limit, table_writer

CATEGORIES = ("base", "long_context")  # miss_param and composite stay held out; miss_func changes the tools
NEW_TASK = "New task."
PACE = bfcl.PACE
# The baselines with PACE's bounded positions (renumbered under L, as PACE is): an ablation, played only when
# named. Past the training context they say what far positions cost H2O, SnapKV and StreamingLLM, and
# beside PACE what its plan adds to its limit.
BOUNDED_BASELINES = ("positions_only", "snapkv_bounded", "streaming_bounded")
ARMS = (*bfcl.ARMS, *BOUNDED_BASELINES)
BOUNDED = tuple(a for a in ARMS if a in PACE or registry.ARMS[a].bounded)
# --sessions is not one: session j is drawn the same whatever it asks for, so a run can grow its sessions
RUN_KEYS = ("model", "dtype", "tokens", "chain_seed", "limit", "chunk", "probe_tokens", "system", "probes")
# PACE's plan in a chained session: the shares of B for the tool docs (the instructions around them
# first), the mentions and the thread (TurnPlanner's tool_share, mention_share, thread_share). Chosen on
# held-out chains (--chain-seed 1, docs/benchmarks/bfcl.md): the thread alone, half of B (docs and
# mentions only displaced heavy hitters; three quarters measured within 1% of a half). The free-running
# suite's (0.5, 0.25, 0) was the first plan played here (a PACE record without "plan" played it).
PLAN = (0.0, 0.0, 0.5)
FIRST_PLAN = (0.5, 0.25, 0.0)
# How the bounded arms (PACE's two, the bounded baselines) lay positions out when they renumber: their
# records say it, and --resume plays again one that played another layout (a record without "layout"
# played the first one, "compact": every gap collapsed to 1).
LAYOUT = "capped gaps"


@dataclass(frozen=True)
class ChainSettings:
    limit: int = 8192
    chunk: int = 2048
    probe_tokens: int = 64
    plan: tuple[float, float, float] = PLAN


# -- the ground truth in the model's own format ----------------------------------------------------------------


def class_docs(cls: str) -> list[dict]:
    """Every tool doc of one of bfcl-eval's backend classes."""
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    return bfcl._json_lines(bfcl.data_dir() / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls])


def arguments(call: bfcl.Call, doc: dict | None) -> dict:
    """A call's arguments by name: positional ones take the doc's parameter names in order."""
    names = list((doc or {}).get("parameters", {}).get("properties", {}))
    if len(call.args) > len(names):
        raise ValueError(f"{call.name}: {len(call.args)} positional arguments, but its doc names {len(names)}")
    return {**dict(zip(names, call.args)), **dict(call.kwargs)}


def ground_call(source: str) -> bfcl.Call:
    """One ground-truth call string (``"cd(folder='document')"``) parsed."""
    call, _ = bfcl._python_call(source, 0)
    if call is None:
        raise ValueError(f"cannot read the ground truth's call {source!r}")
    return call


@dataclass
class Block:
    """One message of the trajectory: its role, content and token ids (the template's whole block). An
    assistant's block of calls also holds ``header`` (its generation-prompt tokens, where a probe starts)
    and ``call_spans``: per call, its JSON object's tokens, relative to the block."""

    role: str
    content: str
    ids: list[int]
    header: int = 0
    call_spans: list[tuple[int, int]] = field(default_factory=list)


def calls_block(template, calls: list[bfcl.Call], docs: dict[str, dict]) -> Block:
    """The assistant message that makes ``calls``, as the chat template writes ``tool_calls``; a template
    that ignores them gets Qwen's ``<tool_call>`` JSON as its content (what its system prompt asks for)."""
    from pace_hf.chat import TokenOffsets

    wanted = [{"name": c.name, "arguments": arguments(c, docs.get(c.name))} for c in calls]
    user = {"role": "user", "content": "U"}
    before = template._render([template.system, user])
    message = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "function": w} for w in wanted]}
    text = template._suffix(template._render([template.system, user, message]), before)
    if not text.startswith(template.gen_header) or wanted[0]["name"] not in text:  # tool_calls not rendered
        content = "\n".join(f"<tool_call>\n{json.dumps(w, ensure_ascii=False)}\n</tool_call>" for w in wanted)
        text = template.block("assistant", content)
    offsets, ids = TokenOffsets.of(template.tok, text)
    header = len(template.encode(template.gen_header))
    if ids[:header] != template.encode(template.gen_header):
        raise ValueError("this chat template's assistant block does not start with its generation prompt's tokens")
    spans, decoder, i = [], json.JSONDecoder(), len(template.gen_header)
    for w in wanted:  # each call's JSON object, in order
        while True:
            i = text.find("{", i)
            if i < 0:
                raise ValueError(f"the chat template wrote no JSON object for the call {w['name']}")
            try:
                value, end = decoder.raw_decode(text, i)
            except ValueError:
                i += 1
                continue
            if [(c.name, arguments(c, docs.get(c.name))) for c in bfcl._json_calls(value)] == [(w["name"], w["arguments"])]:
                break
            i += 1
        span = offsets.span(i, end)
        if span is None or span[0] < header:
            raise ValueError(f"the call {w['name']} is not on whole tokens after the generation prompt")
        spans.append(span)
        i = end
    content = text[len(template.gen_header):len(text) - len(template.turn_end)] if text.endswith(template.turn_end) \
        else text[len(template.gen_header):]
    return Block("assistant", content, ids, header, spans)


@dataclass
class Turn:
    """One user turn of one entry along its ground truth: the user's block, the calls' block (None when the
    ground truth calls nothing), and the backends that run them."""

    entry: dict
    index: int
    user: Block
    calls: list[bfcl.Call]
    sources: list[str]
    assistant: Block | None
    backends: bfcl.Backends

    def outputs(self, template) -> list[Block]:
        """Run the turn's calls in the entry's backends; each output's tool block."""
        results = self.backends.execute(self.sources) if self.sources else []
        return [Block("tool", r, template.encode(template.block("tool", r))) for r in results]


def entry_turns(entry: dict, template, docs: dict[str, dict], tag: str):
    """The turns of ``entry``, in order, with fresh backends (the caller closes ``turn.backends`` after the
    last turn). The first user message starts with :data:`NEW_TASK`."""
    backends = bfcl.Backends(entry, tag)
    for t, (question, truth) in enumerate(zip(entry["question"], entry["ground_truth"])):
        content = "\n".join(m["content"] for m in question if m["role"] == "user")
        if t == 0:
            content = f"{NEW_TASK}\n{content}"
        user = Block("user", content, template.encode(template.block("user", content)))
        calls = [ground_call(s) for s in truth]
        yield Turn(entry, t, user, calls, list(truth), calls_block(template, calls, docs) if calls else None, backends)


def entry_messages(entry: dict, template, docs: dict[str, dict], tag: str):
    """``(role, turn, block)`` for each message of ``entry``, in the order a session adds them: a turn's user
    message, its ground-truth calls, then their real outputs (run only when reached, after the calls). The
    entry's backends are closed at the end, or when the generator is closed (use ``contextlib.closing``)."""
    backends = None
    try:
        for turn in entry_turns(entry, template, docs, tag):
            backends = turn.backends
            yield "user", turn, turn.user
            if turn.assistant is not None:
                yield "assistant", turn, turn.assistant
            for out in turn.outputs(template):
                yield "tool", turn, out
    finally:
        if backends is not None:
            backends.close()


# -- sessions ------------------------------------------------------------------------------------------------


@dataclass
class ChainSession:
    """A drawn session: its id, entries (in order), tools (every doc of the classes they use) and template."""

    session_id: str
    entries: list[dict]
    tools: list[dict]
    template: object
    native: bool
    tokens: int

    @property
    def docs(self) -> dict[str, dict]:
        return {t["name"]: t for t in self.tools}


def session_template(tokenizer, classes: list[str], system: str | None):
    """The chat template whose system message holds every doc of ``classes``; its tools; and whether the
    template renders tools itself."""
    from pace_hf.chat import DEFAULT_SYSTEM, ChatTemplate

    tools = [d for cls in classes for d in class_docs(cls)]
    content, native = bfcl.system_with_tools(tokenizer, system or DEFAULT_SYSTEM, tools)
    return ChatTemplate(tokenizer, content), tools, native


def entry_tokens(entry: dict, template, docs: dict[str, dict]) -> int:
    """The tokens ``entry`` adds to a session (its turns, calls and real outputs)."""
    with contextlib.closing(entry_messages(entry, template, docs, "draw")) as messages:
        return sum(len(block.ids) for _, _, block in messages)


def _twin(entry: dict) -> str:
    return entry["id"].rsplit("_", 1)[1]


def draw_chains(tokenizer, *, tokens: int, sessions: int, seed: int, system: str | None = None,
                pool: list[dict] | None = None) -> list[ChainSession]:
    """``sessions`` sessions of at most ``tokens`` tokens each: entries of ``base`` and ``long_context``
    shuffled by ``seed``, dealt in that order to the first session they fit in (each entry to one session
    at most, never beside its twin), until a session is within 5% of ``tokens`` or the pool is spent."""
    if pool is None:
        pool = [e for c in CATEGORIES for e in bfcl.load_entries(c)]
    order = list(pool)
    random.Random(seed).shuffle(order)
    every = list(dict.fromkeys(cls for e in order for cls in e["involved_classes"]))
    template, tools, _ = session_template(tokenizer, every, system)
    docs = {t["name"]: t for t in tools}
    system_tokens: dict[tuple, int] = {}
    sizes: dict[str, int] = {}
    out, used = [], set()
    for j in range(sessions):
        chosen, classes, body = [], [], 0
        for entry in order:
            if entry["id"] in used or _twin(entry) in {_twin(e) for e in chosen}:
                continue
            cls = list(dict.fromkeys(classes + entry["involved_classes"]))
            if tuple(cls) not in system_tokens:
                system_tokens[tuple(cls)] = len(session_template(tokenizer, cls, system)[0].system_ids)
            if entry["id"] not in sizes:
                sizes[entry["id"]] = entry_tokens(entry, template, docs)
            size = sizes[entry["id"]]
            if system_tokens[tuple(cls)] + body + size > tokens:
                continue
            chosen.append(entry)
            used.add(entry["id"])
            classes, body = cls, body + size
            if system_tokens[tuple(classes)] + body >= 0.95 * tokens:
                break
        if not chosen:
            raise ValueError(f"no entry is left that fits a session of {tokens} tokens (session {j} of {sessions})")
        session_template_, session_tools, native = session_template(tokenizer, classes, system)
        out.append(ChainSession(f"chain{seed}-{j}", chosen, session_tools, session_template_, native,
                                len(session_template_.system_ids) + body))
    return out


# -- one session, one arm ----------------------------------------------------------------------------------


def _head(model, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits of hidden states ``[n, d]`` (with the model's final soft cap, where it has one)."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap is not None else logits


class Prefill:
    """Prefills a session's ids into a cache, ``chunk`` tokens per forward, and scores the target tokens:
    ``targets`` maps a token's index to its call, and the logits at the index before it give the token's NLL
    and whether it is the top-1 token. Only those logits are computed (and the last one of each prefill,
    where a probe starts)."""

    def __init__(self, model, cache, chunk: int):
        self.model, self.cache, self.chunk = model, cache, chunk
        self.decoder = model.get_decoder()
        self.done = 0
        self.targets: dict[int, int] = {}
        self.nll: dict[int, list] = {}  # call -> [tokens, nll sum, top-1 hits]
        self.seconds = 0.0

    def to(self, ids: list[int], end: int) -> torch.Tensor:
        """Prefill ``ids[done:end]``; return the logits at ``end - 1`` (what comes next)."""
        last = None
        started = time.perf_counter()
        with torch.no_grad():
            for start in range(self.done, end, self.chunk):
                stop = min(end, start + self.chunk)
                piece = torch.tensor([ids[start:stop]], dtype=torch.long, device=self.model.device)
                hidden = self.decoder(input_ids=piece, cache=self.cache, use_cache=True).last_hidden_state[0]
                at = [p for p in range(start, stop) if p + 1 in self.targets]
                if stop == end and stop - 1 not in at:
                    at.append(stop - 1)
                if not at:
                    continue
                logits = _head(self.model, hidden[[p - start for p in at]])
                for p, row in zip(at, logits):
                    if p + 1 in self.targets:
                        got = self.nll.setdefault(self.targets[p + 1], [0, 0.0, 0])
                        got[0] += 1
                        got[1] += float(torch.logsumexp(row, 0) - row[ids[p + 1]])
                        got[2] += int(int(row.argmax()) == ids[p + 1])
                if stop == end:
                    last = logits[at.index(stop - 1)]
        self.done = end
        self.seconds += time.perf_counter() - started
        return last


def probe(model, cache, first: torch.Tensor, *, max_tokens: int, stop_ids, tokenizer, names=()) -> str:
    """Greedy decoding from the logits ``first`` on a branch of ``cache`` (an ``EvictionCache``'s
    ``fork()``, or a ``DynamicCache`` cropped back after), until a stop token, ``max_tokens``, or the first
    call is written whole (:func:`pace_bench.bfcl.parse_calls` reads one: only the first is scored); the
    text. ``cache`` is left exactly as it was."""
    from pace_hf import EvictionCache

    decoder = model.get_decoder()
    seen = cache.get_seq_length()
    branch = cache.fork() if isinstance(cache, EvictionCache) else cache
    out, token = [], int(first.argmax())
    try:
        with torch.no_grad():
            while token not in stop_ids and len(out) < max_tokens:
                out.append(token)
                if len(out) == max_tokens:
                    break
                closing = tokenizer.decode(out[-1:])  # a call can only be whole after a brace or parenthesis
                if ("}" in closing or ")" in closing) and bfcl.parse_calls(tokenizer.decode(out, skip_special_tokens=True), names):
                    break
                piece = torch.tensor([[token]], dtype=torch.long, device=model.device)
                token = int(_head(model, decoder(input_ids=piece, cache=branch, use_cache=True).last_hidden_state[0, -1:])[0].argmax())
    finally:
        if branch is not cache:
            branch.unbind()
        elif cache.get_seq_length() > seen:
            cache.crop(seen - cache.get_seq_length())  # transformers 5 takes the tokens to drop, negative
    return tokenizer.decode(out, skip_special_tokens=True)


def judge(text: str, turn: Turn, docs: dict[str, dict]) -> dict:
    """The decoded first call against the ground truth's first: the same name; the same name and arguments
    (parsed values); and whether it gives the ground truth's result and state, each run on a copy of the
    entry's backends as they are before the turn."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import state_checker

    truth = turn.calls[0]
    calls = bfcl.parse_calls(text, set(docs))
    got = calls[0] if calls else None
    name = got is not None and got.name == truth.name
    try:
        args = name and arguments(got, docs.get(got.name)) == arguments(truth, docs.get(truth.name))
    except ValueError:  # more positional arguments than the doc names
        args = False
    same = False
    if got is not None and got.name in docs and got.source() is not None:
        ours, theirs = turn.backends.fork("probe"), turn.backends.fork("truth")
        try:
            mine, mine_state = ours.run([got.source()])
            right, right_state = theirs.run([turn.sources[0]])
            same = mine == right and state_checker(mine_state, right_state)["valid"]
        finally:
            ours.close()
            theirs.close()
    return {"name": bool(name), "args": bool(args), "exec": bool(same), "text": text[:300]}


@contextlib.contextmanager
def _full_cache_through_pace_attention(model, cache):
    """The full cache's forwards through ``pace_attention``, which is the model's SDPA with the same masks,
    except for one query on the CPU: there transformers asks torch for ``enable_gqa``, about 10x slower in
    bf16 than packing each KV head's query heads as its queries (what ``pace_attention`` does). The
    probes decode one token a forward at up to 64K keys, so this decides most of the full cache's time."""
    from pace_hf import EvictionCache, attention

    if isinstance(cache, EvictionCache):  # bound to pace_attention already
        yield
        return
    before = model.config._attn_implementation
    model.set_attn_implementation(attention.register())
    try:
        yield
    finally:
        model.set_attn_implementation(before)


class Progress:
    """The full cache's progress through one session, saved at the end of an entry (at most once every
    ``every`` seconds) and read back when the same session is played again: a 64K session costs the full
    cache hours, and a run killed in its middle then loses at most ``every`` seconds of it. Only the full
    cache saves, since its state is its keys and values; an evicting arm's session is short beside it, and
    its state is the whole cache. A file is read only under the key of the session, arm and settings it
    was written for, and only if the token prefix it holds is the one the replayed conversation has: a
    stale, foreign or unreadable file is said and ignored (the session starts over), never trusted."""

    def __init__(self, path: Path | None, key: str, every: float):
        self.path, self.key, self.every = path, key, every
        self.saved = time.monotonic()

    def load(self) -> dict | None:
        if self.path is None or not self.path.exists():
            return None
        try:
            state = torch.load(self.path, weights_only=True)
        except Exception as e:  # a kill mid-write leaves the .tmp, not this; any damage is still refused
            return self._ignore(f"unreadable ({type(e).__name__}: {e})")
        if not isinstance(state, dict) or state.get("key") != self.key:
            return self._ignore("written for another session, arm or settings")
        return state

    def matches(self, state: dict, ids: list[int]) -> bool:
        """Whether the conversation replayed to the saved entry holds the token prefix the saved keys are of."""
        if len(ids) >= state["done"] and ids_digest(ids[:state["done"]]) == state["prefix"]:
            return True
        self._ignore("its tokens are not this conversation's")
        return False

    def save(self, make_state) -> None:
        if self.path is None or time.monotonic() - self.saved < self.every:
            return
        state = {"key": self.key, **make_state()}
        partial = self._partial()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, partial)
            os.replace(partial, self.path)
        except OSError as e:  # a full disk costs the checkpoint, never the session
            partial.unlink(missing_ok=True)
            print(f"bfcl-chain: could not save the progress of {self.path.stem} ({e}): playing on without it",
                  file=sys.stderr)
        self.saved = time.monotonic()

    def drop(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self._partial().unlink(missing_ok=True)  # what a kill in the middle of a save left

    def _partial(self) -> Path:
        return self.path.with_name(self.path.name + ".tmp")

    def _ignore(self, why: str) -> None:
        print(f"bfcl-chain: {self.path} ignored: {why}; the session starts over", file=sys.stderr)
        return None


def ids_digest(ids: list[int]) -> str:
    """A short digest of a token sequence: a record's ``trajectory``, a saved progress's prefix."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def _progress_key(model, session: "ChainSession", arm: str, s: ChainSettings, probes: bool) -> str:
    what = {"session": session.session_id, "entries": [e["id"] for e in session.entries], "arm": arm,
            "model": model.config._name_or_path, "dtype": str(model.dtype), "chunk": s.chunk,
            "probe_tokens": s.probe_tokens, "probes": probes, "system": ids_digest(session.template.system_ids)}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def play_chain(model, tokenizer, session: ChainSession, arm: str, budget: int | None, s: ChainSettings,
               store=None, probes: bool = True, progress_dir: Path | None = None, progress_every: float = 600.0) -> dict:
    """Play ``session`` along its ground truth with ``arm``'s cache (at ``budget``; None for the full cache);
    the record. With ``progress_dir``, the full cache saves its progress there (:class:`Progress`) and
    resumes from what an earlier, killed play of the same session saved."""
    from pace_hf import EvictionCache
    from pace_hf.memory.retrieval import PageRetriever
    from pace_bench.readings import full_cache_bytes, peak_cache_bytes

    started, cpu_started = time.perf_counter(), time.process_time()
    template, docs = session.template, session.docs
    settings = bfcl.BfclSettings(budget=budget or 1, limit=s.limit, chunk=s.chunk)
    sid = f"{session.session_id}-{arm}-{budget}"
    use_store = store if arm in PACE else None
    cache = bfcl.make_cache(arm, model, settings, use_store, sid)
    spans = dict(zip([t["name"] for t in session.tools], bfcl.tool_spans(template, session.tools)))
    planner = None
    if arm == "pace":
        tool_share, mention_share, thread_share = s.plan
        docs_at = sorted(x for x in spans.values() if x is not None)
        frame = [(0, docs_at[0][0]), (docs_at[-1][1], len(template.system_ids))] if docs_at else []
        planner = bfcl.TurnPlanner(session.tools, list(spans.values()), budget, tool_share=tool_share,
                                   mention_share=mention_share, thread_share=thread_share, frame=frame)
    retriever = PageRetriever(tokenizer) if arm == "pace_retrieval" else None
    conversation = bfcl.Conversation(template)
    prefill = Prefill(model, cache, s.chunk)
    calls, judged, planned = [], [], []
    probe_seconds = 0.0
    stop_ids = template.stop_ids()
    progress = Progress(None if progress_dir is None or arm != "full" else Path(progress_dir) / f"{sid}.pt",
                        _progress_key(model, session, arm, s, probes), progress_every)
    saved, skip = progress.load(), 0
    if saved is not None:  # the entries it covers, replayed without a forward: the same messages, the same ids
        replayed = bfcl.Conversation(template)
        for entry in session.entries[:saved["entries"]]:
            with contextlib.closing(entry_messages(entry, template, docs, f"{arm}{budget}")) as messages:
                for role, _, block in messages:
                    replayed.add(role, block.content, block.ids)
        if progress.matches(saved, replayed.ids):
            conversation, skip = replayed, saved["entries"]
            prefill.done, prefill.targets, prefill.nll = saved["done"], saved["targets"], saved["nll"]
            prefill.seconds, probe_seconds = saved["prefill_seconds"], saved["probe_seconds"]
            calls, judged = saved["calls"], saved["judged"]
            started -= saved["seconds"]  # the record's seconds count every play of the session
            cpu_started -= saved["cpu_seconds"]
    try:
        with peak_cache_bytes(model, cache) as peak, _full_cache_through_pace_attention(model, cache):
            if skip:
                for layer, (keys, values) in enumerate(saved["kv"]):
                    cache.update(keys, values, layer)
            for e, entry in enumerate(session.entries[skip:], skip):
                with contextlib.closing(entry_messages(entry, template, docs, f"{arm}{budget}")) as messages:
                    for role, turn, block in messages:
                        if role == "assistant":
                            at = len(conversation.ids)
                            for k, (a, b) in enumerate(block.call_spans):
                                calls.append([e, turn.index, k, 0, 0.0, 0, None])
                                prefill.targets.update({at + p: len(calls) - 1 for p in range(a, b)})
                            ids = conversation.ids + block.ids
                            first = prefill.to(ids, at + block.header)
                            span = spans.get(turn.calls[0].name)
                            resident = (1.0 if not isinstance(cache, EvictionCache) or span is None
                                        else cache.residency(range(*span)))
                            for c in calls[len(calls) - len(block.call_spans):]:
                                c[6] = None if span is None else round(resident, 4)
                            if probes:
                                t0 = time.perf_counter()
                                text = probe(model, cache, first, max_tokens=s.probe_tokens, stop_ids=stop_ids,
                                             tokenizer=tokenizer, names=docs)
                                probe_seconds += time.perf_counter() - t0
                                judged.append([e, turn.index, judge(text, turn, docs)])
                        message = conversation.add(role, block.content, block.ids)
                        if role == "user":
                            if isinstance(cache, EvictionCache):
                                cache.step = conversation.step
                            if planner is not None:
                                planned.append(planner.plan(conversation, cache, message))
                            if retriever is not None:
                                cache.retrieve(message.content, conversation.ids[:message.start], retriever=retriever)
                progress.save(lambda: {
                    "entries": e + 1, "done": prefill.done, "prefix": ids_digest(conversation.ids[:prefill.done]),
                    "targets": prefill.targets, "nll": prefill.nll, "calls": calls, "judged": judged,
                    "kv": [(layer.keys, layer.values) for layer in cache.layers],
                    "prefill_seconds": prefill.seconds, "probe_seconds": probe_seconds,
                    "seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu_started})
            prefill.to(conversation.ids, len(conversation.ids))
    finally:
        if use_store is not None:
            use_store.delete_session(sid)
        if isinstance(cache, EvictionCache):
            cache.unbind()
    for k, c in enumerate(calls):
        c[3:6] = prefill.nll.get(k, [0, 0.0, 0])
    tokens = len(conversation.ids)
    record = {"session_id": session.session_id, "arm": arm, "budget": budget, "probe": 0,
              "entries": [e["id"] for e in session.entries], "tokens": tokens,
              "system_tokens": len(template.system_ids), "tools_native": session.native,
              "trajectory": ids_digest(conversation.ids),
              "calls": calls, "probes": judged,
              "peak_cache_bytes": peak["bytes"], "full_cache_bytes": full_cache_bytes(model, tokens),
              "prefill_seconds": round(prefill.seconds, 2), "probe_seconds": round(probe_seconds, 2),
              "seconds": round(time.perf_counter() - started, 2),
              "cpu_seconds": round(time.process_time() - cpu_started, 2)}
    if arm in BOUNDED:
        record["layout"] = LAYOUT
    if arm not in PACE:  # the records from before it ran transformers' enable_gqa call there
        record["one_query_attention"] = "packed"
    if planner is not None:
        record["plan"] = list(s.plan)
    if planned:
        record["planned"] = {k: sum(p.get(k, 0) for p in planned) for k in planned[0]}
    if isinstance(cache, EvictionCache) and use_store is not None:
        record["restored_tokens"] = cache.tier_stats.get("retrieval_tokens_restored", 0)
    if skip:
        record["resumed_after_entries"] = skip
    progress.drop()
    return record


def stale(records: list[dict], arms, plan) -> list[dict]:
    """The records that ``--resume`` plays again: those of the bounded arms being played that played another
    layout, and pace's that played another plan."""
    return [r for r in records if r["arm"] in BOUNDED and r["arm"] in arms
            and (r.get("layout", "compact") != LAYOUT
                 or r["arm"] == "pace" and tuple(r.get("plan", FIRST_PLAN)) != tuple(plan))]


# -- reporting -------------------------------------------------------------------------------------------------


def units(r: dict) -> dict[tuple, dict]:
    """Per entry of a record (the unit of the statistics: an entry's calls hang together): its call tokens,
    NLL sum and top-1 hits, and its free-running probes (count, right name, right arguments, same execution)."""
    out: dict[tuple, dict] = {}
    for e, _turn, _k, n, nll, top1, _resident in r["calls"]:
        u = out.setdefault((r["session_id"], e), dict.fromkeys(("tokens", "nll", "top1", "probes", "name", "args", "exec"), 0))
        u["tokens"], u["nll"], u["top1"] = u["tokens"] + n, u["nll"] + nll, u["top1"] + top1
    for e, _turn, verdict in r["probes"]:
        u = out[(r["session_id"], e)]
        u["probes"] += 1
        for k in ("name", "args", "exec"):
            u[k] += verdict[k]
    return out


def bootstrap_ratio(mine, theirs, resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """sum(mine) / sum(theirs) and its 95% percentile bootstrap interval, resampling the paired units."""
    import numpy as np

    a, b = np.asarray(mine, dtype=float), np.asarray(theirs, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(a), (resamples, len(a)))
    ratios = a[idx].sum(1) / b[idx].sum(1)
    return float(a.sum() / b.sum()), float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def _paired(records: list[dict], arm: str, budget) -> list[tuple[dict, dict]]:
    """(the arm's record, the full cache's) per session both played along the same trajectory."""
    full = {r["session_id"]: r for r in records if r["arm"] == "full"}
    return [(r, full[r["session_id"]]) for r in records
            if r["arm"] == arm and r["budget"] == budget and r["session_id"] in full
            and full[r["session_id"]]["trajectory"] == r["trajectory"]]


def _per_unit(pairs) -> list[tuple[dict, dict, tuple[str, str]]]:
    """(the arm's entry, the full cache's, where the entry sits: its category and its half of the session)
    for every entry both played."""
    out = []
    for r, f in pairs:
        mine, theirs = units(r), units(f)
        for (sid, e), u in mine.items():
            if (sid, e) in theirs:
                category = "long_context" if "long_context" in r["entries"][e] else "base"
                half = "first half" if e < len(r["entries"]) / 2 else "second half"
                out.append((u, theirs[(sid, e)], (category, half)))
    return out


def split_line(paired_units: dict[str, list]) -> str:
    """Each arm's call NLL as a ratio to the full cache's (pooled over the paired entries), split by
    category (``base``, ``long_context``) and by the entry's half of its session: where an arm loses."""
    parts = []
    for arm, triples in paired_units.items():
        sums: dict[str, list[float]] = {}
        for mine, theirs, where in triples:
            for key in where:
                got = sums.setdefault(key, [0.0, 0.0])
                got[0], got[1] = got[0] + mine["nll"], got[1] + theirs["nll"]
        if sums:
            order = ("base", "long_context", "first half", "second half")
            parts.append(f"{arm} " + ", ".join(f"{key} {sums[key][0] / sums[key][1]:.2f}" for key in order
                                               if sums.get(key, [0, 0])[1]))
    return ("- call NLL ratio to full, pooled, by category and by the entry's half of its session (exploratory, "
            "not a test): " + "; ".join(parts)) if parts else ""


def sign_line(records: list[dict], budget, arm: str, other: str) -> str:
    """``arm`` against ``other`` entry by entry: on call NLL (lower is better) and on free-running calls with
    the right arguments (more is better), with the two-sided sign test."""
    a = {k: u for r in records if r["arm"] == arm and r["budget"] == budget for k, u in units(r).items()}
    b = {k: u for r in records if r["arm"] == other and r["budget"] == budget for k, u in units(r).items()}
    keys = [k for k in a if k in b]
    if not keys:
        return ""
    nll = [(a[k]["nll"] < b[k]["nll"], a[k]["nll"] > b[k]["nll"]) for k in keys]
    acc = [(a[k]["args"] > b[k]["args"], a[k]["args"] < b[k]["args"]) for k in keys]
    parts = []
    for what, pairs in (("call NLL", nll), ("free-running calls right", acc)):
        better, worse = sum(x for x, _ in pairs), sum(y for _, y in pairs)
        parts.append(f"{what}: better on {better}, worse on {worse}, tied {len(keys) - better - worse} "
                     f"(p = {sign_test(better, worse):.2g})")
    return f"- {arm} against {other}, {len(keys)} entries: " + "; ".join(parts)


def table(records: list[dict]) -> str:
    """Markdown: per budget, a row per arm (the full cache first, as the reference)."""
    out = []
    budgets = sorted({r["budget"] for r in records if r["budget"] is not None})
    for budget in budgets or [None]:
        out += [f"**B = {budget:,}**" if budget else "**full cache only**", "",
                "| arm | sessions | entries | call tokens | NLL/token | NLL ratio to full [95% CI] | top-1 | first call: name "
                "| name + args | same execution | full's right calls kept | tool doc resident | tokens | peak KV (MiB) "
                "| DynamicCache KV (MiB) | prefill s | probe s | CPU s |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        ratios, paired_units = {}, {}
        for arm in ARMS:
            rs = [r for r in records if r["arm"] == arm and (arm == "full" or r["budget"] == budget)]
            if not rs:
                continue
            us = [u for r in rs for u in units(r).values()]
            tok, nll, top1 = (sum(u[k] for u in us) for k in ("tokens", "nll", "top1"))
            probes = sum(u["probes"] for u in us)
            pct = lambda k: f"{sum(u[k] for u in us)}/{probes} ({100 * sum(u[k] for u in us) / max(probes, 1):.0f}%)"
            ratio = kept = "-"
            if arm != "full":
                pairs = paired_units[arm] = _per_unit(_paired(records, arm, budget))
                if pairs:
                    r_, lo, hi = bootstrap_ratio([m["nll"] for m, _, _ in pairs], [f["nll"] for _, f, _ in pairs])
                    ratios[arm] = r_
                    ratio = f"{r_:.3f} [{lo:.3f}, {hi:.3f}]"
                full_right = kept_right = 0
                for r, f in _paired(records, arm, budget):
                    for (_, _, mine), (_, _, theirs) in zip(r["probes"], f["probes"]):
                        full_right += theirs["args"]
                        kept_right += theirs["args"] and mine["args"]
                kept = f"{kept_right}/{full_right}" if full_right else "0/0"
            resident = [c[6] for r in rs for c in r["calls"] if c[6] is not None]
            peaks = [r["peak_cache_bytes"] for r in rs if r.get("peak_cache_bytes")]
            mean = lambda key: sum(r[key] for r in rs) / len(rs)
            out.append(f"| {arm} | {len(rs)} | {len(us)} | {tok:,} | {nll / max(tok, 1):.3f} | {ratio} | "
                       f"{100 * top1 / max(tok, 1):.1f}% | {pct('name')} | {pct('args')} | {pct('exec')} | {kept} | "
                       + (f"{100 * sum(resident) / len(resident):.0f}%" if resident else "-")
                       + f" | {mean('tokens'):,.0f} | " + (f"{sum(peaks) / len(peaks) / 2**20:.0f}" if peaks else "-")
                       + f" | {mean('full_cache_bytes') / 2**20:.0f} | {mean('prefill_seconds'):.0f} | {mean('probe_seconds'):.0f} "
                       f"| {mean('cpu_seconds'):.0f} |")
        lines = [sign_line(records, budget, "pace", other) for other in ("h2o", "snapkv", "streaming")]
        lines.append(split_line(paired_units))
        plans = sorted({tuple(r.get("plan", FIRST_PLAN)) for r in records if r["arm"] == "pace" and r["budget"] == budget})
        if plans:
            lines.append("- pace's plan (shares of B for tool docs, mentions, thread): " + ", ".join(map(str, plans)))
        layouts = sorted({r.get("layout", "compact") for r in records if r["arm"] in BOUNDED and r["budget"] == budget})
        if layouts:
            lines.append("- the bounded arms' renumbering layout: " + ", ".join(layouts))
        full = [r for r in records if r["arm"] == "full"]
        packed = sum(r.get("one_query_attention") == "packed" for r in full)
        if full and budget == (budgets or [None])[0]:
            lines.append(f"- the full cache's one-query forwards (probes): packed in {packed} of {len(full)} sessions, "
                         "transformers' enable_gqa call in the others (the same attention; the packed call is faster)")
        if "pace" in ratios and "h2o" in ratios and ratios["pace"] != 1.0:
            lines.append(f"- H2O's NLL excess over the full cache is {(ratios['h2o'] - 1) / (ratios['pace'] - 1):.1f}x "
                         f"PACE's ({ratios['h2o'] - 1:+.3f} against {ratios['pace'] - 1:+.3f})")
        out += [""] + [line for line in lines if line] + [""]
    return "\n".join(out)


def header(run: dict) -> str:
    return (f"model {run['model']} (torch.{run['dtype']}); sessions of at most {run['tokens']:,} tokens, chains drawn "
            f"with --chain-seed {run['chain_seed']}; L={run['limit']:,}, H={run['chunk']:,}; teacher-forced along the "
            "ground truth; " + (f"each turn's first call also decoded greedily (at most {run['probe_tokens']} tokens) on a "
                                "branch of the cache" if run.get("probes", True) else "no free-running probes")
            + ". The unit of the intervals and sign tests is the entry")


# -- the command -----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from pace_bench.cli import choice_list, int_at_least, model_name
    from pace_bench.models import DEFAULT_MODEL

    ap = argparse.ArgumentParser(prog="pace-bench --suite bfcl-chain", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", type=model_name, default=DEFAULT_MODEL, help="a packaged model name or a local directory")
    ap.add_argument("--tokens", type=int_at_least(1024), default=32768, help="the most tokens a session holds")
    ap.add_argument("--sessions", type=int_at_least(1), default=12, help="sessions (chains) to play")
    ap.add_argument("--chain-seed", type=int, default=0, help="the seed that orders the entries the chains are drawn from")
    ap.add_argument("--arms", type=choice_list(ARMS, "arm(s)"), default=",".join(bfcl.ARMS), metavar="ARM[,ARM...]",
                    help=f"from {{{', '.join(ARMS)}}} (the last {len(BOUNDED_BASELINES)}: baselines with PACE's bounded positions)")
    ap.add_argument("--budgets", default="2048", metavar="B[,B...]",
                    help="B: resident tokens per layer and KV head; every evicting arm plays each")
    ap.add_argument("--limit", type=int_at_least(1), default=8192, help="L: the bounded arms' rotary limit (L > B + H)")
    ap.add_argument("--chunk", type=int_at_least(1), default=2048, help="H: prefill chunk size")
    ap.add_argument("--probe-tokens", type=int_at_least(1), default=64, help="the most tokens a free-running probe decodes")
    ap.add_argument("--probes", action=argparse.BooleanOptionalAction, default=True,
                    help="decode each turn's first call on a branch (--no-probes: teacher-forced measures only)")
    ap.add_argument("--plan", default=",".join(f"{x:g}" for x in PLAN), metavar="TOOLS,MENTIONS,THREAD",
                    help="pace's plan: the shares of B for the matched tool docs, the earlier mentions and the thread")
    ap.add_argument("--system", default=None, help="the system prompt before the tools (default: pace_hf's)")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument("--out", default="runs/bfcl_chain", help="folder for probes.jsonl, table.md and run.json")
    ap.add_argument("--resume", action="store_true", help="keep the (session, arm, budget) records OUT holds; play the rest")
    ap.add_argument("--report", action="store_true", help="play nothing: write OUT/table.md from what OUT holds and exit")
    return ap


def check_args(ap, args) -> None:
    """Bad input is an error before anything loads."""
    why = bfcl.bfcl_missing()
    if why:
        ap.error(why)
    try:
        args.budgets = sorted({int(b) for b in args.budgets.split(",") if b.strip()})
    except ValueError:
        ap.error(f"--budgets: integers separated by commas, got {args.budgets!r}")
    if not args.budgets:
        ap.error("--budgets: none given")
    try:
        args.plan = tuple(float(x) for x in args.plan.split(","))
    except ValueError:
        ap.error(f"--plan: three shares of B separated by commas, got {args.plan!r}")
    if len(args.plan) != 3 or any(x < 0 for x in args.plan) or sum(args.plan) > 1:
        ap.error(f"--plan: three shares of B (tools, mentions, thread), none negative, at most 1 together; got {args.plan}")
    check_budget(ap, args.budgets, budget_flag="--budgets")
    check_limit(ap, [a for a in args.arms if a in BOUNDED], args.limit, max(args.budgets), args.chunk,
                budget_flag="the largest of --budgets")


write_table = table_writer(header, table)  # table.md, at the run's end and for --report


def main(argv=None) -> int:
    from pace_bench.suite import command_line, play_all

    args = command_line(argv, build_parser, check_args, write_table, suite="bfcl-chain", what="records")
    if args is None:
        return 0
    from pace_bench.models import load_model, resolve_dtype
    from pace_bench.records import process_state, resumed_records

    state = process_state()
    out_dir = Path(args.out)
    dtype = resolve_dtype(args.dtype, state.device.type)
    run = {**{k: v for k, v in vars(args).items() if k not in ("resume", "report")},
           "dtype": str(dtype).removeprefix("torch."), "num_processes": state.num_processes}
    records = []
    if args.resume:
        records = resumed_records(out_dir, run, RUN_KEYS, "bfcl-chain")
        other = stale(records, args.arms, args.plan)
        if other and state.is_main_process:
            print(f"pace-bench --suite bfcl-chain: --resume: {len(other)} record(s) of the bounded arms played another "
                  f"--plan or layout: played again with {args.plan}, {LAYOUT}", file=sys.stderr)
        records = [r for r in records if not any(r is o for o in other)]
    elif state.is_main_process:  # a run that starts over starts every session over (before play_all's barrier)
        shutil.rmtree(out_dir / "progress", ignore_errors=True)
    done = {(r["session_id"], r["arm"], r["budget"]) for r in records}
    model, tokenizer = load_model(args.model, dtype=dtype)
    model.to(state.device)
    sessions = draw_chains(tokenizer, tokens=args.tokens, sessions=args.sessions, seed=args.chain_seed, system=args.system)
    s = ChainSettings(limit=args.limit, chunk=args.chunk, probe_tokens=args.probe_tokens, plan=args.plan)
    # every session at the first budget before any at the next: a partial run is complete for the first
    order = [(session, arm, None if arm == "full" else budget) for k, budget in enumerate(args.budgets)
             for session in sessions for arm in args.arms if arm != "full" or k == 0]
    rank = {(x.session_id, arm, b): k for k, (x, arm, b) in enumerate(order)}

    def describe(r):
        us = units(r).values()
        tok, nll = sum(u["tokens"] for u in us), sum(u["nll"] for u in us)
        right = sum(u["args"] for u in us)
        return (f"{r['session_id']:>10} {r['arm']:>14} B={r['budget'] or '-':>5} tokens {r['tokens']:,} "
                f"NLL/token {nll / max(tok, 1):.3f} first calls right {right}/{len(r['probes'])} {r['seconds']:.0f}s")

    play_all(out_dir, run, records, [item for item in order if (item[0].session_id, *item[1:]) not in done],
             lambda item, store: [play_chain(model, tokenizer, item[0], item[1], item[2], s, store, args.probes,
                                             progress_dir=out_dir / "progress")],
             rank=lambda r: rank.get((r["session_id"], r["arm"], r["budget"]), len(rank)),
             describe=describe, desc="bfcl-chain sessions x arms x budgets",
             finish=lambda records: write_table(out_dir, run, records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
