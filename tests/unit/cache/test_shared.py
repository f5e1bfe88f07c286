"""The shared (Redis) row-cache tier against a real redis-server: round trips, failing open, recovering.

No Triton here; ``tests/integration/test_shared_cache.py`` runs the same tier inside a server.
"""

import socket
import threading

import numpy as np
import redis

from coalesce.cache.memory import RowCache
from coalesce.cache.shared import RedisTier, _decode, layout_bytes, redacted
from coalesce.observability.log import Logger
from coalesce.observability.metrics import InMemoryMetricFactory, PipelineMetrics
from coalesce_tools.launcher import RedisServer, free_port, local_redis_port, redis_urls, start_local_redis
from tests.unit.fakes import (
    DIM,
    ClassifierRuntime,
    EncoderRuntime,
    ListSink,
    RaggedRuntime,
    answers,
    classify_pipeline,
    embedding_pipeline,
    metrics,
    ragged_pipeline,
    ragged_request,
    texts,
)

#: One row of the embedding task: a float32 vector.
VECTOR = ((np.dtype(np.float32), (DIM,)),)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


#: The secret test tiers sign their values with.
SECRET = b"unit-test secret"


def make_tier(url, *, clock=None, prefix=None, retry_s=5.0, timeout_s=0.2, ttl_s=0.0, log_interval_s=30.0,
              secret=SECRET, **options):
    factory = InMemoryMetricFactory()
    sink = ListSink()
    tier = RedisTier(url, timeout_s=timeout_s, retry_s=retry_s, ttl_s=ttl_s, mac_secret=secret, **options,
                     key_prefix=prefix or f"test-{np.random.default_rng().integers(1 << 30)}:",
                     logger=Logger("m", sink), metrics=PipelineMetrics(factory, model="m", version="1"),
                     clock=clock or FakeClock(), log_interval_s=log_interval_s)
    return tier, factory, sink


def vectors(n, seed=0):
    """``n`` rows of one output each (a vector)."""
    return [(v,) for v in np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)]


def layouts(n):
    return [VECTOR] * n


def keys(n, tag="k"):
    return [f"{tag}{i}".encode().ljust(16, b".") for i in range(n)]


def test_round_trip_is_bit_identical_and_counted(redis_server):
    tier, factory, _ = make_tier(redis_server.url)
    stored = vectors(5)
    tier.put_many(keys(5), stored)
    assert tier.flush()
    found = tier.get_many([*keys(5), b"absent-key......"], layouts(6))
    assert found[-1] is None
    for got, want in zip(found[:5], stored, strict=True):
        assert len(got) == 1 and got[0].dtype == np.float32 and got[0].tobytes() == want[0].tobytes()
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


def test_a_value_of_the_wrong_size_is_a_miss_not_an_answer(redis_server):
    prefix = "corrupt-test:"
    tier, factory, _ = make_tier(redis_server.url, prefix=prefix)
    client = redis.Redis.from_url(redis_server.url)
    client.set(prefix.encode() + keys(2)[0], b"not a vector")
    client.set(prefix.encode() + keys(2)[1], np.zeros(DIM + 1, dtype=np.float32).tobytes())  # one float too many
    client.close()
    assert tier.get_many(keys(2), layouts(2)) == [None, None]
    assert factory.value("coalesce_shared_cache_errors_total", op="corrupt") == 2
    assert factory.value("coalesce_shared_cache_hits_total") == 0
    tier.close()


SEVERAL = ((np.dtype(np.float32), (5, 3)), (np.dtype(np.float64), (2,)), (np.dtype(np.int64), ()))


def test_decode_refuses_a_value_of_the_wrong_size():
    assert layout_bytes(SEVERAL) == 5 * 3 * 4 + 2 * 8 + 8
    good = bytes(layout_bytes(SEVERAL))
    assert _decode(good, SEVERAL) is not None
    assert _decode(good[:-1], SEVERAL) is None
    assert _decode(good + b"\x00", SEVERAL) is None
    assert _decode(b"", SEVERAL) is None
    assert _decode(b"", ((np.dtype(np.float32), (0, 3)),)) is not None  # an empty output is 0 bytes


