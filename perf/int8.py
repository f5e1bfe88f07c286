"""INT8 graphs of ``minilm`` against its FP32 graph: the accuracy guard's numbers and compute speed.

The graphs: the shipped ``model.int8.onnx`` (``MatMulNBits``, made at set-up by ``coalesce
export --int8``) and ONNX Runtime's dynamic quantisation (``quantize_dynamic``, written here
to a scratch folder), per tensor and per channel. For each, in this process, no server:

- the guard (``coalesce.runtimes.quantized.agreement``): cosine to the FP32 graph on the
  built-in 148 texts, in length-sorted passes of 32 rows and one text at a time; the load
  needs mean >= 0.99 and minimum >= 0.98;
- alone vs batched: each guard text's vector from a pass of its own against the one from its
  pass of 32, the drift a neighbour's rows cause;
- compute: texts/s of length-sorted passes of 32 rows over seeded ``queries`` and
  ``documents`` (every core), the graphs interleaved per repeat; ratios to FP32 per repeat.

``python -m perf.int8`` writes ``perf/results/int8-<yyyymmdd>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from coalesce.runtimes.guard_texts import GUARD_TEXTS
from coalesce.runtimes.onnx import OnnxRuntime
from coalesce.runtimes.quantized import GUARD_PASS_ROWS, agreement, embed
from coalesce.settings import ModelSettings
from coalesce.tasks import create_task
from coalesce_tools.config import read_model_config, with_parameters
from perf import workloads
from perf.report import write_summary

ROOT = Path(__file__).resolve().parent.parent
MINILM = ROOT / "model_repository" / "minilm"


def dynamic_graph(fp32: Path, out: Path, *, per_channel: bool) -> Path:
    """ONNX Runtime's ``quantize_dynamic`` of ``fp32`` (INT8 weights, one activation scale per pass)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(fp32), str(out), weight_type=QuantType.QInt8, per_channel=per_channel)
    return out


