"""The benchmark runner: play sessions through ``model.generate`` with each arm's cache.

Per probe it records the answer, the hidden-check results and why they failed, recall, the residency
of the tokens the probe needs and the rotary gap, read from the cache's ledger when the probe starts,
and, with a store, the cache's tier counters. It writes JSONL, the run's settings (``run.json``), a
Markdown table shaped like the paper's Table 2 and the paper's Figures 1 and 3
(:mod:`pace_bench.figures`).

    PACE_ALLOW_CODE_EVAL=1 pace-bench --arms h2o,pace --sessions 3 --tokens 49152 --out runs/48k

Sessions are independent, so several processes can share the (arm, session) pairs; launched with
accelerate, each process takes the next pair nobody has taken (``pace_bench.suite.claim_in_order``),
writes ``probes.rank{N}.jsonl``, and the main process merges them into ``probes.jsonl``, the table and
the figures:

    PACE_ALLOW_CODE_EVAL=1 accelerate launch --multi_gpu --num_processes 2 -m pace_bench --sessions 3 ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from pace_hf import Blueprint, EvictionCache, Span
from pace_hf.session import generate_reply

from .arms import ARMS, BOUNDED_ARMS, ArmSettings, check_settings, make_cache
from .checkpoint import ChunkLog, PairCheckpoint, pair_settings, store_session_id
from .cli import choice_list, fraction, int_at_least, model_name
from .figures import gap_text, make_figures, settings_for, summarize, with_distance_table
from .progress import SessionProgress, quiet_library_bars
from .readings import ReadAtFirstQuery, full_cache_bytes, peak_cache_bytes, tier_reading
from .records import pair_key, process_state, read_jsonl, session_key, shard_paths
from .suite import check_limit, command_line, play_all
from .sessions import session_messages

PLANNERS = ("oracle", "symbols", "none")
STORES = ("none", "host", "disk", "valkey")



# -- blueprints: the oracle's (whole or with edges dropped), or a planner's ---------------------------


def oracle_blueprint(row, drop_edges: float = 0.0, seed: int = 0) -> Blueprint:
    """The session's oracle blueprint; with ``drop_edges`` = P, a seeded fraction P of its (span, reader)
    edges is dropped (a span left with no reader goes), for the planner-robustness curve."""
    spans = row["blueprint"]
    if not drop_edges:
        return Blueprint.from_dicts(spans)
    edges = [(k, r) for k, b in enumerate(spans) for r in b["readers"]]
    rng = random.Random(f"drop-edges:{seed}:{row['session_id']}:{drop_edges}")
    dropped = set(rng.sample(edges, round(drop_edges * len(edges))))
    kept = [(b, [r for r in b["readers"] if (k, r) not in dropped]) for k, b in enumerate(spans)]
    return Blueprint(Span(b["start"], b["end"], readers) for b, readers in kept if readers)


def probe_plan(row) -> dict[int, str]:
    """The agent's plan: ``{probe step: probe prompt}`` (an agent knows its next tasks)."""
    return {p["step"]: p["prompt"] for p in row["probes"]}


def session_blueprint(row, tokenizer, planner: str = "oracle", drop_edges: float = 0.0, seed: int = 0,
                      budget: int | None = None) -> Blueprint:
    """The blueprint a foresight arm gets: the oracle's, ``SymbolPlanner``'s from the session's text (the
    definitions each probe names, as tokens of the session's chat template, within ``budget``), or none
    (an empty plan)."""
    if planner == "oracle":
        return oracle_blueprint(row, drop_edges, seed)
    if planner == "symbols":
        from pace_hf.chat import ChatTemplate
        from pace_hf.planner import SymbolPlanner

        from .build import SYSTEM_PROMPT

        return SymbolPlanner().blueprint_for(session_messages(row, tokenizer), probe_plan(row),
                                             template=ChatTemplate(tokenizer, SYSTEM_PROMPT), budget=budget)
    if planner == "none":
        return Blueprint()
    raise ValueError(f"unknown planner {planner!r}; choose from {', '.join(PLANNERS)}")


