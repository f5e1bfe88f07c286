"""The soak's verdict: which outcomes are expected around an incident, and the memory slope."""

import math

from perf.soak import Call, classify, slope_mib_per_min

KILL = [{"t_s": 100.0, "what": "kill minilm stub", "until_s": 120.0}, {"t_s": 50.0, "what": "redis restart",
                                                                       "until_s": 52.0}]


def test_outcomes_are_classified_around_the_incidents():
    unavailable = "StatusCode.NOT_FOUND Request for unknown model: 'minilm' has no available versions"
    assert classify(Call(10, 5, "minilm", False, "ok"), KILL) == "ok"
    assert classify(Call(10, 5, "digits", True, "StatusCode.INVALID_ARG bad"), KILL) == "refused"
    assert classify(Call(10, 5, "digits", True, "ok"), KILL) == "unexpected"  # a bad request answered
    assert classify(Call(110, 5, "minilm", False, unavailable), KILL) == "expected"
    assert classify(Call(110, 5, "minilm", True, unavailable), KILL) == "expected"
    assert classify(Call(110, 5, "digits", False, "StatusCode.INTERNAL x"), KILL) == "unexpected"  # a neighbour
    assert classify(Call(51, 5, "minilm_rerank", False, "StatusCode.INTERNAL redis"), KILL) == "unexpected"
    assert classify(Call(130, 5, "minilm", False, unavailable), KILL) == "unexpected"  # long after the reload


def test_slope_is_in_mib_per_minute_after_the_settling_point():
    samples = [{"t_s": t, "server_mib": 100 + (0 if t < 60 else t / 60), "stubs_mib": 50} for t in range(0, 300, 5)]
    assert math.isclose(slope_mib_per_min(samples, 60), 1.0, rel_tol=1e-6)
    assert math.isnan(slope_mib_per_min(samples, 1000))
