"""``python -m perf.capacity``: replicas for a load on paper, from one server's measured numbers.

Reads committed results and computes, for a target of rows per second at a p99:

1. **Per replica**: of the measured closed-loop points of one server (``perf.peers``, the
   ``coalesce`` system: texts/s and p99 per concurrency, medians over rounds), the one with
   the most texts/s whose p99 meets the target. Only measured points: no curve between them.
2. **Replicas**: the target over that, at a chosen headroom (a policy, not a measurement:
   how far below its measured capacity each replica is meant to run, for uneven balancing
   and the time a new replica takes to start).
3. **The shared tier at a repeat rate** (the fraction of rows whose text some replica served
   before): a row found in a cache costs what ``perf.shared_cache`` measured for rows all
   served from caches, a row computed costs what it measured for distinct rows; with the
   Redis tier every repeat is found, without it only the repeats first seen on the same
   replica (``hit_rate_without_tier``).
4. **Bulk beside online** (when a ``perf.bulk`` result is given): replica-hours per million
   rows for a bulk job and for online serving at concurrency 16.
5. **Bulk on N Ray nodes** (when that result has ``bulk-ray`` points): a job's wall time and
   rows/s on N nodes, each a machine like the measured one with its own server, from the
   measured one-node Ray job: its start-up, its sending rate, and the driver's merge per row
   (``ray_scaling``).

Writes ``perf/results/capacity-<yyyymmdd>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from perf.report import median, write_summary

RESULTS: Final = Path(__file__).resolve().parent / "results"
SYSTEM: Final = "coalesce"


@dataclasses.dataclass(frozen=True)
class Capacity:
    """One server's measured point: rows per second at a concurrency, with its p99."""

    profile: str
    concurrency: int
    rows_per_s: float
    p99_ms: float


def measured_points(peers_run: Mapping[str, Any], system: str = SYSTEM) -> list[Capacity]:
    """Medians over rounds of ``system``'s texts/s and p99 per profile and concurrency."""
    grouped: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for point in peers_run["points"]:
        if point["system"] == system and not point.get("errors"):
            grouped.setdefault((point["profile"], int(point["concurrency"])), []).append(point)
    out = []
    for (profile, concurrency), points in sorted(grouped.items()):
        rows = median([float(p["throughput_per_s"]) for p in points])
        p99 = median([float(p["p99_ms"]) for p in points])
        assert rows is not None and p99 is not None
        out.append(Capacity(profile, concurrency, rows, p99))
    return out


def capacity_at(points: Sequence[Capacity], profile: str, p99_ms: float) -> Capacity | None:
    """The measured point of ``profile`` with the most rows/s whose p99 is at most ``p99_ms``; None if none is."""
    meeting = [p for p in points if p.profile == profile and p.p99_ms <= p99_ms]
    return max(meeting, key=lambda p: p.rows_per_s, default=None)


def replicas_needed(rows_per_s: float, per_replica_rows_per_s: float, headroom: float) -> int:
    """Replicas that carry ``rows_per_s`` with each at ``headroom`` (0 < headroom <= 1) of its capacity."""
    if per_replica_rows_per_s <= 0 or not 0 < headroom <= 1:
        raise ValueError(f"need a positive capacity and 0 < headroom <= 1, got {per_replica_rows_per_s}, {headroom}")
    return max(1, math.ceil(rows_per_s / (per_replica_rows_per_s * headroom) - 1e-9))


def cost_per_row(hit_rate: float, miss_rows_per_s: float, hit_rows_per_s: float) -> float:
    """Replica-seconds per row when ``hit_rate`` of rows are cache hits, relative to all rows computed (1.0)."""
    return (1.0 - hit_rate) + hit_rate * miss_rows_per_s / hit_rows_per_s


def hit_rate_without_tier(repeat_rate: float, replicas: int) -> float:
    """Hits the in-process caches alone find, with requests spread uniformly over ``replicas``.

    Assumes each repeat's earlier sighting was one request, so the repeat lands on the
    replica that cached it with probability 1/replicas. Rows repeated many times sit in
    more replicas' caches: for them the in-process caches find more, and the tier saves less.
    """
    return repeat_rate / replicas


