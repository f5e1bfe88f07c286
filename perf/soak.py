"""Soak: every example model under mixed load for a bounded time, with bad inputs, Redis restarts and a killed stub.

One server (supervised, as ``coalesce serve`` runs it) serves the four example models;
``minilm`` and ``minilm_rerank`` cache rows in process and in a real ``redis-server``.
``--workers`` client threads send a seeded mix over gRPC: good requests drawn from small
pools (so the caches hit), and bad ones (wrong type, invalid UTF-8, a missing input) that
must be refused with ``INVALID_ARG``. On a fixed schedule the soak restarts Redis (twice)
and SIGKILLs ``minilm``'s stub (once), and samples the resident memory of the server, its
stubs and Redis every ``--sample-s``.

Expected: a bad request refused; a good ``minilm`` request failing between the kill and
the supervisor's reload (plus a few seconds). Anything else is unexpected: a good request
failing at any other time (Redis restarts must cost nothing but misses), a bad request
answered, wrong output shapes. The memory verdict is the slope of server + stubs RSS after
the last incident (least squares, MiB per minute).

Writes ``perf/results/<run>.{json,md,png}``; raw samples and outcomes to ``perf/results/raw/<run>/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Final

import numpy as np

from coalesce_tools.launcher import RedisServer, ServerOptions, TritonServer
from coalesce_tools.processes import rss_kib, stub_processes
from coalesce_tools.supervisor import SupervisorOptions
from perf.neighbours import build_repository, request_pools
from perf.outcomes import percentile
from perf.report import write_summary
from perf.repository import with_parameters

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"
#: Share of each kind of request in the mix.
MIX: Final = {"minilm": 0.35, "minilm_rerank": 0.15, "minilm_tokens": 0.15, "digits": 0.2, "bad": 0.15}
#: Incidents, as fractions of the run: (when, what).
SCHEDULE: Final = ((0.15, "redis restart"), (0.30, "kill minilm stub"), (0.45, "redis restart"))
#: A good minilm request may fail this long after its model is serving again (clients that sent into the gap).
AFTER_RECOVERY_S: Final = 5.0
CALL_TIMEOUT_S: Final = 15.0


def bad_requests() -> list[tuple[str, list[tuple[str, np.ndarray, str]]]]:
    """Requests every model must refuse with INVALID_ARG: (model, inputs)."""
    return [
        ("minilm", [("TEXT", np.ones((1, 1), dtype=np.float32), "FP32")]),  # wrong type
        ("minilm", [("TEXT", np.array([[b"ok"], [b"bad \xff\xfe"]], dtype=object), "BYTES")]),  # invalid UTF-8
        ("minilm_rerank", [("TEXT", np.array([[b"a query"]], dtype=object), "BYTES")]),  # TEXT_PAIR missing
        ("minilm_tokens", [("input_ids", np.array([[101, 99999999, 102]], dtype=np.int64), "INT64")]),  # out of vocab
    ]


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (0 if it is gone)."""
    return rss_kib(pid) / 1024


@dataclasses.dataclass
class Call:
    """One request of the soak."""

    sent_s: float
    latency_ms: float
    model: str
    bad: bool
    outcome: str  # ok, or the error's text


