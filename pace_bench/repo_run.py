"""``pace-bench --suite repo``: the repo sessions (:mod:`pace_bench.repo`) played with each arm's cache.

    pace-bench --suite repo --arms h2o,pace_oracle,pace_prose --tokens 32768 --sessions 1 --out runs/repo32k

Arms (:data:`REPO_ARMS`): each is a cache of the registry :data:`pace_bench.arms.ARMS` and a plan.
``full`` (DynamicCache; played only when the session fits the model's trained context), ``h2o``,
``snapkv``, ``pace_oracle`` (PACE with the ``ast`` oracle plan: each probe's true definition),
``pace_literal`` / ``pace_prose`` / ``pace_probe`` (PACE with ``SymbolPlanner`` given the agent's plan
in that style, mapped to definition-level token spans through the chat template and capped at the
budget), ``pace_rehydrate`` (PACE with no plan; before each probe the evicted definitions its
prompt names are restored from a host tier) and ``pace_retrieval`` (PACE with no plan; before each
probe the evicted pages its prompt's words rank first are restored, within ``budget // 4``:
:mod:`pace_hf.memory.retrieval`, no identifier matching).

Per probe the record holds what the coding suite's does (answer, pass, recall, the needed tokens'
residency and rotary gap at the probe's first query, peak KV) and the plan's footprint: the tokens
planned for the probe's step and the share of its needed tokens among them. ``table.md`` is the coding
suite's table plus the plan footprint, and a pass rate per probe kind.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from pace_hf import Blueprint, EvictionCache

from .arms import ArmSettings, check_settings, make_cache
from .readings import ReadAtFirstQuery, full_cache_bytes, peak_cache_bytes, tier_reading
from .repo import LISTINGS, PACKAGES, session_messages
from .repo_probes import KINDS, score
from .suite import check_limit


@dataclass(frozen=True)
class RepoArm:
    """A repo-suite arm: the cache (a name in ``pace_bench.arms.ARMS``), its plan (``oracle``, a
    ``SymbolPlanner`` plan style, or None) and what brings evicted context back before each probe:
    ``"rehydrate"`` (the definitions the prompt names, ``SymbolPlanner.rehydrate``; the record's
    ``rehydrated_tokens``), ``"retrieve"`` (the pages its words rank first, ``cache.retrieve``;
    ``retrieved_tokens``) or None."""

    cache: str
    plan: str | None
    before_probe: str | None
    summary: str


_RESTORED_KEY = {"rehydrate": "rehydrated_tokens", "retrieve": "retrieved_tokens"}  # the record's count of each act

REPO_ARMS = {
    "full": RepoArm("full", None, None, "DynamicCache, where the session fits the model's context"),
    "h2o": RepoArm("h2o", None, None, "H2O"),
    "snapkv": RepoArm("snapkv", None, None, "SnapKV"),
    "pace_oracle": RepoArm("pace", "oracle", None, "PACE, the ast oracle plan"),
    "pace_literal": RepoArm("pace", "literal", None, "PACE, SymbolPlanner on literal plans"),
    "pace_prose": RepoArm("pace", "prose", None, "PACE, SymbolPlanner on prose plans"),
    "pace_probe": RepoArm("pace", "probe", None, "PACE, SymbolPlanner on the probes' own prompts"),
    "pace_rehydrate": RepoArm("pace", None, "rehydrate", "PACE, no plan, the definitions each probe names restored"),
    "pace_retrieval": RepoArm("pace", None, "retrieve", "PACE, no plan, the pages each probe's words rank first restored"),
}


def _positions(spans, step: int) -> set[int]:
    return {p for s in spans if step in s.readers for p in range(s.start, s.end)}


def arm_blueprint(row, arm: str, template, budget: int) -> Blueprint:
    """The blueprint an arm plays the session with (empty for arms without a plan)."""
    plan = REPO_ARMS[arm].plan
    if plan == "oracle":
        return Blueprint.from_dicts(row["blueprint"])
    if plan is None:
        return Blueprint()
    from pace_hf.planner import SymbolPlanner

    steps = {p["step"]: p["plans"][plan] for p in row["probes"]}
    return SymbolPlanner(steps).blueprint_for(session_messages(row), template=template, budget=budget)


def plan_reading(blueprint: Blueprint, row, probe) -> dict:
    """The plan's footprint at a probe: tokens planned for its step, and the share of its needed tokens
    (the oracle's) among them."""
    planned = _positions(blueprint, probe["step"])
    needed = _positions(Blueprint.from_dicts(row["blueprint"]), probe["step"])
    return {"plan_tokens": len(planned), "plan_recall": round(len(planned & needed) / max(1, len(needed)), 4)}


def _prefill(model, cache, ids: list[int], chunk: int) -> None:
    with torch.no_grad():
        for s in range(cache.get_seq_length(), len(ids), chunk):
            model(torch.tensor([ids[s:s + chunk]], device=model.device), cache=cache)


def fits(model, row, max_new_tokens: int | None = None) -> bool:
    """Whether the whole session (probes and answers included) fits the model's trained context."""
    total = row["context_len"] + sum(len(p["prompt_ids"]) + min(p["max_new_tokens"], max_new_tokens or 1 << 30)
                                     for p in row["probes"])
    return total <= getattr(model.config, "max_position_embeddings", 1 << 62)


def graded(text: str, probe: dict) -> dict:
    """The record fields of an answer's grade (no model: stored answers are graded again on --resume)."""
    got = score(text, probe["reference"], probe["answer_prefix"])
    return {"checks_passed": int(got["passed"]), "checks_total": 1, "recall_hits": got["recall_hits"],
            "recall_total": got["recall_total"], "failure": got["failure"],
            "checks": [{"name": probe["kind"], "passed": got["passed"], "fact": probe["target"]}],
            **({"similarity": got["similarity"]} if "similarity" in got else {})}


def play(model, tokenizer, row, arm: str, settings: ArmSettings, chunk: int, stop_ids, template,
         max_new_tokens: int | None = None, progress: bool = False, tiers: bool = False) -> list[dict]:
    """Prefill the session, then answer its probes in order, appending each answer (agent style).

    ``tiers``: every evicting arm spills to a host tier, so a PACE arm's planned spans that the budget
    pushed out (the plans of all steps together can exceed it) are fetched back before their step."""
    from pace_hf.session import Message, generate_reply

    spec = REPO_ARMS[arm]
    blueprint = arm_blueprint(row, arm, template, settings.budget)
    store = None
    if spec.before_probe or (tiers and spec.cache != "full"):
        from pace_hf.tiers import HostTier, TieredStore

        store = TieredStore([HostTier()])
    session_id = f"repo-{arm}-{row['session_id']}"
    cache = make_cache(spec.cache, model, blueprint, settings, store=store, session_id=session_id)
    evicting = isinstance(cache, EvictionCache)
    bar = None
    if progress:
        from .progress import SessionProgress

        bar = SessionProgress(f"{arm} {row['session_id']}", row["context_len"]
                              + sum(len(p["prompt_ids"]) for p in row["probes"]))
        if evicting:
            cache.progress = bar
    messages = session_messages(row) if spec.before_probe == "rehydrate" else None
    retriever = None
    if spec.before_probe == "retrieve":
        from pace_hf.memory.retrieval import PageRetriever

        retriever = PageRetriever(tokenizer)
    needed_of = Blueprint.from_dicts(row["blueprint"])
    ids = list(row["context_ids"])
    records = []
    with contextlib.ExitStack() as cleanup:
        peak = cleanup.enter_context(peak_cache_bytes(model, cache))
        cleanup.callback(lambda: bar.close() if bar is not None else None)
        if store is not None:
            cleanup.callback(store.close)
            cleanup.callback(store.delete_session, session_id)
        for k, probe in enumerate(row["probes"], 1):
            of = f"{k}/{len(row['probes'])}"
            start = time.perf_counter()
            if evicting:
                cache.step = probe["step"]
            restored = None
            if spec.before_probe:  # the history is in the cache (what it evicted, in the store) when the turn comes
                if bar is not None:
                    bar.phase(f"prefill history {of}", len(ids) - cache.get_seq_length())
                _prefill(model, cache, ids, chunk)
                before = cache.tier_stats["restored_tokens"]
                if retriever is not None:
                    cache.retrieve(probe["prompt"], ids, retriever=retriever)
                else:
                    from pace_hf.planner import SymbolPlanner

                    turn = Message(len(messages), "user", probe["prompt"], len(ids),
                                   len(ids) + len(probe["prompt_ids"]), probe["step"])
                    SymbolPlanner().rehydrate(SimpleNamespace(messages=messages, cache=cache, step=probe["step"],
                                                              template=template), turn)
                restored = cache.tier_stats["restored_tokens"] - before
            ids += probe["prompt_ids"]
            needed = torch.tensor(sorted(_positions(needed_of, probe["step"])), dtype=torch.long)
            reading = ReadAtFirstQuery(cache, needed)
            budget = min(probe["max_new_tokens"], max_new_tokens or probe["max_new_tokens"])
            criteria = [reading]
            if bar is not None:
                bar.phase(f"prefill probe {of}", len(ids) - cache.get_seq_length())
                criteria.append(bar.answering(f"answer {of}", budget, len(ids)))
            answer = generate_reply(model, ids, cache, max_new_tokens=budget, stop_ids=stop_ids, chunk=chunk,
                                    stopping_criteria=criteria)
            ids += answer + list(row["turn_end_ids"])
            text = tokenizer.decode(answer, skip_special_tokens=True)
            records.append({
                "arm": arm, "session_id": row["session_id"], "package": row["package"], "probe": probe["name"],
                "kind": probe["kind"], "step": probe["step"], "distance": row["distance"],
                "context_len": row["context_len"], "tokens": row["total_tokens"], "answer": text,
                **graded(text, probe),
                "seconds": round(time.perf_counter() - start, 1), **(reading.reading or {}),
                **plan_reading(blueprint, row, probe), **tier_reading(cache),
                **({_RESTORED_KEY[spec.before_probe]: restored} if restored is not None else {}),
                **({"peak_cache_bytes": peak["bytes"], "full_cache_bytes": full_cache_bytes(
                    model, cache.get_seq_length())} if peak["bytes"] is not None else {}),
            })
    return records


# -- reporting -------------------------------------------------------------------------------------------------


def table(records: list[dict], reference_arm: str) -> str:
    """The coding suite's table (:func:`pace_bench.figures.summarize`) with the plan footprint (median
    tokens planned per probe, and the share of the needed tokens planned), then passes per probe kind."""
    from .figures import summarize

    arms = list(dict.fromkeys(r["arm"] for r in records))
    lines = summarize(records, reference_arm).split("\n")
    lines[0] += " plan footprint (median tokens per probe, needed share) |"
    lines[1] += "---|"
    for k, arm in enumerate(arms):
        rs = [r for r in records if r["arm"] == arm]
        tokens = statistics.median(r.get("plan_tokens", 0) for r in rs)
        share = sum(r.get("plan_recall", 0.0) for r in rs) / len(rs)
        lines[2 + k] += f" {tokens:,.0f} ({100 * share:.0f}%) |"
    kinds = [k for k in KINDS if any(r["kind"] == k for r in records)]
    lines += ["", "| arm | " + " | ".join(kinds) + " | needle similarity (mean) |", "|---|" + "---|" * (len(kinds) + 1)]
    for arm in arms:
        cells = []
        for kind in kinds:
            rs = [r for r in records if r["arm"] == arm and r["kind"] == kind]
            cells.append(f"{sum(r['checks_passed'] for r in rs)}/{len(rs)}")
        sims = [r["similarity"] for r in records if r["arm"] == arm and "similarity" in r]
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {sum(sims) / len(sims):.2f} |" if sims else
                     f"| {arm} | " + " | ".join(cells) + " | - |")
    return "\n".join(lines)


