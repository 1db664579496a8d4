"""BFCL v4 multi-turn through each arm's cache: an agent calling real tools, scored by bfcl-eval's checker.

    pace-bench --suite bfcl --categories base --entries 30 --arms full,h2o,pace,pace_retrieval \\
        --budget 1024 --limit 4096 --chunk 2048 --out runs/bfcl

The Berkeley Function Calling Leaderboard's multi-turn entries ship inside the ``bfcl-eval`` wheel
(2026.3.23, installed with ``--no-deps``): the turns, each entry's ``initial_config``, the tool docs of
its ``involved_classes``, the executable backends and the checker. Nothing of bfcl-eval is re-implemented:
calls run in ``multi_turn_utils.execute_multi_turn_func_call`` and an entry is scored by
``multi_turn_checker.multi_turn_checker`` (state and response checks against the ground truth), after
BFCL's own force-termination check. Played: ``base``, ``long_context`` and ``miss_func``;
``miss_param`` and ``composite`` are held out (never run or tuned on) and refused.

The agent loop, one entry and one arm:
- Every doc of the entry's classes is a tool (as BFCL's runner gives them), presented by the model's
  chat template (``apply_chat_template(tools=...)``; a template without tool support gets Qwen's tool
  section in the system prompt). The system prompt holds them: 3.5-6.3K tokens before the first turn.
- The user turns come one at a time. At each step the model answers greedily; its calls are read
  leniently in its own format (:func:`parse_calls`: ``<tool_call>`` blocks, fenced or bare JSON, or
  BFCL's ``[f(a=1)]``), run in the backends, and each result goes back as a tool message, until a reply
  calls nothing. A call to a name that is not one of the entry's tools is not executed (bfcl-eval would
  ``eval`` it): its result is the NameError text bfcl-eval would give, and it changes no state.
- The per-turn cap is BFCL's ``MAXIMUM_STEP_LIMIT`` (20) unless ``--max-steps`` says less: a step past
  it stops the entry, which then fails as BFCL's force-terminated entries do.
- ``--stop-repeats`` (off by default, BFCL has no such rule): a reply equal word for word to the turn's
  previous reply ends the turn without running it again. A small model decoding greedily loops so (the
  same wrong call, its error, the same call); BFCL would let it run to the cap and stop the entry. With
  the rule, the entry goes on to its next turn, so every turn is scored and compared with the full cache,
  at a fraction of the cost; the record counts the turns so ended (``looped``).
- ``miss_func``: the held-out docs come as a user turn at their turn, as BFCL's prompting runner does.

Arms are the registry's caches (``pace_bench.arms``) with the run's B and L. PACE's two differ in what a
user turn does, never in the cache:
- ``pace``: :class:`TurnPlanner`, fed only from the conversation, plans for the turn the tool docs the
  turn's words match and the windows of earlier messages (tool outputs, turns) that name what the turn
  names (quoted strings, file names, ids); evicted parts are restored from the host tier.
- ``pace_retrieval``: no plan; each user turn restores the evicted pages its text matches
  (``EvictionCache.retrieve``).

One record per (entry, arm) in ``probes.jsonl`` (``probe`` 0): the checker's verdict, the executed calls
per turn and step, the raw replies, tokens, peak KV bytes and wall and CPU seconds. ``--resume`` keeps the
pairs played; under ``accelerate launch`` each process plays a share into ``probes.rank{N}.jsonl`` and the
main one merges them (``pace_bench.records``). ``table.md``: accuracy with 95% Wilson intervals, fidelity
to the full cache (turns whose executed calls equal full's), the full cache's calls and passes each arm
keeps, each arm against H2O entry by entry (sign test), and memory. ``--report`` writes the table of what
``--out`` holds so far, a run still going included.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import re
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pace_bench import arms as registry
from pace_bench.stats import sign_test, wilson
from pace_bench.suite import check_budget, check_limit, table_writer

CATEGORIES = ("base", "long_context", "miss_func")
HELD_OUT = ("miss_param", "composite")  # kept to evaluate this suite on material it was not tuned on
PACE = ("pace", "pace_retrieval")
ARMS = ("full", "h2o", "snapkv", "streaming", *PACE)
BOUNDED = tuple(a for a in ARMS if a in PACE or registry.ARMS[a].bounded)
BFCL_STEP_LIMIT = 20  # bfcl_eval.constants.default_prompts.MAXIMUM_STEP_LIMIT
# --resume must match (dtype too: ``--dtype auto`` picks bf16 or fp32 by CPU, and one run must not mix them)
RUN_KEYS = ("model", "dtype", "budget", "limit", "chunk", "max_steps", "max_new_tokens", "system", "stop_repeats")


@dataclass(frozen=True)
class BfclSettings:
    budget: int = 1024
    limit: int = 4096
    chunk: int = 2048
    max_steps: int = BFCL_STEP_LIMIT
    max_new_tokens: int = 256
    stop_repeats: bool = False


# -- bfcl-eval's data, backends and checker --------------------------------------------------------------


def bfcl_missing() -> str | None:
    """Why the suite cannot run here (bfcl-eval not installed), or None."""
    import importlib.util

    if importlib.util.find_spec("bfcl_eval") is None:
        return "bfcl-eval is not installed: pip install --no-deps bfcl-eval==2026.3.23 (make setup does)"
    return None


def data_dir() -> Path:
    import bfcl_eval

    return Path(bfcl_eval.__file__).parent / "data"


def _json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_entries(category: str) -> list[dict]:
    """The category's entries in file order, each with its ``ground_truth`` (the possible answer) and
    ``category``. A held-out category is refused."""
    if category not in CATEGORIES:
        raise ValueError(f"category {category!r} is {'held out' if category in HELD_OUT else 'unknown'}: "
                         f"choose from {', '.join(CATEGORIES)}")
    name = f"BFCL_v4_multi_turn_{category}.json"
    answers = {a["id"]: a["ground_truth"] for a in _json_lines(data_dir() / "possible_answer" / name)}
    return [dict(e, ground_truth=answers[e["id"]], category=category) for e in _json_lines(data_dir() / name)]


def tool_docs(entry: dict) -> tuple[list[dict], dict[int, list[dict]]]:
    """The tools of an entry as BFCL's runner builds them (``populate_test_cases_with_predefined_functions``):
    every doc of its involved classes, less the ones ``miss_func`` holds back, and those, by turn."""
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    docs = [d for cls in entry["involved_classes"]
            for d in _json_lines(data_dir() / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls])]
    held: dict[int, list[dict]] = {}
    for turn, names in entry.get("missed_function", {}).items():
        held[int(turn)] = [d for d in docs if d["name"] in names]
        docs = [d for d in docs if d["name"] not in names]
    return docs, held


def long_context(entry: dict) -> bool:
    """bfcl-eval's own rule: the backends load their long content for these categories."""
    category = entry["id"].rsplit("_", 1)[0]
    return "long_context" in category or "composite" in category


