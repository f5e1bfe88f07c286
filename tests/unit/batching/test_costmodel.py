"""The cost model: its fit, its calibration on a runtime whose time per pass is known, and the DP planner over it."""

import itertools
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce.batching import costmodel
from coalesce.batching.costmodel import CALIBRATION_REPEATS, CALIBRATION_SHAPES, CostModel, calibrate
from coalesce.batching.planner import PlanLimits, plan_sub_batches, plan_sub_batches_dp
from coalesce.core.errors import ConfigError
from coalesce.settings import ModelSettings
from coalesce.tasks import create_task
from tests.conftest import built, model_config
from tests.unit.fakes import RAGGED_CONFIG, FakeRuntime

CPU = CostModel(a_s=0.002, b_s=0.00015, c_s=3e-7)
GPU = CostModel(a_s=0.003, b_s=2e-7, c_s=1e-10)


def total(plans, cost):
    return sum(cost.predict_s(len(p.rows), p.padded_length) for p in plans)


def test_fit_recovers_known_coefficients():
    true = CostModel(0.003, 0.0002, 4e-7)
    samples = [(r, n, true.predict_s(r, n)) for r in (1, 4, 16, 32) for n in (8, 32, 128, 256)]
    fitted = CostModel.fit(samples)
    assert fitted.a_s == pytest.approx(true.a_s, rel=1e-6)
    assert fitted.b_s == pytest.approx(true.b_s, rel=1e-6)
    assert fitted.c_s == pytest.approx(true.c_s, rel=1e-4)


def test_fit_keeps_coefficients_non_negative():
    # Pure per-token cost with noise that would pull the intercept below zero.
    samples = [(r, n, 1e-4 * r * n * (0.97 if r * n < 100 else 1.0)) for r in (1, 8, 32) for n in (8, 64, 256)]
    fitted = CostModel.fit(samples)
    assert min(fitted.a_s, fitted.b_s, fitted.c_s) >= 0


def test_parse():
    assert CostModel.parse("0.001,2e-4,0") == CostModel(0.001, 0.0002, 0.0)
    for bad in ("", "1,2", "a,b,c", "1,2,-3"):
        with pytest.raises(ConfigError):
            CostModel.parse(bad)


def test_dp_separates_long_rows_on_a_cpu_and_merges_on_a_gpu():
    lengths = [12] * 30 + [250, 256]
    limits = PlanLimits(max_rows=64, max_tokens=16384, max_padding_ratio=1.0)
    cpu = plan_sub_batches_dp(lengths, limits, CPU)
    assert [len(p.rows) for p in cpu] == [30, 2]
    gpu = plan_sub_batches_dp(lengths, limits, GPU)
    assert [len(p.rows) for p in gpu] == [32]  # per-pass overhead dominates: one pass


def brute_force_best(lengths, limits, cost):
    ordered = sorted(lengths)
    n = len(ordered)
    best = float("inf")
    for cuts in itertools.product([False, True], repeat=n - 1):
        runs, start = [], 0
        for i, c in enumerate(cuts, start=1):
            if c:
                runs.append(ordered[start:i])
                start = i
        runs.append(ordered[start:])
        if any(len(r) > limits.max_rows or len(r) * r[-1] > limits.max_tokens for r in runs):
            continue
        best = min(best, sum(cost.predict_s(len(r), r[-1]) for r in runs))
    return best


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(2, 256), min_size=1, max_size=10), max_rows=st.integers(1, 10),
       cost=st.sampled_from([CPU, GPU]))
def test_dp_is_optimal_over_sorted_cuts(lengths, max_rows, cost):
    limits = PlanLimits(max_rows=max_rows, max_tokens=1024, max_padding_ratio=1.0)
    plans = plan_sub_batches_dp(lengths, limits, cost)
    assert total(plans, cost) == pytest.approx(brute_force_best(lengths, limits, cost), rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(2, 256), max_size=300), max_rows=st.integers(1, 80),
       max_tokens=st.integers(256, 10_000), cost=st.sampled_from([CPU, GPU]))
