"""``make bench-generate``: continuous batching against request-level static batching and one request at a time.

One tritonserver (explicit model control) serves one temporary repository holding three
models on the same tinylm weights (its version folder's ``hf/``, linked). tinylm is the
untrained test model of ``tests/models/`` (``make setup-dev`` builds it): fast, so the
benchmark measures the batching rather than the model; moving it to the example model
``smollm2`` (a real LM, ~35x the parameters) is left to a later issue.

- ``continuous``: ``tinylm`` as shipped: every step runs one forward pass over all active
  sequences; requests join the next step and leave the step they finish.
- ``static``: request-level static batching: Triton's dynamic batcher forms batches of up
  to 16 requests (``max_queue_delay_microseconds`` small), and the backend
  (``generation_batching: request``) runs each batch until its longest generation ends
  before Triton hands it the next.
- ``single``: one request at a time (``generation_batching: request``,
  ``max_active_sequences: 1``, no Triton batching).

Only the system being measured is loaded (repository API), so the three never share the
cores; each round loads them in a rotated order and runs, on each, the same seeded trace
twice: closed loop with 16 concurrent gRPC streams (each client sends its next request
when its previous one has finished: the issue's headline) and open loop (Poisson arrivals
at ``--rate``). Requests stream (``stream: true``), temperature 0, ``ignore_eos`` so each
generates exactly its ``max_tokens``. Per request: time to first token (TTFT, from the
send in closed loop, from the scheduled arrival in open loop), the gaps between streamed
responses carrying text (ITL), end-to-end latency. Results: ``perf/results/<run>.{md,json,png}``
and per-request CSVs in ``perf/results/raw/<run>/``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import itertools
import json
import math
import os
import queue
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from perf import report, workloads
from perf.report import write_summary
from perf.repository import with_parameters

ROOT = Path(__file__).resolve().parent.parent
TINYLM = ROOT / "tests" / "models" / "tinylm"
SYSTEMS: Final = ("continuous", "static", "single")
MODELS: Final = {"continuous": "tinylm", "static": "tinylm_static", "single": "tinylm_single"}
MODES: Final = ("closed", "open")
#: The largest batch Triton may hand ``static``, and the sequences it may run at once.
STATIC_BATCH: Final = 16
#: The backend's token counter, read around each measurement to check the client's count.
TOKENS_METRIC: Final = "coalesce_generate_tokens_total"


# --- the systems ----------------------------------------------------------------------------------------------------


def system_config(shipped: str, system: str, *, static_delay_us: int = 1000) -> str:
    """``tinylm``'s shipped ``config.pbtxt`` text turned into ``system``'s (renamed, batching changed).

    Everything else (KV cache, prefill budget, threads, prefix cache) stays as shipped, so
    the three differ only in how requests are batched.
    """
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    if system == "continuous":
        return shipped
    name = MODELS[system]
    config = shipped.replace('name: "tinylm"', f'name: "{name}"', 1)
    if system == "static":
        config = config.replace("max_batch_size: 0", f"max_batch_size: {STATIC_BATCH}\n"
                                f"dynamic_batching {{ max_queue_delay_microseconds: {static_delay_us} }}", 1)
        return with_parameters(config, {"generation_batching": "request", "max_active_sequences": str(STATIC_BATCH)})
    return with_parameters(config, {"generation_batching": "request", "max_active_sequences": "1"})


def build_repository(dest: Path, *, static_delay_us: int = 1000) -> Path:
    """A repository with the three systems, each linking the shipped ``tinylm/1/hf`` (never copied)."""
    shipped = (TINYLM / "config.pbtxt").read_text()
    weights = (TINYLM / "1" / "hf").resolve()
    for system in SYSTEMS:
        model = dest / MODELS[system]
        (model / "1").mkdir(parents=True)
        (model / "config.pbtxt").write_text(system_config(shipped, system, static_delay_us=static_delay_us))
        (model / "1" / "hf").symlink_to(weights, target_is_directory=True)
    return dest


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


def ratio_rows(points: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: medians over rounds per system, and same-round ratios of continuous over the others.

    ``x single`` and ``x static`` are tokens/s ratios; ``ttft p99 / static`` is continuous's
    p99 TTFT over static's (below 1 is better). Each is the median of the per-round ratios.
    """
    rows = []
    for mode in MODES:
        by_round: dict[int, dict[str, Mapping[str, Any]]] = {}
        for p in points:
            if p["mode"] == mode:
                by_round.setdefault(int(p["round"]), {})[p["system"]] = p
        if not by_round:
            continue
        row: dict[str, Any] = {"mode": mode, "rounds": len(by_round)}
        for system in SYSTEMS:
            mine = [r[system] for r in by_round.values() if system in r]
            for key in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms",
                        "e2e_p99_ms", "cost_per_m_tokens", "errors"):
                row[f"{system}_{key}"] = report.median([p[key] for p in mine if p.get(key) is not None])

        def per_round(key: str, other: str, rounds: Mapping[int, Mapping[str, Mapping[str, Any]]] = by_round
                      ) -> list[float]:
            return [r["continuous"][key] / r[other][key] for _, r in sorted(rounds.items())
                    if "continuous" in r and other in r and r[other].get(key) and r["continuous"].get(key) is not None]

        row["per_round_over_single"] = per_round("tokens_per_s", "single")
        row["per_round_over_static"] = per_round("tokens_per_s", "static")
        row["per_round_ttft_p99_over_static"] = per_round("ttft_p99_ms", "static")
        row["over_single"] = report.median(row["per_round_over_single"])
        row["over_static"] = report.median(row["per_round_over_static"])
        row["ttft_p99_over_static"] = report.median(row["per_round_ttft_p99_over_static"])
        rows.append(row)
    return rows


