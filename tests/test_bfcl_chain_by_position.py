"""``bench/bfcl_chain_by_position.py``, the arms' call NLL split by where a call sits in its session, on real
records: the first two 32K sessions of seed 0 as they are committed, drawn again with the real tokenizer."""

import json
import shutil
from pathlib import Path

import pytest

from pace_bench.bfcl_chain import bootstrap_ratio, units

RUN = Path(__file__).resolve().parent.parent / "bench" / "results" / "bfcl_chain" / "32k"
SESSIONS = ("chain0-0", "chain0-1")


@pytest.fixture
def by_position(monkeypatch):
    monkeypatch.syspath_prepend("bench")
    import bfcl_chain_by_position

    return bfcl_chain_by_position


@pytest.fixture
def run_dir(tmp_path):
    out = tmp_path / "32k"
    out.mkdir()
    shutil.copy(RUN / "run.json", out)
    lines = [line for line in (RUN / "probes.jsonl").read_text().splitlines()
             if json.loads(line)["session_id"] in SESSIONS and json.loads(line)["budget"] in (None, 2048)]
    (out / "probes.jsonl").write_text("\n".join(lines) + "\n")
    return out


def rows(text: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in text.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_the_rebuilt_trajectories_are_the_records_and_every_call_has_its_place(by_position, run_dir):
    from pace_bench.bfcl_chain import draw_chains
    from pace_bench.models import load_tokenizer

    run = json.loads((run_dir / "run.json").read_text())
    records = [json.loads(line) for line in (run_dir / "probes.jsonl").read_text().splitlines()]
    sessions = draw_chains(load_tokenizer(run["model"]), tokens=run["tokens"], sessions=len(SESSIONS),
                           seed=run["chain_seed"], system=run.get("system"))
    for session in sessions:
        at_call, digest = by_position.call_positions(session)
        mine = [r for r in records if r["session_id"] == session.session_id]
        assert mine and all(r["trajectory"] == digest for r in mine)
        calls = [tuple(c[:3]) for c in mine[0]["calls"]]
        assert sorted(at_call) == sorted(calls)  # every scored call, and only those, has a place
        places = [at_call[c] for c in calls]  # in the trajectory's order, after the system message, inside it
        assert places == sorted(places) and len(set(places)) == len(places)
        assert len(session.template.system_ids) < places[0] and places[-1] < mine[0]["tokens"]

    # split at 0, every call is past it: the ratios are the whole records' (the suite's own units)
    text = by_position.by_position(records, {s.session_id: by_position.call_positions(s) for s in sessions}, 0)
    got = rows(text)
    full = {k: u for r in records if r["arm"] == "full" for k, u in units(r).items()}
    for arm in ("h2o", "pace", "snapkv"):
        mine = {k: u for r in records if r["arm"] == arm for k, u in units(r).items()}
        ratio = bootstrap_ratio([mine[k]["nll"] for k in full], [full[k]["nll"] for k in full])[0]
        assert got[arm][1] == "-" and got[arm][3].startswith(f"{ratio:.2f} ["), arm
    assert "before 0:" not in text


def test_the_command_writes_its_tables_and_refuses_records_of_other_sessions_or_seeds(by_position, run_dir):
    assert by_position.main([str(run_dir), "--at", "24576"]) == 0
    text = (run_dir / "by-position.md").read_text()
    lines = [line for line in text.splitlines() if line.startswith("- ")]
    tokens = [int(line.split(" call tokens")[0].rsplit(" ", 1)[1].replace(",", "")) for line in lines]
    records = [json.loads(line) for line in (run_dir / "probes.jsonl").read_text().splitlines()]
    full = [r for r in records if r["arm"] == "full"]
    assert len(lines) == 2 and sum(tokens) == sum(c[3] for r in full for c in r["calls"])  # every call on one side
    assert text.startswith("`python bench/bfcl_chain_by_position.py ") and " /" not in text.split("\n")[0]  # relative

    # a run paired with itself: every entry wholly on one side is its own pair, at a ratio of 1
    assert by_position.main([str(run_dir), "--at", "24576", "--inside", str(run_dir)]) == 0
    paired = rows((run_dir / "by-position.md").read_text().split("The same entries")[1])
    for arm in ("full", "h2o", "pace", "snapkv", "streaming", "pace_retrieval"):
        for entries_ratio, worse, right in (paired[arm][1:4], paired[arm][4:7]):
            n = int(entries_ratio.split(",")[0])
            assert entries_ratio.endswith(", 1.00") and worse == f"0 of {n} (p = 1)", arm
            here, there = right.split(" of ")[0].split(" / ")
            assert here == there, arm
    other = run_dir.parent / "seed1"
    shutil.copytree(run_dir, other)
    run = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps(dict(run, chain_seed=1)))
    with pytest.raises(SystemExit, match="another seed"):
        by_position.main([str(run_dir), "--inside", str(other)])

    swapped = [dict(r, trajectory=full[1]["trajectory"]) if r["session_id"] == "chain0-0" and r["arm"] == "pace" else r
               for r in records]
    (run_dir / "probes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in swapped))
    with pytest.raises(SystemExit, match="another trajectory"):
        by_position.main([str(run_dir)])