def texts_per_s(task: Any, run: Callable[..., Any], texts: list[str]) -> float:
    """Texts per second of length-sorted passes of ``GUARD_PASS_ROWS`` rows over ``texts``."""
    start = time.perf_counter()
    embed(task, run, texts, pass_rows=GUARD_PASS_ROWS)
    return len(texts) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    """Measure every graph; write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="speed runs per graph and profile, interleaved")
    parser.add_argument("--count", type=int, default=512, help="texts per workload for the speed runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run", default=None, help="report name (default int8-<yyyymmdd>)")
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = parser.parse_args(argv)
    run_name = args.run or datetime.datetime.now(datetime.timezone.utc).strftime("int8-%Y%m%d")
    version = MINILM / "1"
    config = with_parameters(read_model_config(MINILM / "config.pbtxt"), {"precision": "fp32"})
    settings = ModelSettings.from_model_config(config)
    task = create_task(settings, config, version)
    fp32 = OnnxRuntime(version / settings.runtime.onnx_file)
    task.bind(fp32.graph)
    scratch = Path(tempfile.mkdtemp(prefix="coalesce-int8-"))
    graphs = {
        "fp32": fp32,
        "matmulnbits (shipped)": OnnxRuntime(version / settings.runtime.int8_onnx_file),
        "dynamic, per tensor": OnnxRuntime(dynamic_graph(fp32.path, scratch / "dyn.onnx", per_channel=False)),
        "dynamic, per channel": OnnxRuntime(dynamic_graph(fp32.path, scratch / "dynpc.onnx", per_channel=True)),
    }
    guard = {}
    for name, graph in graphs.items():
        if name == "fp32":
            continue
        found = agreement(task, fp32.run, graph.run)
        batched = embed(task, graph.run, GUARD_TEXTS, pass_rows=GUARD_PASS_ROWS)
        alone = embed(task, graph.run, GUARD_TEXTS, pass_rows=1)
        drift = (batched * alone).sum(axis=1) / (np.linalg.norm(batched, axis=1) * np.linalg.norm(alone, axis=1))
        guard[name] = {"mean_cosine": round(found.mean_cosine, 4), "min_cosine": round(found.min_cosine, 4),
                       "worst_text": found.worst_text,
                       "passes": found.passes(settings.runtime.int8_min_mean_cosine, settings.runtime.int8_min_cosine),
                       "alone_vs_batched_min_cosine": round(float(drift.min()), 4),
                       "alone_vs_batched_identical_rows": int((batched == alone).all(axis=1).sum())}
        sys.stderr.write(f"int8: {name}: {guard[name]}\n")
    speed: dict[str, dict[str, list[float]]] = {}
    for profile in ("queries", "documents"):
        texts = workloads.generate(profile, args.count, args.seed)
        for graph in graphs.values():  # one untimed pass each: sessions warm, allocations made
            embed(task, graph.run, texts[:GUARD_PASS_ROWS], pass_rows=GUARD_PASS_ROWS)
        for _ in range(args.repeats):
            for name, graph in graphs.items():
                speed.setdefault(profile, {}).setdefault(name, []).append(texts_per_s(task, graph.run, texts))
        medians = {name: round(statistics.median(runs), 1) for name, runs in speed[profile].items()}
        sys.stderr.write(f"int8: {profile}: {medians}\n")
    ratios = {profile: {name: round(statistics.median(a / b for a, b in zip(runs, by_graph["fp32"], strict=True)), 2)
                        for name, runs in by_graph.items() if name != "fp32"}
              for profile, by_graph in speed.items()}
    result = {"run": run_name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python -m perf.int8", *(argv if argv is not None else sys.argv[1:])]),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "guard_texts": len(GUARD_TEXTS),
              "thresholds": {"mean": settings.runtime.int8_min_mean_cosine, "min": settings.runtime.int8_min_cosine},
              "count": args.count, "repeats": args.repeats, "seed": args.seed,
              "guard": guard, "texts_per_s": speed, "ratio_to_fp32": ratios}
    args.out.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, run_name, result, markdown(result))
    sys.stderr.write(f"int8: wrote {args.out / run_name}.md\n")
    return 0


def markdown(run: dict[str, Any]) -> str:
    """The report: the guard's numbers and the speed ratios per graph."""
    limits = run["thresholds"]
    lines = [f"# INT8 graphs of minilm against FP32 ({run['run']})", "",
             f"`{run['command']}` on {run['machine']}, in process (no server). Guard: cosine to the FP32 graph on "
             f"the {run['guard_texts']} built-in texts, batched (passes of 32) and alone, the worse of both; the load "
             f"needs mean >= {limits['mean']} and minimum >= {limits['min']}. Alone vs batched: one graph's vector "
             "of a text in a pass of its own against the same text in its pass of 32. Speed: length-sorted passes "
             f"of 32 over {run['count']} seeded texts per workload, every core, {run['repeats']} interleaved "
             "repeats; medians, and the median of same-repeat ratios to FP32.", "",
             "| graph | guard mean | guard min | worst text | passes | alone vs batched min | rows identical "
             "| queries x fp32 | documents x fp32 |", "|" + " --- |" * 9]
    for name, g in run["guard"].items():
        lines.append(f"| {name} | {g['mean_cosine']:.4f} | {g['min_cosine']:.4f} | {g['worst_text'][:30]!r} | "
                     f"{'yes' if g['passes'] else 'no'} | {g['alone_vs_batched_min_cosine']:.4f} | "
                     f"{g['alone_vs_batched_identical_rows']}/{run['guard_texts']} | "
                     f"{run['ratio_to_fp32']['queries'][name]:.2f} | {run['ratio_to_fp32']['documents'][name]:.2f} |")
    lines += ["", "| workload | " + " | ".join(run["texts_per_s"]["queries"]) + " |",
              "|" + " --- |" * (1 + len(run["texts_per_s"]["queries"]))]
    for profile, by_graph in run["texts_per_s"].items():
        lines.append(f"| {profile} texts/s | " + " | ".join(f"{statistics.median(v):.1f}" for v in by_graph.values())
                     + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
