"""The planner-robustness curve: checks passed as a seeded fraction of the oracle's edges is dropped,
with and without rehydration (the planner restoring what a probe names), beside H2O on the same sessions.

Why: a real planner misses dependencies. Without rehydration PACE should fall toward H2O as edges go
missing; with rehydration (the evicted turns a probe's prompt names come back from the host tier before
the probe is prefilled) it should stay near the oracle. Each point is one ``pace-bench`` run in its own
folder under ``--out`` (``drop<P>`` or ``drop<P>-rehydrate``, and ``h2o``), run with ``--resume``, so an
interrupted curve continues where it stopped. Then ``robustness.md`` and ``robustness.png`` are written
(``pace_bench.figures``).

    PACE_ALLOW_CODE_EVAL=1 python bench/robustness.py --tokens 8192 --distance 6144 --seed 2 \\
        --drops 0,0.25,0.5,1 --out bench/results/robustness
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pace_bench.figures import FIGURE_ROBUSTNESS, figure_robustness, robustness_table
from pace_bench.runner import main as run_bench
from pace_bench.records import read_jsonl


def point_dir(out: Path, drop: float, rehydrate: bool) -> Path:
    return out / (f"drop{drop:g}" + ("-rehydrate" if rehydrate else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--distance", type=int, default=6144)
    ap.add_argument("--sessions", type=int, default=1)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--drops", default="0,0.25,0.5,1", help="comma-separated fractions of oracle edges to drop")
    ap.add_argument("--no-h2o", action="store_true", help="skip the H2O reference line")
    ap.add_argument("--plot-only", action="store_true", help="only redraw from the folders under --out")
    ap.add_argument("--out", default="runs/robustness")
    args = ap.parse_args(argv)
    drops = [float(d) for d in args.drops.split(",")]
    if any(not 0 <= d <= 1 for d in drops):
        ap.error("--drops: fractions must lie in [0, 1]")
    out = Path(args.out)
    common = ["--model", args.model, "--tokens", str(args.tokens), "--distance", str(args.distance),
              "--sessions", str(args.sessions), "--seed", str(args.seed), "--budget", str(args.budget),
              "--limit", str(args.limit), "--chunk", str(args.chunk), "--no-progress", "--resume"]
    points = [(d, r) for d in drops for r in (False, True)]
    if not args.plot_only:
        for drop, rehydrate in points:
            extra = ["--store", "host", "--rehydrate"] if rehydrate else []
            rc = run_bench(common + ["--arms", "pace", "--planner", "oracle", "--drop-edges", str(drop),
                                     "--out", str(point_dir(out, drop, rehydrate))] + extra)
            if rc:
                return rc
        if not args.no_h2o:
            rc = run_bench(common + ["--arms", "h2o", "--out", str(out / "h2o")])
            if rc:
                return rc
    out.mkdir(parents=True, exist_ok=True)
    records = {p: read_jsonl(point_dir(out, *p) / "probes.jsonl") for p in points}
    h2o = read_jsonl(out / "h2o" / "probes.jsonl")
    settings = {k: getattr(args, k) for k in ("model", "budget", "limit", "chunk")}
    table = robustness_table(records, h2o)
    heading = (f"Planner robustness: {args.model}, {args.sessions} session(s) of seed {args.seed}, "
               f"~{args.tokens:,} context tokens, D={args.distance:,}, B={args.budget:,}, L={args.limit:,}, "
               f"H={args.chunk:,}\n\n")
    (out / "robustness.md").write_text(heading + table)
    figure_robustness(records, settings, out / FIGURE_ROBUSTNESS, h2o)
    (out / "robustness.json").write_text(json.dumps({"settings": vars(args), "drops": drops}, indent=2) + "\n")
    print(heading + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
