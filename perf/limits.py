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

from coalesce.pipeline import EmbeddingPipeline
from coalesce.pooling import pool
from coalesce.settings import Settings
from coalesce.tokenizer import EncodedRows

FIXED_BATCH_SIZES = (8, 16, 32, 64)


def make_pipeline(version_dir: Path, **parameters: str) -> EmbeddingPipeline:
    """A pipeline as the served model has it (DP planner, calibrated cost model)."""
    settings = Settings.from_parameters(dict(parameters), model_name="limit", max_batch_size=64, embedding_dim=384)
    return EmbeddingPipeline.from_version_dir(settings, version_dir)


def limit_at(pipeline: EmbeddingPipeline, texts: Sequence[str], window: int) -> float:
    """Texts per second when only windows of ``window`` consecutive texts may be reordered and cut."""
    rows = [t.encode("utf-8") for t in texts]
    start = time.perf_counter()
    for i in range(0, len(rows), window):
        pipeline.embed([[r] for r in rows[i:i + window]])
    return len(rows) / (time.perf_counter() - start)


def run_passes(pipeline: EmbeddingPipeline, encoded: EncodedRows, groups: Iterable[np.ndarray]) -> None:
    """Run one forward pass per group of rows of ``encoded``, padded to the group's longest, and pool it."""
    for rows in groups:
        ids, mask, types = encoded.padded(rows, int(encoded.lengths[rows].max()))
        pool(pipeline.runtime.run(ids, mask, types), mask, mode=pipeline.settings.pooling,
             normalize=pipeline.settings.normalize)


def sorted_fixed(pipeline: EmbeddingPipeline, texts: Sequence[str], batch: int) -> float:
    """Texts per second: tokenise all, sort by length, run fixed cuts of ``batch`` rows."""
    start = time.perf_counter()
    encoded = pipeline.tokenizer.encode(list(texts))
    order = np.argsort(encoded.lengths, kind="stable")
    run_passes(pipeline, encoded, (order[i:i + batch] for i in range(0, len(order), batch)))
    return len(texts) / (time.perf_counter() - start)


def limit(pipeline: EmbeddingPipeline, texts: Sequence[str]) -> tuple[float, str]:
    """The ceiling and how it was reached."""
    options = {f"sorted, fixed {b}": sorted_fixed(pipeline, texts, b) for b in FIXED_BATCH_SIZES}
    options["sorted, DP cuts"] = limit_at(pipeline, texts, len(texts))
    best = max(options, key=lambda k: options[k])
    return options[best], best
