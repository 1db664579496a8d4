"""``bench/bfcl_chain_plans.py``, the table that sets PACE's variants (a plan, a limit) beside the arms of a
reference run, on real records: the dev chains' reference run (seed 1) as it is committed."""

import json
import shutil
from pathlib import Path

import pytest

from pace_bench.bfcl_chain import table

REF = Path(__file__).resolve().parent.parent / "bench" / "results" / "bfcl_chain" / "dev-seed1" / "ref"


@pytest.fixture
def plans(monkeypatch):
    monkeypatch.syspath_prepend("bench")
    import bfcl_chain_plans

    return bfcl_chain_plans


def rows(text: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in text.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_a_variant_is_set_beside_a_reference_held_elsewhere(plans, tmp_path):
    records = [json.loads(line) for line in (REF / "probes.jsonl").read_text().splitlines()]
    ref = tmp_path / "ref-elsewhere"
    shutil.copytree(REF, ref)
    with (ref / "probes.jsonl").open("a") as f:  # another budget's H2O, far worse: not this table's
        for r in records:
            if r["arm"] == "h2o":
                f.write(json.dumps(dict(r, budget=4096, calls=[c[:4] + [c[4] * 10] + c[5:] for c in r["calls"]])) + "\n")
    variant = tmp_path / "limits" / "pace-L40960"  # the reference's PACE records, as if played unbounded
    variant.mkdir(parents=True)
    run = json.loads((REF / "run.json").read_text())
    (variant / "run.json").write_text(json.dumps(dict(run, limit=40960, arms=["pace"])))
    (variant / "probes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if r["arm"] == "pace"))

    assert plans.main([str(tmp_path / "limits"), "--ref", str(ref)]) == 0
    got = rows((tmp_path / "limits" / "table.md").read_text())
    suite = rows(table(records))  # the suite's own table of the same records: the same ratios
    for arm in ("h2o", "snapkv"):
        assert got[arm][0].split()[0] == suite[arm][4].split()[0], arm
    bounded = "pace, plan (0.5, 0.25, 0.0), L = 8,192, compact"  # records from before the layout was recorded
    unbounded = "pace, plan (0.5, 0.25, 0.0), L = 40,960, never renumbers"
    assert got[bounded][0].split()[0] == suite["pace"][4].split()[0] and got[unbounded] == got[bounded]
    assert got["h2o"][2] == "-" and got["snapkv"][3] == "-"  # no column against StreamingLLM: not played
    assert set(got) == {"arm", "h2o", "snapkv", bounded, unbounded}

    assert plans.main([str(tmp_path / "limits"), "--ref", str(ref), "--budget", "4096"]) == 0  # that H2O alone
    other = rows((tmp_path / "limits" / "table-b4096.md").read_text())
    assert set(other) == {"arm", "h2o"} and float(other["h2o"][0].split()[0]) == pytest.approx(
        10 * float(got["h2o"][0].split()[0]), rel=1e-3)

    (ref / "probes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if r["arm"] != "full"))
    with pytest.raises(SystemExit, match="holds no full-cache records"):
        plans.main([str(tmp_path / "limits"), "--ref", str(ref)])
