"""Retries within one deadline: the policy (full-jitter exponential back-off) and the loops that apply it.

A call gets one ``Deadline``. Every attempt, and every request of a split list, is given
the time left as its own timeout, and a pause never reaches the deadline: a call ends by
its deadline (``RequestTimeoutError``, or the last typed error) and never hangs.
Only failures where nothing was answered are retried (``ServerUnavailableError``, which
includes ``RequestRejectedError``): inference is idempotent, so sending it again is safe;
invalid input, an unknown model or a server error would fail the same way again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from coalesce_client.errors import ClientError, RequestTimeoutError, ServerUnavailableError

T = TypeVar("T")
#: ``random.random``-like: a float in [0, 1).
Uniform = Callable[[], float]


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How a call retries a failure where the server answered nothing (unreachable, not ready, refused).

    The pause before attempt ``n + 1`` is drawn uniformly from ``[0, min(max_delay_s,
    base_delay_s * 2 ** (n - 1)))`` ("full jitter"), so clients that failed together do not
    come back together. ``RetryPolicy(max_attempts=1)`` never retries.

    Attributes:
        max_attempts: Attempts per request, the first included.
        base_delay_s: Upper bound of the first pause.
        max_delay_s: Upper bound of any pause.
    """

    max_attempts: int = 5
    base_delay_s: float = 0.1
    max_delay_s: float = 2.0

    def __post_init__(self) -> None:
        """Reject settings that cannot work, naming the field and value."""
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts!r}")
        if not self.base_delay_s >= 0:
            raise ValueError(f"base_delay_s must be >= 0, got {self.base_delay_s!r}")
        if not self.max_delay_s >= self.base_delay_s:
            raise ValueError(f"max_delay_s must be >= base_delay_s ({self.base_delay_s}), got {self.max_delay_s!r}")

    def delay_cap_s(self, attempt: int) -> float:
        """Upper bound of the pause after failed attempt number ``attempt`` (1-based)."""
        return min(self.max_delay_s, self.base_delay_s * 2.0 ** min(attempt - 1, 64))

    @staticmethod
    def retries(error: ClientError) -> bool:
        """Whether ``error`` is worth another attempt: the server answered nothing, or refused under load."""
        return isinstance(error, ServerUnavailableError)

    def pause_s(self, attempt: int, remaining_s: float, uniform: Uniform = random.random) -> float | None:
        """The pause after failed attempt ``attempt``, or None to give up (no attempts left, or no time left).

        A pause that would reach the deadline gives up at once rather than sleep there.
        """
        if attempt >= self.max_attempts:
            return None
        pause = uniform() * self.delay_cap_s(attempt)
        return pause if pause < remaining_s else None


class Deadline:
    """The end of one call, on a monotonic clock; shared by its attempts and the requests of a split list."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """A deadline ``timeout_s`` from now on ``clock``."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._clock = clock
        self._expires_at = clock() + timeout_s

    def remaining_s(self) -> float:
        """Seconds left, 0 once passed."""
        return max(0.0, self._expires_at - self._clock())


def _expired(deadline: Deadline, last: ClientError | None, what: str) -> ClientError:
    return last or RequestTimeoutError(f"{what}: no answer within {deadline.timeout_s} s")


def call_with_retries(attempt: Callable[[float], T], *, policy: RetryPolicy, deadline: Deadline, what: str,
                      sleep: Callable[[float], None] = time.sleep, uniform: Uniform = random.random) -> T:
    """Run ``attempt(timeout_s)`` until it succeeds, retrying as ``policy`` says, within ``deadline``.

    Args:
        attempt: One try; gets the time left as its timeout and raises ``ClientError``s.
        policy: When to retry and how long to pause.
        deadline: The call's end.
        what: Names the call in a timeout message ("model 'm' at host:port").
        sleep: Pauses (``time.sleep``).
        uniform: Draws the jitter.

    Raises:
        ClientError: The last attempt's error, or ``RequestTimeoutError`` when no time was left to try.
    """
    last: ClientError | None = None
    number = 0
    while True:
        remaining = deadline.remaining_s()
        if remaining <= 0:
            raise _expired(deadline, last, what)
        number += 1
        try:
            return attempt(remaining)
        except ClientError as error:
            if not policy.retries(error):
                raise
            pause = policy.pause_s(number, deadline.remaining_s(), uniform)
            if pause is None:
                raise
            last = error
        sleep(pause)


async def call_with_retries_async(attempt: Callable[[float], Awaitable[T]], *, policy: RetryPolicy,
                                  deadline: Deadline, what: str, uniform: Uniform = random.random) -> T:
    """``call_with_retries`` for coroutines; pauses with ``asyncio.sleep``."""
    last: ClientError | None = None
    number = 0
    while True:
        remaining = deadline.remaining_s()
        if remaining <= 0:
            raise _expired(deadline, last, what)
        number += 1
        try:
            return await attempt(remaining)
        except ClientError as error:
            if not policy.retries(error):
                raise
            pause = policy.pause_s(number, deadline.remaining_s(), uniform)
            if pause is None:
                raise
            last = error
        await asyncio.sleep(pause)
