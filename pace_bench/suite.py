"""The skeleton a pace-bench suite runs on: its records, its resume, its processes and its table.

A suite is a list of work items (a context or an entry, with an arm) and a ``play`` that turns one item
into records; what this module does is the same for every suite, so no suite copies it:
- ``probes.jsonl`` in ``--out`` holds every record; ``--resume`` keeps the records of a run with the same
  settings (the suite decides which are kept) and plays only what is missing;
- ``run.json`` holds the settings, written before the first new item starts;
- under ``accelerate launch`` a process takes the next item nobody has taken whenever it is free
  (:func:`claim_in_order`: one item of hours among items of minutes leaves no process idle while
  another still has a queue), writes ``probes.rank{N}.jsonl``, and the main process merges them in
  the order of the items;
- one store serves every item (host memory unless the suite builds its own; an arm with tiers spills there);
- the table (``table.md``) is written by the suite's ``finish(records)`` once every process is done
  (:func:`table_writer` makes the usual one: the settings, then the table).

``play_all`` is the loop; the coding runner, RULER, the repository suite and BFCL run on it.
``command_line`` is every suite's start (its arguments parsed and checked, or ``--report`` served;
``check_limit`` is the check every suite with bounded arms makes), and
``played`` reads back what a run wrote, for ``--report``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

from pace_hf.cache import DEFAULT_RECENT, DEFAULT_SINKS

from .progress import clock, on_terminal, time_left
from .records import process_state, read_jsonl, shard_paths, write_jsonl


def play_all(out_dir: Path, run: dict, kept: list[dict], work: list, play: Callable[[object, object], Iterable[dict]],
             *, rank: Callable[[dict], tuple], describe: Callable[[dict], str], desc: str,
             finish: Callable[[list[dict]], None], new_store: Callable[[], object] | None = None) -> list[dict]:
    """Play ``work`` (the items not yet in ``kept``), writing each record as it comes; returns every record.

    ``play(item, store)`` yields the item's records; ``rank(record)`` orders the merged records (the items'
    order); ``describe(record)`` is the progress line; ``finish(records)`` writes the table
    (main process only); ``new_store()`` builds the store the items share (default: host memory; it may
    return None: no store)."""
    from tqdm.auto import tqdm

    from pace_hf.tiers import HostTier, TieredStore

    state = process_state()
    sharded = state.num_processes > 1
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "probes.jsonl"
    records = list(kept)
    state.wait_for_everyone()
    if state.is_main_process:
        write_jsonl(log_path, records)  # the kept records are on disk before the first new item starts
        for path in shard_paths(out_dir):
            path.unlink()
        (out_dir / "run.json").write_text(json.dumps(run, indent=1) + "\n")
        if sharded:
            claims_path(out_dir).write_text("")  # nothing taken yet: a resumed run plays what the records lack
    state.wait_for_everyone()
    shard = out_dir / f"probes.rank{state.process_index}.jsonl" if sharded else log_path
    store = new_store() if new_store is not None else TieredStore([HostTier()])
    try:
        with open(shard, "w" if sharded else "a") as log:
            mine = claim_in_order(work, claims_path(out_dir), state.process_index) if sharded else enumerate(work)
            label = desc + (f" (process {state.process_index})" if sharded else "")
            started = time.monotonic()
            # off a terminal the bar is off (a log keeps its every redraw): a line per item says the same
            for done, (at, item) in enumerate(tqdm(mine, total=None if sharded else len(work), desc=label, unit="item",
                                                   position=state.process_index, disable=not on_terminal()), 1):
                for r in play(item, store):
                    if sharded:
                        r["process"] = state.process_index
                    log.write(json.dumps(r) + "\n")
                    log.flush()
                    records.append(r)
                    tqdm.write((f"[{state.process_index}] " if sharded else "") + describe(r))
                if not on_terminal():  # the items after this one, shared by the processes at this one's rate
                    elapsed, after = time.monotonic() - started, (len(work) - at - 1) / state.num_processes
                    count = f"{done} (item {at + 1} of {len(work)})" if sharded else f"{done}/{len(work)}"
                    tqdm.write(f"{label}: {count} done in {clock(elapsed)}, ~{time_left(elapsed, done, done + after)} left",
                               file=sys.stderr)
    finally:
        if store is not None:
            store.close()
    state.wait_for_everyone()
    if state.is_main_process:
        if sharded:  # the kept records and each process's, in the items' order
            records = sorted(read_jsonl([log_path, *shard_paths(out_dir)]), key=rank)
            write_jsonl(log_path, records)
            for path in shard_paths(out_dir):
                path.unlink()
            claims_path(out_dir).unlink(missing_ok=True)
        finish(records)
    state.wait_for_everyone()
    return records


def claims_path(out_dir: Path) -> Path:
    """Where a sharded run's processes take their items (one line an item taken, in order)."""
    return out_dir / "claims"


