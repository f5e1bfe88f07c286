"""The coalescing pipeline over the classify and tensor tasks: coalesced results equal per-row results, errors stay
per request, identical rows are computed once, and rows from the row cache are bit-identical to computed ones."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce.cache.memory import RowCache
from coalesce.core.errors import CoalesceError, InvalidInputError
from coalesce.tasks.classify.task import activate
from tests.unit.fakes import (
    DIM,
    ClassifierRuntime,
    EncoderRuntime,
    RaggedRuntime,
    answers,
    classify_pipeline,
    ragged_pipeline,
    ragged_request,
    texts,
    tokens_pipeline,
)

# -- classify: texts and text pairs to scores ------------------------------------------------------------------


def rerank(pipeline, *requests):
    """Answers to requests of (query, document) pairs, or of single texts (a request of str)."""
    tensors = []
    for request in requests:
        if all(isinstance(row, str) for row in request):
            tensors.append({"TEXT": texts(*request)})
        else:
            tensors.append({"TEXT": texts(*(q for q, _ in request)), "TEXT_PAIR": texts(*(d for _, d in request))})
    return answers(pipeline, *tensors)


def rerank_alone(pipeline, request):
    return np.concatenate([rerank(pipeline, [row])[0]["SCORES"] for row in request])


text_strategy = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(st.one_of(st.lists(st.tuples(text_strategy, text_strategy), min_size=1, max_size=5),
                                   st.lists(text_strategy, min_size=1, max_size=5)), min_size=1, max_size=6),
       max_rows=st.integers(1, 8), planner=st.sampled_from(["dp", "greedy"]))
def test_classify_coalesced_equals_per_row(requests, max_rows, planner):
    pipeline, _ = classify_pipeline(max_batch_rows=max_rows, planner=planner)
    together = rerank(pipeline, *requests)
    for request, got in zip(requests, together, strict=True):
        assert got["SCORES"].shape == (len(request), 1) and got["SCORES"].dtype == np.float32
        np.testing.assert_allclose(got["SCORES"], rerank_alone(pipeline, request), rtol=1e-5, atol=1e-6)


def test_classify_scores_are_the_graphs_logits_through_the_activation():
    rows = [("what is batching", "Batching groups requests."), ("what is batching", "Bananas are yellow.")]
    raw, _ = classify_pipeline(activation="none")
    sigmoid, _ = classify_pipeline()  # minilm_cross_encoder's config: sigmoid
    logits = rerank(raw, rows)[0]["SCORES"]
    scores = rerank(sigmoid, rows)[0]["SCORES"]
    assert logits[0, 0] != logits[1, 0]
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-logits.astype(np.float64))), rtol=1e-6)
    np.testing.assert_array_equal(scores, activate(logits, "sigmoid"))


def test_a_pair_and_the_text_of_both_halves_are_different_rows():
    runtime = ClassifierRuntime()
    pipeline, factory = classify_pipeline(runtime)
    results = rerank(pipeline, [("ab", "c")], ["ab c"], [("ab", "c")], [("a", "bc")])
    assert factory.value("coalesce_deduplicated_rows_total") == 1  # only the repeated pair
    assert runtime.rows_computed == 3
    assert np.array_equal(results[0]["SCORES"], results[2]["SCORES"])
    assert results[0]["SCORES"][0, 0] != results[1]["SCORES"][0, 0]
    assert results[0]["SCORES"][0, 0] != results[3]["SCORES"][0, 0]
    # The pair's halves reached the graph as two segments: token types 0 then 1.
    pair_rows = [f["token_type_ids"] for f in runtime.feeds]
    assert any((types == 1).any() for types in pair_rows)


def test_classify_bad_request_gets_its_own_error_and_neighbours_succeed():
    pipeline, factory = classify_pipeline()
    good = {"TEXT": texts("q", "q"), "TEXT_PAIR": texts("d1", "d2")}
    mismatched = {"TEXT": texts("q", "q"), "TEXT_PAIR": texts("only one")}
    bad_pair = {"TEXT": texts("q"), "TEXT_PAIR": texts(b"\xc3\x28")}
    results = answers(pipeline, good, mismatched, bad_pair, good)
    assert results[0]["SCORES"].shape == results[3]["SCORES"].shape == (2, 1)
    assert isinstance(results[1], InvalidInputError)
    assert str(results[1]) == "input 'TEXT_PAIR' has 1 rows but 'TEXT' has 2: send one pair text per text"
    assert isinstance(results[2], InvalidInputError)
    assert str(results[2]) == ("input 'TEXT_PAIR' row 0 is not valid UTF-8: byte 0xc3 at offset 0 "
                               "(invalid continuation byte)")
    assert factory.value("coalesce_request_failures_total") == 2


def test_classify_failed_pass_fails_only_its_requests():
    runtime = ClassifierRuntime(fail_when=lambda feeds: feeds["input_ids"].shape[1] > 100)
    pipeline, _ = classify_pipeline(runtime)
    results = rerank(pipeline, [("q", "short")], [("q", "long " * 200)], ["alone"])
    assert results[0]["SCORES"].shape == results[2]["SCORES"].shape == (1, 1)
    assert isinstance(results[1], CoalesceError) and results[1].code == "INTERNAL"


def test_classify_cached_rows_are_bit_identical_and_not_recomputed():
    runtime = ClassifierRuntime()
    pipeline, factory = classify_pipeline(runtime, cache=RowCache(1 << 20))
    requests = [[("q", "first doc"), ("q", "second doc")], ["a single text"], [("q", "first doc")]]
    first = rerank(pipeline, *requests)
    assert runtime.rows_computed == 3
    second = rerank(pipeline, *requests)
    assert runtime.rows_computed == 3
    for a, b in zip(first, second, strict=True):
        assert a["SCORES"].tobytes() == b["SCORES"].tobytes()
    assert factory.value("coalesce_cache_hits_total") == 3 and factory.value("coalesce_cache_misses_total") == 3
    fresh, _ = classify_pipeline()
    for request, result in zip(requests, second, strict=True):
        assert np.array_equal(result["SCORES"], rerank_alone(fresh, request))


# -- tensor: ragged token ids in, per-position states out, cut back to each row's length ------------------------


def token_rows(seed, rows, length, *, mask=False, types=True):
    rng = np.random.default_rng(seed)
    request = {"input_ids": rng.integers(1, 30_000, size=(rows, length), dtype=np.int64)}
    if types:
        request["token_type_ids"] = rng.integers(0, 2, size=(rows, length), dtype=np.int64)
    if mask:
        request["attention_mask"] = np.ones((rows, length), dtype=np.int64)
    return request


def rows_of(request, index):
    return {name: value[index:index + 1] for name, value in request.items()}


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 40), st.booleans()), min_size=1, max_size=6),
       max_rows=st.integers(1, 8), max_tokens=st.integers(64, 400), planner=st.sampled_from(["dp", "greedy"]),
       seed=st.integers(0, 1000))
def test_tensor_coalesced_equals_per_row_and_each_row_keeps_its_length(shapes, max_rows, max_tokens, planner, seed):
    pipeline, _ = tokens_pipeline(max_batch_rows=max_rows, max_batch_tokens=max_tokens, planner=planner)
    requests = [token_rows(seed + i, rows, length, mask=mask) for i, (rows, length, mask) in enumerate(shapes)]
    together = answers(pipeline, *requests)
    for (rows, length, _), request, got in zip(shapes, requests, together, strict=True):
        states = got["last_hidden_state"]
        assert states.shape == (rows, length, DIM) and states.dtype == np.float32
        for row in range(rows):
            (single,) = answers(pipeline, rows_of(request, row))
            np.testing.assert_array_equal(states[row], single["last_hidden_state"][0])


def test_tensor_rows_of_other_lengths_share_a_pass_padded_with_zeros_and_a_zero_mask():
    runtime = EncoderRuntime()
    pipeline, _ = tokens_pipeline(runtime, planner="greedy", max_padding_ratio="10")
    short, long = token_rows(1, 1, 3), token_rows(2, 1, 7)
    results = answers(pipeline, short, long)
    assert runtime.calls == [(2, 7)]
    fed = runtime.feeds[0]
    np.testing.assert_array_equal(fed["input_ids"][0], np.r_[short["input_ids"][0], [0] * 4])
    np.testing.assert_array_equal(fed["attention_mask"], [[1] * 3 + [0] * 4, [1] * 7])
    assert results[0]["last_hidden_state"].shape == (1, 3, DIM)
    assert results[1]["last_hidden_state"].shape == (1, 7, DIM)


def test_tensor_bad_request_gets_its_own_error_and_neighbours_succeed():
    pipeline, factory = tokens_pipeline()
    good = token_rows(0, 2, 5)
    wrong_dtype = {**token_rows(1, 1, 5), "input_ids": np.ones((1, 5), dtype=np.int32)}
    results = answers(pipeline, good, wrong_dtype, {"input_ids": good["input_ids"]}, good)
    assert results[0]["last_hidden_state"].shape == results[3]["last_hidden_state"].shape == (2, 5, DIM)
    assert str(results[1]) == "input 'input_ids' has dtype int32, expected int64 (TYPE_INT64)"
    assert str(results[2]) == "request has no input 'token_type_ids'"
    assert all(isinstance(r, InvalidInputError) for r in results[1:3])
    assert factory.value("coalesce_request_failures_total") == 2


def test_tensor_failed_pass_fails_only_its_requests():
    runtime = EncoderRuntime(fail_when=lambda feeds: feeds["input_ids"].shape[1] == 30)
    pipeline, _ = tokens_pipeline(runtime)
    results = answers(pipeline, token_rows(0, 1, 3), token_rows(1, 1, 30), token_rows(2, 2, 4))
    assert isinstance(results[1], CoalesceError) and str(results[1]) == "injected failure on a pass of shape [1, 30]"
    assert results[0]["last_hidden_state"].shape == (1, 3, DIM)
    assert results[2]["last_hidden_state"].shape == (2, 4, DIM)


def test_tensor_identical_rows_are_computed_once():
    runtime = EncoderRuntime()
    pipeline, factory = tokens_pipeline(runtime)
    request = token_rows(0, 2, 6)
    with_mask = {**request, "attention_mask": np.ones((2, 6), dtype=np.int64)}  # the mask the backend fills
    results = answers(pipeline, request, request, with_mask, token_rows(9, 1, 6))
    assert factory.value("coalesce_deduplicated_rows_total") == 4
    assert runtime.rows_computed == 3
    for result in results[1:3]:
        assert np.array_equal(result["last_hidden_state"], results[0]["last_hidden_state"])


def test_tensor_cached_rows_are_bit_identical_and_cut_to_their_own_length():
    runtime = EncoderRuntime()
    pipeline, factory = tokens_pipeline(runtime, cache=RowCache(1 << 22), planner="greedy",
                                        max_padding_ratio="100")
    requests = [token_rows(0, 2, 3), token_rows(1, 1, 11)]
    first = answers(pipeline, *requests)
    assert runtime.calls == [(3, 11)]  # one pass, padded to 11
    mixed = [token_rows(0, 2, 3), token_rows(5, 1, 4), token_rows(1, 1, 11)]
    second = answers(pipeline, *mixed)
    assert runtime.calls == [(3, 11), (1, 4)]  # only the new row ran
    assert factory.value("coalesce_cache_hits_total") == 3
    assert second[0]["last_hidden_state"].tobytes() == first[0]["last_hidden_state"].tobytes()
    assert second[2]["last_hidden_state"].tobytes() == first[1]["last_hidden_state"].tobytes()
    assert [r["last_hidden_state"].shape for r in second] == [(2, 3, DIM), (1, 4, DIM), (1, 11, DIM)]
    fresh, _ = tokens_pipeline()
    for request, result in zip(mixed, second, strict=True):
        for row in range(len(request["input_ids"])):
            (single,) = answers(fresh, rows_of(request, row))
            assert result["last_hidden_state"][row].tobytes() == single["last_hidden_state"][0].tobytes()


# -- tensor, two outputs: one per position (cut back), one per row ----------------------------------------------


@settings(max_examples=30, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 12), st.booleans()), min_size=1, max_size=6),
       seed=st.integers(0, 1000))
def test_several_outputs_coalesced_equal_per_row(shapes, seed):
    pipeline, _ = ragged_pipeline()
    requests = [ragged_request(rows, length, seed + i, mask=mask) for i, (rows, length, mask) in enumerate(shapes)]
    together = answers(pipeline, *requests)
    for (rows, length, _), request, got in zip(shapes, requests, together, strict=True):
        assert got["y"].shape == (rows, length, 3) and got["total"].shape == (rows, 2)
        assert got["total"].dtype == np.float64
        np.testing.assert_array_equal(got["total"][:, 1], length)  # the mask the backend filled, not the padding
        for row in range(rows):
            (single,) = answers(pipeline, rows_of(request, row))
            np.testing.assert_array_equal(got["y"][row], single["y"][0])
            np.testing.assert_array_equal(got["total"][row], single["total"][0])


def test_several_outputs_from_the_cache_are_bit_identical():
    runtime = RaggedRuntime()
    pipeline, factory = ragged_pipeline(runtime, cache=RowCache(1 << 20))
    requests = [ragged_request(2, 5, 0), ragged_request(1, 9, 1, mask=True)]
    first = answers(pipeline, *requests)
    second = answers(pipeline, *requests)
    assert runtime.rows_computed == 3
    assert factory.value("coalesce_cache_hits_total") == 3
    for a, b in zip(first, second, strict=True):
        assert sorted(a) == sorted(b) == ["total", "y"]
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes()

