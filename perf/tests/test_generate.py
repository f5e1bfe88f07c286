import math

import pytest

from perf import generate
from perf.generate import RequestRecord

WORDS = [f"w{i}" for i in range(500)]


def count_words(text: str) -> int:
    return len(text.split())


def trace(**kwargs):
    options = {"rate_per_s": 4.0, "seed": 3, "count_tokens": count_words, "words": WORDS}
    options.update(kwargs)
    return generate.make_trace(400, **options)


def test_trace_is_seeded():
    assert trace() == trace()
    assert trace() != trace(seed=4)


def test_trace_lengths_and_arrivals():
    requests = trace()
    assert [r.index for r in requests] == list(range(400))
    assert all(8 <= r.prompt_tokens <= 200 and r.prompt_tokens == count_words(r.prompt) for r in requests)
    assert all(8 <= r.max_tokens <= 128 for r in requests)
    assert len({r.max_tokens for r in requests}) > 50  # mixed, not one length
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert 0.8 / 4.0 < arrivals[-1] / len(arrivals) < 1.2 / 4.0  # Poisson at 4/s: mean gap 0.25 s
    # log-uniform: more short prompts than long ones
    assert sum(r.prompt_tokens < 40 for r in requests) > sum(r.prompt_tokens > 160 for r in requests)


def test_shared_prefix():
    requests = trace()
    shared = [r for r in requests if r.shared_prefix]
    assert 0.1 < len(shared) / len(requests) < 0.4
    prefix = shared[0].prompt.split()[:48]
    assert all(r.prompt.split()[:48] == prefix for r in shared)
    assert len({r.prompt for r in requests}) > 390


def test_percentile():
    assert generate.percentile([], 50) is None
    assert generate.percentile([5.0], 99) == 5.0
    assert generate.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert generate.percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert generate.percentile([3.0, 1.0, 2.0], 100) == 3.0


def record(index, *, sent, tokens, max_tokens=3, error=""):
    return RequestRecord(index=index, max_tokens=max_tokens, prompt_tokens=10, scheduled_s=sent - 0.5, sent_s=sent,
                         token_times_s=tokens, responses=len(tokens), done_s=tokens[-1] if tokens else math.nan,
                         error=error)


def test_request_metrics_from_send_or_arrival():
    r = record(0, sent=1.0, tokens=[1.1, 1.3, 1.6])
    closed = generate.request_metrics(r, from_arrival=False)
    assert closed["ttft_s"] == pytest.approx(0.1)
    assert closed["itl_s"] == pytest.approx([0.2, 0.3])
    assert closed["e2e_s"] == pytest.approx(0.6)
    assert generate.request_metrics(r, from_arrival=True)["ttft_s"] == pytest.approx(0.6)


def test_summarize_counts_finished_requests_only():
    records = [record(0, sent=0.0, tokens=[0.1, 0.2, 0.3]), record(1, sent=0.0, tokens=[0.2, 0.4, 0.6, 0.8],
                                                                   max_tokens=4),
               record(2, sent=0.0, tokens=[0.1], error="UNAVAILABLE")]
    summary = generate.summarize(records, wall_s=1.0, from_arrival=False, price_per_hour=3.6)
    assert summary["finished"] == 2 and summary["errors"] == 1
    assert summary["generated_tokens"] == 7 and summary["tokens_per_s"] == pytest.approx(7.0)
    assert summary["ttft_p50_ms"] == pytest.approx(150.0)
    assert summary["itl_p50_ms"] == pytest.approx(200.0)
    assert summary["cost_per_m_tokens"] == pytest.approx(3.6 / (7.0 * 3600) * 1e6)


def point(round_index, system, tokens_per_s, ttft_p99_ms, mode="closed"):
    return {"round": round_index, "system": system, "mode": mode, "tokens_per_s": tokens_per_s,
            "ttft_p99_ms": ttft_p99_ms, "errors": 0}


def test_ratios_are_medians_of_same_round_ratios_and_targets():
    points = []
    for r, (cont, static, single) in enumerate([(100.0, 50.0, 20.0), (200.0, 160.0, 50.0), (90.0, 45.0, 30.0)]):
        points += [point(r, "continuous", cont, 10.0), point(r, "static", static, 20.0 if r else 5.0),
                   point(r, "single", single, 100.0)]
    (row,) = generate.ratio_rows(points)
    assert row["mode"] == "closed" and row["rounds"] == 3
    assert row["per_round_over_single"] == pytest.approx([5.0, 4.0, 3.0])
    assert row["over_single"] == pytest.approx(4.0)
    assert row["over_static"] == pytest.approx(2.0)  # rounds: 2.0, 1.25, 2.0
    assert row["ttft_p99_over_static"] == pytest.approx(0.5)  # rounds: 2.0, 0.5, 0.5
    assert row["continuous_tokens_per_s"] == pytest.approx(100.0)
    met = {t["key"]: t["met"] for t in generate.targets(row)}
    assert met == {"over_single": True, "over_static": True, "ttft_p99_over_static": True}
    row["over_static"] = 1.2
    assert not {t["key"]: t["met"] for t in generate.targets(row)}["over_static"]


def test_system_configs_differ_only_in_batching():
    shipped = (generate.TINYLM / "config.pbtxt").read_text()
    assert generate.system_config(shipped, "continuous") == shipped
    static = generate.system_config(shipped, "static", static_delay_us=500)
    assert 'name: "tinylm_static"' in static and "max_batch_size: 16" in static
    assert "max_queue_delay_microseconds: 500" in static
    assert '{ key: "generation_batching", value: { string_value: "request" } }' in static
    assert '{ key: "max_active_sequences", value: { string_value: "16" } }' in static
    single = generate.system_config(shipped, "single")
    assert 'name: "tinylm_single"' in single and "max_batch_size: 0" in single and "dynamic_batching" not in single
    assert '{ key: "max_active_sequences", value: { string_value: "1" } }' in single
    assert '{ key: "kv_cache_bytes", value: { string_value: "67108864" } }' in single
    with pytest.raises(ValueError):
        generate.system_config(shipped, "nope")


def test_repository_links_the_weights(tmp_path):
    generate.build_repository(tmp_path)
    for model in generate.MODELS.values():
        hf = tmp_path / model / "1" / "hf"
        assert hf.is_symlink() and hf.resolve() == (generate.TINYLM / "1" / "hf").resolve()
        assert (tmp_path / model / "config.pbtxt").is_file()
