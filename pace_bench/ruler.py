"""RULER through lm-eval: the field's long-context test, played with each arm's cache.

    pace-bench --suite ruler --tasks niah_single_1,niah_multikey_2,vt,fwe,cwe --lengths 8192,32768 \\
        --samples 10 --needles 4 --arms full,snapkv,snapkv_bounded,pace_retrieval --out runs/ruler

Samples come from lm-eval 0.4.13's own RULER generators (``lm_eval.tasks.ruler``), sized with this
model's tokenizer; answers are scored with lm-eval's own ``common_utils.process_results``. Nothing of
either is re-implemented here: a task is the generator call its lm-eval task makes, with fewer samples
(and, in the session setting, more needles).

Two settings, reported apart:
- ``question_last``: RULER's layout and RULER's one-question prompts, the context then the question in
  one user message, each prompt prefilled from scratch. An evicting arm holds the context whole and
  compresses it once, in the question's forward (``EvictionCache.holding``), as SnapKV and kvpress's
  question-aware mode do: this is the setting where the arms see the question before they choose
  (so ``pace_retrieval`` has nothing evicted to bring back here; ``pace_plan`` is PACE's arm for it).
- ``session``: the context arrives as tool outputs of about ``--tool-tokens`` tokens each (an agent
  reading documents), each question as a later user turn. The cost protocol: a 128K prefill takes half
  an hour on a CPU, so one context carries ``--needles`` K needles (the NIAH generator's key count,
  ``num_needle_k`` = ``num_needle_q`` = K) and is prefilled once and saved (``cache.save()``; a deep copy
  for DynamicCache); each of its K questions resumes the saved state, adds its turn and answers.
  Each question asks for one needle in RULER's one-question wording, with that needle's value as its
  only expected output (``tests/test_ruler.py`` checks that every answer from the saved state is, token
  for token, the answer of a fresh prefill of the context and that question). vt, fwe and cwe ask one
  question of all their context and keep one per context.

In both, each answer starts after lm-eval's ``gen_prefix`` in the assistant turn, as lm-eval does for
chat models. The context is prefilled in ``--chunk`` forwards, then the question (and for the PACE
arms the retrieval step comes between the two).

Arms: ``full`` (DynamicCache), ``h2o``, ``snapkv``, ``snapkv_bounded`` (SnapKV with bounded
positions), ``streaming`` (StreamingLLM), ``pace_retrieval`` (PACE with no plan; each question's turn
restores the evicted pages it matches, ``pace_hf.memory.retrieval``), ``pace_follow`` (the same, also following
the links of what it restores: ``PageRetriever(follow=True)``) and ``pace_plan`` (PACE given the
questions as its plan: the context pages they match lexically are planned before the context arrives).

Each record is one question: its context (``session_id``) and its index there (``probe``), the answer,
lm-eval's score, the residency (mean over layers and KV heads) and rotary gap of its own needle when the
answer's first query runs; for ``pace_retrieval``, the rank of that needle's page under each retrieval
signal (lexical, digest, both) over every page of the context. Output in ``--out``: ``probes.jsonl``
(``--resume`` keeps it; a context cut short answers only its missing questions), ``table.md``
(accuracy per task, length and arm over questions, with 95% Wilson intervals, per setting),
``ruler_{setting}.png``, ``run.json`` and ``contexts/`` (the samples, so a resumed stage need not
generate them again). ``--report`` plays nothing and writes the table and figures of
what ``--out`` holds so far, a run still going included.

Contexts are independent, so several processes can share the (context, arm) pairs, as in the coding
runner: under ``accelerate launch`` each process takes the next pair nobody has taken
(``pace_bench.suite.claim_in_order``), plays it into ``probes.rank{N}.jsonl``, and the main process merges
them (``pace_bench.records``).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import copy
import hashlib
import importlib.util
import io
import json
import os
import random
import re
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from pace_bench import arms as registry
from pace_bench.stats import wilson
from pace_bench.suite import check_budget, check_limit

# task -> the generator call of its lm-eval task (lm_eval/tasks/ruler/*_utils.py) and that task's
# max_gen_toks (its YAML); min_length: the shortest length its generator can fill (template, example
# and answer room included).
TASKS = {
    "niah_single_1": {"kind": "niah", "haystack": "repeat", "needle_k": "words", "needle_v": "numbers",
                      "max_gen_toks": 128, "min_length": 512},
    "niah_multikey_2": {"kind": "niah", "haystack": "needle", "needle_k": "words", "needle_v": "numbers",
                        "max_gen_toks": 128, "min_length": 512},
    "niah_multikey_3": {"kind": "niah", "haystack": "needle", "needle_k": "uuids", "needle_v": "uuids",
                        "max_gen_toks": 128, "min_length": 1024},
    "vt": {"kind": "vt", "max_gen_toks": 30, "min_length": 1024},
    "fwe": {"kind": "fwe", "max_gen_toks": 50, "min_length": 1024},
    "cwe": {"kind": "cwe", "max_gen_toks": 120, "min_length": 1024},
}
SETTINGS = ("question_last", "session")
# The suite's arms are the registry's caches (pace_bench.arms); PACE's three differ in what a question's
# turn does (restore what it matches, also follow its links, or plan the questions), not in the cache.
RETRIEVAL = ("pace_retrieval", "pace_follow")  # no plan: each question's turn restores what it matches
PACE = (*RETRIEVAL, "pace_plan")
ARMS = ("full", "h2o", "snapkv", "snapkv_bounded", "streaming", *PACE)
BOUNDED = tuple(a for a in ARMS if a in PACE or registry.ARMS[a].bounded)
SIGNALS = ("lexical", "digest", "both")
LONG_LINE = 200  # a needle is its whole line when the line is at most this long (niah, vt), else its words
# Needles per NIAH context, at most: every other needle of a context is a distractor of the same form
# for each question, so more needles is a harder task; 8 is twice RULER's densest NIAH (4 keys, queries
# or values).
MAX_NEEDLES = 8


@dataclass(frozen=True)
class RulerSettings:
    budget: int = 2048
    limit: int = 8192
    chunk: int = 4096
    tool_tokens: int = 2048
    max_new_tokens: int | None = None


# -- lm-eval's generators and scorer -------------------------------------------------------------------


def lm_eval_missing(tasks) -> str | None:
    """Why the suite cannot run here (lm-eval, or wonderwords for cwe, not installed), or None."""
    if importlib.util.find_spec("lm_eval") is None:
        return "lm-eval is not installed: pip install 'lm-eval==0.4.13' wonderwords (the [bench] extra)"
    if "cwe" in tasks and importlib.util.find_spec("wonderwords") is None:
        return "task cwe needs wonderwords: pip install wonderwords"
    return None


def _ruler(module: str):
    """A module of ``lm_eval.tasks.ruler``. ``prepare_niah`` asks nltk to download punkt_tab at import;
    only the essay haystack (which downloads its data anyway) sentence-splits, so offline the download
    is skipped instead of timing out."""
    import nltk

    download = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return importlib.import_module(f"lm_eval.tasks.ruler.{module}")
    finally:
        nltk.download = download


def needles_of(task: str, needles: int) -> int:
    """The needles a context of ``task`` carries: ``needles`` for the NIAH tasks; vt, fwe and cwe ask one
    question of all their context, so one."""
    return needles if TASKS[task]["kind"] == "niah" else 1


def generate(task: str, length: int, n: int, tokenizer, seed: int, needles: int = 1) -> list[dict]:
    """``n`` samples of ``task`` at ``length`` tokens from lm-eval's generator (seeded: the generators
    draw from the global ``random`` and ``numpy`` states). A NIAH sample with ``needles`` K > 1 holds K
    needles and asks for all of them (the generator's ``num_needle_k`` = ``num_needle_q`` = K, sized to
    fit that longer question); :func:`questions` splits it into one question per needle. Each sample
    gets ``task`` and ``needles``."""
    import numpy as np

    spec = TASKS[task]
    if needles != needles_of(task, needles) or not 1 <= needles <= MAX_NEEDLES:
        allowed = f"1 to {MAX_NEEDLES} needles" if spec["kind"] == "niah" else "one needle"
        raise ValueError(f"{task} carries {allowed} per context, not {needles}")
    # The generator's modules first: importing them draws from the global random state (wonderwords, nltk),
    # so seeding before would give another sample on a process's first call than on its later ones.
    generator = {"niah": ("niah_utils", "prepare_niah"), "vt": ("vt_utils",), "fwe": ("fwe_utils",),
                 "cwe": ("cwe_utils",)}[spec["kind"]]
    modules = [_ruler(name) for name in generator]
    random.seed(f"{seed}:{task}:{length}")
    np.random.seed(zlib.crc32(f"{seed}:{task}:{length}".encode()))
    quiet = contextlib.redirect_stdout(io.StringIO())  # vt prints every size it tries
    with quiet:
        if spec["kind"] == "niah":
            niah, prepare = modules
            out = prepare.generate_samples(
                prepare.get_haystack(type_haystack=spec["haystack"]), max_seq_length=length, template=niah.TEMPLATE,
                type_haystack=spec["haystack"], type_needle_k=spec["needle_k"], type_needle_v=spec["needle_v"],
                num_samples=n, TOKENIZER=tokenizer, num_needle_k=needles, num_needle_q=needles)
        elif spec["kind"] == "vt":
            vt = modules[0]
            icl = vt.sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=1, max_seq_length=500, incremental=5)[0]
            out = vt.sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=n, max_seq_length=length,
                                                 icl_example=icl)
        elif spec["kind"] == "fwe":
            out = modules[0].sys_kwext(tokenizer=tokenizer, max_seq_length=length, num_samples=n)
        else:
            out = modules[0].sys_word_pair_random(num_samples=n, max_seq_length=length, tokenizer=tokenizer)
    out = [dict(x, task=task, needles=needles) for x in out]
    return [dict(x, questions=form_questions(x)) for x in out]


def tokenizer_digest(tokenizer) -> str:
    """What a tokenizer cuts text with (a fast tokenizer's whole pipeline, else its vocabulary), hashed: a
    context sized with another tokenizer has other lengths."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def kept_or_generated(folder: Path, task: str, length: int, n: int, tokenizer, seed: int,
                      needles: int = 1) -> list[dict]:
    """:func:`generate`'s samples, kept in ``folder`` (a run's ``OUT/contexts``): a stage resumed, or a
    second stage on the same contexts, reads them instead of importing lm-eval's generators again (8 s
    for ``prepare_niah``) and sizing each context again with the tokenizer (minutes at 128K). An entry
    is keyed by all that :func:`generate` reads, lm-eval's version and the tokenizer included; one that
    cannot be read, or holds another key, is generated again and replaced (atomically)."""
    from importlib.metadata import version

    key = {"task": task, "length": length, "samples": n, "seed": seed, "needles": needles,
           "lm_eval": version("lm_eval"), "tokenizer": tokenizer_digest(tokenizer)}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = folder / f"{task}-{length}-{name}.json"
    try:
        kept = json.loads(path.read_text())
        if kept["key"] == key and len(kept["samples"]) == n:
            return kept["samples"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, cut short or damaged: generated again below
    samples = generate(task, length, n, tokenizer, seed, needles)
    folder.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(f".{os.getpid()}.part")
    part.write_text(json.dumps({"key": key, "samples": samples}))
    os.replace(part, path)
    return samples


def niah_question(task: str, key: str) -> tuple[str, str]:
    """RULER's one-question wording for ``key`` in ``task``: the question line and the ``gen_prefix`` that
    lm-eval's NIAH generator writes for a sample with one query and one value (``generate_input_output``
    words its ``TEMPLATE`` in the singular, ``generate_samples`` its prefix)."""
    line = _ruler("niah_utils").TEMPLATE.rsplit("\n", 1)[1]
    for plural, singular in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        line = line.replace(plural, singular)
    value = TASKS[task]["needle_v"][:-1]
    return (line.format(type_needle_v=value, query=key),
            f"The special magic {value} for {key} mentioned in the provided text is")


def niah_questions(sample: dict) -> list[dict]:
    """One question per needle of a NIAH ``sample``: each expected value's key is read off its needle
    line (lm-eval's ``NEEDLE`` format; of the lines holding that value, the one whose key the sample's
    question asks, since niah_multikey's haystack is made of needles too) and asked alone."""
    context, asked = split_question(sample)
    before, after = _ruler("prepare_niah").NEEDLE.format(
        type_needle_v=TASKS[sample["task"]]["needle_v"], key="\n", value="\n").split("\n", 1)
    out = []
    for value in sample["outputs"]:
        line = re.compile(re.escape(before) + r"([^\n]+?)" + re.escape(after.replace("\n", value)))
        keys = {m.group(1) for m in line.finditer(context) if m.group(1) in asked}
        if len(keys) != 1:
            raise ValueError(f"cannot tell which needle holds {value!r} (keys {sorted(keys)}); try another --seed")
        question, prefix = niah_question(sample["task"], keys.pop())
        out.append({"question": question, "gen_prefix": prefix, "outputs": [value]})
    return out


def form_questions(sample: dict) -> list[dict]:
    """The questions asked of ``sample``'s context, each a RULER doc for :func:`score` (its question line,
    ``gen_prefix``, ``outputs`` and the sample's ``max_length``): one per needle when it carries several,
    else the sample's own. :func:`generate` forms them once, into the sample's ``questions``."""
    own = [{"question": split_question(sample)[1], "gen_prefix": sample["gen_prefix"],
            "outputs": list(sample["outputs"])}]
    return [dict(q, max_length=sample["max_length"]) for q in (niah_questions(sample) if sample["needles"] > 1 else own)]


def score(doc: dict, prediction: str) -> float:
    """lm-eval's RULER score of one answer (the fraction of the doc's expected outputs it contains)."""
    metrics = _ruler("common_utils").process_results(doc, [prediction])
    return float(metrics[str(doc["max_length"])])


# -- prompts, with each needle's token positions -----------------------------------------------------------


def split_question(sample: dict) -> tuple[str, str]:
    """(context, question): every RULER input here ends with its question on the last line."""
    context, question = sample["input"].rsplit("\n", 1)
    return context + "\n", question


def needle_spans(text: str, outputs) -> list[tuple[int, int]]:
    """Character spans of ``text`` that hold the expected outputs: each occurrence's line when the line
    is short (a NIAH needle, a VT assignment), else the occurrence itself (FWE, CWE), merged."""
    spans = []
    for out in outputs:
        for m in re.finditer(re.escape(out), text):
            lo, hi = text.rfind("\n", 0, m.start()) + 1, text.find("\n", m.end())
            hi = len(text) if hi < 0 else hi
            spans.append((lo, hi) if hi - lo <= LONG_LINE else (m.start(), m.end()))
    merged = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(e, merged[-1][1]))
        else:
            merged.append((s, e))
    return merged


