import itertools
import random

import pytest

from perf.loadshapes import SHAPES, Shape


def test_steady_and_poisson_offer_the_rate():
    steady = Shape("steady", rate_per_s=50, duration_s=20)
    assert steady.rate_at(0) == steady.rate_at(19.9) == 50
    assert steady.rate_at(20) == 0 and steady.rate_at(-1) == 0
    assert len(steady.arrivals()) == pytest.approx(1000, abs=1)
    arrivals = Shape("poisson", rate_per_s=50, duration_s=200).arrivals(seed=3)
    assert len(arrivals) == pytest.approx(10_000, rel=0.05)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    mean = sum(gaps) / len(gaps)
    # Exponential gaps: the standard deviation equals the mean (evenly spaced would give 0).
    spread = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert spread == pytest.approx(mean, rel=0.1)


def test_poisson_is_seeded():
    shape = Shape("poisson", rate_per_s=30, duration_s=5)
    assert shape.arrivals(seed=1) == shape.arrivals(seed=1) != shape.arrivals(seed=2)


def test_burst_raises_the_rate_at_the_start_of_each_period():
    shape = Shape("burst", rate_per_s=10, duration_s=30, burst_factor=5, burst_s=2, period_s=10)
    assert [shape.rate_at(t) for t in (0, 1.9, 2.0, 9.9, 10.5, 21.0)] == [50, 50, 10, 10, 50, 50]
    # Three bursts of 2 s at 50/s, 24 s at 10/s.
    assert len(shape.arrivals()) == pytest.approx(3 * 2 * 50 + 24 * 10, rel=0.02)  # gaps straddle the edges
    assert shape.expected_requests() == pytest.approx(540, rel=0.01)


def test_ramp_climbs_linearly_to_the_rate():
    shape = Shape("ramp", rate_per_s=100, duration_s=10, ramp_from=0.2)
    assert shape.rate_at(0) == pytest.approx(20)
    assert shape.rate_at(5) == pytest.approx(60)
    assert shape.rate_at(9.999) == pytest.approx(100, rel=1e-3)
    arrivals = shape.arrivals()
    assert len(arrivals) == pytest.approx(shape.expected_requests(), rel=0.02)
    first_half = sum(1 for t in arrivals if t < 5)
    assert first_half < len(arrivals) - first_half


def test_gaps_follow_the_rate_of_the_moment():
    shape = Shape("ramp", rate_per_s=100, duration_s=10, ramp_from=0.1)
    rng = random.Random(0)
    assert shape.gap_s(0, rng) == pytest.approx(0.1)
    assert shape.gap_s(9.99, rng) == pytest.approx(0.01, rel=0.01)
    assert shape.gap_s(10, rng) == 0  # over: no further arrival


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "spiky"}, "shape must be one of steady, poisson, burst, ramp"),
    ({"rate_per_s": 0}, "rate_per_s must be > 0"),
    ({"duration_s": -1}, "duration_s must be > 0"),
    ({"burst_s": 20, "period_s": 10}, "burst_s (20) must not exceed period_s (10)"),
    ({"ramp_from": 0}, "ramp_from must be in (0, 1]"),
])
def test_bad_parameters_are_named(kwargs, message):
    base = {"name": "burst", "rate_per_s": 10, "duration_s": 5}
    with pytest.raises(ValueError) as info:
        Shape(**{**base, **kwargs})
    assert message in str(info.value)


def test_every_shape_has_arrivals():
    for name in SHAPES:
        assert Shape(name, rate_per_s=20, duration_s=3).arrivals()
