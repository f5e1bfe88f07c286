"""perf.gateway's bookkeeping: ratios pair systems within a round, and the report states each target's verdict."""

from __future__ import annotations

from perf import gateway


def point(rnd: int, system: str, **values) -> dict:
    return {"round": rnd, "system": system, "errors": 0, **values}


def test_ratios_pair_the_two_systems_of_the_same_round_and_level():
    points = [point(0, "grpc", concurrency=16, texts_per_s=100.0),
              point(0, "gateway", concurrency=16, texts_per_s=95.0),
              point(1, "grpc", concurrency=16, texts_per_s=200.0),
              point(1, "gateway", concurrency=16, texts_per_s=170.0),
              point(1, "gateway", concurrency=64, texts_per_s=50.0)]  # no gRPC point to pair with: left out
    assert gateway.ratios(points, "texts_per_s", "gateway", "grpc", "concurrency") == {16: [0.95, 0.85]}


def test_the_report_says_met_or_missed_by_how_much():
    run = {"date": "2026-12-06", "command": "python -m perf.gateway", "setup": "setup", "concurrency": [16],
           "streams": [1], "max_tokens": 8, "documents": 4, "rerank_concurrency": 2, "rerank_note": "note",
           "notes": ["n"],
           "embeddings": [point(0, "grpc", concurrency=16, texts_per_s=100.0, p50_ms=1.0, p99_ms=2.0),
                          point(0, "gateway", concurrency=16, texts_per_s=80.0, p50_ms=1.0, p99_ms=3.0),
                          point(0, "infinity", concurrency=16, texts_per_s=20.0, p50_ms=5.0, p99_ms=9.0)],
           "chat": [point(0, "grpc", streams=1, tokens_per_s=10.0, ttft_p50_ms=100.0, ttft_p99_ms=120.0,
                          itl_p50_ms=90.0, itl_p99_ms=95.0),
                    point(0, "gateway", streams=1, tokens_per_s=9.5, ttft_p50_ms=101.5, ttft_p99_ms=125.0,
                          itl_p50_ms=91.0, itl_p99_ms=97.0)],
           "rerank": [point(0, "grpc", concurrency=2, pairs_per_s=40.0, p50_ms=1.0, p99_ms=2.0),
                      point(0, "gateway", concurrency=2, pairs_per_s=38.0, p50_ms=1.0, p99_ms=2.0)]}
    text = gateway.markdown(run)
    assert "0.80 (median 0.80)" in text and "missed by 0.10" in text  # gateway / gRPC against 0.9
    assert "4.00 (median 4.00)" in text and "met by +1.50" in text  # gateway / Infinity against 2.5
    assert "0.95 (median 0.95)" in text and "1.50 (median 1.50) (met)" in text  # tokens ratio; TTFT +1.5 ms
