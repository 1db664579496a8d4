"""Does page retrieval (``pace_hf.memory.retrieval.PageRetriever``) find an evicted definition on real code?

Why: the RULER recall table (README) is measured on RULER's own generators, whose needles are prose
sentences with rare numbers. An agent's evicted context is mostly code that nobody here wrote, and
its questions name a definition by its identifier, by its name written as words, or by what it does.
This measures, on the repo suite's sessions (the installed packages' source, every identifier
renamed; ``pace_bench.repo``), whether the pages a turn's text ranks first hold the definition the
turn needs, with no plan and no identifier matching.

Per probe, and per query wording (the probe's own prompt; the ``prose`` and ``literal`` plans of
``pace_bench.repo._plans``):
- ``rank``: the rank (0 = first) of the page holding most of the target's tokens, among all pages
  of the reading;
- ``covered``: the share of the target's tokens inside what a turn restores within the default share
  (``budget // 4`` = 512 tokens at B = 2,048), every position taken as evicted: the spans
  ``PageRetriever.choose`` yields (the top pages, and with ``--follow on`` the lines they link to).

Signals: ``lexical`` (the retriever's default) and ``digest`` (Quest-style layer-0 key bounds, which
needs the model). Split: ``dev`` packages (those the repo runs and RULER work looked at) and
``held-out`` packages (never looked at while building the retriever); both are reported. The split
``ruler`` is RULER's session prompts instead (``pace_bench.ruler``, lm-eval's generators, ``--seeds``
contexts per task and length): a question's target is its needle (for vt, every line of the chain), so
what a turn restores is measured without playing the model.

    python bench/retrieval_recall.py [--split dev,held-out,ruler] [--sessions 4] [--tokens 32768] [--follow off,on]
        [--ruler-tasks vt,niah_single_1,niah_multikey_2,fwe] [--lengths 8192,32768] [--seeds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pace_bench.models import load_tokenizer  # noqa: E402
from pace_bench.repo import build_repo_session  # noqa: E402
from pace_hf.memory.retrieval import PageRetriever  # noqa: E402

SPLITS = {"dev": ("requests", "tqdm", "typer", "rich", "markdown_it"),
          "held-out": ("click", "jinja2", "packaging", "starlette", "yaml", "urllib3", "attr")}
SHARE = 512


def target_tokens(row, step: int) -> set[int]:
    return {i for s in row["blueprint"] if step in s["readers"] for i in range(s["start"], s["end"])}


def measure(retriever: PageRetriever, row, model=None) -> list[dict]:
    ids = list(row["context_ids"][:row["context_len"]])
    spans = retriever.pages(len(ids))
    out = []
    for probe in row["probes"]:
        need = target_tokens(row, probe["step"])
        inside = [len(need & set(range(s, e))) for s, e in spans]
        main = max(range(len(spans)), key=inside.__getitem__)
        for wording in probe["plans"]:
            order, _ = retriever.rank(ids, probe["plans"][wording], model)
            taken = retriever.preview(ids, probe["plans"][wording], SHARE, model)
            out.append({"package": row["package"], "probe": probe["name"], "kind": probe["kind"], "wording": wording,
                        "rank": order.index(main) if main in order else None,
                        "covered": len(need & taken) / max(1, len(need)), "pages": len(spans)})
    return out


def repo_rows(tokenizer, split: str, sessions: int, tokens: int) -> list[dict]:
    """``sessions`` repo-suite sessions of ``split``'s packages; a drawn package too small for ``tokens``
    is skipped, and said."""
    rows, index = [], 0
    while len(rows) < sessions and index < 4 * sessions:
        try:
            rows.append(build_repo_session(tokenizer, seed=0, session_index=index, total_tokens=tokens,
                                           packages=SPLITS[split], per_kind=3))
        except ValueError as e:
            print(f"skipped session {index} of {split}: {e}", file=sys.stderr)
        index += 1
    return rows


def ruler_rows(tokenizer, tasks: list[str], lengths: list[int], seeds: int) -> list[dict]:
    """RULER's session prompts as rows of :func:`measure`: the context, and per question its needle's
    positions as the target and the question as every wording."""
    from pace_bench import ruler
    from pace_hf.chat import DEFAULT_SYSTEM, ChatTemplate

    template, rows = ChatTemplate(tokenizer, DEFAULT_SYSTEM), []
    for task in tasks:
        for length in lengths:
            for seed in range(seeds):
                sample = ruler.generate(task, length, 1, tokenizer, seed=seed, needles=ruler.needles_of(task, 4))[0]
                prompt = ruler.build_prompt(sample, "session", template, ruler.RulerSettings())
                probes = [{"name": f"seed{seed}:q{j}", "kind": task, "step": j + 1,
                           "plans": {"probe": doc["question"]}} for j, doc in enumerate(prompt["docs"])]
                blueprint = [{"start": p, "end": p + 1, "readers": [j + 1]}
                             for j, needle in enumerate(prompt["needles"]) for p in needle]
                rows.append({"package": f"{task}@{length}", "context_ids": prompt["context"],
                             "context_len": len(prompt["context"]), "probes": probes, "blueprint": blueprint})
    return rows


def summary(records: list[dict]) -> dict:
    n = len(records)
    ranks = [r["rank"] for r in records]
    return {"n": n, "top1": sum(r == 0 for r in ranks), "top3": sum(r is not None and r < 3 for r in ranks),
            "found": sum(r is not None for r in ranks),
            "median_rank": statistics.median(r if r is not None else records[0]["pages"] for r in ranks),
            "covered": round(sum(r["covered"] for r in records) / max(1, n), 3)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", default="dev,held-out")
    ap.add_argument("--sessions", type=int, default=4, help="sessions per split")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--signals", default="lexical", help="comma-separated: lexical, digest, both (the last two load the model)")
    ap.add_argument("--follow", default="off", help="comma-separated: off, on (PageRetriever(follow=...))")
    ap.add_argument("--ruler-tasks", default="vt,niah_single_1,niah_multikey_2,fwe", help="the ruler split's tasks")
    ap.add_argument("--lengths", default="8192,32768", help="the ruler split's lengths")
    ap.add_argument("--seeds", type=int, default=5, help="the ruler split's contexts per task and length")
    ap.add_argument("--json", help="write every record and the summary here")
    args = ap.parse_args(argv)
    signals = args.signals.split(",")
    model, tokenizer = None, load_tokenizer(args.model)
    if any(s != "lexical" for s in signals):  # layer 0's keys and queries
        import torch

        from pace_bench.models import load_model

        model, tokenizer = load_model(args.model, dtype=torch.float32)
    records = []
    for split in args.split.split(","):
        if split == "ruler":
            lengths = [int(n) for n in args.lengths.split(",")]
            rows = ruler_rows(tokenizer, args.ruler_tasks.split(","), lengths, args.seeds)
        else:
            rows = repo_rows(tokenizer, split, args.sessions, args.tokens)
        for row in rows:
            for signal in signals:
                for follow in args.follow.split(","):
                    retriever = PageRetriever(tokenizer, signal=signal, follow=follow == "on")
                    for r in measure(retriever, row, model):
                        records.append({"split": split, "signal": signal if follow == "off" else f"{signal}+follow", **r})
    table = {}
    for key in sorted({(r["split"], r["signal"], r["kind"], r["wording"]) for r in records}):
        table["/".join(key)] = summary([r for r in records if (r["split"], r["signal"], r["kind"], r["wording"]) == key])
    for key in sorted({(r["split"], r["signal"], r["wording"]) for r in records}):
        table["/".join((*key[:2], "all", key[2]))] = summary(
            [r for r in records if (r["split"], r["signal"], r["wording"]) == key])
    print(f"| split / signal / kind / wording | n | top-1 | top-3 | found | median rank | covered within {SHARE} |")
    print("|---|---|---|---|---|---|---|")
    for key, s in table.items():
        print(f"| {key} | {s['n']} | {s['top1']} | {s['top3']} | {s['found']} | {s['median_rank']} | {s['covered']:.2f} |")
    if args.json:
        run = {**vars(args), "json": Path(args.json).name}  # no path of this machine in a result
        Path(args.json).write_text(json.dumps({"args": run, "summary": table, "records": records}, indent=1))
    return table


if __name__ == "__main__":
    main()
