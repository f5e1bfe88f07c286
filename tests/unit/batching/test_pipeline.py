"""The coalescing pipeline over the embedding task: one pass for many requests, errors per request, de-duplication,
the row cache, and the real ONNX graph against sentence-transformers."""

import gc
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce.batching.costmodel import CostModel
from coalesce.batching.pipeline import Pipeline
from coalesce.cache.memory import RowCache
from coalesce.core.errors import CoalesceError, InvalidInputError
from coalesce.loader import load_pipeline
from tests.conftest import TRICKY_TEXTS, model_config
from tests.unit.fakes import DIM, EncoderRuntime, answers, embedding_pipeline, metrics, texts


def padded_to(length):
    """A failure injected into every pass padded to ``length`` positions."""
    return lambda feeds: feeds["input_ids"].shape[1] == length


def embed(pipeline, *requests):
    """Answers to requests of texts (one list of texts per request)."""
    return answers(pipeline, *({"TEXT": texts(*request)} for request in requests))


def alone(pipeline, request):
    """Each text of ``request`` through the pipeline on its own, stacked."""
    return np.concatenate([embed(pipeline, [text])[0]["EMBEDDING"] for text in request])


def test_one_forward_pass_for_many_requests():
    runtime = EncoderRuntime()
    pipeline, factory = embedding_pipeline(runtime)
    results = embed(pipeline, ["a b c"], ["d e f"], ["g h i", "j k l"])
    assert [sorted(r) for r in results] == [["EMBEDDING"]] * 3
    assert [r["EMBEDDING"].shape for r in results] == [(1, DIM), (1, DIM), (2, DIM)]
    assert runtime.calls == [(4, 5)]  # [CLS] x y z [SEP]
    assert factory.value("coalesce_forward_passes_total") == 1
    assert factory.value("coalesce_rows_total") == 4
    assert factory.value("coalesce_requests_total") == 3
    assert factory.value("coalesce_executions_total") == 1


def test_scatter_order_and_equivalence_to_single_requests():
    pipeline, _ = embedding_pipeline()
    requests = [TRICKY_TEXTS[:3], TRICKY_TEXTS[3:4], TRICKY_TEXTS[4:]]
    together = embed(pipeline, *requests)
    for request, got in zip(requests, together, strict=True):
        np.testing.assert_allclose(got["EMBEDDING"], alone(pipeline, request), rtol=1e-5, atol=1e-6)


def test_bad_request_gets_its_own_error_and_neighbours_succeed():
    pipeline, factory = embedding_pipeline(max_text_bytes=100)
    results = answers(pipeline, {"TEXT": texts("fine")}, {"TEXT": texts(b"ok", b"\xff\xfebad")},
                      {"TEXT": np.empty((0, 1), dtype=np.object_)}, {"TEXT": texts("x" * 101)},
                      InvalidInputError("adapter said no"), {}, {"TEXT": texts("also fine")})
    assert results[0]["EMBEDDING"].shape == results[6]["EMBEDDING"].shape == (1, DIM)
    assert [type(r) for r in results[1:6]] == [InvalidInputError] * 5
    assert [r.code for r in results[1:6]] == ["INVALID_ARG"] * 5
    assert str(results[1]) == "input 'TEXT' row 1 is not valid UTF-8: byte 0xff at offset 0 (invalid start byte)"
    assert str(results[2]) == "input 'TEXT' has no rows: send at least one text (shape [N, 1], N >= 1)"
    assert str(results[3]) == ("input 'TEXT' row 0 is 101 bytes, over the model's limit of 100 "
                               "(parameter 'max_text_bytes')")
    assert str(results[4]) == "adapter said no"
    assert str(results[5]) == "request has no input 'TEXT'"
    assert factory.value("coalesce_request_failures_total") == 5
    assert factory.value("coalesce_rows_total") == 2
    np.testing.assert_allclose(results[0]["EMBEDDING"], alone(pipeline, ["fine"]), rtol=1e-5, atol=1e-6)


def test_runtime_failure_fails_only_requests_in_that_pass():
    # "a" is 3 tokens; the long text is cut into its own pass (256 tokens), which fails.
    runtime = EncoderRuntime(fail_when=padded_to(256))
    pipeline, factory = embedding_pipeline(runtime)
    results = embed(pipeline, ["a"], ["word " * 300], ["b", "c"])
    assert results[0]["EMBEDDING"].shape == (1, DIM) and results[2]["EMBEDDING"].shape == (2, DIM)
    assert isinstance(results[1], CoalesceError) and results[1].code == "INTERNAL"
    assert str(results[1]) == "injected failure on a pass of shape [1, 256]"
    assert sorted(runtime.calls) == [(1, 256), (3, 3)]
    assert factory.value("coalesce_request_failures_total") == 1
    assert factory.value("coalesce_forward_passes_total") == 1  # only the pass that succeeded