def test_decode_lays_out_several_outputs_in_order():
    y = np.arange(15, dtype=np.float32).reshape(5, 3)
    total = np.array([2.5, -1.0])
    count = np.array(7, dtype=np.int64)
    value = y.tobytes() + total.tobytes() + count.tobytes()
    got = _decode(value, SEVERAL)
    assert [(a.dtype, a.shape) for a in got] == [(np.float32, (5, 3)), (np.float64, (2,)), (np.int64, ())]
    for have, want in zip(got, (y, total, count), strict=True):
        np.testing.assert_array_equal(have, want)
    assert not got[0].flags.writeable  # views of the value read from Redis: never changed in place


def test_rows_of_several_outputs_round_trip(redis_server):
    tier, factory, _ = make_tier(redis_server.url)
    rng = np.random.default_rng(4)
    rows = [(rng.standard_normal((n, 3)).astype(np.float32), rng.standard_normal(2)) for n in (1, 4, 9)]
    row_layouts = [tuple((a.dtype, a.shape) for a in row) for row in rows]
    tier.put_many(keys(3), rows)
    assert tier.flush()
    found = tier.get_many(keys(3), row_layouts)
    for got, want in zip(found, rows, strict=True):
        assert [(a.dtype, a.shape) for a in got] == [(a.dtype, a.shape) for a in want]
        assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want, strict=True))
    # Asked with another row length, the same value is a miss: the row's layout is part of the check.
    assert tier.get_many(keys(1), [((np.dtype(np.float32), (2, 3)), (np.dtype(np.float64), (2,)))]) == [None]
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
    assert tier.get_many(keys(3), layouts(3)) == [None] * 3
    tier.put_many(keys(3), vectors(3))
    assert factory.value("coalesce_shared_cache_skipped_rows_total") == 6
    assert factory.value("coalesce_shared_cache_errors_total") == 1
    with RedisServer(port):
        clock.now += 5.0
        assert tier.get_many(keys(3), layouts(3)) == [None] * 3  # tried again: up, and an honest miss
        assert factory.value("coalesce_shared_cache_up") == 1
        tier.put_many(keys(3), vectors(3))
        assert tier.flush()
        assert all(v is not None for v in tier.get_many(keys(3), layouts(3)))
    assert [level for level, _ in sink.lines] == ["warn", "info"]
    assert "connect failed" in sink.lines[0][1] and "reachable again" in sink.lines[1][1]
    tier.close()


def test_errors_are_logged_once_per_interval_with_a_count():
    clock = FakeClock()
    tier, factory, sink = make_tier(f"redis://127.0.0.1:{free_port()}/0", clock=clock, retry_s=1.0,
                                    log_interval_s=30.0)
    for _ in range(5):
        clock.now += 1.0
        tier.get_many(keys(1), layouts(1))
    assert factory.value("coalesce_shared_cache_errors_total") == 6  # connect, then 5 lookups
    assert len(sink.lines) == 1
    clock.now += 30.0
    tier.get_many(keys(1), layouts(1))
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
        assert tier.get_many(keys(2), layouts(2)) == [None, None]
        assert factory.value("coalesce_shared_cache_errors_total", op="get") == 1
        tier.put_many(keys(2), vectors(2))  # skipped: the tier stands aside after that timeout
        assert factory.value("coalesce_shared_cache_skipped_rows_total") == 2
        tier.close(timeout_s=0.5)
    finally:
        listener.close()


