"""perf.peers' report of the shipped server: same-round ratios against each target, met or missed."""

from perf.peer_servers.peer_report import shipped_markdown, shipped_rows


def _point(r, system, concurrency, per_s, p50=5.0, p99=20.0):
    return {"round": r, "system": system, "profile": "queries", "concurrency": concurrency,
            "throughput_per_s": per_s, "p50_ms": p50, "p99_ms": p99, "errors": 0}


def test_the_shipped_server_is_judged_by_same_round_ratios():
    points = []
    for r, drift in enumerate((1.0, 0.5)):  # a slow round hits every system alike: ratios stay
        points += [_point(r, "coalesce", 1, 200 * drift, p50=4.0),
                   _point(r, "coalesce-shipped", 1, 190 * drift, p50=4.4),
                   _point(r, "coalesce", 16, 240 * drift), _point(r, "coalesce-shipped", 16, 228 * drift, p99=30.0),
                   _point(r, "coalesce-shipped-int8", 16, 228 * drift),
                   _point(r, "coalesce-shipped-fp32", 16, 140 * drift),
                   _point(r, "infinity-torch", 16, 80 * drift, p99=60.0)]
    run = {"points": points, "systems": ["coalesce", "coalesce-shipped", "coalesce-shipped-int8",
                                         "coalesce-shipped-fp32", "infinity-torch"],
           "references": {"queries": {"bare_p50_ms": [3.0, 3.0]}}}
    rows = {row["concurrency"]: row for row in shipped_rows(run, "queries")}
    assert abs(rows[16]["over_alone"] - 0.95) < 1e-9
    assert abs(rows[1]["p50_over_alone"] - 1.1) < 1e-9
    assert abs(rows[16]["over_infinity_torch"] - 2.85) < 1e-9 and rows[16]["p99_over_infinity_torch"] == 0.5
    assert abs(rows[16]["int8_over_fp32"] - 228 / 140) < 1e-9
    text = "\n".join(shipped_markdown(run, "queries"))
    assert "| 16 | 0.95 (met) | - | - | 2.85 (met) | 0.50 | 1.63 (met) |" in text
    assert "| 1 | 0.95 | 1.10 (met) | 1.47 | - | - | - |" in text


def test_no_shipped_server_no_section():
    run = {"points": [_point(0, "coalesce", 16, 100)], "systems": ["coalesce"], "references": {}}
    assert shipped_markdown(run, "queries") == []
