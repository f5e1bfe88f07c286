"""``make bench-shared``: the shared (Redis) row-cache tier, measured with perf_analyzer.

Two questions, one run, every system side by side in each round:

1. What does the tier cost or gain against plain coalesce? A server serves ``minilm``
   (no cache) and ``minilm_shared`` (in-process tier + Redis tier) side by side. Redis is
   emptied first, so ``minilm_shared`` starts cold; the two points are measured back to
   back, in alternating order from round to round.
2. Does a second server sharing the Redis tier start warm? The first server then embeds
   the whole workload once through ``minilm_shared`` (as a peer serving that traffic
   would), and stops; a new one (a new process, nothing in memory) starts on the same
   Redis, and its first point with the same workload is the ``warm`` one, to compare with
   ``cold``: the same config and workload on a fresh instance, with Redis empty.

Each point reads the tier's hit/miss counters from Triton's metrics around it. Results:
``perf/results/<run>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from coalesce_tools import perfanalyzer
from coalesce_tools.launcher import RedisServer, ServerOptions, TritonServer
from perf import report, repository, workloads
from perf.report import write_summary

ROOT = Path(__file__).resolve().parent.parent
MINILM = ROOT / "model_repository" / "minilm"
PLAIN, SHARED = "minilm", "minilm_shared"
#: Texts per workload: cheap to prefill for duplicates (200 distinct), and above what one point sends.
DEFAULT_COUNTS = {"queries": 8000, "duplicates": 30000}
#: Row-cache counters read around every point.
COUNTERS = ("coalesce_cache_hits_total", "coalesce_shared_cache_hits_total", "coalesce_shared_cache_misses_total",
            "coalesce_shared_cache_errors_total", "coalesce_rows_total")


def build_repository(dest: Path, redis_url: str, cache_bytes: int) -> Path:
    """``minilm`` as shipped and ``minilm_shared`` (in-process tier of ``cache_bytes`` + Redis), weights linked."""
    config = repository.single_model_config()
    shared = repository.with_parameters(repository.renamed(config, SHARED),
                                        {"cache_bytes": str(cache_bytes), "redis_url": redis_url})
    for name, text in ((PLAIN, config), (SHARED, shared)):
        repository.add_model(dest, name, text)
    return dest


def counters(server: TritonServer, model: str) -> dict[str, float]:
    """The row-cache counters of ``model`` now, summed over label sets."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = {}
    for name in COUNTERS:
        pattern = re.compile(rf'^{name}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', re.M)
        out[name] = sum(float(v) for v in pattern.findall(text))
    return out


