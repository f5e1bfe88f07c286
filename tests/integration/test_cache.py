"""The row cache and in-flight de-duplication in a real server, read back through Triton's metrics."""

import re
import time
import urllib.request

import numpy as np

from coalesce_client import EmbeddingClient


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
    scratch_model("cached", replace={r'\{ key: "runtime"': '{ key: "cache_bytes", value: { string_value: "1048576" } },'
                                                            '\n  { key: "runtime"'})
    http_client.load_model("cached")
    with EmbeddingClient(server.grpc_url, model="cached") as client:
        first = client.embed(["a cached sentence", "another one"])
        # Partial hit, and a duplicate inside the same request.
        second = client.embed(["another one", "a new sentence", "a new sentence", "a cached sentence"])
    with EmbeddingClient(server.grpc_url, model="minilm") as plain:
        reference = plain.embed(["a cached sentence", "another one", "a new sentence"])
    assert first.tobytes() == second[[3, 0]].tobytes()
    np.testing.assert_allclose(second[[3, 0, 1]], reference, atol=1e-6)
    assert second[1].tobytes() == second[2].tobytes()
    settled_metric(server, "coalesce_cache_hits_total", "cached", lambda v: v == 2)
    settled_metric(server, "coalesce_cache_misses_total", "cached", lambda v: v == 3)
    settled_metric(server, "coalesce_deduplicated_rows_total", "cached", lambda v: v == 1)
    settled_metric(server, "coalesce_cache_resident_bytes", "cached", lambda v: v > 3 * 384 * 4)
