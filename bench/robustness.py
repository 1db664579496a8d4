"""The planner-robustness curve: checks passed as a seeded fraction of the oracle's edges is dropped,
with and without retrieval-triggered rehydration, beside H2O on the same sessions.

Why: a real planner misses dependencies. Without rehydration PACE should fall toward H2O as edges go
missing; with rehydration (the evicted turns a probe's prompt names come back from the host tier before
the probe is prefilled) it should stay near the oracle. Each point is one ``pace-bench`` run in its own
folder under ``--out`` (``drop<P>`` or ``drop<P>-rehydrate``, and ``h2o``), run with ``--resume``, so an
interrupted curve continues where it stopped. Then ``robustness.md`` and ``robustness.png`` are written.

    PACE_ALLOW_CODE_EVAL=1 python bench/robustness.py --tokens 12288 --distance 8192 --seed 2 \\
        --drops 0,0.25,0.5,1 --out bench/results/robustness
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from pace_hf.bench.runner import main as run_bench
from pace_hf.bench.runner import read_jsonl


def point_dir(out: Path, drop: float, rehydrate: bool) -> Path:
    return out / (f"drop{drop:g}" + ("-rehydrate" if rehydrate else ""))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a proportion k/n."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def tally(folder: Path) -> dict | None:
    """Checks, full probes, recall and residency of one finished run (None if it has no probes)."""
    rows = read_jsonl(folder / "probes.jsonl")
    if not rows:
        return None
    passed = sum(r["checks_passed"] for r in rows)
    total = sum(r["checks_total"] for r in rows)
    residency = [r["residency"] for r in rows if r.get("residency") is not None]
    return {
        "probes": len(rows), "passed": passed, "total": total,
        "full": sum(r["checks_passed"] == r["checks_total"] for r in rows),
        "recall": sum(r["recall_hits"] for r in rows) / max(1, sum(r["recall_total"] for r in rows)),
        "residency": sum(residency) / len(residency) if residency else None,
        "ci": wilson(passed, total),
    }


def write_outputs(out: Path, drops: list[float], settings: dict) -> str:
    """``robustness.md`` (one row per point) and ``robustness.png`` (checks vs dropped fraction)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h2o = tally(out / "h2o")
    lines = [
        f"Planner robustness: {settings['model']}, {settings['sessions']} session(s) of seed {settings['seed']}, "
        f"~{settings['tokens']:,} context tokens, D={settings['distance']}, B={settings['budget']:,}, "
        f"L={settings['limit']:,}, H={settings['chunk']:,}",
        "",
        "| oracle edges dropped | rehydration | checks | full probes | recall | residency |",
        "|---|---|---|---|---|---|",
    ]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for rehydrate, style in ((False, "o-"), (True, "s-")):
        xs, ys, lo, hi = [], [], [], []
        for drop in drops:
            t = tally(point_dir(out, drop, rehydrate))
            if t is None:
                lines.append(f"| {drop:g} | {'yes' if rehydrate else 'no'} | not run | | | |")
                continue
            res = "-" if t["residency"] is None else f"{t['residency']:.3f}"
            lines.append(f"| {drop:g} | {'yes' if rehydrate else 'no'} | {t['passed']}/{t['total']} "
                         f"({t['passed'] / t['total']:.0%}) | {t['full']}/{t['probes']} | {t['recall']:.0%} | {res} |")
            xs.append(drop)
            ys.append(t["passed"] / t["total"])
            lo.append(ys[-1] - t["ci"][0])
            hi.append(t["ci"][1] - ys[-1])
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, capsize=3,
                        label="PACE + rehydration" if rehydrate else "PACE, plan only")
    if h2o is not None:
        lines.append(f"| (H2O) | no | {h2o['passed']}/{h2o['total']} ({h2o['passed'] / h2o['total']:.0%}) "
                     f"| {h2o['full']}/{h2o['probes']} | {h2o['recall']:.0%} | - |")
        ax.axhline(h2o["passed"] / h2o["total"], color="grey", linestyle="--", label="H2O")
    ax.set_xlabel("fraction of the oracle blueprint's edges dropped")
    ax.set_ylabel("checks passed (95% Wilson interval)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"{settings['model']}: {settings['sessions']} x seed {settings['seed']}, "
                 f"{settings['tokens']:,} tokens, B={settings['budget']:,}, L={settings['limit']:,}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "robustness.png", dpi=120)
    plt.close(fig)
    table = "\n".join(lines) + "\n"
    (out / "robustness.md").write_text(table)
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--distance", type=int, default=8192)
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
    if not args.plot_only:
        points = [(d, r) for d in drops for r in (False, True)]
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
    settings = {k: getattr(args, k) for k in ("model", "tokens", "distance", "sessions", "seed", "budget",
                                              "limit", "chunk")}
    print(write_outputs(out, drops, settings))
    (out / "robustness.json").write_text(json.dumps({"settings": settings, "drops": drops}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
