"""Diagnose one adaptive load point: Locust's view beside the backend's own metrics and CPU per process.

One tritonserver with the shipped minilm under ``scheduling: adaptive`` (Triton's queue
policy at ``--triton-queue-share`` of the target), one steady Locust run (gRPC, or ``--protocol http``), then:
`top` (CPU per process, sampled mid-run), the backend's rejections by reason, dispatch
count and time, the cost model's scale and tail ratio, and the backend's arrival-to-answer
latency buckets, so a client-side p99 can be split into backend time and the rest.

    python -m perf.probe_overload --rate 480 [--tenants noisy:10,quiet-a:1,quiet-b:1] [--param key=value ...]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from coalesce_tools.launcher import ServerOptions, TritonServer
from perf import adaptive
from perf.load import run_locust

#: Metric families printed after the run (the backend's and Triton's own).
SHOWN = re.compile(r"^(coalesce_rejections_total|coalesce_tenant_rejections_total|coalesce_tenant_rows_total|"
                   r"coalesce_dispatch_(seconds|predicted_seconds|rows)_(sum|count)|coalesce_cost_model_\w+|"
                   r"coalesce_answer_send_seconds|coalesce_tenant_latency_seconds_bucket|nv_inference_queue_duration_us|"
                   r"nv_inference_exec_count|nv_inference_request_success)\{")


def main(argv: list[str] | None = None) -> int:
    """Run the probe and print what it saw."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=480.0, help="requests per second (steady)")
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("--target-ms", type=float, default=200.0)
    parser.add_argument("--triton-queue-share", type=float, default=0.25)
    parser.add_argument("--profile", default="queries")
    parser.add_argument("--tenants", default="", help="tenant shares, as the eval's tenant run: 'noisy:10,quiet-a:1'")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc", help="Locust's client protocol")
    parser.add_argument("--param", action="append", default=[], help="extra model parameter key=value")
    args = parser.parse_args(argv)
    config = adaptive.adaptive_config(args.target_ms, name="probe", triton_queue_timeout_share=args.triton_queue_share)
    for item in args.param:
        key, value = item.split("=", 1)
        config = re.sub(rf'\{{ key: "{key}", value: \{{ string_value: "[^"]*" }} }},\n  ', "", config)
        config = config.replace('{ key: "runtime"', f'{{ key: "{key}", value: {{ string_value: "{value}" }} }},\n'
                                '  { key: "runtime"', 1)
    workdir = Path(tempfile.mkdtemp(prefix="coalesce-probe-"))
    repo = adaptive.build_repository(workdir / "repo", {"probe": config})
    options = ServerOptions.on_free_ports(repo, model_control="explicit", load_models=("probe",))
    with TritonServer(options) as server:
        top = subprocess.Popen(f"sleep {args.duration_s / 3:.0f}; top -b -n 2 -d 5 -w 200 -o %CPU "
                               "| grep -A6 '^ *PID' | tail -6", shell=True, stdout=subprocess.PIPE, text=True)
        result = run_locust(shape="steady", protocol=args.protocol, rate_per_s=args.rate, duration_s=args.duration_s,
                            pool=256, profile=args.profile, grpc_url=server.grpc_url, http_url=server.http_url,
                            prefix=workdir / "locust", model="probe", html=False,
                            extra=["--target-ms", str(args.target_ms), "--allow-rejections",
                                   *(["--tenants", args.tenants] if args.tenants else [])])
        print({k: result.get(k) for k in ("goodput_per_s", "ok_p99_ms", "rejected", "errors", "tenants")})
        print(top.communicate()[0])
        time.sleep(1.0)  # metrics reach Triton every metrics_interval_ms
        text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
        for line in text.splitlines():
            if SHOWN.match(line) and 'model="probe"' in line:
                print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
