"""The benchmark runner: play sessions through ``model.generate`` with each arm's cache.

Per probe it records the answer, the hidden-check results, recall, the residency of the tokens the
probe needs and the rotary gap, read from the cache's ledger when the probe starts. It writes JSONL,
a Markdown table shaped like the paper's Table 2 and PNG plots of accuracy against definition
distance and against rotary gap (the paper's Figures 1 and 3).

    PACE_ALLOW_CODE_EVAL=1 pace-bench --arms h2o,pace --sessions 3 --tokens 49152 --out runs/48k
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pace_hf import Blueprint, EvictionCache
from pace_hf.cache import DEFAULT_RECENT
from pace_hf.bench.models import preferred_dtype

from transformers import StoppingCriteria

from pace_hf.scoring import CumulativeAttention, Foresight, ObservationWindow, Recency

# Each arm is a composition: a scoring policy, with or without foresight, with or without a limit.
# name -> (base scorer or None for the full cache, foresight, bounded)
ARM_PARTS = {
    "full": (None, False, False),
    "h2o": (CumulativeAttention, False, False),
    "snapkv": (ObservationWindow, False, False),
    "streaming": (Recency, False, False),
    "positions_only": (CumulativeAttention, False, True),
    "retention_only": (CumulativeAttention, True, False),
    "pace": (CumulativeAttention, True, True),
    "snapkv_foresight": (ObservationWindow, True, False),
    "streaming_bounded": (Recency, False, True),
}
ARMS = tuple(ARM_PARTS)


@dataclass(frozen=True)
class ArmSettings:
    budget: int = 2048
    limit: int = 8192


def make_cache(arm: str, model, blueprint: Blueprint, s: ArmSettings):
    """The cache of one arm; every evicting arm shares budget, sinks, recent and schedule."""
    from transformers import DynamicCache

    if arm not in ARM_PARTS:
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    scorer, foresight, bounded = ARM_PARTS[arm]
    if scorer is None:
        return DynamicCache(config=model.config)
    scoring = Foresight(scorer(), blueprint) if foresight else scorer()
    recent = 0 if scorer is Recency else DEFAULT_RECENT
    return EvictionCache(model, budget=s.budget, limit=s.limit if bounded else None, scoring=scoring, recent=recent)


def needed_positions(row, probe) -> torch.Tensor:
    """Logical positions of the spans this probe reads (from the session's oracle blueprint)."""
    spans = [torch.arange(b["start"], b["end"]) for b in row["blueprint"] if probe["step"] in b["readers"]]
    return torch.cat(spans) if spans else torch.empty(0, dtype=torch.long)


def ledger_at_probe(cache, needed: torch.Tensor) -> dict:
    """Residency of the needed tokens (mean over layers and KV heads) and the rotary gap between the
    probe's first query and the farthest resident needed token (None when none is resident)."""
    if not isinstance(cache, EvictionCache):  # the full arm: everything resident at its logical position
        seen = cache.get_seq_length()
        return {"residency": 1.0, "rotary_gap": int(seen - needed.min()) if needed.numel() else None}
    return {"residency": cache.residency(needed), "rotary_gap": cache.rotary_gap(needed)}


class ReadAtFirstQuery(StoppingCriteria):
    """Reads the ledger once, when generate has prefilled the probe and is about to feed its first
    answer token (the first stopping check); never stops generation."""

    def __init__(self, cache, needed: torch.Tensor):
        self.cache, self.needed, self.reading = cache, needed, None

    def __call__(self, input_ids, scores, **kwargs):
        if self.reading is None:
            self.reading = ledger_at_probe(self.cache, self.needed)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate_answer(model, ids: list[int], cache, max_new_tokens: int, stop_ids: list[int], chunk: int,
                    stopping_criteria=None) -> list[int]:
    """Greedy answer to the conversation ``ids``; ``cache`` holds a prefix of it. No trailing EOS."""
    input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)
    with torch.no_grad():
        out = model.generate(
            input_ids, cache=cache, attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
            eos_token_id=stop_ids, pad_token_id=stop_ids[0], prefill_chunk_size=chunk,
            stopping_criteria=stopping_criteria,
        )
    new = out[0, len(ids):].tolist()
    while new and new[-1] in stop_ids:
        new.pop()
    return new