class _TritonRequest:
    """What ``execute``'s frame holds while the pipeline runs: Triton's requests."""


def _answer(pipeline, request_tensors):
    requests = [_TritonRequest()]
    results = answers(pipeline, request_tensors)
    return results, weakref.ref(requests[0])


@pytest.mark.parametrize(("fail_at", "request_texts"), [
    (None, [b"ok", b"\xff"]),
    (256, ["word " * 300]),
], ids=["bad_input", "runtime_failure"])
def test_error_results_keep_no_frames_alive(fail_at, request_texts):
    """An error answer must not carry the frames it was raised in.

    Through them it would keep its caller's frame, and so the Triton requests, alive in a
    reference cycle until a collector pass; in the Python backend that pass can come after
    the stub unmapped shared memory at shutdown, where it crashed the stub.
    """
    pipeline, _ = embedding_pipeline(EncoderRuntime(fail_when=padded_to(fail_at)))
    gc.disable()  # only reference counting: what the cycle collector would rescue is a leak here
    try:
        results, request = _answer(pipeline, {"TEXT": texts(*request_texts)})
        assert isinstance(results[0], CoalesceError)
        assert results[0].__traceback__ is None and results[0].__context__ is None
        assert request() is None, "the error answer keeps the caller's requests alive"
    finally:
        gc.enable()


def test_padding_metrics():
    pipeline, factory = embedding_pipeline(planner="greedy", max_padding_ratio="1000")
    embed(pipeline, ["a", "a b c d e f"])  # 3 and 8 tokens in one pass
    assert factory.value("coalesce_real_tokens_total") == 11
    assert factory.value("coalesce_padded_tokens_total") == 16
    assert factory.observations("coalesce_padding_ratio") == [pytest.approx(16 / 11)]
    assert factory.observations("coalesce_forward_batch_rows") == [2]
    for stage in ("read", "prepare", "plan", "infer", "split", "scatter"):
        assert len(factory.observations("coalesce_stage_seconds", stage=stage)) == 1, stage


text_strategy = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.lists(text_strategy, min_size=1, max_size=6), min_size=1, max_size=8),
       max_rows=st.integers(1, 16), ratio=st.floats(1.0, 3.0), planner=st.sampled_from(["dp", "greedy"]))