def replicas_with_repeats(rows_per_s: float, per_replica_rows_per_s: float, headroom: float, repeat_rate: float,
                          miss_rows_per_s: float, hit_rows_per_s: float, *, shared_tier: bool) -> int:
    """Replicas for a load of which ``repeat_rate`` repeats earlier rows, with or without the shared tier.

    Without the tier the local hit rate depends on the replica count: iterated to its fixed point.
    """
    replicas = replicas_needed(rows_per_s, per_replica_rows_per_s, headroom)
    for _ in range(64):
        hits = repeat_rate if shared_tier else hit_rate_without_tier(repeat_rate, replicas)
        load = rows_per_s * cost_per_row(hits, miss_rows_per_s, hit_rows_per_s)
        again = replicas_needed(load, per_replica_rows_per_s, headroom)
        if again == replicas:
            break
        replicas = again
    return replicas


def shared_costs(shared_run: Mapping[str, Any], profile: str) -> tuple[float, float]:
    """(rows/s all computed, rows/s all from caches) of ``perf.shared_cache`` for one profile, medians over rounds.

    ``plain`` (no cache) on distinct rows is the computed rate; ``warm`` (a second server on a
    filled Redis tier: every row a hit, in process or in Redis) the cached one.
    """
    def rate(system: str) -> float:
        values = [float(p["throughput_per_s"]) for p in shared_run["points"]
                  if p["system"] == system and p["profile"] == profile]
        value = median(values)
        if value is None:
            raise ValueError(f"the shared-tier run has no {system} point for profile {profile}")
        return value

    return rate("plain"), rate("warm")