class Backends:
    """bfcl-eval's backends for one play of one entry. bfcl-eval keeps each instance in its module's
    globals under a model name and the entry's id, so a play gets a fresh name (two arms, or a rerun,
    never share state), and :meth:`close` drops its instances and the checker's."""

    def __init__(self, entry: dict, tag: str):
        self.entry = entry
        self.name = re.sub(r"\W", "_", f"pace_bench_{tag}_{uuid.uuid4().hex[:8]}")

    def execute(self, calls: list[str]) -> list[str]:
        return self.run(calls)[0]

    def run(self, calls: list[str]) -> tuple[list[str], dict]:
        """Each call's output, and the backend instances by class (their state, for ``state_checker``)."""
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import execute_multi_turn_func_call

        return execute_multi_turn_func_call(calls, self.entry["initial_config"], self.entry["involved_classes"],
                                            self.name, self.entry["id"], long_context=long_context(self.entry))

    def fork(self, tag: str) -> "Backends":
        """A copy of these backends as they are now (their instances deep-copied): a call tried aside on it
        leaves this play's state untouched. Backends not yet used copy nothing and start from the entry's
        ``initial_config``, as these would."""
        import copy

        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

        twin = Backends(self.entry, tag)
        space = vars(multi_turn_utils)
        for key in [k for k in space if k.startswith(self.name)]:
            space[twin.name + key[len(self.name):]] = copy.deepcopy(space[key])
        return twin

    def check(self, decoded: list[list[list[str]]], forced: bool) -> dict:
        """bfcl-eval's verdict: ``{"valid": bool, ...}``. As its eval runner does, an entry stopped before
        its last turn fails as force-terminated; the others go to ``multi_turn_checker``."""
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

        truth = self.entry["ground_truth"]
        if forced or len(decoded) != len(truth):
            return {"valid": False, "error_type": "multi_turn:force_terminated",
                    "error_message": f"stopped after {len(decoded)} of {len(truth)} turns"}
        return multi_turn_checker(decoded, truth, self.entry, self.entry["id"].rsplit("_", 1)[0], self.name + "_check")

    def close(self) -> None:
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

        space = vars(multi_turn_utils)
        for key in [k for k in space if k.startswith(self.name)]:
            del space[key]


