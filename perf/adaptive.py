"""``make eval-adaptive``: adaptive scheduling against the best static config ``coalesce tune`` finds.

One run, one machine, both systems in one tritonserver, measured back to back at every
point (alternating which goes first):

- ``static``: the shipped minilm with the batching settings ``coalesce tune`` picks for
  the same p99 target (Triton's dynamic batcher: queue delay and preferred sizes; the
  backend's max_batch_rows). Tuned per workload profile in this run (``--static auto``).
- ``adaptive``: the shipped minilm with ``scheduling: adaptive``, ``target_p99_ms`` set to
  the target and Triton's queue delay 0.

Measured per profile:

1. Concurrency 1 (perf_analyzer): p50 latency over the bare compute time of one text
   (the pipeline in process, no server), each ratio within one of ``--c1-rounds``
   interleaved rounds, the median over rounds reported.
2. Capacity: the static system's closed-loop throughput at concurrency 32.
3. Locust (HTTP; ``--protocol grpc``), open loop (arrivals do not wait for answers; a pool of users bounds what is in
   flight): steady and Poisson arrivals at fractions and multiples of that capacity,
   bursts (4x for 2 s every 10 s) and a ramp to 2x. Goodput counts answers within the
   target per second of schedule; refusals count as not good, like late answers.
4. Tenants (first profile): one tenant at 10x the rate of two others, together past
   capacity; per-tenant p99 and goodput.

Results: ``perf/results/<run>.json``, ``.md`` and ``-goodput.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from coalesce.batching.pipeline import Pipeline
from coalesce_tools import perfanalyzer, tune
from coalesce_tools.launcher import ServerOptions, TritonServer
from perf import limits, repository, workloads
from perf.load import run_locust
from perf.report import write_summary

ROOT = Path(__file__).resolve().parent.parent
MINILM = ROOT / "model_repository" / "minilm"
#: p99 targets per workload profile: documents (a long tail past 128 tokens) cannot meet 200 ms at any
#: tuned point at concurrency 32 on 2 CPU cores (perf/results/adaptive-tune/tune-documents-c32-*.json).
DEFAULT_TARGETS = "queries=200,documents=500"
SYSTEMS = ("static", "adaptive")
#: Triton's scheduler with no queue delay: the latency floor of serving at concurrency 1.
FLOOR_MODEL = "minilm_floor"
#: Tenants of the isolation run: one at ten times the rate of each of the others.
TENANT_SHARES = "noisy:10,quiet-a:1,quiet-b:1"


def static_model(profile: str) -> str:
    """Name of the static system's model for ``profile`` (each profile has its own tuned config)."""
    return f"minilm_static_{profile}"


def adaptive_model(profile: str) -> str:
    """Name of the adaptive system's model for ``profile`` (its target is the profile's)."""
    return f"minilm_adaptive_{profile}"


def inline_model(profile: str) -> str:
    """Name of the adaptive model without Triton's queue policy (inline runs on), measured at concurrency 1."""
    return f"minilm_inline_{profile}"


def per_profile(text: str, profiles: list[str], *, what: str) -> dict[str, str]:
    """``'a=x,b=y'`` (or one value for all) as ``{profile: value}``; profiles left out get ``auto``."""
    if "=" not in text:
        return dict.fromkeys(profiles, text)
    pairs = dict(entry.split("=", 1) for entry in text.split(",") if entry)
    unknown = sorted(set(pairs) - set(profiles))
    if unknown:
        raise SystemExit(f"eval: {what} names profiles not in this run: {', '.join(unknown)}")
    return {p: pairs.get(p, "auto") for p in profiles}


