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
import json
import platform
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
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


def sorted_passes(task: Task, texts: Sequence[str], *, pass_rows: int) -> Iterator[Pass]:
    """``texts`` as the task's passes of up to ``pass_rows`` rows, sorted by length (as the planner forms them)."""
    prepared = task.prepare(list(texts))
    order = np.argsort(prepared.lengths, kind="stable")
    for start in range(0, len(order), pass_rows):
        rows = order[start:start + pass_rows]
        padded = int(prepared.lengths[rows].max())
        yield Pass(prepared, rows, padded, task.assemble(prepared, rows, padded))


def embed(task: Task, run: RunPass, texts: Sequence[str], *, pass_rows: int) -> np.ndarray:
    """The task's output vectors for ``texts`` (in order), run in length-sorted passes of ``pass_rows`` rows."""
    output = guarded_output(task)
    vectors: np.ndarray | None = None
    for batch in sorted_passes(task, texts, pass_rows=pass_rows):
        out = np.asarray(task.split(batch, run(batch.feeds, task.graph_outputs))[output], dtype=np.float32)
        if vectors is None:
            vectors = np.empty((len(texts), *out.shape[1:]), dtype=np.float32)
        vectors[batch.indices] = out
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


#: Beside an INT8 graph: how it was made and measured (``coalesce_tools.quantize`` writes it).
RECORD_SUFFIX: Final = ".json"


def int8_pays(int8_path: Path) -> tuple[bool, str]:
    """Whether precision ``auto`` serves the INT8 graph at ``int8_path``, and why (for the load log).

    It does where the export's record says the graph passed the guard and ran faster than the
    FP32 graph; the record also names the CPU it was measured on, and another CPU is called out.
    """
    record_path = int8_path.with_name(int8_path.name + RECORD_SUFFIX)
    if not record_path.is_file():
        return False, f"no INT8 graph measured here ({record_path.name} missing; `coalesce export --int8` makes one)"
    try:
        record = json.loads(record_path.read_text())
        chosen = record.get("chosen")
        ratio = float(record["texts_per_s_over_fp32"][chosen]) if chosen else 0.0
    except (ValueError, KeyError, TypeError) as exc:
        return False, f"{record_path.name} is unreadable ({exc})"
    if not chosen:
        return False, f"no INT8 graph passed the accuracy guard at export ({record_path.name})"
    if not int8_path.is_file():
        return False, f"{int8_path.name} is missing beside its record (`coalesce export --int8 --force` remakes it)"
    where = "" if record.get("cpu") in (None, cpu_name()) else f" (measured on {record['cpu']}, not this {cpu_name()})"
    if ratio <= 1.0:
        return False, f"the INT8 graph ({chosen}) ran {ratio:.2f}x FP32's texts/s at export{where}"
    return True, f"the INT8 graph ({chosen}) ran {ratio:.2f}x FP32's texts/s at export{where}"


def cpu_name() -> str:
    """This CPU's model name and its INT8 instruction sets, which decide which INT8 kernels are fast."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    extras = [name for name in ("avx512_vnni", "avx_vnni", "amx_int8") if name in flags]
    return f"{model} ({', '.join(extras) or 'no VNNI'})"
