"""Noisy neighbours: one model at twice its capacity beside lightly loaded models on the same server and cores.

Serves every example model of ``model_repository/`` together (embedding, classify, tensor)
and, for each isolation variant, in interleaved rounds on fresh servers:

1. the light models alone at a steady Poisson rate (their floor);
2. the same light load while the noisy model is offered twice its capacity (open loop,
   Poisson, at most ``--noisy-in-flight`` requests outstanding, as a client's connection
   pool would; arrivals beyond it are counted as not sent).

Capacity is the noisy model's closed-loop throughput, measured once at the start on the
``shared`` variant. Reported per variant: the light models' p50/p99 alone and beside the
noise, their ratio, and what isolation costs the noisy model (answers per second).

Variants (every model's config as shipped, then):
- ``shipped``: unchanged: one ONNX Runtime thread per model, and every core for a model's pass while no
  other model computes (``share_idle_cores``, the borrowed threads at idle priority).
- ``wide_no_spin``: the same without ONNX Runtime's threads spin-waiting (``thread_spinning false``; with one
  thread per model only the wide session has threads that could spin). Measured as ``shipped`` in
  ``neighbours-20261207-spin``, where ``shipped_spin`` was today's ``shipped``.
- ``borrow_normal``: the same with the borrowed threads at normal priority (``borrowed_thread_priority normal``).
- ``one_core_each``: a fixed split: one thread per model, never more (``share_idle_cores false``; one thread
  has no pool to spin).
- ``shared``: no isolation; each model's ONNX Runtime uses every core (spinning) whenever Triton hands it a batch.
- ``no_spin``: every core, but its threads do not spin-wait for work.
- ``rate_limiter``: every core, under Triton's rate limiter (``--rate-limit=execution_count``): every instance
  needs the one global resource ``cores``, so one model computes at a time and the next waits its turn.

Targets (issue "cores shared, not split"): under ``shipped``, each light model's p99 beside the noise
<= 1.3x alone, and the noisy model >= 0.95x its answers/s under ``one_core_each`` (same round).

Raw per-request outcomes go to ``perf/results/raw/<run>/`` (not committed); the summary
(``.json``, ``.md``, ``.png``) to ``perf/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import numpy as np

from coalesce_tools.launcher import ServerOptions, TritonServer
from perf import workloads
from perf.outcomes import percentile
from perf.report import write_summary
from perf.repository import SINGLE_MODEL_THREADS, example_repository, with_parameters

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "model_repository"
RESULTS = ROOT / "perf" / "results"
VARIANTS: Final = ("shipped", "wide_no_spin", "borrow_normal", "one_core_each", "shared", "no_spin", "rate_limiter")
#: The variants a default run measures (the others were measured before: perf/results/neighbours-20261205.md).
DEFAULT_VARIANTS: Final = ("shipped", "borrow_normal", "one_core_each")
#: Targets of the shipped variant: light p99 beside the noise over alone, noisy answers/s over the fixed split's.
MAX_LIGHT_P99_RATIO: Final = 1.3
MIN_NOISY_VS_SPLIT: Final = 0.95
#: The resource every instance needs under the ``rate_limiter`` variant (and the shipped example configs).
RATE_LIMITER: Final = 'rate_limiter { resources [ { name: "cores", global: true, count: 1 } ] }'
_INSTANCE_GROUP: Final = re.compile(r"instance_group\s*\[\s*\{([^}]*)\}\s*\]")


def variant_config(config: str, variant: str) -> str:
    """One model's config under ``variant`` (see the module's docstring)."""
    if variant == "shipped":
        return config
    if variant == "borrow_normal":
        return with_parameters(config, {"borrowed_thread_priority": "normal"})
    if variant == "wide_no_spin":
        return with_parameters(config, {"thread_spinning": "false"})
    if variant == "one_core_each":
        return with_parameters(config, {"intra_op_threads": "1", "share_idle_cores": "false"})
    config = with_parameters(config, SINGLE_MODEL_THREADS)
    if variant == "rate_limiter":
        if _INSTANCE_GROUP.search(config):
            return _INSTANCE_GROUP.sub(lambda m: f"instance_group [ {{{m.group(1).rstrip()}, {RATE_LIMITER} }} ]",
                                       config, count=1)
        return config + f"\ninstance_group [ {{ count: 1, kind: KIND_CPU, {RATE_LIMITER} }} ]\n"
    if variant == "no_spin":
        return with_parameters(config, {"thread_spinning": "false"})
    return config


def build_repository(dest: Path, variant: str) -> Path:
    """Every example model under ``variant``: configs written, build outputs linked."""
    return example_repository(dest, lambda _name, config: variant_config(config, variant))


# -- requests ----------------------------------------------------------------------------------------

#: Distinct requests per model. An example config may ship a row cache (minilm does), which answers a
#: request sent before without computing it, so no server is sent the same request twice: warm-up and
#: measurement take disjoint parts of a pool, and a loop that runs out fails rather than repeat.
POOL_REQUESTS = 1000

def request_pools(count: int, seed: int) -> dict[str, list[list[tuple[str, np.ndarray, str]]]]:
    """Seeded requests for each example model: (name, array, datatype) per input."""
    queries = workloads.queries(count, seed)
    documents = workloads.documents(count * 8, seed)
    from sklearn.datasets import load_digits
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(EXAMPLES / "minilm" / "1" / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=256)
    images = load_digits().images.astype(np.float32)

    def texts(values: list[str]) -> np.ndarray:
        return np.array([[v.encode("utf-8")] for v in values], dtype=object)

    pools: dict[str, list[list[tuple[str, np.ndarray, str]]]] = {"minilm": [], "minilm_rerank": [],
                                                                   "minilm_tokens": [], "digits": []}
    # Documents truncated to 256 tokens can coincide: keep the first of each distinct token sequence.
    token_ids = list({tuple(e.ids): None for e in tokenizer.encode_batch(documents)})[:count]
    for i in range(count):
        pools["minilm"].append([("TEXT", texts([queries[i]]), "BYTES")])
        docs = documents[8 * i:8 * i + 8]
        pools["minilm_rerank"].append([("TEXT", texts([queries[i]] * 8), "BYTES"), ("TEXT_PAIR", texts(docs), "BYTES")])
        ids = np.array([token_ids[i]], dtype=np.int64)
        pools["minilm_tokens"].append([("input_ids", ids, "INT64"), ("token_type_ids", np.zeros_like(ids), "INT64")])
        pools["digits"].append([("image", images[i % len(images)][None], "FP32")])
    return pools


@dataclasses.dataclass
class Outcome:
    """One request of a run."""

    model: str
    sent_s: float
    latency_ms: float
    result: str  # ok, error, not_sent


async def _send(client: Any, model: str, request: list[Any], outcomes: list[Outcome], sent_s: float,
                started: float, timeout_s: float) -> None:
    from tritonclient.utils import InferenceServerException

    loop = asyncio.get_running_loop()
    begin = loop.time()
    try:
        await client.infer(model, request, client_timeout=timeout_s)
        result = "ok"
    except InferenceServerException:
        result = "error"
    outcomes.append(Outcome(model, sent_s, (loop.time() - begin) * 1000, result))


async def open_loop(client: Any, model: str, requests: list[list[Any]], rate_per_s: float, duration_s: float,
                    seed: int, outcomes: list[Outcome], max_in_flight: int, timeout_s: float) -> None:
    """Poisson arrivals at ``rate_per_s`` for ``duration_s``; at most ``max_in_flight`` outstanding."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    started = loop.time()
    at = 0.0
    tasks: set[asyncio.Task[None]] = set()
    index = 0
    while True:
        at += rng.expovariate(rate_per_s)
        if at > duration_s:
            break
        await asyncio.sleep(max(0.0, started + at - loop.time()))
        if len(tasks) >= max_in_flight:
            outcomes.append(Outcome(model, at, 0.0, "not_sent"))
            continue
        if index >= len(requests):
            raise RuntimeError(f"{model}: all {len(requests)} distinct requests sent; raise POOL_REQUESTS")
        task = asyncio.create_task(_send(client, model, requests[index], outcomes, at, started, timeout_s))
        index += 1
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


