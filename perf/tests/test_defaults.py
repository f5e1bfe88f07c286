import pytest

from perf import defaults, repository
from perf.repository import MINILM

SHIPPED = (MINILM / "config.pbtxt").read_text()


def test_every_variant_changes_one_setting_of_the_shipped_config():
    names = defaults.variants(SHIPPED)
    shipped_us = defaults.shipped_delay_us(SHIPPED)
    delays = defaults.delay_variants(SHIPPED)
    assert names == ("shipped", "fp32", *delays, "nocache")
    assert sorted([*delays.values(), shipped_us]) == sorted(defaults.DELAY_CANDIDATES_US)
    configs = {v: defaults.variant_config(SHIPPED, v) for v in names}
    for variant, config in configs.items():
        assert f'name: "minilm_{variant}"' in config and 'name: "minilm"' not in config
        # The shipped thread settings stay: these are the defaults as served.
        assert defaults.parameter(config, "intra_op_threads") == "1"
        assert defaults.parameter(config, "thread_spinning") == "true"
    assert defaults.parameter(configs["shipped"], "precision") == "auto"
    assert defaults.parameter(configs["fp32"], "precision") == "fp32"
    assert f"max_queue_delay_microseconds: {shipped_us}\n" in configs["shipped"]
    for variant, us in delays.items():
        assert f"max_queue_delay_microseconds: {us}\n" in configs[variant]
    assert [v for v, c in configs.items() if not defaults.has_cache(c)] == ["nocache"]
    # Apart from the name, each variant differs from the shipped text in one line: its own setting's.
    for variant, edited in (("fp32", "precision"), ("nocache", "cache_bytes"),
                            *((v, "max_queue_delay") for v in delays)):
        shipped = configs["shipped"].replace("minilm_shipped", f"minilm_{variant}").splitlines()
        changed = [b for a, b in zip(shipped, configs[variant].splitlines(), strict=True) if a != b]
        assert len(changed) == 1 and edited in changed[0]


def test_delay_variant_refuses_a_config_without_one_delay_line():
    changed = repository.QUEUE_DELAY_LINE.sub("", SHIPPED)
    with pytest.raises(ValueError, match="max_queue_delay_microseconds"):
        defaults.variant_config(changed, "delay500")
    with pytest.raises(ValueError, match="exactly once"):
        defaults.variants(SHIPPED + "\n  max_queue_delay_microseconds: 100\n")
    with pytest.raises(ValueError, match="unknown variant"):
        defaults.variant_config(SHIPPED, "fp16")


def test_windows_keep_a_point_below_the_distinct_texts():
    assert defaults.max_windows(3000, 100, 1) == 10
    assert defaults.max_windows(3000, 250, 16) == 9  # 9 * (250 * 1.25 + 16) = 2956 < 3000
    assert defaults.max_windows(3000, 790, 1) == 3
    with pytest.raises(ValueError, match="lower --request-count"):
        defaults.max_windows(3000, 1000, 16)


def test_rounds_rotate_the_order_and_ratios_pair_rounds():
    assert defaults.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert defaults.round_order(["a", "b", "c"], 4) == ["b", "c", "a"]
    points = [{"round": r, "variant": v, "profile": "queries", "concurrency": 16, "throughput_per_s": t}
              for r, v, t in ((0, "shipped", 100.0), (0, "fp32", 50.0), (1, "shipped", 90.0), (1, "fp32", 60.0),
                              (2, "shipped", 80.0))]
    assert defaults.same_round_ratios(points, "throughput_per_s", "shipped", "fp32", profile="queries",
                                      concurrency=16) == [2.0, 1.5]
    assert defaults.verdict(1.6, 1.5, at_least=True) == "met by 0.100"
    assert defaults.verdict(0.9, 0.95, at_least=True) == "missed by 0.050"
    assert defaults.verdict(0.8, 1.0, at_least=False) == "met by 0.200"
    assert defaults.verdict(None, 1.0, at_least=True) == "not measured"


def test_the_duplicates_point_concerns_the_cache_only():
    names = defaults.variants(SHIPPED)
    rounds = defaults.plan(["queries"], [1, 16], names, duplicates=True)
    assert rounds[:2] == [("queries", 1, names), ("queries", 16, names)]
    assert rounds[2] == ("duplicates", 16, ("shipped", "nocache"))
    assert len(defaults.plan(["queries"], [1], names, duplicates=False)) == 1


def test_the_report_and_plot_name_the_shipped_delay_and_its_alternatives(tmp_path):
    names = defaults.variants(SHIPPED)
    points = [{"round": r, "variant": v, "profile": p, "concurrency": n, "throughput_per_s": 100.0 + r,
               "p50_ms": 5.0, "p99_ms": 9.0, "avg_batch": 1.0, "requests": 500, "cache_hits": 0.0, "max_windows": 3}
              for r in (0, 1) for v in names for p in ("queries",) for n in (1, 16)]
    run = {"run": "defaults-test", "command": "x", "machine": "m", "protocol": "http", "workloads": "w", "rounds": 2,
           "profiles": ["queries"], "concurrency": [1, 16], "variants": list(names),
           "shipped_delay_us": defaults.shipped_delay_us(SHIPPED), "points": points, "accuracy": []}
    text = defaults.markdown(run)
    others = " and ".join(f"{us} us" for us in defaults.delay_variants(SHIPPED).values())
    assert f"## 1. Queue delay: {run['shipped_delay_us']} us (shipped) vs {others}" in text
    assert defaults.plot(run, tmp_path / "p.png").stat().st_size > 0
    # The p50 ratio is shipped over the other delay: below 1 is what a shorter shipped delay should give.
    for us in defaults.delay_variants(SHIPPED).values():
        expected = "below 1 expected" if run["shipped_delay_us"] < us else "above 1 expected"
        assert f"vs delay{us}: N=1 p50 ratio 1.00 ({expected}" in text
