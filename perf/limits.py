"""Offline ceilings: the same runtime in-process, no server, tokenisation included.

- ``limit``: the whole workload sorted by length, run at its best fixed batch size
  (or the whole-workload DP plan, if better). No online server can beat it.
- ``limit@N``: only reordering and cutting within windows of N consecutive texts, as a
  server holding N requests at once could, with the best cuts we can find (the DP
  planner over a calibrated cost model).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from coalesce.batching.pipeline import Pipeline
from coalesce.core.task import Prepared
from coalesce.loader import load_pipeline
from coalesce_tools.config import read_model_config, with_parameters
from perf.repository import NO_CACHE, SINGLE_MODEL_THREADS

FIXED_BATCH_SIZES = (8, 16, 32, 64)


def make_pipeline(version_dir: Path, **parameters: str) -> Pipeline:
    """A pipeline as the served model has it alone (its config, every core, no row cache), ``parameters`` set."""
    config = with_parameters(read_model_config(version_dir.parent / "config.pbtxt"),
                             {**SINGLE_MODEL_THREADS, **NO_CACHE, **parameters})
    return load_pipeline(config, version_dir)


def text_requests(texts: Sequence[str]) -> list[dict[str, np.ndarray]]:
    """One ``TEXT`` request per text, as the adapter hands requests over."""
    return [{"TEXT": np.array([[t.encode("utf-8")]], dtype=object)} for t in texts]


def embed_each(pipeline: Pipeline, texts: Sequence[str]) -> None:
    """Run the pipeline once over one request per text (read, coalesced and computed together)."""
    pipeline.run([pipeline.read(request) for request in text_requests(texts)])


def limit_at(pipeline: Pipeline, texts: Sequence[str], window: int) -> float:
    """Texts per second when only windows of ``window`` consecutive texts may be reordered and cut."""
    requests = text_requests(texts)
    start = time.perf_counter()
    for i in range(0, len(requests), window):
        pipeline.run([pipeline.read(r) for r in requests[i:i + window]])
    return len(requests) / (time.perf_counter() - start)


def run_passes(pipeline: Pipeline, prepared: Prepared, groups: Iterable[np.ndarray]) -> None:
    """Run one forward pass per group of rows of ``prepared``, padded to the group's longest, with the task's split."""
    for rows in groups:
        pipeline.run_pass(prepared, rows, int(prepared.lengths[rows].max()))


def sorted_fixed(pipeline: Pipeline, texts: Sequence[str], batch: int) -> float:
    """Texts per second: tokenise all, sort by length, run fixed cuts of ``batch`` rows."""
    start = time.perf_counter()
    prepared = pipeline.task.prepare(list(texts))
    order = np.argsort(prepared.lengths, kind="stable")
    run_passes(pipeline, prepared, (order[i:i + batch] for i in range(0, len(order), batch)))
    return len(texts) / (time.perf_counter() - start)


def limit(pipeline: Pipeline, texts: Sequence[str]) -> tuple[float, str]:
    """The ceiling and how it was reached."""
    options = {f"sorted, fixed {b}": sorted_fixed(pipeline, texts, b) for b in FIXED_BATCH_SIZES}
    options["sorted, DP cuts"] = limit_at(pipeline, texts, len(texts))
    best = max(options, key=lambda k: options[k])
    return options[best], best
