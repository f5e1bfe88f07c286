"""``python -m perf.gateway`` (``make bench-openai``): the OpenAI gateway against Triton's own gRPC, and Infinity.

One tritonserver serves ``minilm`` (the shipped config as a server running it alone has it:
every core, ``repository.single_model_config``; row cache off, since every text is sent
once), ``minilm_rerank`` (the shipped bi-encoder scorer, alone on every core, no cache) and
the shipped ``smollm2``; the gateway runs beside it (``coalesce gateway``), and Infinity's
torch engine serves the same all-MiniLM-L6-v2 weights from its own venv
(``scripts/setup_peers.sh infinity``). Everything shares this machine's cores with the load
generator, as one would in production on one host. Interleaved rounds, each system in turn,
the order rotated per round:

- embeddings, one distinct text per request, closed loop at each ``--concurrency``: straight
  to Triton over gRPC (``tritonclient.grpc.aio``), through ``/v1/embeddings``, and Infinity's
  OpenAI ``/embeddings``. Targets: gateway >= 0.9x gRPC's texts/s; >= 2.5x Infinity's, lower p99.
- chat streaming on smollm2 (greedy, ``ignore_eos``, ``--max-tokens`` each), closed loop at
  each ``--streams``: a direct gRPC stream (the gateway's own ``Triton.generate``, with the
  same chat-templated prompt) against ``/v1/chat/completions`` with ``stream``. Targets: TTFT
  p50 within 2 ms of gRPC's, tokens/s >= 0.9x.
- rerank: pairs/s of ``/v1/rerank`` (a query and ``--documents`` documents per call) against
  the same pairs sent straight to Triton over gRPC. Infinity's ``/rerank`` needs a
  cross-encoder, and none with trained weights ships here (the example scorer is a
  bi-encoder, which Infinity does not rerank with), so no Infinity rerank row is measured.

Results: ``perf/results/<run>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from perf import closed_loop, repository, workloads
from perf.closed_loop import LoadResult, Sample
from perf.report import write_summary

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "model_repository"
EMBED, RERANK, CHAT = "minilm", "minilm_rerank", "smollm2"
CHAT_QUESTIONS = ("What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
                  "Give me a tip for learning Python.", "What do bees make?", "How many legs does a spider have?",
                  "Describe a cat in one sentence.", "What is two plus two?")
EMBEDDING_TARGETS = {"gateway_vs_grpc": 0.9, "gateway_vs_infinity": 2.5}
CHAT_TARGETS = {"ttft_p50_delta_ms": 2.0, "tokens_ratio": 0.9}


def build_repository(dest: Path) -> Path:
    """``minilm`` and ``minilm_rerank`` alone on every core without the row cache, and the shipped ``smollm2``."""
    for name in (EMBED, RERANK):
        config = (SHIPPED / name / "config.pbtxt").read_text()
        config = repository.with_parameters(config, {**repository.SINGLE_MODEL_THREADS, **repository.NO_CACHE})
        repository.add_model(dest, name, config, version_dir=SHIPPED / name / "1")
    (dest / CHAT).mkdir(parents=True)
    (dest / CHAT / "config.pbtxt").write_text((SHIPPED / CHAT / "config.pbtxt").read_text())
    (dest / CHAT / "1").symlink_to((SHIPPED / CHAT / "1").resolve())
    return dest


# -- embeddings and rerank: closed loops ----------------------------------------------------------------

async def grpc_loop(url: str, model: str, rows: Sequence[dict[str, np.ndarray]], output: str, concurrency: int, *,
                    duration_s: float, warmup_s: float) -> LoadResult:
    """Closed loop straight to Triton over gRPC: ``concurrency`` workers, one request each in flight, rows cycled."""
    import tritonclient.grpc.aio as grpcclient
    from tritonclient.utils import InferenceServerException

    def inputs(tensors: dict[str, np.ndarray]) -> list[Any]:
        made = []
        for name, value in tensors.items():
            tensor = grpcclient.InferInput(name, list(value.shape), "BYTES")
            tensor.set_data_from_numpy(value)
            made.append(tensor)
        return made

    requests = [inputs(t) for t in rows]
    wanted = [grpcclient.InferRequestedOutput(output)]
    async with grpcclient.InferenceServerClient(url) as client:
        async def point(seconds: float) -> LoadResult:
            samples: list[Sample] = []
            start = time.perf_counter()
            deadline = start + seconds
            counter = iter(range(1 << 62))

            async def worker() -> None:
                while time.perf_counter() < deadline:
                    index = next(counter)
                    sent = time.perf_counter()
                    error = None
                    try:
                        await client.infer(model, requests[index % len(requests)], outputs=wanted)
                    except InferenceServerException as exc:
                        error = str(exc)[:200]
                    samples.append(Sample(sent_s=sent - start, latency_s=time.perf_counter() - sent,
                                          status=200 if error is None else 500, error=error))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return LoadResult(concurrency=concurrency, duration_s=time.perf_counter() - start, samples=samples)

        if warmup_s > 0:
            await point(warmup_s)
        return await point(duration_s)


def embedding_point(system: str, urls: dict[str, str], texts: Sequence[str], concurrency: int, *,
                    duration_s: float, warmup_s: float) -> dict[str, Any]:
    """One closed-loop point of ``system`` (``grpc``, ``gateway`` or ``infinity``) at ``concurrency``."""
    if system == "grpc":
        rows = [{"TEXT": np.array([[t]], dtype=object)} for t in texts]
        result = asyncio.run(grpc_loop(urls["grpc"], EMBED, rows, "EMBEDDING", concurrency, duration_s=duration_s,
                                       warmup_s=warmup_s))
    else:
        from perf.peer_servers.systems import SERVED_NAME

        model = EMBED if system == "gateway" else SERVED_NAME
        bodies = closed_loop.encode_bodies(texts, lambda t: {"model": model, "input": [t]})
        result = closed_loop.closed_loop(urls[system], bodies, concurrency, duration_s=duration_s, warmup_s=warmup_s)
    return {"system": system, **result.summary(), "texts_per_s": result.throughput_per_s}


def rerank_point(system: str, urls: dict[str, str], queries: Sequence[str], documents: Sequence[str],
                 per_call: int, concurrency: int, *, duration_s: float, warmup_s: float) -> dict[str, Any]:
    """One closed-loop point of rerank calls (a query and ``per_call`` documents) at ``concurrency``."""
    calls = [(q, [documents[(i * per_call + j) % len(documents)] for j in range(per_call)])
             for i, q in enumerate(queries)]
    if system == "grpc":
        rows = [{"TEXT": np.array([[q]] * per_call, dtype=object), "TEXT_PAIR": np.array([[d] for d in docs],
                                                                                         dtype=object)}
                for q, docs in calls]
        result = asyncio.run(grpc_loop(urls["grpc"], RERANK, rows, "SCORES", concurrency, duration_s=duration_s,
                                       warmup_s=warmup_s))
    else:
        bodies = [json.dumps({"model": RERANK, "query": q, "documents": docs, "return_documents": False}).encode()
                  for q, docs in calls]
        result = closed_loop.closed_loop(urls["rerank"], bodies, concurrency, duration_s=duration_s,
                                         warmup_s=warmup_s)
    return {"system": system, **result.summary(), "pairs_per_s": result.throughput_per_s * per_call}


# -- chat streaming -----------------------------------------------------------------------------------

async def _streams(one: Callable[[int], Coroutine[Any, Any, tuple[float, float, int, str | None]]], streams: int,
                   duration_s: float) -> dict[str, Any]:
    """Closed loop of ``streams`` workers, each running ``one(i)`` -> (TTFT s, total s, tokens, error) in turn."""
    records: list[tuple[float, float, int, str | None]] = []
    start = time.perf_counter()
    deadline = start + duration_s
    counter = iter(range(1 << 62))

    async def worker() -> None:
        while time.perf_counter() < deadline:
            records.append(await one(next(counter)))

    await asyncio.gather(*(worker() for _ in range(streams)))
    wall = time.perf_counter() - start
    good = [r for r in records if r[3] is None]
    ttft = sorted(r[0] * 1e3 for r in good)

    def quantile(values: list[float], q: float) -> float | None:
        return values[min(len(values) - 1, max(0, int(np.ceil(q * len(values))) - 1))] if values else None

    itl = sorted((r[1] - r[0]) / (r[2] - 1) * 1e3 for r in good if r[2] > 1)
    return {"streams": streams, "requests": len(records), "errors": len(records) - len(good), "wall_s": wall,
            "tokens_per_s": sum(r[2] for r in good) / wall, "ttft_p50_ms": quantile(ttft, 0.5),
            "ttft_p99_ms": quantile(ttft, 0.99), "itl_p50_ms": quantile(itl, 0.5), "itl_p99_ms": quantile(itl, 0.99),
            "error_kinds": sorted({r[3] for r in records if r[3]})[:3]}


def chat_point(system: str, urls: dict[str, str], prompts: Sequence[str], streams: int, max_tokens: int, *,
               duration_s: float, warmup_s: float) -> dict[str, Any]:
    """One closed-loop point of streamed chats: ``grpc`` (direct stream) or ``gateway`` (SSE)."""
    import aiohttp

    from coalesce_tools.gateway.triton import Triton

    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}

    async def run() -> dict[str, Any]:
        if system == "grpc":
            triton = Triton(urls["grpc"], timeout_s=120)

            async def one(index: int) -> tuple[float, float, int, str | None]:
                sent = time.perf_counter()
                first, pieces = None, 0
                try:
                    async for piece in triton.generate(CHAT, prompts[index % len(prompts)], sampling):
                        if piece.text:
                            first = first or time.perf_counter()
                            pieces += 1
                except Exception as exc:
                    return 0.0, 0.0, 0, repr(exc)[:200]
                return (first or time.perf_counter()) - sent, time.perf_counter() - sent, max_tokens, None

            try:
                if warmup_s > 0:
                    await _streams(one, streams, warmup_s)
                return await _streams(one, streams, duration_s)
            finally:
                await triton.close()

        connector = aiohttp.TCPConnector(limit=streams)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def one(index: int) -> tuple[float, float, int, str | None]:
                body = {"model": CHAT, "messages": [{"role": "user", "content": CHAT_QUESTIONS[index % len(
                    CHAT_QUESTIONS)]}], "stream": True, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
                sent = time.perf_counter()
                first = None
                try:
                    async with session.post(urls["chat"], json=body) as response:
                        if response.status != 200:
                            return 0.0, 0.0, 0, f"HTTP {response.status}: {(await response.text())[:150]}"
                        async for line in response.content:
                            if first is None and line.startswith(b"data: {") and b'"content":"' in line \
                                    and b'"content":""' not in line:
                                first = time.perf_counter()
                except aiohttp.ClientError as exc:
                    return 0.0, 0.0, 0, repr(exc)[:200]
                return (first or time.perf_counter()) - sent, time.perf_counter() - sent, max_tokens, None

            if warmup_s > 0:
                await _streams(one, streams, warmup_s)
            return await _streams(one, streams, duration_s)

    return {"system": system, **asyncio.run(run())}


# -- the run ------------------------------------------------------------------------------------------

def ratios(points: Sequence[dict[str, Any]], key: str, a: str, b: str, group: str) -> dict[Any, list[float]]:
    """Per ``group`` value, the per-round ratios ``a / b`` of ``key`` (rounds measured back to back)."""
    out: dict[Any, list[float]] = {}
    by = {(p["round"], p[group], p["system"]): p for p in points}
    for (rnd, level, system), point in by.items():
        other = by.get((rnd, level, b))
        if system == a and other and other.get(key):
            out.setdefault(level, []).append(point[key] / other[key])
    return out


def median_of(points: Sequence[dict[str, Any]], key: str, **match: Any) -> float | None:
    """Median of ``key`` over the points matching ``match``."""
    values = [p[key] for p in points if all(p.get(k) == v for k, v in match.items()) and p.get(key) is not None]
    return statistics.median(values) if values else None


def markdown(run: dict[str, Any]) -> str:
    """The report."""
    lines = [f"# The gateway: OpenAI routes against Triton's gRPC and Infinity ({run['date']})", "",
             f"Command: `{run['command']}`", "", run["setup"], ""]
    emb = run["embeddings"]
    lines += ["## /v1/embeddings (one distinct text per request)", "",
              "| concurrency | system | texts/s (median) | p50 ms | p99 ms | errors |",
              "| --- | --- | --- | --- | --- | --- |"]
    for level in run["concurrency"]:
        for system in ("grpc", "gateway", "infinity"):
            if median_of(emb, "texts_per_s", concurrency=level, system=system) is None:
                continue
            errors = sum(p["errors"] for p in emb if p["concurrency"] == level and p["system"] == system)
            lines.append(f"| {level} | {system} | {median_of(emb, 'texts_per_s', concurrency=level, system=system):.1f}"
                         f" | {median_of(emb, 'p50_ms', concurrency=level, system=system):.1f}"
                         f" | {median_of(emb, 'p99_ms', concurrency=level, system=system):.1f} | {errors} |")
    lines += ["", "| concurrency | gateway / gRPC (per round) | target | gateway / Infinity (per round) | target |",
              "| --- | --- | --- | --- | --- |"]
    vs_grpc = ratios(emb, "texts_per_s", "gateway", "grpc", "concurrency")
    vs_inf = ratios(emb, "texts_per_s", "gateway", "infinity", "concurrency")
    for level in run["concurrency"]:
        g, i = vs_grpc.get(level, []), vs_inf.get(level, [])
        lines.append(f"| {level} | {_rounds(g)} | >= {EMBEDDING_TARGETS['gateway_vs_grpc']} ({_verdict(g, 0.9)}) "
                     f"| {_rounds(i)} | >= {EMBEDDING_TARGETS['gateway_vs_infinity']} ({_verdict(i, 2.5)}) |")
    chat = run["chat"]
    lines += ["", f"## /v1/chat/completions streamed ({run['max_tokens']} tokens each, greedy, ignore_eos)", "",
              "| streams | system | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for level in run["streams"]:
        for system in ("grpc", "gateway"):
            m = {k: median_of(chat, k, streams=level, system=system)
                 for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}
            errors = sum(p["errors"] for p in chat if p["streams"] == level and p["system"] == system)
            lines.append(f"| {level} | {system} | " + " | ".join(_fmt(v) for v in m.values()) + f" | {errors} |")
    lines += ["", "| streams | tokens/s gateway / gRPC | target >= 0.9 | TTFT p50 gateway - gRPC (ms) | "
              "target <= 2 |", "| --- | --- | --- | --- | --- |"]
    tok = ratios(chat, "tokens_per_s", "gateway", "grpc", "streams")
    for level in run["streams"]:
        deltas = [p["ttft_p50_ms"] - q["ttft_p50_ms"] for p in chat for q in chat
                  if p["round"] == q["round"] and p["streams"] == q["streams"] == level
                  and p["system"] == "gateway" and q["system"] == "grpc" and p["ttft_p50_ms"] and q["ttft_p50_ms"]]
        met = "met" if deltas and statistics.median(deltas) <= 2.0 else "missed"
        lines.append(f"| {level} | {_rounds(tok.get(level, []))} ({_verdict(tok.get(level, []), 0.9)}) | | "
                     f"{_rounds(deltas)} ({met}) | |")
    rr = run["rerank"]
    lines += ["", f"## /v1/rerank ({run['documents']} documents per call, concurrency {run['rerank_concurrency']})", "",
              "| system | pairs/s (median) | p50 ms | p99 ms | errors |", "| --- | --- | --- | --- | --- |"]
    for system in ("grpc", "gateway"):
        errors = sum(p["errors"] for p in rr if p["system"] == system)
        lines.append(f"| {system} | {_fmt(median_of(rr, 'pairs_per_s', system=system))} | "
                     f"{_fmt(median_of(rr, 'p50_ms', system=system))} | {_fmt(median_of(rr, 'p99_ms', system=system))}"
                     f" | {errors} |")
    r = ratios(rr, "pairs_per_s", "gateway", "grpc", "concurrency").get(run["rerank_concurrency"], [])
    lines += ["", f"Gateway / gRPC pairs/s per round: {_rounds(r)}.", "", run["rerank_note"], ""]
    lines += ["## Notes", "", *[f"- {n}" for n in run["notes"]], ""]
    return "\n".join(lines)


def _fmt(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rounds(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values) + (f" (median {statistics.median(values):.2f})" if values else "-")


def _verdict(values: Sequence[float], target: float) -> str:
    if not values:
        return "not measured"
    value = statistics.median(values)
    return f"met by {value - target:+.2f}" if value >= target else f"missed by {target - value:.2f}"


def plot(run: dict[str, Any], path: Path) -> Path:
    """Texts/s per system and concurrency, and TTFT p50 per system and stream count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    systems = ("grpc", "gateway", "infinity")
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        values = [median_of(run["embeddings"], "texts_per_s", concurrency=c, system=system) or 0
                  for c in run["concurrency"]]
        left.bar([x + i * width for x in range(len(run["concurrency"]))], values, width, label=system)
    left.set_xticks([x + width for x in range(len(run["concurrency"]))], [f"c={c}" for c in run["concurrency"]])
    left.set_ylabel("texts/s")
    left.set_title("/v1/embeddings vs gRPC vs Infinity")
    left.legend()
    for i, system in enumerate(("grpc", "gateway")):
        values = [median_of(run["chat"], "ttft_p50_ms", streams=s, system=system) or 0 for s in run["streams"]]
        right.bar([x + i * 0.4 for x in range(len(run["streams"]))], values, 0.4, label=system)
    right.set_xticks([x + 0.2 for x in range(len(run["streams"]))], [f"{s} streams" for s in run["streams"]])
    right.set_ylabel("TTFT p50 (ms)")
    right.set_title("chat streaming: gateway SSE vs gRPC stream")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its report."""
    parser = argparse.ArgumentParser(prog="python -m perf.gateway", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--documents", type=int, default=16, help="documents per rerank call")
    parser.add_argument("--rerank-concurrency", type=int, default=8)
    parser.add_argument("--no-infinity", action="store_true", help="leave Infinity out (no .bench venv)")
    parser.add_argument("--run", default=f"gateway-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d}")
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from coalesce_tools.gateway.options import GatewayOptions
    from coalesce_tools.gateway.server import GatewayProcess
    from coalesce_tools.launcher import ADMIN_HEADER, ServerOptions, TritonServer, free_port
    from perf.peer_servers import systems

    texts = workloads.queries(20000, seed=11)
    documents = workloads.documents(4000, seed=12)
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED / CHAT / "1" / "hf"))
    prompts = [str(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True)) for q in CHAT_QUESTIONS]
    notes: dict[str, str] = {}
    run: dict[str, Any] = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}",
        "command": "python -m perf.gateway " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "concurrency": args.concurrency, "streams": args.streams, "max_tokens": args.max_tokens,
        "documents": args.documents, "rerank_concurrency": args.rerank_concurrency,
        "embeddings": [], "chat": [], "rerank": [], "notes": [],
    }
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="coalesce-gateway-bench-")))
        options = ServerOptions.on_free_ports(build_repository(workdir / "repo"), model_control="explicit",
                                              load_models=(EMBED, RERANK, CHAT))
        log = stack.enter_context((workdir / "tritonserver.log").open("w"))
        server = stack.enter_context(TritonServer(options, echo=log))
        gateway = stack.enter_context(GatewayProcess(GatewayOptions(
            model_repository=workdir / "repo", triton_grpc_url=server.grpc_url, port=free_port(),
            triton_admin_key=server.admin_headers.get(ADMIN_HEADER))))
        urls = {"grpc": server.grpc_url, "gateway": gateway.url + "/v1/embeddings",
                "chat": gateway.url + "/v1/chat/completions", "rerank": gateway.url + "/v1/rerank"}
        embed_systems = ["grpc", "gateway"]
        if not args.no_infinity:
            endpoint = systems.start_infinity(stack, workdir, "infinity-torch", notes)
            urls["infinity"] = endpoint.url
            embed_systems.append("infinity")
        run["setup"] = (
            f"One tritonserver: `{EMBED}` and `{RERANK}` alone on every core (`intra_op_threads 0`, spinning), "
            "row cache off (every text is sent once), as shipped otherwise (INT8); the shipped `smollm2`. "
            "The gateway (`coalesce gateway`, Starlette on uvicorn) beside it; Infinity "
            f"{'(torch engine, FP32, batch 32) ' if 'infinity' in urls else 'not run '}on the same weights. "
            "Server, gateway, peers and the load generator share this machine's 2 cores. Systems run one at a "
            f"time, the order rotated each round; {args.rounds} rounds of {args.duration_s:.0f} s after "
            f"{args.warmup_s:.0f} s of warm-up per point.")
        order = list(embed_systems)
        for rnd in range(args.rounds):
            for level in args.concurrency:
                for system in order:
                    point = embedding_point(system, urls, texts[(rnd * 7919) % 5000:], level,
                                            duration_s=args.duration_s, warmup_s=args.warmup_s)
                    run["embeddings"].append({"round": rnd, **point})
                    print(f"embeddings r{rnd} c={level} {system}: {point['texts_per_s']:.1f}/s "
                          f"p99 {point['p99_ms']} ms errors {point['errors']}", flush=True)
            pair = [s for s in order if s in ("grpc", "gateway")]  # the order rotated, Infinity left out
            for level in args.streams:
                for system in pair:
                    point = chat_point(system, urls, prompts, level, args.max_tokens, duration_s=args.duration_s,
                                       warmup_s=args.warmup_s)
                    run["chat"].append({"round": rnd, **point})
                    print(f"chat r{rnd} streams={level} {system}: {point['tokens_per_s']:.1f} tok/s "
                          f"ttft p50 {point['ttft_p50_ms']} ms errors {point['errors']}", flush=True)
            for system in pair:
                point = rerank_point(system, urls, texts[5000 + rnd * 500:], documents, args.documents,
                                     args.rerank_concurrency, duration_s=args.duration_s, warmup_s=args.warmup_s)
                run["rerank"].append({"round": rnd, "concurrency": args.rerank_concurrency, **point})
                print(f"rerank r{rnd} {system}: {point['pairs_per_s']:.1f} pairs/s errors {point['errors']}",
                      flush=True)
            order = order[1:] + order[:1]
    run["rerank_note"] = ("Infinity's `/rerank` loads cross-encoders only; no cross-encoder with trained weights ships "
                          "in a package this machine reaches, and the example scorer is a bi-encoder, so the "
                          "Infinity rerank comparison the issue asks for is not measured.")
    run["notes"] = [f"{k}: {v}" for k, v in notes.items()] + [
        "Usage counts: the gateway tokenises each text once more for `usage` (the model's own tokenizer); that "
        "work shares the cores with the server and is part of the gateway's cost here."]
    path = write_summary(args.out, args.run, run, markdown(run))
    plot(run, args.out / f"{args.run}.png")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
