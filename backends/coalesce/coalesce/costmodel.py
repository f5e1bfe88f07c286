"""A cost model of one forward pass, calibrated on the real runtime at load.

``time = a + b * rows * len + c * rows * len**2``: a fixed cost per pass (call
overhead, small-matrix inefficiency), a cost per padded token (the dense layers),
and a cost growing with the square of the padded length (attention). The planner
uses it to choose cuts; on a CPU ``b`` dominates and padding decides, on a GPU ``a``
is larger and bigger batches pay, and the same fitted model is right for both.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final

import numpy as np

from coalesce.errors import ConfigError

if TYPE_CHECKING:
    from coalesce.runtime import Runtime

#: Shapes timed at load: (rows, padded length), spanning short queries to full-length documents.
CALIBRATION_SHAPES: Final = ((1, 8), (1, 64), (1, 256), (4, 16), (4, 128), (16, 16), (16, 64),
                             (8, 256), (32, 32), (64, 16))
CALIBRATION_REPEATS: Final = 3


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Predicted seconds of one forward pass of ``rows`` rows padded to ``length`` tokens."""

    a_s: float
    b_s: float
    c_s: float

    def predict_s(self, rows: int | np.ndarray, length: int | np.ndarray) -> np.ndarray | float:
        """Predicted seconds (vectorised over numpy arguments)."""
        tokens = rows * length
        return self.a_s + self.b_s * tokens + self.c_s * tokens * length

    @classmethod
    def parse(cls, text: str) -> CostModel:
        """Parse ``"a,b,c"`` (seconds), as given in the ``cost_model`` setting.

        Raises:
            ConfigError: If it is not three non-negative numbers.
        """
        parts = text.split(",")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 3 or min(values) < 0:
            raise ConfigError(f"cost model '{text}' is not three non-negative numbers 'a,b,c' (seconds)")
        return cls(*values)

    def __str__(self) -> str:
        return f"{self.a_s:.3g},{self.b_s:.3g},{self.c_s:.3g}"

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]]) -> CostModel:
        """Least-squares fit with non-negative coefficients to ``(rows, length, seconds)`` samples.

        Relative error is what matters for choosing cuts, so each sample is weighted by
        the inverse of its time; a coefficient that would go negative is fixed at 0.
        """
        data = np.asarray(list(samples), dtype=np.float64)
        rows, length, seconds = data[:, 0], data[:, 1], data[:, 2]
        features = np.stack([np.ones_like(rows), rows * length, rows * length * length], axis=1)
        weights = 1.0 / np.maximum(seconds, 1e-9)
        active = [0, 1, 2]
        coef = np.zeros(3)
        while active:
            x = features[:, active] * weights[:, None]
            solution, *_ = np.linalg.lstsq(x, seconds * weights, rcond=None)
            if (solution >= 0).all():
                coef[:] = 0
                coef[active] = solution
                break
            active.pop(int(np.argmin(solution)))
        return cls(float(coef[0]), float(coef[1]), float(coef[2]))


def calibrate(runtime: Runtime, *, max_rows: int, max_tokens: int, max_length: int,
              shapes: Sequence[tuple[int, int]] = CALIBRATION_SHAPES,
              repeats: int = CALIBRATION_REPEATS) -> tuple[CostModel, list[tuple[int, int, float]]]:
    """Time the runtime on representative shapes within the limits and fit a ``CostModel``.

    Each shape runs once to warm up, then ``repeats`` times; the fastest run counts,
    because noise on a shared machine only ever adds time.
    """
    samples: list[tuple[int, int, float]] = []
    for rows, length in shapes:
        rows, length = min(rows, max_rows), min(length, max_length)
        if rows * length > max_tokens:
            rows = max(1, max_tokens // length)
        ids = np.full((rows, length), 1000, dtype=np.int64)
        ids[:, 0], ids[:, -1] = 101, 102
        mask = np.ones_like(ids)
        types = np.zeros_like(ids)
        runtime.run(ids, mask, types)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            runtime.run(ids, mask, types)
            best = min(best, time.perf_counter() - start)
        samples.append((rows, length, best))
    return CostModel.fit(samples), samples