# -- the command --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from .cli import choice_list, int_at_least, model_name, token_counts
    from .models import DEFAULT_MODEL

    ap = argparse.ArgumentParser(prog="pace-bench --suite repo", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 epilog="arms:\n" + "\n".join(f"  {k:<15} {a.summary}" for k, a in REPO_ARMS.items()))
    ap.formatter_class = type("F", (argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter), {})
    ap.add_argument("--model", type=model_name, default=DEFAULT_MODEL, help="a packaged model name or a local directory")
    ap.add_argument("--arms", type=choice_list(list(REPO_ARMS), "arm(s)"), default="h2o,pace_oracle,pace_prose",
                    metavar="ARM[,ARM...]", help=f"from {{{', '.join(REPO_ARMS)}}}")
    ap.add_argument("--tokens", type=token_counts, default="32768", metavar="N[,N...]",
                    help="session lengths: context tokens before the first probe")
    ap.add_argument("--sessions", type=int_at_least(1), default=1, help="sessions per length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--packages", type=lambda t: [p.strip() for p in t.split(",") if p.strip()],
                    default=",".join(PACKAGES), metavar="PKG[,PKG...]", help="installed packages the sessions read")
    ap.add_argument("--listing", choices=LISTINGS, default="mixed", help="how tool calls print files")
    ap.add_argument("--probes-per-kind", type=int_at_least(1), default=2, help="needle, signature, constant probes each")
    ap.add_argument("--budget", type=int_at_least(1), default=2048, help="B: resident tokens per layer and KV head")
    ap.add_argument("--limit", type=int_at_least(1), default=8192, help="L: PACE's rotary limit (L > B + H)")
    ap.add_argument("--chunk", type=int_at_least(1), default=4096, help="H: prefill chunk size")
    ap.add_argument("--reference-arm", choices=list(REPO_ARMS), default="h2o", help="the arm the table pairs against")
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=None, help="cap each probe's answer length")
    ap.add_argument("--tiers", action="store_true",
                    help="every evicting arm spills to a host tier: PACE fetches planned spans the budget pushed out "
                         "back before their step (pace_rehydrate and pace_retrieval always have one)")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default="runs/repo", help="folder for probes.jsonl, table.md and run.json")
    ap.add_argument("--resume", action="store_true", help="keep the (arm, session) pairs already in OUT/probes.jsonl")
    return ap


