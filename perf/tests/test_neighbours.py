"""perf.neighbours never sends a server the same request twice: the example configs ship row caches."""

import asyncio

import pytest

from perf.neighbours import POOL_REQUESTS, closed_loop, open_loop, request_pools


class Recorder:
    """Stands in for the Triton client's ``infer``: records each request object it is sent."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    async def infer(self, model, request, client_timeout):
        self.sent.append(id(request))
        await asyncio.sleep(0.001)


def test_every_pool_holds_distinct_requests():
    pools = request_pools(POOL_REQUESTS, seed=0)
    for model, pool in pools.items():
        keys = {tuple(array.tobytes() for _, array, _ in request) for request in pool}
        assert len(keys) == len(pool) == POOL_REQUESTS, model


def test_the_closed_loop_sends_each_request_once_and_fails_when_they_run_out():
    requests = [[object()] for _ in range(20)]
    client = Recorder()
    with pytest.raises(RuntimeError, match="all 20 distinct requests sent"):
        asyncio.run(closed_loop(client, "m", requests, concurrency=4, duration_s=5.0))
    assert len(client.sent) == len(set(client.sent)) == 20


def test_the_open_loop_sends_each_request_once_and_fails_when_they_run_out():
    requests = [[object()] for _ in range(5)]
    client = Recorder()
    with pytest.raises(RuntimeError, match="all 5 distinct requests sent"):
        asyncio.run(open_loop(client, "m", requests, rate_per_s=200.0, duration_s=5.0, seed=0, outcomes=[],
                              max_in_flight=100, timeout_s=1.0))
    assert len(client.sent) == len(set(client.sent)) == 5