async def closed_loop(client: Any, model: str, requests: list[list[Any]], concurrency: int,
                      duration_s: float) -> float:
    """Answers per second with ``concurrency`` requests always outstanding, each of ``requests`` sent once.

    Raises:
        RuntimeError: If every request was sent before ``duration_s`` ended (repeating one would let a row
            cache answer it).
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + duration_s
    done = [0]

    async def worker(offset: int) -> None:
        i = offset
        while loop.time() < end:
            if i >= len(requests):
                raise RuntimeError(f"{model}: all {len(requests)} distinct requests sent; raise POOL_REQUESTS")
            await client.infer(model, requests[i], client_timeout=60)
            done[0] += 1
            i += concurrency

    start = loop.time()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return done[0] / (loop.time() - start)


def _inputs(pool: list[list[tuple[str, np.ndarray, str]]]) -> list[list[Any]]:
    import tritonclient.grpc.aio as grpcaio

    out = []
    for request in pool:
        items = []
        for name, array, datatype in request:
            item = grpcaio.InferInput(name, list(array.shape), datatype)
            item.set_data_from_numpy(array)
            items.append(item)
        out.append(items)
    return out


def summarize(outcomes: list[Outcome], model: str, duration_s: float) -> dict[str, Any]:
    """Latency percentiles and counts of one model's requests."""
    mine = [o for o in outcomes if o.model == model]
    ok = [o.latency_ms for o in mine if o.result == "ok"]
    return {"sent": sum(o.result != "not_sent" for o in mine), "ok": len(ok),
            "errors": sum(o.result == "error" for o in mine), "not_sent": sum(o.result == "not_sent" for o in mine),
            "answers_per_s": round(len(ok) / duration_s, 2),
            "p50_ms": round(percentile(ok, 0.5), 2), "p99_ms": round(percentile(ok, 0.99), 2)}