# -- the model's calls, read leniently -----------------------------------------------------------------------

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PY_CALL = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(")


@dataclass(frozen=True)
class Call:
    """One call the model wrote: a name, positional and keyword arguments (plain values)."""

    name: str
    args: tuple = ()
    kwargs: tuple = ()  # (key, value) pairs, in the order written

    def source(self) -> str | None:
        """The call as bfcl-eval executes it (``name(k=repr(v), ...)``, as its handlers write calls), or None
        when a name or key is not an identifier: the string goes to ``eval``, so nothing else gets there."""
        if not _IDENT.match(self.name) or not all(isinstance(k, str) and _IDENT.match(k) for k, _ in self.kwargs):
            return None
        return f"{self.name}({','.join([repr(a) for a in self.args] + [f'{k}={v!r}' for k, v in self.kwargs])})"


def _json_calls(value) -> list[Call]:
    """The calls in a decoded JSON value: ``{"name", "arguments"|"parameters"}`` (arguments possibly a JSON
    string), ``{"function": name or {...}, ...}``, ``{"tool_calls": [...]}``, or lists of them."""
    if isinstance(value, list):
        return [c for v in value for c in _json_calls(v)]
    if not isinstance(value, dict):
        return []
    if isinstance(value.get("tool_calls"), list):
        return _json_calls(value["tool_calls"])
    function = value.get("function")
    if isinstance(function, dict):
        return _json_calls(function)
    name = value.get("name") if isinstance(value.get("name"), str) else function if isinstance(function, str) else None
    if name is None:
        return []
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return []
    if not isinstance(args, dict):
        return []
    return [Call(name, (), tuple(args.items()))]


def _python_call(text: str, start: int) -> tuple[Call | None, int]:
    """The Python call written at ``text[start:]`` (``name(...)`` with literal arguments) and where it ends."""
    for end in [m.end() for m in re.finditer(r"\)", text[start:])]:
        try:
            node = ast.parse(text[start:start + end], mode="eval").body
        except SyntaxError:
            continue
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            return None, start + end
        try:
            args = tuple(ast.literal_eval(a) for a in node.args)
            kwargs = tuple((k.arg, ast.literal_eval(k.value)) for k in node.keywords)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None, start + end
        if any(k is None for k, _ in kwargs):  # **spread
            return None, start + end
        return Call(node.func.id, args, kwargs), start + end
    return None, start + 1


def parse_calls(text: str, names) -> list[Call]:
    """The calls a reply writes, read leniently, in order: JSON objects anywhere (``<tool_call>`` blocks,
    fenced ```json blocks or bare, one or a list), else Python calls of the tools ``names`` (BFCL's own
    ``[f(a=1), g()]``; a word before a parenthesis in prose is no call unless it names a tool). A JSON call
    keeps any name (the model meant a call), a Python one only a tool's."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i] in "{[":
            try:
                value, end = decoder.raw_decode(text, i)
            except ValueError:
                i += 1
                continue
            calls += _json_calls(value)
            i = end
            continue
        i += 1
    if calls:
        return calls
    i = 0
    while True:
        m = _PY_CALL.search(text, i)
        if m is None:
            return calls
        if m.group(1) not in names:
            i = m.end()
            continue
        call, i = _python_call(text, m.start())
        if call is not None:
            calls.append(call)


# -- tools in the chat template ------------------------------------------------------------------------

# What a template without tool support is given in its system prompt: Qwen2.5's own tool section.
TOOL_SECTION = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                "with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\nFor each "
                "function call, return a json object with function name and arguments within <tool_call></tool_call> "
                "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def system_with_tools(tokenizer, system: str, tools: list[dict]) -> tuple[str, bool]:
    """The system message's content that makes the chat template render ``tools`` as it would with
    ``apply_chat_template(tools=...)`` (so the session's messages can be tokenized one at a time after
    it), and whether the template renders tools itself. A template that ignores ``tools`` gets
    :data:`TOOL_SECTION` after ``system``."""
    def render(content, **kw):
        return tokenizer.apply_chat_template([{"role": "system", "content": content}], tokenize=False, **kw)

    with_tools, without = render(system, tools=tools), render(system)
    if with_tools == without:
        return system + TOOL_SECTION.format(tools="".join("\n" + json.dumps(t) for t in tools)), False
    mark = "PACE_BENCH_SYSTEM_MARK"
    prefix, _, suffix = render(mark).partition(mark)
    if not (with_tools.startswith(prefix) and with_tools.endswith(suffix)):
        raise ValueError("this chat template renders tools outside the system message: cannot be played turn by turn")
    return with_tools[len(prefix):len(with_tools) - len(suffix)], True


def tool_spans(template, tools: list[dict]) -> list[tuple[int, int] | None]:
    """Per tool, the token span of its doc in the system block (``template.system_ids``), or None where the
    template wrote it in a form not found (such a tool is never planned)."""
    from pace_hf.chat import TokenOffsets

    text = template.tok.decode(template.system_ids)
    offsets, ids = TokenOffsets.of(template.tok, text)
    if ids != list(template.system_ids):
        return [None] * len(tools)
    out = []
    for tool in tools:
        at = next((text.find(s) for s in (json.dumps(tool, ensure_ascii=False), json.dumps(tool)) if s in text), -1)
        out.append(offsets.span(at, at + len(json.dumps(tool, ensure_ascii=False))) if at >= 0 else None)
    return out


# -- the conversation and PACE's planner --------------------------------------------------------------------


class Conversation:
    """The session's ids and messages, one template block per message, as ``PACESession`` keeps them.
    Why not a ``PACESession``: it takes only a ``PACECache``, and every arm (full's DynamicCache, H2O's)
    must play the same loop."""

    def __init__(self, template):
        from pace_hf.session import Message

        self.template, self.Message = template, Message
        self.ids: list[int] = list(template.system_ids)
        self.messages: list = []
        self.step = 0  # the user turns so far: a turn is a step of the cache's plan

    def add(self, role: str, content: str, ids: list[int] | None = None):
        if role == "user":
            self.step += 1
        ids = self.template.encode(self.template.block(role, content)) if ids is None else ids
        message = self.Message(len(self.messages), role, content, len(self.ids), len(self.ids) + len(ids), self.step)
        self.ids += ids
        self.messages.append(message)
        return message


_WORD = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_NAMED = re.compile(r"'([^'\n]{2,80})'|\"([^\"\n]{2,80})\"|([A-Za-z0-9_\-./]*[0-9_.][A-Za-z0-9_\-./]*)")


def _words(text: str) -> list[str]:
    """Lower-cased words, identifiers split at ``_`` and case changes (``get_stock_info``: get, stock, info)."""
    out = []
    for w in _WORD.findall(text.replace("_", " ")):
        out += [p.lower() for p in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", w)]
    return out


def named_things(text: str) -> set[str]:
    """What a turn names: quoted strings, and words with a digit, ``_``, ``.`` or ``-`` (file names, ids,
    amounts), at least 3 characters."""
    got = set()
    for m in _NAMED.finditer(text):
        thing = next(g for g in m.groups() if g is not None).strip(" .,;:")
        if len(thing) >= 3:
            got.add(thing)
    return got


class TurnPlanner:
    """PACE's plan for a BFCL session, from the conversation alone (never the ground truth or the backends'
    state). When user turn ``k`` arrives it plans for step ``k``:

    0. ``frame``, the spans planned at every turn (the chained suite's: the system message around the tool
       docs, which says how to write a call), within the tool docs' share;
    1. the tool docs the turn's words match: BM25 (``bm25s``) over each tool's name, description and
       parameter names, the turn as the query; a tool the turn names literally first; within
       ``tool_share * budget`` tokens;
    2. the earlier messages that name what the turn names (:func:`named_things`): a window of
       ``window`` tokens either side of each mention, the most recent message first, within
       ``mention_share * budget`` tokens;
    3. the thread the turn continues: the turn itself and the messages before it, whole, the most recent
       first, within ``thread_share * budget`` tokens. A long session holds many tasks behind the current
       one, and its heavy hitters are not the current task's turns.

    A span already prefilled and partly evicted is restored from the cache's store (``restore``); one not
    prefilled yet (the tool docs, before the first turn's forward) is planned, so prefill keeps it."""

    def __init__(self, tools: list[dict], spans, budget: int, *, tool_share: float = 0.5,
                 mention_share: float = 0.25, thread_share: float = 0.0, window: int = 24, frame=()):
        import bm25s

        self.names = [t["name"] for t in tools]
        self.spans = list(spans)
        self.tool_room, self.mention_room = int(tool_share * budget), int(mention_share * budget)
        self.thread_room = int(thread_share * budget)
        self.frame = list(frame)
        self.window = window
        docs = [_words(t["name"]) * 3 + _words(t.get("description", "")) +
                [w for p in t.get("parameters", {}).get("properties", {}) for w in _words(p)] for t in tools]
        self.index = bm25s.BM25()
        self.index.index([d or ["_"] for d in docs], show_progress=False)
        self.vocab = {w for d in docs for w in d}

    def tools_for(self, text: str) -> list[int]:
        """Tool indices in the order they are planned for a turn saying ``text``."""
        literal = [i for i, n in enumerate(self.names) if re.search(rf"\b{re.escape(n)}\b", text)]
        query = [w for w in _words(text) if w in self.vocab]
        scores = self.index.get_scores(query) if query else [0.0] * len(self.names)
        ranked = sorted((i for i in range(len(self.names)) if scores[i] > 0), key=lambda i: -scores[i])
        return list(dict.fromkeys(literal + ranked))

    def mentions(self, conversation: Conversation, message) -> list[tuple[int, int]]:
        """Token windows of the earlier messages around each thing the turn names, most recent first."""
        things = named_things(message.content)
        out = []
        for m in reversed(conversation.messages[:message.index]):
            hits = [i for t in things for i in (x.start() for x in re.finditer(re.escape(t), m.content))]
            if not hits:
                continue
            offsets, _, at = conversation.template.content_offsets(m.role, m.content)
            for h in sorted(hits):
                got = offsets.span(at + h, at + h + 1)
                if got is not None:
                    mid = m.start + got[0]
                    out.append((max(m.start, mid - self.window), min(m.end, mid + self.window)))
        return out

    def plan(self, conversation: Conversation, cache, message) -> dict:
        """Plan (and restore) for the turn ``message``; returns what it planned, in tokens."""
        chosen, used = [], 0
        for s, e in self.frame:
            if used + e - s <= self.tool_room:
                chosen.append((s, e))
                used += e - s
        for i in self.tools_for(message.content):
            span = self.spans[i]
            if span is not None and used + span[1] - span[0] <= self.tool_room:
                chosen.append(span)
                used += span[1] - span[0]
        tools = used
        for s, e in self.mentions(conversation, message):
            if used - tools + e - s <= self.mention_room:
                chosen.append((s, e))
                used += e - s
        mentions, thread = used - tools, self.thread(conversation, message)
        chosen += thread
        restored = sum(_keep(cache, s, e) for s, e in _merge(chosen))
        return {"planned_tool_tokens": tools, "planned_mention_tokens": mentions,
                "planned_thread_tokens": sum(e - s for s, e in thread), "restored_tokens": restored}

    def thread(self, conversation: Conversation, message) -> list[tuple[int, int]]:
        """The turn and the whole messages before it, most recent first, while they fit ``thread_room``."""
        out, used = [], 0
        for m in reversed(conversation.messages[:message.index + 1]):
            if used + m.end - m.start > self.thread_room:
                break
            out.append((m.start, m.end))
            used += m.end - m.start
        return out


def _merge(spans):
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(e, out[-1][1]))
        else:
            out.append((s, e))
    return out