def _send(client: Any, model: str, inputs: list[tuple[str, np.ndarray, str]]) -> str:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    items = []
    for name, array, datatype in inputs:
        item = grpcclient.InferInput(name, list(array.shape), datatype)
        item.set_data_from_numpy(array)
        items.append(item)
    try:
        result = client.infer(model, items, client_timeout=CALL_TIMEOUT_S)
    except InferenceServerException as exc:
        return f"{exc.status()} {exc.message()}"
    outputs = result.get_response().outputs
    return "ok" if outputs and all(o.shape and o.shape[0] == inputs[0][1].shape[0] for o in outputs) else \
        f"wrong outputs {[list(o.shape) for o in outputs]}"


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    """Serve, load, inject the incidents, sample memory; everything the report needs."""
    import tritonclient.grpc as grpcclient

    workdir = Path(tempfile.mkdtemp(prefix="coalesce-soak-"))
    redis = RedisServer(maxmemory="256mb").start()
    repo = build_repository(workdir / "repo", "one_core_each")
    for model in ("minilm", "minilm_rerank"):
        config = repo / model / "config.pbtxt"
        config.write_text(with_parameters(config.read_text(), {"cache_bytes": str(32 << 20),
                                                               "redis_url": redis.url}))
    server = TritonServer(ServerOptions.on_free_ports(repo, supervisor=SupervisorOptions(health_port=0)))
    server.start()
    pools = request_pools(args.pool, seed=0)
    bad = bad_requests()
    calls: list[Call] = []
    samples: list[dict[str, float]] = []
    incidents: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop = threading.Event()
    start = time.monotonic()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        models, weights = list(MIX), list(MIX.values())
        try:
            while not stop.is_set():
                kind = rng.choices(models, weights)[0]
                if kind == "bad":
                    model, inputs = rng.choice(bad)
                else:
                    model, inputs = kind, rng.choice(pools[kind])
                sent = time.monotonic()
                outcome = _send(client, model, inputs)
                with lock:
                    calls.append(Call(sent - start, (time.monotonic() - sent) * 1000, model, kind == "bad", outcome))
        finally:
            client.close()

    def sample() -> None:
        while not stop.wait(args.sample_s):
            pid = server.pid
            stubs = [s.pid for s in stub_processes(pid)] if pid else []
            samples.append({"t_s": time.monotonic() - start, "server_mib": rss_mib(pid) if pid else 0.0,
                            "stubs_mib": sum(rss_mib(p) for p in stubs), "stubs": len(stubs),
                            "redis_mib": rss_mib(rp) if (rp := redis.pid) else 0.0})

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.workers)]
    threads.append(threading.Thread(target=sample, daemon=True))
    for thread in threads:
        thread.start()
    try:
        for at, what in SCHEDULE:
            stop.wait(max(0.0, start + at * args.duration_s - time.monotonic()))
            happened = time.monotonic() - start
            if what == "redis restart":
                redis.kill()
                time.sleep(2)
                redis.start()
                incidents.append({"t_s": happened, "what": what, "until_s": time.monotonic() - start})
            else:
                before = len(server.supervisor.recoveries) if server.supervisor else 0
                for stub in stub_processes(server.pid or 0):
                    if stub.model == "minilm":
                        os.kill(stub.pid, signal.SIGKILL)
                deadline = time.monotonic() + 120
                while (server.supervisor is not None and len(server.supervisor.recoveries) == before
                       and time.monotonic() < deadline):
                    time.sleep(0.2)
                incidents.append({"t_s": happened, "what": what, "until_s": time.monotonic() - start})
            sys.stderr.write(f"soak: {what} at {happened:.0f} s, over at {incidents[-1]['until_s']:.0f} s\n")
        stop.wait(max(0.0, start + args.duration_s - time.monotonic()))
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=CALL_TIMEOUT_S + 5)
        server.stop()
        redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"calls": calls, "samples": samples, "incidents": incidents,
            "recoveries_s": [s for _, s in (server.supervisor.recoveries if server.supervisor else [])]}


def classify(call: Call, incidents: list[dict[str, Any]]) -> str:
    """``ok``, ``refused`` (a bad request, as it must be), ``expected`` (in the kill's window), or ``unexpected``."""
    if call.bad and "INVALID_ARG" in call.outcome:
        return "refused"
    if not call.bad and call.outcome == "ok":
        return "ok"
    for incident in incidents:
        # While the model is being reloaded, good and bad requests alike get Triton's "unavailable".
        if (incident["what"] == "kill minilm stub" and call.model == "minilm" and call.outcome != "ok"
                and incident["t_s"] - CALL_TIMEOUT_S <= call.sent_s <= incident["until_s"] + AFTER_RECOVERY_S):
            return "expected"
    return "unexpected"


def slope_mib_per_min(samples: list[dict[str, float]], after_s: float) -> float:
    """Least-squares slope of server + stubs RSS over the samples after ``after_s``, in MiB per minute."""
    points = [(s["t_s"], s["server_mib"] + s["stubs_mib"]) for s in samples if s["t_s"] >= after_s]
    if len(points) < 3:
        return float("nan")
    t, m = np.array(points).T
    return float(np.polyfit(t / 60, m, 1)[0])


