"""The retry policy's back-off schedule and the deadline arithmetic, on a fake clock (no server, no sleeping)."""

from __future__ import annotations

import asyncio

import pytest

from coalesce_client import (
    EmbeddingClient,
    InvalidInputError,
    ModelNotFoundError,
    RequestRejectedError,
    RequestTimeoutError,
    RetryPolicy,
    ServerError,
    ServerUnavailableError,
    TlsOptions,
)
from coalesce_client.cli import parse_headers
from coalesce_client.retry import Deadline, call_with_retries, call_with_retries_async


class FakeClock:
    """A monotonic clock that moves only when told to; ``sleep`` advances it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


def test_the_pause_caps_double_from_the_base_up_to_the_maximum():
    policy = RetryPolicy(max_attempts=10, base_delay_s=0.1, max_delay_s=1.0)
    assert [policy.delay_cap_s(n) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert policy.delay_cap_s(10_000) == 1.0  # no overflow far out


def test_full_jitter_draws_between_zero_and_the_cap():
    policy = RetryPolicy(max_attempts=10, base_delay_s=0.1, max_delay_s=1.0)
    assert policy.pause_s(3, remaining_s=60, uniform=lambda: 0.0) == 0.0
    assert policy.pause_s(3, remaining_s=60, uniform=lambda: 0.5) == pytest.approx(0.2)
    assert policy.pause_s(3, remaining_s=60, uniform=lambda: 0.999) == pytest.approx(0.3996)
    draws = [RetryPolicy(max_attempts=10).pause_s(4, remaining_s=60) for _ in range(1000)]
    assert all(d is not None and 0 <= d < 0.8 for d in draws) and len(set(draws)) > 900


def test_no_pause_after_the_last_attempt_nor_one_that_reaches_the_deadline():
    policy = RetryPolicy(max_attempts=3, base_delay_s=1.0, max_delay_s=1.0)
    assert policy.pause_s(2, remaining_s=60, uniform=lambda: 0.5) == 0.5
    assert policy.pause_s(3, remaining_s=60, uniform=lambda: 0.5) is None  # attempts used up
    assert policy.pause_s(1, remaining_s=0.5, uniform=lambda: 0.5) is None  # would sleep to the deadline
    assert policy.pause_s(1, remaining_s=0.51, uniform=lambda: 0.5) == 0.5


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_attempts": 0}, "max_attempts must be at least 1, got 0"),
    ({"base_delay_s": -1.0}, "base_delay_s must be >= 0, got -1.0"),
    ({"base_delay_s": 2.0, "max_delay_s": 1.0}, "max_delay_s must be >= base_delay_s (2.0), got 1.0"),
])
def test_a_policy_that_cannot_work_is_refused(kwargs, message):
    with pytest.raises(ValueError) as info:
        RetryPolicy(**kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize(("error", "retried"), [
    (ServerUnavailableError("down"), True),
    (RequestRejectedError("request refused: queue full"), True),
    (InvalidInputError("bad"), False),
    (ModelNotFoundError("gone"), False),
    (ServerError("boom"), False),
    (RequestTimeoutError("slow"), False),
])
def test_only_unanswered_or_refused_requests_are_retried(error, retried):
    assert RetryPolicy.retries(error) is retried


def test_the_deadline_counts_down_on_its_clock_and_stops_at_zero():
    clock = FakeClock()
    deadline = Deadline(2.0, clock=clock)
    assert deadline.remaining_s() == 2.0
    clock.now += 1.5
    assert deadline.remaining_s() == pytest.approx(0.5)
    clock.now += 3
    assert deadline.remaining_s() == 0.0
    with pytest.raises(ValueError, match=r"^timeout_s must be > 0, got 0$"):
        Deadline(0)


def run(attempt, *, policy=None, timeout_s=10.0, uniform=lambda: 0.5):
    clock = FakeClock()
    deadline = Deadline(timeout_s, clock=clock)
    outcome = call_with_retries(lambda left: attempt(clock, left), policy=policy or RetryPolicy(), deadline=deadline,
                                what="model 'm' at u", sleep=clock.sleep, uniform=uniform)
    return outcome, clock


def test_each_attempt_gets_the_time_left_and_pauses_follow_the_schedule():
    given: list[float] = []

    def attempt(clock, timeout_s):
        given.append(timeout_s)
        clock.now += 0.25  # each failed attempt costs a quarter second
        if len(given) < 4:
            raise ServerUnavailableError("down")
        return "vectors"

    outcome, clock = run(attempt, policy=RetryPolicy(max_attempts=5, base_delay_s=0.1, max_delay_s=2.0))
    assert outcome == "vectors"
    assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2])  # half of each cap: 0.1, 0.2, 0.4
    assert given == pytest.approx([10.0, 9.7, 9.35, 8.9])  # the time left, pauses and attempts deducted


def test_the_last_error_is_raised_when_the_attempts_are_used_up():
    calls = []

    def attempt(clock, timeout_s):
        calls.append(timeout_s)
        raise RequestRejectedError(f"request refused: try {len(calls)}")

    with pytest.raises(RequestRejectedError, match="try 3"):
        run(attempt, policy=RetryPolicy(max_attempts=3))
    assert len(calls) == 3


@pytest.mark.parametrize("error", [InvalidInputError("bad"), ModelNotFoundError("gone"), ServerError("boom")])
def test_errors_that_would_repeat_are_raised_at_once(error):
    calls = []

    def attempt(clock, timeout_s):
        calls.append(timeout_s)
        raise error

    with pytest.raises(type(error)):
        run(attempt)
    assert len(calls) == 1


def test_back_off_never_sleeps_past_the_deadline():
    clock = FakeClock()
    deadline = Deadline(1.0, clock=clock)

    def attempt(timeout_s):
        clock.now += 0.4
        raise ServerUnavailableError("down")

    with pytest.raises(ServerUnavailableError):
        call_with_retries(attempt, policy=RetryPolicy(max_attempts=100, base_delay_s=0.5, max_delay_s=0.5),
                          deadline=deadline, what="w", sleep=clock.sleep, uniform=lambda: 0.99)
    # t=0.4 fails, pause 0.495 -> 0.895; the second fails at 1.295, past the deadline: no pause is drawn.
    assert clock.sleeps == pytest.approx([0.495])
    assert clock.now - 100.0 == pytest.approx(1.295)


def test_a_call_ends_by_its_deadline_whatever_the_attempts_do():
    clock = FakeClock()
    deadline = Deadline(1.0, clock=clock)
    attempts = []

    def attempt(timeout_s):
        attempts.append(timeout_s)
        clock.now += timeout_s  # every attempt uses all the time it is given, then the server is gone
        raise ServerUnavailableError("down")

    with pytest.raises(ServerUnavailableError):
        call_with_retries(attempt, policy=RetryPolicy(max_attempts=100), deadline=deadline, what="w",
                          sleep=clock.sleep, uniform=lambda: 0.0)
    assert attempts == [1.0] and clock.now - 100.0 == 1.0


def test_no_time_left_raises_a_timeout_before_any_attempt():
    clock = FakeClock()
    deadline = Deadline(1.0, clock=clock)
    clock.now += 5
    with pytest.raises(RequestTimeoutError, match=r"^model 'm' at u: no answer within 1.0 s$"):
        call_with_retries(lambda timeout_s: pytest.fail("no attempt without time"), policy=RetryPolicy(),
                          deadline=deadline, what="model 'm' at u", sleep=clock.sleep)


def test_the_async_loop_retries_the_same_way():
    given: list[float] = []

    async def attempt(timeout_s):
        given.append(timeout_s)
        if len(given) < 3:
            raise ServerUnavailableError("down")
        return "ok"

    async def main():
        return await call_with_retries_async(attempt, policy=RetryPolicy(base_delay_s=0.001, max_delay_s=0.001),
                                             deadline=Deadline(5.0), what="w")

    assert asyncio.run(main()) == "ok" and len(given) == 3
    assert given[0] > given[1] > given[2] > 4.9


def test_tls_options_check_their_files(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    assert TlsOptions(ca).grpc_arguments() == {"ssl": True, "root_certificates": str(ca), "private_key": None,
                                               "certificate_chain": None}
    with pytest.raises(ValueError, match=r"^client_cert and client_key go together"):
        TlsOptions(ca, client_cert=ca)
    with pytest.raises(ValueError, match=r"^TLS ca_cert '.*missing.pem' is not a file$"):
        TlsOptions(tmp_path / "missing.pem")
    with pytest.raises(ValueError, match=r"^TLS options need protocol='grpc'"):
        EmbeddingClient(protocol="http", tls=TlsOptions(ca))


def test_cli_headers_come_from_pairs_and_from_the_environment():
    environ = {"TOKEN": "Bearer abc"}
    assert parse_headers(["X-Team=search"], ["Authorization=TOKEN"], environ) == {
        "x-team": "search", "authorization": "Bearer abc"}
    with pytest.raises(ValueError, match=r"^--header-env authorization: environment variable NOPE is not set$"):
        parse_headers([], ["authorization=NOPE"], environ)
    with pytest.raises(ValueError, match=r"^--header takes NAME=VALUE, got 'novalue'$"):
        parse_headers(["novalue"], [], environ)