def test_dp_invariants_and_never_worse_than_greedy(lengths, max_rows, max_tokens, cost):
    limits = PlanLimits(max_rows=max_rows, max_tokens=max_tokens, max_padding_ratio=1.25)
    plans = plan_sub_batches_dp(lengths, limits, cost)
    covered = np.concatenate([p.rows for p in plans]) if plans else np.array([], dtype=np.int64)
    assert sorted(covered.tolist()) == list(range(len(lengths)))
    for p in plans:
        assert len(p.rows) <= max_rows and p.padded_tokens <= max_tokens
        assert p.padded_length == max(lengths[r] for r in p.rows)
    assert total(plans, cost) <= total(plan_sub_batches(lengths, limits), cost) + 1e-12


class FakeClock:
    """A clock that moves only when the runtime computes: each pass takes exactly what ``true`` predicts."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


class TimedRuntime(FakeRuntime):
    """Takes ``true.predict_s(rows, length)`` seconds of ``clock`` per pass, whatever it is fed."""

    def __init__(self, clock, true, graph=None):
        super().__init__()
        self.clock, self.true, self.graph = clock, true, graph

    def compute(self, feeds):
        first = next(iter(feeds.values()))
        # Token ids carry the pass's length; a model of fixed shape has none (every row is one position).
        rows, length = first.shape[0], (feeds["input_ids"].shape[1] if "input_ids" in feeds else 1)
        self.clock.now += float(self.true.predict_s(rows, length))
        return {name: np.zeros(1) for name in ("last_hidden_state", "logits", "y", "total")}


@pytest.fixture()
def clock(monkeypatch):
    """Calibration's clock, driven by the runtime (what calibration measures is then known exactly)."""
    fake = FakeClock()
    monkeypatch.setattr(costmodel, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def embedding_task():
    config = model_config("minilm")
    return create_task(ModelSettings.from_model_config(config), config, built("minilm"))


def test_calibration_times_the_runtime_on_every_shape_and_fits_what_it_measured(clock):
    true = CostModel(0.004, 0.00003, 2e-8)
    runtime = TimedRuntime(clock, true)
    fitted, samples = calibrate(runtime, embedding_task(), max_rows=64, max_tokens=8192)
    # Every shape ran once to warm up, then CALIBRATION_REPEATS times, with the task's synthetic feeds.
    assert runtime.calls == [shape for shape in CALIBRATION_SHAPES for _ in range(1 + CALIBRATION_REPEATS)]
    assert set(runtime.feeds[0]) == {"input_ids", "attention_mask", "token_type_ids"}
    assert samples == [(rows, length, pytest.approx(true.predict_s(rows, length), rel=1e-9))
                       for rows, length in CALIBRATION_SHAPES]
    assert fitted.a_s == pytest.approx(true.a_s, rel=1e-6)
    assert fitted.b_s == pytest.approx(true.b_s, rel=1e-6)
    assert fitted.c_s == pytest.approx(true.c_s, rel=1e-4)


def test_calibration_keeps_every_timed_pass_within_the_planners_limits(clock):
    runtime = TimedRuntime(clock, CostModel(0.001, 0.0001, 0.0))
    _, samples = calibrate(runtime, embedding_task(), max_rows=16, max_tokens=1024)
    assert [(rows, length) for rows, length, _ in samples] == [
        (1, 8), (1, 64), (1, 256), (4, 16), (4, 128), (16, 16), (16, 64), (4, 256), (16, 32), (16, 16)]
    assert all(rows <= 16 and rows * length <= 1024 for rows, length in runtime.calls)


def test_a_model_of_fixed_shape_is_timed_at_length_one(clock):
    config = {**RAGGED_CONFIG, "input": [{"name": "scale", "data_type": "TYPE_FP32", "dims": ["2"]}],
              "output": [{"name": "total", "data_type": "TYPE_FP64", "dims": ["2"]}],
              "parameters": {"task": {"string_value": "tensor"}}}
    task = create_task(ModelSettings.from_model_config(config), config, built("digits"))
    assert task.max_length == 1
    true = CostModel(0.002, 0.0005, 0.0)
    runtime = TimedRuntime(clock, true)
    fitted, samples = calibrate(runtime, task, max_rows=64, max_tokens=8192)
    assert {length for _, length, _ in samples} == {1}
    assert [f["scale"].shape for f in runtime.feeds[::1 + CALIBRATION_REPEATS]] == [
        (rows, 2) for rows, _ in CALIBRATION_SHAPES]
    for rows, _, seconds in samples:
        assert seconds == pytest.approx(true.predict_s(rows, 1), rel=1e-9)
        assert fitted.predict_s(rows, 1) == pytest.approx(seconds, rel=1e-6)