def check_args(ap, args) -> None:
    """Bad input is an error before anything loads."""
    from .repo import RepoSourceError, package_files

    settings = ArmSettings(budget=args.budget, limit=args.limit)
    for arm in args.arms:
        refusal = check_settings(REPO_ARMS[arm].cache, settings)
        if refusal:
            ap.error(f"--arms {arm} with --budget {args.budget} --limit {args.limit}: {refusal}")
    check_limit(ap, [a for a in args.arms if REPO_ARMS[a].cache == "pace"], args.limit, args.budget, args.chunk)
    for package in args.packages:
        try:
            package_files(package)
        except RepoSourceError as e:
            ap.error(str(e))


def main(argv=None) -> int:
    from .suite import command_line, play_all

    args = command_line(argv, build_parser, check_args)
    from pace_hf.chat import ChatTemplate

    from .models import load_model, load_tokenizer, resolve_dtype
    from .records import pair_key, read_jsonl
    from .repo import SYSTEM_PROMPT, load_repo_sessions

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.model)
    rows = []  # built before the model loads: a length the packages cannot fill fails fast
    for tokens in args.tokens:
        try:
            rows += list(load_repo_sessions(tokenizer, n_sessions=args.sessions, total_tokens=tokens, seed=args.seed,
                                            packages=args.packages, listing_style=args.listing,
                                            per_kind=args.probes_per_kind))
        except ValueError as e:
            raise SystemExit(f"pace-bench --suite repo: {tokens} tokens: {e}") from None
    log_path = out_dir / "probes.jsonl"
    sizes = {r["session_id"]: len(r["probes"]) for r in rows}
    records = read_jsonl(log_path) if args.resume else []
    probes = {(r["session_id"], r["distance"], r["context_len"], p["name"]): p for r in rows for p in r["probes"]}
    key = lambda r: (r["session_id"], r["distance"], r["context_len"], r["probe"])  # noqa: E731
    records = [r for r in records if key(r) in probes]  # records of other sessions, lengths or probe sets go
    count: dict[tuple, int] = {}
    for r in records:
        count[pair_key(r["arm"], r)] = count.get(pair_key(r["arm"], r), 0) + 1
    records = [{**r, **graded(r["answer"], probes[key(r)])} for r in records  # a scoring fix reaches old answers
               if count[pair_key(r["arm"], r)] == sizes.get(r["session_id"])]
    done = {pair_key(r["arm"], r) for r in records}
    dtype = resolve_dtype(args.dtype)
    model, tokenizer = load_model(args.model, dtype=dtype)
    template = ChatTemplate(tokenizer, SYSTEM_PROMPT)
    settings = ArmSettings(budget=args.budget, limit=args.limit)
    run = {**{k: v for k, v in vars(args).items() if k != "resume"}, "dtype": str(dtype).removeprefix("torch.")}
    order = [(row, arm) for row in rows for arm in args.arms]
    rank = {pair_key(arm, row): k for k, (row, arm) in enumerate(order)}
    skipped = []

    def played(item, store):  # the arms with tiers build their own store (``tiers=``)
        row, arm = item
        if REPO_ARMS[arm].cache == "full" and not fits(model, row, args.max_new_tokens):
            skipped.append(f"{arm} {row['session_id']}")
            return []
        return play(model, tokenizer, row, arm, settings, args.chunk, template.stop_ids(), template,
                    args.max_new_tokens, progress=args.progress, tiers=args.tiers)

    def describe(record):
        return (f"{record['arm']:>15} {record['session_id']} {record['probe']:<40} "
                f"{'pass' if record['checks_passed'] else 'fail'} recall {record['recall_hits']}/"
                f"{record['recall_total']} residency {record.get('residency', 1.0):.3f} "
                f"plan {record['plan_tokens']} {record['seconds']:.0f}s" + (f"  ({record['failure']})" if record["failure"] else ""))

    def finish(records):
        header = (f"model {args.model} ({dtype}), {len(rows)} sessions ({', '.join(sorted({r['package'] for r in rows}))}), "
                  f"{sum(len(r['probes']) for r in rows)} probes, lengths {', '.join(f'{t:,}' for t in args.tokens)}, "
                  f"B={args.budget:,}, H={args.chunk:,}, L={args.limit:,}, listing {args.listing}"
                  + (", evicting arms spill to a host tier" if args.tiers else "")
                  + (f"; not played (the session exceeds the model's context): {', '.join(skipped)}" if skipped else "")
                  + "\n\n")
        text = table(records, args.reference_arm) if records else "(no records)"
        (out_dir / "table.md").write_text(header + text + "\n")
        print(header + text)

    play_all(out_dir, run, records, [(row, arm) for row, arm in order if pair_key(arm, row) not in done], played,
             rank=lambda r: (rank.get(pair_key(r["arm"], r), len(rank)), r["probe"]), describe=describe,
             desc="sessions x arms", finish=finish)
    return 0


if __name__ == "__main__":
    sys.exit(main())
