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
    shipped = (generate.SMOLLM2 / "config.pbtxt").read_text()
    kv_bytes = generate.shipped_parameter(shipped, "kv_cache_bytes")
    assert kv_bytes and kv_bytes.isdigit()
    assert generate.system_config(shipped, "continuous") == shipped
    static = generate.system_config(shipped, "static", static_delay_us=500)
    assert 'name: "smollm2_static"' in static and "max_batch_size: 16" in static
    assert "max_queue_delay_microseconds: 500" in static
    assert generate.shipped_parameter(static, "generation_batching") == "request"
    assert generate.shipped_parameter(static, "max_active_sequences") == "16"
    single = generate.system_config(shipped, "single")
    assert 'name: "smollm2_single"' in single and "max_batch_size: 0" in single and "dynamic_batching" not in single
    assert generate.shipped_parameter(single, "max_active_sequences") == "1"
    assert generate.shipped_parameter(single, "kv_cache_bytes") == kv_bytes
    for system in ("nope", "llama-server"):
        with pytest.raises(ValueError):
            generate.system_config(shipped, system)


def test_repository_links_the_weights(tmp_path):
    generate.build_repository(tmp_path)
    for model in generate.MODELS.values():
        hf = tmp_path / model / "1" / "hf"
        assert hf.is_symlink() and hf.resolve() == (generate.SMOLLM2 / "1" / "hf").resolve()
        assert (tmp_path / model / "config.pbtxt").is_file()


def test_fixed_modes():
    assert generate.fixed_modes("16:32,1:4") == [(16, 32), (1, 4)]
    assert generate.fixed_modes("8") == [(8, 16)]
    with pytest.raises(ValueError):
        generate.fixed_modes("0:4")


def test_llama_server_context_holds_the_longest_request_in_every_slot(tmp_path):
    requests = trace()[:20]
    per_slot = generate.context_per_slot([requests])
    longest = max(r.prompt_tokens for r in requests) + max(r.max_tokens for r in requests)
    assert per_slot % 256 == 0 and longest + 32 <= per_slot < longest + 32 + 256
    command = generate.llama_server_command(tmp_path / "llama-server", tmp_path / "m.gguf", port=1234, slots=16,
                                            context_per_slot=per_slot, threads=2)
    def flag(name):
        return command[command.index(name) + 1]

    assert flag("--parallel") == "16" and flag("--ctx-size") == str(16 * per_slot)
    assert flag("--threads") == "2" and flag("--host") == "127.0.0.1" and "--cont-batching" in command


def test_ratios_and_targets_against_llama_server():
    points = []
    for r, (cont, llama) in enumerate([(120.0, 200.0), (130.0, 100.0), (110.0, 110.0)]):
        for mode, scale in (("fixed-16", 1.0), ("fixed-1", 0.2)):
            points += [{**point(r, "continuous", cont * scale, 50.0, mode=mode), "streams": 16, "ttft_p50_ms": 10.0,
                        "itl_p50_ms": 20.0, "itl_p99_ms": 40.0},
                       {**point(r, "llama-server", llama * scale, 100.0, mode=mode), "streams": 16,
                        "ttft_p50_ms": 20.0, "itl_p50_ms": 10.0, "itl_p99_ms": 20.0}]
    rows = {row["mode"]: row for row in generate.ratio_rows(points)}
    assert list(rows) == ["fixed-16", "fixed-1"]
    row = rows["fixed-16"]
    assert row["systems"] == ["continuous", "llama-server"] and row["streams"] == 16
    assert row["per_round_over_llama"] == pytest.approx([0.6, 1.3, 1.0])
    assert row["over_llama"] == pytest.approx(1.0)
    assert row["ttft_p99_over_llama"] == pytest.approx(0.5) and row["itl_p50_over_llama"] == pytest.approx(2.0)
    assert "over_static" not in row
    (met,) = generate.targets(row)
    assert met["key"] == "over_llama" and met["goal"] == 1.0 and met["met"]
    (half,) = generate.targets(rows["fixed-1"])
    assert half["goal"] == 0.5 and half["met"]  # the same ratios: 1.0x >= 0.5x


def test_targets_skip_what_was_not_measured():
    points = [point(0, "continuous", 100.0, 10.0), point(0, "static", 50.0, 20.0)]
    (row,) = generate.ratio_rows(points)
    assert [t["key"] for t in generate.targets(row)] == ["over_static", "ttft_p99_over_static"]


def test_agreement_of_greedy_outputs():
    texts = {"continuous": {0: "Paris is", 1: "abcdef", 2: "x"}, "llama-server": {0: "Paris is", 1: "abcxyz"}}
    found = generate.agreement(texts, "continuous", "llama-server")
    assert found == {"requests": 2, "identical": 1, "common_prefix_chars_p50": 5.5, "chars_p50": 7.0}
    assert generate.agreement({"continuous": {0: "a"}}, "continuous", "llama-server") is None


def test_shipped_parameter():
    config = '{ key: "max_active_sequences", value: { string_value: "16" } }'
    assert generate.shipped_parameter(config, "max_active_sequences") == "16"
    assert generate.shipped_parameter(config, "nope") is None


def test_report_renders_every_section(tmp_path):
    points = []
    for mode, systems in (("closed", ("continuous", "static", "single", "llama-server")),
                          ("fixed-16", ("continuous", "llama-server")), ("fixed-1", ("continuous", "llama-server"))):
        for system in systems:
            points.append({**point(0, system, 100.0, 50.0, mode=mode), "order": 0, "streams": 16, "wall_s": 1.0,
                           "finished": 4, "ttft_p50_ms": 10.0, "itl_p50_ms": 20.0, "itl_p99_ms": 40.0,
                           "e2e_p50_ms": 1.0, "e2e_p99_ms": 2.0, "cost_per_m_tokens": 0.3, "avg_batch": None,
                           "backend_tokens": 256.0, "generated_tokens": 256})
    ratios = generate.ratio_rows(points)
    run = {"run": "t", "date": "d", "machine": "2 cores; x", "command": "c", "trace": "t", "systems_note": "s",
           "llama_note": "l", "tokens_note": "t", "itl_note": "i", "rounds": 1, "concurrency": 16,
           "closed_requests": 4, "single_requests": 2, "open_requests": 4, "rate_per_s": 1.0, "price_per_hour": 0.1,
           "fixed": [{"streams": 16, "requests": 4}, {"streams": 1, "requests": 2}], "points": points,
           "ratios": ratios, "targets": [t for row in ratios for t in generate.targets(row)],
           "agreement": [{"mode": "fixed-16", "requests": 4, "identical": 3, "common_prefix_chars_p50": 200.0,
                          "chars_p50": 250.0}], "step_costs": []}
    run["discussion"] = generate.discussion(run)
    text = generate.markdown(run)
    assert "Against llama.cpp's server: 64 tokens per request" in text
    assert "continuous tokens/s >= 1.0x llama-server's at 16 streams" in text
    assert "| 16 | 1.00x |" in text and "3 of 4 identical" in text
    assert "Targets at 16 concurrent streams" in text and "| llama-server |" in text
    assert generate.plot(run, tmp_path / "t.png").is_file()