def rehydrate_for_probe(cache, row, tokenizer, probe, messages) -> int:
    """Restore, from the cache's store, the evicted definitions that the probe's prompt names
    (``SymbolPlanner.rehydrate``, mapped to tokens through the session's chat template, so a
    definition comes back without the rest of its turn); returns the tokens restored (layer 0)."""
    from pace_hf.chat import ChatTemplate
    from pace_hf.planner import SymbolPlanner
    from pace_hf.session import Message

    from .build import SYSTEM_PROMPT

    turn = Message(len(messages), "user", probe["prompt"], cache.get_seq_length(),
                   cache.get_seq_length() + len(probe["prompt_ids"]), probe["step"])
    session = SimpleNamespace(messages=messages, cache=cache, step=probe["step"],
                              template=ChatTemplate(tokenizer, SYSTEM_PROMPT))
    before = cache.tier_stats["restored_tokens"]
    SymbolPlanner().rehydrate(session, turn)
    return cache.tier_stats["restored_tokens"] - before


# -- the ledger at each probe ----------------------------------------------------------------------------


def needed_positions(row, probe) -> torch.Tensor:
    """Logical positions of the spans this probe reads (from the session's oracle blueprint)."""
    spans = [torch.arange(b["start"], b["end"]) for b in row["blueprint"] if probe["step"] in b["readers"]]
    return torch.cat(spans) if spans else torch.empty(0, dtype=torch.long)


def _score(metric, text: str, probe) -> dict:
    """The metric's details for one answer; a scoring failure (anything but a refusal to run code at
    all) is recorded with every check failed, so that one probe cannot end a long run."""
    try:
        return metric.compute(predictions=[text], references=[probe["reference"]])["details"][0]
    except Exception as e:  # noqa: BLE001 - one probe's scoring failure must not end a long run
        from pace_bench.metrics.pace_coding.sandbox import CodeExecutionNotAllowed, SandboxUnavailable

        if isinstance(e, (CodeExecutionNotAllowed, SandboxUnavailable)):
            raise  # no probe can be scored on this machine: stop now, not hours later
        try:  # the probe still counts, with every check failed
            ref = json.loads(probe["reference"])
            totals = (len(ref["checks"]), len(ref.get("recall", [])))
        except Exception:  # noqa: BLE001
            totals = (0, 0)
        return {"checks_passed": 0, "checks_total": totals[0], "recall_hits": 0, "recall_total": totals[1],
                "checks": [], "failure": "scoring error", "scoring_error": f"{type(e).__name__}: {e}"[:500]}


