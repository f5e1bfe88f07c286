"""``make bench``: coalesce, naive and pytriton served side by side, and the offline ceilings.

One run, one machine: ``minilm`` (coalesce) and ``naive`` load into the same tritonserver
(explicit model control), the PyTriton ``@batch`` baseline runs in its own (PyTriton
starts one), and perf_analyzer sweeps concurrency over gRPC and HTTP with
``count_windows`` measurement on the same seeded workloads, interleaving the systems at
every point; Triton's statistics API gives per-batch-size execution counts and
queue/compute times. ``limit`` and ``limit@N`` run in-process on the same texts beside
them. Results: ``perf/results/<run>.json``, ``.md`` and PNG plots.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from coalesce_tools import perfanalyzer
from coalesce_tools.launcher import ServerOptions, TritonServer, free_port
from perf import limits, report, repository, workloads
from perf.baselines.pytriton.server import MODEL_NAME as PYTRITON_MODEL
from perf.baselines.pytriton.server import BaselineServer

ROOT = Path(__file__).resolve().parent.parent
MINILM = ROOT / "model_repository" / "minilm"
NAIVE = ROOT / "perf" / "baselines" / "naive"


#: Like for like: every system and ceiling runs the FP32 graph ``model.onnx`` without a row cache (naive and
#: pytriton have neither INT8 nor a cache), so coalesce serves the shipped config with these (it ships INT8
#: and a 64 MiB cache; ``make bench-defaults`` measures both against their alternatives).
LIKE_FOR_LIKE = {"precision": "fp32", "cache_bytes": "0"}
#: Like for like: the baselines' queue delay (naive's config, pytriton's default) for coalesce too (it ships 0).
QUEUE_DELAY_US = 2000
#: The ``cached`` system: coalesce with a row cache of 256 MiB, under its own name.
CACHED_PARAMETERS = {"cache_bytes": "268435456"}


def build_repository(dest: Path, systems: list[str]) -> Path:
    """A repository with minilm (FP32), its cached variant and the naive baseline, weights linked."""
    version = MINILM / "1"
    sources = {"coalesce": (MINILM, "minilm"), "cached": (MINILM, "minilm_cached"), "naive": (NAIVE, "naive")}
    for system in (s for s in systems if s in sources):
        source, name = sources[system]
        if source == MINILM:
            config = repository.with_queue_delay(
                repository.with_parameters(repository.single_model_config(), LIKE_FOR_LIKE), QUEUE_DELAY_US)
        else:
            config = (source / "config.pbtxt").read_text()
        if system == "cached":
            config = repository.with_parameters(repository.renamed(config, name), CACHED_PARAMETERS)
        model = repository.add_model(dest, name, config, version_dir=version)
        if (source / "model.py").is_file():
            shutil.copy(source / "model.py", model / "1" / "model.py")
    return dest


SYSTEMS = ("coalesce", "naive", "pytriton", "cached")
MODELS = {"coalesce": "minilm", "naive": "naive", "pytriton": PYTRITON_MODEL, "cached": "minilm_cached"}


def measure(server: TritonServer | BaselineServer, model: str, protocol: str, input_data: Path, concurrency: int,
            request_count: int, workdir: Path) -> dict[str, Any]:
    """One perf_analyzer point with Triton's statistics around it."""
    url = server.grpc_url if protocol == "grpc" else server.http_url
    return perfanalyzer.measure(model=model, protocol=protocol, url=url, grpc_url=server.grpc_url,
                                input_data=input_data, concurrency=concurrency, request_count=request_count,
                                workdir=workdir)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="queries,documents")
    parser.add_argument("--concurrency", default="8,32,128")
    parser.add_argument("--protocols", default="grpc,http")
    parser.add_argument("--systems", default="coalesce,naive,pytriton",
                        help=f"any of {', '.join(SYSTEMS)} (cached: minilm with the row cache on)")
    parser.add_argument("--count", type=int, default=3000, help="distinct texts per workload")
    parser.add_argument("--limit-texts", type=int, default=1024, help="texts per offline ceiling run")
    parser.add_argument("--request-count", type=int, default=300, help="requests per measurement window")
    parser.add_argument("--rounds", type=int, default=3,
                        help="every point and ceiling is measured once per round; the report gives medians")
    parser.add_argument("--price-per-hour", type=float, default=0.10, help="instance price, for $/M inferences")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run", default=datetime.datetime.now(datetime.timezone.utc).strftime("bench-%Y%m%dT%H%M%SZ"))
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = parser.parse_args(argv)
    profiles = args.profiles.split(",")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    protocols = args.protocols.split(",")
    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="coalesce-bench-"))
    texts = {p: workloads.generate(p, args.count, args.seed) for p in profiles}
    inputs = {}
    for profile in profiles:
        inputs[profile] = workdir / f"{profile}.json"
        inputs[profile].write_text(json.dumps(workloads.to_input_data(texts[profile]), ensure_ascii=False))

    points: list[dict[str, Any]] = []
    in_triton = [s for s in systems if s != "pytriton"]
    options = ServerOptions.on_free_ports(build_repository(workdir / "repo", in_triton), model_control="explicit",
                                          load_models=tuple(MODELS[s] for s in in_triton))
    total = args.rounds * len(profiles) * len(concurrencies) * len(protocols) * len(systems)
    ceilings: dict[str, dict[str, list[Any]]] = {}
    failures: list[dict[str, Any]] = []
    with ExitStack() as stack:
        servers: dict[str, TritonServer | BaselineServer] = {}
        if in_triton:
            server = stack.enter_context(TritonServer(options))
            servers.update(dict.fromkeys(in_triton, server))
        if "pytriton" in systems:
            servers["pytriton"] = stack.enter_context(BaselineServer(
                MINILM / "1", http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                log_path=workdir / "pytriton.log"))
        # The ceilings run in this process while the servers idle, right beside the served
        # points they are compared with, once per round, so the machine's drift hits both alike.
        pipeline = limits.make_pipeline(MINILM / "1", **LIKE_FOR_LIKE)
        for round_index in range(args.rounds):
            for profile in profiles:
                sample = texts[profile][:args.limit_texts]
                best, how = limits.limit(pipeline, sample)
                ceiling = ceilings.setdefault(profile, {"limit": [], "limit_how": []})
                ceiling["limit"].append(best)
                ceiling["limit_how"].append(how)
                for concurrency in concurrencies:
                    for protocol in protocols:
                        for system in systems:  # interleaved, so drift hits every system alike
                            point = {"round": round_index, "system": system, "profile": profile,
                                     "protocol": protocol, "concurrency": concurrency}
                            try:
                                if system == "cached":
                                    # Every point starts with an empty cache: perf_analyzer replays the input
                                    # data from its first entry, so a warm cache would see repeats that the
                                    # workload does not have.
                                    repository.reload_model(servers[system].grpc_url, MODELS[system])
                                point.update(measure(servers[system], MODELS[system], protocol, inputs[profile],
                                                     concurrency, args.request_count, workdir))
                            except perfanalyzer.PerfAnalyzerError as exc:
                                sys.stderr.write(f"bench: point {point} failed: {exc}\n")
                                failures.append({**point, "error": str(exc)[-300:]})
                                continue
                            if system == "coalesce" and point.get("avg_batch"):
                                # The best any backend could do with the requests Triton handed it at once:
                                # windows as large as the average batch it saw, at this moment.
                                window = max(1, round(point["avg_batch"]))
                                point["limit_at_batch_window"] = window
                                point["limit_at_batch"] = limits.limit_at(pipeline, sample, window)
                            points.append(point)
                            sys.stderr.write(f"bench [{len(points) + len(failures)}/{total}] round {round_index} "
                                             f"{system} {profile} {protocol} N={concurrency}: "
                                             f"{point['throughput_per_s']:.1f}/s p99 {point['p99_ms']:.1f} ms, "
                                             f"avg batch {point['avg_batch']:.1f}\n")
                    ceiling.setdefault(f"limit@{concurrency}", []).append(
                        limits.limit_at(pipeline, sample, concurrency))
                sys.stderr.write(f"bench: round {round_index} ceilings {profile}: "
                                 f"{ {k: v[-1] for k, v in ceiling.items()} }\n")

    run = {"run": args.run, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{os.cpu_count()} cores, no GPU, ONNX Runtime CPU",
           "like_for_like": "FP32 (model.onnx) for every system and ceiling: coalesce runs the shipped minilm config "
                        f"with precision fp32 and no row cache; queue delay {QUEUE_DELAY_US} us for every system",
           "command": "make bench  # python -m perf.bench " + " ".join(argv or sys.argv[1:]),
           "workloads": f"{args.count} distinct texts per profile, seed {args.seed}; ceilings on the first "
                        f"{args.limit_texts}", "rounds": args.rounds, "price_per_hour": args.price_per_hour,
           "protocols": protocols, "points": points, "limits": ceilings, "failures": failures}
    run["plots"] = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in report.plot(run, args.out)]
    report.write_summary(args.out, args.run, run, report.markdown(run))
    shutil.rmtree(workdir, ignore_errors=True)
    sys.stderr.write(f"bench: wrote {args.out / args.run}.md\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
