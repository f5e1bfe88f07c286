"""The shared (Redis) row-cache tier inside a real server: warm after a reload, fail-open when Redis dies.

A reload starts a new stub process with empty memory, so rows it answers without
computing came from Redis: the same as a second server on the same Redis.
"""

import threading

import numpy as np
import pytest
import redis

from coalesce_client import EmbeddingClient
from coalesce_tools.launcher import RedisServer
from tests.integration.conftest import FIXED_COST, infer
from tests.integration.test_cache import metric, settled_metric, wait_for

MODEL = "shared"
PREFIX = "itest:"


@pytest.fixture(scope="module")
def redis_for_model():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shared_model(server, repository, redis_for_model):
    import tritonclient.http as httpclient

    from tests.integration.conftest import add_model

    parameters = {"cache_bytes": "0", "redis_url": redis_for_model.url, "redis_timeout_ms": "200",
                  "redis_retry_s": "0.2", "redis_key_prefix": PREFIX}
    add_model(repository, MODEL, parameters=parameters)
    client = httpclient.InferenceServerClient(server.http_url)
    client.load_model(MODEL)
    yield MODEL
    client.unload_model(MODEL)
    client.close()


def stored_rows(url):
    client = redis.Redis.from_url(url)
    try:
        return len(client.keys(PREFIX + "*"))
    finally:
        client.close()



def test_a_reloaded_model_starts_warm_from_redis(server, shared_model, redis_for_model, http_client):
    texts = ["shared tier one", "shared tier two", "shared tier three"]
    with EmbeddingClient(server.grpc_url, model=shared_model) as client:
        computed = client.embed(texts)
    assert wait_for(lambda: stored_rows(redis_for_model.url) >= 3), "rows never reached Redis"
    settled_metric(server, "coalesce_shared_cache_misses_total", shared_model, lambda v: v == 3)
    http_client.load_model(shared_model)  # a new instance: a new stub process, nothing in memory
    with EmbeddingClient(server.http_url, model=shared_model, protocol="http") as client:
        warm = client.embed(texts)
    assert warm.tobytes() == computed.tobytes()
    settled_metric(server, "coalesce_shared_cache_hits_total", shared_model, lambda v: v >= 3)


def test_a_tensor_model_with_rows_of_many_lengths_starts_warm_too(server, scratch_model, redis_for_model,
                                                                   http_client):
    """Values of outputs that follow each row's length are stored and checked per row."""
    scratch_model("shared_tokens", source="minilm_tokens",
                  parameters={"redis_url": redis_for_model.url, "redis_key_prefix": "itest-tokens:",
                              "cost_model": FIXED_COST})
    http_client.load_model("shared_tokens")
    requests = [[101, 7592, 102], [101, 7592, 2088, 2003, 102], [101, 102]]

    def ask():
        return [infer(server, "grpc", "shared_tokens",
                      [("input_ids", np.array([ids], dtype=np.int64), "INT64"),
                       ("token_type_ids", np.zeros((1, len(ids)), dtype=np.int64), "INT64")],
                      ["last_hidden_state"])["last_hidden_state"] for ids in requests]

    computed = ask()
    assert wait_for(lambda: len(redis.Redis.from_url(redis_for_model.url).keys("itest-tokens:*")) >= 3)
    http_client.load_model("shared_tokens")  # a new stub: only Redis can answer without computing
    warm = ask()
    assert [w.tobytes() for w in warm] == [c.tobytes() for c in computed]
    assert [w.shape for w in warm] == [(1, len(ids), 384) for ids in requests]
    settled_metric(server, "coalesce_shared_cache_hits_total", "shared_tokens", lambda v: v >= 3)


def test_redis_killed_mid_run_fails_no_request_and_the_tier_comes_back(server, shared_model, redis_for_model):
    errors: list[BaseException] = []
    answered = [0]
    stop = threading.Event()

    def traffic(offset):
        with EmbeddingClient(server.grpc_url, model=shared_model) as client:
            i = 0
            while not stop.is_set() and i < 2000:  # bounded
                try:
                    vectors = client.embed([f"outage text {offset} {i % 20}", f"outage text shared {i % 5}"])
                    assert vectors.shape == (2, 384) and np.isfinite(vectors).all()
                    answered[0] += 1
                except BaseException as exc:
                    errors.append(exc)
                i += 1

    workers = [threading.Thread(target=traffic, args=(n,)) for n in range(2)]
    for worker in workers:
        worker.start()
    try:
        assert wait_for(lambda: answered[0] >= 20)
        redis_for_model.kill()
        assert wait_for(lambda: metric(server, "coalesce_shared_cache_errors_total", shared_model) > 0), \
            "the model never noticed Redis was gone"
        during = answered[0]
        assert wait_for(lambda: answered[0] >= during + 20), "requests stopped while Redis was down"
        redis_for_model.start()  # back on the same port, empty
        hits = metric(server, "coalesce_shared_cache_hits_total", shared_model)
        assert wait_for(lambda: metric(server, "coalesce_shared_cache_hits_total", shared_model) > hits), \
            "the shared tier never came back after Redis restarted"
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
    assert errors == []
    settled_metric(server, "coalesce_shared_cache_up", shared_model, lambda v: v == 1)
    assert "shared cache redis://127.0.0.1" in server.log_text()
