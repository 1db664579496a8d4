"""PACE's variants on chained BFCL sessions (a plan, a limit) against the same full, H2O, SnapKV and
StreamingLLM records, at one budget: how the plan was chosen on held-out chains, and how the limit that
choice pointed to fares on the chains the protocol plays.

    python bench/bfcl_chain_plans.py [DIR] [--ref REF] [--budget B]   # DIR: bench/results/bfcl_chain/dev-seed1

DIR holds one folder per run of ``pace-bench --suite bfcl-chain`` on the same chains; REF (DIR/ref unless
given) is the run whose full cache is the reference (the full cache, H2O, SnapKV... and the plan it
played). Each other folder is one ``--plan`` at one ``--limit``. A PACE row names its plan, its limit and
its renumbering layout: the record's (or its run.json's) ``"layout"``, "compact" when neither says (the
runs from before renumbering kept eviction's gaps, capped), and "never renumbers" where the session fits
under the limit. Writes DIR/table.md: per arm and variant, the call NLL as a ratio to the full cache's
(bootstrap 95% interval over entries) and the entry-by-entry sign tests against H2O, SnapKV and
StreamingLLM (where played): the tables of ``docs/benchmarks/bfcl.md``'s "Choosing the plan" and "The
limit, tested on seed 0". At another ``--budget`` than 2,048 it writes DIR/table-b{B}.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pace_bench.bfcl_chain import FIRST_PLAN, bootstrap_ratio, units
from pace_bench.records import read_jsonl
from pace_bench.stats import sign_test

BUDGET = 2048  # the budget every dev variant played, and table.md's (a reference may also hold another's records)
BASELINES = {"h2o": "H2O", "snapkv": "SnapKV", "streaming": "StreamingLLM"}  # the columns, where played


def variants(folders: list[Path], budget: int = BUDGET):
    """(label, record) per record of ``folders`` at ``budget`` (the full cache's too); a baseline under its
    arm's name."""
    for folder in folders:
        run = json.loads((folder / "run.json").read_text())
        for r in read_jsonl(folder / "probes.jsonl"):
            if r["budget"] not in (None, budget):
                continue
            if r["arm"] != "pace":
                yield r["arm"], r
                continue
            layout = ("never renumbers" if r["tokens"] <= run["limit"]
                      else r.get("layout", run.get("layout", "compact")))
            yield f"pace, plan {tuple(r.get('plan', FIRST_PLAN))}, L = {run['limit']:,}, {layout}", r


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default="bench/results/bfcl_chain/dev-seed1", type=Path)
    ap.add_argument("--ref", type=Path, default=None, help="the reference run's folder (default: DIR/ref)")
    ap.add_argument("--budget", type=int, default=BUDGET, help="the budget whose records are compared")
    args = ap.parse_args(argv)
    root, ref = args.dir, args.ref or args.dir / "ref"
    folders = [ref] + sorted(p for p in root.iterdir() if p.is_dir() and p.resolve() != ref.resolve())
    rows: dict[str, list[dict]] = {}
    for label, r in variants(folders, args.budget):
        rows.setdefault(label, []).append(r)
    if "full" not in rows:
        raise SystemExit(f"bfcl_chain_plans.py: {ref} holds no full-cache records, the reference of every ratio")
    full = {k: u for r in rows.pop("full") for k, u in units(r).items()}
    base = {arm: {k: u for r in rows[arm] for k, u in units(r).items()} for arm in BASELINES if arm in rows}
    tokens = sum(u["tokens"] for u in full.values())
    lines = [f"{len(full)} entries, {tokens:,} call tokens, B = {args.budget:,}; the full cache's NLL is "
             f"{sum(u['nll'] for u in full.values()) / tokens:.3f} per call token", "",
             "| arm | NLL ratio to full [95% CI] | top-1 | "
             + " | ".join(f"against {BASELINES[arm]}, by entry: better / worse (p)" for arm in base) + " |",
             "|---|---|---|" + "---|" * len(base)]
    for label, rs in sorted(rows.items(), key=lambda kv: kv[0]):
        mine = {k: u for r in rs for k, u in units(r).items()}
        keys = [k for k in mine if k in full]
        ratio, lo, hi = bootstrap_ratio([mine[k]["nll"] for k in keys], [full[k]["nll"] for k in keys])
        top1 = sum(mine[k]["top1"] for k in keys) / sum(mine[k]["tokens"] for k in keys)
        versus = []
        for arm, other in base.items():
            better = sum(mine[k]["nll"] < other[k]["nll"] for k in keys if k in other)
            worse = sum(mine[k]["nll"] > other[k]["nll"] for k in keys if k in other)
            versus.append("-" if label == arm else f"{better} / {worse} (p = {sign_test(better, worse):.2g})")
        lines.append(f"| {label} | {ratio:.3f} [{lo:.2f}, {hi:.2f}] | {100 * top1:.1f}% | " + " | ".join(versus) + " |")
    (root / ("table.md" if args.budget == BUDGET else f"table-b{args.budget}.md")).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
