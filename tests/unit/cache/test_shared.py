"""The shared (Redis) row-cache tier against a real redis-server: round trips, failing open, recovering.

No Triton here; ``tests/integration/test_shared_cache.py`` runs the same tier inside a server.
"""

import socket
import threading

import numpy as np
import pytest
import redis

from coalesce.launcher import RedisServer, free_port, local_redis_port, redis_urls, start_local_redis
from coalesce.log import Logger
from coalesce.metrics import InMemoryMetricFactory, PipelineMetrics
from coalesce.pipeline import EmbeddingPipeline
from coalesce.settings import Settings
from coalesce.shared_cache import RedisTier, redacted
from tests.unit.test_pipeline import DIM, TableRuntime, enc, rows_computed


class ListSink:
    def __init__(self):
        self.lines = []

    def log_info(self, message):
        self.lines.append(("info", message))

    def log_warn(self, message):
        self.lines.append(("warn", message))

    def log_error(self, message):
        self.lines.append(("error", message))

    def log_verbose(self, message):
        self.lines.append(("verbose", message))


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make_tier(url, *, clock=None, prefix=None, retry_s=5.0, timeout_s=0.2, ttl_s=0.0, log_interval_s=30.0):
    factory = InMemoryMetricFactory()
    sink = ListSink()
    tier = RedisTier(url, dim=DIM, timeout_s=timeout_s, retry_s=retry_s, ttl_s=ttl_s,
                     key_prefix=prefix or f"test-{np.random.default_rng().integers(1 << 30)}:",
                     logger=Logger("m", sink), metrics=PipelineMetrics(factory, model="m", version="1"),
                     clock=clock or FakeClock(), log_interval_s=log_interval_s)
    return tier, factory, sink