def play_session(model, tokenizer, row, arm: str, settings: ArmSettings, metric, chunk: int, stop_ids,
                 max_new_tokens: int | None = None) -> list[dict]:
    """Prefill the session, then answer its probes in order, appending each answer (agent style)."""
    blueprint = Blueprint.from_dicts(row["blueprint"])
    cache = make_cache(arm, model, blueprint, settings)
    ids = list(row["context_ids"])
    records = []
    for probe in row["probes"]:
        ids += probe["prompt_ids"]
        if isinstance(cache, EvictionCache):
            cache.step = probe["step"]
        start = time.perf_counter()
        reading = ReadAtFirstQuery(cache, needed_positions(row, probe))
        budget = min(probe["max_new_tokens"], max_new_tokens or probe["max_new_tokens"])
        answer = generate_answer(model, ids, cache, budget, stop_ids, chunk, [reading])
        probe_state = reading.reading or {}
        seconds = time.perf_counter() - start
        ids += answer + list(row["turn_end_ids"])
        text = tokenizer.decode(answer, skip_special_tokens=True)
        try:
            score = metric.compute(predictions=[text], references=[probe["reference"]])["details"][0]
        except Exception as e:  # noqa: BLE001 - one probe's scoring failure must not end a long run
            from pace_hf.metrics.pace_coding.sandbox import CodeExecutionNotAllowed, SandboxUnavailable
            if isinstance(e, (CodeExecutionNotAllowed, SandboxUnavailable)):
                raise  # no probe can be scored on this machine: stop now, not hours later
            try:  # the probe still counts, with every check failed
                ref = json.loads(probe["reference"])
                totals = (len(ref["checks"]), len(ref.get("recall", [])))
            except Exception:  # noqa: BLE001
                totals = (0, 0)
            score = {"checks_passed": 0, "checks_total": totals[0], "recall_hits": 0, "recall_total": totals[1],
                     "checks": [], "scoring_error": f"{type(e).__name__}: {e}"[:500]}
        records.append({
            "arm": arm, "session_id": row["session_id"], "probe": probe["name"], "step": probe["step"],
            "distance": row["distance"], "context_len": row["context_len"], "answer": text,
            "checks_passed": score["checks_passed"], "checks_total": score["checks_total"],
            "recall_hits": score["recall_hits"], "recall_total": score["recall_total"],
            "checks": score["checks"], "seconds": round(seconds, 1), **probe_state,
            **({"scoring_error": score["scoring_error"]} if "scoring_error" in score else {}),
        })
    return records


def _gap(value) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def progress_line(r: dict) -> str:
    """One line per scored probe, naming the facts of the checks that failed."""
    failed = sorted({c.get("fact") or c["name"] for c in r["checks"] if not c["passed"]})
    return (f"{r['arm']:>14} {r['session_id']} {r['probe']:<8} checks {r['checks_passed']}/{r['checks_total']} "
            f"recall {r['recall_hits']}/{r['recall_total']} residency {r.get('residency', 1.0):.3f} "
            f"gap {_gap(r.get('rotary_gap'))} {r['seconds']:.0f}s" + (f"  failed: {', '.join(failed)}" if failed else ""))


def completed_records(path: Path, probes_per_session: int) -> list[dict]:
    """Records of the (arm, session) pairs that ``path`` holds in full (a run cut short loses only the
    pair it was playing)."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    count: dict[tuple, int] = {}
    for r in records:
        count[r["arm"], r["session_id"]] = count.get((r["arm"], r["session_id"]), 0) + 1
    return [r for r in records if count[r["arm"], r["session_id"]] == probes_per_session]


def summarize(records: list[dict], reference_arm: str | None) -> str:
    """A Markdown table in the shape of the paper's Table 2."""
    from pace_hf.metrics.pace_coding.pace_coding import sign_test

    arms = list(dict.fromkeys(r["arm"] for r in records))
    by_arm = {a: [r for r in records if r["arm"] == a] for a in arms}
    key = lambda r: (r["session_id"], r["probe"])  # noqa: E731
    lines = ["| arm | checks | full probes | recall | residency | mean rotary gap | vs " + (reference_arm or "-") + " (better/worse/tied, p) |",
             "|---|---|---|---|---|---|---|"]
    for arm, rs in by_arm.items():
        passed, total = sum(r["checks_passed"] for r in rs), sum(r["checks_total"] for r in rs)
        full = sum(r["checks_passed"] == r["checks_total"] for r in rs)
        recall = sum(r["recall_hits"] for r in rs) / max(1, sum(r["recall_total"] for r in rs))
        residency = sum(r.get("residency", 1.0) for r in rs) / len(rs)
        gaps = [r["rotary_gap"] for r in rs if r.get("rotary_gap") is not None]  # nothing resident: no gap
        gap = _gap(sum(gaps) / len(gaps) if gaps else None)
        paired = "-"
        if reference_arm in by_arm and arm != reference_arm:
            ref = {key(r): r["checks_passed"] for r in by_arm[reference_arm]}
            diffs = [r["checks_passed"] - ref[key(r)] for r in rs if key(r) in ref]
            better, worse = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
            paired = f"{better}/{worse}/{len(diffs) - better - worse}, p={sign_test(better, worse):.3g}"
        lines.append(f"| {arm} | {passed}/{total} ({100 * passed / max(1, total):.0f}%) | {full}/{len(rs)} | "
                     f"{100 * recall:.0f}% | {residency:.3f} | {gap} | {paired} |")
    return "\n".join(lines)


