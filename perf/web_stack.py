"""``python -m perf.web_stack``: which web stack the gateway runs on, chosen by measurement.

Each candidate serves one route that does what the gateway's embeddings route does around
its Triton call: read a JSON body, and answer a 384-float vector in OpenAI's JSON. No model
runs, so the numbers are the stack's own cost per request, which the gateway adds to every
call on cores it shares with Triton. Candidates, each in its own process on a free port:

- ``starlette-uvicorn``: Starlette on uvicorn with uvloop and httptools, orjson bodies (what ships);
- ``starlette-uvicorn-json``: the same with the standard library's ``json``;
- ``fastapi-uvicorn``: FastAPI with a pydantic request model, orjson answer (if FastAPI installs);
- ``aiohttp``: aiohttp's own server on uvloop, orjson bodies.

Driven by ``perf.closed_loop`` (one aiohttp generator, closed loop), interleaved rounds.
Results: ``perf/results/<run>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from perf import closed_loop
from perf.report import write_summary

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 384

_SERVER = r'''
import sys, numpy as np
port, stack = int(sys.argv[1]), sys.argv[2]
vector = np.random.default_rng(0).normal(size=384).astype(np.float32)
if stack.startswith("starlette") or stack.startswith("fastapi"):
    import json, orjson, uvicorn
    from starlette.responses import Response
    if stack == "fastapi-uvicorn":
        from fastapi import FastAPI
        from pydantic import BaseModel
        app = FastAPI()
        class Body(BaseModel):
            model: str
            input: list[str]
        @app.post("/v1/embeddings")
        async def embed(body: Body) -> Response:
            data = [{"object": "embedding", "index": i, "embedding": vector} for i, _ in enumerate(body.input)]
            return Response(orjson.dumps({"object": "list", "data": data, "model": body.model},
                                         option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")
    else:
        from starlette.applications import Starlette
        from starlette.routing import Route
        loads = orjson.loads if stack == "starlette-uvicorn" else json.loads
        def dumps(value):
            if stack == "starlette-uvicorn":
                return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
            return json.dumps(value).encode()
        async def embed(request):
            body = loads(await request.body())
            row = vector if stack == "starlette-uvicorn" else vector.tolist()
            data = [{"object": "embedding", "index": i, "embedding": row} for i, _ in enumerate(body["input"])]
            return Response(dumps({"object": "list", "data": data, "model": body["model"]}),
                            media_type="application/json")
        app = Starlette(routes=[Route("/v1/embeddings", embed, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning",
                access_log=False)
else:
    import asyncio, orjson, uvloop
    from aiohttp import web
    async def embed(request):
        body = orjson.loads(await request.read())
        data = [{"object": "embedding", "index": i, "embedding": vector} for i, _ in enumerate(body["input"])]
        return web.Response(body=orjson.dumps({"object": "list", "data": data, "model": body["model"]},
                                              option=orjson.OPT_SERIALIZE_NUMPY), content_type="application/json")
    app = web.Application()
    app.router.add_post("/v1/embeddings", embed)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
'''

STACKS = ("starlette-uvicorn", "starlette-uvicorn-json", "fastapi-uvicorn", "aiohttp")


def start(stack: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``stack``'s server; its process and URL once it answers."""
    from coalesce_tools.launcher import free_port

    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), stack])
    url = f"http://127.0.0.1:{port}/v1/embeddings"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            request = urllib.request.Request(url, data=b'{"model":"m","input":["x"]}',
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=2):
                return process, url
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"{stack} did not start")


def main(argv: list[str] | None = None) -> int:
    """Measure each stack and write the report."""
    parser = argparse.ArgumentParser(prog="python -m perf.web_stack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--run", default=f"web-stack-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d}")
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = parser.parse_args(argv)
    stacks = [s for s in STACKS if s != "fastapi-uvicorn" or importlib.util.find_spec("fastapi")]
    bodies = closed_loop.encode_bodies([f"text {i}" for i in range(1000)], lambda t: {"model": "m", "input": [t]})
    servers = {s: start(s) for s in stacks}
    points: list[dict[str, Any]] = []
    try:
        order = list(stacks)
        for rnd in range(args.rounds):
            for stack in order:
                result = closed_loop.closed_loop(servers[stack][1], bodies, args.concurrency,
                                                 duration_s=args.duration_s, warmup_s=1.0)
                points.append({"round": rnd, "stack": stack, **result.summary()})
                print(f"r{rnd} {stack}: {result.throughput_per_s:.0f}/s p99 {result.latency_ms(0.99):.2f} ms",
                      flush=True)
            order = order[1:] + order[:1]
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait()
    lines = [f"# Web stack for the gateway ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d})", "",
             f"Command: `python -m perf.web_stack {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"One route, a JSON body in and a {WIDTH}-float OpenAI embeddings answer out, no model; closed loop at "
             f"concurrency {args.concurrency}, {args.rounds} interleaved rounds of {args.duration_s:.0f} s; server "
             "and generator share this machine's 2 cores.", "",
             "| stack | requests/s (median) | per round | p50 ms | p99 ms |", "| --- | --- | --- | --- | --- |"]
    best = max(statistics.median(p["throughput_per_s"] for p in points if p["stack"] == s) for s in stacks)
    for stack in stacks:
        mine = [p for p in points if p["stack"] == stack]
        rate = statistics.median(p["throughput_per_s"] for p in mine)
        per_round = ", ".join(f"{p['throughput_per_s']:.0f}" for p in mine)
        lines.append(f"| {stack} | {rate:.0f} ({rate / best:.2f}x the best) | {per_round} | "
                     f"{statistics.median(p['p50_ms'] for p in mine):.2f} | "
                     f"{statistics.median(p['p99_ms'] for p in mine):.2f} |")
    write_summary(args.out, args.run, {"points": points, "concurrency": args.concurrency}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
