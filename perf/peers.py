"""``python -m perf.peers``: Coalesce beside the embedding servers users would pick instead.

Every system serves the same packaged all-MiniLM-L6-v2 on this machine, each peer from its
own virtual environment (``bash scripts/setup_peers.sh``), all started at once and all
driven by one closed-loop HTTP load generator (``perf.closed_loop``), one text per request:

- ``coalesce``: the shipped ``model_repository/minilm`` config on every core, in tritonserver;
  ``coalesce-fp32``: the same with ``precision fp32``; ``naive`` and ``pytriton``: the
  Triton-protocol baselines of ``perf/baselines``. KServe v2 JSON.
- ``coalesce-shipped`` (``-int8``, ``-fp32``): the example repository as shipped, every model
  loaded, in a tritonserver of its own; the load goes to ``minilm`` (row cache off; its
  precision forced in the last two).
- ``infinity-torch``, ``infinity-optimum``, ``infinity-optimum-int8``: Infinity's torch and
  ONNX Runtime engines, batch size 32; OpenAI-style ``/embeddings``.
- ``rayserve``: a Ray Serve deployment with ``@serve.batch(max_batch_size=32)`` over the
  same ONNX Runtime session (``perf/peer_servers/ray_app.py``).

Before measuring, every system must return a vector with cosine >= ``--min-cosine`` to
``coalesce-fp32``'s for a few texts of each workload; one that does not is reported as failing
and not measured. Then, for each round, profile and concurrency, every system is measured in
turn (interleaved, so the machine's drift hits all alike): a warm-up, then a fixed duration.
Beside them, once per round, in-process references: ``bare`` (one text at a time through the
shipped pipeline: tokenise + one pass) and ``limit@16``. Results: ``perf/results/<run>.{json,md,png}``,
per-request CSV under ``perf/results/raw/<run>/``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from perf import closed_loop, limits, workloads
from perf.peer_servers import peer_report, systems
from perf.peer_servers.systems import SYSTEMS, Endpoint
from perf.report import write_summary

ROOT = Path(__file__).resolve().parent.parent
#: Texts checked per workload before measuring, and the longest (informational: truncation differs).
CHECK_TEXTS = 3


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors (0 for a zero or mismatched vector)."""
    if len(a) != len(b) or not a:
        return 0.0
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def vectors(endpoint: Endpoint, texts: Sequence[str]) -> list[list[float]]:
    """One request per text; the vectors in order.

    Raises:
        RuntimeError: If a request fails.
    """
    return [endpoint.vector(closed_loop.post_json(endpoint.url, endpoint.payload(t))) for t in texts]


def check(endpoints: dict[str, Endpoint], reference: str, texts: Sequence[str], long_text: str,
          min_cosine: float) -> dict[str, dict[str, Any]]:
    """Each system's cosines to ``reference``'s vectors; ``ok`` when every one of ``texts`` reaches ``min_cosine``.

    ``long_text`` (the longest of the sample, past the 256 tokens of truncation) is compared too
    but does not decide: a system that truncates later gives another vector for it.
    """
    expected = vectors(endpoints[reference], [*texts, long_text])
    out: dict[str, dict[str, Any]] = {}
    for system, endpoint in endpoints.items():
        try:
            got = vectors(endpoint, [*texts, long_text])
        except Exception as exc:  # reported per system: one broken peer must not stop the others
            out[system] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
            continue
        cosines = [cosine(a, b) for a, b in zip(got, expected, strict=True)]
        worst = min(cosines[:-1])
        out[system] = {"ok": worst >= min_cosine, "min_cosine": worst, "long_text_cosine": cosines[-1],
                       "dimension": len(got[0])}
        if worst < min_cosine:
            out[system]["error"] = f"cosine {worst:.4f} < {min_cosine} to {reference}"
    return out