def _keep(cache, start: int, end: int) -> int:
    """Keep ``[start, end)`` for the cache's current step: restore its evicted prefilled part, plan the
    rest. Returns the tokens restored."""
    from pace_hf import Span

    seen, restored = cache.get_seq_length(), 0
    done = min(end, seen)
    if start < done:
        if cache.store is not None and cache.residency(range(start, done)) < 1.0:
            restored = cache.restore(start, done)
        else:
            cache.blueprint.add(Span(start, done, [cache.step]))
    if end > seen:
        cache.blueprint.add(Span(max(start, seen), end, [cache.step]))
    return restored


# -- one entry, one arm ----------------------------------------------------------------------------------------


def make_cache(arm: str, model, s: BfclSettings, store=None, session_id: str | None = None):
    """The registry's cache of ``arm`` (PACE's two are its ``pace``, with an empty plan)."""
    from pace_hf import Blueprint

    return registry.make_cache("pace" if arm in PACE else arm, model, Blueprint(),
                               registry.ArmSettings(budget=s.budget, limit=s.limit), store, session_id)


def _reply(model, tokenizer, template, conversation: Conversation, cache, s: BfclSettings, stop_ids) -> str:
    """The model's next assistant message, greedy (only the new tokens are prefilled), appended."""
    from pace_hf.session import generate_reply

    header = template.encode(template.gen_header)
    reply = generate_reply(model, conversation.ids + header, cache, max_new_tokens=s.max_new_tokens,
                           stop_ids=stop_ids, chunk=s.chunk)
    text = tokenizer.decode(reply, skip_special_tokens=True)
    conversation.add("assistant", text, header + reply + template.turn_end_ids())
    return text


