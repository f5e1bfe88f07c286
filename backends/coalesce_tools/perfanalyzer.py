"""Run perf_analyzer for one point and read Triton's statistics around it.

Shared by ``make bench`` and ``coalesce tune``. Uses the perf_analyzer binary of the
``tritonclient==2.51.0`` wheel (installed beside this Python), which links
``libcudart.so.12`` from ``nvidia-cuda-runtime-cu12`` (no GPU needed) and Debian's
``libb64-0d``.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


class PerfAnalyzerError(RuntimeError):
    """perf_analyzer could not measure a point; the message has its output."""


def binary() -> Path:
    """The perf_analyzer beside this Python.

    Raises:
        PerfAnalyzerError: If it is not installed.
    """
    path = Path(sys.executable).parent / "perf_analyzer"
    if not path.is_file():
        raise PerfAnalyzerError(f"perf_analyzer not found at {path}: run `make setup`")
    return path


def environment() -> dict[str, str]:
    """Environment with the CUDA runtime library on the library path."""
    env = dict(os.environ)
    try:
        import nvidia.cuda_runtime

        lib = Path(next(iter(nvidia.cuda_runtime.__path__))) / "lib"
        env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p)
    except ImportError:
        pass  # a container's perf_analyzer finds the system CUDA runtime
    return env


def model_stats(grpc_url: str, model: str) -> dict[str, Any]:
    """Cumulative inference statistics of one model (all versions summed by Triton per version; first)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"]
    finally:
        client.close()
    return dict(stats[0]) if stats else {}


def _count_ns(stats: dict[str, Any], key: str) -> tuple[int, int]:
    entry = stats.get("inference_stats", {}).get(key, {})
    return int(entry.get("count", 0)), int(entry.get("ns", 0))


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per-request queue/compute means (ms) and executions per batch size between two snapshots."""
    out: dict[str, Any] = {}
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        c0, n0 = _count_ns(before, key)
        c1, n1 = _count_ns(after, key)
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


def measure(*, model: str, protocol: str, url: str, grpc_url: str, input_data: Path, concurrency: int,
            request_count: int, workdir: Path, extra_args: tuple[str, ...] = (),
            timeout_s: float = 600.0, stability_percent: int = 40, max_trials: int = 10) -> dict[str, Any]:
    """One perf_analyzer point (``count_windows``), with Triton's statistics around it.

    Stability is judged over 3 windows within ``stability_percent``; on a shared 2-core
    machine with long-tailed texts, perf_analyzer's default 10% is rarely reached.

    Returns:
        ``throughput_per_s``, ``p50_ms``, ``p95_ms``, ``p99_ms`` and the fields of ``stats_delta``.

    Raises:
        PerfAnalyzerError: If perf_analyzer fails or times out.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    csv_path = workdir / f"{model}-{protocol}-{input_data.stem}-{concurrency}-{time.monotonic_ns()}.csv"
    command = [str(binary()), "-m", model, "-i", protocol, "-u", url, "--input-data", str(input_data),
               f"--concurrency-range={concurrency}", "--measurement-mode=count_windows",
               f"--measurement-request-count={request_count}", f"--max-trials={max_trials}",
               f"--stability-percentage={stability_percent}",
               "-f", str(csv_path), *extra_args]
    before = model_stats(grpc_url, model)
    try:
        done = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise PerfAnalyzerError(f"perf_analyzer did not finish within {timeout_s:.0f} s") from exc
    time.sleep(0.2)  # Triton records an execution's statistics just after its responses
    after = model_stats(grpc_url, model)
    if done.returncode != 0 or not csv_path.is_file():
        raise PerfAnalyzerError(f"perf_analyzer exited with {done.returncode}: "
                                f"{(done.stdout + done.stderr).strip()[-1200:]}")
    with csv_path.open() as handle:
        row = next(csv.DictReader(handle))
    return {"throughput_per_s": float(row["Inferences/Second"]),
            "p50_ms": float(row["p50 latency"]) / 1e3, "p95_ms": float(row["p95 latency"]) / 1e3,
            "p99_ms": float(row["p99 latency"]) / 1e3, **stats_delta(before, after)}
