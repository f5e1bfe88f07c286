"""A flood of 1 MiB rows: memory levels off under a bound, small requests keep being answered, refusals say why.

Slow (a minute and more, GBs of traffic): ``make flood`` runs it (``pytest -m slow``) and
records its last result in ``perf/results/flood-<date>.md``. Knobs, from the environment:
``FLOOD_SECONDS`` (60), ``FLOOD_THREADS`` (64), ``FLOOD_ROWS`` (rows per request, cycled per
thread: ``1,64``, so half the requests are 64 x 1 MiB and over ``max_request_bytes``),
``FLOOD_ROW_BYTES`` (1 MiB), and the bounds ``FLOOD_SERVER_RSS_MIB`` / ``FLOOD_STUB_RSS_MIB``.
"""

from __future__ import annotations

import collections
import datetime
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from coalesce_tools.processes import rss_kib, stub_processes

MODEL = "minilm"
MIB = 1 << 20
#: The default of max_request_bytes, and the refusals a flood may meet (Triton's queue is not bounded: no
#: "Exceeds maximum queue size"; "request refused: " is the adaptive queue's).
MAX_REQUEST_BYTES = 4 * MIB
KNOWN_REFUSALS = ("(parameter 'max_request_bytes')", "request refused: ")

#: Deselected by default (``-m "not slow"`` in pyproject's pytest options); ``make flood`` runs it with ``-m slow``.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


