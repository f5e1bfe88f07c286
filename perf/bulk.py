"""``python -m perf.bulk``: a bulk job through one local server against the offline limit, and its cost.

For each workload a seeded corpus (``perf.workloads``, every text distinct) is written as
JSONL, and each round measures, one after the other on the same machine:

- ``limit``: the offline in-process ceiling of ``perf.limits``: the served model's own
  pipeline (every core, no row cache), the whole corpus tokenised, sorted by length and
  run at its best cuts (fixed 8/16/32/64, or the DP planner over the whole corpus).
- ``bulk``: ``coalesce-client batch`` (a subprocess, as a user runs it) over the JSONL file
  into Parquet, through one tritonserver serving that same model config, its concurrency
  found by itself. Rows/s is the job's own: reading, sending and merging the output
  included, Python's start-up not.
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


def batch_command(python: Path, grpc_url: str, model: str, source: Path, output: Path) -> list[str]:
    """The bulk job as a user runs it (a fresh output each time, no progress bar)."""
    return [str(python), "-m", "coalesce_client.cli", "--url", grpc_url, "--model", model, "batch", str(source),
            str(output), "--restart", "--no-progress"]


def summarize(points: Sequence[Mapping[str, Any]], profiles: Sequence[str], *, price_per_core_hour: float,
              cores: int) -> list[dict[str, Any]]:
    """Per workload: median rows/s of each system, the median of same-round bulk/limit ratios, and costs."""
    rows = []
    for profile in profiles:
        def rates(system: str, profile: str = profile) -> dict[int, float]:
            return {int(p["round"]): float(p["rows_per_s"]) for p in points
                    if p["profile"] == profile and p["system"] == system}

        limit, bulk, online = rates("limit"), rates("bulk"), rates("online")
        ratios = [bulk[r] / limit[r] for r in bulk if r in limit and limit[r] > 0]
        medians = {name: median(list(values.values())) for name, values in
                   (("limit", limit), ("bulk", bulk), ("online", online))}
        costs = {name: (cost_per_million_rows(value, price_per_core_hour, cores) if value else None)
                 for name, value in medians.items()}
        ratio = median(ratios)
        rows.append({"profile": profile, **{f"{k}_rows_per_s": v for k, v in medians.items()},
                     "bulk_over_limit": ratio, "bulk_over_limit_rounds": ratios,
                     "bulk_over_online": (medians["bulk"] / medians["online"]
                                          if medians["bulk"] and medians["online"] else None),
                     **{f"{k}_cost_per_m_rows": v for k, v in costs.items()},
                     "met": ratio is not None and ratio >= TARGET_RATIO})
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
             "config on every core without its row cache, the pipeline `limit` runs in process.", "",
             f"- `limit`: {run['limit_note']}",
             "- `bulk`: `coalesce-client batch` over the corpus as JSONL into Parquet (a subprocess; rows/s of the "
             "job's whole run: reading, sending and the merged output), concurrency found by the job.",
             f"- `online`: one text per HTTP request, closed loop at concurrency {ONLINE_CONCURRENCY}, "
             f"{run['online_duration_s']:g} s after a warm-up, same server and texts.",
             f"- cost: an assumed ${price:g} per core-hour x {cores} cores = ${price * cores:g}/hour for the machine; "
             "$ per 1M rows = that / (rows/s x 3600) x 1e6. Client and server share the same cores, so this is "
             "the whole job's cost.", "",
             "| workload | limit rows/s | bulk rows/s | bulk / limit (target >= 0.9) | online c=16 rows/s | "
             "$/1M rows bulk | $/1M rows online | bulk / online |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in run["summary"]:
        rounds = ", ".join(f"{r:.2f}" for r in row["bulk_over_limit_rounds"])
        verdict = "met" if row["met"] else "missed"
        lines.append(f"| {row['profile']} | {_fmt(row['limit_rows_per_s'])} | {_fmt(row['bulk_rows_per_s'])} | "
                     f"**{_fmt(row['bulk_over_limit'], 2)}** ({verdict}; rounds {rounds}) | "
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


def bulk_point(python: Path, grpc_url: str, model: str, source: Path, workdir: Path) -> dict[str, Any]:
    """Run the bulk job once; its report, and the wall time seen from outside (Python's start-up included).

    Raises:
        RuntimeError: The job failed, or its output does not hold every row.
    """
    output = workdir / f"{source.stem}.parquet"
    started = time.perf_counter()
    done = subprocess.run(batch_command(python, grpc_url, model, source, output), capture_output=True, text=True,
                          timeout=3600)
    outside_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the bulk job failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    if report["output_rows"] != report["rows"] or report["rejected"]:
        raise RuntimeError(f"the bulk job wrote {report['output_rows']} of {report['rows']} rows: {done.stderr}")
    return {"rows_per_s": report["rows_per_s"], "outside_s": outside_s, "report": report,
            "detail": f"job {report['wall_s']:.1f} s (read {report['read_s']:.2f}, send {report['send_s']:.1f}, "
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
    config = repository.with_parameters(repository.single_model_config(), repository.NO_CACHE)
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

    pipeline = limits.make_pipeline(repository.MINILM / "1")
    limits.embed_each(pipeline, corpora[args.profiles[0]][:64])  # warm-up
    try:
        with repository.serve({model: config}, prefix="coalesce-bulk-repo-") as server:
            for round_index in range(args.rounds):
                for profile, texts in corpora.items():
                    rate, how = limits.limit(pipeline, texts)
                    record({"round": round_index, "profile": profile, "system": "limit", "rows_per_s": rate,
                            "detail": how})
                    bulk = bulk_point(Path(sys.executable), server.grpc_url, model, sources[profile], workdir)
                    record({"round": round_index, "profile": profile, "system": "bulk", **bulk})
                    bodies = closed_loop.encode_bodies(texts, closed_loop.kserve_text)
                    result = closed_loop.closed_loop(f"http://{server.http_url}/v2/models/{model}/infer", bodies,
                                                     ONLINE_CONCURRENCY, duration_s=args.online_duration_s,
                                                     warmup_s=2.0)
                    summary = result.summary()
                    record({"round": round_index, "profile": profile, "system": "online",
                            "rows_per_s": summary["throughput_per_s"], "online": summary,
                            "detail": f"p50 {_fmt(summary['p50_ms'])} ms, p99 {_fmt(summary['p99_ms'])} ms, "
                                      f"{summary['errors']} errors"})
    finally:
        pipeline.close()
    run = {"date": today, "command": "python -m perf.bulk " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": f"{platform.machine()}, {cores} cores", "cores": cores, "rounds": args.rounds,
           "count": args.count, "seed": args.seed, "model": model, "online_duration_s": args.online_duration_s,
           "price_per_core_hour": args.price_per_core_hour,
           "limit_note": "perf.limits.limit: the whole corpus tokenised and sorted by length, the best of fixed "
                         f"cuts {'/'.join(map(str, limits.FIXED_BATCH_SIZES))} and DP cuts over the whole corpus "
                         "(no server, no client, no file)",
           "points": points,
           "summary": summarize(points, args.profiles, price_per_core_hour=args.price_per_core_hour, cores=cores)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(run, indent=1) + "\n")
    (args.out_dir / f"{name}.md").write_text(markdown(run))
    sys.stdout.write(f"wrote {args.out_dir / f'{name}.md'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
