"""``python -m perf.bulk``: a bulk job through one local server against the offline limit, and its cost.

For each workload a seeded corpus (``perf.workloads``, every text distinct) is written as
JSONL. One tritonserver serves minilm as a server running it alone for bulk work would:
every core, no row cache (all texts are distinct), and ONNX Runtime's threads not
spin-waiting (they would take the cores the server's front end, the stub and the job need
between passes). Each round measures, one after the other on the same machine:

- ``limit``: the offline in-process ceiling of ``perf.limits``: the model's own pipeline
  (every core, no row cache), the whole corpus tokenised, sorted by length and run at its
  best cuts (fixed 8/16/32/64, or the DP planner over the whole corpus); the better of
  ONNX Runtime spin-waiting and not, so the limit is not lowered by the served setting.
- ``bulk``: ``coalesce-client batch --tokenizer <the model's tokenizer.json>`` (a subprocess,
  as a user runs it) over the JSONL file into Parquet, concurrency found by itself. Rows/s
  is the job's own: reading, sorting, sending and merging the output included, Python's
  start-up not. ``bulk-est``: the same job without ``--tokenizer`` (rows sorted by estimated
  token counts).
- ``online``: the same server answering one text per HTTP request at concurrency 16, closed
  loop (``perf.closed_loop``), texts of the same corpus.

The report gives rows/s, bulk over limit (target >= 0.9x) and the cost of 1M rows for
the bulk job and for online serving: the machine's price (``--price-per-core-hour`` times
its cores, an assumption stated in the report) over the measured rows/s. Writes
``perf/results/bulk-<yyyymmdd>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from perf import closed_loop, limits, repository, workloads
from perf.report import median

RESULTS: Final = Path(__file__).resolve().parent / "results"
#: The bulk job's target against the offline limit (issue 20).
TARGET_RATIO: Final = 0.9
#: Concurrency of the online comparison.
ONLINE_CONCURRENCY: Final = 16
#: The project's usual instance price is $0.10/hour for this 2-core machine (perf/report.py, ``make bench``).
DEFAULT_PRICE_PER_CORE_HOUR: Final = 0.05
#: The served model: every core, no row cache, ONNX Runtime not spin-waiting.
SERVED_PARAMETERS: Final = {**repository.SINGLE_MODEL_THREADS, **repository.NO_CACHE, "thread_spinning": "false"}
#: Systems measured per round, in order.
SYSTEMS: Final = ("limit", "bulk", "bulk-est", "online")


def corpus_rows(texts: Sequence[str], prefix: str) -> list[dict[str, str]]:
    """The JSONL rows of a corpus: ids ``<prefix>-<n>`` in order, and the texts."""
    return [{"id": f"{prefix}-{i}", "text": text} for i, text in enumerate(texts)]


def write_jsonl(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Write one JSON object per line."""
    with open(path, "w", encoding="utf-8") as stream:
        for row in rows:
            stream.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def cost_per_million_rows(rows_per_s: float, price_per_core_hour: float, cores: int) -> float:
    """Dollars per million rows at ``rows_per_s`` on ``cores`` cores priced ``price_per_core_hour`` each."""
    if rows_per_s <= 0:
        return float("inf")
    return price_per_core_hour * cores / (rows_per_s * 3600.0) * 1e6


def batch_command(python: Path, grpc_url: str, model: str, source: Path, output: Path,
                  tokenizer: Path | None = None) -> list[str]:
    """The bulk job as a user runs it (a fresh output each time, no progress bar)."""
    return [str(python), "-m", "coalesce_client.cli", "--url", grpc_url, "--model", model, "batch", str(source),
            str(output), "--restart", "--no-progress", *(["--tokenizer", str(tokenizer)] if tokenizer else [])]