def play(model, tokenizer, entry: dict, arm: str, s: BfclSettings, store=None, system: str | None = None,
         progress: bool = False) -> dict:
    """Play ``entry`` with ``arm``'s cache and score it; the record."""
    from pace_hf import EvictionCache
    from pace_hf.chat import DEFAULT_SYSTEM, ChatTemplate
    from pace_hf.memory.retrieval import PageRetriever
    from pace_bench.readings import full_cache_bytes, peak_cache_bytes

    from tqdm.auto import tqdm

    started, cpu_started = time.perf_counter(), time.process_time()
    tools, held = tool_docs(entry)
    content, native = system_with_tools(tokenizer, system or DEFAULT_SYSTEM, tools)
    template = ChatTemplate(tokenizer, content)
    stop_ids = template.stop_ids()
    names = {t["name"] for t in tools} | {t["name"] for docs in held.values() for t in docs}
    conversation = Conversation(template)
    session_id = f"bfcl-{entry['id']}-{arm}"
    use_store = store if arm in PACE else None
    cache = make_cache(arm, model, s, use_store, session_id)
    planner = TurnPlanner(tools, tool_spans(template, tools), s.budget) if arm == "pace" else None
    retriever = PageRetriever(tokenizer) if arm == "pace_retrieval" else None
    backends = Backends(entry, arm)
    decoded, replies, steps, planned = [], [], [], []
    forced, looped = False, 0
    bar = tqdm(total=len(entry["question"]), desc=f"{arm} {entry['id']}", unit="turn", leave=False,
               dynamic_ncols=True, disable=not progress)
    try:
        with peak_cache_bytes(model, cache) as peak:
            for t, turn in enumerate(entry["question"]):
                if t in held:  # miss_func: the held-back docs arrive as a turn, as in BFCL's prompting runner
                    from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING

                    turn = [{"role": "user", "content": DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(
                        functions=held[t])}]
                for m in turn:
                    message = conversation.add(m["role"], m["content"])
                if isinstance(cache, EvictionCache):
                    cache.step = conversation.step
                if planner is not None:
                    planned.append(planner.plan(conversation, cache, message))
                if retriever is not None:
                    before = cache.tier_stats.get("retrieval_tokens_restored", 0)
                    cache.retrieve(message.content, conversation.ids[:message.start], retriever=retriever)
                    planned.append({"restored_tokens": cache.tier_stats.get("retrieval_tokens_restored", 0) - before})
                executed, turn_replies = [], []
                for step in range(s.max_steps + 1):
                    bar.set_postfix_str(f"turn {t + 1} step {step + 1}")
                    text = _reply(model, tokenizer, template, conversation, cache, s, stop_ids)
                    turn_replies.append(text)
                    if s.stop_repeats and len(turn_replies) > 1 and text.strip() == turn_replies[-2].strip():
                        looped += 1
                        break
                    calls = parse_calls(text, names)
                    if not calls:
                        break
                    runnable = [c.source() if c.name in names else None for c in calls]
                    ran = iter(backends.execute([c for c in runnable if c is not None]))
                    for c, source in zip(calls, runnable):
                        result = next(ran) if source is not None else f"Error during execution: name {c.name!r} is not defined"
                        conversation.add("tool", result)
                    if any(runnable):
                        executed.append([c for c in runnable if c is not None])
                else:  # a step past the cap: BFCL stops the entry
                    forced = True
                decoded.append(executed)
                replies.append(turn_replies)
                steps.append(len(turn_replies))
                bar.update(1)
                if forced:
                    break
        verdict = backends.check(decoded, forced)
    finally:
        bar.close()
        backends.close()
        if use_store is not None:
            use_store.delete_session(session_id)
        if isinstance(cache, EvictionCache):
            cache.unbind()
    tokens = len(conversation.ids)
    record = {"category": entry["category"], "session_id": entry["id"], "probe": 0, "arm": arm,
              "valid": bool(verdict["valid"]), "error_type": verdict.get("error_type"),
              "error_message": str(verdict.get("error_message", ""))[:300], "turns": len(entry["question"]),
              "turns_played": len(decoded), "force_terminated": forced, "looped": looped, "steps": steps, "calls": decoded,
              "replies": replies, "tools_native": native, "tokens": tokens, "system_tokens": len(template.system_ids),
              "peak_cache_bytes": peak["bytes"], "full_cache_bytes": full_cache_bytes(model, tokens),
              "seconds": round(time.perf_counter() - started, 2),
              "cpu_seconds": round(time.process_time() - cpu_started, 2)}
    if planned:
        record["planned"] = planned
    return record