class Sampler(threading.Thread):
    """Samples the RSS of the server and of each stub every ``interval_s`` until stopped."""

    def __init__(self, server_pid: int, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.server_pid, self.interval_s = server_pid, interval_s
        self.samples: list[tuple[float, int, int, int]] = []  # (t, server KiB, model's stub KiB, all stubs KiB)
        self.stop = threading.Event()
        self.model_stub = next((s.pid for s in stub_processes(server_pid) if s.model == MODEL), None)

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.is_set():
            children = [s.pid for s in stub_processes(self.server_pid)]
            self.samples.append(
                (
                    time.monotonic() - start,
                    rss_kib(self.server_pid),
                    rss_kib(self.model_stub) if self.model_stub else 0,
                    sum(rss_kib(pid) for pid in children),
                )
            )
            self.stop.wait(self.interval_s)


def rows_tensor(rows: int, row_bytes: int, fill: bytes) -> np.ndarray:
    array = np.empty((rows, 1), dtype=np.object_)
    row = (fill * (row_bytes // len(fill) + 1))[:row_bytes]
    array[:, 0] = [row] * rows
    return array


def test_a_flood_of_large_rows_is_bounded_and_small_requests_keep_being_answered(server):
    import tritonclient.grpc as grpcclient

    seconds = float(_env("FLOOD_SECONDS", "60"))
    threads = int(_env("FLOOD_THREADS", "64"))
    row_counts = [int(r) for r in _env("FLOOD_ROWS", "1,64").split(",")]
    row_bytes = int(_env("FLOOD_ROW_BYTES", str(MIB)))
    server_bound_mib = int(_env("FLOOD_SERVER_RSS_MIB", "6144"))
    stub_bound_mib = int(_env("FLOOD_STUB_RSS_MIB", "2048"))
    assert server.pid is not None
    sampler = Sampler(server.pid)
    assert sampler.model_stub is not None, f"no stub of {MODEL} among {stub_processes(server.pid)}"

    # One input per request size, serialised once and shared by every thread (they only read it).
    inputs = {}
    for rows in row_counts:
        item = grpcclient.InferInput("TEXT", [rows, 1], "BYTES")
        item.set_data_from_numpy(rows_tensor(rows, row_bytes, b"flood of ordinary prose, word after word. "))
        inputs[rows] = item
    client = grpcclient.InferenceServerClient(server.grpc_url)
    outcomes: collections.Counter[tuple[int, str]] = collections.Counter()
    refusals: dict[str, str] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def flood(index: int) -> None:
        k = index
        while time.monotonic() < deadline:
            rows = row_counts[k % len(row_counts)]
            k += 1
            try:
                result = client.infer(MODEL, [inputs[rows]], client_timeout=120)
                outcome = "ok" if result.as_numpy("EMBEDDING").shape == (rows, 384) else "wrong shape"
            except InferenceServerException as exc:
                message = exc.message() or str(exc)
                outcome = f"{exc.status()}: " + next((k for k in KNOWN_REFUSALS if k in message), "unknown")
                with lock:
                    refusals.setdefault(outcome, message[:300])
            with lock:
                outcomes[(rows, outcome)] += 1

    canary_latencies_s: list[float] = []
    canary_failures: list[str] = []

    def canary() -> None:
        own = grpcclient.InferenceServerClient(server.grpc_url)
        item = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
        item.set_data_from_numpy(rows_tensor(1, 24, b"a small canary request. "))
        try:
            while time.monotonic() < deadline:
                start = time.perf_counter()
                try:
                    own.infer(MODEL, [item], client_timeout=60).as_numpy("EMBEDDING")
                    canary_latencies_s.append(time.perf_counter() - start)
                except InferenceServerException as exc:
                    canary_failures.append(exc.message() or str(exc))
                time.sleep(0.5)
        finally:
            own.close()

    sampler.start()
    time.sleep(1.0)  # a baseline sample before the flood
    workers = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(threads)]
    workers.append(threading.Thread(target=canary, daemon=True))
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(seconds + 180)
    time.sleep(2.0)
    sampler.stop.set()
    sampler.join(10)
    client.close()
    assert not any(worker.is_alive() for worker in workers), "a client thread hung"

    samples = sampler.samples
    flooded = [s for s in samples if 1.0 <= s[0] <= 1.0 + seconds]
    third = max(1, len(flooded) // 3)
    middle, last = flooded[third : 2 * third], flooded[2 * third :]
    peak = {name: max(s[i] for s in samples) // 1024 for i, name in ((1, "server"), (2, "stub"), (3, "stubs"))}
    middle_peak = {name: max(s[i] for s in middle) // 1024 for i, name in ((1, "server"), (2, "stub"))}
    last_peak = {name: max(s[i] for s in last) // 1024 for i, name in ((1, "server"), (2, "stub"))}
    over = [rows for rows in row_counts if rows * row_bytes > MAX_REQUEST_BYTES]
    report = {
        "seconds": seconds,
        "threads": threads,
        "rows": row_counts,
        "row_bytes": row_bytes,
        "outcomes": {f"{rows} rows: {outcome}": count for (rows, outcome), count in sorted(outcomes.items())},
        "refusal examples": refusals,
        "rss_mib": {
            "server start": samples[0][1] // 1024,
            "server peak": peak["server"],
            "server peak, middle third": middle_peak["server"],
            "server peak, last third": last_peak["server"],
            "server end": samples[-1][1] // 1024,
            f"{MODEL} stub start": samples[0][2] // 1024,
            f"{MODEL} stub peak": peak["stub"],
            f"{MODEL} stub peak, middle third": middle_peak["stub"],
            f"{MODEL} stub peak, last third": last_peak["stub"],
            f"{MODEL} stub end": samples[-1][2] // 1024,
            "all stubs peak": peak["stubs"],
        },
        "series": [(round(t), server_kib // 1024, stub_kib // 1024) for t, server_kib, stub_kib, _ in samples[::10]],
        "canary": {
            "answered": len(canary_latencies_s),
            "failed": len(canary_failures),
            "p50 s": round(statistics.median(canary_latencies_s), 3) if canary_latencies_s else None,
            "max s": round(max(canary_latencies_s), 3) if canary_latencies_s else None,
        },
    }
    _write_report(report, server_bound_mib, stub_bound_mib)

    assert not canary_failures, f"small requests failed under the flood: {canary_failures[:3]}"
    assert len(canary_latencies_s) >= 3, report["canary"]
    unknown = {k: v for k, v in refusals.items() if k.endswith("unknown")}
    assert not unknown, f"refusals that do not say why: {unknown}"
    for rows in over:
        assert outcomes[(rows, "ok")] == 0, f"{rows}-row requests of {rows * row_bytes} bytes were computed"
        assert sum(n for (r, o), n in outcomes.items() if r == rows and "max_request_bytes" in o) > 0
    assert sum(n for (r, o), n in outcomes.items() if o == "ok") > 0, report["outcomes"]
    assert peak["server"] <= server_bound_mib, report["rss_mib"]
    assert peak["stub"] <= stub_bound_mib, report["rss_mib"]
    # The backend's own process levelled off: the last third of the flood grew no further than noise above
    # the middle third. The server's RSS is what clients have in flight (their request bodies, up to
    # threads x request size, in its front end and queue): bounded above, it swings with them.
    assert last_peak["stub"] <= middle_peak["stub"] * 1.25 + 256, report["rss_mib"]


def _write_report(report: dict, server_bound_mib: int, stub_bound_mib: int) -> None:
    """Markdown for ``perf/results/flood-<date>.md`` where ``FLOOD_REPORT`` names it; printed either way."""
    lines = [
        f"# Flood {datetime.date.today():%Y%m%d}",
        "",
        f"- machine: {os.cpu_count()} cores, {platform.machine()}; model `{MODEL}` (Triton's scheduling, "
        "example config)",
        "- command: `make flood` (`pytest -m slow tests/integration/test_flood.py`; "
        f"FLOOD_SECONDS={report['seconds']:g} FLOOD_THREADS={report['threads']} "
        f"FLOOD_ROWS={','.join(map(str, report['rows']))} FLOOD_ROW_BYTES={report['row_bytes']})",
        f"- {report['threads']} gRPC client threads, each cycling through requests of {report['rows']} rows of "
        f"{report['row_bytes']} bytes, plus one canary thread sending a 24-byte text every 0.5 s",
        f"- bounds asserted: tritonserver RSS <= {server_bound_mib} MiB, the {MODEL} stub <= {stub_bound_mib} MiB, "
        "and the stub's peak in the last third of the flood <= 1.25 x the middle third's + 256 MiB (levelled off); "
        "the server's RSS holds the request bodies in flight (up to threads x request size) and swings with them",
        "",
        "| outcome | requests |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in report["outcomes"].items()),
        "",
        "| RSS | MiB |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in report["rss_mib"].items()),
        "",
        "RSS over time (s: server MiB / stub MiB): " + ", ".join(f"{t}: {a}/{b}" for t, a, b in report["series"]) + ".",
        "",
        f"Canary: {report['canary']['answered']} answered, {report['canary']['failed']} failed, "
        f"p50 {report['canary']['p50 s']} s, max {report['canary']['max s']} s.",
        "",
        "Refusals, one example each:",
        "",
        *(f"- `{k}`: {v}" for k, v in report["refusal examples"].items()),
        "",
    ]
    text = "\n".join(lines)
    print("\n" + text)
    target = os.environ.get("FLOOD_REPORT")
    if target:
        Path(target).write_text(text)
