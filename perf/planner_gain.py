"""How much can cutting a window of texts into passes gain at all, on this machine?

In-process, tokenisation included, no server: every window of N consecutive texts is
run three ways back to back, and the times are summed per way, so the machine's drift
(±20% from second to second here) hits all three alike:

- ``planner``: the backend's own plan (DP cuts over the calibrated cost model), as
  ``Pipeline.run`` runs it;
- ``one_at_a_time``: one pass per text, no padding: what the ``naive`` baseline does
  with one-text requests;
- ``pad_to_longest``: one pass over the window padded to its longest text, in arrival
  order: what PyTriton's ``@batch`` does.

``planner / one_at_a_time`` bounds what any coalescing backend can gain over the naive
baseline on that workload with windows of N, whatever the server; ``planner /
pad_to_longest`` does the same against PyTriton. Writes ``perf/results/<run>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coalesce.batching.pipeline import Pipeline
from perf import limits, workloads
from perf.report import write_summary

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("planner", "one_at_a_time", "pad_to_longest")


def compare(pipeline: Pipeline, texts: Sequence[str], window: int) -> dict[str, float]:
    """Texts per second of each way over ``texts`` cut into windows of ``window``, interleaved per window."""
    spent = dict.fromkeys(WAYS, 0.0)
    for start in range(0, len(texts), window):
        chunk = list(texts[start:start + window])
        t0 = time.perf_counter()
        limits.embed_each(pipeline, chunk)
        t1 = time.perf_counter()
        limits.run_passes(pipeline, pipeline.task.prepare(chunk), [np.array([i]) for i in range(len(chunk))])
        t2 = time.perf_counter()
        limits.run_passes(pipeline, pipeline.task.prepare(chunk), [np.arange(len(chunk))])
        t3 = time.perf_counter()
        spent["planner"] += t1 - t0
        spent["one_at_a_time"] += t2 - t1
        spent["pad_to_longest"] += t3 - t2
    return {way: len(texts) / seconds for way, seconds in spent.items()}


def markdown(run: dict[str, Any]) -> str:
    """The gains as a table."""
    lines = [f"# Planner gain {run['run']}", "", f"- machine: {run['machine']}", f"- command: `{run['command']}`",
             f"- {run['texts']} texts per profile, seed 0; the three ways interleaved window by window", "",
             "| profile | window | planner/s | one at a time/s | pad to longest/s | planner / one at a time "
             "| planner / pad to longest |", "|" + " --- |" * 7]
    for r in run["rows"]:
        lines.append(f"| {r['profile']} | {r['window']} | {r['planner']:.1f} | {r['one_at_a_time']:.1f} | "
                     f"{r['pad_to_longest']:.1f} | {r['planner'] / r['one_at_a_time']:.2f} | "
                     f"{r['planner'] / r['pad_to_longest']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Measure every profile and window; write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="queries,documents")
    parser.add_argument("--windows", default="4,8,16,32,64")
    parser.add_argument("--texts", type=int, default=512, help="texts per profile")
    parser.add_argument("--version-dir", type=Path, default=ROOT / "model_repository" / "minilm" / "1")
    parser.add_argument("--run",
                        default=datetime.datetime.now(datetime.timezone.utc).strftime("planner-gain-%Y%m%dT%H%M%SZ"))
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = parser.parse_args(argv)
    pipeline = limits.make_pipeline(args.version_dir)
    rows = []
    for profile in args.profiles.split(","):
        texts = workloads.generate(profile, args.texts, 0)
        for window in (int(w) for w in args.windows.split(",")):
            row = {"profile": profile, "window": window, **compare(pipeline, texts, window)}
            rows.append(row)
            sys.stderr.write(f"planner gain {profile} window {window}: "
                             + ", ".join(f"{w} {row[w]:.1f}/s" for w in WAYS) + "\n")
    run = {"run": args.run, "machine": f"{os.cpu_count()} cores, no GPU, ONNX Runtime CPU",
           "command": "python -m perf.planner_gain " + " ".join(argv or sys.argv[1:]), "texts": args.texts,
           "cost_model": str(pipeline.cost_model), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, args.run, run, markdown(run))
    sys.stderr.write(f"planner gain: wrote {args.out / args.run}.md\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
