import pytest

from coalesce_tools.perfanalyzer import stats_delta
from perf import report


def point(system, profile, concurrency, tput, p99, protocol="grpc"):
    return {"system": system, "profile": profile, "protocol": protocol, "concurrency": concurrency,
            "throughput_per_s": tput, "p50_ms": p99 / 2, "p95_ms": p99 * 0.9, "p99_ms": p99, "queue_ms": 1.0,
            "compute_input_ms": 0.1, "compute_infer_ms": 5.0, "compute_output_ms": 0.1, "avg_batch": 4.0,
            "batch_sizes": {"1": 3, "4": 10}}


RUN = {
    "run": "t", "machine": "test", "command": "make bench", "workloads": "w", "price_per_hour": 3.6,
    "protocols": ["grpc"],
    "points": [point("coalesce", "queries", 8, 300.0, 20.0), point("naive", "queries", 8, 200.0, 30.0),
               point("pytriton", "queries", 8, 150.0, 40.0),
               point("coalesce", "queries", 32, 400.0, 50.0)],
    "limits": {"queries": {"limit": 500.0, "limit_how": "sorted", "limit@8": 320.0, "limit@32": 420.0}},
}


def test_cost_per_million():
    # $3.60/hour at 1000/s: 3.6M inferences an hour -> $1 per million.
    assert report.cost_per_million(1000.0, 3.6) == pytest.approx(1.0)
    assert report.cost_per_million(0.0, 3.6) == float("inf")


def test_ratio_rows():
    rows = report.ratio_rows(RUN["points"], RUN["limits"], "grpc")
    assert [(r["concurrency"]) for r in rows] == [8, 32]
    first = rows[0]
    assert first["over_naive"] == pytest.approx(1.5)
    assert first["over_pytriton"] == pytest.approx(2.0)
    assert first["pytriton_p99_ms"] == 40.0
    assert first["over_limit_at_n"] == pytest.approx(300 / 320)
    assert first["over_limit"] == pytest.approx(0.6)
    assert rows[1]["over_naive"] is None  # no baseline points at N=32
    assert rows[1]["over_pytriton"] is None


def test_markdown_and_plots(tmp_path):
    paths = report.plot(RUN, tmp_path)
    assert all(p.is_file() and p.stat().st_size > 1000 for p in paths)
    text = report.markdown({**RUN, "plots": [str(p) for p in paths]})
    assert "| queries | 8 | 300.0 | 20.0 | 200.0 | 30.0 | 150.0 | 40.0 | 1.50 | 2.00 | 0.94 | 0.60 | 4.0 | - |" in text
    assert "t-throughput.png" in text


def test_stats_delta():
    def snap(execs, infers, queue_ns, sizes):
        return {"execution_count": execs, "inference_count": infers,
                "inference_stats": {"queue": {"count": infers, "ns": queue_ns},
                                    "compute_infer": {"count": infers, "ns": 2 * queue_ns}},
                "batch_stats": [{"batch_size": s, "compute_infer": {"count": c}} for s, c in sizes.items()]}

    delta = stats_delta(snap(2, 10, 10_000_000, {1: 1, 9: 1}), snap(5, 40, 70_000_000, {1: 1, 9: 1, 10: 3}))
    assert delta["avg_batch"] == 10
    assert delta["batch_sizes"] == {"10": 3}
    assert delta["queue_ms"] == pytest.approx(2.0)
    assert delta["compute_infer_ms"] == pytest.approx(4.0)


def test_ratios_are_medians_of_per_round_ratios():
    # The machine halves its speed in round 1: absolute figures move, same-round ratios do not.
    points = []
    for rnd, speed in enumerate((1.0, 0.5, 1.0)):
        for system, tput in (("coalesce", 300.0), ("naive", 200.0), ("pytriton", 100.0)):
            extra = {"limit_at_batch": 320.0 * speed} if system == "coalesce" else {}
            points.append({**point(system, "documents", 32, tput * speed, 40.0 / speed), "round": rnd, **extra})
    limits = {"documents": {"limit@32": [330.0, 165.0, 330.0], "limit": [400.0, 200.0, 400.0]}}
    (row,) = report.ratio_rows(points, limits, "grpc")
    assert row["rounds"] == 3
    assert row["over_naive"] == pytest.approx(1.5)
    assert row["over_pytriton"] == pytest.approx(3.0)
    assert row["over_limit_at_n"] == pytest.approx(300 / 330)
    assert row["over_limit"] == pytest.approx(0.75)
    assert row["over_limit_at_batch"] == pytest.approx(300 / 320)
    assert row["batch"] == 4.0
    assert row["coalesce_per_s"] == 300.0 and row["coalesce_p99_ms"] == 40.0


def test_summarize_merges_rounds():
    points = [{**point("coalesce", "queries", 8, t, 10.0), "round": r} for r, t in enumerate((100.0, 300.0, 200.0))]
    (merged,) = report.summarize(points)
    assert merged["throughput_per_s"] == 200.0 and merged["rounds"] == 3
    assert merged["batch_sizes"] == {"1": 9, "4": 30}


def test_median():
    assert report.median([]) is None
    assert report.median([3.0, 1.0, 2.0]) == 2.0
    assert report.median([4.0, 1.0, 2.0, 3.0]) == 2.5


def test_cache_rows_compare_cached_with_plain_in_the_same_rounds():
    points = []
    for rnd, speed in enumerate((1.0, 0.5)):
        points.append({**point("coalesce", "duplicates", 32, 100.0 * speed, 50.0), "round": rnd})
        points.append({**point("cached", "duplicates", 32, 400.0 * speed, 10.0), "round": rnd})
    points.append({**point("coalesce", "queries", 32, 100.0, 50.0), "round": 0})  # no cached twin: no row
    (row,) = report.cache_rows(points, "grpc")
    assert row["profile"] == "duplicates" and row["cached_over_coalesce"] == pytest.approx(4.0)
    text = report.markdown({**RUN, "points": points, "limits": {}})
    assert "## Row cache (grpc)" in text and "| duplicates | 32 | 75.0 | 300.0 | 10.0 | 4.00 |" in text
