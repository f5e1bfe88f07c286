"""The capacity model's arithmetic and its reading of committed results."""

from __future__ import annotations

import json

import pytest

from perf import capacity


def peers_run(points):
    return {"machine": "test", "points": [
        {"system": system, "profile": profile, "concurrency": c, "round": r, "throughput_per_s": t, "p99_ms": p,
         "errors": 0}
        for system, profile, c, r, t, p in points]}


def test_the_best_measured_point_that_meets_the_p99_is_the_capacity():
    run = peers_run([("coalesce", "q", 1, 0, 100, 10), ("coalesce", "q", 1, 1, 120, 12),
                     ("coalesce", "q", 16, 0, 300, 80), ("coalesce", "q", 16, 1, 320, 90),
                     ("coalesce", "q", 64, 0, 310, 260), ("other", "q", 16, 0, 900, 5)])
    points = capacity.measured_points(run)
    assert [(p.concurrency, p.rows_per_s, p.p99_ms) for p in points] == [(1, 110, 11), (16, 310, 85), (64, 310, 260)]
    assert capacity.capacity_at(points, "q", 100).concurrency == 16
    assert capacity.capacity_at(points, "q", 50).concurrency == 1
    assert capacity.capacity_at(points, "q", 5) is None


def test_replicas_round_up_at_the_headroom():
    assert capacity.replicas_needed(1000, 250, 1.0) == 4
    assert capacity.replicas_needed(1000, 250, 0.8) == 5
    assert capacity.replicas_needed(1, 250, 0.8) == 1
    with pytest.raises(ValueError, match="headroom"):
        capacity.replicas_needed(1000, 250, 0)


def test_the_shared_tier_saves_what_hits_cost_less():
    assert capacity.cost_per_row(0.0, 250, 4000) == 1.0
    assert capacity.cost_per_row(0.5, 250, 4000) == pytest.approx(0.5 + 0.5 / 16)
    with_tier = capacity.replicas_with_repeats(2000, 250, 1.0, 0.5, 250, 4000, shared_tier=True)
    without = capacity.replicas_with_repeats(2000, 250, 1.0, 0.5, 250, 4000, shared_tier=False)
    assert with_tier == 5  # 2000 * 0.53125 / 250 = 4.25
    # without the tier: 8 replicas find 0.5/8 of rows; 2000 * (1 - 0.0625 * 15/16) / 250 = 7.53 -> 8
    assert without == 8
    assert capacity.replicas_with_repeats(2000, 250, 1.0, 0.0, 250, 4000, shared_tier=True) == 8


def test_a_plan_from_the_committed_results_reads_and_reports(tmp_path):
    peers = json.loads(capacity.latest("peers-*.json").read_text())
    shared = json.loads(capacity.latest("shared-*.json").read_text())
    run = capacity.plan(peers, shared, rows_per_s=2000, p99_ms=100, headroom=0.8, repeat_rates=[0, 0.5],
                        profiles=["queries"])
    [entry] = run["profiles"]
    assert entry["meets_p99"] and entry["per_replica"]["p99_ms"] <= 100
    assert entry["repeats"][0]["with_tier"] == entry["repeats"][0]["without_tier"] == entry["replicas"]
    assert entry["repeats"][1]["with_tier"] < entry["repeats"][1]["without_tier"]
    text = capacity.markdown({"run": "t", "command": "c", "sources": {"peers": "p", "peers_machine": "m",
                                                                       "shared": "s"}, **run})
    assert f"Replicas for 2000 rows/s at p99 <= 100 ms: {entry['replicas']}" in text


def test_bad_arguments_are_refused_with_a_message(capsys):
    assert capacity.main(["--headroom", "1.5", "--run", "never"]) == 2
    assert "headroom" in capsys.readouterr().err


def test_bulk_and_online_cost_in_replica_hours_per_million_rows():
    [costs] = capacity.bulk_costs({"summary": [{"profile": "q", "bulk_rows_per_s": 500.0, "online_rows_per_s": 250.0}]})
    assert costs["bulk_replica_hours_per_1m"] == pytest.approx(1e6 / 500 / 3600)
    assert costs["online_replica_hours_per_1m"] == pytest.approx(2 * costs["bulk_replica_hours_per_1m"])
    text = capacity.markdown({"run": "t", "command": "c", "rows_per_s": 1, "p99_ms": 1, "headroom": 1, "profiles": [],
                              "sources": {"peers": "p", "peers_machine": "m", "shared": "s"}, "bulk": [costs]})
    assert "| q | 500.0 | 250.0 | 0.56 | 1.11 | 2.00x |" in text


def test_the_ray_model_adds_nodes_to_the_sending_rate_only():
    report = {"rows": 3000, "wall_s": 20.0, "send_s": 15.0, "merge_s": 0.03, "written": 3000, "output_rows": 3000}
    run = {"points": [{"profile": "q", "system": "bulk-ray", "rows_per_s": 150.0, "report": report},
                      {"profile": "q", "system": "bulk", "rows_per_s": 270.0, "report": {}}]}
    [entry] = capacity.ray_scaling(run, nodes=(1, 4), job_rows=(1e6,))
    assert entry["start_s"] == pytest.approx(4.97) and entry["node_rows_per_s"] == pytest.approx(200.0)
    assert entry["merge_s_per_row"] == pytest.approx(1e-5) and entry["local_rows_per_s"] == 270.0
    one, four = entry["table"]
    assert one["wall_s"] == pytest.approx(4.97 + 1e6 / 200 + 10.0)
    assert four["wall_s"] == pytest.approx(4.97 + 1e6 / 800 + 10.0)
    assert four["efficiency"] == pytest.approx(1e6 / four["wall_s"] / 800)
    assert capacity.ray_scaling({"points": [{"profile": "q", "system": "bulk", "rows_per_s": 1.0}]}) == []
