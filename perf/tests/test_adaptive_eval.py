"""Pieces of the adaptive evaluation (perf/adaptive.py) that decide what the report says."""

import math

from perf.adaptive import c1_summary, p99_bound_ms, verdicts


def test_p99_bound_is_the_first_bucket_holding_99_percent():
    assert p99_bound_ms({0.1: 50, 0.2: 99, 0.3: 100, math.inf: 100}) == 200.0
    assert p99_bound_ms({0.1: 98, 0.2: 98, 0.5: 100, math.inf: 100}) == 500.0
    assert p99_bound_ms({0.1: 0, math.inf: 0}) is None


def run_with(c1_adaptive_ms, goodputs):
    runs = []
    for (shape, load), (static, adaptive) in goodputs.items():
        for system, goodput in (("static", static), ("adaptive", adaptive)):
            runs.append({"profile": "q", "system": system, "shape": shape, "load": load, "goodput_per_s": goodput})
    profiles = {"q": {"bare_compute_ms": 5.0, "adaptive_c1_over_bare": c1_adaptive_ms / 5.0, "static_c1_over_bare": 2.0,
                      "floor_c1_over_bare": 1.3, "adaptive_c1_over_floor": c1_adaptive_ms / 6.5}}
    return {"profiles": profiles, "runs": runs, "targets_ms": {"q": 200.0}}


def test_verdicts_judge_each_target_on_its_numbers():
    good = verdicts(run_with(5.5, {("steady", 1.0): (100, 120), ("steady", 2.0): (2, 115)}))
    assert good["q: c=1 p50 <= 1.2 x bare compute"]["met"]
    assert good["q: goodput >= static at every load"]["met"]
    assert good["q: goodput at 2x overload >= 0.9 x peak"]["met"]
    bad = verdicts(run_with(7.0, {("steady", 1.0): (100, 90), ("steady", 2.0): (2, 60)}))
    assert not bad["q: c=1 p50 <= 1.2 x bare compute"]["met"]
    assert bad["q: goodput >= static at every load"]["misses"] == ["steady x1.0: 90 < 100"]
    assert not bad["q: goodput at 2x overload >= 0.9 x peak"]["met"]


def test_c1_ratios_are_taken_within_each_round_then_the_median():
    # The machine slows by half in round 2: every time doubles, the ratios within it do not change.
    rounds = [{"bare": 5.0, "adaptive": 6.0, "floor": 5.5}, {"bare": 10.0, "adaptive": 12.0, "floor": 11.0},
              {"bare": 5.0, "adaptive": 7.0, "floor": 5.0}]
    figures = c1_summary(rounds)
    assert figures["bare_compute_ms"] == 5.0
    assert figures["adaptive_c1_p50_ms"] == 7.0
    assert figures["adaptive_c1_over_bare"] == 1.2  # median of 1.2, 1.2, 1.4 (a ratio of medians would say 1.4)
    assert figures["floor_c1_over_bare"] == 1.1
    assert math.isclose(figures["adaptive_c1_over_floor"], 12.0 / 11.0)
    assert "floor_c1_over_floor" not in figures and figures["c1_rounds"] == rounds