def plot(records: list[dict], out_dir: Path) -> list[Path]:
    """Accuracy against definition distance and against rotary gap, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for field, label, name in (("distance", "definition distance (tokens)", "accuracy_vs_distance.png"),
                               ("rotary_gap", "rotary gap at the probe (tokens)", "accuracy_vs_gap.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm in dict.fromkeys(r["arm"] for r in records):
            rs = sorted((r for r in records if r["arm"] == arm and r.get(field) is not None), key=lambda r: r[field])
            xs = [r[field] for r in rs]
            ys = [r["checks_passed"] / max(1, r["checks_total"]) for r in rs]
            ax.plot(xs, ys, marker="o", linestyle="-" if field == "distance" else "none", label=arm)
        ax.set_xlabel(label)
        ax.set_ylabel("checks passed (fraction)")
        ax.set_ylim(-0.05, 1.05)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pace-bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--arms", default="h2o,pace", help=f"comma-separated, from {', '.join(ARMS)}")
    ap.add_argument("--sessions", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8192, help="context tokens before the first probe")
    ap.add_argument("--distance", type=int, nargs="*", default=[None], help="definition distances to sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--filler-mode", default="non-repeating")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=4096, help="prefill_chunk_size")
    ap.add_argument("--reference-arm", default="h2o")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="cap the per-probe answer length")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--resume", action="store_true",
                    help="keep the (arm, session) pairs already complete in OUT/probes.jsonl and run the rest")
    args = ap.parse_args(argv)

    from pace_hf.metrics.pace_coding.sandbox import require_opt_in

    require_opt_in()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
    import evaluate
    from tqdm.auto import tqdm

    from pace_hf.bench import load_sessions
    from pace_hf.metrics import PACE_CODING
    from pace_hf.bench.models import load_model

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for arm in arms:
        if arm not in ARMS:
            raise SystemExit(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = preferred_dtype(device) if args.dtype == "auto" else getattr(torch, args.dtype)
    model, tokenizer = load_model(args.model, dtype=dtype)
    metric = evaluate.load(PACE_CODING)
    stop_ids = [i for i in {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
                if isinstance(i, int) and i >= 0]
    settings = ArmSettings(budget=args.budget, limit=args.limit)
    rows = []
    for distance in args.distance:
        rows += list(load_sessions(tokenizer, n_sessions=args.sessions, total_tokens=args.tokens,
                                   distance=distance, seed=args.seed, filler_mode=args.filler_mode))
    log_path = out_dir / "probes.jsonl"
    records = completed_records(log_path, {len(r["probes"]) for r in rows}.pop()) if args.resume else []
    same_sessions = {(r["session_id"], r["context_len"]) for r in rows}
    records = [r for r in records if (r["session_id"], r["context_len"]) in same_sessions]
    done = {(r["arm"], r["session_id"]) for r in records}
    with open(log_path, "w") as log:
        for record in records:
            log.write(json.dumps(record) + "\n")
        log.flush()  # the kept records are on disk before the first new pair starts
        # session-major, so that a run cut short still holds paired results
        pairs = [(row, arm) for row in rows for arm in arms if (arm, row["session_id"]) not in done]
        for row, arm in tqdm(pairs, desc="sessions x arms", unit="run"):
            for record in play_session(model, tokenizer, row, arm, settings, metric, args.chunk, stop_ids,
                                       args.max_new_tokens):
                log.write(json.dumps(record) + "\n")
                log.flush()
                records.append(record)
                tqdm.write(progress_line(record))
    table = summarize(records, args.reference_arm)
    header = (f"model {args.model} ({dtype}), {len(rows)} sessions x {len(rows[0]['probes'])} probes, "
              f"~{args.tokens:,} context tokens, B={args.budget:,}, H={args.chunk:,}, L={args.limit:,}\n\n")
    (out_dir / "table.md").write_text(header + table + "\n")
    plots = plot(records, out_dir)
    print(header + table)
    print("\nplots: " + ", ".join(str(p) for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
