"""``make load``: Locust runs (headless) of every load shape over gRPC and HTTP against a fresh server.

Starts tritonserver on the shipped ``minilm`` (free ports), then for each shape and protocol
runs ``locust -f perf/locustfile.py --headless`` in its own process (Locust monkey-patches
the process for gevent), writing Locust's CSV and HTML reports and the Triton-count check
into ``perf/results/<run>/``, and a summary (``<run>.md``, ``<run>.json``, a timeline PNG)
beside them. Exit code 1 when any run failed a request or its counts did not match Triton's.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coalesce_tools.launcher import ServerOptions, TritonServer
from perf.loadshapes import SHAPES
from perf.report import write_summary

ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = ROOT / "perf" / "locustfile.py"
USERS = {"grpc": "GrpcEmbeddingUser", "http": "HttpEmbeddingUser"}


def run_locust(*, shape: str, protocol: str, rate_per_s: float, duration_s: float, pool: int, profile: str,
               grpc_url: str, http_url: str, prefix: Path, model: str = "minilm",
               extra: Sequence[str] = (), html: bool = True) -> dict[str, Any]:
    """One headless Locust run; returns its summary (Locust's aggregate row and the Triton check).

    Raises:
        RuntimeError: Locust wrote no report (it could not start); the message has its output.
    """
    prefix.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", USERS[protocol],
               "--pool", str(pool), "--shape", shape, "--rate", str(rate_per_s), "--duration-s", str(duration_s),
               "--profile", profile, "--model", model, "--grpc-url", grpc_url, "--http-url", http_url,
               "--csv", str(prefix), *(["--html", f"{prefix}.html"] if html else []), "--stop-timeout", "60",
               "--only-summary", "--loglevel", "WARNING", *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    check_path = Path(f"{prefix}_triton.json")
    if not check_path.is_file():
        raise RuntimeError(f"locust ({shape}, {protocol}) wrote no report, exit code {done.returncode}:\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    summary: dict[str, Any] = {"protocol": protocol, "exit_code": done.returncode,
                               **json.loads(check_path.read_text())}
    summary.update(aggregate_row(Path(f"{prefix}_stats.csv")))
    return summary


def aggregate_row(stats_csv: Path) -> dict[str, float]:
    """Throughput and latency percentiles from the ``Aggregated`` row of Locust's ``_stats.csv``."""
    with stats_csv.open(newline="") as handle:
        row = next((r for r in csv.DictReader(handle) if r["Name"] == "Aggregated"), None)
    if row is None:
        raise ValueError(f"{stats_csv} has no Aggregated row")

    def number(key: str) -> float:
        value = row.get(key, "")
        return float(value) if value not in ("", "N/A") else 0.0

    return {"achieved_per_s": number("Requests/s"), "p50_ms": number("50%"), "p95_ms": number("95%"),
            "p99_ms": number("99%"), "max_ms": number("Max Response Time")}


def markdown(run: Mapping[str, Any]) -> str:
    """The summary table: one row per shape and protocol."""
    lines = [f"# Load run {run['run']}", "", f"- machine: {run['machine']}", f"- command: `{run['command']}`",
             f"- workload: {run['profile']}, one text per request; pool of {run['pool']} users; "
             f"{run['duration_s']} s per shape", "- Locust CSV/HTML per run in "
             f"`{run['run']}/`; offered = arrivals the shape scheduled, sent late when no user was free", "",
             "| shape | protocol | rate/s | offered | sent | failed | Triton saw | counts match | achieved/s "
             "| p50 ms | p95 ms | p99 ms | send late p99 s |", "|" + " --- |" * 13]
    for r in run["runs"]:
        lines.append("| " + " | ".join(str(x) for x in (
            r["shape"], r["protocol"], r["rate_per_s"], r["offered_requests"], r["locust_requests"],
            r["locust_failures"], r["triton_inferences"], "yes" if r["counts_match"] else "NO",
            f"{r['achieved_per_s']:.1f}", r["p50_ms"], r["p95_ms"], r["p99_ms"], r["late_s_p99"])) + " |")
    lines += ["", f"Timeline: `{Path(run['plot']).name}`" if run.get("plot") else "", ""]
    return "\n".join(lines)


def plot(run: Mapping[str, Any], path: Path) -> Path:
    """Per shape: offered and sent requests per second, and p99 latency, over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s in SHAPES if any(r["shape"] == s for r in run["runs"])]
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 3.8), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        latency_ax = ax.twinx()
        for r in (r for r in run["runs"] if r["shape"] == shape):
            t = [p["t_s"] for p in r["timeline"]]
            if r["protocol"] == run["protocols"][0]:
                ax.step(t, [p["offered"] for p in r["timeline"]], where="post", color="grey", label="offered/s")
            ax.step(t, [p["sent"] for p in r["timeline"]], where="post", label=f"sent/s ({r['protocol']})")
            latency_ax.plot(t, [p["p99_ms"] for p in r["timeline"]], linestyle=":",
                            label=f"p99 ms ({r['protocol']})")
        ax.set_title(shape)
        ax.set_xlabel("s into the run")
        ax.set_ylabel("requests per second")
        latency_ax.set_ylabel("p99 latency (ms)")
        handles = ax.get_legend_handles_labels()
        more = latency_ax.get_legend_handles_labels()
        ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """Run every shape over every protocol and write the reports."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--protocols", default="grpc,http")
    parser.add_argument("--profile", default="queries")
    parser.add_argument("--rate", type=float, default=100.0, help="requests/s: mean, burst base, ramp end")
    parser.add_argument("--ramp-rate", type=float, default=300.0, help="requests/s the ramp ends at")
    parser.add_argument("--duration-s", type=float, default=30.0, help="length of each run")
    parser.add_argument("--pool", type=int, default=64, help="Locust users: the most requests in flight")
    parser.add_argument("--run", default=datetime.datetime.now(datetime.timezone.utc).strftime("load-%Y%m%dT%H%M%SZ"))
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    protocols = args.protocols.split(",")
    for name, chosen, allowed in (("shape", shapes, SHAPES), ("protocol", protocols, tuple(USERS))):
        unknown = sorted(set(chosen) - set(allowed))
        if unknown:
            parser.error(f"unknown {name}(s) {', '.join(unknown)}; choose from {', '.join(allowed)}")
    options = ServerOptions.on_free_ports(ROOT / "model_repository")
    runs = []
    with TritonServer(options) as server:
        for shape in shapes:
            for protocol in protocols:
                rate = args.ramp_rate if shape == "ramp" else args.rate
                summary = run_locust(shape=shape, protocol=protocol, rate_per_s=rate, duration_s=args.duration_s,
                                     pool=args.pool, profile=args.profile, grpc_url=server.grpc_url,
                                     http_url=server.http_url,
                                     prefix=args.out / "raw" / args.run / f"{shape}-{protocol}")
                runs.append(summary)
                sys.stderr.write(f"load {shape} {protocol}: sent {summary['locust_requests']}/"
                                 f"{summary['offered_requests']}, {summary['achieved_per_s']:.1f}/s, p99 "
                                 f"{summary['p99_ms']} ms, Triton saw {summary['triton_inferences']}, counts "
                                 f"{'match' if summary['counts_match'] else 'DO NOT match'}\n")
    run = {"run": args.run, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{os.cpu_count()} cores, no GPU, client and server on the same machine",
           "command": "make load  # python -m perf.load " + " ".join(argv or sys.argv[1:]),
           "profile": args.profile, "pool": args.pool, "duration_s": args.duration_s, "protocols": protocols,
           "runs": runs}
    run["plot"] = str(plot(run, args.out / f"{args.run}-timeline.png"))
    write_summary(args.out, args.run, run, markdown(run))
    sys.stderr.write(f"load: wrote {args.out / args.run}.md\n")
    ok = all(r["exit_code"] == 0 and r["counts_match"] and not r["locust_failures"] for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
