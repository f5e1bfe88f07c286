from coalesce_tools.tune import TunePoint, apply_to_pbtxt, config_override, grid, pareto_frontier, select
from tests.conftest import MODEL_DIR


def result(tput, p99, label=""):
    return {"throughput_per_s": tput, "p99_ms": p99, "label": label or f"{tput}/{p99}"}


def test_grid_is_the_full_product_in_order():
    points = grid([0, 1000], [(), (16, 32)], [1], [64], [8192])
    assert len(points) == 4
    assert points[0] == TunePoint(0, (), 1, 64, 8192)
    assert points[-1] == TunePoint(1000, (16, 32), 1, 64, 8192)


def test_pareto_frontier_and_selection():
    results = [result(100, 10), result(200, 30), result(150, 40), result(250, 80), result(200, 30, "tie")]
    frontier = pareto_frontier(results)
    assert [(r["throughput_per_s"], r["p99_ms"]) for r in frontier] == [(100, 10), (200, 30), (200, 30), (250, 80)]
    assert select(results, 50)["throughput_per_s"] == 200
    assert select(results, 100)["throughput_per_s"] == 250
    assert select(results, 5) is None


def test_config_override_keeps_the_rest():
    base = {"name": "minilm", "dynamic_batching": {"max_queue_delay_microseconds": 2000},
            "instance_group": [{"kind": "KIND_CPU", "count": 1}],
            "parameters": {"runtime": {"string_value": "auto"}}}
    out = config_override(base, TunePoint(500, (8,), 2, 32, 4096))
    assert out["dynamic_batching"] == {"max_queue_delay_microseconds": 500, "preferred_batch_size": [8]}
    assert out["instance_group"] == [{"kind": "KIND_CPU", "count": 2}]
    assert out["parameters"]["runtime"] == {"string_value": "auto"}
    assert out["parameters"]["max_batch_rows"] == {"string_value": "32"}
    assert base["dynamic_batching"]["max_queue_delay_microseconds"] == 2000  # not mutated


def test_apply_to_shipped_pbtxt_keeps_comments():
    text = (MODEL_DIR / "config.pbtxt").read_text()
    out = apply_to_pbtxt(text, TunePoint(750, (8, 16), 2, 32, 4096))
    assert "max_queue_delay_microseconds: 750" in out
    assert "preferred_batch_size: [ 8, 16 ]" in out
    assert "count: 2" in out
    assert '{ key: "max_batch_rows", value: { string_value: "32" } }' in out
    assert '{ key: "max_batch_tokens", value: { string_value: "4096" } }' in out
    assert out.count("#") == text.count("#")
    none = apply_to_pbtxt(text, TunePoint(0, (), 1, 64, 8192))
    assert "preferred_batch_size: [ ]" in none


def test_apply_adds_missing_parameters():
    out = apply_to_pbtxt('name: "m"\nparameters [\n  { key: "runtime", value: { string_value: "auto" } }\n]\n',
                         TunePoint(0, (), 1, 16, 2048))
    assert '{ key: "max_batch_rows", value: { string_value: "16" } }' in out
    assert out.strip().endswith("]")
