r"""Locust load test for a Coalesce model: gRPC and HTTP users built on ``coalesce_client``.

Run headless (``make load`` does this for every shape and protocol and writes a report)::

    locust -f perf/locustfile.py --headless GrpcEmbeddingUser --pool 32 \\
        --shape poisson --rate 100 --duration-s 30 --grpc-url 127.0.0.1:8001 \\
        --csv perf/results/load/poisson-grpc --html perf/results/load/poisson-grpc.html

Users are a fixed pool (``--pool``, which bounds the requests in flight) that take their
send times in turn from one seeded schedule of arrivals drawn from the shape
(``perf/loadshapes.py``: steady, poisson, burst, ramp). Each request embeds one text
from a seeded workload (``perf/workloads.py``). Locust runs on
gevent: tritonclient's HTTP client is geventhttpclient, and grpcio is switched to its
gevent mode before any channel opens, so both cooperate with Locust's scheduler.

At the end the run reads Triton's statistics for the model and checks that the server
saw exactly the requests Locust counted (successes as ``inference_count``, failures as
the model's failed inferences); a mismatch, or any failed request, makes the exit code 1.
The comparison is written to ``<csv prefix>_triton.json``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import gevent
import grpc.experimental.gevent
from locust import LoadTestShape, User, events, task
from locust.env import Environment

from coalesce_client.client import EmbeddingClient
from coalesce_client.errors import ClientError, RequestRejectedError
from coalesce_client.load import model_statistics
from perf import workloads
from perf.loadshapes import SHAPES, Shape
from perf.outcomes import Outcome, assign_tenants, parse_shares, summarize_outcomes

# grpcio blocks the whole process unless told to yield to gevent; must run before any channel opens.
grpc.experimental.gevent.init_gevent()

SETTLE_S = 5.0


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("coalesce")
    group.add_argument("--shape", choices=SHAPES, default="steady", help="arrival-rate shape")
    group.add_argument("--pool", type=int, default=32, help="users in the pool: the most requests in flight")
    group.add_argument("--rate", type=float, default=50.0, help="requests/s (mean, base or final, by shape)")
    group.add_argument("--duration-s", type=float, default=30.0, help="length of the run")
    group.add_argument("--burst-factor", type=float, default=4.0)
    group.add_argument("--burst-s", type=float, default=2.0)
    group.add_argument("--period-s", type=float, default=10.0)
    group.add_argument("--profile", choices=workloads.PROFILES, default="queries", help="workload profile")
    group.add_argument("--texts", type=int, default=3000, help="distinct texts in the workload")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--model", default="minilm")
    group.add_argument("--grpc-url", default="127.0.0.1:8001", help="gRPC host:port (also read for statistics)")
    group.add_argument("--http-url", default="127.0.0.1:8000", help="HTTP host:port")
    group.add_argument("--timeout-s", type=float, default=30.0, help="limit of each request")
    group.add_argument("--tenants", default="",
                       help="'name:share,...': each arrival belongs to a tenant drawn by share (seeded), sent as "
                            "request parameter 'tenant'; empty: no tenant parameter")
    group.add_argument("--target-ms", type=float, default=0.0,
                       help="latency target: the report counts goodput (answers within it per second); 0: none")
    group.add_argument("--allow-rejections", action="store_true",
                       help="UNAVAILABLE refusals (admission control) do not fail the run; they are counted")


def shape_of(options: Any) -> Shape:
    """The ``Shape`` the command line asks for."""
    return Shape(options.shape, rate_per_s=options.rate, duration_s=options.duration_s,
                 burst_factor=options.burst_factor, burst_s=options.burst_s, period_s=options.period_s)


@dataclasses.dataclass
class RunState:
    """What all users of this process share: the workload, the shape, the clock and the counts before."""

    texts: list[str] = dataclasses.field(default_factory=list)
    shape: Shape | None = None
    started: float = 0.0
    before: tuple[int, int] = (0, 0)
    next_text: int = 0
    arrivals: list[float] = dataclasses.field(default_factory=list)
    tenants: list[str] = dataclasses.field(default_factory=list)
    next_arrival: int = 0
    answered: int = 0

    def take_arrival(self) -> tuple[float, str] | None:
        """The next unclaimed arrival (s from the start, tenant), or None when the schedule is used up."""
        if self.next_arrival >= len(self.arrivals):
            return None
        self.next_arrival += 1
        index = self.next_arrival - 1
        return self.arrivals[index], self.tenants[index] if self.tenants else ""


#: Every request's outcome, for goodput and per-tenant figures.
_OUTCOMES: list[Outcome] = []


_Run = RunState()
#: How late each request was sent after its scheduled arrival (s): > 0 when no user was free.
_LATE_S: list[float] = []


#: Latencies (ms) of the requests sent in each second of the run, for the timeline.
_TIMELINE: dict[int, list[float]] = {}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timeline() -> list[dict[str, float]]:
    """Per second of the run: arrivals offered, requests sent, their p50 and p99 latency (ms)."""
    offered: dict[int, int] = {}
    for t_s in _Run.arrivals:
        offered[int(t_s)] = offered.get(int(t_s), 0) + 1
    rows = []
    for second in range(max([*offered, *_TIMELINE, 0]) + 1):
        latencies = _TIMELINE.get(second, [])
        rows.append({"t_s": second, "offered": offered.get(second, 0), "sent": len(latencies),
                     "p50_ms": round(_percentile(latencies, 0.5), 2) if latencies else 0.0,
                     "p99_ms": round(_percentile(latencies, 0.99), 2) if latencies else 0.0})
    return rows


def _late_p99() -> float:
    return round(_percentile(_LATE_S, 0.99), 4) if _LATE_S else 0.0


def options_of(environment: Environment) -> Any:
    """Locust's parsed command line (always there when Locust runs this file)."""
    if environment.parsed_options is None:
        raise RuntimeError("perf/locustfile.py must be run by locust (no parsed options)")
    return environment.parsed_options


