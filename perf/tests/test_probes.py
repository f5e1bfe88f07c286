import re

from perf import probe_floor, probe_queue_policy


def test_the_policy_variant_is_the_shipped_config_plus_the_policy():
    configs = probe_queue_policy.variants()
    assert set(configs) == {"shipped", "policy"}
    assert not re.search(r"^\s*default_queue_policy", configs["shipped"], flags=re.M)
    added = [line for line in configs["policy"].splitlines() if line not in configs["shipped"].splitlines()]
    assert added == [f"  {probe_queue_policy.POLICY}"]


def _point(**fields):
    return {"throughput_per_s": 100.0, "p50_ms": 5.0, "p99_ms": 9.0, "errors": 0, **fields}


def test_the_policy_report_counts_stalled_requests_over_rounds():
    points = [_point(round=r, variant=v, concurrency=c, successes=50, stalled=3 if v == "policy" else 0)
              for r in (0, 1) for v in ("shipped", "policy") for c in (1, 16)]
    text = probe_queue_policy.markdown({"date": "d", "command": "c", "machine": "m", "rounds": 2, "duration_s": 5.0,
                                        "concurrencies": [1, 16], "variants": ["shipped", "policy"],
                                        "points": points})
    assert "| policy | 16 | 100.0 | 5.0 | 9.0 | 6 of 100 |" in text
    assert "| shipped | 1 | 100.0 | 5.0 | 9.0 | 0 of 100 |" in text


def test_the_floor_report_sets_served_figures_beside_the_in_process_ones():
    points = [_point(round=0, workload=w, concurrency=c) for w in ("one text, cached", "distinct") for c in (1, 16)]
    points.append(_point(round=0, workload="distinct", concurrency=1, p50_ms=None))  # a point with no success
    text = probe_floor.markdown({"date": "d", "command": "c", "machine": "m", "rounds": 1, "duration_s": 5.0,
                                 "concurrencies": [1, 16], "points": points,
                                 "bare": {"p50_ms": 2.5, "mean_ms": 2.8}, "limit_at_16_texts_per_s": 540.0})
    assert "| one text, cached | 16 | 100.0 | 5.00 | 9.00 |" in text
    assert "| distinct | 1 | 100.0 | 5.00 | 9.00 |" in text  # the point without a success has no p50
    assert "bare one at a time p50 2.50 ms (mean 2.80); limit@16 540.0 texts/s" in text
