"""``python -m perf.bulk``: a bulk job through one local server against the offline limit, and its cost.

For each workload a seeded corpus (``perf.workloads``, every text distinct) is written as
JSONL. One tritonserver serves minilm twice, as a server running it alone for bulk work
would: no row cache (every text is distinct) and ONNX Runtime's threads not spin-waiting
(they would take the cores the server's front end, the stub and the job need between
passes), in two layouts of the same two cores:

- ``1x2``: one instance whose passes use every core (``SINGLE_MODEL_THREADS``'s layout);
- ``2x1``: two instances of one thread each, so one instance's Python work (tokenising,
  assembling, splitting, the stub's round trip) overlaps the other's forward pass.

Each round measures, one after the other on the same machine:

- ``limit``: the offline in-process ceiling, no server, no client, no file: the best of
  ``perf.limits.limit`` (the model's pipeline on every core, not spin-waiting as served, or
  both ways with ``--limit-spinning true false``; the whole corpus tokenised, sorted by
  length and run at its best cuts: fixed 8/16/32/64, or the DP planner over the whole
  corpus) and of two one-thread pipelines side by side (``parallel_limit``: the same sorted
  corpus, fixed cuts dealt out in turn), the in-process counterpart of ``2x1``.
- ``bulk``: ``coalesce-client batch --tokenizer <the model's tokenizer.json>`` (a subprocess,
  as a user runs it) over the JSONL file into Parquet through ``2x1``, concurrency found by
  itself. Rows/s is the job's own: reading, sorting, sending and merging the output
  included, Python's start-up not. ``bulk-1x2``: the same through ``1x2``. ``bulk-est``:
  through ``2x1`` without ``--tokenizer`` (rows sorted by estimated token counts).
  ``bulk-ray``: through ``2x1`` with ``--engine ray`` (a one-node Ray instance the job starts,
  on the same cores; its start-up is in the job's time).
- ``online``, ``online-1x2``: one text per HTTP request at concurrency 16, closed loop
  (``perf.closed_loop``), texts of the same corpus, through ``2x1`` and ``1x2``.

The report gives rows/s, bulk over limit (target >= 0.9x) and the cost of 1M rows for
the bulk job and for online serving on the same server: the machine's price
(``--price-per-core-hour`` times its cores, an assumption stated in the report) over the
measured rows/s. Writes ``perf/results/bulk-<yyyymmdd>.{json,md}``.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import numpy as np

from perf import closed_loop, limits, repository, workloads
from perf.report import median, write_summary

RESULTS: Final = Path(__file__).resolve().parent / "results"
#: The bulk job's target against the offline limit (issue 20).
TARGET_RATIO: Final = 0.9
#: Concurrency of the online comparison.
ONLINE_CONCURRENCY: Final = 16
#: The project's usual instance price is $0.10/hour for this 2-core machine (perf/report.py, ``make bench``).
DEFAULT_PRICE_PER_CORE_HOUR: Final = 0.05
#: Texts per workload: enough for each bulk job to run 10-20 s here, so that its fixed costs (reading the
#: file, counting tokens, merging the output) weigh as they would on a real job.
DEFAULT_COUNTS: Final = {"queries": 10000, "documents": 3000, "mixed": 3000}
#: Every served variant: no row cache, ONNX Runtime not spin-waiting.
SERVED_PARAMETERS: Final = {**repository.NO_CACHE, "thread_spinning": "false"}
#: Served layouts of the two cores: model name -> (instances, ONNX Runtime intra-op threads; 0: every core).
LAYOUTS: Final = {"1x2": (1, 0), "2x1": (2, 1)}
#: Systems measured per round, in order, and the layout each goes through.
SYSTEMS: Final = ("limit", "bulk", "bulk-1x2", "bulk-est", "bulk-ray", "online", "online-1x2")
SYSTEM_LAYOUT: Final = {"bulk": "2x1", "bulk-1x2": "1x2", "bulk-est": "2x1", "bulk-ray": "2x1", "online": "2x1",
                        "online-1x2": "1x2"}
#: The shipped config's instance group, which a layout replaces.
INSTANCE_GROUP: Final = "instance_group [ { count: 1, kind: KIND_CPU } ]"


def layout_config(shipped: str, instances: int, threads: int) -> str:
    """``shipped`` (the minilm config) served as ``instances`` instances of ``threads`` intra-op threads each."""
    if INSTANCE_GROUP not in shipped:
        raise ValueError(f"the config has no {INSTANCE_GROUP!r} to replace")
    config = shipped.replace(INSTANCE_GROUP, f"instance_group [ {{ count: {instances}, kind: KIND_CPU }} ]")
    return repository.with_parameters(config, {**SERVED_PARAMETERS, "intra_op_threads": str(threads)})


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


def deal(groups: Sequence[np.ndarray], workers: int) -> list[list[np.ndarray]]:
    """``groups`` dealt out in turn to ``workers`` (each gets every ``workers``-th, so all get alike lengths)."""
    return [list(groups[k::workers]) for k in range(workers)]


def parallel_limit(pipelines: Sequence[Any], texts: Sequence[str]) -> tuple[float, str]:
    """Rows/s of one-thread pipelines side by side: the corpus tokenised once and sorted, fixed cuts dealt out.

    The best of fixed cuts 8/16/32/64; each pipeline runs its share of the passes in its own
    thread (ONNX Runtime and the tokenizer release the GIL).
    """
    options: dict[str, float] = {}
    with ThreadPoolExecutor(max_workers=len(pipelines)) as pool:
        for batch in limits.FIXED_BATCH_SIZES:
            start = time.perf_counter()
            prepared = pipelines[0].task.prepare(list(texts))
            order = np.argsort(prepared.lengths, kind="stable")
            shares = deal([order[i:i + batch] for i in range(0, len(order), batch)], len(pipelines))
            runs = [pool.submit(limits.run_passes, pipeline, prepared, share)
                    for pipeline, share in zip(pipelines, shares, strict=True)]
            for run in runs:
                run.result()
            options[f"sorted, fixed {batch}"] = len(texts) / (time.perf_counter() - start)
    best = max(options, key=lambda k: options[k])
    return options[best], best


def batch_command(python: Path, grpc_url: str, model: str, source: Path, output: Path,
                  tokenizer: Path | None = None, engine: str = "local") -> list[str]:
    """The bulk job as a user runs it (a fresh output each time, no progress bar)."""
    return [str(python), "-m", "coalesce_client.cli", "--url", grpc_url, "--model", model, "batch", str(source),
            str(output), "--restart", "--no-progress", *(["--tokenizer", str(tokenizer)] if tokenizer else []),
            *(["--engine", engine] if engine != "local" else [])]


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
        # The one-instance layout against its own in-process counterpart: the one-pipeline limit.
        one = {int(p["round"]): max(v[0] for k, v in p["variants"].items() if k.startswith("1 x"))
               for p in points if p["profile"] == profile and p["system"] == "limit"
               and any(k.startswith("1 x") for k in p.get("variants", {}))}
        ratios = [rate / one[r] for r, rate in rates["bulk-1x2"].items() if one.get(r)]
        summary["limit-1x2_rows_per_s"] = median(list(one.values()))
        summary["bulk-1x2_over_limit-1x2"] = median(ratios)
        for bulk, online in (("bulk", "online"), ("bulk-1x2", "online-1x2")):
            a, b = summary[f"{bulk}_rows_per_s"], summary[f"{online}_rows_per_s"]
            summary[f"{bulk}_over_{online}"] = a / b if a and b else None
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
    counts = ", ".join(f"{count} {profile}" for profile, count in run["counts"].items())
    lines = [f"# Bulk jobs against the offline limit ({run['date']})", "",
             f"`{run['command']}` on {run['machine']}, {run['rounds']} round(s); corpora of {counts} (distinct "
             f"texts, seed {run['seed']}). One tritonserver serves minilm (INT8, as shipped) without its row cache "
             "and with ONNX Runtime not spin-waiting, in two layouts of the cores: `2x1` (two instances of one "
             "thread) and `1x2` (one instance on every core).", "",
             f"- `limit`: {run['limit_note']}",
             "- `bulk`: `coalesce-client batch --tokenizer <minilm's tokenizer.json>` over the corpus as JSONL into "
             "Parquet through `2x1` (a subprocess; rows/s of the job's whole run: reading, counting tokens, "
             "sending and the merged output; Python's start-up not), concurrency found by the job. `bulk-1x2`: the "
             "same through `1x2`. `bulk-est`: through `2x1` without `--tokenizer` (rows sorted by estimated token "
             "counts). `bulk-ray`: as `bulk-est` with `--engine ray` (a one-node Ray instance started by the job on "
             "the same cores, its start-up counted; Ray's actors sort by estimated counts).",
             f"- `online`: one text per HTTP request, closed loop at concurrency {ONLINE_CONCURRENCY}, "
             f"{run['online_duration_s']:g} s after a warm-up, same server and texts, through `2x1` (`online-1x2`: "
             "through `1x2`).",
             f"- cost: an assumed ${price:g} per core-hour x {cores} cores = ${price * cores:g}/hour for the machine; "
             "$ per 1M rows = that / (rows/s x 3600) x 1e6. Client and server share the same cores, so this is "
             "the whole job's cost.", "",
             "| workload | limit rows/s | bulk rows/s | bulk / limit (target >= 0.9) | bulk-1x2 (/ limit) | "
             "bulk-est (/ limit) | bulk-ray (/ limit) | online c=16 | $/1M rows bulk | $/1M rows online | "
             "bulk / online |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in run["summary"]:
        rounds = ", ".join(f"{r:.2f}" for r in row["bulk_over_limit_rounds"])
        verdict = "met" if row["met"] else "missed"
        lines.append(f"| {row['profile']} | {_fmt(row['limit_rows_per_s'])} | {_fmt(row['bulk_rows_per_s'])} | "
                     f"**{_fmt(row['bulk_over_limit'], 2)}** ({verdict}; rounds {rounds}) | "
                     f"{_fmt(row['bulk-1x2_rows_per_s'])} ({_fmt(row['bulk-1x2_over_limit'], 2)}) | "
                     f"{_fmt(row['bulk-est_rows_per_s'])} ({_fmt(row['bulk-est_over_limit'], 2)}) | "
                     f"{_fmt(row.get('bulk-ray_rows_per_s'))} ({_fmt(row.get('bulk-ray_over_limit'), 2)}) | "
                     f"{_fmt(row['online_rows_per_s'])} | {_fmt(row['bulk_cost_per_m_rows'], 3)} | "
                     f"{_fmt(row['online_cost_per_m_rows'], 3)} | {_times(row['bulk_over_online'])} |")
    lines += ["", "On the one-instance layout (`1x2`), against its in-process counterpart (the one-pipeline limit), "
              "and bulk and online side by side:", "",
              "| workload | one-pipeline limit rows/s | bulk-1x2 rows/s (/ that limit) | online-1x2 c=16 rows/s | "
              "$/1M rows bulk-1x2 | $/1M rows online-1x2 | bulk / online |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in run["summary"]:
        lines.append(f"| {row['profile']} | {_fmt(row.get('limit-1x2_rows_per_s'))} | "
                     f"{_fmt(row['bulk-1x2_rows_per_s'])} ({_fmt(row.get('bulk-1x2_over_limit-1x2'), 2)}) | "
                     f"{_fmt(row['online-1x2_rows_per_s'])} | {_fmt(row['bulk-1x2_cost_per_m_rows'], 3)} | "
                     f"{_fmt(row['online-1x2_cost_per_m_rows'], 3)} | {_times(row['bulk-1x2_over_online-1x2'])} |")
    lines += ["", "Per round (load: the machine's 1-minute load average as the point ended; with the bench alone "
              f"on the machine it stays near its {cores} cores, higher during the online points, whose generator, "
              "front end and stubs all have runnable threads):", "",
              "| round | workload | system | rows/s | load | detail |", "| --- | --- | --- | --- | --- | --- |"]
    for point in run["points"]:
        lines.append(f"| {point['round']} | {point['profile']} | {point['system']} | {point['rows_per_s']:.1f} | "
                     f"{_fmt(point.get('load_1m'), 2)} | {point.get('detail', '')} |")
    for note in run.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def bulk_point(python: Path, grpc_url: str, model: str, source: Path, workdir: Path,
               tokenizer: Path | None, engine: str = "local") -> dict[str, Any]:
    """Run the bulk job once; its report, and the wall time seen from outside (Python's start-up included).

    Raises:
        RuntimeError: The job failed, or its output does not hold every row.
    """
    output = workdir / f"{source.stem}.parquet"
    started = time.perf_counter()
    done = subprocess.run(batch_command(python, grpc_url, model, source, output, tokenizer, engine),
                          capture_output=True, text=True, timeout=3600)
    outside_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the bulk job failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    if report["output_rows"] != report["rows"] or report["rejected"]:
        raise RuntimeError(f"the bulk job wrote {report['output_rows']} of {report['rows']} rows: {done.stderr}")
    return {"rows_per_s": report["rows_per_s"], "outside_s": outside_s, "report": report,
            "detail": f"job {report['wall_s']:.1f} s (read {report['read_s']:.2f}, count tokens and send "
                      f"{report['send_s']:.1f}, merge {report['merge_s']:.2f}); {report['requests']} requests; "
                      f"concurrency {report['concurrency']} (windows at {[c for c, _ in report['concurrency_history']]}"
                      f"); process {outside_s:.1f} s"}


def online_point(url: str, texts: Sequence[str], duration_s: float) -> dict[str, Any]:
    """Closed-loop HTTP at ``ONLINE_CONCURRENCY``, one text per request."""
    bodies = closed_loop.encode_bodies(texts, closed_loop.kserve_text)
    summary = closed_loop.closed_loop(url, bodies, ONLINE_CONCURRENCY, duration_s=duration_s, warmup_s=2.0).summary()
    return {"rows_per_s": summary["throughput_per_s"], "online": summary,
            "detail": f"p50 {_fmt(summary['p50_ms'])} ms, p99 {_fmt(summary['p99_ms'])} ms, {summary['errors']} errors"}


def limit_point(single: Mapping[str, Any], parallel: Sequence[Any], texts: Sequence[str]) -> dict[str, Any]:
    """The best in-process rate over every variant, and each variant's."""
    measured = {f"1 x every core, spinning {spin}": limits.limit(pipeline, texts) for spin, pipeline in single.items()}
    measured["2 x 1 thread"] = parallel_limit(parallel, texts)
    best = max(measured, key=lambda k: measured[k][0])
    return {"rows_per_s": measured[best][0], "variants": {k: list(v) for k, v in measured.items()},
            "detail": "; ".join(f"{k}: {v[0]:.1f} ({v[1]})" for k, v in measured.items())}


def main(argv: list[str] | None = None) -> int:
    """Build the corpora, serve both layouts, measure every system per round, write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", nargs="+", default=["queries", "documents", "mixed"],
                        choices=[p for p in workloads.PROFILES if p != "duplicates"])
    parser.add_argument("--count", type=int, help="texts per workload (default: "
                        + ", ".join(f"{k} {v}" for k, v in DEFAULT_COUNTS.items()) + ")")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--online-duration-s", type=float, default=15.0)
    parser.add_argument("--price-per-core-hour", type=float, default=DEFAULT_PRICE_PER_CORE_HOUR,
                        help="assumed price of one core for an hour, in dollars (cost per 1M rows)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--run", help="report name (default bulk-<yyyymmdd>)")
    parser.add_argument("--note", action="append", default=[], help="a line added to the report (repeatable)")
    parser.add_argument("--limit-spinning", nargs="+", choices=("true", "false"), default=["false"],
                        help="ONNX Runtime spin-waiting settings of the one-pipeline limit (both: the better; "
                             "spin-waiting never gave the best limit here, two one-thread pipelines did)")
    parser.add_argument("--from-json", type=Path, help="only write the report again from a run's JSON (its "
                        "summary recomputed from its points), beside it")
    args = parser.parse_args(argv)
    if args.from_json:
        run = json.loads(args.from_json.read_text())
        run["summary"] = summarize(run["points"], list(run["counts"]), price_per_core_hour=run["price_per_core_hour"],
                                   cores=run["cores"])
        run["notes"] = [*run.get("notes", []), *args.note]
        args.from_json.write_text(json.dumps(run, indent=1) + "\n")
        args.from_json.with_suffix(".md").write_text(markdown(run))
        sys.stdout.write(f"wrote {args.from_json.with_suffix('.md')}\n")
        return 0
    today = datetime.date.today().strftime("%Y%m%d")
    name = args.run or f"bulk-{today}"
    cores = len(os.sched_getaffinity(0))
    shipped = (repository.MINILM / "config.pbtxt").read_text()
    configs = {f"minilm_{layout}": layout_config(shipped, *shape) for layout, shape in LAYOUTS.items()}
    tokenizer = repository.MINILM / "1" / "tokenizer.json"
    workdir = Path(tempfile.mkdtemp(prefix="coalesce-bulk-"))
    counts = {profile: args.count or DEFAULT_COUNTS[profile] for profile in args.profiles}
    corpora = {profile: workloads.generate(profile, counts[profile], args.seed) for profile in args.profiles}
    sources = {profile: write_jsonl(corpus_rows(texts, profile), workdir / f"{profile}.jsonl")
               for profile, texts in corpora.items()}
    points: list[dict[str, Any]] = []

    def record(point: dict[str, Any]) -> None:
        # The machine's 1-minute load as the point ends: above the cores' count, something else was running too.
        point["load_1m"] = round(os.getloadavg()[0], 2)
        points.append(point)
        sys.stdout.write(f"round {point['round']} {point['profile']} {point['system']}: {point['rows_per_s']:.1f} "
                         f"rows/s {point.get('detail', '')}\n")
        sys.stdout.flush()

    version = repository.MINILM / "1"
    single = {spin: limits.make_pipeline(version, thread_spinning=spin) for spin in args.limit_spinning}
    parallel = [limits.make_pipeline(version, intra_op_threads="1", thread_spinning="false") for _ in range(2)]
    for pipeline in (*single.values(), *parallel):
        limits.embed_each(pipeline, corpora[args.profiles[0]][:64])  # warm-up
    try:
        with repository.serve(configs, prefix="coalesce-bulk-repo-") as server:
            urls = {layout: f"http://{server.http_url}/v2/models/minilm_{layout}/infer" for layout in LAYOUTS}
            warm = closed_loop.encode_bodies(corpora[args.profiles[0]][:64], closed_loop.kserve_text)
            for url in urls.values():
                closed_loop.closed_loop(url, warm, 4, request_count=64)
            for round_index in range(args.rounds):
                for profile, texts in corpora.items():
                    here = {"round": round_index, "profile": profile}
                    record({**here, "system": "limit", **limit_point(single, parallel, texts)})
                    for system in ("bulk", "bulk-1x2", "bulk-est", "bulk-ray"):
                        point = bulk_point(Path(sys.executable), server.grpc_url,
                                           f"minilm_{SYSTEM_LAYOUT[system]}", sources[profile], workdir,
                                           None if system in ("bulk-est", "bulk-ray") else tokenizer,
                                           "ray" if system == "bulk-ray" else "local")
                        record({**here, "system": system, **point})
                    for system in ("online", "online-1x2"):
                        record({**here, "system": system,
                                **online_point(urls[SYSTEM_LAYOUT[system]], texts, args.online_duration_s)})
    finally:
        for pipeline in (*single.values(), *parallel):
            pipeline.close()
    run = {"date": today,
           "command": " ".join(["python -m perf.bulk", *(argv if argv is not None else sys.argv[1:])]),
           "machine": f"{platform.machine()}, {cores} cores", "cores": cores, "rounds": args.rounds,
           "counts": counts, "seed": args.seed, "online_duration_s": args.online_duration_s,
           "price_per_core_hour": args.price_per_core_hour,
           "limit_note": "the best of perf.limits.limit (the served pipeline on every core, spin-waiting "
                         f"{' or '.join(args.limit_spinning).replace('true', 'on').replace('false', 'off')}: the "
                         "whole corpus tokenised and sorted by length, the best of fixed cuts "
                         f"{'/'.join(map(str, limits.FIXED_BATCH_SIZES))} and DP cuts over the whole corpus) and of "
                         "two one-thread pipelines side by side (the same sorted corpus, the best fixed cuts dealt out "
                         "in turn); no server, no client, no file",
           "configs": configs, "points": points, "notes": args.note,
           "summary": summarize(points, args.profiles, price_per_core_hour=args.price_per_core_hour, cores=cores)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_summary(args.out_dir, name, run, markdown(run))
    sys.stdout.write(f"wrote {args.out_dir / f'{name}.md'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