def serve(repository: Path, variant: str) -> TritonServer:
    """A server on ``repository`` with every model loaded (rate limiter on for that variant)."""
    options = ServerOptions.on_free_ports(repository, model_control="explicit", load_models=("*",),
                                          rate_limit="execution_count" if variant == "rate_limiter" else "off")
    return TritonServer(options).start()


def measure_variant(variant: str, workdir: Path, pools: dict[str, list[list[Any]]], args: argparse.Namespace,
                    noisy_rate: float, round_: int) -> dict[str, Any]:
    """Light alone, then light beside the noise, on a fresh server under ``variant``."""
    repo = build_repository(workdir / f"{variant}-{round_}", variant)
    server = serve(repo, variant)
    try:
        return asyncio.run(_measure(server.grpc_url, pools, args, noisy_rate, round_))
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)


async def _measure(url: str, pools: dict[str, list[list[tuple[str, np.ndarray, str]]]], args: argparse.Namespace,
                   noisy_rate: float, round_: int) -> dict[str, Any]:
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(url)
    try:
        requests = {model: _inputs(pool) for model, pool in pools.items()}
        for model in (args.noisy, *args.light):  # warm every model and connection, on requests no phase sends
            for request in requests[model][-4:]:
                await client.infer(model, request, client_timeout=60)
        seed = 1000 * round_
        # The two phases send disjoint halves of each light model's pool: no request is sent twice to a server.
        half = POOL_REQUESTS // 2
        alone: list[Outcome] = []
        await asyncio.gather(*(open_loop(client, m, requests[m][:half], args.light_rate, args.duration_s, seed + k,
                                         alone, 10_000, 60) for k, m in enumerate(args.light)))
        together: list[Outcome] = []
        await asyncio.gather(
            open_loop(client, args.noisy, requests[args.noisy][:-4], noisy_rate, args.duration_s, seed + 99, together,
                      args.noisy_in_flight, 120),
            *(open_loop(client, m, requests[m][half:-4], args.light_rate, args.duration_s, seed + k, together,
                        10_000, 60) for k, m in enumerate(args.light)))
        return {"alone": {m: summarize(alone, m, args.duration_s) for m in args.light},
                "together": {m: summarize(together, m, args.duration_s) for m in (*args.light, args.noisy)},
                "raw": {"alone": [dataclasses.asdict(o) for o in alone],
                        "together": [dataclasses.asdict(o) for o in together]}}
    finally:
        await client.close()


async def _capacity(url: str, pools: dict[str, list[list[tuple[str, np.ndarray, str]]]], model: str,
                    concurrency: int, duration_s: float) -> float:
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(url)
    try:
        requests = _inputs(pools[model])
        half = len(requests) // 2  # warm-up and measurement on disjoint halves: no request is sent twice
        await closed_loop(client, model, requests[half:], concurrency, 3.0)
        return await closed_loop(client, model, requests[:half], concurrency, duration_s)
    finally:
        await client.close()


