"""The INT8 accuracy guard: a quantised graph serves only if its vectors stay close to the FP32 graph's.

INT8 weights (``coalesce export --int8``) speed a CPU encoder up, but how far its vectors
drift depends on the model and on how it was quantised: a graph quantised with ONNX
Runtime's dynamic defaults can be far off while looking fine on a handful of texts. So at
load the INT8 graph and the FP32 graph both embed the built-in text set (``guard_texts``),
and the model loads only if the cosine between each pair of vectors has a mean and a
minimum at or above the settings ``int8_min_mean_cosine`` and ``int8_min_cosine``.

Quantised kernels may round a row differently with other rows beside it (activation
scales taken over a pass, kernels chosen by the pass's shape), so the texts are embedded
both in passes of up to ``GUARD_PASS_ROWS`` rows sorted by length (as the planner forms
them) and one at a time, and the worst of both counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from coalesce.core.errors import ConfigError
from coalesce.core.task import Pass, Task
from coalesce.runtimes.guard_texts import GUARD_TEXTS

#: Rows per pass of the guard's batched run (the planner's passes on short texts are of this order).
GUARD_PASS_ROWS: Final = 32

#: Runs one pass: feeds in, the graph's outputs by name out (a runtime's ``run``).
RunPass = Callable[[dict[str, np.ndarray], Sequence[str]], dict[str, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Agreement:
    """How close a candidate graph's vectors are to the reference graph's (cosine per text)."""

    mean_cosine: float
    min_cosine: float
    texts: int
    worst_text: str

    def passes(self, min_mean: float, min_each: float) -> bool:
        """Whether both the mean and the minimum reach their thresholds."""
        return self.mean_cosine >= min_mean and self.min_cosine >= min_each

    def describe(self) -> str:
        """The numbers, for a log line or an error."""
        return (f"mean cosine {self.mean_cosine:.4f}, minimum {self.min_cosine:.4f} over {self.texts} texts "
                f"(worst: {self.worst_text[:40]!r})")


def guarded_output(task: Task) -> str:
    """The output the guard compares by cosine: the task's one output (a vector per row).

    Raises:
        ConfigError: If the task has more than one output (which one to compare is not known).
    """
    if len(task.outputs) != 1:
        raise ConfigError(f"the INT8 accuracy guard compares a model's one output; this one has "
                          f"{[spec.name for spec in task.outputs]}")
    return task.outputs[0].name


def embed(task: Task, run: RunPass, texts: Sequence[str], *, pass_rows: int) -> np.ndarray:
    """The task's output vectors for ``texts`` (in order), run in length-sorted passes of ``pass_rows`` rows."""
    output = guarded_output(task)
    prepared = task.prepare(list(texts))
    order = np.argsort(prepared.lengths, kind="stable")
    vectors: np.ndarray | None = None
    for start in range(0, len(order), pass_rows):
        rows = order[start:start + pass_rows]
        padded = int(prepared.lengths[rows].max())
        batch = Pass(prepared, rows, padded, task.assemble(prepared, rows, padded))
        out = np.asarray(task.split(batch, run(batch.feeds, task.graph_outputs))[output], dtype=np.float32)
        if vectors is None:
            vectors = np.empty((len(texts), *out.shape[1:]), dtype=np.float32)
        vectors[rows] = out
    assert vectors is not None  # texts is never empty
    return vectors


def agreement(task: Task, reference: RunPass, candidate: RunPass,
              texts: Sequence[str] = GUARD_TEXTS) -> Agreement:
    """The candidate's cosine to the reference on ``texts``: batched and one at a time, the worst of both.

    The vectors compared are those of ``task.guarded_task()`` (the task's own, or for a task of
    text pairs the embedding of each text).
    """
    task = task.guarded_task()
    want = _unit(embed(task, reference, texts, pass_rows=GUARD_PASS_ROWS))
    batched = (_unit(embed(task, candidate, texts, pass_rows=GUARD_PASS_ROWS)) * want).sum(axis=1)
    alone = (_unit(embed(task, candidate, texts, pass_rows=1)) * want).sum(axis=1)
    cosine = np.minimum(batched, alone)
    worst = int(np.argmin(cosine))
    return Agreement(mean_cosine=float(min(batched.mean(), alone.mean())), min_cosine=float(cosine[worst]),
                     texts=len(texts), worst_text=texts[worst])


def _unit(vectors: np.ndarray) -> np.ndarray:
    flat = vectors.reshape(len(vectors), -1)
    return flat / np.maximum(np.linalg.norm(flat, axis=1, keepdims=True), 1e-12)
