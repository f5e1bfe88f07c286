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


def test_each_variant_changes_only_thread_settings_of_the_shipped_config():
    from coalesce.settings import ModelSettings
    from coalesce_tools.config import parse_model_config
    from perf.neighbours import VARIANTS, variant_config
    from perf.repository import EXAMPLES

    shipped = (EXAMPLES / "minilm" / "config.pbtxt").read_text()
    runtime = {v: ModelSettings.from_model_config(parse_model_config(variant_config(shipped, v))).runtime
               for v in VARIANTS}
    assert variant_config(shipped, "shipped") == shipped
    assert runtime["shipped"].share_idle_cores and runtime["shipped"].borrowed_thread_priority == "idle"
    assert runtime["shipped"].intra_op_threads == 1
    assert runtime["borrow_normal"].borrowed_thread_priority == "normal"
    assert runtime["shipped"].thread_spinning and not runtime["wide_no_spin"].thread_spinning
    assert not runtime["one_core_each"].share_idle_cores and runtime["one_core_each"].intra_op_threads == 1
    assert runtime["shared"].intra_op_threads == 0 and runtime["shared"].thread_spinning
    assert runtime["no_spin"].intra_op_threads == 0 and not runtime["no_spin"].thread_spinning
    assert "rate_limiter" in variant_config(shipped, "rate_limiter")
    assert {r.precision for r in runtime.values()} == {"auto"}  # the shipped precision stays


def test_targets_say_met_or_missed_per_light_model_and_for_the_noisy_model():
    from perf.neighbours import targets

    def round_(r, variant, noisy):
        return {"round": r, "variant": variant, "together": {"n": {"answers_per_s": noisy}}}

    run = {"variants": ["shipped", "one_core_each"], "noisy": "n",
           "table": [{"variant": "shipped", "model": "a", "p99_ratio": 1.1},
                     {"variant": "shipped", "model": "b", "p99_ratio": 1.6}],
           "rounds": [round_(0, "shipped", 10.0), round_(0, "one_core_each", 11.0),
                      round_(1, "shipped", 12.0), round_(1, "one_core_each", 10.0)]}
    text = "\n".join(targets(run))
    assert "`a` p99 beside the noise / alone: 1.10 (target <= 1.3: met)" in text
    assert "`b` p99 beside the noise / alone: 1.60 (target <= 1.3: missed)" in text
    assert "(median of same-round ratios): 1.05 (target >= 0.95: met)" in text
