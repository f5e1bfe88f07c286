import collections

from perf import workloads


def test_seeded_and_distinct():
    assert workloads.queries(300, seed=1) == workloads.queries(300, seed=1)
    assert workloads.queries(300, seed=1) != workloads.queries(300, seed=2)
    for profile in ("queries", "documents"):
        texts = workloads.generate(profile, 2000, seed=0)
        assert len(set(texts)) == 2000


def test_query_lengths():
    lengths = [len(t.split()) for t in workloads.queries(2000)]
    assert min(lengths) >= 1 and max(lengths) <= 16
    assert sum(3 <= n <= 16 for n in lengths) / len(lengths) > 0.95


def test_documents_have_a_long_tail():
    words = sorted(len(t.split()) for t in workloads.documents(2000))
    assert words[len(words) // 2] <= 30  # most are short
    assert sum(n > 100 for n in words) / len(words) > 0.05  # a tail well past 128 tokens


def test_duplicates_are_zipf_over_a_small_set():
    texts = workloads.duplicates(5000, unique=200)
    counts = collections.Counter(texts).most_common()
    assert len(counts) <= 200
    assert counts[0][1] > 10 * counts[-1][1]


def test_input_data_format(tmp_path):
    out = workloads.write("queries", 10, 0, tmp_path / "q.json")
    import json

    data = json.loads(out.read_text())["data"]
    assert len(data) == 10
    assert data[0]["TEXT"]["shape"] == [1] and isinstance(data[0]["TEXT"]["content"][0], str)


def test_bench_repository_has_the_cached_variant(tmp_path):
    from perf.bench import build_repository

    repo = build_repository(tmp_path, ["coalesce", "cached"])
    cached = (repo / "minilm_cached" / "config.pbtxt").read_text()
    assert 'name: "minilm_cached"' in cached
    assert cached.count('{ key: "cache_bytes", value: { string_value: "268435456" } }') == 1
    assert cached.count("cache_bytes") == 1
    assert "268435456" not in (repo / "minilm" / "config.pbtxt").read_text()
    assert (repo / "minilm_cached" / "1" / "model.onnx").exists()


def test_bench_serves_every_system_like_for_like(tmp_path):
    """make bench compares coalesce with naive and PyTriton on what they run: FP32, no row cache, one delay."""
    from coalesce_tools.config import parse_model_config
    from perf.bench import LIKE_FOR_LIKE, QUEUE_DELAY_US, build_repository

    repo = build_repository(tmp_path, ["coalesce", "naive"])
    ours = parse_model_config((repo / "minilm" / "config.pbtxt").read_text())
    naive = parse_model_config((repo / "naive" / "config.pbtxt").read_text())
    assert {k: ours["parameters"][k]["string_value"] for k in LIKE_FOR_LIKE} == {"precision": "fp32",
                                                                                 "cache_bytes": "0"}
    delays = {int(c["dynamic_batching"]["max_queue_delay_microseconds"]) for c in (ours, naive)}
    assert delays == {QUEUE_DELAY_US}