def adaptive_config(target_ms: float, triton_delay_us: int = 0, name: str = "minilm_adaptive",
                    triton_queue_timeout_share: float = 0.0) -> str:
    """The shipped config with adaptive scheduling on, its target set, and Triton's queue delay (0 by default).

    ``triton_queue_timeout_share`` > 0 also makes Triton refuse a request that waited that
    share of the target in Triton's own queue, before the backend could see it (the time
    the backend's deadlines cannot count: under overload, requests queue there while the
    model's process is busy taking the earlier ones).
    """
    text = repository.renamed(repository.single_model_config(), name)
    point = tune.TunePoint(max_queue_delay_us=triton_delay_us, preferred_batch_sizes=(), instance_count=1,
                           max_batch_rows=64, max_batch_tokens=8192)
    text = tune.apply_to_pbtxt(text, point)
    if triton_queue_timeout_share > 0:
        timeout_us = int(target_ms * 1000 * triton_queue_timeout_share)
        text = re.sub(r"(max_queue_delay_microseconds: \d+)",
                      r"\1\n  default_queue_policy { timeout_action: REJECT, default_timeout_microseconds: "
                      f"{timeout_us}, allow_timeout_override: true }}", text, count=1)
    return text.replace('{ key: "runtime"', '{ key: "scheduling", value: { string_value: "adaptive" } },\n'
                        f'  {{ key: "target_p99_ms", value: {{ string_value: "{target_ms:g}" }} }},\n'
                        '  { key: "runtime"', 1)


def static_config(profile: str, point: tune.TunePoint) -> str:
    """The shipped config with a tuned point applied."""
    text = repository.renamed(repository.single_model_config(), static_model(profile))
    return tune.apply_to_pbtxt(text, point)


def build_repository(dest: Path, configs: dict[str, str]) -> Path:
    """One folder per model config, weights linked from the shipped minilm."""
    for name, config in configs.items():
        repository.add_model(dest, name, config)
    return dest