def flush_redis(redis_url: str) -> None:
    """Empty the Redis behind ``redis_url``."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        client.flushall()
    finally:
        client.close()


def measured(server: TritonServer, model: str, system: str, args: argparse.Namespace, input_data: Path,
             workdir: Path, **point: Any) -> dict[str, Any]:
    """One perf_analyzer point of ``model`` with the cache counters around it."""
    before = counters(server, model)
    result = perfanalyzer.measure(model=model, protocol="grpc", url=server.grpc_url, grpc_url=server.grpc_url,
                                  input_data=input_data, concurrency=args.concurrency,
                                  request_count=args.request_count, workdir=workdir)
    after = counters(server, model)
    delta = {k: after[k] - before[k] for k in COUNTERS}
    rows = max(delta["coalesce_rows_total"], 1.0)
    out = {**point, "system": system, **result, "rows": delta["coalesce_rows_total"],
           "local_hit_rate": delta["coalesce_cache_hits_total"] / rows,
           "shared_hit_rate": delta["coalesce_shared_cache_hits_total"] / rows,
           "shared_errors": delta["coalesce_shared_cache_errors_total"],
           "wrapped": delta["coalesce_rows_total"] > args.counts[point["profile"]]}
    sys.stderr.write(f"bench-shared: round {point['round']} {point['profile']} {system}: "
                     f"{out['throughput_per_s']:.1f}/s p99 {out['p99_ms']:.1f} ms, hits local "
                     f"{out['local_hit_rate']:.0%} shared {out['shared_hit_rate']:.0%}\n")
    return out


def prefill(server: TritonServer, texts: list[str], rows_per_request: int = 64) -> None:
    """Embed every text once through ``minilm_shared``; stopping the server then waits for its Redis writes."""
    from coalesce_client import EmbeddingClient

    with EmbeddingClient(server.grpc_url, model=SHARED) as client:
        client.embed_many([texts[i:i + rows_per_request] for i in range(0, len(texts), rows_per_request)])


def ratio_rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per profile: medians over rounds, and same-round ratios cold/plain, warm/cold, warm/plain."""
    rows = []
    for profile in sorted({p["profile"] for p in points}):
        by_round: dict[int, dict[str, dict[str, Any]]] = {}
        for p in points:
            if p["profile"] == profile:
                by_round.setdefault(p["round"], {})[p["system"]] = p
        full = [r for r in by_round.values() if {"plain", "cold", "warm"} <= r.keys()]

        def med(system: str, key: str, rounds: list[dict[str, dict[str, Any]]] = full) -> float | None:
            return report.median([r[system][key] for r in rounds])

        def ratio(a: str, b: str, rounds: list[dict[str, dict[str, Any]]] = full) -> float | None:
            return report.median([r[a]["throughput_per_s"] / r[b]["throughput_per_s"] for r in rounds])

        rows.append({"profile": profile, "rounds": len(full),
                     **{f"{s}_per_s": med(s, "throughput_per_s") for s in ("plain", "cold", "warm")},
                     **{f"{s}_p99_ms": med(s, "p99_ms") for s in ("plain", "cold", "warm")},
                     "cold_over_plain": ratio("cold", "plain"), "warm_over_cold": ratio("warm", "cold"),
                     "warm_over_plain": ratio("warm", "plain"),
                     "warm_shared_hit_rate": med("warm", "shared_hit_rate"),
                     "cold_hit_rate": report.median([r["cold"]["local_hit_rate"] + r["cold"]["shared_hit_rate"]
                                                     for r in full]),
                     "per_round_warm_over_cold": [r["warm"]["throughput_per_s"] / r["cold"]["throughput_per_s"]
                                                  for r in full]})
    return rows


