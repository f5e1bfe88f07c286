"""``python -m perf.probe_floor``: what serving one text costs beyond computing it.

One tritonserver serves the shipped minilm (every core) twice: with its row cache and
without. The same closed-loop HTTP generator as ``perf.peers`` sends, at concurrency 1 and
16: one text over and over to the cached model (after the first request every answer comes
from the row cache: no forward pass, so the latency is Triton's HTTP front end, its queue,
the stub's round trip, the cache lookup and the generator itself), then distinct texts to
the uncached one (every request a forward pass). In
process, the same texts one at a time (``bare``) and in windows of 16 (``limit@16``), as
``perf.peers`` reports them. Writes ``perf/results/serving-floor-<yyyymmdd>.md`` and
``.json``: the served p50 at concurrency 1 is about bare compute plus the floor.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path
from typing import Any, Final

from perf import closed_loop, limits, peers, repository, workloads
from perf.report import median, write_summary

RESULTS: Final = Path(__file__).resolve().parent / "results"


def markdown(run: dict[str, Any]) -> str:
    """The report: medians over rounds per workload and load, beside the in-process figures."""
    lines = [f"# What serving costs beyond compute ({run['date']})", "",
             f"`{run['command']}` on {run['machine']}: the shipped minilm (every core) with and without its row "
             "cache, one "
             f"closed-loop HTTP client, one text per request, {run['rounds']} rounds of {run['duration_s']:g} s. "
             "`one text, cached`: the same text every time (answered from the row cache, no forward pass); "
             "`distinct`: texts of the queries workload (seed 0), cycled, to the model without a row cache "
             "(every request a forward pass).", "",
             "| workload | c | texts/s | p50 ms | p99 ms |", "| --- | --- | --- | --- | --- |"]
    for name in ("one text, cached", "distinct"):
        for concurrency in run["concurrencies"]:
            points = [p for p in run["points"] if p["workload"] == name and p["concurrency"] == concurrency]
            lines.append(f"| {name} | {concurrency} | {median([p['throughput_per_s'] for p in points]):.1f} | "
                         f"{median([p['p50_ms'] for p in points if p['p50_ms'] is not None]):.2f} | "
                         f"{median([p['p99_ms'] for p in points if p['p99_ms'] is not None]):.2f} |")
    bare, limit16 = run["bare"], run["limit_at_16_texts_per_s"]
    lines += ["", f"In process, the same distinct texts: bare one at a time p50 {bare['p50_ms']:.2f} ms "
              f"(mean {bare['mean_ms']:.2f}); limit@16 {limit16:.1f} texts/s.", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Serve the shipped minilm, measure both workloads at c = 1 and 16, measure in process, write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    texts = workloads.generate("queries", 2000, 0)
    # workload: (model, bodies)
    workload_bodies = {"one text, cached": ("cached", closed_loop.encode_bodies(texts[:1], closed_loop.kserve_text)),
                       "distinct": ("nocache", closed_loop.encode_bodies(texts, closed_loop.kserve_text))}
    shipped = repository.single_model_config()
    configs = {"cached": shipped, "nocache": repository.with_parameters(shipped, repository.NO_CACHE)}
    concurrencies = (1, 16)
    points: list[dict[str, Any]] = []
    with repository.serve(configs, prefix="coalesce-floor-") as server:
        for round_index in range(args.rounds):
            for name, (model, bodies) in workload_bodies.items():
                for concurrency in concurrencies:
                    result = closed_loop.closed_loop(f"http://{server.http_url}/v2/models/{model}/infer", bodies,
                                                     concurrency, duration_s=args.duration_s, warmup_s=1.0)
                    point = {"round": round_index, "workload": name, **result.summary()}
                    points.append(point)
                    sys.stdout.write(f"round {round_index} {name} c={concurrency}: {point['throughput_per_s']:.1f} "
                                     f"texts/s, p50 {point['p50_ms'] or 0:.2f} ms, p99 {point['p99_ms'] or 0:.2f} "
                                     f"ms, {point['errors']} errors\n")
                    sys.stdout.flush()
    # In process after the server is gone, so that nothing else runs beside it.
    pipeline = limits.make_pipeline(repository.MINILM / "1")
    limits.embed_each(pipeline, texts[:16])  # warm-up
    bare = peers.bare_latency(pipeline, texts[:200])
    limit16 = limits.limit_at(pipeline, texts[:512], 16)
    pipeline.close()
    today = datetime.date.today().strftime("%Y%m%d")
    run = {"date": today, "command": "python -m perf.probe_floor " + " ".join(argv or sys.argv[1:]),
           "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
           "rounds": args.rounds, "duration_s": args.duration_s, "concurrencies": list(concurrencies),
           "points": points, "bare": bare, "limit_at_16_texts_per_s": limit16}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_summary(args.out_dir, f"serving-floor-{today}", run, markdown(run))
    sys.stdout.write(f"wrote {args.out_dir / f'serving-floor-{today}.md'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
