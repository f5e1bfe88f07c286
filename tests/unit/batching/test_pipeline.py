import gc
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce.cache import RowCache
from coalesce.errors import CoalesceError, InvalidInputError, RuntimeFailure
from coalesce.metrics import InMemoryMetricFactory, PipelineMetrics
from coalesce.pipeline import EmbeddingPipeline
from coalesce.settings import Settings
from coalesce.tokenizer import TextTokenizer
from tests.conftest import TRICKY_TEXTS, VERSION_DIR

DIM = 384


class TableRuntime:
    """A deterministic encoder: each token's state is a fixed random vector of its id.

    Row-independent and blind to padding (padded positions are masked out by pooling), so
    any correct coalescing must give exactly the per-request result.
    """

    name = "table"
    hidden_size = DIM

    def __init__(self, fail_when_padded_to: int | None = None) -> None:
        self.table = np.random.default_rng(0).standard_normal((40_000, DIM)).astype(np.float32)
        self.calls: list[tuple[int, int]] = []
        self.fail_when_padded_to = fail_when_padded_to

    def run(self, input_ids, attention_mask, token_type_ids):
        assert input_ids.dtype == np.int64 and input_ids.shape == attention_mask.shape == token_type_ids.shape
        self.calls.append(input_ids.shape)
        if input_ids.shape[1] == self.fail_when_padded_to:
            raise RuntimeFailure(f"injected failure at padded length {self.fail_when_padded_to}")
        return self.table[input_ids]


@pytest.fixture(scope="module")
def tokenizer(version_dir):
    return TextTokenizer(version_dir / "tokenizer.json", 256)


def make(tokenizer, runtime=None, cache=None, **params):
    # A fixed, CPU-like cost model (1 ms a pass, 0.1 ms a token) keeps plans deterministic.
    params.setdefault("cost_model", "0.001,0.0001,0")
    settings = Settings.from_parameters({k: str(v) for k, v in params.items()}, model_name="m",
                                        max_batch_size=64, embedding_dim=DIM)
    factory = InMemoryMetricFactory()
    pipeline = EmbeddingPipeline(settings, runtime or TableRuntime(), tokenizer,
                                 PipelineMetrics(factory, model="m", version="1"), cache=cache,
                                 fingerprint=b"f" * 32 if cache is not None else b"")
    return pipeline, factory


def enc(texts):
    return [t.encode("utf-8") for t in texts]


def test_tokenizer_truncates_at_256_and_never_pads(tokenizer):
    rows = tokenizer.encode(["", "hello", "word " * 1000])
    assert rows.lengths.tolist()[:2] == [2, 3]  # [CLS] [SEP], [CLS] hello [SEP]
    assert rows.lengths[2] == 256


def test_one_forward_pass_for_many_requests(tokenizer):
    runtime = TableRuntime()
    pipeline, factory = make(tokenizer, runtime)
    results = pipeline.embed([enc(["a b c"]), enc(["d e f"]), enc(["g h i", "j k l"])])
    assert [r.shape for r in results] == [(1, DIM), (1, DIM), (2, DIM)]
    assert len(runtime.calls) == 1
    assert factory.value("coalesce_forward_passes_total") == 1
    assert factory.value("coalesce_rows_total") == 4
    assert factory.value("coalesce_requests_total") == 3


def test_scatter_order_and_equivalence_to_single_requests(tokenizer):
    pipeline, _ = make(tokenizer)
    requests = [enc(TRICKY_TEXTS[:3]), enc(TRICKY_TEXTS[3:4]), enc(TRICKY_TEXTS[4:])]
    together = pipeline.embed(requests)
    for request, got in zip(requests, together, strict=True):
        for row, text in enumerate(request):
            (alone,) = pipeline.embed([[text]])
            np.testing.assert_allclose(got[row], alone[0], rtol=1e-5, atol=1e-6)


def test_bad_request_gets_its_own_error_and_neighbours_succeed(tokenizer):
    pipeline, factory = make(tokenizer, max_text_bytes=100)
    results = pipeline.embed([enc(["fine"]), [b"ok", b"\xff\xfebad"], [], enc(["x" * 101]),
                              InvalidInputError("adapter said no"), enc(["also fine"])])
    assert isinstance(results[0], np.ndarray) and isinstance(results[5], np.ndarray)
    assert isinstance(results[1], InvalidInputError)
    assert "row 1 is not valid UTF-8: byte 0xff at offset 0" in str(results[1])
    assert isinstance(results[2], InvalidInputError) and "no rows" in str(results[2])
    assert isinstance(results[3], InvalidInputError) and "101 bytes" in str(results[3])
    assert str(results[4]) == "adapter said no"
    assert factory.value("coalesce_request_failures_total") == 4
    assert factory.value("coalesce_rows_total") == 2