def summarize(points: Sequence[Mapping[str, Any]], profiles: Sequence[str], *, price_per_core_hour: float,
              cores: int) -> list[dict[str, Any]]:
    """Per workload: median rows/s of each system, medians of same-round ratios to the limit, and costs."""
    rows = []
    for profile in profiles:
        rates = {system: {int(p["round"]): float(p["rows_per_s"]) for p in points
                          if p["profile"] == profile and p["system"] == system} for system in SYSTEMS}
        limit = rates["limit"]
        summary: dict[str, Any] = {"profile": profile}
        for system in SYSTEMS:
            value = median(list(rates[system].values()))
            summary[f"{system}_rows_per_s"] = value
            summary[f"{system}_cost_per_m_rows"] = (cost_per_million_rows(value, price_per_core_hour, cores)
                                                    if value else None)
            if system.startswith("bulk"):
                ratios = [rate / limit[r] for r, rate in rates[system].items() if limit.get(r)]
                summary[f"{system}_over_limit_rounds"] = ratios
                summary[f"{system}_over_limit"] = median(ratios)
        bulk, online = summary["bulk_rows_per_s"], summary["online_rows_per_s"]
        summary["bulk_over_online"] = bulk / online if bulk and online else None
        summary["met"] = summary["bulk_over_limit"] is not None and summary["bulk_over_limit"] >= TARGET_RATIO
        rows.append(summary)
    return rows


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(run: Mapping[str, Any]) -> str:
    """The report: a table per workload, how the limit was reached and how the job spent its time."""
    price, cores = run["price_per_core_hour"], run["cores"]
    lines = [f"# Bulk jobs against the offline limit ({run['date']})", "",
             f"`{run['command']}` on {run['machine']}, {run['rounds']} round(s); corpora of {run['count']} distinct "
             f"texts per workload (seed {run['seed']}). One tritonserver serves `{run['model']}`: the shipped minilm "
             "config on every core, without its row cache and with ONNX Runtime not spin-waiting.", "",
             f"- `limit`: {run['limit_note']}",
             "- `bulk`: `coalesce-client batch --tokenizer <minilm's tokenizer.json>` over the corpus as JSONL into "
             "Parquet (a subprocess; rows/s of the job's whole run: reading, sorting, sending and the merged "
             "output), concurrency found by the job. `bulk-est`: the same without `--tokenizer` (rows sorted by "
             "estimated token counts).",
             f"- `online`: one text per HTTP request, closed loop at concurrency {ONLINE_CONCURRENCY}, "
             f"{run['online_duration_s']:g} s after a warm-up, same server and texts.",
             f"- cost: an assumed ${price:g} per core-hour x {cores} cores = ${price * cores:g}/hour for the machine; "
             "$ per 1M rows = that / (rows/s x 3600) x 1e6. Client and server share the same cores, so this is "
             "the whole job's cost.", "",
             "| workload | limit rows/s | bulk rows/s | bulk / limit (target >= 0.9) | bulk-est rows/s (/ limit) | "
             "online c=16 rows/s | $/1M rows bulk | $/1M rows online | bulk / online |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in run["summary"]:
        rounds = ", ".join(f"{r:.2f}" for r in row["bulk_over_limit_rounds"])
        verdict = "met" if row["met"] else "missed"
        lines.append(f"| {row['profile']} | {_fmt(row['limit_rows_per_s'])} | {_fmt(row['bulk_rows_per_s'])} | "
                     f"**{_fmt(row['bulk_over_limit'], 2)}** ({verdict}; rounds {rounds}) | "
                     f"{_fmt(row['bulk-est_rows_per_s'])} ({_fmt(row['bulk-est_over_limit'], 2)}) | "
                     f"{_fmt(row['online_rows_per_s'])} | {_fmt(row['bulk_cost_per_m_rows'], 3)} | "
                     f"{_fmt(row['online_cost_per_m_rows'], 3)} | {_times(row['bulk_over_online'])} |")
    lines += ["", "Per round:", "", "| round | workload | system | rows/s | detail |",
              "| --- | --- | --- | --- | --- |"]
    for point in run["points"]:
        lines.append(f"| {point['round']} | {point['profile']} | {point['system']} | {point['rows_per_s']:.1f} | "
                     f"{point.get('detail', '')} |")
    if run.get("notes"):
        lines += ["", *run["notes"]]
    return "\n".join(lines) + "\n"


def bulk_point(python: Path, grpc_url: str, model: str, source: Path, workdir: Path,
               tokenizer: Path | None) -> dict[str, Any]:
    """Run the bulk job once; its report, and the wall time seen from outside (Python's start-up included).

    Raises:
        RuntimeError: The job failed, or its output does not hold every row.
    """
    output = workdir / f"{source.stem}.parquet"
    started = time.perf_counter()
    done = subprocess.run(batch_command(python, grpc_url, model, source, output, tokenizer), capture_output=True,
                          text=True, timeout=3600)
    outside_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the bulk job failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    if report["output_rows"] != report["rows"] or report["rejected"]:
        raise RuntimeError(f"the bulk job wrote {report['output_rows']} of {report['rows']} rows: {done.stderr}")
    return {"rows_per_s": report["rows_per_s"], "outside_s": outside_s, "report": report,
            "detail": f"job {report['wall_s']:.1f} s (read {report['read_s']:.2f}, sort and send "
                      f"{report['send_s']:.1f}, "
                      f"merge {report['merge_s']:.2f}); {report['requests']} requests; concurrency "
                      f"{report['concurrency']} (windows {report['concurrency_history']}); process "
                      f"{outside_s:.1f} s"}


def main(argv: list[str] | None = None) -> int:
    """Build the corpora, serve the model, measure limit, bulk and online per round, write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", nargs="+", default=["queries", "documents"], choices=workloads.PROFILES[:2])
    parser.add_argument("--count", type=int, default=3000, help="texts per workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--online-duration-s", type=float, default=15.0)
    parser.add_argument("--price-per-core-hour", type=float, default=DEFAULT_PRICE_PER_CORE_HOUR,
                        help="assumed price of one core for an hour, in dollars (cost per 1M rows)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--run", help="report name (default bulk-<yyyymmdd>)")
    args = parser.parse_args(argv)
    today = datetime.date.today().strftime("%Y%m%d")
    name = args.run or f"bulk-{today}"
    cores = len(os.sched_getaffinity(0))
    model = "minilm"
    config = repository.with_parameters(repository.single_model_config(), SERVED_PARAMETERS)
    tokenizer = repository.MINILM / "1" / "tokenizer.json"
    workdir = Path(tempfile.mkdtemp(prefix="coalesce-bulk-"))
    corpora = {profile: workloads.generate(profile, args.count, args.seed) for profile in args.profiles}
    sources = {profile: write_jsonl(corpus_rows(texts, profile), workdir / f"{profile}.jsonl")
               for profile, texts in corpora.items()}
    points: list[dict[str, Any]] = []

    def record(point: dict[str, Any]) -> None:
        points.append(point)
        sys.stdout.write(f"round {point['round']} {point['profile']} {point['system']}: {point['rows_per_s']:.1f} "
                         f"rows/s {point.get('detail', '')}\n")
        sys.stdout.flush()

    # In process, both ways ONNX Runtime's threads may wait for work: the limit is the better one.
    pipelines = {spin: limits.make_pipeline(repository.MINILM / "1", thread_spinning=spin)
                 for spin in ("true", "false")}
    for pipeline in pipelines.values():
        limits.embed_each(pipeline, corpora[args.profiles[0]][:64])  # warm-up
    try:
        with repository.serve({model: config}, prefix="coalesce-bulk-repo-") as server:
            url = f"http://{server.http_url}/v2/models/{model}/infer"
            warm = closed_loop.encode_bodies(corpora[args.profiles[0]][:64], closed_loop.kserve_text)
            closed_loop.closed_loop(url, warm, 4, request_count=64)
            for round_index in range(args.rounds):
                for profile, texts in corpora.items():
                    measured = {spin: limits.limit(pipeline, texts) for spin, pipeline in pipelines.items()}
                    spin = max(measured, key=lambda k: measured[k][0])
                    record({"round": round_index, "profile": profile, "system": "limit",
                            "rows_per_s": measured[spin][0],
                            "detail": "; ".join(f"spinning {k}: {v[0]:.1f} ({v[1]})" for k, v in measured.items())})
                    for system, with_tokenizer in (("bulk", tokenizer), ("bulk-est", None)):
                        point = bulk_point(Path(sys.executable), server.grpc_url, model, sources[profile], workdir,
                                           with_tokenizer)
                        record({"round": round_index, "profile": profile, "system": system, **point})
                    bodies = closed_loop.encode_bodies(texts, closed_loop.kserve_text)
                    result = closed_loop.closed_loop(url, bodies, ONLINE_CONCURRENCY,
                                                     duration_s=args.online_duration_s, warmup_s=2.0)
                    summary = result.summary()
                    record({"round": round_index, "profile": profile, "system": "online",
                            "rows_per_s": summary["throughput_per_s"], "online": summary,
                            "detail": f"p50 {_fmt(summary['p50_ms'])} ms, p99 {_fmt(summary['p99_ms'])} ms, "
                                      f"{summary['errors']} errors"})
    finally:
        for pipeline in pipelines.values():
            pipeline.close()
    run = {"date": today, "command": "python -m perf.bulk " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": f"{platform.machine()}, {cores} cores", "cores": cores, "rounds": args.rounds,
           "count": args.count, "seed": args.seed, "model": model, "online_duration_s": args.online_duration_s,
           "price_per_core_hour": args.price_per_core_hour,
           "limit_note": "perf.limits.limit: the whole corpus tokenised and sorted by length, the best of fixed "
                         f"cuts {'/'.join(map(str, limits.FIXED_BATCH_SIZES))} and DP cuts over the whole corpus "
                         "(no server, no client, no file), with ONNX Runtime spin-waiting or not, whichever was "
                         "faster that round",
           "points": points,
           "summary": summarize(points, args.profiles, price_per_core_hour=args.price_per_core_hour, cores=cores)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(run, indent=1) + "\n")
    (args.out_dir / f"{name}.md").write_text(markdown(run))
    sys.stdout.write(f"wrote {args.out_dir / f'{name}.md'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
