"""The paper's Figures 1 and 3 from a run's records (issue 14 section 2)."""

import json

import numpy as np
import pandas as pd
import pytest

from pace_bench import figures
from pace_bench.figures import FIGURE_1, FIGURE_3, distance_groups, settings_for, title_for
from pace_bench.stats import wilson


def _rec(arm, sid, distance, passed, total=4, residency=1.0, gap=1000, target=None, context_len=49152):
    return {"arm": arm, "session_id": sid, "probe": f"p{passed}{total}", "distance": distance,
            "target_distance": target, "context_len": context_len, "checks_passed": passed, "checks_total": total,
            "recall_hits": passed, "recall_total": total, "residency": residency, "rotary_gap": gap}


def _sweep():
    """Two sessions at each of four D values: retention_only falls past 32K, pace stays, h2o at two D."""
    records = []
    for d in (2048, 16384, 32768, 47104):
        for s in range(2):
            sid, actual = f"s0-{s}", d - 7 * s
            records.append(_rec("pace", sid, actual, 4, gap=6000 + s, target=d))
            records.append(_rec("retention_only", sid, actual, 4 if d < 32768 else 0, gap=d + 400, target=d))
            if d in (2048, 47104):
                records.append(_rec("h2o", sid, actual, 0, residency=0.2, gap=None if s else d + 500, target=d))
    return records


def test_wilson_interval_matches_the_formula():
    low, high = wilson([40, 0, 4], [45, 45, 4])
    assert low[0] == pytest.approx(0.7650, abs=1e-3) and high[0] == pytest.approx(0.9520, abs=1e-3)
    assert low[1] == 0 and high[1] == pytest.approx(0.0787, abs=1e-3)
    assert high[2] == pytest.approx(1.0) and low[2] == pytest.approx(0.5101, abs=1e-3)
    assert tuple(np.concatenate(wilson([0], [0]))) == (0.0, 1.0)  # no trials: no information


def test_distance_groups_use_the_target_else_cluster_the_actual_distances():
    df = pd.DataFrame([{"distance": 16380, "target_distance": 16384}, {"distance": 48700, "target_distance": None},
                       {"distance": 48714, "target_distance": None}, {"distance": 48707, "target_distance": None},
                       {"distance": 8182, "target_distance": None}])
    assert distance_groups(df).tolist() == [16384, 48707, 48707, 48707, 8182]
    assert distance_groups(df.drop(columns="target_distance")).tolist() == [16380, 48707, 48707, 48707, 8182]


def test_settings_come_from_the_command_line_over_run_json(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"model": "qwen2.5-coder-0.5b", "budget": 2048, "limit": 8192,
                                                   "chunk": 4096}))
    assert settings_for(tmp_path, [], {"budget": 1024, "limit": None}) == {
        "model": "qwen2.5-coder-0.5b", "budget": 1024, "limit": 8192, "chunk": 4096}
    assert settings_for(tmp_path / "absent", [{"model": "m"}]) == {"model": "m"}


def test_title_names_model_b_l_h_session_length_and_n():
    title = title_for(pd.DataFrame(_sweep()), {"model": "qwen2.5-coder-0.5b", "budget": 2048, "limit": 8192,
                                               "chunk": 4096})
    assert "qwen2.5-coder-0.5b, B=2,048, L=8,192, H=4,096" in title
    assert "~48K-token sessions" in title and "8 sessions," in title and "n = 4-8 probes per arm" in title


def test_both_figures_are_drawn_for_a_sweep(tmp_path):
    paths = figures.make_figures(_sweep(), tmp_path, {"model": "qwen2.5-coder-0.5b", "budget": 2048})
    assert [p.name for p in paths] == [FIGURE_1, FIGURE_3] and all(p.stat().st_size > 10_000 for p in paths)


def test_figure_3_keeps_foresight_arms_at_full_residency_and_bins_the_gap(monkeypatch, tmp_path):
    pooled = []
    real = figures._pooled
    monkeypatch.setattr(figures, "_pooled", lambda df, by: pooled.append(real(df, by)) or pooled[-1])
    records = _sweep() + [_rec("pace", "s9", 100, 0, residency=0.5, gap=100),  # below full residency: left out
                          _rec("pace", "s9", 100, 0, residency=1.0, gap=None)]  # no gap: left out
    figures.figure_gap(records, {}, tmp_path / FIGURE_3)
    g = pooled[-1].set_index(["arm", "bin"])
    assert set(g.index.get_level_values("arm")) == {"pace", "retention_only"}  # h2o is not of the family
    assert g.loc[("pace", "0-8K"), "probes"] == 8 and g.loc[("pace", "0-8K"), "passed"] == 32
    assert g.loc[("retention_only", "0-8K"), "probes"] == 2
    assert ("retention_only", "8-16K") not in g.index
    assert g.loc[("retention_only", "16-32K"), "probes"] == 2  # 16,784
    assert g.loc[("retention_only", ">32K"), "probes"] == 4 and g.loc[("retention_only", ">32K"), "passed"] == 0