def play_session(model, tokenizer, row, arm: str, settings: ArmSettings, metric, chunk: int, stop_ids,
                 max_new_tokens: int | None = None, *, blueprint: Blueprint | None = None, store=None,
                 rehydrate: bool = False, progress: bool = False, checkpoint_every: int | None = None,
                 resume: bool = False, chunk_log: Path | None = None) -> list[dict]:
    """Prefill the session, then answer its probes in order, appending each answer (agent style).

    ``blueprint``: what foresight arms plan with (default: the session's oracle blueprint). ``store``:
    spill evicted tokens there (and restore planned spans from it). ``rehydrate``: before each probe,
    restore the evicted turns that its prompt names (needs a store and a foresight arm).
    ``progress``: a bar of the session's prefilled tokens that names the phase (:mod:`pace_bench.progress`).
    ``checkpoint_every``: save the pair to the (durable) ``store`` every N prefill chunks; ``resume``:
    continue from its last save, if it has one (:mod:`pace_bench.checkpoint`). ``chunk_log``: append each
    prefill chunk's tokens/s and cache bytes to this JSONL file."""
    blueprint = Blueprint.from_dicts(row["blueprint"]) if blueprint is None else blueprint
    session_id = store_session_id(arm, row)
    saving = resumed = None
    if checkpoint_every:
        cls = type(make_cache(arm, None, blueprint, settings))
        if store is None or not issubclass(cls, EvictionCache):
            raise ValueError(f"checkpoints save an eviction cache to a store: arm {arm!r} with store {store!r} cannot")
        saving = PairCheckpoint(store, session_id, checkpoint_every,
                                pair_settings(row, settings, chunk, max_new_tokens, rehydrate, blueprint))
        got = saving.resume(cls, model) if resume else None
        if got is None:
            saving.start_over()
        else:
            cache, resumed = got
    if resumed is None:
        cache = make_cache(arm, model, blueprint, settings, store=store, session_id=session_id)
    evicting = isinstance(cache, EvictionCache)
    probes = row["probes"]
    bar = None
    if progress:
        prompts = sum(len(p["prompt_ids"]) for p in probes) + (len(probes) - 1) * len(row["turn_end_ids"])
        bar = SessionProgress(f"{arm} {row['session_id']}", len(row["context_ids"]) + prompts)
        if evicting:
            cache.progress = bar  # told of every prefilled chunk
    clock = None
    if chunk_log is not None and evicting:
        clock = cache.progress = ChunkLog(chunk_log, cache, {"arm": arm, "session_id": row["session_id"],
                                                             "distance": row["distance"]},
                                         full_cache_bytes(model, 1), inner=bar)
    can_rehydrate = rehydrate and evicting and cache.store is not None and cache.blueprint is not None
    messages = session_messages(row, tokenizer) if can_rehydrate else None
    ids = list(row["context_ids"]) if resumed is None else resumed["ids"]
    records = [] if resumed is None else resumed["records"]
    with contextlib.ExitStack() as cleanup:
        peak = cleanup.enter_context(peak_cache_bytes(model, cache))
        if resumed is not None and peak["bytes"] is not None:
            peak["bytes"] = resumed["peak_bytes"] or 0  # the peak before the save
        cleanup.callback(lambda: bar.close() if bar is not None else None)
        if store is not None and saving is None:  # the spilled KV served this run only
            cleanup.callback(store.delete_session, session_id)
        if resumed is not None:
            from tqdm.auto import tqdm

            tqdm.write(f"resumed {arm} {row['session_id']} from its checkpoint at token {cache.get_seq_length():,} "
                       f"(probe {resumed['probe'] + 1}/{len(probes)}, {resumed['phase']})")
            if bar is not None:
                bar.phase("resumed", cache.get_seq_length())
        for k, probe in enumerate(probes, 1):
            if resumed is not None and k - 1 < resumed["probe"]:
                continue  # answered before the save: its record came with it
            of = f"{k}/{len(probes)}"
            start = time.perf_counter()
            # where the save was made in this probe (its step was set, its history prefilled or rehydrated)
            phase = resumed["phase"] if resumed is not None and k - 1 == resumed["probe"] else None
            if phase is not None:
                start -= resumed["seconds"]

            def checkpointing(at: str) -> dict:
                """generate_reply's checkpoint arguments in phase ``at`` of probe ``k``."""
                if saving is None:
                    return {}
                state = lambda: {"probe": k - 1, "phase": at, "ids": ids, "records": records,  # noqa: E731
                                 "restored": restored if at == "probe" else None, "peak_bytes": peak["bytes"],
                                 "seconds": time.perf_counter() - start}
                return {"checkpoint_every": saving.every, "checkpoint": saving.saver(cache, state, after=(
                    clock.mark if clock is not None else None))}

            if evicting and phase is None:
                cache.step = probe["step"]
            restored = resumed["restored"] if phase == "probe" else None
            if can_rehydrate and phase != "probe" and cache.get_seq_length() < len(ids):
                # Rehydration answers a turn's arrival: as in a live session, the history is in the cache
                # (and what it evicted is in the store) before the probe's turn comes.
                if bar is not None:
                    bar.phase(f"prefill history {of}", len(ids) - cache.get_seq_length())
                if clock is not None:
                    clock.mark()
                generate_reply(model, ids, cache, max_new_tokens=1, stop_ids=stop_ids, chunk=chunk,
                               **checkpointing("history"))
            if phase != "probe":
                if bar is not None and can_rehydrate:
                    bar.phase(f"rehydrate {of}")
                restored = rehydrate_for_probe(cache, row, tokenizer, probe, messages) if can_rehydrate else None
                ids += probe["prompt_ids"]
            reading = ReadAtFirstQuery(cache, needed_positions(row, probe))
            budget = min(probe["max_new_tokens"], max_new_tokens or probe["max_new_tokens"])
            criteria = [reading]
            if bar is not None:
                bar.phase(f"prefill probe {of}", len(ids) - cache.get_seq_length())
                criteria.append(bar.answering(f"answer {of}", budget, len(ids)))
            if clock is not None:
                clock.mark()
            answer = generate_reply(model, ids, cache, max_new_tokens=budget, stop_ids=stop_ids, chunk=chunk,
                                    stopping_criteria=criteria, **checkpointing("probe"))
            if bar is not None:
                bar.phase(f"scoring {of}")
            seconds = time.perf_counter() - start
            ids += answer + list(row["turn_end_ids"])
            text = tokenizer.decode(answer, skip_special_tokens=True)
            score = _score(metric, text, probe)
            records.append({
                "arm": arm, "session_id": row["session_id"], "probe": probe["name"], "step": probe["step"],
                "distance": row["distance"], "context_len": row["context_len"], "answer": text,
                "checks_passed": score["checks_passed"], "checks_total": score["checks_total"],
                "recall_hits": score["recall_hits"], "recall_total": score["recall_total"],
                "failure": score.get("failure"), "answer_form": score.get("answer_form"),
                "checks": score["checks"], "seconds": round(seconds, 1), **(reading.reading or {}),
                **tier_reading(cache), **({"rehydrated_tokens": restored} if restored is not None else {}),
                **({"scoring_error": score["scoring_error"]} if "scoring_error" in score else {}),
                # the session's peak so far, and what the full cache would hold at the same length
                **({"peak_cache_bytes": peak["bytes"], "full_cache_bytes": full_cache_bytes(
                    model, cache.get_seq_length())} if peak["bytes"] is not None else {}),
            })
    if saving is not None:  # complete: its checkpoint goes (kept, for --resume, when the pair failed)
        saving.done()
    return records