def test_runtime_failure_fails_only_requests_in_that_pass(tokenizer):
    # "a" is 3 tokens; the long text is cut into its own pass, which fails.
    pipeline, _ = make(tokenizer, TableRuntime(fail_when_padded_to=256))
    results = pipeline.embed([enc(["a"]), enc(["word " * 300]), enc(["b", "c"])])
    assert isinstance(results[0], np.ndarray) and isinstance(results[2], np.ndarray)
    assert isinstance(results[1], CoalesceError) and results[1].code == "INTERNAL"
    assert "injected failure" in str(results[1])


class _TritonRequest:
    """What ``execute``'s frame holds while the pipeline runs: Triton's requests."""


def _answer(pipeline, rows):
    requests = [_TritonRequest()]
    results = pipeline.embed([rows])
    return results, weakref.ref(requests[0])


@pytest.mark.parametrize(("fail_when_padded_to", "rows"), [
    (None, [b"ok", b"\xff"]),
    (256, enc(["word " * 300])),
], ids=["bad_input", "runtime_failure"])
def test_error_results_keep_no_frames_alive(tokenizer, fail_when_padded_to, rows):
    """An error answer must not carry the frames it was raised in.

    Through them it would keep its caller's frame, and so the Triton requests, alive in a
    reference cycle until a collector pass; in the Python backend that pass can come after
    the stub unmapped shared memory at shutdown, where it crashed the stub.
    """
    pipeline, _ = make(tokenizer, TableRuntime(fail_when_padded_to=fail_when_padded_to))
    gc.disable()  # only reference counting: what the cycle collector would rescue is a leak here
    try:
        results, request = _answer(pipeline, rows)
        assert isinstance(results[0], CoalesceError)
        assert results[0].__traceback__ is None and results[0].__context__ is None
        assert request() is None, "the error answer keeps the caller's requests alive"
    finally:
        gc.enable()


def test_padding_metrics(tokenizer):
    pipeline, factory = make(tokenizer, planner="greedy", max_padding_ratio=1000)
    pipeline.embed([enc(["a", "a b c d e f"])])  # 3 and 8 tokens in one pass
    assert factory.value("coalesce_real_tokens_total") == 11
    assert factory.value("coalesce_padded_tokens_total") == 16
    assert factory.observations("coalesce_padding_ratio") == [pytest.approx(16 / 11)]
    assert factory.observations("coalesce_forward_batch_rows") == [2]
    assert len(factory.observations("coalesce_stage_seconds", stage="infer")) == 1


def test_output_width_must_match_config(tokenizer):
    settings = Settings.from_parameters({}, model_name="m", embedding_dim=768)
    with pytest.raises(CoalesceError, match=r"dims \[768\] but the table model produces width 384"):
        EmbeddingPipeline(settings, TableRuntime(), tokenizer,
                          PipelineMetrics(InMemoryMetricFactory(), model="m", version="1"))


text_strategy = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60)


def test_calibrated_cost_model_is_used(tokenizer):
    pipeline, _ = make(tokenizer, cost_model="auto")
    model = pipeline.cost_model
    assert min(model.a_s, model.b_s, model.c_s) >= 0
    assert model.predict_s(8, 64) > 0


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.lists(text_strategy, min_size=1, max_size=6), min_size=1, max_size=8),
       max_rows=st.integers(1, 16), ratio=st.floats(1.0, 3.0), planner=st.sampled_from(["dp", "greedy"]))
def test_coalesced_equals_per_request(tokenizer, requests, max_rows, ratio, planner):
    pipeline, _ = make(tokenizer, max_batch_rows=max_rows, max_padding_ratio=ratio, planner=planner)
    together = pipeline.embed([enc(r) for r in requests])
    for request, got in zip(requests, together, strict=True):
        (alone,) = pipeline.embed([enc(request)])
        assert got.shape == (len(request), DIM)
        np.testing.assert_allclose(got, alone, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)


def test_real_onnx_runtime_matches_sentence_transformers(version_dir, reference_model):
    settings = Settings.from_parameters({}, model_name="minilm", max_batch_size=64, embedding_dim=DIM)
    pipeline = EmbeddingPipeline.from_version_dir(settings, version_dir)
    got = np.concatenate(pipeline.embed([enc(TRICKY_TEXTS[:4]), enc(TRICKY_TEXTS[4:])]))
    want = reference_model.encode(TRICKY_TEXTS, normalize_embeddings=True)
    cosine = (got * want).sum(axis=1)
    assert cosine.min() >= 0.999, cosine
    assert VERSION_DIR.samefile(version_dir)


