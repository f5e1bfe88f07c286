"""``python -m perf.probe_queue_policy``: does a ``default_queue_policy`` make Triton's batcher stall?

One tritonserver serves the shipped minilm twice (every core, no row cache): as shipped
(no queue policy) and with ``dynamic_batching.default_queue_policy { max_queue_size: 256 }``
added. The same closed-loop HTTP generator as ``perf.peers`` drives each at concurrency 1
and 16, interleaved, for ``--rounds`` rounds; a stalled request shows as a latency near
500 ms, the dynamic batcher's idle wait. Why: any such policy turns off the batcher's
prefetching, and without it the batcher waits for a free instance on a condition variable
under a private mutex, where a wakeup can be lost (``coalesce.loader.triton_prefetch_blockers``).
Writes ``perf/results/queue-policy-<yyyymmdd>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any, Final

from perf import closed_loop, repository, workloads
from perf.report import median, write_summary

#: A request at least this slow waited out the batcher's 500 ms idle wait.
STALL_MS: Final = 450.0
POLICY: Final = "default_queue_policy { max_queue_size: 256 }"
RESULTS: Final = Path(__file__).resolve().parent / "results"


def variants() -> dict[str, str]:
    """The shipped config (every core, no row cache) as shipped and with a queue policy added."""
    base = repository.with_parameters(repository.single_model_config(), repository.NO_CACHE)
    if re.search(r"^\s*default_queue_policy", base, flags=re.M):
        raise ValueError("the shipped config sets a default_queue_policy already")
    policy, count = re.subn(r"(max_queue_delay_microseconds: \d+)", rf"\1\n  {POLICY}", base)
    if count != 1:
        raise ValueError("the shipped config has no max_queue_delay_microseconds to put the policy after")
    return {"shipped": base, "policy": policy}


def markdown(run: dict[str, Any]) -> str:
    """The report: medians over rounds per variant and concurrency, then every point."""
    lines = [f"# Triton queue policy and the batcher's 500 ms stall ({run['date']})", "",
             f"`{run['command']}` on {run['machine']}: the shipped minilm (every core, no row cache) as shipped "
             f"(no queue policy) and with `{POLICY}`, one closed-loop HTTP client per point, one text per request "
             f"(queries), {run['rounds']} rounds of {run['duration_s']:g} s, interleaved. A request >= "
             f"{STALL_MS:.0f} ms waited out the batcher's idle wait.", "",
             "| variant | concurrency | texts/s | p50 ms | p99 ms | stalled requests |",
             "| --- | --- | --- | --- | --- | --- |"]
    for concurrency in run["concurrencies"]:
        for name in run["variants"]:
            points = [p for p in run["points"] if p["variant"] == name and p["concurrency"] == concurrency]
            stalled = sum(p["stalled"] for p in points)
            total = sum(p["successes"] for p in points)
            lines.append(f"| {name} | {concurrency} | {median([p['throughput_per_s'] for p in points]):.1f} | "
                         f"{median([p['p50_ms'] for p in points if p['p50_ms'] is not None]):.1f} | "
                         f"{median([p['p99_ms'] for p in points if p['p99_ms'] is not None]):.1f} "
                         f"| {stalled} of {total} |")
    lines += ["", "Every point:", "",
              "| round | variant | concurrency | texts/s | p50 ms | p99 ms | stalled | errors |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {p['round']} | {p['variant']} | {p['concurrency']} | {p['throughput_per_s']:.1f} | "
              f"{p['p50_ms'] or 0:.1f} | {p['p99_ms'] or 0:.1f} | {p['stalled']} | {p['errors']} |"
              for p in run["points"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Serve both variants, print texts/s, p50, p99 and stalled requests per point, write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    configs = variants()
    bodies = closed_loop.encode_bodies(workloads.generate("queries", 2000, 3), closed_loop.kserve_text)
    concurrencies = (1, 16)
    points: list[dict[str, Any]] = []
    with repository.serve(configs, prefix="coalesce-policy-") as server:
        for round_index in range(args.rounds):
            for concurrency in concurrencies:
                order = list(configs) if round_index % 2 == 0 else list(reversed(configs))
                for name in order:
                    result = closed_loop.closed_loop(f"http://{server.http_url}/v2/models/{name}/infer", bodies,
                                                     concurrency, duration_s=args.duration_s, warmup_s=1.0)
                    point = {"round": round_index, "variant": name, **result.summary(),
                             "successes": result.successes,
                             "stalled": sum(1 for s in result.samples if s.ok and s.latency_s * 1e3 >= STALL_MS)}
                    points.append(point)
                    sys.stdout.write(f"round {round_index} {name:8s} c={concurrency:2d}: "
                                     f"{point['throughput_per_s']:6.1f} texts/s, p50 {point['p50_ms'] or 0:6.1f} ms, "
                                     f"p99 {point['p99_ms'] or 0:6.1f} ms, {point['stalled']} of "
                                     f"{point['successes']} stalled, {point['errors']} errors\n")
                    sys.stdout.flush()
    today = datetime.date.today().strftime("%Y%m%d")
    run = {"date": today, "command": "python -m perf.probe_queue_policy " + " ".join(argv or sys.argv[1:]),
           "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
           "rounds": args.rounds, "duration_s": args.duration_s, "concurrencies": list(concurrencies),
           "variants": list(configs), "points": points}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_summary(args.out_dir, f"queue-policy-{today}", run, markdown(run))
    sys.stdout.write(f"wrote {args.out_dir / f'queue-policy-{today}.md'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