def bare_latency(pipeline: Any, texts: Sequence[str]) -> dict[str, float]:
    """In-process, one text at a time (tokenise + one pass): mean and p50 ms."""
    times_ms = []
    for text in texts:
        start = time.perf_counter()
        limits.embed_each(pipeline, [text])
        times_ms.append((time.perf_counter() - start) * 1e3)
    times_ms.sort()
    return {"mean_ms": sum(times_ms) / len(times_ms), "p50_ms": times_ms[(len(times_ms) - 1) // 2]}


def start_all(stack: ExitStack, workdir: Path, wanted: list[str],
              notes: dict[str, str]) -> tuple[dict[str, Endpoint], dict[str, str]]:
    """Start every wanted system (and ``coalesce-fp32``, the reference); the endpoints and the start failures."""
    endpoints: dict[str, Endpoint] = {}
    failed: dict[str, str] = {}
    in_triton = [s for s in systems.TRITON_MODELS if s in wanted or s == "coalesce-fp32"]
    endpoints.update(systems.start_triton(stack, workdir, in_triton))
    for system in wanted:
        if system in endpoints:
            continue
        started = time.monotonic()
        try:
            if system in systems.SHIPPED_SERVERS:
                endpoints[system] = systems.start_shipped(stack, workdir, system)
            elif system == "pytriton":
                endpoints[system] = systems.start_pytriton(stack, workdir)
            elif system in systems.INFINITY_ENGINES:
                endpoints[system] = systems.start_infinity(stack, workdir, system, notes)
            elif system == "rayserve":
                endpoints[system] = systems.start_ray(stack, workdir)
        except Exception as exc:  # a peer that cannot start is reported, the others still run
            failed[system] = f"{type(exc).__name__}: {exc}"[-1500:]
            sys.stderr.write(f"peers: {system} failed to start: {failed[system]}\n")
            continue
        sys.stderr.write(f"peers: {system} ready in {time.monotonic() - started:.0f} s\n")
    return endpoints, failed


def main(argv: list[str] | None = None) -> int:
    """Start the systems, check their vectors, measure interleaved rounds, write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"any of {', '.join(SYSTEMS)}")
    parser.add_argument("--profiles", default="queries,documents")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=3, help="each point measured once per round; medians reported")
    parser.add_argument("--duration-s", type=float, default=15.0, help="measured seconds per point")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="unrecorded load before each point")
    parser.add_argument("--count", type=int, default=2000, help="distinct texts per workload")
    parser.add_argument("--bare-texts", type=int, default=200, help="texts timed one at a time for `bare`")
    parser.add_argument("--limit-texts", type=int, default=512, help="texts per `limit@16` run")
    parser.add_argument("--min-cosine", type=float, default=0.98)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 round, 4 s points after 1 s warm-up, fewer reference texts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run", default=None, help="report name (default peers-<yyyymmdd>, -quick for --quick)")
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration_s, args.warmup_s = 1, 4.0, 1.0
        args.bare_texts, args.limit_texts = 50, 128
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    run_name = args.run or f"peers-{today}" + ("-quick" if args.quick else "")
    wanted = args.systems.split(",")
    unknown = sorted(set(wanted) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    profiles = args.profiles.split(",")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    raw_dir = args.out / "raw" / run_name
    raw_dir.mkdir(parents=True, exist_ok=True)
    # Short: Ray puts its sockets under it, and a socket path may not pass 107 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="peers-"))
    texts = {p: workloads.generate(p, args.count, args.seed) for p in profiles}
    command = "python -m perf.peers " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    notes: dict[str, str] = {}
    points: list[dict[str, Any]] = []
    references: dict[str, dict[str, list[float]]] = {}
    with ExitStack() as stack, (raw_dir / "requests.csv").open("w", newline="") as raw_file:
        raw = csv.writer(raw_file)
        raw.writerow(["round", "profile", "concurrency", "system", "sent_s", "latency_s", "status", "error"])
        endpoints, start_failures = start_all(stack, workdir, wanted, notes)
        sample = [t for p in profiles for t in texts[p][:CHECK_TEXTS]]
        long_text = max((t for p in profiles for t in texts[p][:200]), key=len)
        checks = {s: {"ok": False, "error": e} for s, e in start_failures.items()}
        checks.update(check(endpoints, "coalesce-fp32", sample, long_text, args.min_cosine))
        measured = [s for s in wanted if checks.get(s, {}).get("ok")]
        for system in wanted:
            if system not in measured:
                sys.stderr.write(f"peers: {system} FAILS its check, not measured: {checks[system].get('error')}\n")
        bodies = {(p, s): closed_loop.encode_bodies(texts[p], endpoints[s].payload) for p in profiles for s in measured}
        pipeline = limits.make_pipeline(systems.MINILM / "1")
        total = args.rounds * len(profiles) * len(concurrencies) * len(measured)
        for round_index in range(args.rounds):
            for profile in profiles:
                # In process, while every server idles, once per round beside the served points.
                reference = references.setdefault(profile, {"bare_mean_ms": [], "bare_p50_ms": [], "limit@16": []})
                bare = bare_latency(pipeline, texts[profile][:args.bare_texts])
                reference["bare_mean_ms"].append(bare["mean_ms"])
                reference["bare_p50_ms"].append(bare["p50_ms"])
                reference["limit@16"].append(limits.limit_at(pipeline, texts[profile][:args.limit_texts], 16))
                for concurrency in concurrencies:
                    for system in measured:  # interleaved, so drift hits every system alike
                        result = closed_loop.closed_loop(endpoints[system].url, bodies[profile, system], concurrency,
                                                         duration_s=args.duration_s, warmup_s=args.warmup_s)
                        point = {"round": round_index, "system": system, "profile": profile, **result.summary()}
                        points.append(point)
                        raw.writerows([round_index, profile, concurrency, system, f"{s.sent_s:.6f}",
                                       f"{s.latency_s:.6f}", s.status, s.error or ""] for s in result.samples)
                        p99 = point["p99_ms"]
                        sys.stderr.write(f"peers [{len(points)}/{total}] round {round_index} {profile} "
                                         f"c={concurrency} {system}: {point['throughput_per_s']:.1f}/s p99 "
                                         f"{'-' if p99 is None else f'{p99:.1f}'} ms, {point['errors']} errors\n")

    run: dict[str, Any] = {
        "run": run_name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} cores, no GPU", "command": command, "rounds": args.rounds,
        "profiles": profiles, "concurrency": concurrencies, "duration_s": args.duration_s, "warmup_s": args.warmup_s,
        "workloads": f"{args.count} distinct texts per profile, seed {args.seed}; bare on the first "
                     f"{args.bare_texts}, limit@16 on the first {args.limit_texts}",
        "systems": wanted, "checks": checks, "notes": notes, "versions": systems.peer_versions(wanted),
        "points": points, "references": references, "raw": str(raw_dir.relative_to(ROOT))
        if raw_dir.is_relative_to(ROOT) else str(raw_dir),
    }
    run["plot"] = peer_report.plot(run, args.out / f"{run_name}.png").name
    write_summary(args.out, run_name, run, peer_report.markdown(run))
    # The servers' logs beside the raw data (a failed run keeps the whole work folder instead).
    (raw_dir / "logs").mkdir(exist_ok=True)
    for log in workdir.glob("*.log"):
        shutil.copy(log, raw_dir / "logs" / log.name)
    shutil.rmtree(workdir, ignore_errors=True)
    sys.stderr.write(f"peers: wrote {args.out / run_name}.md\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