def table(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per variant and light model: medians over rounds, and the median of same-round ratios."""
    rows = []
    for variant in run["variants"]:
        rounds = [r for r in run["rounds"] if r["variant"] == variant]
        noisy = [r["together"][run["noisy"]] for r in rounds]
        for model in run["light"]:
            alone = [r["alone"][model] for r in rounds]
            beside = [r["together"][model] for r in rounds]
            rows.append({
                "variant": variant, "model": model,
                "alone_p50_ms": statistics.median(a["p50_ms"] for a in alone),
                "alone_p99_ms": statistics.median(a["p99_ms"] for a in alone),
                "noisy_p50_ms": statistics.median(b["p50_ms"] for b in beside),
                "noisy_p99_ms": statistics.median(b["p99_ms"] for b in beside),
                "p99_ratio": statistics.median(b["p99_ms"] / max(a["p99_ms"], 1e-9)
                                               for a, b in zip(alone, beside, strict=True)),
                "light_errors": sum(b["errors"] for b in beside),
                "noisy_answers_per_s": statistics.median(n["answers_per_s"] for n in noisy),
                "noisy_model_p99_ms": statistics.median(n["p99_ms"] for n in noisy),
                "noisy_not_sent": sum(n["not_sent"] for n in noisy)})
    return rows


def targets(run: dict[str, Any]) -> list[str]:
    """The ``shipped`` variant against its targets: light p99 ratios, and the noisy model against the fixed split."""
    if "shipped" not in run["variants"]:
        return []
    lines = ["", "Targets of `shipped`:", ""]
    for r in run["table"]:
        if r["variant"] == "shipped":
            met = "met" if r["p99_ratio"] <= MAX_LIGHT_P99_RATIO else "missed"
            lines.append(f"- `{r['model']}` p99 beside the noise / alone: {r['p99_ratio']:.2f} (target <= "
                         f"{MAX_LIGHT_P99_RATIO}: {met})")
    if "one_core_each" in run["variants"]:
        by_round = {(r["round"], r["variant"]): r["together"][run["noisy"]]["answers_per_s"] for r in run["rounds"]}
        ratios = [by_round[k, "shipped"] / by_round[k, "one_core_each"]
                  for k in {r["round"] for r in run["rounds"]} if (k, "one_core_each") in by_round
                  and (k, "shipped") in by_round and by_round[k, "one_core_each"] > 0]
        if ratios:
            ratio = statistics.median(ratios)
            met = "met" if ratio >= MIN_NOISY_VS_SPLIT else "missed"
            lines.append(f"- `{run['noisy']}` answers/s under `shipped` / `one_core_each` (median of same-round "
                         f"ratios): {ratio:.2f} (target >= {MIN_NOISY_VS_SPLIT}: {met})")
    return lines


def markdown(run: dict[str, Any]) -> str:
    """The report."""
    lines = [f"# Noisy neighbours: {run['run']}", "",
             f"- command: `{run['command']}`", f"- machine: {run['machine']}; commit {run['commit']}",
             f"- noisy model `{run['noisy']}` (8 (query, document) pairs per request) offered "
             f"{run['noisy_rate_per_s']:.1f} requests/s = {run['overload']:g} x its capacity "
             f"{run['capacity_per_s']:.1f}/s (closed loop, concurrency {run['capacity_concurrency']}, `shared`), "
             f"at most {run['noisy_in_flight']} in flight",
             f"- light models {', '.join(f'`{m}`' for m in run['light'])}: {run['light_rate_per_s']:g} requests/s "
             f"each (Poisson, one row per request), {run['duration_s']:g} s per phase, {run['rounds_count']} "
             "rounds, variants interleaved (a fresh server each)",
             "- every example model is loaded in every server, its shipped config (precision, row cache, queue "
             "delay) changed only by the variant's thread settings; no server is sent the same request twice, so no "
             "row cache answers one; medians over rounds, ratios within a round", "",
             "| variant | light model | alone p50 ms | alone p99 ms | beside noise p50 ms | beside noise p99 ms "
             "| p99 ratio | light errors | noisy answers/s | noisy p99 ms | noisy not sent |",
             "|" + " --- |" * 11]
    for r in run["table"]:
        lines.append(f"| {r['variant']} | {r['model']} | {r['alone_p50_ms']:.1f} | {r['alone_p99_ms']:.1f} | "
                     f"{r['noisy_p50_ms']:.1f} | {r['noisy_p99_ms']:.1f} | {r['p99_ratio']:.2f} | "
                     f"{r['light_errors']} | {r['noisy_answers_per_s']:.1f} | {r['noisy_model_p99_ms']:.0f} | "
                     f"{r['noisy_not_sent']} |")
    lines += targets(run)
    lines += ["", "Per round (light p99 beside the noise, ms):", ""]
    for r in run["rounds"]:
        lines.append(f"- round {r['round']} `{r['variant']}`: " + ", ".join(
            f"{m} {r['together'][m]['p99_ms']:.1f} (alone {r['alone'][m]['p99_ms']:.1f})" for m in run["light"])
            + f"; noisy {r['together'][run['noisy']]['answers_per_s']:.1f}/s")
    return "\n".join(lines) + "\n"


def plot(run: dict[str, Any], path: Path) -> Path:
    """Light models' p99 alone and beside the noise, per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = run["table"]
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['variant']}\n{r['model']}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["alone_p99_ms"] for r in rows], 0.4, label="alone")
    ax.bar(x + 0.2, [r["noisy_p99_ms"] for r in rows], 0.4, label=f"beside {run['noisy']} at {run['overload']:g}x")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("light model p99 (ms)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("Noisy neighbour: light models' p99 by isolation")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _commit() -> str:
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                          check=False).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    """Measure every variant in interleaved rounds; write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noisy", default="minilm_rerank")
    parser.add_argument("--light", default="minilm,digits", help="comma-separated light models")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=20.0, help="seconds of each phase")
    parser.add_argument("--light-rate", type=float, default=10.0, help="requests/s to each light model")
    parser.add_argument("--overload", type=float, default=2.0, help="noisy rate as a multiple of its capacity")
    parser.add_argument("--noisy-in-flight", type=int, default=64)
    parser.add_argument("--capacity-concurrency", type=int, default=16)
    parser.add_argument("--capacity-s", type=float, default=10.0)
    parser.add_argument("--run", default=datetime.datetime.now(datetime.timezone.utc).strftime("neighbours-%Y%m%d"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.light = [m for m in args.light.split(",") if m]
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    pools = request_pools(POOL_REQUESTS, seed=0)
    workdir = Path(tempfile.mkdtemp(prefix="coalesce-neighbours-"))
    try:
        repo = build_repository(workdir / "capacity", "shared")
        server = serve(repo, "shared")
        try:
            capacity = asyncio.run(_capacity(server.grpc_url, pools, args.noisy, args.capacity_concurrency,
                                             args.capacity_s))
        finally:
            server.stop()
        noisy_rate = args.overload * capacity
        sys.stderr.write(f"neighbours: {args.noisy} capacity {capacity:.1f}/s; offering {noisy_rate:.1f}/s\n")
        rounds = []
        for round_ in range(args.rounds):
            order = variants[round_ % len(variants):] + variants[:round_ % len(variants)]
            for variant in order:
                started = time.monotonic()
                result = measure_variant(variant, workdir, pools, args, noisy_rate, round_)
                rounds.append({"round": round_, "variant": variant, **result})
                light = ", ".join(f"{m} p99 {result['together'][m]['p99_ms']:.0f} ms (alone "
                                  f"{result['alone'][m]['p99_ms']:.0f})" for m in args.light)
                sys.stderr.write(f"neighbours: round {round_} {variant}: {light}; noisy "
                                 f"{result['together'][args.noisy]['answers_per_s']:.1f}/s "
                                 f"({time.monotonic() - started:.0f} s)\n")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    raw_dir = args.out / "raw" / args.run
    raw_dir.mkdir(parents=True, exist_ok=True)
    for r in rounds:
        (raw_dir / f"round{r['round']}-{r['variant']}.json").write_text(json.dumps(r.pop("raw")))
    run = {"run": args.run, "command": "python -m perf.neighbours " + " ".join(argv if argv is not None else
                                                                                 sys.argv[1:]),
           "machine": f"{os.cpu_count()} cores", "commit": _commit(), "noisy": args.noisy, "light": args.light,
           "variants": variants, "capacity_per_s": capacity, "capacity_concurrency": args.capacity_concurrency,
           "noisy_rate_per_s": noisy_rate, "overload": args.overload, "noisy_in_flight": args.noisy_in_flight,
           "light_rate_per_s": args.light_rate, "duration_s": args.duration_s, "rounds_count": args.rounds,
           "rounds": rounds}
    run["table"] = table(run)
    args.out.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, args.run, run, markdown(run))
    plot(run, args.out / f"{args.run}.png")
    sys.stdout.write(markdown(run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