# -- reporting -------------------------------------------------------------------------------------------------


def turn_calls(r: dict) -> list[list[str]]:
    """The calls executed at each turn of a record, its steps flattened."""
    return [[c for step in turn for c in step] for turn in r["calls"]]


def fidelity(r: dict, full: dict) -> tuple[int, int]:
    """(turns whose executed calls equal the full cache's, turns either played): a turn only one of the two
    reached (the other stopped early) differs; one neither reached is not counted."""
    mine, theirs = turn_calls(r), turn_calls(full)
    same = sum(1 for t in range(min(len(mine), len(theirs))) if mine[t] == theirs[t])
    return same, max(len(mine), len(theirs))


def calls_kept(r: dict, full: dict) -> tuple[int, int]:
    """(the full cache's executed calls that the arm also executed at the same turn, the full cache's calls).
    Fidelity counts a turn where neither executed anything as equal, and with a small model most turns are
    such; this counts only what the full cache did, so an arm that drops its calls cannot hide there."""
    mine = turn_calls(r)
    kept = total = 0
    for t, theirs in enumerate(turn_calls(full)):
        total += len(theirs)
        if t < len(mine):
            kept += sum((Counter(theirs) & Counter(mine[t])).values())
    return kept, total


def table(records: list[dict]) -> str:
    """Markdown: per category, a row per arm: accuracy with its 95% Wilson interval; fidelity to the full
    cache over the entries both played; of the full cache's executed calls and of its passes, those the arm
    keeps; tokens, peak KV and seconds per entry (means)."""
    out = []
    for category in CATEGORIES:
        got = [r for r in records if r["category"] == category]
        if not got:
            continue
        full = {r["session_id"]: r for r in got if r["arm"] == "full"}
        out += [f"**multi_turn_{category}**", "",
                "| arm | n | accuracy [95% CI] | fidelity to full (turns) | full's calls kept | full's passes kept "
                "| turns with a call | turns looped | tokens | peak KV (MiB) | full KV at that length (MiB) | wall s | CPU s |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm in [a for a in ARMS if any(r["arm"] == a for r in got)]:
            rs = [r for r in got if r["arm"] == arm]
            n, k = len(rs), sum(r["valid"] for r in rs)
            lo, hi = wilson(k, n)
            paired = [(r, full[r["session_id"]]) for r in rs if r["session_id"] in full]
            if arm == "full" or not paired:
                fid = calls = kept = "-"
            else:
                same, turns = map(sum, zip(*(fidelity(r, f) for r, f in paired)))
                fid = f"{same}/{turns} ({100 * same / max(turns, 1):.0f}%)"
                hit, of = map(sum, zip(*(calls_kept(r, f) for r, f in paired)))
                calls = f"{hit}/{of} ({100 * hit / of:.0f}%)" if of else "0/0"
                passes = [r for r, f in paired if f["valid"]]
                kept = f"{sum(r['valid'] for r in passes)}/{len(passes)}"
            called = sum(sum(1 for t in r["calls"] if t) for r in rs)
            turns = sum(r["turns_played"] for r in rs)
            peaks = [r["peak_cache_bytes"] for r in rs if r.get("peak_cache_bytes")]

            def mean(key):
                return sum(r[key] for r in rs) / n

            out.append(f"| {arm} | {n} | {k}/{n} = {100 * k / n:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}] | {fid} | {calls} | {kept} "
                       f"| {called}/{turns} | {sum(r.get('looped', 0) for r in rs)} | {mean('tokens'):,.0f} | "
                       + (f"{sum(peaks) / len(peaks) / 2**20:.1f}" if peaks else "-")
                       + f" | {mean('full_cache_bytes') / 2**20:.1f} | {mean('seconds'):.0f} | {mean('cpu_seconds'):.0f} |")
        errors: dict[str, dict[str, int]] = {}
        for r in got:
            if not r["valid"]:
                errors.setdefault(r["error_type"] or "?", {}).setdefault(r["arm"], 0)
                errors[r["error_type"] or "?"][r["arm"]] += 1
        if errors:
            out += ["", "Failures by bfcl-eval's error type: " + "; ".join(
                f"{e} " + ", ".join(f"{a} {c}" for a, c in sorted(by.items())) for e, by in sorted(errors.items()))]
        if paired_line := against_h2o(got):
            out += ["", paired_line]
        out.append("")
    if twins_line := long_context_twins(records):
        out.append(twins_line)
    return "\n".join(out)


def against_h2o(records: list[dict]) -> str:
    """Each arm against H2O entry by entry, on the full cache's calls kept, with the two-sided sign test:
    the calls of one entry hang together, so the entries, not the calls, are the independent units."""
    by = {(r["session_id"], r["arm"]): r for r in records}
    parts = []
    for arm in [a for a in ARMS if a not in ("full", "h2o") and any(r["arm"] == a for r in records)]:
        more = fewer = tied = 0
        for (sid, a), full in by.items():
            if a != "full" or (sid, arm) not in by or (sid, "h2o") not in by:
                continue
            mine, theirs = calls_kept(by[sid, arm], full)[0], calls_kept(by[sid, "h2o"], full)[0]
            more, fewer, tied = more + (mine > theirs), fewer + (mine < theirs), tied + (mine == theirs)
        if more + fewer + tied:
            parts.append(f"{arm} more on {more}, fewer on {fewer}, as many on {tied} "
                         f"(sign test p = {sign_test(more, fewer):.2g})")
    return ("Full's calls kept, entry by entry against h2o: " + "; ".join(parts)) if parts else ""


def long_context_twins(records: list[dict]) -> str:
    """How many ``long_context`` entries played exactly as their ``base`` twins under the full cache (the
    same calls and tokens). Their long content reaches the model only through tool outputs, so a model
    whose calls never fetch it plays the base entry again, and the two categories are not two samples."""
    full = {r["session_id"]: r for r in records if r["arm"] == "full"}
    pairs = [(r, full[sid.replace("long_context", "base")]) for sid, r in full.items()
             if r["category"] == "long_context" and sid.replace("long_context", "base") in full]
    if not pairs:
        return ""
    same = sum(a["calls"] == b["calls"] and a["tokens"] == b["tokens"] for a, b in pairs)
    return (f"Under the full cache, {same} of {len(pairs)} long_context entries played exactly as their base "
            "twins (the same calls and tokens): their long content comes only through tool outputs.")


def header(run: dict) -> str:
    return (f"model {run['model']} (torch.{run['dtype']}), B={run['budget']:,}, L={run['limit']:,}, H={run['chunk']:,}; "
            f"at most {run['max_steps']} steps a turn (BFCL: {BFCL_STEP_LIMIT}) and {run['max_new_tokens']} new tokens a "
            "step; greedy; " + ("a reply repeating the turn's previous one ends the turn (--stop-repeats); "
                                 if run.get("stop_repeats") else "")
            + "n counts entries; fidelity and what is kept, only the entries full also played")


# -- the command -----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from pace_bench.cli import choice_list, int_at_least, model_name
    from pace_bench.models import DEFAULT_MODEL

    ap = argparse.ArgumentParser(prog="pace-bench --suite bfcl", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", type=model_name, default=DEFAULT_MODEL, help="a packaged model name or a local directory")
    ap.add_argument("--categories", type=str, default="base", metavar="C[,C...]",
                    help=f"multi-turn categories from {{{', '.join(CATEGORIES)}}} ({', '.join(HELD_OUT)} are held out)")
    ap.add_argument("--entries", type=int_at_least(1), default=None, metavar="N",
                    help="the first N entries of each category (default: all 200)")
    ap.add_argument("--arms", type=choice_list(ARMS, "arm(s)"), default="full,h2o,pace,pace_retrieval",
                    metavar="ARM[,ARM...]", help=f"from {{{', '.join(ARMS)}}}")
    ap.add_argument("--budget", type=int_at_least(1), default=1024, help="B: resident tokens per layer and KV head")
    ap.add_argument("--limit", type=int_at_least(1), default=4096, help="L: the bounded arms' rotary limit (L > B + H)")
    ap.add_argument("--chunk", type=int_at_least(1), default=2048, help="H: prefill chunk size")
    ap.add_argument("--max-steps", type=int_at_least(1), default=BFCL_STEP_LIMIT,
                    help="steps (replies with calls) a turn may take; one more stops the entry, as BFCL's runner does")
    ap.add_argument("--stop-repeats", action="store_true",
                    help="a reply equal to the turn's previous one ends the turn (a greedy loop; not a BFCL rule)")
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=256, help="new tokens per reply")
    ap.add_argument("--system", default=None, help="the system prompt before the tools (default: pace_hf's)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="a bar per entry and arm")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument("--out", default="runs/bfcl", help="folder for probes.jsonl, table.md and run.json")
    ap.add_argument("--resume", action="store_true",
                    help="keep the (entry, arm) pairs OUT already holds (and a sharded run's shards) and play the rest")
    ap.add_argument("--report", action="store_true", help="play nothing: write OUT/table.md from what OUT holds and exit")
    return ap


def check_args(ap, args) -> None:
    """Bad input is an error before anything loads."""
    why = bfcl_missing()
    if why:
        ap.error(why)
    args.categories = list(dict.fromkeys(c.strip().removeprefix("multi_turn_") for c in args.categories.split(",") if c.strip()))
    held = [c for c in args.categories if c in HELD_OUT]
    if held:
        ap.error(f"--categories: {', '.join(held)} {'is' if len(held) == 1 else 'are'} held out (kept to evaluate this "
                 "suite on material it was not tuned on): not played")
    bad = [c for c in args.categories if c not in CATEGORIES]
    if bad or not args.categories:
        ap.error(f"--categories: unknown {', '.join(bad) or '(none given)'}: choose from {', '.join(CATEGORIES)}")
    check_budget(ap, [args.budget])
    check_limit(ap, [a for a in args.arms if a in BOUNDED], args.limit, args.budget, args.chunk)


write_table = table_writer(header, table)  # table.md, at the run's end and for --report


def main(argv=None) -> int:
    from pace_bench.suite import command_line, play_all

    args = command_line(argv, build_parser, check_args, write_table, suite="bfcl", what="played entries")
    if args is None:
        return 0
    from pace_bench.models import load_model, resolve_dtype
    from pace_bench.records import process_state, resumed_records

    state = process_state()
    out_dir = Path(args.out)
    by_category = [load_entries(c)[:args.entries] for c in args.categories]
    # the categories interleaved (the first entry of each, then the second...): a partial run covers each
    entries = [e for row in itertools.zip_longest(*by_category) for e in row if e is not None]
    dtype = resolve_dtype(args.dtype, state.device.type)
    run = {**{k: v for k, v in vars(args).items() if k not in ("resume", "report", "progress")},
           "dtype": str(dtype).removeprefix("torch."), "num_processes": state.num_processes}
    records = []
    if args.resume:
        records = resumed_records(out_dir, run, RUN_KEYS, "bfcl")
    done = {(r["session_id"], r["arm"]) for r in records}
    model, tokenizer = load_model(args.model, dtype=dtype)
    model.to(state.device)
    s = BfclSettings(budget=args.budget, limit=args.limit, chunk=args.chunk, max_steps=args.max_steps,
                     max_new_tokens=args.max_new_tokens, stop_repeats=args.stop_repeats)
    order = [(e, arm) for e in entries for arm in args.arms]  # an entry's arms together: a partial run is paired
    rank = {(e["id"], arm): k for k, (e, arm) in enumerate(order)}

    play_all(out_dir, run, records, [(e, arm) for e, arm in order if (e["id"], arm) not in done],
             lambda item, store: [play(model, tokenizer, item[0], item[1], s, store, args.system,
                                       progress=args.progress and state.is_main_process)],
             rank=lambda r: rank.get((r["session_id"], r["arm"]), len(rank)),
             describe=lambda r: (f"{r['session_id']:>24} {r['arm']:>14} {'PASS' if r['valid'] else 'fail'} "
                                 f"{r['error_type'] or '':<40} turns {r['turns_played']}/{r['turns']} "
                                 f"tokens {r['tokens']:,} {r['seconds']:.0f}s"),
             desc="bfcl entries x arms", finish=lambda records: write_table(out_dir, run, records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
