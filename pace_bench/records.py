"""A run's log: one JSON record per probe, in ``probes.jsonl`` (``probes.rank{N}.jsonl`` per process of
a sharded run, merged by the main process at the end). The runner writes and resumes it; the figures
and tables read it.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

BARRIER_TIMEOUT = timedelta(days=7)  # see process_state


def session_key(r: dict) -> tuple:
    """A session, in a row or a record: its id and its definition distance (a distance sweep builds
    session s0-0 once per D, with the same id)."""
    return r["session_id"], r.get("distance")


def pair_key(arm: str, r: dict) -> tuple:
    """An (arm, session) pair: the unit a run plays, resumes and shards."""
    return (arm, *session_key(r))


def read_jsonl(paths) -> list[dict]:
    """The records of the JSONL files ``paths`` (one path or several; missing files hold none), in
    order, each (arm, session, budget, probe) once: a record repeated in a later file is dropped (a run of
    several budgets plays each arm and session once per budget)."""
    paths = [paths] if isinstance(paths, (str, Path)) else paths
    records, seen = [], set()
    for path in map(Path, paths):
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                key = (*pair_key(r["arm"], r), r.get("budget"), r["probe"])
                if key not in seen:
                    seen.add(key)
                    records.append(r)
    return records


def write_jsonl(path: Path, records: list[dict]) -> None:
    """Replace ``path`` with ``records``, atomically (a run stopped meanwhile keeps the old file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


def process_state():
    """accelerate's ``PartialState``: this process's rank and device under ``accelerate launch`` (or
    torchrun), a single process otherwise. On a machine without CUDA the processes talk over gloo.
    Every suite shards its pairs with it and writes ``probes.rank{N}.jsonl`` (:func:`shard_paths`).

    The processes' group waits up to a week at a barrier, not torch's 30 minutes: at the end of a run a
    process that has played its last item waits there for the others' last, which can be hours (a 64K
    full-cache BFCL session). A process that dies is still seen at once: the launcher stops the others."""
    import torch
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available(),
                        timeout=BARRIER_TIMEOUT)


def shard_paths(out_dir: Path) -> list[Path]:
    """The per-process logs of a sharded run, ``probes.rank{N}.jsonl``, by rank."""
    return sorted(Path(out_dir).glob("probes.rank*.jsonl"),
                  key=lambda p: int(p.name.split(".")[1][4:]) if p.name.split(".")[1][4:].isdigit() else 1 << 30)


def run_records(run_dir: Path) -> list[dict]:
    """The records of the run in ``run_dir``: its ``probes.jsonl`` and the shards of a sharded run not
    merged yet (a resumed one holds both: the kept records, and what each process added). No record at
    all is an error."""
    run_dir = Path(run_dir)
    records = read_jsonl([run_dir / "probes.jsonl", *shard_paths(run_dir)])
    if not records:
        raise SystemExit(f"no probe records in {run_dir} (looked for probes.jsonl and probes.rank*.jsonl)")
    return records


def resumed_records(out_dir: Path, run: dict, keys, suite: str) -> list[dict]:
    """``--resume``: the records ``out_dir`` holds (its log and any shards), after refusing a run that was
    played with other values of ``keys`` in its ``run.json`` (a run must not mix settings, dtype included)."""
    out_dir = Path(out_dir)
    if (out_dir / "run.json").exists():
        before = json.loads((out_dir / "run.json").read_text())
        differ = [k for k in keys if before.get(k) != run.get(k)]
        if differ:
            raise SystemExit(f"pace-bench --suite {suite}: --resume: {out_dir} was played with other {', '.join(differ)}; "
                             "resume with the same settings (--dtype too), or use another --out")
    return read_jsonl([out_dir / "probes.jsonl", *shard_paths(out_dir)])
