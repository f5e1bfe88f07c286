import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce.batching.planner import PlanLimits, plan_sub_batches

LOOSE = PlanLimits(max_rows=1000, max_tokens=1_000_000, max_padding_ratio=1000.0)


def test_empty():
    assert plan_sub_batches([], LOOSE) == []


def test_sorted_and_padded_to_own_longest_row():
    lengths = [5, 200, 7, 6, 190]
    plans = plan_sub_batches(lengths, PlanLimits(max_rows=64, max_tokens=8192, max_padding_ratio=1.25))
    assert [list(p.rows) for p in plans] == [[0, 3, 2], [4, 1]]
    assert [p.padded_length for p in plans] == [7, 200]
    assert plans[0].real_tokens == 18
    assert plans[0].padded_tokens == 21


def test_row_limit():
    plans = plan_sub_batches([10] * 10, PlanLimits(max_rows=4, max_tokens=10_000, max_padding_ratio=10))
    assert [len(p.rows) for p in plans] == [4, 4, 2]


def test_token_budget_counts_padding():
    plans = plan_sub_batches([100] * 5, PlanLimits(max_rows=64, max_tokens=250, max_padding_ratio=10))
    assert [len(p.rows) for p in plans] == [2, 2, 1]
    assert all(p.padded_tokens <= 250 for p in plans)


def test_padding_bound_splits_short_from_long():
    lengths = [10] * 31 + [256]
    plans = plan_sub_batches(lengths, PlanLimits(max_rows=64, max_tokens=8192, max_padding_ratio=1.25))
    assert [len(p.rows) for p in plans] == [31, 1]
    assert plans[1].padded_length == 256


def test_equal_lengths_keep_arrival_order():
    plans = plan_sub_batches([3, 3, 3, 3], LOOSE)
    assert list(plans[0].rows) == [0, 1, 2, 3]


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(min_value=1, max_value=256), max_size=300),
       max_rows=st.integers(1, 80), max_tokens=st.integers(256, 10_000),
       ratio=st.floats(1.0, 4.0))
def test_plan_invariants(lengths, max_rows, max_tokens, ratio):
    limits = PlanLimits(max_rows=max_rows, max_tokens=max_tokens, max_padding_ratio=ratio)
    plans = plan_sub_batches(lengths, limits)
    covered = np.concatenate([p.rows for p in plans]) if plans else np.array([], dtype=np.int64)
    # Every row exactly once.
    assert sorted(covered.tolist()) == list(range(len(lengths)))
    for p in plans:
        rows_len = [lengths[r] for r in p.rows]
        assert rows_len == sorted(rows_len)
        assert p.padded_length == max(rows_len)
        assert p.real_tokens == sum(rows_len)
        assert len(p.rows) <= max_rows
        assert p.padded_tokens <= max_tokens
        # A single row is always allowed; otherwise padding stays within the bound.
        assert len(p.rows) == 1 or p.padding_ratio <= ratio + 1e-9
