"""INT8 graphs of ``minilm`` against its FP32 graph: the accuracy guard's numbers and compute speed.

The graphs: the shipped ``model.int8.onnx`` (made at set-up by ``coalesce export --int8``, the
faster of its two families on the building CPU; its record says which), ONNX Runtime's dynamic
quantisation (``quantize_dynamic``, written here to a scratch folder) per tensor and per
channel, and per channel with the MatMuls whose inputs have the worst outliers kept in FP32
(``coalesce_tools.quantize``'s dynamic family, at several counts). For each, in this process,
no server:

- the guard (``coalesce.runtimes.quantized.agreement``): cosine to the FP32 graph on the
  built-in 148 texts, in length-sorted passes of 32 rows and one text at a time; the load
  needs mean >= 0.99 and minimum >= 0.98;
- alone vs batched: each guard text's vector from a pass of its own against the one from its
  pass of 32, the drift a neighbour's rows cause;
- compute: texts/s of length-sorted passes of 32 rows over seeded ``queries`` and
  ``documents``, on one thread (a model's share beside busy neighbours) and on every core
  (alone), the graphs interleaved per repeat; ratios to FP32 per repeat.

``python -m perf.int8`` writes ``perf/results/int8-<yyyymmdd>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from coalesce.runtimes.guard_texts import GUARD_TEXTS
from coalesce.runtimes.onnx import OnnxRuntime
from coalesce.runtimes.quantized import GUARD_PASS_ROWS, agreement, embed
from coalesce.settings import ModelSettings
from coalesce.tasks import create_task
from coalesce_tools.config import read_model_config, with_parameters
from coalesce_tools.quantize import guard_feeds, outlier_ranking, quantize_dynamic_except, texts_per_s
from perf import workloads
from perf.report import write_summary

ROOT = Path(__file__).resolve().parent.parent
MINILM = ROOT / "model_repository" / "minilm"


def dynamic_graph(fp32: Path, out: Path, *, per_channel: bool) -> Path:
    """ONNX Runtime's ``quantize_dynamic`` of ``fp32`` (INT8 weights, one activation scale per pass)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(fp32), str(out), weight_type=QuantType.QInt8, per_channel=per_channel)
    return out


#: The thread layouts timed: a model's own share (beside busy neighbours) and every core (alone, spinning).
PROFILES: dict[str, dict[str, Any]] = {"1 thread": {"intra_op_threads": 1, "thread_spinning": False},
                                       "every core": {"intra_op_threads": 0, "thread_spinning": True}}
#: Counts of worst-outlier MatMuls kept in FP32 for the dynamic candidates.
FP32_COUNTS = (6, 12, 18)