def vectors(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


def keys(n, tag="k"):
    return [f"{tag}{i}".encode().ljust(16, b".") for i in range(n)]


def test_round_trip_is_bit_identical_and_counted(redis_server):
    tier, factory, _ = make_tier(redis_server.url)
    stored = vectors(5)
    tier.put_many(keys(5), stored)
    assert tier.flush()
    found = tier.get_many([*keys(5), b"absent-key......"])
    assert found[-1] is None
    assert np.stack(found[:5]).tobytes() == stored.tobytes()
    assert factory.value("coalesce_shared_cache_hits_total") == 5
    assert factory.value("coalesce_shared_cache_misses_total") == 1
    assert factory.value("coalesce_shared_cache_up") == 1
    assert len(factory.observations("coalesce_shared_cache_lookup_seconds")) == 1
    tier.close()


def test_ttl_is_set_on_every_row(redis_server):
    prefix = "ttl-test:"
    tier, _, _ = make_tier(redis_server.url, prefix=prefix, ttl_s=30.0)
    tier.put_many(keys(2), vectors(2))
    assert tier.flush()
    client = redis.Redis.from_url(redis_server.url)
    assert 0 < client.pttl(prefix.encode() + keys(2)[1]) <= 30_000
    client.close()
    tier.close()


def test_a_value_of_the_wrong_width_is_a_miss_not_an_answer(redis_server):
    prefix = "corrupt-test:"
    tier, factory, _ = make_tier(redis_server.url, prefix=prefix)
    client = redis.Redis.from_url(redis_server.url)
    client.set(prefix.encode() + keys(1)[0], b"not a vector")
    client.close()
    assert tier.get_many(keys(1)) == [None]
    assert factory.value("coalesce_shared_cache_errors_total", op="corrupt") == 1
    tier.close()


def test_redis_down_at_load_serves_without_it_and_recovers_when_it_starts():
    clock = FakeClock()
    port = free_port()
    tier, factory, sink = make_tier(f"redis://127.0.0.1:{port}/0", clock=clock, retry_s=5.0)
    assert factory.value("coalesce_shared_cache_errors_total", op="connect") == 1
    assert factory.value("coalesce_shared_cache_up") == 0
    assert not tier.available
    # While it stands aside, nothing touches the network: misses and skipped writes, no new errors.
    assert tier.get_many(keys(3)) == [None] * 3
    tier.put_many(keys(3), vectors(3))
    assert factory.value("coalesce_shared_cache_skipped_rows_total") == 6
    assert factory.value("coalesce_shared_cache_errors_total") == 1
    with RedisServer(port):
        clock.now += 5.0
        assert tier.get_many(keys(3)) == [None] * 3  # tried again: up, and an honest miss
        assert factory.value("coalesce_shared_cache_up") == 1
        tier.put_many(keys(3), vectors(3))
        assert tier.flush()
        assert all(v is not None for v in tier.get_many(keys(3)))
    assert [level for level, _ in sink.lines] == ["warn", "info"]
    assert "connect failed" in sink.lines[0][1] and "reachable again" in sink.lines[1][1]
    tier.close()


def test_errors_are_logged_once_per_interval_with_a_count():
    clock = FakeClock()
    tier, factory, sink = make_tier(f"redis://127.0.0.1:{free_port()}/0", clock=clock, retry_s=1.0,
                                    log_interval_s=30.0)
    for _ in range(5):
        clock.now += 1.0
        tier.get_many(keys(1))
    assert factory.value("coalesce_shared_cache_errors_total") == 6  # connect, then 5 lookups
    assert len(sink.lines) == 1
    clock.now += 30.0
    tier.get_many(keys(1))
    assert len(sink.lines) == 2 and "(6 error(s) since the last message)" in sink.lines[1][1]
    tier.close()


def test_a_redis_that_never_answers_costs_one_timeout_then_stands_aside():
    # A real listening socket that accepts and never replies: a hung Redis.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    clock = FakeClock()
    try:
        tier, factory, _ = make_tier(f"redis://127.0.0.1:{port}/0", clock=clock, timeout_s=0.05)
        assert factory.value("coalesce_shared_cache_errors_total", op="connect") == 1
        clock.now += 10.0
        assert tier.get_many(keys(2)) == [None, None]
        assert factory.value("coalesce_shared_cache_errors_total", op="get") == 1
        tier.put_many(keys(2), vectors(2))  # skipped: the tier stands aside after that timeout
        assert factory.value("coalesce_shared_cache_skipped_rows_total") == 2
        tier.close(timeout_s=0.5)
    finally:
        listener.close()


def test_redacted_hides_the_password():
    assert redacted("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redacted("redis://host:6379/0") == "redis://host:6379/0"


def pipeline_on(tokenizer, url, runtime, *, prefix, **params):
    params.setdefault("cost_model", "0.001,0.0001,0")
    settings = Settings.from_parameters({k: str(v) for k, v in params.items()}, model_name="m",
                                        max_batch_size=64, embedding_dim=DIM)
    factory = InMemoryMetricFactory()
    metrics = PipelineMetrics(factory, model="m", version="1")
    shared = RedisTier(url, dim=DIM, timeout_s=0.2, retry_s=0.0, key_prefix=prefix, metrics=metrics)
    return EmbeddingPipeline(settings, runtime, tokenizer, metrics, shared=shared, fingerprint=b"f" * 32), factory


def test_a_second_pipeline_on_the_same_redis_starts_warm(tokenizer, redis_server):
    prefix = "warm-test:"
    first_runtime, second_runtime = TableRuntime(), TableRuntime()
    first, _ = pipeline_on(tokenizer, redis_server.url, first_runtime, prefix=prefix)
    requests = [enc(["alpha", "beta"]), enc(["gamma " * 40, "alpha"])]
    computed = first.embed(requests)
    assert first.shared.flush()
    second, factory = pipeline_on(tokenizer, redis_server.url, second_runtime, prefix=prefix)
    warm = second.embed(requests)
    assert rows_computed(second_runtime) == 0
    assert factory.value("coalesce_shared_cache_hits_total") == 3
    for a, b in zip(computed, warm, strict=True):
        assert a.tobytes() == b.tobytes()
    first.close()
    second.close()


def test_in_process_tier_in_front_keeps_shared_hits(tokenizer, redis_server):
    from coalesce.cache import RowCache

    prefix = "tiers-test:"
    writer, _ = pipeline_on(tokenizer, redis_server.url, TableRuntime(), prefix=prefix)
    writer.embed([enc(["one", "two"])])
    assert writer.shared.flush()
    settings = writer.settings
    factory = InMemoryMetricFactory()
    metrics = PipelineMetrics(factory, model="m", version="1")
    runtime = TableRuntime()
    reader = EmbeddingPipeline(settings, runtime, tokenizer, metrics, cache=RowCache(1 << 20), fingerprint=b"f" * 32,
                               shared=RedisTier(redis_server.url, dim=DIM, timeout_s=0.2, retry_s=0.0,
                                                key_prefix=prefix, metrics=metrics))
    reader.embed([enc(["one", "two", "three"])])
    reader.embed([enc(["one", "two", "three"])])
    assert rows_computed(runtime) == 1  # "three", once
    assert factory.value("coalesce_shared_cache_hits_total") == 2
    assert factory.value("coalesce_cache_hits_total") == 3  # the second call: all in process
    writer.close()
    reader.close()


def test_redis_killed_mid_run_never_fails_a_request_and_the_cache_comes_back(tokenizer):
    port = free_port()
    server = RedisServer(port).start()
    runtime = TableRuntime()
    pipeline, factory = pipeline_on(tokenizer, f"redis://127.0.0.1:{port}/0", runtime, prefix="kill-test:")
    texts = [f"sentence number {i}" for i in range(8)]
    errors: list[object] = []
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            for result in pipeline.embed([enc(texts[:4]), enc(texts[4:])]):
                if not isinstance(result, np.ndarray):
                    errors.append(result)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        server.kill()
        for _ in range(200):  # bounded: until the tier has seen the outage
            if factory.value("coalesce_shared_cache_errors_total") > 0:
                break
            stop.wait(0.01)
        server.start()
        hits_before = factory.value("coalesce_shared_cache_hits_total")
        for _ in range(500):  # bounded: until rows are written and read back again
            if factory.value("coalesce_shared_cache_hits_total") > hits_before:
                break
            stop.wait(0.01)
    finally:
        stop.set()
        worker.join(30)
        pipeline.close()
        server.stop()
    assert errors == []
    assert factory.value("coalesce_shared_cache_errors_total") > 0
    assert factory.value("coalesce_shared_cache_hits_total") > hits_before


def test_serve_starts_redis_for_loopback_urls_nobody_answers(tmp_path):
    port = free_port()
    model = tmp_path / "shared"
    model.mkdir()
    model.joinpath("config.pbtxt").write_text(
        'name: "shared"\nparameters [\n  { key: "redis_url", value: { string_value: "redis://127.0.0.1:PORT/0" } },\n'
        '  { key: "cache_bytes", value: { string_value: "0" } }\n]\n'.replace("PORT", str(port)))
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "config.pbtxt").write_text(
        'parameters [ { key: "redis_url", value: { string_value: "redis://cache.example:6379/0" } } ]')
    assert redis_urls(tmp_path) == ["redis://cache.example:6379/0", f"redis://127.0.0.1:{port}/0"]
    assert local_redis_port("redis://cache.example:6379/0") is None
    assert local_redis_port("redis://localhost/0") == 6379
    started = start_local_redis(tmp_path)
    try:
        assert [s.port for s in started] == [port]
        assert start_local_redis(tmp_path) == []  # already answering: left alone
        assert redis.Redis(port=port).ping()
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def tokenizer(version_dir):
    from coalesce.tokenizer import TextTokenizer

    return TextTokenizer(version_dir / "tokenizer.json", 256)