def bulk_costs(bulk_run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Replica-hours per million rows per profile, bulk and online at concurrency 16, from a ``perf.bulk`` result."""
    out = []
    for entry in bulk_run["summary"]:
        bulk, online = float(entry["bulk_rows_per_s"]), float(entry["online_rows_per_s"])
        out.append({"profile": entry["profile"], "bulk_rows_per_s": bulk, "online_c16_rows_per_s": online,
                    "bulk_replica_hours_per_1m": 1e6 / bulk / 3600, "online_replica_hours_per_1m": 1e6 / online / 3600})
    return out


#: Nodes and job sizes of the Ray scaling table.
RAY_NODES: Final = (1, 2, 4, 8, 16, 64)
RAY_JOB_ROWS: Final = (1e6, 1e8, 1e9)


def ray_wall_s(rows: float, nodes: int, *, start_s: float, node_rows_per_s: float, merge_s_per_row: float) -> float:
    """A Ray job's wall time on ``nodes`` nodes: start-up, the rows sent at every node's rate, the driver's merge."""
    return start_s + rows / (nodes * node_rows_per_s) + rows * merge_s_per_row


def ray_scaling(bulk_run: Mapping[str, Any], *, nodes: Sequence[int] = RAY_NODES,
                job_rows: Sequence[float] = RAY_JOB_ROWS) -> list[dict[str, Any]]:
    """Per profile with ``bulk-ray`` points: the measured one-node terms and the modelled table for N nodes.

    The terms are medians over rounds of the one-node job's reports: start-up (its wall time less
    sending and merging: Ray's start, reading, planning), sending rate (rows written over seconds
    sending), and the driver's merge per output row. The local engine's rows/s on the same server
    is shown beside them: the most one node's server gave a job.
    """
    out = []
    for profile in dict.fromkeys(p["profile"] for p in bulk_run["points"]):
        reports = [p["report"] for p in bulk_run["points"]
                   if p["profile"] == profile and p["system"] == "bulk-ray" and p.get("report")]
        if not reports:
            continue
        start_s = median([r["wall_s"] - r["send_s"] - r["merge_s"] for r in reports])
        node_rate = median([r["written"] / r["send_s"] for r in reports if r["send_s"] > 0])
        merge = median([r["merge_s"] / max(1, r["output_rows"]) for r in reports])
        if start_s is None or node_rate is None or merge is None:
            continue  # a job that sent nothing measured no rate
        local = median([float(p["rows_per_s"]) for p in bulk_run["points"]
                        if p["profile"] == profile and p["system"] == "bulk"])
        table = [{"nodes": n, "rows": rows,
                  "wall_s": ray_wall_s(rows, n, start_s=start_s, node_rows_per_s=node_rate, merge_s_per_row=merge)}
                 for rows in job_rows for n in nodes]
        for row in table:
            row["rows_per_s"] = row["rows"] / row["wall_s"]
            row["efficiency"] = row["rows_per_s"] / (row["nodes"] * node_rate)
        out.append({"profile": profile, "rows_measured": reports[0]["rows"], "start_s": start_s,
                    "node_rows_per_s": node_rate, "merge_s_per_row": merge, "local_rows_per_s": local,
                    "table": table})
    return out


def plan(peers_run: Mapping[str, Any], shared_run: Mapping[str, Any], *, rows_per_s: float, p99_ms: float,
         headroom: float, repeat_rates: Sequence[float], profiles: Sequence[str],
         bulk_run: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The capacity plan as data (what ``markdown`` prints)."""
    points = measured_points(peers_run)
    by_profile = []
    for profile in profiles:
        best = capacity_at(points, profile, p99_ms)
        entry: dict[str, Any] = {"profile": profile,
                                 "measured": [dataclasses.asdict(p) for p in points if p.profile == profile]}
        if best is None:
            entry["meets_p99"] = False
            by_profile.append(entry)
            continue
        # The shared-tier run measures distinct rows on its own profiles; another profile takes the
        # ratio of queries (short texts: a computed row is cheapest there, so a hit is costed high).
        cache_profile = profile if profile in {p["profile"] for p in shared_run["points"]} else "queries"
        miss, hit = shared_costs(shared_run, cache_profile)
        entry.update(meets_p99=True, per_replica=dataclasses.asdict(best), cache_profile=cache_profile,
                     replicas=replicas_needed(rows_per_s, best.rows_per_s, headroom),
                     replicas_at_full_load=replicas_needed(rows_per_s, best.rows_per_s, 1.0),
                     miss_rows_per_s=miss, hit_rows_per_s=hit,
                     repeats=[{"repeat_rate": r,
                               "with_tier": replicas_with_repeats(rows_per_s, best.rows_per_s, headroom, r, miss, hit,
                                                                  shared_tier=True),
                               "without_tier": replicas_with_repeats(rows_per_s, best.rows_per_s, headroom, r, miss,
                                                                     hit, shared_tier=False)}
                              for r in repeat_rates])
        by_profile.append(entry)
    return {"rows_per_s": rows_per_s, "p99_ms": p99_ms, "headroom": headroom, "profiles": by_profile,
            "bulk": bulk_costs(bulk_run) if bulk_run else None,
            "ray": ray_scaling(bulk_run) if bulk_run else None}


def markdown(run: Mapping[str, Any]) -> str:
    """The report."""
    target = f"{run['rows_per_s']:g} rows/s at p99 <= {run['p99_ms']:g} ms"
    lines = [f"# Capacity on paper: {run['run']}", "",
             f"- command: `{run['command']}`",
             f"- target: {target}; headroom {run['headroom']:g} (each replica planned at that share of its "
             "measured capacity: a choice, not a measurement)",
             f"- per-replica numbers: `{run['sources']['peers']}` (system `{SYSTEM}`, "
             f"{run['sources']['peers_machine']}); "
             f"cache costs: `{run['sources']['shared']}`"
             + (f"; bulk: `{run['sources']['bulk']}`" if run["sources"].get("bulk") else ""),
             ""]
    for entry in run["profiles"]:
        lines += [f"## {entry['profile']}", "", "| concurrency | rows/s | p99 ms | meets the p99 |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {p['concurrency']} | {p['rows_per_s']:.1f} | {p['p99_ms']:.1f} | "
                  f"{'yes' if p['p99_ms'] <= run['p99_ms'] else 'no'} |" for p in entry["measured"]]
        lines.append("")
        if not entry["meets_p99"]:
            lines += [f"No measured point meets p99 <= {run['p99_ms']:g} ms: measure lower concurrencies "
                      "(or a faster model) before planning on this profile.", ""]
            continue
        best = entry["per_replica"]
        lines += [f"Per replica: {best['rows_per_s']:.1f} rows/s (concurrency {best['concurrency']}, p99 "
                  f"{best['p99_ms']:.1f} ms). **Replicas for {target}: {entry['replicas']}** "
                  f"({entry['replicas_at_full_load']} at full measured capacity).", "",
                  f"Shared tier (profile {entry['cache_profile']} of the shared-tier run): rows computed "
                  f"{entry['miss_rows_per_s']:.1f}/s, rows all from caches {entry['hit_rows_per_s']:.1f}/s per server "
                  f"(a hit costs {entry['miss_rows_per_s'] / entry['hit_rows_per_s']:.3f} of a computed row).", "",
                  "| repeat rate | replicas with the Redis tier | without it (in-process caches only) | saved |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {r['repeat_rate']:g} | {r['with_tier']} | {r['without_tier']} | "
                  f"{r['without_tier'] - r['with_tier']} |" for r in entry["repeats"]]
        lines.append("")
    if run.get("bulk"):
        lines += ["## Bulk beside online", "",
                  "One server; bulk: `coalesce-client batch` over a file; online: one text per request at "
                  "concurrency 16.", "",
                  "| profile | bulk rows/s | online rows/s | replica-hours per 1M rows: bulk | online | ratio |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {b['profile']} | {b['bulk_rows_per_s']:.1f} | {b['online_c16_rows_per_s']:.1f} | "
                  f"{b['bulk_replica_hours_per_1m']:.2f} | {b['online_replica_hours_per_1m']:.2f} | "
                  f"{b['online_replica_hours_per_1m'] / b['bulk_replica_hours_per_1m']:.2f}x |" for b in run["bulk"]]
        lines.append("")
    for entry in run.get("ray") or []:
        lines += [f"## Bulk on N Ray nodes: {entry['profile']}", "",
                  f"Measured on one node (`bulk-ray`, {entry['rows_measured']} rows, the server and the job on the "
                  f"same cores): start-up {entry['start_s']:.1f} s (Ray's start, reading, planning), sending "
                  f"{entry['node_rows_per_s']:.1f} rows/s, the driver's merge {entry['merge_s_per_row'] * 1e6:.1f} us "
                  f"a row. The local engine on the same server: {_num(entry['local_rows_per_s'])} rows/s.", "",
                  "wall = start-up + rows / (N x sending rate) + rows x merge; each node a machine like this one "
                  "with its own server.", "",
                  "| rows | nodes | wall | rows/s | of N x one node |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {row['rows']:.0e} | {row['nodes']} | {_duration(row['wall_s'])} | {row['rows_per_s']:.0f} | "
                  f"{row['efficiency']:.0%} |" for row in entry["table"]]
        lines.append("")
    if run.get("ray"):
        lines += ["Ray model assumptions: nodes add sending rate linearly (each has its own server, and Ray's "
                  "scheduling and the shared file system do not limit them); start-up is what one node took and does "
                  "not grow with nodes; the merge into one output file runs on the driver alone, so it bounds a huge "
                  "job (at that size the part files would be the output; the engine merges them today).", ""]
    lines += ["## Assumptions", "",
              "- A replica serves what the one measured server served: same model, config, cores and client load "
              "shape. The per-replica numbers were measured with the load generator on the same 2 cores as the "
              "server, so a replica with cores of its own serves at least as much (the plan errs high on replicas).",
              "- Load spreads evenly over replicas (per-request balancing: HTTP, or gRPC with client-side round "
              "robin or an L7 proxy); the headroom covers what it does not.",
              "- Replicas add linearly: nothing shared limits them. The Redis tier is shared: it was measured with "
              "one server against it, not many.",
              "- p99 holds at the chosen point because each replica's offered concurrency stays at or below the "
              "measured one: scale on queue time (scripts/deploy/k8s/hpa.yaml) to keep it there.",
              "- Cache costs come from a run at another concurrency and protocol (perf.shared_cache, gRPC, "
              "perf_analyzer) than the per-replica numbers; only their ratio is used.",
              "- Without the tier, a repeat is found only on the replica that served its one earlier sighting "
              "(probability 1/replicas): the most the tier can save. Rows repeated many times are in more replicas' "
              "caches, and the tier saves less for them.",
              ""]
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def latest(pattern: str) -> Path:
    """The newest committed result matching ``pattern`` (by name: the date is in it)."""
    found = sorted(p for p in RESULTS.glob(pattern) if not p.stem.endswith(("-quick",)))
    if not found:
        raise FileNotFoundError(f"no {pattern} in {RESULTS}: run the benchmark that writes it first")
    return found[-1]


def shown(path: Path) -> str:
    """``path`` relative to the repository where it is inside it."""
    root = RESULTS.parent.parent
    return str(path.resolve().relative_to(root)) if path.resolve().is_relative_to(root) else str(path)


def main(argv: list[str] | None = None) -> int:
    """Entry point: print where the report went."""
    parser = argparse.ArgumentParser(prog="python -m perf.capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows-per-s", type=float, default=2000.0, help="load to plan for, rows per second")
    parser.add_argument("--p99-ms", type=float, default=100.0, help="latency target each replica must meet")
    parser.add_argument("--headroom", type=float, default=0.8,
                        help="share of its measured capacity each replica is planned at (0 < h <= 1)")
    parser.add_argument("--repeat-rates", default="0,0.25,0.5,0.75,0.9",
                        help="comma-separated fractions of rows repeating earlier ones")
    parser.add_argument("--profiles", default="queries,documents")
    parser.add_argument("--peers", type=Path, help="perf.peers result (default: the newest peers-*.json)")
    parser.add_argument("--shared", type=Path, help="perf.shared_cache result (default: the newest shared-*.json)")
    parser.add_argument("--bulk", type=Path, help="perf.bulk result (default: the newest bulk-*.json, if any)")
    parser.add_argument("--run", default=f"capacity-{datetime.date.today():%Y%m%d}")
    args = parser.parse_args(argv)
    try:
        repeat_rates = [float(r) for r in args.repeat_rates.split(",") if r.strip()]
        if not all(0 <= r <= 1 for r in repeat_rates) or not 0 < args.headroom <= 1:
            raise ValueError("repeat rates must be in [0, 1] and the headroom in (0, 1]")
        peers_path = args.peers or latest("peers-*.json")
        shared_path = args.shared or latest("shared-*.json")
        bulk_path = args.bulk
        if bulk_path is None:
            try:
                bulk_path = latest("bulk-*.json")
            except FileNotFoundError:
                bulk_path = None
        peers_run = json.loads(peers_path.read_text())
        run = plan(peers_run, json.loads(shared_path.read_text()),
                   rows_per_s=args.rows_per_s, p99_ms=args.p99_ms, headroom=args.headroom, repeat_rates=repeat_rates,
                   profiles=[p for p in args.profiles.split(",") if p],
                   bulk_run=json.loads(bulk_path.read_text()) if bulk_path else None)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        print(f"perf.capacity: {exc}", file=sys.stderr)
        return 2
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    run = {"run": args.run, "command": f"python -m perf.capacity {argv_text}".strip(),
           "sources": {"peers": shown(peers_path), "peers_machine": peers_run.get("machine", "?"),
                       "shared": shown(shared_path), "bulk": shown(bulk_path) if bulk_path else None},
           **run}
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_summary(RESULTS, args.run, run, markdown(run))
    print(RESULTS / f"{args.run}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
