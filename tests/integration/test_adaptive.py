"""Adaptive scheduling in a real server: deferred responses, refusals with reasons, cancellation, tenants.

No timing assertions: each check is about which answer a request gets, not how fast.
"""

import re
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from coalesce_client import EmbeddingClient
from tests.integration.conftest import EXACT_MODEL, FP32_NO_CACHE, add_model
from tests.integration.test_cache import metric, settled_metric

MODEL = "adaptive"
LIMITED = "adaptive_limited"


def adaptive_config(**parameters):
    parameters = {"scheduling": "adaptive", **parameters}
    entries = "".join(f'{{ key: "{k}", value: {{ string_value: "{v}" }} }},\n  ' for k, v in parameters.items())
    return {
        r"max_queue_delay_microseconds: \d+": "max_queue_delay_microseconds: 0",
        r'\{ key: "runtime"': entries + '{ key: "runtime"',
    }


@pytest.fixture(scope="module")
def adaptive_models(server, repository):
    # FP32 without a row cache: each request's vectors are held to minilm_fp32's exactly (an INT8 vector may
    # differ in its last digits with the rows beside it in a pass), and every row is scheduled, none cached.
    add_model(repository, MODEL, replace=adaptive_config(target_p99_ms="60000"), parameters=FP32_NO_CACHE)
    add_model(
        repository,
        LIMITED,
        replace=adaptive_config(target_p99_ms="60000", tenant_max_rows_per_s="noisy:3", max_dispatch_rows="1"),
        parameters=FP32_NO_CACHE,
    )
    client = httpclient.InferenceServerClient(server.http_url)
    for name in (MODEL, LIMITED):
        client.load_model(name)
    yield
    for name in (MODEL, LIMITED):
        client.unload_model(name)
    client.close()


def cancelled(server):
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    pattern = re.compile(
        rf'^coalesce_rejections_total\{{(?=[^}}]*model="{LIMITED}")(?=[^}}]*reason="cancelled")'
        r"[^}]*\} (\S+)$",
        re.M,
    )
    return sum(float(v) for v in pattern.findall(text))


def text_input(texts, module=grpcclient):
    tensor = module.InferInput("TEXT", [len(texts), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=np.object_))
    return tensor


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_every_concurrent_request_is_answered_with_the_same_vectors(server, adaptive_models, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    batches = [[f"adaptive request {i} row {j}" for j in range(1 + i % 3)] for i in range(48)]
    with EmbeddingClient(url, protocol=protocol, model=MODEL) as client:
        answers = client.embed_many(batches, max_in_flight=16)
    with EmbeddingClient(server.grpc_url, model=EXACT_MODEL) as plain:
        expected = plain.embed_many(batches, max_in_flight=16)
    for got, want in zip(answers, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    rows = sum(len(b) for b in batches)
    settled_metric(server, "coalesce_tenant_rows_total", MODEL, lambda v: v >= rows)
    assert metric(server, "coalesce_rejections_total", MODEL) == 0


def test_a_deadline_that_cannot_be_met_is_refused_at_once_with_unavailable(server, adaptive_models):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.infer(MODEL, [text_input(["a request with a one-microsecond budget"])], timeout=1)
    finally:
        client.close()
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    assert "cannot meet its deadline" in info.value.message()
    settled_metric(server, "coalesce_rejections_total", MODEL, lambda v: v >= 1)


def test_bad_request_parameters_are_invalid_arg(server, adaptive_models):
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.infer(MODEL, [text_input(["x"], httpclient)], parameters={"priority_level": "urgent"})
    finally:
        client.close()
    assert "'priority_level' must be an integer" in info.value.message()


def test_a_rate_limited_tenant_is_refused_and_the_others_are_served(server, adaptive_models):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    outcomes = {"noisy": [], "quiet": []}
    try:
        for i in range(12):
            for tenant in ("noisy", "quiet"):
                try:
                    result = client.infer(LIMITED, [text_input([f"{tenant} {i}"])], parameters={"tenant": tenant})
                    outcomes[tenant].append(result.as_numpy("EMBEDDING").shape)
                except InferenceServerException as exc:
                    outcomes[tenant].append((exc.status(), exc.message()))
    finally:
        client.close()
    assert outcomes["quiet"] == [(1, 384)] * 12
    refused = [o for o in outcomes["noisy"] if o != (1, 384)]
    assert refused, "the noisy tenant was never limited"
    assert all(
        status == "StatusCode.UNAVAILABLE" and "tenant 'noisy' is over its rate limit (3 rows/s)" in message
        for status, message in refused
    )


def steady(read, *, quiet_s=0.3, timeout_s=30.0):
    """``read()`` once it stopped changing for ``quiet_s`` (the backend sends its metrics every 100 ms)."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = read()
        if now == value:
            return value
        value = now
    raise AssertionError(f"the value kept changing (last {value})")


def test_cancelled_requests_are_dropped_before_they_are_computed(server, adaptive_models):
    """Requests cancelled while queued are answered CANCELLED and never reach a forward pass."""
    sent = 48
    client = grpcclient.InferenceServerClient(server.grpc_url)
    long_text = "a long document that takes a while to embed " * 40
    done = threading.Semaphore(0)
    errors = []

    def callback(result, error):
        errors.append(error)
        done.release()

    cancelled_before = steady(lambda: cancelled(server))
    computed_before = steady(lambda: metric(server, "coalesce_rows_total", LIMITED))
    try:
        # One row per dispatch: the queue holds the later requests while the first ones run (enough of
        # them that a fast machine has not answered 8 before the metric shows them queued).
        contexts = [
            client.async_infer(LIMITED, [text_input([f"{i} {long_text}"])], callback, parameters={"tenant": "quiet"})
            for i in range(sent)
        ]
        # Cancel only once the backend holds them queued (no race on a sleep).
        settled_metric(server, "coalesce_queue_requests", LIMITED, lambda v: v >= 8)
        for context in contexts[4:]:
            context.cancel()
        for _ in contexts:
            assert done.acquire(timeout=120)
    finally:
        client.close()
    dropped = steady(lambda: cancelled(server)) - cancelled_before
    assert dropped >= 1, "no queued request was dropped as cancelled"
    assert sum(error is None for error in errors) >= 4  # the four not cancelled were answered
    # rows_total counts the rows that reached the pipeline: a dropped request that had been computed
    # would push it past sent - dropped. (Fewer is fine: a cancellation may also stop a request
    # before the backend sees it.) Every answered request was computed.
    computed = steady(lambda: metric(server, "coalesce_rows_total", LIMITED)) - computed_before
    assert sum(error is None for error in errors) <= computed <= sent - dropped


def test_the_client_sends_tenant_and_deadline_and_names_refusals(server, adaptive_models):
    from coalesce_client import RequestRejectedError

    with EmbeddingClient(server.http_url, protocol="http", model=MODEL, tenant="acme", priority_level=2) as client:
        assert client.embed(["a tenant's text"]).shape == (1, 384)
    with (
        EmbeddingClient(server.grpc_url, model=MODEL, deadline_s=1e-6) as client,
        pytest.raises(RequestRejectedError, match="cannot meet its deadline"),
    ):
        client.embed(["too little time"])
    settled_metric(server, "coalesce_tenant_rows_total", MODEL, lambda v: v >= 1)
