"""Plans the forward passes for all rows of one dispatch, whatever the task.

Rows are sorted by length (tokens, or a tensor row's variable dim) and cut into
sub-batches bounded by a row limit, a padded-position budget and a padding bound.
Each sub-batch is padded only to its own longest row, so a handful of long rows never
inflates the cost of the many short ones beside them. On a CPU the padded positions,
not the number of calls, decide the cost; the padding bound is what keeps them close
to the real ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from coalesce.batching.costmodel import CostModel


@dataclasses.dataclass(frozen=True)
class SubBatch:
    """One planned forward pass.

    Attributes:
        rows: Indices of the rows (into the flat row list) it computes, shortest first.
        padded_length: Tokens every row is padded to: the longest row's length.
        real_tokens: Sum of the rows' own lengths.
    """

    rows: np.ndarray
    padded_length: int
    real_tokens: int

    @property
    def padded_tokens(self) -> int:
        """Tokens the forward pass computes, padding included."""
        return len(self.rows) * self.padded_length

    @property
    def padding_ratio(self) -> float:
        """Padded tokens over real tokens (1.0 means no padding at all)."""
        return self.padded_tokens / max(self.real_tokens, 1)


@dataclasses.dataclass(frozen=True)
class PlanLimits:
    """Bounds on one forward pass, taken from the settings."""

    max_rows: int
    max_tokens: int
    max_padding_ratio: float


def plan_sub_batches(lengths: Sequence[int] | np.ndarray, limits: PlanLimits) -> list[SubBatch]:
    """Cut rows into sub-batches: sorted by length, bounded by rows, tokens and padding.

    Greedy over the rows in ascending length: a row joins the open sub-batch unless
    that would exceed ``max_rows``, make ``rows x longest`` exceed ``max_tokens``, or
    make padded over real tokens exceed ``max_padding_ratio``. The sort is stable, so
    equal lengths keep arrival order.

    Args:
        lengths: Token length of each row (>= 1; truncation has already applied).
        limits: The bounds of one pass.

    Returns:
        Sub-batches covering every row exactly once, in ascending length.
    """
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    if lengths_arr.size == 0:
        return []
    order = np.argsort(lengths_arr, kind="stable")
    plans: list[SubBatch] = []
    start = 0
    real = 0
    for pos, row in enumerate(order):
        length = int(lengths_arr[row])
        count = pos - start
        if count:
            # Ascending order: the new row is the longest, so it sets the padded length.
            rows_after = count + 1
            padded_after = rows_after * length
            if (rows_after > limits.max_rows
                    or padded_after > limits.max_tokens
                    or padded_after > limits.max_padding_ratio * (real + length)):
                plans.append(_make(order[start:pos], lengths_arr, real))
                start, real = pos, 0
        real += length
    plans.append(_make(order[start:], lengths_arr, real))
    return plans


def _make(rows: np.ndarray, lengths: np.ndarray, real: int) -> SubBatch:
    return SubBatch(rows=rows, padded_length=int(lengths[rows[-1]]), real_tokens=real)


def plan_sub_batches_dp(lengths: Sequence[int] | np.ndarray, limits: PlanLimits,
                        cost: CostModel) -> list[SubBatch]:
    """Cut rows into the sub-batches of least predicted total time.

    Rows are sorted by length; an optimal plan then cuts the sorted order into
    contiguous runs (exchanging rows between runs can only raise some run's padded
    length). Dynamic programming over the cut points, with ``best[j]`` the least
    time of the first ``j`` sorted rows, under the row limit and the token budget
    (``max_padding_ratio`` is not used: padding is priced by the model itself).

    Args:
        lengths: Token length of each row.
        limits: Row limit and token budget of one pass.
        cost: Predicted time of a pass.

    Returns:
        Sub-batches covering every row exactly once, in ascending length.
    """
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    n = lengths_arr.size
    if n == 0:
        return []
    order = np.argsort(lengths_arr, kind="stable")
    sorted_len = lengths_arr[order]
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        pad = int(sorted_len[j - 1])
        most = min(limits.max_rows, max(1, limits.max_tokens // pad), j)
        starts = np.arange(j - most, j)
        candidates = best[starts] + cost.predict_s(j - starts, pad)
        k = int(np.argmin(candidates))
        best[j] = candidates[k]
        cut[j] = starts[k]
    plans: list[SubBatch] = []
    j = n
    while j > 0:
        i = int(cut[j])
        rows = order[i:j]
        plans.append(SubBatch(rows=rows, padded_length=int(sorted_len[j - 1]),
                              real_tokens=int(sorted_len[i:j].sum())))
        j = i
    plans.reverse()
    return plans