def run_tune(profile: str, input_data: Path, target_ms: float, workdir: Path) -> tuple[tune.TunePoint, str]:
    """``coalesce tune`` for ``profile`` at ``target_ms``: the chosen point and its report's path.

    Raises:
        RuntimeError: If the session chose nothing.
    """
    out = workdir / f"tune-{profile}"
    command = [sys.executable, "-m", "coalesce_tools.tune", "--p99-ms", str(target_ms), "--input-data", str(input_data),
               "--model-repository", str(ROOT / "model_repository"), "--out", str(out), "--budget-s", "600"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    reports = sorted(out.glob("*.json"))
    if not reports:
        raise RuntimeError(f"coalesce tune wrote no report: {(done.stdout + done.stderr)[-2000:]}")
    return chosen_point(reports[-1], target_ms, profile), str(reports[-1])


def chosen_point(report_path: Path, target_ms: float, profile: str) -> tune.TunePoint:
    """The point a tune report's results give for ``target_ms`` (selected again: the report may be for another).

    Raises:
        RuntimeError: If no point met the target.
    """
    report = json.loads(report_path.read_text())
    chosen = tune.select(report["results"], target_ms)
    if chosen is None:
        raise RuntimeError(f"coalesce tune found no point under p99 {target_ms:g} ms for {profile} "
                           f"({report_path}); give that profile a larger target")
    return tune.TunePoint.from_dict(chosen["point"])


def bare_compute_ms(pipeline: Pipeline, texts: list[str], count: int = 100) -> float:
    """Median in-process time (ms) to embed one text alone: the floor for latency at concurrency 1."""
    times = []
    for text in texts[:count]:
        start = time.perf_counter()
        limits.embed_each(pipeline, [text])
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def concurrency_one(server: TritonServer, models: dict[str, str], texts: list[str], input_data: Path,
                    workdir: Path, rounds: int) -> dict[str, Any]:
    """p50 at concurrency 1 of each served model over the bare compute, in interleaved rounds.

    This machine's speed drifts by more than the 20% the target allows between minutes,
    so one bare measurement and one served measurement taken a minute apart do not
    compare. Each round measures the bare compute and every model back to back (the
    order rotating per round); each ratio is taken within its round and the median over
    rounds is reported.
    """
    pipeline = limits.make_pipeline(MINILM / "1")
    bare_compute_ms(pipeline, texts, count=20)  # warm-up: ONNX Runtime's first runs are slow
    names = ["bare", *models]
    per_round: list[dict[str, float]] = []
    for index in range(rounds):
        shift = index % len(names)
        measured: dict[str, float] = {}
        for name in names[shift:] + names[:shift]:
            if name == "bare":
                measured[name] = bare_compute_ms(pipeline, texts)
            else:
                measured[name] = perfanalyzer.measure(
                    model=models[name], protocol="grpc", url=server.grpc_url, grpc_url=server.grpc_url,
                    input_data=input_data, concurrency=1, request_count=100, workdir=workdir)["p50_ms"]
        per_round.append(measured)
    return c1_summary(per_round)


def c1_summary(per_round: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over rounds of each p50 and of each ratio taken within a round (``bare`` is the in-process time)."""
    figures: dict[str, Any] = {"bare_compute_ms": statistics.median(r["bare"] for r in per_round),
                               "c1_rounds": per_round}
    models = [name for name in per_round[0] if name != "bare"]
    for name in models:
        figures[f"{name}_c1_p50_ms"] = statistics.median(r[name] for r in per_round)
        figures[f"{name}_c1_over_bare"] = statistics.median(r[name] / r["bare"] for r in per_round)
        if "floor" in models and name != "floor":
            figures[f"{name}_c1_over_floor"] = statistics.median(r[name] / r["floor"] for r in per_round)
    return figures


def tenant_latency_buckets(metrics_url: str, model: str) -> dict[str, dict[float, float]]:
    """Per tenant, the cumulative buckets of ``coalesce_tenant_latency_seconds`` (arrival to answer, in the backend)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    pattern = re.compile(r'^coalesce_tenant_latency_seconds_bucket\{([^}]*)\} (\S+)$', re.M)
    out: dict[str, dict[float, float]] = {}
    for labels, value in pattern.findall(text):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if fields.get("model") == model:
            out.setdefault(fields["tenant"], {})[float(fields["le"])] = float(value)
    return out


def p99_bound_ms(buckets: dict[float, float]) -> float | None:
    """The smallest bucket bound (ms) under which at least 99% of the observations fall (None: no observations)."""
    total = buckets.get(math.inf, 0.0)
    if total <= 0:
        return None
    return next(le * 1000 for le in sorted(buckets) if buckets[le] >= 0.99 * total)


def main(argv: list[str] | None = None) -> int:
    """Run the evaluation and write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-ms", default=DEFAULT_TARGETS,
                        help="p99 target both systems get, per profile ('queries=200,documents=500') or one for all")
    parser.add_argument("--profiles", default="queries,documents")
    parser.add_argument("--loads", default="0.5,1,2", help="steady and Poisson rates, as multiples of capacity")
    parser.add_argument("--shapes", default="steady,poisson,burst,ramp")
    parser.add_argument("--duration-s", type=float, default=20.0, help="length of each Locust run")
    parser.add_argument("--pool", type=int, default=256, help="Locust users: the most requests in flight")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http",
                        help="Locust's protocol. HTTP by default: at 2x capacity on 2 cores the gRPC client "
                             "(grpcio under gevent) took ~50%% of a core against ~30%% for HTTP, and its own lag "
                             "tripled the ok p99 it reported (700 against 225 ms, perf.probe_overload --protocol)")
    parser.add_argument("--static", default="auto",
                        help="'auto' runs coalesce tune per profile; else tune reports (JSON) per profile "
                             "('queries=path,...'), whose results are selected again for the profile's target")
    parser.add_argument("--count", type=int, default=3000, help="distinct texts per workload")
    parser.add_argument("--triton-queue-share", type=float, default=0.25,
                        help="adaptive: Triton refuses requests that waited this share of the target in its own "
                             "queue (default_queue_policy REJECT); 0 leaves Triton's queue unbounded")
    parser.add_argument("--capacity", default="",
                        help="capacity per profile ('queries=300,...') instead of measuring it (static, N=32)")
    parser.add_argument("--c1-rounds", type=int, default=3,
                        help="interleaved rounds of the concurrency-1 measurement (bare compute and every model)")
    parser.add_argument("--no-tenants", action="store_true", help="skip the tenant-isolation run")
    parser.add_argument("--run",
                        default=datetime.datetime.now(datetime.timezone.utc).strftime("adaptive-%Y%m%dT%H%M%SZ"))
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = parser.parse_args(argv)
    profiles = args.profiles.split(",")
    loads = [float(x) for x in args.loads.split(",")]
    shapes = args.shapes.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="coalesce-eval-"))
    texts = {p: workloads.generate(p, args.count, 0) for p in profiles}
    inputs = {}
    for profile in profiles:
        inputs[profile] = workdir / f"{profile}.json"
        inputs[profile].write_text(json.dumps(workloads.to_input_data(texts[profile]), ensure_ascii=False))

    targets = {p: float(v) for p, v in per_profile(args.target_ms, profiles, what="--target-ms").items()}
    capacities = {p: float(v) for p, v in per_profile(args.capacity, profiles, what="--capacity").items()
                  if args.capacity and v != "auto"}
    reports = per_profile(args.static, profiles, what="--static")
    statics: dict[str, dict[str, Any]] = {}
    for profile in profiles:
        if reports[profile] == "auto":
            sys.stderr.write(f"eval: coalesce tune --p99-ms {targets[profile]:g} on {profile} ...\n")
            point, report = run_tune(profile, inputs[profile], targets[profile], workdir)
        else:
            report = reports[profile]
            point = chosen_point(Path(report), targets[profile], profile)
        statics[profile] = {"point": point, "label": point.label(), "tune_report": report,
                            "target_ms": targets[profile]}
        sys.stderr.write(f"eval: static config for {profile} (p99 {targets[profile]:g} ms): {point.label()}\n")

    configs = {adaptive_model(p): adaptive_config(targets[p], name=adaptive_model(p),
                                                  triton_queue_timeout_share=args.triton_queue_share)
               for p in profiles}
    if args.triton_queue_share > 0:
        # The adaptive config without Triton's queue policy runs short dispatches inline in execute
        # (coalesce.scheduling.driver.scheduler_config); measured at concurrency 1 only, beside the others.
        configs.update({inline_model(p): adaptive_config(targets[p], name=inline_model(p)) for p in profiles})
    configs.update({static_model(p): static_config(p, statics[p]["point"]) for p in profiles})
    configs[FLOOR_MODEL] = tune.apply_to_pbtxt(
        repository.renamed(repository.single_model_config(), FLOOR_MODEL),
        tune.TunePoint(max_queue_delay_us=0, preferred_batch_sizes=(), instance_count=1, max_batch_rows=64,
                       max_batch_tokens=8192))
    repo = build_repository(workdir / "repo", configs)
    options = ServerOptions.on_free_ports(repo, model_control="explicit", load_models=tuple(configs))
    runs: list[dict[str, Any]] = []
    summary: dict[str, dict[str, Any]] = {}
    order = 0

    def models(profile: str) -> dict[str, str]:
        return {"static": static_model(profile), "adaptive": adaptive_model(profile)}

    def locust(server: TritonServer, profile: str, system: str, shape: str, rate: float, load: float | None,
               tenants: str = "") -> None:
        prefix = args.out / "raw" / args.run / f"{profile}-{shape}-{load if load is not None else ''}{system}"
        extra = ["--target-ms", str(targets[profile]), "--allow-rejections", "--texts", str(args.count)]
        if tenants:
            extra += ["--tenants", tenants]
        result = run_locust(shape=shape, protocol=args.protocol, rate_per_s=rate, duration_s=args.duration_s,
                            pool=args.pool, profile=profile, grpc_url=server.grpc_url, http_url=server.http_url,
                            prefix=prefix, model=models(profile)[system], extra=extra,
                            html=False)  # with thousands of distinct refusal messages, each HTML is megabytes
        result.pop("timeline", None)
        runs.append({"profile": profile, "system": system, "shape": shape, "load": load, **result})
        sys.stderr.write(f"eval: {profile} {shape} x{load} {system}: offered {rate:.0f}/s, goodput "
                         f"{result['goodput_per_s']}/s, ok p99 {result['ok_p99_ms']} ms, refused "
                         f"{result['rejected']}, errors {result['errors']}\n")

    with TritonServer(options) as server:
        for profile in profiles:
            figures: dict[str, Any] = {}
            capacity = perfanalyzer.measure(model=static_model(profile), protocol="grpc", url=server.grpc_url,
                                            grpc_url=server.grpc_url, input_data=inputs[profile], concurrency=32,
                                            request_count=200, workdir=workdir)
            figures["capacity_per_s"] = float(capacities.get(profile, capacity["throughput_per_s"]))
            figures["measured_capacity_per_s"] = capacity["throughput_per_s"]
            # The served floor: Triton's scheduler with no queue delay (no waiting at all), through the
            # same server, protocol and Python backend: what any scheduler pays at concurrency 1.
            c1_models = {**models(profile), "floor": FLOOR_MODEL}
            if args.triton_queue_share > 0:
                c1_models["inline"] = inline_model(profile)
            figures.update(concurrency_one(server, c1_models, texts[profile], inputs[profile], workdir,
                                           args.c1_rounds))
            summary[profile] = figures
            sys.stderr.write(f"eval: {profile}: {figures}\n")
            cap = figures["capacity_per_s"]
            plan: list[tuple[str, float, float | None]] = []
            for shape in shapes:
                if shape in ("steady", "poisson"):
                    plan += [(shape, load * cap, load) for load in loads]
                elif shape == "burst":
                    plan.append((shape, 0.5 * cap, 0.5))  # 4x bursts: 2x capacity for 2 s of every 10
                elif shape == "ramp":
                    plan.append((shape, 2.0 * cap, 2.0))  # from 0.2x to 2x
            for shape, rate, load in plan:
                pair = list(SYSTEMS) if order % 2 == 0 else list(reversed(SYSTEMS))
                order += 1
                for system in pair:
                    locust(server, profile, system, shape, rate, load)
        if not args.no_tenants:
            profile = profiles[0]
            for system in SYSTEMS:
                before = tenant_latency_buckets(server.metrics_url, models(profile)[system])
                locust(server, profile, system, "steady", 1.5 * summary[profile]["capacity_per_s"], 1.5,
                       tenants=TENANT_SHARES)
                runs[-1]["shape"] = "tenants"
                if system == "adaptive":
                    time.sleep(1.0)  # the backend sends its metrics every metrics_interval_ms (100 ms)
                    after = tenant_latency_buckets(server.metrics_url, models(profile)[system])
                    bounds = {tenant: p99_bound_ms({le: n - before.get(tenant, {}).get(le, 0)
                                                    for le, n in counts.items()})
                              for tenant, counts in after.items()}
                    runs[-1]["backend_p99_at_most_ms"] = {t: b for t, b in bounds.items() if b is not None}

    run = {"run": args.run, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{os.cpu_count()} cores, no GPU, ONNX Runtime CPU; Locust and server on the same machine",
           "command": "make eval-adaptive  # python -m perf.adaptive " + " ".join(argv or sys.argv[1:]),
           "targets_ms": targets, "duration_s": args.duration_s, "pool": args.pool, "protocol": args.protocol,
           "statics": {p: {k: v for k, v in s.items() if k != "point"} for p, s in statics.items()},
           "profiles": summary, "runs": runs}
    run["verdicts"] = verdicts(run)
    run["plot"] = str(plot(run, args.out / f"{args.run}-goodput.png"))
    write_summary(args.out, args.run, run, markdown(run))
    sys.stderr.write(f"eval: wrote {args.out / args.run}.md\n")
    return 0


def _pairs(run: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(static, adaptive) runs of the same profile, shape and load."""
    index = {(r["profile"], r["shape"], r["load"], r["system"]): r for r in run["runs"]}
    return [(index[(p, s, load, "static")], index[(p, s, load, "adaptive")])
            for (p, s, load, system) in index if system == "static" and (p, s, load, "adaptive") in index]


def verdicts(run: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each with the numbers it was judged on."""
    out: dict[str, Any] = {}
    for profile, point in run["profiles"].items():
        out[f"{profile}: c=1 p50 <= 1.2 x bare compute"] = {
            "value": round(point["adaptive_c1_over_bare"], 2), "met": point["adaptive_c1_over_bare"] <= 1.2,
            "static": round(point["static_c1_over_bare"], 2),
            "served_floor": round(point["floor_c1_over_bare"], 2),
            "adaptive_over_served_floor": round(point["adaptive_c1_over_floor"], 2)}
        pairs = [(s, a) for s, a in _pairs(run) if s["profile"] == profile and s["shape"] != "tenants"]
        worse = [f"{s['shape']} x{s['load']}: {a['goodput_per_s']} < {s['goodput_per_s']}" for s, a in pairs
                 if a["goodput_per_s"] < s["goodput_per_s"]]
        out[f"{profile}: goodput >= static at every load"] = {"met": not worse, "misses": worse}
        adaptive = [r for r in run["runs"] if r["profile"] == profile and r["system"] == "adaptive"
                    and r["shape"] in ("steady", "poisson")]
        if adaptive:
            peak = max(r["goodput_per_s"] for r in adaptive)
            overload = [r["goodput_per_s"] for r in adaptive if (r["load"] or 0) >= 2.0]
            if overload:
                out[f"{profile}: goodput at 2x overload >= 0.9 x peak"] = {
                    "value": round(min(overload) / peak, 2) if peak else 0.0, "met": min(overload) >= 0.9 * peak,
                    "peak_per_s": peak, "overload_per_s": overload}
    for r in run["runs"]:
        if r["shape"] == "tenants" and r["system"] == "adaptive":
            quiet = {t: v for t, v in r.get("tenants", {}).items() if t != "noisy"}
            out["quiet tenants' p99 within target (noisy at 10x)"] = {
                "met": bool(quiet) and all(v["ok_p99_ms"] <= run["targets_ms"][r["profile"]] and not v["rejected"]
                                           for v in quiet.values()),
                "p99_ms": {t: v["ok_p99_ms"] for t, v in quiet.items()},
                "backend_p99_at_most_ms": {t: v for t, v in r.get("backend_p99_at_most_ms", {}).items()
                                           if t != "noisy"},
                "refused": {t: v["rejected"] for t, v in r.get("tenants", {}).items()}}
    return out


def markdown(run: dict[str, Any]) -> str:
    """The report."""
    lines = [f"# Adaptive scheduling vs the best static config: {run['run']}", "",
             f"- date: {run['date']}", f"- machine: {run['machine']}", f"- command: `{run['command']}`",
             f"- targets: p99 {run['targets_ms']} ms; Locust runs of {run['duration_s']:g} s, open loop "
             f"(pool of {run['pool']} users), {run.get('protocol', 'grpc')}, one text per request", ""]
    lines += ["## Static configs (`coalesce tune --p99-ms` in this run)", ""]
    lines += [f"- {p} (p99 {s['target_ms']:g} ms): `{s['label']}` ({s['tune_report']})"
              for p, s in run["statics"].items()]
    lines += ["", "## Targets", "", "| target | met | numbers |", "| --- | --- | --- |"]
    for name, v in run["verdicts"].items():
        detail = {k: val for k, val in v.items() if k != "met"}
        lines.append(f"| {name} | {'yes' if v['met'] else 'NO'} | `{json.dumps(detail)}` |")
    lines += ["", "## Concurrency 1 and capacity", "",
              "Bare compute: the pipeline in process, one text. Served floor: the same model through the same "
              "server with Triton's scheduler and no queue delay (no waiting at all; what gRPC, Triton and the "
              "Python backend's process hop cost any scheduler).", "",
              "| profile | bare compute ms | served floor c=1 p50 ms | static c=1 p50 ms | adaptive c=1 p50 ms | "
              "adaptive / bare | adaptive / served floor | capacity/s (static, N=32) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    inline = [f"{p}: {point['inline_c1_p50_ms']:.1f} ms ({point['inline_c1_over_bare']:.2f} x bare, "
              f"{point['inline_c1_over_floor']:.2f} x served floor)"
              for p, point in run["profiles"].items() if "inline_c1_p50_ms" in point]
    for p, point in run["profiles"].items():
        lines.append(f"| {p} | {point['bare_compute_ms']:.1f} | {point['floor_c1_p50_ms']:.1f} | "
                     f"{point['static_c1_p50_ms']:.1f} | {point['adaptive_c1_p50_ms']:.1f} | "
                     f"{point['adaptive_c1_over_bare']:.2f} | {point['adaptive_c1_over_floor']:.2f} | "
                     f"{point['capacity_per_s']:.1f} |")
    rounds = [(p, i, r) for p, point in run["profiles"].items() for i, r in enumerate(point.get("c1_rounds", []))]
    if rounds:
        names = list(rounds[0][2])
        lines += ["", "Medians over interleaved rounds; each ratio is taken within its round. The rounds (p50 ms):", "",
                  "| profile | round | " + " | ".join(names) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
        lines += [f"| {p} | {i + 1} | " + " | ".join(f"{r[n]:.2f}" for n in names) + " |" for p, i, r in rounds]
    if inline:
        lines += ["", "Adaptive without Triton's queue policy (short dispatches then run inline in `execute` on an "
                  "idle model), concurrency 1: " + "; ".join(inline) + "."]
    lines += ["", "## Goodput (answers within the target per second)", "",
              "| profile | shape | load | offered/s | static goodput/s | adaptive goodput/s | adaptive / static | "
              "static ok p99 ms | adaptive ok p99 ms | static refused / late-or-failed | adaptive refused |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s, a in _pairs(run):
        ratio = a["goodput_per_s"] / s["goodput_per_s"] if s["goodput_per_s"] else float("inf")
        lines.append(f"| {s['profile']} | {s['shape']} | {s['load']} | {s['offered_requests'] / run['duration_s']:.0f}"
                     f" | {s['goodput_per_s']} | {a['goodput_per_s']} | {ratio:.2f} | {s['ok_p99_ms']} | "
                     f"{a['ok_p99_ms']} | {s['rejected']} / {s['sent'] - round(s['within_target'] * s['sent'])} | "
                     f"{a['rejected']} |")
    for r in run["runs"]:
        if r["shape"] == "tenants":
            backend = r.get("backend_p99_at_most_ms", {})
            lines += ["", f"## Tenants ({r['system']}): {TENANT_SHARES}, 1.5 x capacity", "",
                      "Latencies as Locust saw them; `backend p99 <=` is the backend's own arrival-to-answer "
                      "p99 for that tenant (`coalesce_tenant_latency_seconds`, to its bucket bound).", "",
                      "| tenant | sent | ok | refused | ok p50 ms | ok p99 ms | backend p99 <= ms | goodput/s |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            for t, v in r.get("tenants", {}).items():
                lines.append(f"| {t} | {v['sent']} | {v['ok']} | {v['rejected']} | {v['ok_p50_ms']} | "
                             f"{v['ok_p99_ms']} | {backend.get(t, '-')} | {v['goodput_per_s']} |")
    lines += ["", f"Plot: `{Path(run['plot']).name}`; Locust CSVs per run in `raw/{run['run']}/` (not committed).",
              ""]
    return "\n".join(lines)


def plot(run: dict[str, Any], path: Path) -> Path:
    """Goodput against offered load, per profile and arrival shape, both systems."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = list(run["profiles"])
    fig, axes = plt.subplots(1, len(profiles), figsize=(5.5 * len(profiles), 4), squeeze=False)
    for ax, profile in zip(axes[0], profiles, strict=True):
        for system, style in (("static", "--"), ("adaptive", "-")):
            for shape, marker in (("steady", "o"), ("poisson", "s"), ("burst", "^"), ("ramp", "v")):
                points = sorted((r["offered_requests"] / run["duration_s"], r["goodput_per_s"]) for r in run["runs"]
                                if r["profile"] == profile and r["system"] == system and r["shape"] == shape)
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], style, marker=marker,
                            label=f"{system} {shape}")
        ax.set_title(f"{profile}: goodput within p99 {run['targets_ms'][profile]:g} ms")
        ax.set_xlabel("offered requests/s")
        ax.set_ylabel("answers within target per s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