@events.test_start.add_listener
def _start(environment: Environment, **_: Any) -> None:
    options = options_of(environment)
    _Run.texts = workloads.generate(options.profile, options.texts, options.seed)
    _Run.shape = shape_of(options)
    _Run.arrivals = _Run.shape.arrivals(options.seed)
    _Run.tenants = assign_tenants(len(_Run.arrivals), parse_shares(options.tenants), options.seed)
    _Run.next_arrival = _Run.next_text = _Run.answered = 0
    _LATE_S.clear()
    _TIMELINE.clear()
    _OUTCOMES.clear()
    try:
        _Run.before = _triton_counts(options)
    except Exception as exc:
        # No statistics, no count check: stop before sending anything, saying why.
        message = f"cannot read Triton's statistics for model '{options.model}' at {options.grpc_url}: {exc}"
        print(f"coalesce load: error: {message}", file=sys.stderr, flush=True)
        environment.process_exit_code = 2
        if environment.runner is not None:
            gevent.spawn(environment.runner.quit)
        _Run.arrivals = []
        return
    _Run.started = time.perf_counter()


def _triton_counts(options: Any) -> tuple[int, int]:
    """``(successful inferences, failed inferences)`` of the model, summed over versions."""
    totals = model_statistics(options.grpc_url, options.model)
    return totals["inference_count"], totals["failure_count"]


@events.test_stop.add_listener
def _stop(environment: Environment, **_: Any) -> None:
    options = options_of(environment)
    if environment.process_exit_code == 2:
        return  # the start failed and said why
    total = environment.stats.total
    sent_ok = total.num_requests - total.num_failures
    # Triton records an execution's statistics just after sending its responses: let them land.
    deadline = time.monotonic() + SETTLE_S
    while True:
        after = _triton_counts(options)
        seen_ok, seen_failed = after[0] - _Run.before[0], after[1] - _Run.before[1]
        if _counts_match(options, seen_ok, seen_failed, sent_ok, total.num_failures) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert _Run.shape is not None
    report = {
        "shape": _Run.shape.name, "rate_per_s": _Run.shape.rate_per_s, "duration_s": _Run.shape.duration_s,
        "users": options.pool, "profile": options.profile, "model": options.model,
        "offered_requests": len(_Run.arrivals), "late_s_p99": _late_p99(),
        "locust_requests": total.num_requests, "locust_failures": total.num_failures,
        "triton_inferences": seen_ok, "triton_failures": seen_failed,
        "counts_match": _counts_match(options, seen_ok, seen_failed, sent_ok, total.num_failures),
        "target_ms": options.target_ms,
        **summarize_outcomes(_OUTCOMES, _Run.shape.duration_s, options.target_ms),
        "timeline": timeline(),
    }
    prefix = getattr(options, "csv_prefix", None)
    if prefix:
        Path(f"{prefix}_triton.json").write_text(json.dumps(report, indent=2) + "\n")
    print("coalesce load: " + json.dumps({k: v for k, v in report.items() if k != "timeline"}), flush=True)
    unexpected = report["errors"] if options.allow_rejections else total.num_failures
    if not report["counts_match"] or unexpected:
        environment.process_exit_code = 1


