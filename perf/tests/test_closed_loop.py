import asyncio
import json

import pytest
from aiohttp import web

from perf import closed_loop


class Server:
    """A real local HTTP server: answers after a short wait, fails texts starting with "bad", counts what it saw."""

    def __init__(self, delay_s=0.01):
        self.delay_s = delay_s
        self.in_flight = 0
        self.most_in_flight = 0
        self.seen = []

    async def handle(self, request):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            text = (await request.json())["input"][0]
            self.seen.append(text)
            await asyncio.sleep(self.delay_s)
            if text.startswith("bad"):
                return web.json_response({"error": "refused"}, status=503)
            return web.json_response({"data": [{"embedding": [0.0] * 8}]})
        finally:
            self.in_flight -= 1

    async def start(self):
        app = web.Application()
        app.router.add_post("/embeddings", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/embeddings"


def run_against(server, texts, concurrency, **options):
    async def main():
        url = await server.start()
        try:
            bodies = closed_loop.encode_bodies(texts, lambda t: {"model": "m", "input": [t]})
            return await closed_loop.closed_loop_async(url, bodies, concurrency, **options)
        finally:
            await server.runner.cleanup()

    return asyncio.run(main())


def test_request_count_is_exact_and_concurrency_is_held():
    server = Server()
    texts = [f"text {i}" for i in range(10)]
    result = run_against(server, texts, 4, request_count=40)
    assert len(result.samples) == 40 and result.errors == 0
    # Closed loop: never more in flight than workers, and the workers did overlap.
    assert server.most_in_flight == 4
    # The bodies are drawn in order and cycled: every text four times.
    assert sorted(server.seen) == sorted(texts * 4)
    assert all(s.latency_s >= server.delay_s for s in result.samples)
    summary = result.summary()
    assert summary["requests"] == 40 and summary["p50_ms"] >= 10.0 and summary["p99_ms"] >= summary["p50_ms"]
    # 4 workers, 10 ms per answer: near 400/s on an idle machine, never above it.
    assert 0 < result.throughput_per_s <= 4 / server.delay_s * 1.05
    json.dumps(summary)  # JSON-ready


def test_errors_are_counted_not_timed():
    server = Server(delay_s=0.001)
    result = run_against(server, ["good a", "bad b"], 2, request_count=20)
    assert result.successes == 10 and result.errors == 10
    assert all(s.status == 503 and "HTTP 503" in s.error for s in result.samples if not s.ok)
    assert list(result.error_kinds().values()) == [10]
    assert result.throughput_per_s == pytest.approx(10 / result.duration_s)


def test_duration_bounds_the_point_and_warmup_is_not_recorded():
    server = Server(delay_s=0.02)
    result = run_against(server, ["x"], 2, duration_s=0.3, warmup_s=0.2)
    # Sends stop at the deadline; requests already sent are waited for.
    assert result.duration_s == pytest.approx(0.3, abs=0.15)
    assert max(s.sent_s for s in result.samples) < 0.3
    assert len(server.seen) > len(result.samples) > 0  # the warm-up's requests reached the server only


def test_refused_connection_is_an_error():
    bodies = closed_loop.encode_bodies(["a"], lambda t: {"input": [t]})
    # Port 9 (discard) on loopback: nothing listens in the test environment.
    result = closed_loop.closed_loop("http://127.0.0.1:9/x", bodies, 1, request_count=3, request_timeout_s=5)
    assert result.errors == 3 and result.latency_ms(0.5) is None


def test_a_point_needs_a_bound():
    with pytest.raises(ValueError, match="duration_s or request_count"):
        closed_loop.closed_loop("http://127.0.0.1:9/x", [b"{}"], 1)
