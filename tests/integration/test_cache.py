"""The row cache and in-flight de-duplication in a real server, read back through Triton's metrics."""

import re
import time
import urllib.request

import numpy as np
import pytest

from coalesce_client import EmbeddingClient
from coalesce_client.client import encode_texts
from tests.conftest import INT8_SCORE_ATOL
from tests.integration.conftest import EXACT_MODEL, FIXED_COST, FP32_NO_CACHE, infer


def metric(server, name, model):
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    pattern = re.compile(rf'^{name}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


def wait_for(condition, timeout_s=30.0):
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def settled_metric(server, name, model, condition, timeout_s=30.0):
    """The metric's value once ``condition`` holds for it (the backend sends its metrics every 100 ms).

    Fails the test with the last value seen if it never does within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric(server, name, model)
        if condition(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} of model '{model}' stayed at {value}")
        time.sleep(0.05)


def test_cached_rows_match_computed_and_are_counted(server, scratch_model, http_client):
    # FP32 with a small cache, so that rows computed here can be held to minilm_fp32's exactly.
    scratch_model("cached", parameters={**FP32_NO_CACHE, "cache_bytes": "1048576"})
    http_client.load_model("cached")
    with EmbeddingClient(server.grpc_url, model="cached") as client:
        first = client.embed(["a cached sentence", "another one"])
        # Partial hit, and a duplicate inside the same request.
        second = client.embed(["another one", "a new sentence", "a new sentence", "a cached sentence"])
    with EmbeddingClient(server.grpc_url, model=EXACT_MODEL) as plain:
        reference = plain.embed(["a cached sentence", "another one", "a new sentence"])
    assert first.tobytes() == second[[3, 0]].tobytes()
    np.testing.assert_allclose(second[[3, 0, 1]], reference, atol=1e-6)
    assert second[1].tobytes() == second[2].tobytes()
    settled_metric(server, "coalesce_cache_hits_total", "cached", lambda v: v == 2)
    settled_metric(server, "coalesce_cache_misses_total", "cached", lambda v: v == 3)
    settled_metric(server, "coalesce_deduplicated_rows_total", "cached", lambda v: v == 1)
    settled_metric(server, "coalesce_cache_resident_bytes", "cached", lambda v: v > 3 * 384 * 4)


def test_the_shipped_minilm_answers_a_repeated_text_from_its_row_cache(server):
    """minilm as shipped (INT8, 64 MiB row cache): a text seen before is not computed again, and its bytes repeat."""
    text = f"a text the shipped row cache has not seen, {time.time_ns()}"
    hits = metric(server, "coalesce_cache_hits_total", "minilm")
    misses = metric(server, "coalesce_cache_misses_total", "minilm")
    passes = metric(server, "coalesce_forward_passes_total", "minilm")
    with EmbeddingClient(server.grpc_url, model="minilm") as client:
        first = client.embed([text])
        settled_metric(server, "coalesce_cache_misses_total", "minilm", lambda v: v == misses + 1)
        computed = settled_metric(server, "coalesce_forward_passes_total", "minilm", lambda v: v == passes + 1)
        again = client.embed([text])
    assert again.tobytes() == first.tobytes()
    settled_metric(server, "coalesce_cache_hits_total", "minilm", lambda v: v == hits + 1)
    assert metric(server, "coalesce_cache_misses_total", "minilm") == misses + 1
    assert metric(server, "coalesce_forward_passes_total", "minilm") == computed  # no pass for the repeat


def _classify_rows(rows):
    return [
        ("TEXT", encode_texts([q for q, _ in rows]), "BYTES"),
        ("TEXT_PAIR", encode_texts([d for _, d in rows]), "BYTES"),
    ]


def _token_rows(rows):
    return [
        ("input_ids", np.array(rows, dtype=np.int64), "INT64"),
        ("token_type_ids", np.zeros((len(rows), len(rows[0])), dtype=np.int64), "INT64"),
    ]


def _digit_rows(rows):
    return [("image", np.stack([np.full((8, 8), v, dtype=np.float32) for v in rows]), "FP32")]


#: Per task: example model, output, how a request of rows is made, a first request and a second one
#: holding two of its rows (in another order), one new row and a duplicate of that new row.
TASK_CASES = {
    "classify": (
        "minilm_cross_encoder",
        "SCORES",
        _classify_rows,
        [("q", "first document"), ("q", "second document")],
        [("q", "second document"), ("q", "new"), ("q", "new"), ("q", "first document")],
    ),
    "similarity": (
        "minilm_rerank",
        "SCORES",
        _classify_rows,
        [("q", "first document"), ("q", "second document")],
        [("q", "second document"), ("q", "new"), ("q", "new"), ("q", "first document")],
    ),
    "tensor_variable": (
        "minilm_tokens",
        "last_hidden_state",
        _token_rows,
        [[101, 2000, 102], [101, 3000, 102]],
        [[101, 3000, 102], [101, 4000, 102], [101, 4000, 102], [101, 2000, 102]],
    ),
    "tensor_fixed": ("digits", "logits", _digit_rows, [1.0, 2.0], [2.0, 5.0, 5.0, 1.0]),
}
#: How close cached rows are to the source model's computed ones: minilm_rerank is INT8, whose scores move with the
#: rows beside them (the cache holds its first computation, bit for bit).
TOLERANCE = {"similarity": INT8_SCORE_ATOL}


@pytest.mark.parametrize("case", sorted(TASK_CASES))
def test_every_task_answers_cached_and_duplicate_rows_bit_identical(server, scratch_model, http_client, case):
    source, output, make, first_rows, second_rows = TASK_CASES[case]
    name = f"cached_{case}"
    scratch_model(name, source=source, parameters={"cache_bytes": "4194304", "cost_model": FIXED_COST})
    http_client.load_model(name)
    first = infer(server, "grpc", name, make(first_rows), [output])[output]
    second = infer(server, "grpc", name, make(second_rows), [output])[output]
    plain = infer(server, "grpc", source, make(second_rows), [output])[output]  # the same rows, no cache
    assert second[3].tobytes() == first[0].tobytes() and second[0].tobytes() == first[1].tobytes()
    assert second[1].tobytes() == second[2].tobytes()
    np.testing.assert_allclose(second, plain, atol=TOLERANCE.get(case, 1e-5))
    settled_metric(server, "coalesce_cache_hits_total", name, lambda v: v == 2)
    settled_metric(server, "coalesce_cache_misses_total", name, lambda v: v == 3)
    settled_metric(server, "coalesce_deduplicated_rows_total", name, lambda v: v == 1)