def test_coalesced_equals_per_request(requests, max_rows, ratio, planner):
    pipeline, _ = embedding_pipeline(max_batch_rows=max_rows, max_padding_ratio=ratio, planner=planner)
    together = embed(pipeline, *requests)
    for request, got in zip(requests, together, strict=True):
        vectors = got["EMBEDDING"]
        assert vectors.shape == (len(request), DIM)
        np.testing.assert_allclose(vectors, embed(pipeline, request)[0]["EMBEDDING"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)


def test_real_onnx_runtime_matches_sentence_transformers(version_dir, reference_model, tmp_path):
    # A version folder elsewhere, holding the built files: the pipeline must run what the folder it is given holds.
    for name in ("model.onnx", "tokenizer.json"):
        (tmp_path / name).symlink_to(version_dir / name)
    pipeline = load_pipeline(model_config("minilm", cost_model="0.001,0.0001,0", precision="fp32"), tmp_path)
    assert pipeline.runtime.name == "onnxruntime"
    assert pipeline.runtime.path == tmp_path / "model.onnx"
    assert pipeline.runtime.path.samefile(version_dir / "model.onnx")
    assert pipeline.task.tokenizer_path == tmp_path / "tokenizer.json"
    assert pipeline.task.tokenizer_path.samefile(version_dir / "tokenizer.json")
    results = embed(pipeline, TRICKY_TEXTS[:4], TRICKY_TEXTS[4:])
    got = np.concatenate([r["EMBEDDING"] for r in results])
    want = reference_model.encode(TRICKY_TEXTS, normalize_embeddings=True)
    cosine = (got * want).sum(axis=1)
    assert cosine.min() >= 0.999, cosine


def test_identical_rows_are_computed_once_and_fanned_out():
    runtime = EncoderRuntime()
    pipeline, factory = embedding_pipeline(runtime)
    requests = [["same", "other", "same"], ["same"], ["third", "other"]]
    results = embed(pipeline, *requests)
    # Three distinct texts went through the runtime, whatever the planner's cuts.
    assert runtime.rows_computed == 3
    assert factory.value("coalesce_deduplicated_rows_total") == 3
    reference, _ = embedding_pipeline()
    for request, result in zip(requests, results, strict=True):
        assert np.array_equal(result["EMBEDDING"], alone(reference, request))
    # A fanned-out row is a copy: changing one answer leaves the others alone.
    results[0]["EMBEDDING"][0] += 1.0
    assert np.array_equal(results[1]["EMBEDDING"][0], alone(reference, ["same"])[0])
    assert np.array_equal(results[0]["EMBEDDING"][2], alone(reference, ["same"])[0])


def test_failed_pass_fails_every_request_that_shares_its_row():
    pipeline, _ = embedding_pipeline(EncoderRuntime(fail_when=padded_to(256)))
    long = "word " * 300
    results = embed(pipeline, ["a", long], ["b"], [long])
    assert isinstance(results[0], CoalesceError) and isinstance(results[2], CoalesceError)
    assert results[1]["EMBEDDING"].shape == (1, DIM)


def test_cached_rows_are_bit_identical_and_not_recomputed():
    runtime = EncoderRuntime()
    pipeline, factory = embedding_pipeline(runtime, cache=RowCache(1 << 20))
    requests = [["alpha", "beta"], ["gamma " * 40]]
    first = embed(pipeline, *requests)
    assert runtime.rows_computed == 3
    second = embed(pipeline, *requests)
    assert runtime.rows_computed == 3  # nothing ran again
    for a, b in zip(first, second, strict=True):
        assert a["EMBEDDING"].tobytes() == b["EMBEDDING"].tobytes()
    assert factory.value("coalesce_cache_hits_total") == 3 and factory.value("coalesce_cache_misses_total") == 3
    assert factory.value("coalesce_cache_resident_bytes") == pipeline.cache.resident_bytes > 0


def test_partial_hits_compute_only_the_misses_and_scatter_in_order():
    runtime = EncoderRuntime()
    pipeline, _ = embedding_pipeline(runtime, cache=RowCache(1 << 20))
    embed(pipeline, ["a", "b"])
    runtime.feeds.clear()
    requests = [["x", "a"], ["b", "y", "a"], ["b"]]
    results = embed(pipeline, *requests)
    assert runtime.rows_computed == 2  # only "x" and "y" were planned and run
    fresh, _ = embedding_pipeline()
    for request, result in zip(requests, results, strict=True):
        assert np.array_equal(result["EMBEDDING"], alone(fresh, request))


def test_failed_rows_are_not_cached():
    runtime = EncoderRuntime(fail_when=padded_to(256))
    pipeline, _ = embedding_pipeline(runtime, cache=RowCache(1 << 20))
    long = "word " * 300
    assert isinstance(embed(pipeline, [long])[0], CoalesceError)
    runtime.fail_when = None
    runtime.feeds.clear()
    assert embed(pipeline, [long])[0]["EMBEDDING"].shape == (1, DIM)
    assert runtime.rows_computed == 1


def test_small_cache_evicts_and_counts():
    one = RowCache.entry_bytes((np.zeros(DIM, dtype=np.float32),))
    pipeline, factory = embedding_pipeline(cache=RowCache(2 * one))
    embed(pipeline, ["one", "two", "three", "four"])
    assert factory.value("coalesce_cache_evictions_total") == 2
    assert factory.value("coalesce_cache_resident_bytes") == 2 * one


def test_cache_needs_a_fingerprint():
    reference, _ = embedding_pipeline()
    recorded, _ = metrics()
    with pytest.raises(ValueError, match="a row cache needs the output fingerprint its keys are made under"):
        Pipeline(reference.task, EncoderRuntime(), reference.options, recorded, cost_model=CostModel(0.001, 0, 0),
                 cache=RowCache(1024))
    # A disabled cache (0 bytes) needs none: it is never asked.
    assert Pipeline(reference.task, EncoderRuntime(), reference.options, recorded, cost_model=CostModel(0.001, 0, 0),
                    cache=RowCache(0)).cache is None


def test_fingerprint_follows_version_and_output_settings(version_dir):
    def fingerprint(version="1", **parameters):
        parameters = {"cost_model": "0.001,0.0001,0", "cache_bytes": "1048576", **parameters}
        return load_pipeline(model_config("minilm", **parameters), version_dir, version=version).fingerprint

    base = fingerprint()
    assert base == fingerprint() and len(base) == 32
    assert len({base, fingerprint(version="2"), fingerprint(max_sequence_length="128"),
                fingerprint(pooling="cls"), fingerprint(normalize="false")}) == 5
    # Settings that change only speed keep the key, so a retuned config keeps its cache.
    assert fingerprint(max_batch_rows="16", planner="greedy", cache_bytes="2048") == base
