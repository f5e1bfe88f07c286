"""``make bench``: coalesce and the naive baseline served side by side, and the offline ceilings.

One run, one server, one machine: both models load into the same tritonserver (explicit
model control) and perf_analyzer sweeps concurrency over gRPC and HTTP with
``count_windows`` measurement on the same seeded workloads; Triton's statistics API
gives per-batch-size execution counts and queue/compute times. Then ``limit`` and
``limit@N`` run in-process on the same texts. Results: ``perf/results/<run>.json``,
``.md`` and PNG plots.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from coalesce.launcher import ServerOptions, TritonServer, free_port
from perf import limits, report, workloads

ROOT = Path(__file__).resolve().parent.parent
MINILM = ROOT / "model_repository" / "minilm"
NAIVE = ROOT / "perf" / "baselines" / "naive"


def perf_analyzer_binary() -> Path:
    """The perf_analyzer of the ``tritonclient==2.51.0`` wheel, beside this Python."""
    path = Path(sys.executable).parent / "perf_analyzer"
    if not path.is_file():
        raise SystemExit(f"perf_analyzer not found at {path}: run `make setup`")
    return path


def perf_analyzer_env() -> dict[str, str]:
    """perf_analyzer links libcudart.so.12 (from nvidia-cuda-runtime-cu12) even without a GPU."""
    import nvidia.cuda_runtime

    lib = Path(next(iter(nvidia.cuda_runtime.__path__))) / "lib"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def build_repository(dest: Path, systems: list[str]) -> Path:
    """A repository with the shipped minilm and the naive baseline, weights linked."""
    version = MINILM / "1"
    sources = {"coalesce": (MINILM, "minilm"), "naive": (NAIVE, "naive")}
    for system in systems:
        source, name = sources[system]
        (dest / name / "1").mkdir(parents=True)
        shutil.copy(source / "config.pbtxt", dest / name / "config.pbtxt")
        for item in ("model.onnx", "tokenizer.json"):
            (dest / name / "1" / item).symlink_to((version / item).resolve())
        if (source / "model.py").is_file():
            shutil.copy(source / "model.py", dest / name / "1" / "model.py")
    return dest


def model_stats(url: str, model: str) -> dict[str, Any]:
    """Cumulative inference statistics of one model (gRPC, as JSON)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        return client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    finally:
        client.close()