#: The issue's targets, at 16 concurrent streams (the closed loop).
TARGETS: Final = (("over_single", ">=", 3.0, "continuous tokens/s >= 3x single's"),
                  ("over_static", ">=", 1.5, "continuous tokens/s >= 1.5x static's"),
                  ("ttft_p99_over_static", "<=", 1.0, "continuous p99 TTFT no worse than static's"))


def targets(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each target of ``TARGETS`` against a closed-loop ratio row: the measured ratio and whether it is met."""
    out = []
    for key, op, goal, what in TARGETS:
        value = row.get(key)
        met = value is not None and (value >= goal if op == ">=" else value <= goal)
        out.append({"target": what, "key": key, "op": op, "goal": goal, "measured": value, "met": met})
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
        for record, done in failed:
            record.error = reason
            done.set()

    def close(self) -> None:
        """Stop every stream and close the clients."""
        for client in self._clients:
            try:
                client.stop_stream(cancel_requests=True)
            finally:
                client.close()


class _Clock:
    """Seconds since the last ``reset``."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self._start


def _open_streams(url: str, count: int, model: str, trace: Sequence[TraceRequest], *, batched: bool,
                  scheduled: bool) -> tuple[_Clock, Streams, list[RequestRecord]]:
    """``count`` open streams, a record per request (scheduled at its arrival, or when sent) and the run's clock.

    The clock starts once the streams are open.
    """
    clock = _Clock()
    streams = Streams(url, count, model, batched=batched, clock=clock)
    records = [RequestRecord(index=t.index, max_tokens=t.max_tokens, prompt_tokens=t.prompt_tokens,
                             scheduled_s=t.arrival_s if scheduled else math.nan) for t in trace]
    clock.reset()
    return clock, streams, records


def _wall_s(streams: Streams, records: Sequence[RequestRecord], clock: _Clock, deadline_s: float) -> float:
    """End what is still pending at the deadline; the run's wall time: to its last final response."""
    streams.fail_pending(f"not finished within the run's deadline of {deadline_s:.0f} s")
    return max([r.done_s for r in records if r.ok], default=clock())


def run_closed(url: str, model: str, trace: Sequence[TraceRequest], *, concurrency: int, batched: bool,
               deadline_s: float) -> tuple[list[RequestRecord], float]:
    """Closed loop: ``concurrency`` clients, each sending the trace's next request when its last one ended."""
    clock, streams, records = _open_streams(url, concurrency, model, trace, batched=batched, scheduled=False)
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for t in trace:
        todo.put(t.index)

    def worker(client: int) -> None:
        while clock() < deadline_s:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            record = records[index]
            record.scheduled_s = clock()
            try:
                done = streams.send(client, f"{index}", record, trace[index].prompt)
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


def run_open(url: str, model: str, trace: Sequence[TraceRequest], *, clients: int, batched: bool,
             deadline_s: float) -> tuple[list[RequestRecord], float]:
    """Open loop: every request sent at its scheduled arrival, round-robin over ``clients`` streams."""
    clock, streams, records = _open_streams(url, clients, model, trace, batched=batched, scheduled=True)
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


# --- the server -----------------------------------------------------------------------------------------------------


def tokens_counter(metrics_url: str, model: str) -> float:
    """The backend's generated-token counter of ``model`` now (summed over label sets)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    pattern = re.compile(rf'^{TOKENS_METRIC}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


def executions(admin: Any, model: str, headers: Mapping[str, str] | None) -> tuple[int, int]:
    """Triton's request and ``execute`` counts of ``model`` so far: their ratio is the batch it handed the model."""
    stats = admin.get_inference_statistics(model_name=model, headers=headers)["model_stats"][0]
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def warm_up(url: str, model: str, *, batched: bool) -> None:
    """A few short requests, so the first measured ones do not pay for first calls."""
    streams = Streams(url, 2, model, batched=batched, clock=time.perf_counter)
    try:
        events = [streams.send(i % 2, f"warm-{i}", RequestRecord(index=i, max_tokens=8, prompt_tokens=0,
                                                                  scheduled_s=0.0), "def warm_up(): return 1")
                  for i in range(4)]
        for event in events:
            event.wait(timeout=60)
    finally:
        streams.close()


def write_raw(path: Path, records: Sequence[RequestRecord], *, from_arrival: bool) -> None:
    """One CSV row per request: its times, responses, tokens asked and re-tokenised, error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["index", "prompt_tokens", "max_tokens", "scheduled_s", "sent_s", "first_token_s", "done_s",
                         "ttft_ms", "e2e_ms", "responses", "text_responses", "retokenised_tokens", "error"])
        for r in records:
            m = request_metrics(r, from_arrival=from_arrival) if r.ok else {"ttft_s": None, "e2e_s": None}
            writer.writerow([r.index, r.prompt_tokens, r.max_tokens, f"{r.scheduled_s:.4f}", f"{r.sent_s:.4f}",
                             f"{r.token_times_s[0]:.4f}" if r.token_times_s else "", f"{r.done_s:.4f}",
                             "" if m["ttft_s"] is None else f"{m['ttft_s'] * 1000:.2f}",
                             "" if m["e2e_s"] is None else f"{m['e2e_s'] * 1000:.2f}", r.responses,
                             len(r.token_times_s), r.retokenised, r.error])


# --- the report -----------------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 1) -> str:
    return report._fmt(value, digits)


def _rounds(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def markdown(run: Mapping[str, Any]) -> str:
    """The report: setup, the headline table with targets, per-mode tables, every measurement."""
    rows = {r["mode"]: r for r in run["ratios"]}
    lines = [f"# Generation: continuous vs static vs single ({run['run']})", "",
             f"- date: {run['date']}", f"- machine: {run['machine']}", f"- command: `{run['command']}`",
             f"- trace: {run['trace']}", f"- systems: {run['systems_note']}",
             f"- rounds: {run['rounds']}, each loading the systems one at a time in a rotated order; numbers are "
             "medians over rounds, ratios are medians of the same-round ratios",
             f"- tokens: {run['tokens_note']}",
             f"- ITL: {run['itl_note']}",
             f"- cost: instance price ${run['price_per_hour']}/hour (perf/report.py's convention, `make bench`'s "
             "default), $ per 1M generated tokens = price / (tokens/s x 3600) x 1e6", ""]
    closed = rows.get("closed")
    if closed:
        lines += [f"## Targets at {run['concurrency']} concurrent streams (closed loop)", "",
                  "| target | measured (median of rounds) | per round | met |", "| --- | --- | --- | --- |"]
        per_round = {"over_single": "per_round_over_single", "over_static": "per_round_over_static",
                     "ttft_p99_over_static": "per_round_ttft_p99_over_static"}
        for t in run["targets"]:
            lines.append(f"| {t['target']} ({t['op']} {t['goal']}) | {_fmt(t['measured'], 2)}x | "
                         f"{_rounds(closed[per_round[t['key']]])} | "
                         f"{'yes' if t['met'] else 'NO'} |")
        lines.append("")
    titles = {"closed": f"Closed loop: {run['concurrency']} concurrent streams, {run['closed_requests']} requests",
              "open": f"Open loop: Poisson arrivals at {run['rate_per_s']} requests/s, {run['open_requests']} requests"}
    for mode in MODES:
        row = rows.get(mode)
        if not row:
            continue
        lines += [f"## {titles[mode]}", "",
                  "| system | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | E2E p50 ms | E2E p99 ms "
                  "| $/1M tokens | errors |", "|" + " --- |" * 10]
        for system in SYSTEMS:
            cells = [system] + [_fmt(row[f"{system}_{k}"], d) for k, d in (
                ("tokens_per_s", 1), ("ttft_p50_ms", 1), ("ttft_p99_ms", 1), ("itl_p50_ms", 1), ("itl_p99_ms", 1),
                ("e2e_p50_ms", 0), ("e2e_p99_ms", 0), ("cost_per_m_tokens", 3), ("errors", 0))]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", f"continuous over single: {_fmt(row['over_single'], 2)}x tokens/s (rounds: "
                  f"{_rounds(row['per_round_over_single'])}); over static: {_fmt(row['over_static'], 2)}x (rounds: "
                  f"{_rounds(row['per_round_over_static'])}); p99 TTFT continuous / static: "
                  f"{_fmt(row['ttft_p99_over_static'], 2)} (rounds: {_rounds(row['per_round_ttft_p99_over_static'])})",
                  ""]
    if run.get("step_costs"):
        lines += ["## One decoding step by sequences in it (the engine in process, no server)", "",
                  "| sequences | ms per step | ms per sequence | tokens/s |", "| --- | --- | --- | --- |",
                  *(f"| {r['sequences']} | {r['step_ms']:.2f} | {r['ms_per_sequence']:.2f} | {r['tokens_per_s']:.0f} |"
                    for r in run["step_costs"]), ""]
    if run.get("discussion"):
        lines += ["## Reading it", "", *run["discussion"], ""]
    lines += ["## Every measurement", "",
              "| round | order | mode | system | tokens/s | wall s | finished | errors | TTFT p50 / p99 ms | "
              "ITL p50 / p99 ms | E2E p99 ms | requests per execute | backend tokens / asked |", "|" + " --- |" * 13]
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

    rows = {r["mode"]: r for r in run["ratios"]}
    modes = [m for m in MODES if m in rows]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    width = 0.8 / max(len(modes), 1)
    for m, mode in enumerate(modes):
        xs = [i + (m - (len(modes) - 1) / 2) * width for i in range(len(SYSTEMS))]
        axes[0].bar(xs, [rows[mode][f"{s}_tokens_per_s"] or 0 for s in SYSTEMS], width, label=mode, color=f"C{m}")
        for x, system in zip(xs, SYSTEMS, strict=True):
            values = [p["tokens_per_s"] for p in run["points"] if p["mode"] == mode and p["system"] == system]
            axes[0].plot([x] * len(values), values, "k.", markersize=4)
    axes[0].set_xticks(range(len(SYSTEMS)), SYSTEMS)
    axes[0].set_ylabel("generated tokens/s")
    axes[0].set_title("throughput (bars: median, dots: rounds)")
    axes[0].legend(fontsize=8)
    for ax, metric in ((axes[1], "ttft"), (axes[2], "itl")):
        labels, slots = [], 0
        for mode in modes:
            for system in SYSTEMS:
                for q, hatch in (("p50", ""), ("p99", "//")):
                    value = rows[mode][f"{system}_{metric}_{q}_ms"]
                    ax.bar(slots, value or 0, color=f"C{SYSTEMS.index(system)}", hatch=hatch, edgecolor="black",
                           linewidth=0.3)
                    labels.append(f"{system} {q}\n{mode}")
                    slots += 1
            slots += 1
            labels.append("")
        ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=90)
        ax.set_yscale("log")
        ax.set_ylabel("ms (median over rounds)")
        ax.set_title(f"{metric.upper()} p50 (plain) and p99 (hatched)")
    fig.suptitle(f"tinylm on {run['machine']}: continuous vs static vs single")
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
    closed = rows.get("closed")
    if closed and all(closed.get(f"{s}_itl_p50_ms") and closed.get(f"{s}_tokens_per_s") for s in SYSTEMS):
        # Little's law: tokens/s = sequences per step / step time, and the ITL p50 is about one step.
        active = {s: closed[f"{s}_tokens_per_s"] * closed[f"{s}_itl_p50_ms"] / 1000 for s in SYSTEMS}
        step = {s: closed[f"{s}_itl_p50_ms"] for s in SYSTEMS}
        out.append(
            f"- Why (closed loop, medians): a decoding step of one sequence takes {step['single']:.1f} ms (single's "
            f"ITL p50); continuous's steps take {step['continuous']:.1f} ms and carry about "
            f"{active['continuous']:.1f} sequences (tokens/s x ITL p50), static's {step['static']:.1f} ms with about "
            f"{active['static']:.1f}. On 2 CPU cores a step's cost grows with every sequence in it (about "
            f"{(step['continuous'] - step['single']) / max(active['continuous'] - 1, 1e-9):.2f} ms each here), so "
            "batching gains only the fixed part of a step, not the near-free extra rows a GPU gives. Static batching "
            "here is request-level: a sequence that finishes leaves the forward pass at once (the backend never pads "
            "finished sequences), so a draining static batch costs cheaper steps, not wasted ones; what static loses "
            "is the clients idle while the batch drains (fewer sequences per step) and the wait for the next batch "
            "(its TTFT).")
    costs = {int(r["sequences"]): r["step_ms"] for r in run.get("step_costs", [])}
    if 1 in costs and 8 in costs and 16 in costs:
        out.append(
            f"- In process, without the server, a step of 1, 8 and 16 decoding sequences takes {costs[1]:.1f}, "
            f"{costs[8]:.1f} and {costs[16]:.1f} ms (table above): the engine's own step grows "
            f"{(costs[16] - costs[8]) / 8:.2f} ms per sequence from 8 to 16. The served steps are longer and grow "
            "faster because each sequence also costs a response and a cancellation check per step (each a round "
            "trip between the model's process and the server) and the client's work, all on the same 2 cores.")
    batches = [p["avg_batch"] for p in run["points"] if p["system"] == "static" and p["mode"] == "closed"
               and p.get("avg_batch")]
    if batches:
        out.append(
            f"- Triton handed `static` {report.median(batches):.1f} requests per execute (median of rounds; "
            f"{', '.join(f'{b:.1f}' for b in batches)}), not the {run['concurrency']} clients: the raw CSVs show the "
            "next batch often closed while the running one was still draining, so requests sent in its last "
            "few hundred ms waited a whole further batch. Fuller static batches would raise static's tokens/s "
            "and narrow the ratio above.")
    return out


def step_costs(batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32), *, prompt_words: int = 100,
               steps: int = 30) -> list[dict[str, float]]:
    """One decoding step's time by sequences in it: tinylm's engine in this process, no server, no client.

    Separates what batching saves on this CPU (the step's fixed part) from what serving
    adds (responses, cancellation checks, the client on the same cores).
    """
    import numpy as np

    from coalesce.generation.loader import load_engine
    from coalesce.generation.request import read_request
    from coalesce.settings import ModelSettings
    from coalesce_tools.config import read_model_config

    config = read_model_config(TINYLM / "config.pbtxt")
    engine = load_engine(config, TINYLM / "1", settings=ModelSettings.from_model_config(config), start=False)
    prompt = np.array([(" word" * prompt_words).encode()], dtype=object)
    rows = []
    for count in batch_sizes:
        for _ in range(count):
            request = read_request({"text_input": prompt}, {"max_tokens": steps * 2, "temperature": 0,
                                                            "ignore_eos": True}, engine.options)
            engine.submit(request, lambda event: None)
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


def main(argv: list[str] | None = None) -> int:
    """Run every round and write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="every system measured once per round, rotated order")
    parser.add_argument("--concurrency", type=int, default=16, help="closed loop: concurrent streams")
    parser.add_argument("--closed-requests", type=int, default=128, help="closed loop: requests per measurement")
    parser.add_argument("--rate", type=float, default=5.0, help="open loop: Poisson arrivals per second")
    parser.add_argument("--open-requests", type=int, default=48, help="open loop: requests per measurement")
    parser.add_argument("--open-clients", type=int, default=8, help="open loop: gRPC streams the requests share")
    parser.add_argument("--modes", default="closed,open", help="closed, open or both")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--static-delay-us", type=int, default=1000,
                        help="static: Triton's max_queue_delay_microseconds")
    parser.add_argument("--deadline-s", type=float, default=240.0, help="most seconds one measurement may take")
    parser.add_argument("--price-per-hour", type=float, default=0.10, help="instance price, for $/1M tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 round, fewer requests: a check, not a report")
    parser.add_argument("--run", default=None, help="report name (default generate-<YYYYMMDD>, -quick with --quick)")
    parser.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.closed_requests, args.open_requests = 1, 32, 12
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    args.run = args.run or f"generate-{day}{'-quick' if args.quick else ''}"
    systems = args.systems.split(",")
    modes = args.modes.split(",")
    if sorted(set(systems) - set(SYSTEMS)) or sorted(set(modes) - set(MODES)):
        parser.error(f"systems are {', '.join(SYSTEMS)}; modes are {', '.join(MODES)}")
    if not (TINYLM / "1" / "hf" / "tokenizer.json").is_file():
        parser.error(f"{TINYLM / '1' / 'hf'} is not built: run `coalesce prepare --model-repository tests/models` "
                     "(make setup-dev does)")

    import tritonclient.http as httpclient
    from tokenizers import Tokenizer

    from coalesce_tools.launcher import ServerOptions, TritonServer

    tokenizer = Tokenizer.from_file(str(TINYLM / "1" / "hf" / "tokenizer.json"))

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids) if text else 0

    words = prose_words()
    # Both traces from one seed: the same prompts and lengths for every system and round.
    closed_trace = make_trace(args.closed_requests, rate_per_s=args.rate, seed=args.seed, count_tokens=count_tokens,
                              words=words)
    open_trace = make_trace(args.open_requests, rate_per_s=args.rate, seed=args.seed + 1, count_tokens=count_tokens,
                            words=words)
    raw_dir = args.out / "raw" / args.run
    workdir = Path(tempfile.mkdtemp(prefix="coalesce-generate-"))
    repo = build_repository(workdir / "repo", static_delay_us=args.static_delay_us)
    options = ServerOptions.on_free_ports(repo, model_control="explicit", load_models=(MODELS[systems[0]],))
    points: list[dict[str, Any]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    with TritonServer(options) as server:
        admin = httpclient.InferenceServerClient(server.http_url)
        headers = server.admin_headers or None
        loaded: str | None = MODELS[systems[0]]
        try:
            for round_index in range(args.rounds):
                order = systems[round_index % len(systems):] + systems[:round_index % len(systems)]
                for position, system in enumerate(order):
                    model = MODELS[system]
                    loaded_at = time.perf_counter()
                    if loaded != model:
                        admin.load_model(model, headers=headers)
                    loaded = None
                    sys.stderr.write(f"bench-generate: round {round_index} {system} loaded in "
                                     f"{time.perf_counter() - loaded_at:.1f} s\n")
                    batched = system == "static"
                    warm_up(server.grpc_url, model, batched=batched)
                    time.sleep(1.5)  # the warm-up's tokens reach the backend's counter before it is read
                    for mode in modes:
                        before = tokens_counter(server.metrics_url, model)
                        stats_before = executions(admin, model, headers)
                        if mode == "closed":
                            records, wall = run_closed(server.grpc_url, model, closed_trace,
                                                       concurrency=args.concurrency, batched=batched,
                                                       deadline_s=args.deadline_s)
                        else:
                            records, wall = run_open(server.grpc_url, model, open_trace, clients=args.open_clients,
                                                     batched=batched, deadline_s=args.deadline_s)
                        time.sleep(1.5)  # the backend's metrics thread publishes the last counts
                        backend = tokens_counter(server.metrics_url, model) - before
                        requests, calls = (a - b for a, b in zip(executions(admin, model, headers), stats_before,
                                                                 strict=True))
                        for r in records:
                            r.retokenised = count_tokens(r.text)
                        write_raw(raw_dir / f"r{round_index}-{system}-{mode}.csv", records,
                                  from_arrival=mode == "open")
                        point = {"round": round_index, "order": position, "system": system, "mode": mode,
                                 **summarize(records, wall_s=wall, from_arrival=mode == "open",
                                             price_per_hour=args.price_per_hour),
                                 "backend_tokens": backend, "triton_executions": calls,
                                 "avg_batch": requests / calls if calls else None,
                                 "retokenised_tokens": sum(r.retokenised for r in records if r.ok)}
                        points.append(point)
                        sys.stderr.write(
                            f"bench-generate: round {round_index} {system} {mode}: {point['tokens_per_s']:.1f} tok/s "
                            f"in {wall:.1f} s, TTFT p50/p99 {_fmt(point['ttft_p50_ms'])}/{_fmt(point['ttft_p99_ms'])}"
                            f" ms, ITL p50/p99 {_fmt(point['itl_p50_ms'])}/{_fmt(point['itl_p99_ms'])} ms, "
                            f"{point['errors']} errors, backend tokens {backend:.0f} of "
                            f"{point['generated_tokens']}\n")
                    admin.unload_model(model, headers=headers)
                    while admin.is_model_ready(model, headers=headers):
                        time.sleep(0.2)
        except Exception:
            sys.stderr.write(f"bench-generate: failed; tritonserver pid {server.pid}, last log lines:\n"
                             f"{server.log_tail(80)}\n")
            raise
        finally:
            admin.close()
    shutil.rmtree(workdir, ignore_errors=True)
    costs = step_costs()

    ratios = ratio_rows(points)
    closed_row = next((r for r in ratios if r["mode"] == "closed"), None)
    prompt_lengths = sorted(t.prompt_tokens for t in closed_trace)
    run: dict[str, Any] = {
        "run": args.run, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} cores, no GPU, torch CPU (tinylm: 4 layers, hidden 256, 3.9 M parameters, "
                   "random weights); shared and noisy",
        "command": ("make bench-generate  # python -m perf.generate "
                    + " ".join(argv if argv is not None else sys.argv[1:])).strip(),
        "trace": f"seed {args.seed}; prompts {prompt_lengths[0]}-{prompt_lengths[-1]} tokens (log-uniform 8-200, "
                 "English prose from Python's docs, 25% behind a shared 48-token prefix), max_tokens uniform "
                 "8-128, temperature 0, ignore_eos, stream over gRPC (one stream per client)",
        "systems_note": f"continuous = tinylm as shipped (max_active_sequences 64); static = max_batch_size "
                        f"{STATIC_BATCH} + dynamic_batching (max_queue_delay {args.static_delay_us} us), "
                        f"generation_batching request, max_active_sequences {STATIC_BATCH}; single = "
                        "generation_batching request, max_active_sequences 1; all else as shipped (intra_op_threads "
                        "1, prefix cache on)",
        "tokens_note": "generated tokens of a request = its max_tokens (ignore_eos; prompts + max_tokens stay under "
                       "the 1024-token context), checked against the backend's coalesce_generate_tokens_total "
                       "counter around each measurement (last column below); tokens/s = generated tokens / wall time "
                       "from the run's start to its last final response. The client also re-tokenises each "
                       "generated text (`tokenizer.json`, no special tokens): raw CSVs and JSON "
                       "(`retokenised_tokens`), fewer than generated where BPE merges adjacent tokens",
        "itl_note": "gaps between consecutive streamed responses that carry text (each is one decoding step, one "
                    "token; a step whose token completes no character sends nothing, so a gap may span two steps)",
        "rounds": args.rounds, "concurrency": args.concurrency, "rate_per_s": args.rate,
        "closed_requests": args.closed_requests, "open_requests": args.open_requests,
        "price_per_hour": args.price_per_hour, "points": points, "ratios": ratios,
        "targets": targets(closed_row) if closed_row else [],
        "step_costs": costs,
    }
    run["discussion"] = discussion(run)
    image = plot(run, args.out / f"{args.run}.png")
    run["plots"] = [str(image.relative_to(ROOT)) if image.is_relative_to(ROOT) else str(image)]
    write_summary(args.out, args.run, run, markdown(run))
    sys.stderr.write(f"bench-generate: wrote {args.out / args.run}.md\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
