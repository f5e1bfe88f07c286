"""Arrival-rate shapes for the Locust runs, as pure functions of time (no gevent, no Locust).

A shape says how many requests per second should *arrive* at each moment. One schedule
of arrival times is drawn from it for the whole run, and the Locust users (a fixed pool,
which bounds the requests in flight) take the arrivals in turn, so the offered load is
the shape's whatever the pool size:

- ``steady``: a constant rate, evenly spaced arrivals.
- ``poisson``: the same mean rate with exponential gaps, so arrivals cluster the way
  independent clients do.
- ``burst``: the base rate, with a burst of ``burst_factor`` x the rate for
  ``burst_s`` seconds at the start of every ``period_s``.
- ``ramp``: from ``ramp_from`` x the rate up to the rate in a straight line over the run,
  to find where latency starts to climb.

When every user is still waiting for a response as an arrival falls due, it is sent late,
as soon as a user is free: past the server's capacity the pool behaves as a closed loop of
its size. Reports give both the offered and the achieved rate.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Final

SHAPES: Final = ("steady", "poisson", "burst", "ramp")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One arrival-rate shape and its parameters.

    Attributes:
        name: One of ``SHAPES``.
        rate_per_s: Mean (steady, poisson), base (burst) or final (ramp) requests per second.
        duration_s: Length of the run.
        burst_factor: Rate multiplier during a burst.
        burst_s: Length of each burst.
        period_s: A burst starts every ``period_s`` seconds.
        ramp_from: Fraction of ``rate_per_s`` the ramp starts from.
    """

    name: str
    rate_per_s: float
    duration_s: float
    burst_factor: float = 4.0
    burst_s: float = 2.0
    period_s: float = 10.0
    ramp_from: float = 0.1

    def __post_init__(self) -> None:
        """Reject parameters no run could follow, naming the one at fault."""
        if self.name not in SHAPES:
            raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {self.name!r}")
        for field in ("rate_per_s", "duration_s", "burst_factor", "burst_s", "period_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)!r}")
        if self.burst_s > self.period_s:
            raise ValueError(f"burst_s ({self.burst_s}) must not exceed period_s ({self.period_s})")
        if not 0 < self.ramp_from <= 1:
            raise ValueError(f"ramp_from must be in (0, 1], got {self.ramp_from!r}")

    def rate_at(self, t_s: float) -> float:
        """Target arrivals per second at ``t_s`` seconds into the run (0 once it is over)."""
        if t_s < 0 or t_s >= self.duration_s:
            return 0.0
        if self.name == "burst" and t_s % self.period_s < self.burst_s:
            return self.rate_per_s * self.burst_factor
        if self.name == "ramp":
            start = self.rate_per_s * self.ramp_from
            return start + (self.rate_per_s - start) * t_s / self.duration_s
        return self.rate_per_s

    def expected_requests(self, step_s: float = 0.01) -> float:
        """Arrivals the shape offers over the whole run (its rate integrated over time)."""
        steps = int(self.duration_s / step_s)
        return sum(self.rate_at((i + 0.5) * step_s) for i in range(steps)) * step_s

    def gap_s(self, t_s: float, rng: random.Random) -> float:
        """Seconds from an arrival at ``t_s`` to the next one in the schedule.

        ``poisson`` draws the gap from an exponential distribution, the others space
        arrivals evenly at the rate of the moment.
        """
        rate = self.rate_at(t_s)
        if rate <= 0:
            return max(self.duration_s - t_s, 0.0)
        if self.name == "poisson":
            return rng.expovariate(rate)
        return 1.0 / rate

    def arrivals(self, seed: int = 0) -> list[float]:
        """The whole schedule: arrival times (s from the start) inside the run."""
        rng = random.Random(seed)
        out: list[float] = []
        t_s = 0.0
        while True:
            t_s += self.gap_s(t_s, rng)
            if t_s >= self.duration_s:
                return out
            out.append(t_s)