def encode_block(template, role: str, content: str, groups) -> tuple[list[int], list[list[int]]]:
    """The message's ids and, per group of character spans of ``content``, the (block-relative) token
    positions covering them."""
    block = template.block(role, content)
    at = block.index(content)
    enc = template.tok(block, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    ends = [e for _, e in offsets]
    starts = [s for s, _ in offsets]
    out = []
    for spans in groups:
        positions = []
        for cs, ce in spans:
            first = bisect.bisect_right(ends, cs + at)
            last = bisect.bisect_left(starts, ce + at)
            positions += range(first, max(first, last))
        out.append(positions)
    return ids, out


def tool_cuts(context: str, spans, tokenizer, tool_tokens: int) -> list[int]:
    """Where the context is cut into tool outputs of about ``tool_tokens`` tokens: character offsets, at a
    line or word end and never inside a needle (``spans``), first 0 and last ``len(context)``."""
    offsets = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    cuts, k = [0], tool_tokens
    while k < len(offsets):
        at = offsets[k][0]
        for s, e in spans:
            if s < at < e:
                at = s
        nl = max(context.rfind("\n", cuts[-1], at), context.rfind(" ", cuts[-1], at))
        at = nl + 1 if nl > cuts[-1] else at
        if at > cuts[-1]:
            cuts.append(at)
        k += tool_tokens
    return cuts + [len(context)]


def build_prompt(sample: dict, setting: str, template, settings: RulerSettings) -> dict:
    """The conversation's ids: ``context`` (everything before the first question's turn, or before the
    question in question-last), ``questions`` (per question, the rest, up to and with its answer prefix),
    ``docs`` (the sample's ``questions``) and ``needles`` (per question, its needle's logical positions)."""
    context, _ = split_question(sample)
    docs = sample["questions"]
    groups = [needle_spans(context, d["outputs"]) for d in docs]
    ids = list(template.system_ids)

    def answer_prefix(doc):
        return template.encode(template.gen_header + doc["gen_prefix"])

    if setting == "question_last":
        if len(docs) != 1:
            raise ValueError("question-last prompts are RULER's, one question each: generate them with needles=1")
        content = context + docs[0]["question"]
        block, (positions, asked) = encode_block(template, "user", content, groups + [[(len(context), len(content))]])
        split = asked[0] if asked else len(block)
        return {"context": ids + block[:split], "questions": [block[split:] + answer_prefix(docs[0])], "docs": docs,
                "needles": [[len(ids) + p for p in positions]]}
    needles = [[] for _ in docs]
    cuts = tool_cuts(context, [s for g in groups for s in g], template.tok, settings.tool_tokens)
    for lo, hi in zip(cuts, cuts[1:]):
        inside = [[(max(s, lo) - lo, min(e, hi) - lo) for s, e in g if s < hi and e > lo] for g in groups]
        block, positions = encode_block(template, "tool", context[lo:hi], inside)
        for got, p in zip(needles, positions):
            got += [len(ids) + x for x in p]
        ids += block
    turns = [template.encode(template.block("user", d["question"])) + answer_prefix(d) for d in docs]
    return {"context": ids, "questions": turns, "docs": docs, "needles": needles}


# -- arms ----------------------------------------------------------------------------------------------------


def make_cache(arm: str, model, s: RulerSettings, store=None, session_id: str | None = None):
    """The cache of one arm: the registry's (PACE's three arms are its ``pace``, with no plan yet)."""
    from pace_hf import Blueprint

    return registry.make_cache("pace" if arm in PACE else arm, model, Blueprint(),
                               registry.ArmSettings(budget=s.budget, limit=s.limit), store, session_id)


def plan_questions(cache, retriever, context_ids: list[int], texts: list[str], step: int) -> list:
    """PACE given the questions as its plan (the agent knows its next steps): per question, the context
    pages it matches lexically, best first, within the retrieval share of the budget (``budget // 4``),
    all planned for ``step``. Questions take pages in turns, each its best page first, and the plan stops
    at half the budget (the rest is for the sinks, the recent window and the question); a page two
    questions match is planned once.

    Why the retriever's BM25 and not the planner's lexical ranker (``pace_hf.planner.prose.Lexicon``):
    that ranker ranks the *definitions* the planner's reader extracts (code, and named prose facts such
    as "`MAX_RETRIES` = 5"), and RULER's haystack holds none a question asks for: a NIAH needle ("One of
    the special magic numbers for wry-hat is: 7301041.") is not one, so it would plan nothing. The
    retriever's pages are the same BM25 (``bm25s``) over the context's own text."""
    from pace_hf import Span

    share = retriever.share or max(1, cache.budget // 4)
    pages = retriever.pages(len(context_ids))
    orders = [retriever.rank(context_ids, text)[0] for text in texts]
    used, chosen, total = [0] * len(texts), [], 0
    for r in range(max(map(len, orders), default=0)):
        for j, order in enumerate(orders):
            if r >= len(order) or order[r] in chosen:
                continue
            start, end = pages[order[r]]
            if used[j] + end - start <= share and total + end - start <= cache.budget // 2:
                chosen.append(order[r])
                used[j] += end - start
                total += end - start
    return [cache.blueprint.add(Span(*pages[p], [step])) for p in chosen]


def prefill(model, cache, ids: list[int], chunk: int, bar=None) -> None:
    """Prefill what ``cache`` lacks of ``ids``, ``chunk`` tokens per forward, each counted on ``bar``."""
    with torch.no_grad():
        for s in range(cache.get_seq_length(), len(ids), chunk):
            model(torch.tensor([ids[s:s + chunk]], device=model.device), cache=cache)
            if bar is not None:
                bar.update(len(ids[s:s + chunk]))


def save_state(cache):
    """What a later question resumes from: the store's saved session, or a copy of a DynamicCache."""
    from pace_hf import EvictionCache

    if isinstance(cache, EvictionCache):
        cache.save()
        return ("saved", type(cache), cache.session_id)
    return ("copy", copy.deepcopy(cache), None)


def resume_state(state, model, store):
    kind, what, session_id = state
    if kind == "saved":
        return what.resume(session_id, store=store, model=model)
    return copy.deepcopy(what)


def answer(model, cache, ids: list[int], max_new_tokens: int, stop_ids, chunk: int, needle,
           criteria=()) -> tuple[list[int], dict]:
    """Greedy answer to ``ids`` (the cache holds a prefix), and the ledger at the answer's first query."""
    from pace_bench.readings import ReadAtFirstQuery
    from pace_hf.session import generate_reply

    reading = ReadAtFirstQuery(cache, torch.tensor(needle, dtype=torch.long))
    tokens = generate_reply(model, ids, cache, max_new_tokens=max_new_tokens, stop_ids=stop_ids, chunk=chunk,
                            stopping_criteria=[reading, *criteria])
    return tokens, reading.reading or {}


def needle_page_ranks(rankers: dict, model, context_ids: list[int], question: str, needle) -> dict:
    """The rank (0 = first) of the page holding most of the needle, per retrieval signal (``rankers``:
    a PageRetriever per signal), over every page of the context: how well each signal would find it."""
    out = {}
    for signal, r in rankers.items():
        pages = r.pages(len(context_ids))
        hits = [sum(s <= p < e for p in needle) for s, e in pages]
        target = max(range(len(pages)), key=hits.__getitem__) if needle else None
        order, _ = r.rank(context_ids, question, model)
        out[signal] = order.index(target) if target in order else None
    return out


def context_id(setting: str, sample: dict) -> str:
    return f"{setting}-{sample['task']}-{sample['max_length']}-{sample['index']}"


def play(model, tokenizer, template, sample: dict, setting: str, arm: str, s: RulerSettings, stop_ids,
         store=None, ranks: bool = False, skip=(), progress: bool = False) -> list[dict]:
    """One context, one arm, one setting: a record per question (answer, lm-eval score, its needle's
    ledger), but for the question indices in ``skip`` (answered before). Session: the context is
    prefilled once and saved, and each question resumes the saved state. ``progress``: a bar of the
    prefilled tokens that names the phase (:class:`pace_bench.progress.SessionProgress`)."""
    from pace_hf import EvictionCache
    from pace_hf.memory.retrieval import PageRetriever

    started = time.perf_counter()
    prompt = build_prompt(sample, setting, template, s)
    context, docs = prompt["context"], prompt["docs"]
    todo = [j for j in range(len(docs)) if j not in skip]
    sid = context_id(setting, sample)
    pace = arm in PACE
    use_store = store if (pace or setting == "session") and arm != "full" else None
    cache = make_cache(arm, model, s, use_store, f"ruler-{sid}-{arm}")
    retriever = PageRetriever(tokenizer, follow=arm == "pace_follow")
    rankers = {sig: PageRetriever(tokenizer, signal=sig) for sig in SIGNALS} if ranks and arm == "pace_retrieval" else {}
    if arm == "pace_plan":  # every question, answered or not: the prefill is the one they all share
        plan_questions(cache, retriever, context, [d["question"] for d in docs], step=1)
    if isinstance(cache, EvictionCache):
        cache.step = 1
    bar = None
    if progress:
        from pace_bench.progress import SessionProgress

        bar = SessionProgress(f"{arm} {sid}", len(context) + sum(len(prompt["questions"][j]) for j in todo))
    records = []
    try:
        if bar is not None:
            bar.phase("prefill context", len(context))
        # question-last: the prompt is compressed once, by its question's forward (SnapKV's setting)
        with cache.holding() if setting == "question_last" and isinstance(cache, EvictionCache) else contextlib.nullcontext():
            prefill(model, cache, context, s.chunk, bar)
        prefill_seconds = time.perf_counter() - started
        state = save_state(cache) if setting == "session" else None  # prefill once, save
        for n, j in enumerate(todo, 1):
            start, doc, of = time.perf_counter(), docs[j], f"{n}/{len(todo)}"
            if state is not None:  # each question resumes the saved state
                cache = resume_state(state, model, use_store)
                if isinstance(cache, EvictionCache):
                    cache.step = 1
            restored = None
            if arm in RETRIEVAL:
                before = cache.tier_stats.get("retrieval_tokens_restored", 0)
                cache.retrieve(doc["question"], context, retriever=retriever)
                restored = cache.tier_stats.get("retrieval_tokens_restored", 0) - before
            budget = min(TASKS[sample["task"]]["max_gen_toks"], s.max_new_tokens or 1 << 30)
            criteria = []
            if bar is not None:
                bar.phase(f"prefill question {of}", len(prompt["questions"][j]))
                criteria.append(bar.answering(f"answer {of}", budget, len(context) + len(prompt["questions"][j])))
            tokens, reading = answer(model, cache, context + prompt["questions"][j], budget, stop_ids, s.chunk,
                                     prompt["needles"][j], criteria)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            record = {"setting": setting, "task": sample["task"], "length": sample["max_length"],
                      "index": sample["index"], "session_id": sid, "probe": j, "probes": len(docs), "arm": arm,
                      "score": score(doc, text), "answer": text, "outputs": doc["outputs"],
                      "context_tokens": len(context), "needle_tokens": len(prompt["needles"][j]), **reading,
                      "seconds": round(time.perf_counter() - start, 2), "prefill_seconds": round(prefill_seconds, 2)}
            if restored is not None:
                record["retrieval_tokens_restored"] = restored
            if rankers:
                record["needle_page_rank"] = needle_page_ranks(rankers, model, context, doc["question"],
                                                               prompt["needles"][j])
            records.append(record)
    finally:
        if bar is not None:
            bar.close()
        if use_store is not None:
            use_store.delete_session(f"ruler-{sid}-{arm}")
    return records
# -- reporting ---------------------------------------------------------------------------------------------


def by_cell(records: list[dict]) -> dict[tuple, list[dict]]:
    """The records of each table cell: (setting, task, length, arm) -> records."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["setting"], r["task"], r["length"], r["arm"]), []).append(r)
    return groups


def accuracy(records: list[dict]) -> dict[tuple, tuple[float, int, float, float]]:
    """(setting, task, length, arm) -> (mean score, n, Wilson low, Wilson high)."""
    out = {}
    for key, got in by_cell(records).items():
        p = sum(r["score"] for r in got) / len(got)
        out[key] = (p, len(got), *wilson(p * len(got), len(got)))
    return out


def table(records: list[dict]) -> str:
    """Markdown, kvpress's leaderboard shape: one table per setting, a row per (task, length), a column
    per arm, each cell the accuracy in % with its 95% Wilson interval and question count; below each, the
    same grid of the needle's mean residency and rotary gap (why an arm failed: lost, or too far), and
    last the retrieval signals' needle-page ranks (:func:`recall_table`)."""
    acc, grouped = accuracy(records), by_cell(records)
    arms = [a for a in ARMS if any(k[3] == a for k in acc)]
    out = []
    for setting in SETTINGS:
        rows = sorted({(k[1], k[2]) for k in acc if k[0] == setting}, key=lambda t: (list(TASKS).index(t[0]), t[1]))
        if not rows:
            continue
        out += [f"**{setting}**", "", "| task | length | " + " | ".join(arms) + " |",
                "|---|---|" + "---|" * len(arms)]
        for task, length in rows:
            cells = []
            for arm in arms:
                got = acc.get((setting, task, length, arm))
                cells.append("-" if got is None else f"{100 * got[0]:.0f} [{100 * got[2]:.0f}, {100 * got[3]:.0f}] (n={got[1]})")
            out.append(f"| {task} | {length:,} | " + " | ".join(cells) + " |")
        out += ["", f"Needle when the answer's first query runs ({setting}): mean residency / mean rotary gap",
                "", "| task | length | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
        for task, length in rows:
            cells = []
            for arm in arms:
                got = grouped.get((setting, task, length, arm), [])
                gaps = [r["rotary_gap"] for r in got if r.get("rotary_gap") is not None]
                cells.append("-" if not got else f"{sum(r['residency'] for r in got) / len(got):.2f} / "
                             + (f"{sum(gaps) / len(gaps):,.0f}" if gaps else "-"))
            out.append(f"| {task} | {length:,} | " + " | ".join(cells) + " |")
        out.append("")
    out += recall_table(records)
    return "\n".join(out)


def recall_table(records: list[dict]) -> list[str]:
    """Markdown lines: per (setting, task, length), how often each retrieval signal ranks the needle's page
    first and in its top 3 (``pace_retrieval`` records with ``needle_page_rank``); none if no such record."""
    ranked = [r for r in records if r.get("needle_page_rank")]
    if not ranked:
        return []
    signals = list(ranked[0]["needle_page_rank"])
    out = ["Retrieval: the needle's page ranked first / in the top 3, of n questions, per signal", "",
           "| setting | task | length | n | " + " | ".join(signals) + " |", "|---|---|---|---|" + "---|" * len(signals)]
    keys = sorted({(r["setting"], r["task"], r["length"]) for r in ranked},
                  key=lambda k: (SETTINGS.index(k[0]), list(TASKS).index(k[1]), k[2]))
    for key in keys:
        got = [r["needle_page_rank"] for r in ranked if (r["setting"], r["task"], r["length"]) == key]
        cells = [f"{sum(g[s] == 0 for g in got)} / {sum(g[s] is not None and g[s] < 3 for g in got)}" for s in signals]
        out.append(f"| {key[0]} | {key[1]} | {key[2]:,} | {len(got)} | " + " | ".join(cells) + " |")
    return out + [""]


def figures(records: list[dict], out_dir: Path) -> list[Path]:
    """One figure per setting: accuracy against length, a panel per task, a line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = accuracy(records)
    paths = []
    for setting in SETTINGS:
        tasks = [t for t in TASKS if any(k[0] == setting and k[1] == t for k in acc)]
        if not tasks:
            continue
        fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.4), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for arm in ARMS:
                pts = sorted((k[2], v) for k, v in acc.items() if k[:2] == (setting, task) and k[3] == arm)
                if pts:
                    xs = [x for x, _ in pts]
                    ax.errorbar(xs, [100 * v[0] for _, v in pts], capsize=2, marker="o", label=arm,
                                yerr=[[100 * (v[0] - v[2]) for _, v in pts], [100 * (v[3] - v[0]) for _, v in pts]])
            ax.set_xscale("log", base=2)
            ax.set(title=task, xlabel="context length (tokens)", ylabel="accuracy (%)", ylim=(-5, 105))
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(f"RULER, {setting.replace('_', '-')} setting")
        fig.tight_layout()
        path = out_dir / f"ruler_{setting}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# -- the command ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from pace_bench.models import DEFAULT_MODEL
    from pace_bench.cli import choice_list, int_at_least, model_name, token_counts

    ap = argparse.ArgumentParser(prog="pace-bench --suite ruler", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", type=model_name, default=DEFAULT_MODEL, help="a packaged model name or a local directory")
    ap.add_argument("--tasks", type=choice_list(list(TASKS), "task(s)"), default="niah_single_1",
                    metavar="TASK[,TASK...]", help=f"from {{{', '.join(TASKS)}}}")
    ap.add_argument("--lengths", type=token_counts, default="8192", metavar="N[,N...]", help="RULER's max_seq_length(s)")
    ap.add_argument("--samples", type=int_at_least(1), default=5, help="contexts per task and length")
    ap.add_argument("--needles", type=int_at_least(1), default=4, metavar="K",
                    help=f"session setting: needles per NIAH context, each asked from the saved state (1 to "
                         f"{MAX_NEEDLES}); vt, fwe and cwe ask one question of all their context and keep 1, and "
                         "question-last keeps RULER's one-question prompts")
    ap.add_argument("--arms", type=choice_list(ARMS, "arm(s)"), default="full,snapkv,pace_retrieval",
                    metavar="ARM[,ARM...]", help=f"from {{{', '.join(ARMS)}}}")
    ap.add_argument("--settings", type=choice_list(SETTINGS, "setting(s)"), default="session", metavar="S[,S...]",
                    help=f"from {{{', '.join(SETTINGS)}}}")
    ap.add_argument("--budget", type=int_at_least(1), default=2048, help="B: resident tokens per layer and KV head")
    ap.add_argument("--limit", type=int_at_least(1), default=8192, help="L: the bounded arms' rotary limit (L > B + H)")
    ap.add_argument("--chunk", type=int_at_least(1), default=4096, help="H: prefill chunk size")
    ap.add_argument("--tool-tokens", type=int_at_least(16), default=2048, help="tokens per tool output (session setting)")
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=None, help="cap the tasks' max_gen_toks")
    ap.add_argument("--ranks", action=argparse.BooleanOptionalAction, default=True,
                    help="record the needle page's rank under each retrieval signal (pace_retrieval)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                    help="a bar per context and arm: its prefilled tokens and the phase")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument("--out", default="runs/ruler", help="folder for probes.jsonl, table.md, run.json and figures")
    ap.add_argument("--resume", action="store_true",
                    help="keep the questions already answered in OUT/probes.jsonl (and a sharded run's "
                         "OUT/probes.rank*.jsonl) and answer the rest")
    ap.add_argument("--report", action="store_true",
                    help="play nothing: write OUT/table.md and the figures from the questions OUT holds answers "
                         "to (a run still going, or one stopped mid-context, included) and exit")
    return ap


def check_args(ap, args) -> None:
    """Bad input is an error before anything loads."""
    why = lm_eval_missing(args.tasks)
    if why:
        ap.error(why)
    short = [f"{t} needs >= {TASKS[t]['min_length']}" for t in args.tasks for n in args.lengths[:1]
             if n < TASKS[t]["min_length"]]
    if short:
        ap.error(f"--lengths {args.lengths[0]} is under the task's minimum length: {'; '.join(short)}")
    if args.needles > MAX_NEEDLES:
        ap.error(f"--needles {args.needles}: a NIAH context carries at most {MAX_NEEDLES} needles (every other needle "
                 "is a distractor of the same form for each question)")
    check_budget(ap, [args.budget])
    check_limit(ap, [a for a in args.arms if a in BOUNDED], args.limit, args.budget, args.chunk)


def contexts(args, tokenizer) -> list[tuple[str, dict]]:
    """(setting, sample) per context this run plays: RULER's one-question samples for question-last, the
    ``--needles`` samples for the session setting (the same samples when a context carries one needle).
    A task that cannot fill a length is an error here, before the model loads."""
    made: dict[tuple, list[dict]] = {}
    out = []
    for setting in args.settings:
        for task in args.tasks:
            k = needles_of(task, args.needles) if setting == "session" else 1
            for length in args.lengths:
                if (task, length, k) not in made:
                    try:  # every needle's question is formed here too
                        made[task, length, k] = kept_or_generated(Path(args.out) / "contexts", task, length,
                                                                  args.samples, tokenizer, args.seed, k)
                    except (ValueError, AssertionError) as e:
                        raise SystemExit(f"pace-bench --suite ruler: {task} at {length} tokens: {e}") from None
                out += [(setting, x) for x in made[task, length, k]]
    return out


def kept_records(paths, plays) -> list[dict]:
    """The records of the logs ``paths`` (``--resume``). A record of a context this run plays that asks
    another question than this run's (another --seed, --needles or tokenizer) is an error: the table
    would mix two runs' questions."""
    from pace_bench.records import read_jsonl

    asked = {context_id(setting, x): [q["outputs"] for q in x["questions"]] for setting, x in plays}
    records = read_jsonl(paths)
    for r in records:
        want = asked.get(r["session_id"])
        if want is not None and (r["probes"] != len(want) or want[r["probe"]] != r["outputs"]):
            raise SystemExit(f"pace-bench --suite ruler: --resume: {Path(paths[0]).parent} holds answers to other "
                             f"questions of context {r['session_id']} than this run asks; resume with the same "
                             "--seed, --needles and --model, or use another --out")
    return records


def header(run: dict) -> str:
    """The table's first line, from a run's settings (``OUT/run.json``); the number of contexts per cell
    varies between a run's stages, so each cell's n says it."""
    return (f"model {run['model']} (torch.{run['dtype']}), B={run['budget']:,}, H={run['chunk']:,}, "
            f"L={run['limit']:,}; n counts questions: one context per question in question_last and for vt, fwe "
            f"and cwe, up to {run['needles']} needles per context in session, each asked from its saved state"
            + (f"; {run['num_processes']} processes" if run["num_processes"] > 1 else ""))


def write_table(out_dir: Path, run: dict, records: list[dict]) -> None:
    """``table.md`` (also printed) and the figures, at the run's end and for ``--report``: the settings, then
    the table of ``records``."""
    text = header(run) + "\n\n" + table(records)
    (out_dir / "table.md").write_text(text + "\n")
    paths = figures(records, out_dir)
    print(text)
    print("figures: " + ", ".join(str(p) for p in paths))


def main(argv=None) -> int:
    from pace_bench.suite import command_line, play_all

    args = command_line(argv, build_parser, check_args, write_table, suite="ruler", what="answered questions")
    if args is None:
        return 0
    from pace_bench.models import load_model, load_tokenizer, resolve_dtype
    from pace_bench.records import process_state, shard_paths
    from pace_hf.chat import DEFAULT_SYSTEM, ChatTemplate

    state = process_state()
    out_dir = Path(args.out)
    log_path = out_dir / "probes.jsonl"
    tokenizer = load_tokenizer(args.model)
    plays = contexts(args, tokenizer)  # before the model loads: a task that cannot fill a length fails fast
    # every process reads the kept records before the main one rewrites the log
    records = kept_records([log_path, *shard_paths(out_dir)], plays) if args.resume else []
    answered: dict[tuple, set] = {}
    for r in records:
        answered.setdefault((r["session_id"], r["arm"]), set()).add(r["probe"])
    dtype = resolve_dtype(args.dtype, state.device.type)
    model, tokenizer = load_model(args.model, dtype=dtype)
    model.to(state.device)
    template = ChatTemplate(tokenizer, DEFAULT_SYSTEM)
    stop_ids = template.stop_ids()
    s = RulerSettings(budget=args.budget, limit=args.limit, chunk=args.chunk, tool_tokens=args.tool_tokens,
                      max_new_tokens=args.max_new_tokens)
    run = {**{k: v for k, v in vars(args).items() if k not in ("resume", "report")},
           "dtype": str(dtype).removeprefix("torch."), "num_processes": state.num_processes}
    order = [(setting, x, arm) for setting, x in plays for arm in args.arms]
    work = [(setting, x, arm) for setting, x, arm in order
            if len(answered.get((context_id(setting, x), arm), ())) < len(x["questions"])]
    rank = {(context_id(setting, x), arm): k for k, (setting, x, arm) in enumerate(order)}

    def played(item, store):
        setting, x, arm = item
        return play(model, tokenizer, template, x, setting, arm, s, stop_ids, store, args.ranks,
                    skip=answered.get((context_id(setting, x), arm), ()), progress=args.progress and state.is_main_process)

    def describe(r):
        gap = r.get("rotary_gap")
        return (f"{r['setting']:>13} {r['task']} {r['length']:>6} #{r['index']}.{r['probe']} {r['arm']:>14} "
                f"score {r['score']:.2f} residency {r.get('residency', float('nan')):.3f} "
                f"gap {'n/a' if gap is None else gap} {r['seconds']:.0f}s  {r['answer'][:40]!r}")

    play_all(out_dir, run, records, work, played, rank=lambda r: (rank.get((r["session_id"], r["arm"]), len(rank)), r["probe"]),
             describe=describe, desc="ruler contexts x arms",
             finish=lambda records: write_table(out_dir, run, records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
