"""PACE's plan for chained BFCL sessions, chosen on held-out chains: every variant against the same full,
H2O and SnapKV records.

    python bench/bfcl_chain_plans.py [DIR]      # DIR: bench/results/bfcl_chain/dev-seed1 (the default)

DIR holds one folder per run of ``pace-bench --suite bfcl-chain`` on the same chains (``ref``: the full
cache, H2O, SnapKV and the first plan; each other folder one ``--plan`` at one ``--limit``; a folder's run.json
may add ``"layout"``, the renumbering layout it played, "compact" when absent: the runs from before
renumbering kept eviction's gaps, capped). Writes DIR/table.md: per
arm and variant, the call NLL as a ratio to the full cache's (bootstrap 95% interval over entries) and
the entry-by-entry sign test against H2O, the table of ``docs/benchmarks/bfcl.md``'s "Choosing the plan".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pace_bench.bfcl_chain import FIRST_PLAN, bootstrap_ratio, units
from pace_bench.records import read_jsonl
from pace_bench.stats import sign_test


def variants(root: Path):
    """(label, run.json, records) per folder; the reference folder's baselines each under its arm's name."""
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        run = json.loads((folder / "run.json").read_text())
        for r in read_jsonl(folder / "probes.jsonl"):
            layout = "never renumbers" if run["limit"] > run["tokens"] else run.get("layout", "compact")
            label = r["arm"] if r["arm"] != "pace" else (f"pace, plan {tuple(r.get('plan', FIRST_PLAN))}, "
                                                         f"L = {run['limit']:,}, {layout}")
            yield label, r


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "bench/results/bfcl_chain/dev-seed1")
    rows: dict[str, list[dict]] = {}
    for label, r in variants(root):
        rows.setdefault(label, []).append(r)
    full = {k: u for r in rows.pop("full") for k, u in units(r).items()}
    h2o = {k: u for r in rows["h2o"] for k, u in units(r).items()}
    tokens = sum(u["tokens"] for u in full.values())
    lines = [f"{len(full)} entries, {tokens:,} call tokens; the full cache's NLL is "
             f"{sum(u['nll'] for u in full.values()) / tokens:.3f} per call token", "",
             "| arm | NLL ratio to full [95% CI] | top-1 | against H2O, by entry: better / worse (p) |",
             "|---|---|---|---|"]
    for label, rs in sorted(rows.items(), key=lambda kv: kv[0]):
        mine = {k: u for r in rs for k, u in units(r).items()}
        keys = [k for k in mine if k in full]
        ratio, lo, hi = bootstrap_ratio([mine[k]["nll"] for k in keys], [full[k]["nll"] for k in keys])
        top1 = sum(mine[k]["top1"] for k in keys) / sum(mine[k]["tokens"] for k in keys)
        better = sum(mine[k]["nll"] < h2o[k]["nll"] for k in keys if k in h2o)
        worse = sum(mine[k]["nll"] > h2o[k]["nll"] for k in keys if k in h2o)
        versus = "-" if label == "h2o" else f"{better} / {worse} (p = {sign_test(better, worse):.2g})"
        lines.append(f"| {label} | {ratio:.3f} [{lo:.2f}, {hi:.2f}] | {100 * top1:.1f}% | {versus} |")
    (root / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