def markdown(run: dict[str, Any]) -> str:
    """The report."""
    f = report._fmt
    lines = [f"# Shared row-cache tier: {run['run']}", "", f"- date: {run['date']}", f"- machine: {run['machine']}",
             f"- command: `{run['command']}`", f"- workloads: {run['workloads']}",
             f"- rounds: {run['rounds']}; gRPC, concurrency {run['concurrency']}; throughputs and p99s are medians "
             "over rounds, ratios are medians of same-round ratios", "",
             "Systems: `plain` is the shipped minilm (no cache); `cold` is `minilm_shared` (in-process tier "
             f"{run['cache_bytes']} B + Redis tier), Redis emptied before it; `warm` is `minilm_shared` in a second "
             "tritonserver process started after the first stopped, on the same Redis.", "",
             "| profile | plain/s | cold/s | warm/s | cold / plain | warm / cold | warm / plain | hit rate cold | "
             "shared hit rate warm | p99 plain / cold / warm ms | warm / cold per round |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in run["rows"]:
        lines.append(
            f"| {r['profile']} | {f(r['plain_per_s'], 1)} | {f(r['cold_per_s'], 1)} | {f(r['warm_per_s'], 1)} | "
            f"{f(r['cold_over_plain'])} | {f(r['warm_over_cold'])} | {f(r['warm_over_plain'])} | "
            f"{f(r['cold_hit_rate'])} | {f(r['warm_shared_hit_rate'])} | {f(r['plain_p99_ms'], 0)} / "
            f"{f(r['cold_p99_ms'], 0)} / {f(r['warm_p99_ms'], 0)} | "
            f"{', '.join(f(v) for v in r['per_round_warm_over_cold'])} |")
    # A warm point that wraps only sees more of what is cached anyway; plain and cold must not wrap.
    wrapped = [p for p in run["points"] if p.get("wrapped") and p["system"] != "warm"]
    lines += ["", f"Rows per point: {min(p['rows'] for p in run['points']):.0f} to "
                  f"{max(p['rows'] for p in run['points']):.0f}; "
              + (f"{len(wrapped)} point(s) sent more rows than the workload has, so perf_analyzer wrapped into "
                 "repeats: " + ", ".join(f"{p['profile']}/{p['system']}/round {p['round']}" for p in wrapped)
                 if wrapped else "no point wrapped around the workload.")] if run["points"] else []
    if run["failures"]:
        lines += ["", "Failed points:", *(f"- {x}" for x in run["failures"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the rounds and write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="queries,duplicates")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--count", type=int, default=None,
                        help="texts per workload (default: 8000 distinct queries, 30000 duplicates): more than one "
                             "point sends (see each point's rows), so perf_analyzer does not wrap into repeats the "
                             "workload does not have; the prefill embeds them all")
    parser.add_argument("--request-count", type=int, default=300, help="requests per measurement window")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-bytes", type=int, default=256 << 20, help="in-process tier of minilm_shared")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run", default=datetime.datetime.now(datetime.timezone.utc).strftime("shared-%Y%m%dT%H%M%SZ"))
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = parser.parse_args(argv)
    profiles = args.profiles.split(",")
    counts = args.counts = {p: args.count or DEFAULT_COUNTS.get(p, 8000) for p in profiles}
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="coalesce-bench-shared-"))
    inputs, texts = {}, {}
    for profile in profiles:
        inputs[profile] = workdir / f"{profile}.json"
        texts[profile] = workloads.generate(profile, counts[profile], args.seed)
        inputs[profile].write_text(json.dumps(workloads.to_input_data(texts[profile]), ensure_ascii=False))
    points: list[dict[str, Any]] = []
    failures: list[str] = []
    with RedisServer(maxmemory="2gb") as redis_server:
        repo = build_repository(workdir / "repo", redis_server.url, args.cache_bytes)

        def server() -> TritonServer:
            options = ServerOptions.on_free_ports(repo, model_control="explicit", load_models=(PLAIN, SHARED))
            return TritonServer(options)

        for round_index in range(args.rounds):
            for profile in profiles:
                point = {"round": round_index, "profile": profile}
                flush_redis(redis_server.url)
                try:
                    with server() as first:
                        # Alternate which goes first, so an order effect cancels over rounds.
                        pair = [(PLAIN, "plain"), (SHARED, "cold")]
                        for model, system in pair if round_index % 2 == 0 else pair[::-1]:
                            points.append(measured(first, model, system, args, inputs[profile], workdir, **point))
                        prefill(first, texts[profile])
                    with server() as second:  # a new process: only Redis remembers
                        points.append(measured(second, SHARED, "warm", args, inputs[profile], workdir, **point))
                except perfanalyzer.PerfAnalyzerError as exc:
                    sys.stderr.write(f"bench-shared: {point} failed: {exc}\n")
                    failures.append(f"{point}: {str(exc)[-300:]}")
    run = {"run": args.run, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{os.cpu_count()} cores, no GPU, ONNX Runtime CPU, redis-server on loopback",
           "command": "make bench-shared  # python -m perf.shared_cache " + " ".join(argv or sys.argv[1:]),
           "workloads": ", ".join(f"{p}: {n} texts" for p, n in counts.items())
                        + f" (queries: all distinct; duplicates: Zipf over 200), seed {args.seed}",
           "rounds": args.rounds, "concurrency": args.concurrency, "cache_bytes": args.cache_bytes,
           "points": points, "failures": failures}
    run["rows"] = ratio_rows(points)
    write_summary(args.out, args.run, run, markdown(run))
    shutil.rmtree(workdir, ignore_errors=True)
    sys.stderr.write(f"bench-shared: wrote {args.out / args.run}.md\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