def test_identical_rows_are_computed_once_and_fanned_out(tokenizer):
    runtime = TableRuntime()
    pipeline, factory = make(tokenizer, runtime)
    requests = [enc(["same", "other", "same"]), enc(["same"]), enc(["third", "other"])]
    results = pipeline.embed(requests)
    # Three distinct texts went through the runtime, whatever the planner's cuts.
    assert sum(rows for rows, _ in runtime.calls) == 3
    assert factory.value("coalesce_deduplicated_rows_total") == 3
    alone, _ = make(tokenizer)
    for request, result in zip(requests, results, strict=True):
        expected = alone.embed([[row] for row in request])
        assert np.array_equal(result, np.concatenate(expected))
    # A fanned-out row is a copy: changing one answer leaves the others alone.
    results[0][0] += 1.0
    assert np.array_equal(results[1][0], alone.embed([enc(["same"])])[0][0])


def test_failed_pass_fails_every_request_that_shares_its_row(tokenizer):
    pipeline, _ = make(tokenizer, TableRuntime(fail_when_padded_to=256))
    long = "word " * 300
    results = pipeline.embed([enc(["a", long]), enc(["b"]), enc([long])])
    assert isinstance(results[0], CoalesceError) and isinstance(results[2], CoalesceError)
    assert isinstance(results[1], np.ndarray)


def rows_computed(runtime):
    return sum(rows for rows, _ in runtime.calls)


def test_cached_rows_are_bit_identical_and_not_recomputed(tokenizer):
    runtime = TableRuntime()
    pipeline, factory = make(tokenizer, runtime, cache=RowCache(1 << 20))
    requests = [enc(["alpha", "beta"]), enc(["gamma " * 40])]
    first = pipeline.embed(requests)
    assert rows_computed(runtime) == 3
    second = pipeline.embed(requests)
    assert rows_computed(runtime) == 3  # nothing ran again
    for a, b in zip(first, second, strict=True):
        assert a.tobytes() == b.tobytes()
    assert factory.value("coalesce_cache_hits_total") == 3 and factory.value("coalesce_cache_misses_total") == 3
    assert factory.value("coalesce_cache_resident_bytes") == pipeline.cache.resident_bytes > 0


def test_partial_hits_compute_only_the_misses_and_scatter_in_order(tokenizer):
    runtime = TableRuntime()
    pipeline, _ = make(tokenizer, runtime, cache=RowCache(1 << 20))
    pipeline.embed([enc(["a", "b"])])
    runtime.calls.clear()
    requests = [enc(["x", "a"]), enc(["b", "y", "a"]), enc(["b"])]
    results = pipeline.embed(requests)
    assert rows_computed(runtime) == 2  # only "x" and "y" were planned and run
    fresh, _ = make(tokenizer)
    for request, result in zip(requests, results, strict=True):
        assert np.array_equal(result, np.concatenate(fresh.embed([[row] for row in request])))


def test_failed_rows_are_not_cached(tokenizer):
    runtime = TableRuntime(fail_when_padded_to=256)
    pipeline, _ = make(tokenizer, runtime, cache=RowCache(1 << 20))
    long = "word " * 300
    assert isinstance(pipeline.embed([enc([long])])[0], CoalesceError)
    runtime.fail_when_padded_to = None
    runtime.calls.clear()
    assert isinstance(pipeline.embed([enc([long])])[0], np.ndarray)
    assert rows_computed(runtime) == 1


def test_small_cache_evicts_and_counts(tokenizer):
    one = RowCache.entry_bytes(np.zeros(DIM, dtype=np.float32))
    pipeline, factory = make(tokenizer, cache=RowCache(2 * one))
    pipeline.embed([enc(["one", "two", "three", "four"])])
    assert factory.value("coalesce_cache_evictions_total") == 2
    assert factory.value("coalesce_cache_resident_bytes") == 2 * one


def test_cache_needs_a_fingerprint(tokenizer):
    settings = Settings.from_parameters({"cost_model": "0.001,0.0001,0"}, model_name="m", max_batch_size=64,
                                        embedding_dim=DIM)
    with pytest.raises(ValueError, match="needs the output fingerprint"):
        EmbeddingPipeline(settings, TableRuntime(), tokenizer, PipelineMetrics(InMemoryMetricFactory(), model="m",
                                                                               version="1"), cache=RowCache(1024))


def test_fingerprint_follows_version_and_output_settings(version_dir):
    def fingerprint(version="1", **params):
        params = {"cost_model": "0.001,0.0001,0", "cache_bytes": "1048576", **params}
        settings = Settings.from_parameters(params, model_name="m", max_batch_size=64, embedding_dim=DIM)
        return EmbeddingPipeline.from_version_dir(settings, version_dir, version=version).fingerprint

    base = fingerprint()
    assert base == fingerprint() and len(base) == 32
    assert len({base, fingerprint(version="2"), fingerprint(max_sequence_length="128"),
                fingerprint(pooling="cls"), fingerprint(normalize="false")}) == 5
    # Settings that change only speed keep the key, so a retuned config keeps its cache.
    assert fingerprint(max_batch_rows="16", planner="greedy") == base
