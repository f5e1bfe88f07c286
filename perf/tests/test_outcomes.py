import pytest

from perf.outcomes import Outcome, assign_tenants, parse_shares, percentile, summarize_outcomes


def test_parse_shares_and_seeded_assignment():
    shares = parse_shares("noisy:10, quiet-a:1,quiet-b:1")
    assert shares == {"noisy": 10.0, "quiet-a": 1.0, "quiet-b": 1.0}
    first = assign_tenants(1200, shares, seed=3)
    assert first == assign_tenants(1200, shares, seed=3)
    assert 900 < first.count("noisy") < 1100
    assert assign_tenants(5, {}, seed=0) == []
    for bad in ("noisy", "a:0", "a:-1", ":2", "a:x"):
        with pytest.raises(ValueError, match="--tenants entry"):
            parse_shares(bad)


def test_goodput_counts_answers_within_target_and_refusals_are_not_good():
    outcomes = [Outcome(0.1, "a", 50.0, "ok"), Outcome(0.2, "a", 250.0, "ok"), Outcome(0.3, "b", 10.0, "rejected"),
                Outcome(0.4, "b", 20.0, "ok"), Outcome(0.5, "b", 5.0, "error")]
    summary = summarize_outcomes(outcomes, duration_s=2.0, target_ms=200.0)
    assert summary["goodput_per_s"] == 1.0  # two answers within 200 ms, over 2 s
    assert (summary["ok"], summary["rejected"], summary["errors"]) == (3, 1, 1)
    assert summary["within_target"] == 0.4
    assert summary["tenants"]["a"]["ok_p99_ms"] == 250.0 and summary["tenants"]["b"]["rejected"] == 1
    assert percentile([], 0.5) == 0.0