def test_the_cli_regenerates_the_figures_of_a_run_dir(tmp_path, capsys):
    (tmp_path / "probes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _sweep()))
    assert figures.main([str(tmp_path), "--model", "qwen2.5-coder-0.5b", "--budget", "2048", "--limit", "8192",
                         "--chunk", "4096"]) == 0
    out = capsys.readouterr()
    assert FIGURE_1 in out.out and FIGURE_3 in out.out and "unknown" not in out.err
    assert (tmp_path / FIGURE_1).exists() and (tmp_path / FIGURE_3).exists()
    figures.main([str(tmp_path), "--out", str(tmp_path / "again")])  # no settings: a warning, '?' in the titles
    assert "model, budget, limit, chunk unknown" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no probe records"):
        figures.main([str(tmp_path / "again")])


def test_the_cli_draws_several_runs_of_one_setting_as_one(tmp_path, capsys):
    """A sweep and an arm run later at two of its distances: one table, one pair of figures."""
    sweep = [r for r in _sweep() if r["arm"] != "h2o"]
    h2o = [r for r in _sweep() if r["arm"] == "h2o"]
    settings = {"model": "qwen2.5-coder-0.5b", "budget": 2048, "limit": 8192, "chunk": 4096}
    for name, records in (("sweep", sweep), ("h2o", h2o)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "probes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (tmp_path / name / "run.json").write_text(json.dumps(settings))
    with pytest.raises(SystemExit):  # where would the merged figures go?
        figures.main([str(tmp_path / "sweep"), str(tmp_path / "h2o")])
    assert "--out" in capsys.readouterr().err
    assert figures.main([str(tmp_path / "sweep"), str(tmp_path / "h2o"), "--out", str(tmp_path / "all")]) == 0
    table = (tmp_path / "all" / "table.md").read_text()
    assert "| h2o | 0/16 (0%)" in table and "| pace | 32/32 (100%)" in table
    assert "| retention_only | 16/32 (50%)" in table
    assert "| 46K | 2 | 0/8 (0%)" in table.split("By definition distance D")[1]
    assert (tmp_path / "all" / FIGURE_1).exists() and (tmp_path / "all" / FIGURE_3).exists()
    (tmp_path / "h2o" / "run.json").write_text(json.dumps(dict(settings, budget=1024)))
    with pytest.raises(SystemExit, match="differ in budget"):
        figures.main([str(tmp_path / "sweep"), str(tmp_path / "h2o"), "--out", str(tmp_path / "all")])


def test_the_distance_table_has_a_row_per_d_and_a_column_per_arm():
    lines = figures.distance_table(_sweep()).splitlines()
    assert lines[0] == "| D | sessions | h2o | retention_only | pace |"
    assert lines[2].startswith("| 2K | 2 | 0/8 (0%), gap 2.5K | 8/8 (100%), gap 2.4K | 8/8 (100%), gap 5.9K |")
    assert lines[3] == "| 16K | 2 | - | 8/8 (100%), gap 16.4K | 8/8 (100%), gap 5.9K |"  # h2o not run there
    assert lines[5].startswith("| 46K | 2 | 0/8 (0%), gap 46.5K | 0/8 (0%)")  # one h2o probe had no gap: left out


def test_every_registered_arm_is_told_apart_in_the_registry_order():
    from pace_bench.arms import ARMS, FORESIGHT_ARMS

    styles = {(figures.arm_style(a)["color"], figures.arm_style(a)["marker"]) for a in ARMS}
    assert len(styles) == len(ARMS)  # every arm is told apart
    assert figures._arms(pd.DataFrame({"arm": ["pace", "new_arm", "h2o", "full"]})) == ["full", "h2o", "pace", "new_arm"]
    assert set(FORESIGHT_ARMS) == {"retention_only", "pace", "snapkv_foresight"}


def _point(passed_per_probe, recall=(1, 1), residency=1.0):
    return [dict(_rec("pace", "s2-0", 6144, p, total=5, residency=residency), probe=f"p{i}",
                 recall_hits=recall[0], recall_total=recall[1]) for i, p in enumerate(passed_per_probe)]


def test_the_robustness_curve_pools_each_point_and_draws_the_reference(tmp_path):
    points = {(0.0, False): _point([5, 5, 5]), (0.0, True): _point([5, 5, 4]),
              (1.0, False): _point([0, 0, 1], recall=(0, 1), residency=0.1), (1.0, True): _point([5, 3, 0]),
              (0.5, False): []}  # not run yet: no row
    h2o = [dict(r, arm="h2o") for r in _point([0, 0, 0], recall=(0, 1), residency=0.05)]
    table = figures.robustness_table(points, h2o).splitlines()
    assert len(table) == 2 + 4 + 1
    assert table[2] == "| 0 | no | 15/15 (100%) | 3/3 | 100% | 1.000 |"
    assert table[4] == "| 1 | no | 1/15 (7%) | 0/3 | 0% | 0.100 |"
    assert table[5] == "| 1 | yes | 8/15 (53%) | 1/3 | 100% | 1.000 |"
    assert table[6].startswith("| (h2o) | - | 0/15 (0%) | 0/3 | 0% |")
    path = figures.figure_robustness(points, {"model": "qwen2.5-coder-0.5b", "budget": 2048}, tmp_path / "r.png", h2o)
    assert path.stat().st_size > 10_000
