"""RULER through lm-eval: the field's long-context test, played with each arm's cache.

    pace-bench --suite ruler --tasks niah_single_1,niah_multikey_2,vt,fwe,cwe --lengths 8192,32768 \\
        --samples 10 --arms full,snapkv,snapkv_bounded,pace_retrieval --out runs/ruler

Samples come from lm-eval 0.4.13's own RULER generators (``lm_eval.tasks.ruler``), sized with this
model's tokenizer; answers are scored with lm-eval's own ``common_utils.process_results``. Nothing of
either is re-implemented here: a task is the generator call its lm-eval task makes, with fewer samples.

Two settings, reported apart:
- ``question_last``: RULER's layout, the context then the question in one user message.
- ``session``: the context arrives as tool outputs of about ``--tool-tokens`` tokens each (an agent
  reading documents), the question as a later user turn. The protocol: prefill the tool outputs once,
  save (``cache.save()``; a deep copy for DynamicCache), then resume the saved state, add the question
  and answer. One question per context here, as in RULER (``tests/test_ruler.py`` checks that the
  answer from the saved state is token for token the answer of a fresh prefill).

In both, each answer starts after lm-eval's ``gen_prefix`` in the assistant turn, as lm-eval does for
chat models. The context is prefilled in ``--chunk`` forwards, then the question (and for the PACE
arms the retrieval step comes between the two).

Arms: ``full`` (DynamicCache), ``h2o``, ``snapkv``, ``snapkv_bounded`` (SnapKV with bounded
positions), ``streaming`` (StreamingLLM), ``pace_retrieval`` (PACE with no plan; the question's turn
restores the evicted pages it matches, ``pace_hf.retrieval``) and ``pace_plan`` (PACE given the
question as its plan: the context pages it matches lexically are planned before the context arrives).

Each record holds the needle's residency (mean over layers and KV heads) and its rotary gap when the
answer's first query runs; for ``pace_retrieval``, the rank of the needle's page under each retrieval
signal (lexical, digest, both) over every page of the context. Output in ``--out``: ``records.jsonl``
(one line per sample, arm and setting; ``--resume`` keeps them), ``table.md`` (accuracy per task,
length and arm with 95% Wilson intervals, per setting), ``ruler_{setting}.png`` and ``run.json``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import copy
import importlib.util
import io
import json
import math
import os
import random
import re
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

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
ARMS = ("full", "h2o", "snapkv", "snapkv_bounded", "streaming", "pace_retrieval", "pace_plan")
BOUNDED = ("snapkv_bounded", "pace_retrieval", "pace_plan")
SIGNALS = ("lexical", "digest", "both")
LONG_LINE = 200  # a needle is its whole line when the line is at most this long (niah, vt), else its words


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


def generate(task: str, length: int, n: int, tokenizer, seed: int) -> list[dict]:
    """``n`` samples of ``task`` at ``length`` tokens from lm-eval's generator (seeded: the generators
    draw from the global ``random`` and ``numpy`` states)."""
    import numpy as np

    spec = TASKS[task]
    random.seed(f"{seed}:{task}:{length}")
    np.random.seed(zlib.crc32(f"{seed}:{task}:{length}".encode()))
    quiet = contextlib.redirect_stdout(io.StringIO())  # vt prints every size it tries
    with quiet:
        if spec["kind"] == "niah":
            niah, prepare = _ruler("niah_utils"), _ruler("prepare_niah")
            return prepare.generate_samples(
                prepare.get_haystack(type_haystack=spec["haystack"]), max_seq_length=length, template=niah.TEMPLATE,
                type_haystack=spec["haystack"], type_needle_k=spec["needle_k"], type_needle_v=spec["needle_v"],
                num_samples=n, TOKENIZER=tokenizer)
        if spec["kind"] == "vt":
            vt = _ruler("vt_utils")
            icl = vt.sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=1, max_seq_length=500, incremental=5)[0]
            return vt.sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=n, max_seq_length=length,
                                                  icl_example=icl)
        if spec["kind"] == "fwe":
            return _ruler("fwe_utils").sys_kwext(tokenizer=tokenizer, max_seq_length=length, num_samples=n)
        return _ruler("cwe_utils").sys_word_pair_random(num_samples=n, max_seq_length=length, tokenizer=tokenizer)


def score(sample: dict, prediction: str) -> float:
    """lm-eval's RULER score of one answer (the fraction of the expected outputs it contains)."""
    metrics = _ruler("common_utils").process_results(sample, [prediction])
    return float(metrics[str(sample["max_length"])])


