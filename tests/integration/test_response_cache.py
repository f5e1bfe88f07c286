"""Triton's own response cache in front of a coalesce model: a whole-request hash, next to our row cache."""

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from coalesce_client import EmbeddingClient
from coalesce_tools.launcher import ServerOptions, TritonServer
from tests.integration.conftest import add_model


@pytest.fixture(scope="module")
def cached_server(tmp_path_factory, version_dir):
    repo = tmp_path_factory.mktemp("response_cache_repo")
    add_model(repo, "minilm_rc", replace={r"\ninstance_group": "\nresponse_cache { enable: true }\ninstance_group"})
    options = ServerOptions.on_free_ports(repo, response_cache_bytes=8 << 20)
    with TritonServer(options) as server:
        yield server


def stats(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        # Statistics are an admin API: the server restricts them (model control none: a key only it knows).
        entry = client.get_inference_statistics("minilm_rc", headers=server.grpc_admin_headers,
                                                as_json=True)["model_stats"][0]
    finally:
        client.close()
    hits = int(entry["inference_stats"].get("cache_hit", {}).get("count", 0))
    return hits, int(entry.get("execution_count", 0))


def test_identical_requests_hit_and_one_changed_row_misses(cached_server):
    with EmbeddingClient(cached_server.grpc_url, model="minilm_rc") as client:
        first = client.embed(["a", "b", "c"])
        again = client.embed(["a", "b", "c"])
        changed = client.embed(["a", "b", "d"])  # one row differs: Triton's hash of the request misses
    assert again.tobytes() == first.tobytes()
    np.testing.assert_allclose(changed[:2], first[:2], atol=1e-6)
    hits, executions = stats(cached_server)
    assert hits == 1
    assert executions == 2