def main(argv: list[str] | None = None) -> int:
    """Measure every graph; write the report."""
    from coalesce.runtimes.quantized import cpu_name

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
    fp32_path = version / settings.runtime.onnx_file
    task.bind(OnnxRuntime(fp32_path).graph)
    scratch = Path(tempfile.mkdtemp(prefix="coalesce-int8-"))
    shipped_path = version / settings.runtime.int8_onnx_file
    record = json.loads(shipped_path.with_name(shipped_path.name + ".json").read_text())
    paths = {"fp32": fp32_path, f"shipped: {record['chosen']}": shipped_path,
             "dynamic, per tensor": dynamic_graph(fp32_path, scratch / "dyn.onnx", per_channel=False),
             "dynamic, per channel": dynamic_graph(fp32_path, scratch / "dynpc.onnx", per_channel=True)}
    ranking = outlier_ranking(fp32_path, guard_feeds(task, GUARD_TEXTS))
    for count in FP32_COUNTS:
        path = scratch / f"dyn{count}.onnx"
        quantize_dynamic_except(fp32_path, path, [name for name, _ in ranking[:count]])
        paths[f"dynamic, per channel, {count} of {len(ranking)} in FP32"] = path
    reference = OnnxRuntime(fp32_path)
    guard = {}
    for name, path in paths.items():
        if name == "fp32":
            continue
        graph = OnnxRuntime(path)
        found = agreement(task, reference.run, graph.run)
        batched = embed(task, graph.run, GUARD_TEXTS, pass_rows=GUARD_PASS_ROWS)
        alone = embed(task, graph.run, GUARD_TEXTS, pass_rows=1)
        drift = (batched * alone).sum(axis=1) / (np.linalg.norm(batched, axis=1) * np.linalg.norm(alone, axis=1))
        guard[name] = {"mean_cosine": round(found.mean_cosine, 4), "min_cosine": round(found.min_cosine, 4),
                       "worst_text": found.worst_text,
                       "passes": found.passes(settings.runtime.int8_min_mean_cosine, settings.runtime.int8_min_cosine),
                       "alone_vs_batched_min_cosine": round(float(drift.min()), 4),
                       "alone_vs_batched_identical_rows": int((batched == alone).all(axis=1).sum())}
        sys.stderr.write(f"int8: {name}: {guard[name]}\n")
    speed: dict[str, dict[str, dict[str, list[float]]]] = {}
    for profile, threads in PROFILES.items():
        graphs = {name: OnnxRuntime(path, **threads) for name, path in paths.items()}
        for workload in ("queries", "documents"):
            texts = workloads.generate(workload, args.count, args.seed)
            for graph in graphs.values():  # one untimed pass each: sessions warm, allocations made
                embed(task, graph.run, texts[:GUARD_PASS_ROWS], pass_rows=GUARD_PASS_ROWS)
            runs = speed.setdefault(profile, {}).setdefault(workload, {})
            for _ in range(args.repeats):
                for name, graph in graphs.items():
                    runs.setdefault(name, []).append(texts_per_s(task, graph.run, texts))
            sys.stderr.write(f"int8: {profile} {workload}: "
                             f"{ {n: round(statistics.median(r), 1) for n, r in runs.items()} }\n")
        del graphs
    ratios = {profile: {workload: {name: round(statistics.median(a / b for a, b in zip(runs, by_graph["fp32"],
                                                                                         strict=True)), 2)
                                   for name, runs in by_graph.items() if name != "fp32"}
                        for workload, by_graph in by_workload.items()}
              for profile, by_workload in speed.items()}
    result = {"run": run_name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python -m perf.int8", *(argv if argv is not None else sys.argv[1:])]),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {cpu_name()}", "guard_texts": len(GUARD_TEXTS),
              "thresholds": {"mean": settings.runtime.int8_min_mean_cosine, "min": settings.runtime.int8_min_cosine},
              "count": args.count, "repeats": args.repeats, "seed": args.seed, "shipped_record": record,
              "guard": guard, "texts_per_s": speed, "ratio_to_fp32": ratios}
    args.out.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, run_name, result, markdown(result))
    sys.stderr.write(f"int8: wrote {args.out / run_name}.md\n")
    return 0


def markdown(run: dict[str, Any]) -> str:
    """The report: the guard's numbers and the speed ratios per graph and thread layout."""
    limits = run["thresholds"]
    profiles = list(run["ratio_to_fp32"])
    lines = [f"# INT8 graphs of minilm against FP32 ({run['run']})", "",
             f"`{run['command']}` on {run['machine']}, in process (no server). Guard: cosine to the FP32 graph on "
             f"the {run['guard_texts']} built-in texts, batched (passes of 32) and alone, the worse of both; the load "
             f"needs mean >= {limits['mean']} and minimum >= {limits['min']}. Alone vs batched: one graph's vector "
             "of a text in a pass of its own against the same text in its pass of 32. Speed: length-sorted passes "
             f"of 32 over {run['count']} seeded texts per workload, {run['repeats']} interleaved repeats; medians, "
             "and the median of same-repeat ratios to FP32, on one thread (no spinning) and on every core "
             "(spinning).", "",
             f"Shipped `model.int8.onnx`: {run['shipped_record']['quantization']}; set-up timed "
             + ", ".join(f"{k} {v}x" for k, v in run["shipped_record"]["texts_per_s_over_fp32"].items())
             + " FP32 on one thread.", "",
             "| graph | guard mean | guard min | worst text | passes | alone vs batched min | rows identical | "
             + " | ".join(f"{w} x fp32, {p}" for p in profiles for w in ("queries", "documents")) + " |",
             "|" + " --- |" * (7 + 2 * len(profiles))]
    for name, g in run["guard"].items():
        cells = [f"{run['ratio_to_fp32'][p][w][name]:.2f}" for p in profiles for w in ("queries", "documents")]
        lines.append(f"| {name} | {g['mean_cosine']:.4f} | {g['min_cosine']:.4f} | {g['worst_text'][:30]!r} | "
                     f"{'yes' if g['passes'] else 'no'} | {g['alone_vs_batched_min_cosine']:.4f} | "
                     f"{g['alone_vs_batched_identical_rows']}/{run['guard_texts']} | " + " | ".join(cells) + " |")
    for profile, by_workload in run["texts_per_s"].items():
        names = list(by_workload["queries"])
        lines += ["", f"texts/s, {profile}:", "", "| workload | " + " | ".join(names) + " |",
                  "|" + " --- |" * (1 + len(names))]
        for workload, by_graph in by_workload.items():
            lines.append(f"| {workload} | " + " | ".join(f"{statistics.median(v):.1f}" for v in by_graph.values())
                         + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