def summarize(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Counts by class and model, latencies, the memory slope and the verdict."""
    calls: list[Call] = result["calls"]
    incidents = result["incidents"]
    classes: dict[str, int] = {}
    unexpected: dict[str, int] = {}
    for call in calls:
        kind = classify(call, incidents)
        classes[kind] = classes.get(kind, 0) + 1
        if kind == "unexpected":
            key = f"{call.model}: {call.outcome[:120]}"
            unexpected[key] = unexpected.get(key, 0) + 1
    samples = result["samples"]
    settle_s = max((i["until_s"] for i in incidents), default=0.0) + 30.0
    slope = slope_mib_per_min(samples, settle_s)
    ok_latency = [c.latency_ms for c in calls if c.outcome == "ok"]
    total = [s["server_mib"] + s["stubs_mib"] for s in samples]
    return {
        "calls": len(calls), "classes": classes, "unexpected": unexpected,
        "p50_ms": percentile(ok_latency, 0.5), "p99_ms": percentile(ok_latency, 0.99),
        "per_model_ok": {m: sum(1 for c in calls if c.model == m and c.outcome == "ok") for m in MIX if m != "bad"},
        "incidents": incidents, "recoveries_s": result["recoveries_s"],
        "rss_settled_after_s": settle_s, "rss_slope_mib_per_min": slope,
        "rss_max_mib": max(total, default=0.0), "rss_last_mib": total[-1] if total else 0.0,
        "redis_max_mib": max((s["redis_mib"] for s in samples), default=0.0),
        "slope_limit_mib_per_min": args.slope_limit,
        "passed": not unexpected and classes.get("ok", 0) > 0 and abs(slope) <= args.slope_limit,
    }


def markdown(run: dict[str, Any]) -> str:
    """The report page."""
    s = run["summary"]
    lines = [
        f"# Soak {run['run']}", "",
        f"`{run['command']}` on {run['machine']}, commit {run['commit']}: {run['duration_s']:.0f} s, "
        f"{run['workers']} client threads over gRPC, all four example models on one supervised server; "
        "`minilm` and `minilm_rerank` cache rows in process and in a real redis-server.", "",
        f"**Verdict: {'passed' if s['passed'] else 'FAILED'}** — {s['calls']} calls, "
        f"{sum(s['unexpected'].values())} unexpected outcomes; server + stubs RSS slope after the last incident "
        f"{s['rss_slope_mib_per_min']:+.2f} MiB/min (limit ±{s['slope_limit_mib_per_min']}).", "",
        "| outcome | calls |", "|---|---:|",
        *[f"| {k} | {v} |" for k, v in sorted(s["classes"].items())], "",
        "`refused`: a bad request answered with INVALID_ARG (as it must be); `expected`: a `minilm` request that "
        f"failed between its stub's kill and {AFTER_RECOVERY_S:.0f} s after its reload.", "",
        "| incident | at s | over at s |", "|---|---:|---:|",
        *[f"| {i['what']} | {i['t_s']:.0f} | {i['until_s']:.0f} |" for i in s["incidents"]], "",
        f"Supervisor reloads: {', '.join(f'{r:.1f} s' for r in s['recoveries_s']) or 'none'} from detection to "
        "serving.", "",
        f"Answered requests: p50 {s['p50_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms; per model "
        + ", ".join(f"{m} {n}" for m, n in s["per_model_ok"].items()) + ".", "",
        f"Memory: server + stubs at most {s['rss_max_mib']:.0f} MiB, {s['rss_last_mib']:.0f} MiB at the end; "
        f"slope measured from {s['rss_settled_after_s']:.0f} s; redis-server at most {s['redis_max_mib']:.0f} MiB.",
        "", f"![memory over time]({run['run']}.png)", "",
    ]
    if s["unexpected"]:
        lines += ["Unexpected outcomes:", "", *[f"- {n} x {k}" for k, n in s["unexpected"].items()], ""]
    return "\n".join(lines)


def plot(run: dict[str, Any], path: Path) -> None:
    """Memory over time, incidents marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = run["samples"]
    t = [s["t_s"] for s in samples]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(t, [s["server_mib"] for s in samples], label="tritonserver")
    ax.plot(t, [s["stubs_mib"] for s in samples], label="stubs (sum)")
    ax.plot(t, [s["redis_mib"] for s in samples], label="redis-server")
    ax.plot(t, [s["server_mib"] + s["stubs_mib"] for s in samples], label="server + stubs", linewidth=2)
    for incident in run["summary"]["incidents"]:
        ax.axvline(incident["t_s"], color="grey", linestyle=":")
        ax.annotate(incident["what"], (incident["t_s"], ax.get_ylim()[1] * 0.95), rotation=90, fontsize=8,
                    va="top", ha="right")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS, MiB")
    ax.set_title(f"Soak {run['run']}: resident memory")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the soak; write the report; exit 1 if it failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=float(os.environ.get("SOAK_S", "600")))
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--pool", type=int, default=50, help="distinct good requests per model (the caches hit)")
    parser.add_argument("--sample-s", type=float, default=2.0)
    parser.add_argument("--slope-limit", type=float, default=2.0, help="largest |RSS slope| passed, MiB/min")
    parser.add_argument("--run", default=datetime.datetime.now(datetime.timezone.utc).strftime("soak-%Y%m%d"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = run_soak(args)
    from perf.neighbours import _commit

    run = {"run": args.run, "command": "python -m perf.soak " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": f"{os.cpu_count()} cores", "commit": _commit(), "duration_s": args.duration_s,
           "workers": args.workers, "mix": MIX, "schedule": SCHEDULE, "samples": result["samples"]}
    run["summary"] = summarize(result, args)
    raw = args.out / "raw" / args.run
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "calls.json").write_text(json.dumps([dataclasses.asdict(c) for c in result["calls"]]))
    args.out.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, args.run, run, markdown(run))
    plot(run, args.out / f"{args.run}.png")
    sys.stdout.write(markdown(run))
    return 0 if run["summary"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
