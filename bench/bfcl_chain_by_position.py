"""Where in a chained BFCL session the calls are lost: each arm's call NLL against the full cache's, split
by whether the call sits before or past a token position (``--at``; 32,768 by default, the training
context of Qwen2.5-Coder-0.5B, the model these runs play).

    python bench/bfcl_chain_by_position.py [DIR] [--at N] [--inside DIR2]   # DIR: bench/results/bfcl_chain/64k

Past its training context the full cache reads positions the model never saw, while PACE renumbers under
its limit. If the full cache falls there, the arms' ratios to it fall past ``--at``; later calls are also
harder for every arm (a session's second half costs more at 32K too), so the same split of the 32K
sessions (``--at 24576``) is the control.

The chains of one seed deal the same entries at every length, so most entries of a 64K session were also
played in a 32K one. ``--inside DIR2`` (the 32K run) pairs them: each arm's NLL on an entry whose calls all
lie past ``--at`` here, against its NLL on the same calls inside DIR2's shorter session. The preceding
entries differ, so an arm whose resident tokens stay close to the query (PACE's renumbered positions,
StreamingLLM's recent window) is the control for what a far position costs the others.

The records hold no positions: the sessions are drawn again from the run's settings (``run.json``) with
the model's tokenizer, and each trajectory is rebuilt, its messages and real tool outputs, without a
forward; a record whose trajectory differs from the rebuilt one is refused. Writes DIR/by-position.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from pace_bench import bfcl
from pace_bench.bfcl_chain import bootstrap_ratio, draw_chains, entry_messages, ids_digest
from pace_bench.records import read_jsonl
from pace_bench.stats import sign_test


def call_positions(session) -> tuple[dict[tuple[int, int, int], int], str]:
    """``{(entry, turn, call): the position of the call's first token}`` along ``session``'s trajectory,
    and the trajectory's digest (as a record holds it)."""
    conversation = bfcl.Conversation(session.template)
    at_call = {}
    for e, entry in enumerate(session.entries):
        with contextlib.closing(entry_messages(entry, session.template, session.docs, "positions")) as messages:
            for role, turn, block in messages:
                if role == "assistant":
                    for k, (a, _b) in enumerate(block.call_spans):
                        at_call[(e, turn.index, k)] = len(conversation.ids) + a
                conversation.add(role, block.content, block.ids)
    return at_call, ids_digest(conversation.ids)


def split_units(record: dict, at_call: dict, at: int) -> dict[tuple, dict]:
    """Per (session, entry, side of ``at``): the call tokens and their NLL sum. An entry that straddles
    ``at`` gives a unit on each side."""
    out: dict[tuple, dict] = {}
    for e, turn, k, n, nll, _top1, _resident in record["calls"]:
        side = "past" if at_call[(e, turn, k)] >= at else "before"
        u = out.setdefault((record["session_id"], e, side), {"tokens": 0, "nll": 0.0})
        u["tokens"], u["nll"] = u["tokens"] + n, u["nll"] + nll
    return out


def by_position(records: list[dict], positions: dict[str, tuple[dict, str]], at: int) -> str:
    """Markdown: the full cache's NLL per call token on each side of ``at``; per arm and budget, its
    pooled ratio to the full cache there (bootstrap 95% interval over units) and how many units it
    beats the full cache on (sign test)."""
    for r in records:
        if r["trajectory"] != positions[r["session_id"]][1]:
            raise SystemExit(f"bfcl_chain_by_position.py: {r['session_id']} ({r['arm']}, B = {r['budget']}) read "
                             "another trajectory than the one drawn again from run.json: not these sessions")
    units = {(r["arm"], r["budget"]): {} for r in records}
    for r in records:
        units[(r["arm"], r["budget"])].update(split_units(r, positions[r["session_id"]][0], at))
    if ("full", None) not in units:
        raise SystemExit("bfcl_chain_by_position.py: no full-cache records, the reference of every ratio")
    full = units.pop(("full", None))
    sides = ("before", "past")
    lines = [f"Calls split at token {at:,}: a call is past it when its first token is.", ""]
    for side in sides:
        mine = [u for k, u in full.items() if k[2] == side]
        tokens = sum(u["tokens"] for u in mine)
        if tokens:
            lines.append(f"- {side} {at:,}: {len({k[:2] for k in full if k[2] == side})} entries, {tokens:,} call "
                         f"tokens; the full cache's NLL is {sum(u['nll'] for u in mine) / tokens:.3f} per call token")
    lines += ["", "| arm | B | " + " | ".join(f"ratio to full, {side} [95% CI] | better than full, {side} (p)"
                                              for side in sides) + " |", "|---|---|" + "---|---|" * len(sides)]
    for (arm, budget), mine in sorted(units.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = []
        for side in sides:
            keys = [k for k in mine if k[2] == side and k in full]
            if not keys:
                cells += ["-", "-"]
                continue
            ratio, lo, hi = bootstrap_ratio([mine[k]["nll"] for k in keys], [full[k]["nll"] for k in keys])
            better = sum(mine[k]["nll"] < full[k]["nll"] for k in keys)
            worse = sum(mine[k]["nll"] > full[k]["nll"] for k in keys)
            cells += [f"{ratio:.2f} [{lo:.2f}, {hi:.2f}]", f"{better} of {len(keys)} (p = {sign_test(better, worse):.2g})"]
        lines.append(f"| {arm} | {budget:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def same_entries(records: list[dict], positions: dict[str, tuple[dict, str]], at: int, inside: list[dict]) -> str:
    """Markdown: per arm and budget, its NLL on the entries whose calls all lie past ``at`` (and, apart, all
    before it) against its NLL on the same entries' calls in ``inside``'s records (another run of the same
    chain seed: the same entries in other sessions), the entries paired where their call tokens are equal;
    and the turns of those entries whose free-running first call is right (name and arguments), here and there."""
    def per_entry(rs, where=None):
        out: dict[tuple, dict] = {}
        for r in rs:
            for e, turn, k, n, nll, _top1, _resident in r["calls"]:
                side = None if where is None else "past" if where[r["session_id"]][0][(e, turn, k)] >= at else "before"
                u = out.setdefault((r["arm"], r["budget"], r["entries"][e]),
                                   {"tokens": 0, "nll": 0.0, "sides": set(), "turns": 0, "right": 0})
                u["tokens"], u["nll"] = u["tokens"] + n, u["nll"] + nll
                u["sides"].add(side)
            for e, _turn, verdict in r["probes"]:
                u = out[(r["arm"], r["budget"], r["entries"][e])]
                u["turns"], u["right"] = u["turns"] + 1, u["right"] + verdict["args"]
        return out

    here, there = per_entry(records, positions), per_entry(inside)
    lines = [f"The same entries inside a shorter session: each arm's NLL on an entry whose calls all lie {{before, past}} "
             f"{at:,} here, as a ratio to its NLL on the same calls in the other run (equal call tokens).", "",
             "| arm | B | " + " | ".join(f"{side} {at:,}: entries, ratio | worse here (p) | first calls right, here / there"
                                     for side in ("before", "past")) + " |",
             "|---|---|" + "---|---|---|" * 2]
    for arm, budget in sorted({k[:2] for k in here}, key=lambda ab: (ab[1] or 0, ab[0] != "full", ab[0])):
        cells = []
        for side in ("before", "past"):
            keys = [k for k, u in here.items() if k[:2] == (arm, budget) and u["sides"] == {side}
                    and k in there and there[k]["tokens"] == u["tokens"]]
            if not keys:
                cells += ["-", "-", "-"]
                continue
            ratio = sum(here[k]["nll"] for k in keys) / sum(there[k]["nll"] for k in keys)
            worse = sum(here[k]["nll"] > there[k]["nll"] for k in keys)
            better = sum(here[k]["nll"] < there[k]["nll"] for k in keys)
            turns = sum(here[k]["turns"] for k in keys)
            right = f"{sum(here[k]['right'] for k in keys)} / {sum(there[k]['right'] for k in keys)} of {turns}" if turns else "-"
            cells += [f"{len(keys)}, {ratio:.2f}", f"{worse} of {len(keys)} (p = {sign_test(worse, better):.2g})", right]
        lines.append(f"| {arm} | {'-' if budget is None else f'{budget:,}'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from pace_bench.models import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default="bench/results/bfcl_chain/64k", type=Path)
    ap.add_argument("--at", type=int, default=32768, help="the token position calls are split at")
    ap.add_argument("--inside", type=Path, default=None,
                    help="a run of the same chain seed at a shorter length: its entries paired with these")
    args = ap.parse_args(argv)
    run = json.loads((args.dir / "run.json").read_text())
    records = read_jsonl(args.dir / "probes.jsonl")
    played = sorted({int(r["session_id"].rsplit("-", 1)[1]) for r in records})
    sessions = draw_chains(load_tokenizer(run["model"]), tokens=run["tokens"], sessions=played[-1] + 1,
                           seed=run["chain_seed"], system=run.get("system"))
    positions = {s.session_id: call_positions(s) for s in sessions}
    command = f"python bench/bfcl_chain_by_position.py {os.path.relpath(args.dir)} --at {args.at}"  # relative
    text = by_position(records, positions, args.at)
    if args.inside is not None:
        inside = read_jsonl(args.inside / "probes.jsonl")
        if json.loads((args.inside / "run.json").read_text())["chain_seed"] != run["chain_seed"]:
            raise SystemExit(f"bfcl_chain_by_position.py: --inside {args.inside} drew its chains with another seed")
        command += f" --inside {os.path.relpath(args.inside)}"
        text += "\n\n" + same_entries(records, positions, args.at, inside)
    text = f"`{command}`\n\n{text}"
    (args.dir / "by-position.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