# -- prompts, with the needle's token positions ------------------------------------------------------------


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


def encode_block(template, role: str, content: str, char_spans) -> tuple[list[int], list[int]]:
    """The message's ids and the (block-relative) token positions covering ``char_spans`` of ``content``."""
    block = template.block(role, content)
    at = block.index(content)
    enc = template.tok(block, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    ends = [e for _, e in offsets]
    starts = [s for s, _ in offsets]
    positions = []
    for cs, ce in char_spans:
        first = bisect.bisect_right(ends, cs + at)
        last = bisect.bisect_left(starts, ce + at)
        positions += range(first, max(first, last))
    return ids, positions


def tool_pieces(context: str, spans, tokenizer, tool_tokens: int) -> list[tuple[str, list]]:
    """The context cut into tool outputs of about ``tool_tokens`` tokens, at a line or word end and never
    inside a needle; each with its needle spans (relative to the piece)."""
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
    cuts.append(len(context))
    pieces = []
    for lo, hi in zip(cuts, cuts[1:]):
        if hi > lo:
            pieces.append((context[lo:hi], [(max(s, lo) - lo, min(e, hi) - lo) for s, e in spans if s < hi and e > lo]))
    return pieces


def build_prompt(sample: dict, setting: str, template, settings: RulerSettings) -> dict:
    """The conversation's ids: ``context`` (everything before the question's turn, or before the
    question in question-last), ``question`` (the rest, up to and with the answer prefix), the question
    text, and the needle's logical positions."""
    context, question = split_question(sample)
    spans = needle_spans(context, sample["outputs"])
    ids, needle = list(template.system_ids), []
    answer_prefix = template.encode(template.gen_header + sample["gen_prefix"])
    if setting == "question_last":
        content = context + question
        block, positions = encode_block(template, "user", content, spans)
        _, asked = encode_block(template, "user", content, [(len(context), len(content))])
        split = asked[0] if asked else len(block)
        return {"context": ids + block[:split], "question": block[split:] + answer_prefix, "question_text": question,
                "needle": [len(ids) + p for p in positions]}
    for text, piece_spans in tool_pieces(context, spans, template.tok, settings.tool_tokens):
        block, positions = encode_block(template, "tool", text, piece_spans)
        needle += [len(ids) + p for p in positions]
        ids += block
    turn = template.encode(template.block("user", question))
    return {"context": ids, "question": turn + answer_prefix, "question_text": question, "needle": needle}


# -- arms ----------------------------------------------------------------------------------------------------


def make_cache(arm: str, model, s: RulerSettings, store=None, session_id: str | None = None):
    """The cache of one arm. Every evicting arm shares budget, sinks, recent and schedule."""
    from transformers import DynamicCache

    from pace_hf import EvictionCache, PACECache
    from pace_hf.scoring import CumulativeAttention, ObservationWindow, Recency

    if arm == "full":
        return DynamicCache(config=model.config)
    kw = {"budget": s.budget, "store": store, "session_id": session_id if store is not None else None}
    if arm in ("pace_retrieval", "pace_plan"):
        return PACECache(None, model, limit=s.limit, **kw)
    scoring = {"h2o": CumulativeAttention, "snapkv": ObservationWindow, "snapkv_bounded": ObservationWindow,
               "streaming": Recency}[arm]()
    return EvictionCache(model, scoring=scoring, limit=s.limit if arm in BOUNDED else None,
                         recent=0 if arm == "streaming" else 128, **kw)


def plan_question(cache, retriever, context_ids: list[int], question: str, step: int) -> list:
    """PACE given the question as its plan: the context pages the question matches lexically, best
    first, planned for ``step`` until they fill the retrieval share of the budget."""
    from pace_hf import Span

    order, _ = retriever.rank(context_ids, question)
    share = retriever.share or max(1, cache.budget // 4)
    planned, used = [], 0
    for page in order:
        start, end = retriever.pages(len(context_ids))[page]
        if used + (end - start) <= share:
            planned.append(cache.blueprint.add(Span(start, end, [step])))
            used += end - start
    return planned


def prefill(model, cache, ids: list[int], chunk: int) -> None:
    with torch.no_grad():
        for s in range(cache.get_seq_length(), len(ids), chunk):
            model(torch.tensor([ids[s:s + chunk]], device=model.device), cache=cache)


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


def answer(model, cache, ids: list[int], max_new_tokens: int, stop_ids, chunk: int, needle) -> tuple[list[int], dict]:
    """Greedy answer to ``ids`` (the cache holds a prefix), and the ledger at the answer's first query."""
    from pace_bench.readings import ReadAtFirstQuery
    from pace_hf.session import generate_reply

    reading = ReadAtFirstQuery(cache, torch.tensor(needle, dtype=torch.long))
    tokens = generate_reply(model, ids, cache, max_new_tokens=max_new_tokens, stop_ids=stop_ids, chunk=chunk,
                            stopping_criteria=[reading])
    return tokens, reading.reading or {}


def needle_page_ranks(retriever_for, model, context_ids: list[int], question: str, needle) -> dict:
    """The rank (0 = first) of the page holding most of the needle, per retrieval signal, over every
    page of the context: how well each signal would find it."""
    out = {}
    for signal in SIGNALS:
        r = retriever_for(signal)
        pages = r.pages(len(context_ids))
        hits = [sum(s <= p < e for p in needle) for s, e in pages]
        target = max(range(len(pages)), key=hits.__getitem__) if needle else None
        order, _ = r.rank(context_ids, question, model)
        out[signal] = order.index(target) if target in order else None
    return out


def play(model, tokenizer, template, sample: dict, setting: str, arm: str, s: RulerSettings, stop_ids,
         session_id: str, store=None, ranks: bool = False) -> dict:
    """One sample, one arm, one setting: the record (answer, lm-eval score, the needle's ledger)."""
    from pace_hf import EvictionCache
    from pace_hf.retrieval import PageRetriever

    started = time.perf_counter()
    prompt = build_prompt(sample, setting, template, s)
    context, full = prompt["context"], prompt["context"] + prompt["question"]
    pace = arm in ("pace_retrieval", "pace_plan")
    use_store = store if (pace or setting == "session") and arm != "full" else None
    cache = make_cache(arm, model, s, use_store, session_id)
    retriever = PageRetriever(tokenizer)
    if arm == "pace_plan":
        plan_question(cache, retriever, context, prompt["question_text"], step=1)
    if isinstance(cache, EvictionCache):
        cache.step = 1
    try:
        prefill(model, cache, context, s.chunk)
        if setting == "session":  # prefill once, save; each question resumes the saved state
            cache = resume_state(save_state(cache), model, use_store)
            if isinstance(cache, EvictionCache):
                cache.step = 1
        restored = None
        if arm == "pace_retrieval":
            cache.rehydrate(prompt["question_text"], context, retriever=retriever)
            restored = cache.tier_stats.get("retrieval_tokens_restored", 0)
        budget = min(TASKS[sample["task"]]["max_gen_toks"], s.max_new_tokens or 1 << 30)
        tokens, reading = answer(model, cache, full, budget, stop_ids, s.chunk, prompt["needle"])
    finally:
        if use_store is not None:
            use_store.delete_session(session_id)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    record = {"setting": setting, "task": sample["task"], "length": sample["max_length"], "index": sample["index"],
              "arm": arm, "score": score(sample, text), "answer": text, "outputs": list(sample["outputs"]),
              "context_tokens": len(context), "needle_tokens": len(prompt["needle"]), **reading,
              "seconds": round(time.perf_counter() - started, 2)}
    if restored is not None:
        record["retrieval_tokens_restored"] = restored
    if ranks and arm == "pace_retrieval":
        record["needle_page_rank"] = needle_page_ranks(lambda sig: PageRetriever(tokenizer, signal=sig), model,
                                                       context, prompt["question_text"], prompt["needle"])
    return record


# -- reporting ---------------------------------------------------------------------------------------------


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson interval of a proportion ``p`` over ``n`` samples (RULER's partial scores count as
    that fraction of a success)."""
    if n == 0:
        return 0.0, 1.0
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def accuracy(records: list[dict]) -> dict[tuple, tuple[float, int, float, float]]:
    """(setting, task, length, arm) -> (mean score, n, Wilson low, Wilson high)."""
    groups: dict[tuple, list[float]] = {}
    for r in records:
        groups.setdefault((r["setting"], r["task"], r["length"], r["arm"]), []).append(r["score"])
    out = {}
    for key, scores in groups.items():
        p = sum(scores) / len(scores)
        out[key] = (p, len(scores), *wilson(p, len(scores)))
    return out


def table(records: list[dict]) -> str:
    """Markdown, kvpress's leaderboard shape: one table per setting, a row per (task, length), a column
    per arm, each cell the accuracy in % with its 95% Wilson interval and sample count."""
    acc = accuracy(records)
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
        out.append("")
    return "\n".join(out)


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


def _list(choices, what):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or '(none given)'}: choose from "
                                             f"{', '.join(choices)}")
        return list(dict.fromkeys(items))

    return parse


def _lengths(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one length")
    return sorted(set(values))


def build_parser() -> argparse.ArgumentParser:
    from pace_bench.models import DEFAULT_MODEL
    from pace_bench.cli import int_at_least, model_name

    ap = argparse.ArgumentParser(prog="pace-bench --suite ruler", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", type=model_name, default=DEFAULT_MODEL, help="a packaged model name or a local directory")
    ap.add_argument("--tasks", type=_list(list(TASKS), "task(s)"), default="niah_single_1", metavar="TASK[,TASK...]",
                    help=f"from {{{', '.join(TASKS)}}}")
    ap.add_argument("--lengths", type=_lengths, default="8192", metavar="N[,N...]", help="RULER's max_seq_length(s)")
    ap.add_argument("--samples", type=int_at_least(1), default=5, help="samples per task and length")
    ap.add_argument("--arms", type=_list(ARMS, "arm(s)"), default="full,snapkv,pace_retrieval", metavar="ARM[,ARM...]",
                    help=f"from {{{', '.join(ARMS)}}}")
    ap.add_argument("--settings", type=_list(SETTINGS, "setting(s)"), default="session", metavar="S[,S...]",
                    help=f"from {{{', '.join(SETTINGS)}}}")
    ap.add_argument("--budget", type=int_at_least(1), default=2048, help="B: resident tokens per layer and KV head")
    ap.add_argument("--limit", type=int_at_least(1), default=8192, help="L: the bounded arms' rotary limit (L > B + H)")
    ap.add_argument("--chunk", type=int_at_least(1), default=4096, help="H: prefill chunk size")
    ap.add_argument("--tool-tokens", type=int_at_least(16), default=2048, help="tokens per tool output (session setting)")
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=None, help="cap the tasks' max_gen_toks")
    ap.add_argument("--ranks", action=argparse.BooleanOptionalAction, default=True,
                    help="record the needle page's rank under each retrieval signal (pace_retrieval)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument("--out", default="runs/ruler", help="folder for records.jsonl, table.md, run.json and figures")
    ap.add_argument("--resume", action="store_true", help="keep the records already in OUT/records.jsonl")
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
    if args.budget < 4 + 128:
        ap.error(f"--budget {args.budget} cannot hold the 4 sink and 128 recent tokens the arms protect")
    bounded = [a for a in args.arms if a in BOUNDED]
    if bounded and args.limit <= args.budget + args.chunk:
        ap.error(f"bounded arms ({', '.join(bounded)}) need --limit > --budget + --chunk: "
                 f"{args.limit} <= {args.budget} + {args.chunk}")


def record_key(r: dict) -> tuple:
    return r["setting"], r["task"], r["length"], r["index"], r["arm"]


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tqdm.auto import tqdm

    from pace_bench.models import load_model, load_tokenizer, preferred_dtype
    from pace_hf.chat import DEFAULT_SYSTEM, ChatTemplate
    from pace_hf.tiers import HostTier, TieredStore

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "records.jsonl"
    records = [json.loads(x) for x in log_path.read_text().splitlines() if x.strip()] if args.resume and log_path.exists() else []
    done = {record_key(r) for r in records}
    tokenizer = load_tokenizer(args.model)
    samples = []  # generated before the model loads: a task that cannot fill a length fails fast
    for task in args.tasks:
        for length in args.lengths:
            try:
                samples += [dict(x, task=task) for x in generate(task, length, args.samples, tokenizer, args.seed)]
            except (ValueError, AssertionError) as e:
                raise SystemExit(f"pace-bench --suite ruler: {task} at {length} tokens: {e}") from None
    dtype = preferred_dtype() if args.dtype == "auto" else getattr(torch, args.dtype)
    model, tokenizer = load_model(args.model, dtype=dtype)
    template = ChatTemplate(tokenizer, DEFAULT_SYSTEM)
    stop_ids = template.stop_ids()
    s = RulerSettings(budget=args.budget, limit=args.limit, chunk=args.chunk, tool_tokens=args.tool_tokens,
                      max_new_tokens=args.max_new_tokens)
    (out_dir / "run.json").write_text(json.dumps({**{k: v for k, v in vars(args).items() if k != "resume"},
                                                  "dtype": str(dtype).removeprefix("torch.")}, indent=1) + "\n")
    store = TieredStore([HostTier()])
    work = [(setting, x, arm) for setting in args.settings for x in samples for arm in args.arms
            if (setting, x["task"], x["max_length"], x["index"], arm) not in done]
    try:
        with open(log_path, "a") as log:
            for setting, x, arm in tqdm(work, desc="ruler samples x arms", unit="answer"):
                r = play(model, tokenizer, template, x, setting, arm, s, stop_ids,
                         f"ruler-{setting}-{x['task']}-{x['max_length']}-{x['index']}-{arm}", store, args.ranks)
                log.write(json.dumps(r) + "\n")
                log.flush()
                records.append(r)
                gap = r.get("rotary_gap")
                tqdm.write(f"{setting:>13} {r['task']} {r['length']:>6} #{r['index']} {arm:>14} score {r['score']:.2f} "
                           f"residency {r.get('residency', float('nan')):.3f} gap {'n/a' if gap is None else gap} "
                           f"{r['seconds']:.0f}s  {r['answer'][:40]!r}")
    finally:
        store.close()
    text = table(records)
    (out_dir / "table.md").write_text(f"model {args.model} ({dtype}), B={args.budget:,}, H={args.chunk:,}, "
                                      f"L={args.limit:,}, {args.samples} samples per cell\n\n" + text + "\n")
    paths = figures(records, out_dir)
    print(text)
    print("figures: " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
