"""A cost model of one forward pass, calibrated on the real runtime at load.

``time = a + b * rows * len + c * rows * len**2``: a fixed cost per pass (call
overhead, small-matrix inefficiency), a cost per padded token (the dense layers),
and a cost growing with the square of the padded length (attention). The planner
uses it to choose cuts; on a CPU ``b`` dominates and padding decides, on a GPU ``a``
is larger and bigger batches pay, and the same fitted model is right for both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Final

import numpy as np

from coalesce.core.errors import ConfigError
from coalesce.settings import parse_cost_model

if TYPE_CHECKING:
    from coalesce.core.task import Task
    from coalesce.runtimes import Runtime

#: Shapes timed at load: (rows, padded length), spanning short queries to full-length documents
#: (lengths are cut to the task's longest row: 1 for models of fixed shape).
CALIBRATION_SHAPES: Final = ((1, 8), (1, 64), (1, 256), (4, 16), (4, 128), (16, 16), (16, 64),
                             (8, 256), (32, 32), (64, 16))
CALIBRATION_REPEATS: Final = 3
#: Lock file that makes models calibrating on one machine take turns (Triton loads models in parallel).
CALIBRATION_LOCK: Final = os.path.join(tempfile.gettempdir(), "coalesce-calibration.lock")


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
        try:
            return cls(*parse_cost_model(text))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

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


def calibrate(runtime: Runtime, task: Task, *, max_rows: int, max_tokens: int,
              shapes: Sequence[tuple[int, int]] = CALIBRATION_SHAPES,
              repeats: int = CALIBRATION_REPEATS) -> tuple[CostModel, list[tuple[int, int, float]]]:
    """Time the runtime on the task's representative passes within the limits and fit a ``CostModel``.

    Each shape runs once to warm up, then ``repeats`` times; the fastest run counts,
    because noise on a shared machine only ever adds time. Models of one server
    calibrate in turn (a lock file shared by every process on the machine): timed side
    by side they slowed each other several-fold and fitted that slowdown.
    """
    with _machine_lock(CALIBRATION_LOCK):
        return _calibrate(runtime, task, max_rows=max_rows, max_tokens=max_tokens, shapes=shapes, repeats=repeats)


@contextlib.contextmanager
def _machine_lock(path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path``; released when the block ends or the process dies."""
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _calibrate(runtime: Runtime, task: Task, *, max_rows: int, max_tokens: int, shapes: Sequence[tuple[int, int]],
               repeats: int) -> tuple[CostModel, list[tuple[int, int, float]]]:
    samples: list[tuple[int, int, float]] = []
    for rows, length in shapes:
        rows, length = min(rows, max_rows), min(length, task.max_length)
        if rows * length > max_tokens:
            rows = max(1, max_tokens // length)
        feeds = task.synthetic_feeds(rows, length)
        runtime.run(feeds, task.graph_outputs)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            runtime.run(feeds, task.graph_outputs)
            best = min(best, time.perf_counter() - start)
        samples.append((rows, length, best))
    return CostModel.fit(samples), samples