# -- reporting ---------------------------------------------------------------------------------------------


def progress_line(r: dict) -> str:
    """One line per scored probe, naming the facts of the checks that failed and why the probe did."""
    failed = sorted({c.get("fact") or c["name"] for c in r["checks"] if not c["passed"]})
    why = f" ({r['failure']})" if r.get("failure") else ""
    return (f"{r['arm']:>14} {r['session_id']} {r['probe']:<8} checks {r['checks_passed']}/{r['checks_total']} "
            f"recall {r['recall_hits']}/{r['recall_total']} residency {r.get('residency', 1.0):.3f} "
            f"gap {gap_text(r.get('rotary_gap'))} {r['seconds']:.0f}s"
            + (f"  failed{why}: {', '.join(failed)}" if failed else ""))


def completed_records(paths, probes_per_session: int) -> list[dict]:
    """Records of the (arm, session) pairs that the JSONL file(s) ``paths`` hold in full (a run cut
    short loses only the pairs it was playing; a sharded run's files are read together)."""
    records = read_jsonl(paths)
    count: dict[tuple, int] = {}
    for r in records:
        count[pair_key(r["arm"], r)] = count.get(pair_key(r["arm"], r), 0) + 1
    return [r for r in records if count[pair_key(r["arm"], r)] == probes_per_session]


def resumable_records(paths, rows) -> list[dict]:
    """The complete (arm, session) pairs of the logs ``paths`` that this run's sessions ``rows`` can
    continue. A log that also holds results of sessions this run does not build (another --tokens,
    --distance, --seed or session generator) is an error: rewriting the log would lose them."""
    same_sessions = {(*session_key(r), r["context_len"]) for r in rows}
    foreign = {session_key(r) for r in read_jsonl(paths)
               if (*session_key(r), r.get("context_len")) not in same_sessions}
    if foreign:
        listed = ", ".join(f"{sid} (D={d})" if d is not None else sid for sid, d in sorted(foreign, key=str)[:4])
        raise SystemExit(
            f"pace-bench: --resume: {Path(paths[0]).parent} holds results of {len(foreign)} session(s) this run "
            f"does not build ({listed}{', ...' if len(foreign) > 4 else ''}); resume with the same --tokens, "
            "--distance, --seed and --filler-mode (more --sessions is fine), or use another --out")
    return completed_records(paths, {len(r["probes"]) for r in rows}.pop())


def plot(records: list[dict], out_dir: Path, settings: dict | None = None) -> list[Path]:
    """The paper's Figures 1 and 3 (:func:`pace_bench.figures.make_figures`) into ``out_dir``."""
    return make_figures(records, out_dir, settings_for(out_dir, records, settings))


# -- the command line -----------------------------------------------------------------------------------