def _ns(stats: dict[str, Any], key: str) -> tuple[int, int]:
    entry = stats["inference_stats"].get(key, {})
    return int(entry.get("count", 0)), int(entry.get("ns", 0))


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per-request queue/compute means (ms) and executions per batch size between two snapshots."""
    out: dict[str, Any] = {}
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        c0, n0 = _ns(before, key)
        c1, n1 = _ns(after, key)
        out[f"{key}_ms"] = (n1 - n0) / max(c1 - c0, 1) / 1e6
    sizes_before = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in before.get("batch_stats", [])}
    sizes: dict[str, int] = {}
    for b in after.get("batch_stats", []):
        size = int(b["batch_size"])
        count = int(b["compute_infer"]["count"]) - sizes_before.get(size, 0)
        if count:
            sizes[str(size)] = count
    executions = int(after.get("execution_count", 0)) - int(before.get("execution_count", 0))
    inferences = int(after.get("inference_count", 0)) - int(before.get("inference_count", 0))
    out["batch_sizes"] = sizes
    out["avg_batch"] = inferences / max(executions, 1)
    return out


def measure(server: TritonServer, model: str, protocol: str, input_data: Path, concurrency: int,
            request_count: int, workdir: Path) -> dict[str, Any]:
    """One perf_analyzer point with Triton's statistics around it."""
    url = server.grpc_url if protocol == "grpc" else server.http_url
    csv_path = workdir / f"{model}-{protocol}-{input_data.stem}-{concurrency}.csv"
    command = [str(perf_analyzer_binary()), "-m", model, "-i", protocol, "-u", url, "--input-data", str(input_data),
               f"--concurrency-range={concurrency}", "--measurement-mode=count_windows",
               f"--measurement-request-count={request_count}", "--max-trials=6", "--stability-percentage=25",
               "-f", str(csv_path)]
    before = model_stats(server.grpc_url, model)
    done = subprocess.run(command, env=perf_analyzer_env(), capture_output=True, text=True, timeout=600)
    time.sleep(0.2)  # let the last execution's statistics land
    after = model_stats(server.grpc_url, model)
    if done.returncode != 0 or not csv_path.is_file():
        raise RuntimeError(f"perf_analyzer failed ({done.returncode}): {done.stdout[-800:]}{done.stderr[-800:]}")
    with csv_path.open() as handle:
        row = next(csv.DictReader(handle))
    return {"throughput_per_s": float(row["Inferences/Second"]),
            "p50_ms": float(row["p50 latency"]) / 1e3, "p95_ms": float(row["p95 latency"]) / 1e3,
            "p99_ms": float(row["p99 latency"]) / 1e3,
            **stats_delta(before, after)}


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="queries,documents")
    parser.add_argument("--concurrency", default="8,32,128")
    parser.add_argument("--protocols", default="grpc,http")
    parser.add_argument("--systems", default="coalesce,naive")
    parser.add_argument("--count", type=int, default=3000, help="distinct texts per workload")
    parser.add_argument("--limit-texts", type=int, default=1024, help="texts per offline ceiling run")
    parser.add_argument("--request-count", type=int, default=300, help="requests per measurement window")
    parser.add_argument("--price-per-hour", type=float, default=0.10, help="instance price, for $/M inferences")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run", default=datetime.datetime.now(datetime.UTC).strftime("bench-%Y%m%dT%H%M%SZ"))
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = parser.parse_args(argv)
    profiles = args.profiles.split(",")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    protocols = args.protocols.split(",")
    systems = args.systems.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="coalesce-bench-"))
    texts = {p: workloads.generate(p, args.count, args.seed) for p in profiles}
    inputs = {}
    for profile in profiles:
        inputs[profile] = workdir / f"{profile}.json"
        inputs[profile].write_text(json.dumps(workloads.to_input_data(texts[profile]), ensure_ascii=False))

    points: list[dict[str, Any]] = []
    options = ServerOptions(model_repository=build_repository(workdir / "repo", systems), host="127.0.0.1",
                            http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            model_control="explicit", load_models=tuple("minilm" if s == "coalesce" else s
                                                                        for s in systems))
    total = len(profiles) * len(concurrencies) * len(protocols) * len(systems)
    with TritonServer(options) as server:
        for profile in profiles:
            for concurrency in concurrencies:
                for protocol in protocols:
                    for system in systems:  # interleaved, so drift hits every system alike
                        model = "minilm" if system == "coalesce" else system
                        point = {"system": system, "profile": profile, "protocol": protocol,
                                 "concurrency": concurrency}
                        try:
                            point.update(measure(server, model, protocol, inputs[profile], concurrency,
                                                 args.request_count, workdir))
                        except (RuntimeError, subprocess.TimeoutExpired) as exc:
                            sys.stderr.write(f"bench: point {point} failed: {exc}\n")
                            continue
                        points.append(point)
                        sys.stderr.write(f"bench [{len(points)}/{total}] {system} {profile} {protocol} "
                                         f"N={concurrency}: {point['throughput_per_s']:.1f}/s "
                                         f"p99 {point['p99_ms']:.1f} ms, avg batch {point['avg_batch']:.1f}\n")

    ceilings: dict[str, dict[str, Any]] = {}
    pipeline = limits.make_pipeline(MINILM / "1")
    for profile in profiles:
        sample = texts[profile][:args.limit_texts]
        value, how = limits.limit(pipeline, sample)
        ceilings[profile] = {"limit": value, "limit_how": how}
        for concurrency in concurrencies:
            ceilings[profile][f"limit@{concurrency}"] = limits.limit_at(pipeline, sample, concurrency)
        sys.stderr.write(f"bench: ceilings {profile}: {ceilings[profile]}\n")

    run = {"run": args.run, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "machine": f"{os.cpu_count()} cores, no GPU, ONNX Runtime CPU",
           "command": "make bench  # python -m perf.bench " + " ".join(argv or sys.argv[1:]),
           "workloads": f"{args.count} distinct texts per profile, seed {args.seed}; ceilings on the first "
                        f"{args.limit_texts}", "price_per_hour": args.price_per_hour,
           "protocols": protocols, "points": points, "limits": ceilings}
    run["plots"] = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in report.plot(run, args.out)]
    (args.out / f"{args.run}.json").write_text(json.dumps(run, indent=2) + "\n")
    (args.out / f"{args.run}.md").write_text(report.markdown(run))
    shutil.rmtree(workdir, ignore_errors=True)
    sys.stderr.write(f"bench: wrote {args.out / args.run}.md\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