def test_redacted_hides_the_password():
    assert redacted("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redacted("redis://host:6379/0") == "redis://host:6379/0"


def shared_tier(url, prefix, recorded):
    return RedisTier(url, timeout_s=0.2, retry_s=0.0, key_prefix=prefix, metrics=recorded[0], mac_secret=SECRET)


def embed(pipeline, *requests):
    return answers(pipeline, *({"TEXT": texts(*request)} for request in requests))


def embedding_on(url, runtime, *, prefix, cache=None):
    recorded = metrics()
    return embedding_pipeline(runtime, shared=shared_tier(url, prefix, recorded), cache=cache,
                              pipeline_metrics=recorded)


def test_a_second_pipeline_on_the_same_redis_starts_warm(redis_server):
    prefix = "warm-test:"
    first_runtime, second_runtime = EncoderRuntime(), EncoderRuntime()
    first, _ = embedding_on(redis_server.url, first_runtime, prefix=prefix)
    requests = [["alpha", "beta"], ["gamma " * 40, "alpha"]]
    computed = embed(first, *requests)
    assert first.shared.flush()
    second, factory = embedding_on(redis_server.url, second_runtime, prefix=prefix)
    warm = embed(second, *requests)
    assert second_runtime.feeds == []
    assert factory.value("coalesce_shared_cache_hits_total") == 3
    for a, b in zip(computed, warm, strict=True):
        assert a["EMBEDDING"].tobytes() == b["EMBEDDING"].tobytes()
    first.close()
    second.close()


def test_in_process_tier_in_front_keeps_shared_hits(redis_server):
    prefix = "tiers-test:"
    writer, _ = embedding_on(redis_server.url, EncoderRuntime(), prefix=prefix)
    embed(writer, ["one", "two"])
    assert writer.shared.flush()
    runtime = EncoderRuntime()
    reader, factory = embedding_on(redis_server.url, runtime, prefix=prefix, cache=RowCache(1 << 20))
    embed(reader, ["one", "two", "three"])
    embed(reader, ["one", "two", "three"])
    assert runtime.rows_computed == 1  # "three", once
    assert factory.value("coalesce_shared_cache_hits_total") == 2
    assert factory.value("coalesce_cache_hits_total") == 3  # the second call: all in process
    writer.close()
    reader.close()


def test_a_pair_model_starts_warm_from_redis(redis_server):
    prefix = "pairs-test:"
    requests = [{"TEXT": texts("q", "q"), "TEXT_PAIR": texts("first doc", "second doc")}, {"TEXT": texts("q")}]
    recorded = metrics()
    first, _ = classify_pipeline(ClassifierRuntime(), shared=shared_tier(redis_server.url, prefix, recorded))
    computed = answers(first, *requests)
    assert first.shared.flush()
    runtime, recorded = ClassifierRuntime(), metrics()
    second, factory = classify_pipeline(runtime, shared=shared_tier(redis_server.url, prefix, recorded),
                                        pipeline_metrics=recorded)
    warm = answers(second, *requests)
    assert runtime.feeds == [] and factory.value("coalesce_shared_cache_hits_total") == 3
    for a, b in zip(computed, warm, strict=True):
        assert a["SCORES"].tobytes() == b["SCORES"].tobytes()
    first.close()
    second.close()


def test_rows_of_every_length_and_several_outputs_start_warm_from_redis(redis_server):
    prefix = "ragged-test:"
    requests = [ragged_request(2, 3, 0), ragged_request(1, 11, 1, mask=True), ragged_request(3, 1, 2)]
    recorded = metrics()
    first, _ = ragged_pipeline(RaggedRuntime(), shared=shared_tier(redis_server.url, prefix, recorded))
    computed = answers(first, *requests)
    assert first.shared.flush()
    runtime, recorded = RaggedRuntime(), metrics()
    second, factory = ragged_pipeline(runtime, shared=shared_tier(redis_server.url, prefix, recorded),
                                      pipeline_metrics=recorded)
    mixed = [*requests, ragged_request(1, 5, 9)]
    warm = answers(second, *mixed)
    assert runtime.rows_computed == 1  # only the new row
    assert factory.value("coalesce_shared_cache_hits_total") == 6
    for a, b in zip(computed, warm[:3], strict=True):
        for name in ("y", "total"):
            assert a[name].shape == b[name].shape and a[name].tobytes() == b[name].tobytes()
    first.close()
    second.close()


def test_redis_killed_mid_run_never_fails_a_request_and_the_cache_comes_back():
    port = free_port()
    server = RedisServer(port).start()
    pipeline, factory = embedding_on(f"redis://127.0.0.1:{port}/0", EncoderRuntime(), prefix="kill-test:")
    sentences = [f"sentence number {i}" for i in range(8)]
    errors: list[object] = []
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            for result in embed(pipeline, sentences[:4], sentences[4:]):
                if not isinstance(result, dict):
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