def _counts_match(options: Any, seen_ok: int, seen_failed: int, sent_ok: int, sent_failed: int) -> bool:
    """Whether Triton saw what Locust sent.

    Triton 2.51 counts an error answered through a response sender (an adaptive model's
    refusal) as a successful inference, so with refusals allowed only the totals compare.
    """
    if options.allow_rejections:
        return seen_ok + seen_failed == sent_ok + sent_failed
    return (seen_ok, seen_failed) == (sent_ok, sent_failed)


class CoalesceShape(LoadTestShape):
    """Spawns the whole pool at once; ends the run once every scheduled arrival has been answered.

    (Or, at the latest, ``--timeout-s`` after the schedule's end, so a stalled server cannot hang it.)
    """

    def tick(self) -> tuple[int, float] | None:
        """``(users, spawn rate)`` while arrivals are outstanding, then None (stop)."""
        assert self.runner is not None
        options = options_of(self.runner.environment)
        if _Run.shape is not None and _Run.answered >= len(_Run.arrivals):
            return None
        if self.get_run_time() >= options.duration_s + options.timeout_s:
            return None
        return options.pool, float(options.pool)


class _EmbeddingUser(User):
    """One client; each task takes the next arrival, embeds the next text and reports to Locust."""

    abstract = True
    protocol = "grpc"

    def __init__(self, environment: Environment) -> None:
        """Open this user's client (lazily)."""
        super().__init__(environment)
        options = options_of(environment)
        self._url = options.grpc_url if self.protocol == "grpc" else options.http_url
        self._model, self._timeout_s = options.model, options.timeout_s
        self.clients: dict[str, EmbeddingClient] = {}
        self.arrival_s: float | None = None
        self.tenant = ""

    def client_for(self, tenant: str) -> EmbeddingClient:
        """This user's client for ``tenant`` (the tenant is a fixed request parameter of a client)."""
        client = self.clients.get(tenant)
        if client is None:
            client = self.clients[tenant] = EmbeddingClient(
                self._url, protocol=self.protocol, model=self._model, timeout_s=self._timeout_s,
                tenant=tenant or None)
        return client

    def _claim(self) -> None:
        claimed = _Run.take_arrival()
        self.arrival_s, self.tenant = claimed if claimed is not None else (None, "")

    def wait_time(self) -> float:
        """Until this user's claimed arrival (0 when it is already due or the schedule is used up)."""
        self._claim()
        if self.arrival_s is None:
            return 0.5  # nothing left to send; the shape stops the run at its next tick
        return max(0.0, self.arrival_s - (time.perf_counter() - _Run.started))

    def on_start(self) -> None:
        """Claim a first arrival and sleep until it."""
        self._claim()
        if self.arrival_s is not None:
            gevent.sleep(max(0.0, self.arrival_s - (time.perf_counter() - _Run.started)))

    @task
    def embed(self) -> None:
        """Embed one text at the claimed arrival and record the request's outcome and latency."""
        if self.arrival_s is None:
            return
        start = time.perf_counter()
        _LATE_S.append(start - _Run.started - self.arrival_s)
        text = _Run.texts[_Run.next_text % len(_Run.texts)]
        _Run.next_text += 1
        exception: Exception | None = None
        length = 0
        result = "ok"
        try:
            length = int(self.client_for(self.tenant).embed([text]).nbytes)
        except RequestRejectedError as exc:
            exception, result = exc, "rejected"
        except ClientError as exc:
            exception, result = exc, "error"
        assert _Run.shape is not None
        latency_ms = (time.perf_counter() - start) * 1000.0
        _OUTCOMES.append(Outcome(start - _Run.started, self.tenant, latency_ms, result))
        _TIMELINE.setdefault(int(start - _Run.started), []).append(latency_ms)
        self.environment.events.request.fire(
            request_type=self.protocol, name=f"embed {_Run.shape.name}", response_time=latency_ms,
            response_length=length, exception=exception, context={})
        _Run.answered += 1
        self.arrival_s = None

    def on_stop(self) -> None:
        """Close this user's connections."""
        for client in self.clients.values():
            client.close()


class GrpcEmbeddingUser(_EmbeddingUser):
    """Embeds over gRPC (``--grpc-url``)."""

    protocol = "grpc"


class HttpEmbeddingUser(_EmbeddingUser):
    """Embeds over HTTP (``--http-url``)."""

    protocol = "http"