def claim_in_order(work: list, path: Path, who: int):
    """``(index, item)`` of ``work``, each to the first process that asks: the next item nobody has taken,
    under an exclusive lock on ``path`` (``flock``: every process of the run sees one count). Every process
    holds the same ``work``, as it computed it from the same records."""
    while True:
        with open(path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            f.seek(0)
            taken = len(f.read().splitlines())
            if taken >= len(work):
                return
            f.write(f"{taken} {who}\n")
        yield taken, work[taken]


def command_line(argv, build_parser: Callable[[], argparse.ArgumentParser],
                 check_args: Callable[[argparse.ArgumentParser, argparse.Namespace], None],
                 report: Callable[[Path, dict, list[dict]], None] | None = None, *, suite: str = "",
                 what: str = "records") -> argparse.Namespace | None:
    """A suite's arguments, parsed and checked; None once ``--report`` is served: ``report(out_dir, run,
    records)`` rewrote the table of what ``--out`` holds (:func:`played`; ``suite`` and ``what`` name it in
    the refusal of a folder without a run), and nothing is played. A run plays offline: its model comes
    from the local cache, never the Hub."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if report is not None and args.report:
        out_dir = Path(args.out)
        records, run = played(out_dir, suite, what)
        report(out_dir, run, records)
        return None
    check_args(ap, args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return args


def check_budget(ap: argparse.ArgumentParser, budgets: list[int], budget_flag: str = "--budget") -> None:
    """Refuses (``ap.error``) a budget under the sink and recent tokens every evicting arm protects (the
    caches' defaults), before anything loads."""
    small = [b for b in budgets if b < DEFAULT_SINKS + DEFAULT_RECENT]
    if small:
        ap.error(f"{budget_flag} {small[0]} cannot hold the {DEFAULT_SINKS} sink and {DEFAULT_RECENT} recent tokens the "
                 "arms protect")


def check_limit(ap: argparse.ArgumentParser, bounded: list[str], limit: int, budget: int, chunk: int,
                budget_flag: str = "--budget") -> None:
    """Refuses (``ap.error``) bounded arms whose limit cannot hold a budget and a chunk (L > B + H): a renumber
    leaves the residents below B and the next chunk must fit above them. The chunk is the run's, not the
    cache's (a cache sees it only when the forward brings it, after the model has loaded), so a suite checks
    it here, before anything loads; ``budget`` is the largest the run plays (``budget_flag`` names it)."""
    if bounded and limit <= budget + chunk:
        ap.error(f"bounded arms ({', '.join(bounded)}) need --limit > {budget_flag} + --chunk (L > B + H): "
                 f"{limit} <= {budget} + {chunk}")


def table_writer(header: Callable[[dict], str], table: Callable[[list[dict]], str]) -> Callable[[Path, dict, list[dict]], None]:
    """A suite's ``write_table(out_dir, run, records)``, used at the run's end and for ``--report``: writes
    ``table.md`` (and prints it): ``header(run)``, the settings, then ``table(records)``."""
    def write_table(out_dir: Path, run: dict, records: list[dict]) -> None:
        text = header(run) + "\n\n" + table(records)
        (out_dir / "table.md").write_text(text + "\n")
        print(text)
    return write_table


def played(out_dir: Path, suite: str, what: str) -> tuple[list[dict], dict]:
    """``--report``'s input: every record ``out_dir`` holds (the merged log and any process's shard) and
    the run's settings; a folder without both is refused, naming ``what`` its records are."""
    records = read_jsonl([p for p in [out_dir / "probes.jsonl", *shard_paths(out_dir)] if p.exists()])
    if not records or not (out_dir / "run.json").exists():
        raise SystemExit(f"pace-bench --suite {suite} --report: {out_dir} holds no {what} (probes.jsonl) and "
                         "run.json of a run")
    return records, json.loads((out_dir / "run.json").read_text())


__all__ = ["claim_in_order", "command_line", "play_all", "played", "table_writer"]