_EPILOG = """\
terms:
  B (--budget)  resident tokens per layer and KV head after each forward.
  H (--chunk)   prefill chunk size: tokens per forward while prefilling (generate's prefill_chunk_size);
                bounded arms need L > B + H.
  L (--limit)   the largest rotary position a bounded arm ever uses (BOUNDED_ARMS);
                residents are renumbered before a chunk would pass it.

arms (the registry pace_bench.arms.ARMS):
ARM_LINES

code execution:
  The checks run the model's code. It runs in a sandbox, but it is untrusted: opt in with
  PACE_ALLOW_CODE_EVAL=1 (or HF_ALLOW_CODE_EVAL=1, as for HF's code_eval), on a machine you can
  afford to lose.

example:
  PACE_ALLOW_CODE_EVAL=1 pace-bench --arms h2o,pace --sessions 3 --tokens 49152 --out runs/48k

several processes (sessions are independent; each process plays a share of the (arm, session) pairs,
writes OUT/probes.rank{N}.jsonl, and the main process merges them into OUT/probes.jsonl, the table and
the figures; --resume reads the shards too). --multi_gpu starts one process per --num_processes with
torchrun, one GPU each, or on a machine without CUDA, CPU processes over gloo:
  PACE_ALLOW_CODE_EVAL=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
      --mixed_precision no --dynamo_backend no -m pace_bench --arms h2o,pace --sessions 3 --out runs/48k
""".replace("BOUNDED_ARMS", ", ".join(BOUNDED_ARMS)).replace(
    "ARM_LINES", "\n".join(f"  {a.name:<18} {a.summary}" for a in ARMS.values()))


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _suite_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--suite", choices=("coding", "ruler", "repo", "bfcl", "bfcl-chain"), default="coding",
                    help="coding: the long-session coding benchmark; ruler: RULER through lm-eval (see --suite ruler "
                         "--help); repo: sessions over installed packages' real source (see --suite repo --help); "
                         "bfcl: BFCL v4 multi-turn tool calling, scored by bfcl-eval (see --suite bfcl --help); bfcl-chain: BFCL "
                         "entries chained into long sessions, teacher-forced (see --suite bfcl-chain --help)")
    return ap


