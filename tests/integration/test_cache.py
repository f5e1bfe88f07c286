"""The row cache and in-flight de-duplication in a real server, read back through Triton's metrics."""

import re
import urllib.request

import numpy as np

from coalesce_client import EmbeddingClient


def metric(server, name, model):
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    pattern = re.compile(rf'^{name}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


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
    assert metric(server, "coalesce_cache_hits_total", "cached") == 2
    assert metric(server, "coalesce_cache_misses_total", "cached") == 3
    assert metric(server, "coalesce_deduplicated_rows_total", "cached") == 1
    assert metric(server, "coalesce_cache_resident_bytes", "cached") > 3 * 384 * 4