def build_parser() -> argparse.ArgumentParser:
    from pace_bench.filler import FILLER_MODES
    from pace_bench.models import DEFAULT_MODEL, model_names

    ap = argparse.ArgumentParser(prog="pace-bench", description=__doc__.split("\n\n")[0], epilog=_EPILOG,
                                 formatter_class=_Formatter, parents=[_suite_parser()])
    ap.add_argument("--model", type=model_name, default=DEFAULT_MODEL, metavar="NAME",
                    help=f"one of {{{', '.join(model_names())}}}, or a local model directory")
    ap.add_argument("--arms", type=choice_list(ARMS, "arm(s)"), default="h2o,pace", metavar="ARM[,ARM...]",
                    help=f"comma-separated, from {{{', '.join(ARMS)}}}")
    ap.add_argument("--sessions", type=int_at_least(1), default=1, help="sessions per distance")
    ap.add_argument("--tokens", type=int_at_least(1), default=8192, help="context tokens before the first probe")
    ap.add_argument("--distance", type=int_at_least(0), nargs="+", default=None, metavar="D",
                    help="definition distances to sweep: tokens of filler between the definitions and the first "
                         "probe; none: all the filler after the definitions")
    ap.add_argument("--seed", type=int, default=0, help="the sessions' seed (session i of seed s is s<s>-<i>)")
    ap.add_argument("--secret", default=None,
                    help="the sessions' secret (32 hex digits; default: a fresh one, recorded in run.json): with "
                         "--seed it rebuilds a recorded run's sessions; --resume reads it from run.json")
    ap.add_argument("--filler-mode", choices=FILLER_MODES, default="non-repeating",
                    help="non-repeating: no stdlib file twice; repeating: four small files, cycled")
    ap.add_argument("--budget", type=int_at_least(1), default=2048, help="B: resident tokens per layer and KV head")
    ap.add_argument("--limit", type=int_at_least(1), default=8192,
                    help="L: rotary positions of bounded arms stay below it; needs L > B + H")
    ap.add_argument("--chunk", type=int_at_least(1), default=4096, help="H: prefill chunk size (tokens per forward)")
    ap.add_argument("--reference-arm", choices=ARMS, default="h2o",
                    help="the arm the table pairs the others against (if it is not run: the first arm run)")
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=None, help="cap the per-probe answer length")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="auto: bfloat16 where the CPU or GPU runs it fast, else float32")
    ap.add_argument("--planner", choices=PLANNERS, default="oracle",
                    help="what foresight arms plan with: the session's oracle blueprint, SymbolPlanner's from "
                         "the session's text, or no plan")
    ap.add_argument("--drop-edges", type=fraction, default=0.0, metavar="P",
                    help="drop a seeded fraction P of the oracle blueprint's (span, reader) edges")
    ap.add_argument("--store", choices=STORES, default="none",
                    help="spill evicted tokens to this tier (planned spans are restored from it)")
    ap.add_argument("--store-path", default=None, help="the disk tier's folder; none: OUT/kv")
    ap.add_argument("--spill-cap-mb", type=int_at_least(0), default=None, metavar="MB",
                    help="keep at most MB of spilled KV per session in the store (least recently used "
                         "pages go first; a restore of a dropped page brings back what is left)")
    ap.add_argument("--valkey-url", default="valkey://127.0.0.1:6379", help="the valkey tier's server")
    ap.add_argument("--rehydrate", action=argparse.BooleanOptionalAction, default=False,
                    help="before each probe, restore the evicted turns its prompt names (needs --store)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                    help="a per-chunk progress bar for each prefill")
    ap.add_argument("--out", default="runs/bench",
                    help="folder for probes.jsonl, run.json, table.md and the figures (fig1_*.png, fig3_*.png)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the (arm, session) pairs already complete in OUT/probes.jsonl (and in a sharded "
                         "run's OUT/probes.rank*.jsonl) and run the rest; with --checkpoint-every, a pair cut "
                         "short continues from its last checkpoint")
    ap.add_argument("--checkpoint-every", type=int_at_least(1), default=None, metavar="N",
                    help="save the running pair (its cache and the runner's state) to the store every N prefill "
                         "chunks, so that --resume continues it from there, to the same tokens; needs --store "
                         "disk or valkey (default: no checkpoints)")
    ap.add_argument("--chunk-log", action=argparse.BooleanOptionalAction, default=False,
                    help="append each prefill chunk's tokens/s and cache bytes to OUT/chunks.jsonl")
    return ap


def check_args(ap: argparse.ArgumentParser, args) -> None:
    """Checks across arguments, before anything loads (``ap.error`` exits with a usage message)."""
    settings = ArmSettings(budget=args.budget, limit=args.limit,
                           spill_cap_bytes=None if args.spill_cap_mb is None else args.spill_cap_mb << 20)
    for arm in args.arms:
        refusal = check_settings(arm, settings)  # the cache's own check of B and L
        if refusal:
            ap.error(f"--arms {arm} with --budget {args.budget} --limit {args.limit}: {refusal}")
    check_limit(ap, [a for a in args.arms if ARMS[a].bounded], args.limit, args.budget, args.chunk)
    if args.drop_edges and args.planner != "oracle":
        ap.error("--drop-edges drops edges of the oracle blueprint: it needs --planner oracle")
    if args.rehydrate and args.store == "none":
        ap.error("--rehydrate restores evicted turns from a store: give --store host, disk or valkey")
    if args.store_path and args.store != "disk":
        ap.error("--store-path is the disk tier's folder: it needs --store disk")
    if args.checkpoint_every and args.store not in ("disk", "valkey"):
        ap.error("--checkpoint-every saves to a store that outlives the process: give --store disk or valkey")
    if args.checkpoint_every and "full" in args.arms:
        ap.error("--checkpoint-every saves eviction caches; the full arm (DynamicCache) has no save: run it without")


def make_store(args, out_dir: Path):
    """The TieredStore of ``--store``, or None."""
    if args.store == "none":
        return None
    from pace_hf.tiers import DiskTier, HostTier, TieredStore, ValkeyTier

    tier = {"host": lambda: HostTier(),
            "disk": lambda: DiskTier(args.store_path or out_dir / "kv"),
            "valkey": lambda: ValkeyTier(args.valkey_url)}[args.store]()
    return TieredStore([tier])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    suite, argv = _suite_parser().parse_known_args(argv)
    if suite.suite == "ruler":  # RULER through lm-eval: its own arguments (pace-bench --suite ruler --help)
        from pace_bench.ruler import main as ruler_main

        return ruler_main(argv)
    if suite.suite == "repo":  # real repository sessions: its own arguments (pace-bench --suite repo --help)
        from pace_bench.repo_run import main as repo_main

        return repo_main(argv)
    if suite.suite == "bfcl":  # BFCL v4 multi-turn through bfcl-eval: its own arguments (pace-bench --suite bfcl --help)
        from pace_bench.bfcl import main as bfcl_main

        return bfcl_main(argv)
    if suite.suite == "bfcl-chain":  # BFCL entries chained into long sessions, teacher-forced (--suite bfcl-chain --help)
        from pace_bench.bfcl_chain import main as chain_main

        return chain_main(argv)
    args = command_line(argv, build_parser, check_args)

    from pace_bench.metrics.pace_coding.sandbox import CodeExecutionNotAllowed, SandboxUnavailable, opted_in

    if not opted_in():
        raise SystemExit("pace-bench: the checks execute model-generated code; opt in with PACE_ALLOW_CODE_EVAL=1 "
                         "(or HF_ALLOW_CODE_EVAL=1) on a machine you can afford to lose (see --help)")
    try:
        return _run(args)
    except (CodeExecutionNotAllowed, SandboxUnavailable) as e:
        raise SystemExit(f"pace-bench: {type(e).__name__}: {e}") from None


def run_secret(args, out_dir: Path, main: bool) -> str:
    """The sessions' secret: --secret, else on --resume the one run.json recorded, else a fresh one. The
    main process decides and writes it to ``out_dir/secret`` (the other processes of a sharded run read it
    there: call this inside ``main_process_first``). A run.json without one (a run of session generator
    13 or older, whose facts followed from the seed) cannot be resumed: this generator does not rebuild it."""
    from pace_bench.build import check_secret, new_secret

    path = out_dir / "secret"
    if not main:
        return path.read_text().strip()
    recorded = None
    if args.resume and (out_dir / "run.json").exists():
        recorded = json.loads((out_dir / "run.json").read_text()).get("secret")
        if recorded is None:
            raise SystemExit(f"pace-bench: --resume: {out_dir / 'run.json'} records no session secret: it is a run of "
                             "session generator 13 or older (facts drawn from the seed alone), which this generator "
                             "does not rebuild; start it again in another --out")
        if args.secret is not None and args.secret != recorded:
            raise SystemExit(f"pace-bench: --resume: --secret differs from the one {out_dir / 'run.json'} records")
    secret = args.secret if args.secret is not None else recorded or new_secret()
    try:
        check_secret(secret)
    except ValueError as e:
        raise SystemExit(f"pace-bench: --secret: {e}") from None
    path.write_text(secret + "\n")
    return secret


def run_settings(args, dtype, rows, num_processes: int) -> dict:
    """What ``run.json`` records: the settings a figure's title or a reader needs."""
    return {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "arms": args.arms,
            "sessions": args.sessions, "tokens": args.tokens, "distances": args.distance, "seed": args.seed,
            "secret": rows[0]["secret"], "filler_mode": args.filler_mode, "budget": args.budget, "limit": args.limit,
            "chunk": args.chunk,
            "planner": args.planner, "drop_edges": args.drop_edges, "store": args.store, "rehydrate": args.rehydrate,
            "max_new_tokens": args.max_new_tokens, "probes_per_session": len(rows[0]["probes"]),
            "checkpoint_every": args.checkpoint_every,
            "num_processes": num_processes}


def _run(args) -> int:
    os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
    quiet_library_bars()  # off a terminal: no raw redraws of transformers' and datasets' bars in the log
    import evaluate

    from pace_bench import load_sessions
    from pace_bench.build import SYSTEM_PROMPT
    from pace_bench.models import load_model, load_tokenizer, resolve_dtype
    from pace_hf.chat import ChatTemplate
    from pace_bench.metrics import PACE_CODING

    state = process_state()
    sharded = state.num_processes > 1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    # The sessions first: a knob that does not fit (say, a distance longer than the session) is an
    # error before the model loads. The main process builds them into the datasets cache; the others
    # read them from it.
    tokenizer = load_tokenizer(args.model)
    rows = []
    with state.main_process_first():
        secret = run_secret(args, out_dir, state.is_main_process)
        for distance in args.distance or [None]:
            try:
                rows += [dict(row, target_distance=distance) for row in
                         load_sessions(tokenizer, n_sessions=args.sessions, total_tokens=args.tokens,
                                       distance=distance, seed=args.seed, filler_mode=args.filler_mode,
                                       secret=secret)]
            except ValueError as e:
                raise SystemExit(f"pace-bench: {e}") from None
    log_path = out_dir / "probes.jsonl"
    # --resume keeps the complete pairs of the merged log and of any shards a sharded run left behind
    # (however many processes it had); every process reads them before the main one rewrites them, and
    # before the model loads, so that a log this run cannot continue is an error at once.
    records = resumable_records([log_path, *shard_paths(out_dir)], rows) if args.resume else []
    done = {pair_key(r["arm"], r) for r in records}
    dtype = resolve_dtype(args.dtype, state.device.type)
    model, tokenizer = load_model(args.model, dtype=dtype)
    model.to(state.device)
    metric = evaluate.load(PACE_CODING)
    stop_ids = ChatTemplate(tokenizer, SYSTEM_PROMPT).stop_ids()
    settings = ArmSettings(budget=args.budget, limit=args.limit,
                           spill_cap_bytes=None if args.spill_cap_mb is None else args.spill_cap_mb << 20)
    if sharded and args.store == "disk":  # each process its own folder
        args.store_path = str(Path(args.store_path or out_dir / "kv") / f"rank{state.process_index}")
    if state.is_main_process and not args.resume:  # a fresh run's chunk log starts empty; a resumed one appends
        for path in out_dir.glob("chunks*.jsonl"):
            path.unlink()
    order = {pair_key(arm, row): k for k, (row, arm) in enumerate((r, a) for r in rows for a in args.arms)}
    blueprints: dict[tuple, Blueprint] = {}
    chunk_log = (out_dir / (f"chunks.rank{state.process_index}.jsonl" if sharded else "chunks.jsonl")) \
        if args.chunk_log else None

    def played(item, store):
        row, arm = item
        if session_key(row) not in blueprints:
            blueprints[session_key(row)] = session_blueprint(row, tokenizer, args.planner, args.drop_edges,
                                                             args.seed, budget=args.budget)
        for record in play_session(model, tokenizer, row, arm, settings, metric, args.chunk, stop_ids,
                                   args.max_new_tokens, blueprint=blueprints[session_key(row)], store=store,
                                   rehydrate=args.rehydrate, progress=args.progress and state.is_main_process,
                                   checkpoint_every=args.checkpoint_every, resume=args.resume, chunk_log=chunk_log):
            record.update(target_distance=row["target_distance"], planner=args.planner,
                          drop_edges=args.drop_edges, store=args.store)
            yield record

    def finish(records):
        table = with_distance_table(summarize(records, args.reference_arm), records)  # a sweep: Table 3 too
        header = (f"model {args.model} ({dtype}), {len(rows)} sessions x {len(rows[0]['probes'])} probes, "
                  f"~{args.tokens:,} context tokens, B={args.budget:,}, H={args.chunk:,}, L={args.limit:,}, "
                  f"planner {args.planner}" + (f" (edges dropped: {args.drop_edges:g})" if args.drop_edges else "")
                  + (f", store {args.store}" if args.store != "none" else "")
                  + (f", {state.num_processes} processes" if sharded else "") + "\n\n")
        (out_dir / "table.md").write_text(header + table + "\n")
        figures = plot(records, out_dir, {"model": args.model, "budget": args.budget, "limit": args.limit,
                                          "chunk": args.chunk})
        print(header + table)
        print("\nfigures: " + ", ".join(str(p) for p in figures))

    # session-major, so that a run cut short still holds paired results
    pairs = [(row, arm) for row in rows for arm in args.arms if pair_key(arm, row) not in done]
    play_all(out_dir, run_settings(args, dtype, rows, state.num_processes), records, pairs, played,
             rank=lambda r: (order.get(pair_key(r["arm"], r), len(order)), r["step"]), describe=progress_line,
             desc="sessions x arms", finish=finish, new_store=lambda: make_store(args, out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
