"""A local cluster (``coalesce cluster``): haproxy in front of tritonserver replicas sharing one Redis.

The configuration test runs with the integration tests. The cluster test is slow (about two
minutes on 2 cores) and runs only when asked: ``pytest -m slow tests/integration/test_cluster.py``
or ``make cluster-test``, which records its result in the Markdown
file ``CLUSTER_REPORT`` names (``perf/results/cluster-<date>.md``).

The cluster test, on real processes only: two replicas of ``minilm`` (FP32, so every vector
can be held to sentence-transformers' reference) behind haproxy, a redis-server wanting a
password, and four client threads of ``coalesce_client`` (two gRPC, two HTTP, each with a
``RetryPolicy``) sending 1 to 5 texts per call through the balancer: texts of a pool that
repeat, and one never sent before in every third call. One replica's tritonserver is
SIGKILLed mid-run; every call must still succeed with the right vectors, while the cluster
starts that replica again and the balancer takes it back. Then a further replica joins, and
its first request, of rows the others computed, must be answered from Redis.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import random
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from coalesce_client import ClientError, EmbeddingClient, RetryPolicy
from coalesce_tools.cluster import (
    GRPC_BACKEND,
    HTTP_BACKEND,
    BalancerOptions,
    Cluster,
    ClusterError,
    ClusterOptions,
    ReplicaPorts,
    check_haproxy_config,
    haproxy_config,
)
from coalesce_tools.launcher import free_port
from perf import workloads
from tests.conftest import REPOSITORY, built
from tests.integration.test_cache import metric, settled_metric, wait_for

pytestmark = pytest.mark.integration

MODEL = "minilm"
#: Texts that repeat (the pool every call draws from), and texts sent once each (one in every third call).
REPEATED, FRESH = 200, 2000
THREADS = ("grpc", "http", "grpc", "http")
#: Pause of each client thread between two calls: a steady load two cores can serve while the test watches.
PAUSE_S = 0.02
#: Rows of the late replica's first request: texts the others answered before.
LATE_ROWS = 48
RETRY = {"max_attempts": 10, "base_delay_s": 0.05, "max_delay_s": 1.0}
#: The embedding contract: cosine with sentence-transformers (FP32); between two answers for one text.
MIN_COSINE_REFERENCE = 0.999
MIN_COSINE_AGREE = 0.99999


def test_the_generated_haproxy_config_is_valid_for_haproxy(tmp_path):
    replicas = {f"r{i}": ReplicaPorts.numbered(i, 8100) for i in range(3)}
    path = tmp_path / "haproxy.cfg"
    path.write_text(haproxy_config(replicas, BalancerOptions(host="0.0.0.0", check_interval_ms=200)))
    check_haproxy_config(path)
    # And haproxy's own message when it refuses one.
    path.write_text(path.read_text() + "    server r9 127.0.0.1:1 track http_replicas/nobody\n")
    with pytest.raises(ClusterError, match="nobody"):
        check_haproxy_config(path)


@dataclasses.dataclass(frozen=True)
class CountingRetry(RetryPolicy):
    """``RetryPolicy`` that also records each retry it grants (the error's type), for the report."""

    granted: list[str] = dataclasses.field(default_factory=list, compare=False, hash=False)
    _error: threading.local = dataclasses.field(default_factory=threading.local, compare=False, hash=False)

    def retries(self, error: ClientError) -> bool:  # type: ignore[override]
        self._error.last = f"{type(error).__name__}: {str(error)[:160]}"
        return RetryPolicy.retries(error)

    def pause_s(self, attempt, remaining_s, uniform=random.random):
        pause = super().pause_s(attempt, remaining_s, uniform)
        if pause is not None:
            self.granted.append(getattr(self._error, "last", "?"))
        return pause


class Traffic:
    """Client threads calling the balancer until stopped; every answer checked against the reference."""

    def __init__(
        self,
        cluster: Cluster,
        texts: list[str],
        reference: dict[str, np.ndarray],
        *,
        seed: int,
        fresh: list[str] | None = None,
    ) -> None:
        assert cluster.balancer is not None
        self.urls = {"grpc": cluster.balancer.grpc_url, "http": cluster.balancer.http_url}
        self.texts, self.reference = texts, reference
        self.fresh = list(fresh or [])
        self.seed = seed
        self.retries = {protocol: CountingRetry(**RETRY) for protocol in self.urls}
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.calls = {protocol: 0 for protocol in self.urls}
        self.failures: list[str] = []
        self.wrong: list[str] = []
        #: (protocol, start, end) of every successful call, on time.monotonic().
        self.timings: list[tuple[str, float, float]] = []
        self.first_answer: dict[str, np.ndarray] = {}
        self.min_cosine_reference = 1.0
        self.min_cosine_agree = 1.0
        self.threads = [
            threading.Thread(target=self._run, args=(protocol, n), name=f"traffic-{protocol}-{n}")
            for n, protocol in enumerate(THREADS)
        ]

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def _next_fresh(self) -> str | None:
        with self.lock:
            return self.fresh.pop() if self.fresh else None

    def _check(self, texts: list[str], vectors: np.ndarray) -> None:
        want = np.stack([self.reference[t] for t in texts])
        cosine = (vectors * want).sum(axis=1)
        with self.lock:
            self.min_cosine_reference = min(self.min_cosine_reference, float(cosine.min()))
            if vectors.shape != (len(texts), 384) or cosine.min() < MIN_COSINE_REFERENCE:
                self.wrong.append(f"{texts}: shape {vectors.shape}, cosine with the reference {cosine.tolist()}")
            for text, vector in zip(texts, vectors, strict=True):
                first = self.first_answer.setdefault(text, vector)
                agree = float(np.dot(first, vector))
                self.min_cosine_agree = min(self.min_cosine_agree, agree)
                if agree < MIN_COSINE_AGREE:
                    self.wrong.append(f"{text!r}: cosine {agree} with its first answer")

    def _run(self, protocol: str, n: int) -> None:
        rng = random.Random(self.seed * 100 + n)
        with EmbeddingClient(
            self.urls[protocol], protocol=protocol, model=MODEL, timeout_s=60.0, retry=self.retries[protocol]
        ) as client:
            i = 0
            while not self.stop_event.is_set():
                texts = rng.sample(self.texts, rng.randint(1, 4))
                fresh = self._next_fresh() if i % 3 == 0 else None
                if fresh is not None:
                    texts.append(fresh)
                started = time.monotonic()
                try:
                    vectors = client.embed(texts)
                except Exception as exc:  # every failure is a finding: none is expected
                    with self.lock:
                        self.failures.append(f"{protocol}: {type(exc).__name__}: {exc}")
                else:
                    ended = time.monotonic()
                    self._check(texts, vectors)
                    with self.lock:
                        self.calls[protocol] += 1
                        self.timings.append((protocol, started, ended))
                i += 1
                self.stop_event.wait(PAUSE_S)

    def start(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in self.threads), "a client thread hung"


def served(cluster: Cluster) -> dict[tuple[str, str], int]:
    """Requests each replica answered with 2xx through each backend, per haproxy: {(backend, replica): count}."""
    assert cluster.balancer is not None
    return {
        (row["pxname"], row["svname"]): int(row["hrsp_2xx"] or 0)
        for row in cluster.balancer.stats()
        if row["pxname"] in (HTTP_BACKEND, GRPC_BACKEND)
    }


def replica_counters(replica) -> dict[str, float]:
    names = (
        "coalesce_shared_cache_hits_total",
        "coalesce_shared_cache_misses_total",
        "coalesce_cache_hits_total",
        "coalesce_rows_total",
    )
    return {name: metric(replica, name, MODEL) for name in names}


@pytest.fixture(scope="module")
def pools():
    texts = workloads.queries(REPEATED + FRESH, seed=20261205)
    return texts[:REPEATED], texts[REPEATED:]


@pytest.fixture(scope="module")
def reference(pools, reference_model):
    texts = pools[0] + pools[1]
    vectors = reference_model.encode(texts, normalize_embeddings=True, batch_size=64)
    return dict(zip(texts, np.asarray(vectors, dtype=np.float32), strict=True))


@pytest.fixture(scope="module")
def cluster(reference):
    built(MODEL)
    options = ClusterOptions(
        model_repository=REPOSITORY,
        replicas=2,
        replica_port_base=0,
        load_models=(MODEL,),
        # FP32: every vector held to sentence-transformers at MIN_COSINE_REFERENCE and the replicas to each
        # other at MIN_COSINE_AGREE; INT8 vectors shift with their pass's neighbours (perf/results/int8-*.md).
        parameters={"precision": "fp32"},
        balancer=BalancerOptions(http_port=free_port(), grpc_port=free_port(), stats_port=free_port()),
    )
    lines: list[str] = []
    started = time.monotonic()
    running = Cluster(options, log=lambda line: lines.append(f"{time.monotonic() - started:7.2f} s  {line}"))
    running.start()
    running.lines = lines  # type: ignore[attr-defined]
    running.start_s = time.monotonic() - started  # type: ignore[attr-defined]
    yield running
    running.stop()


def diagnostics(cluster: Cluster) -> str:
    assert cluster.balancer is not None
    return (
        "\ncluster:\n"
        + "\n".join(cluster.lines)  # type: ignore[attr-defined]
        + f"\nhaproxy:\n{cluster.balancer.log_tail()}\n"
        + "\n".join(f"{r.name}:\n{r.server.log_tail(20)}" for r in cluster.replicas)
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_calls_through_the_balancer_survive_a_killed_replica_and_a_late_one_starts_warm(cluster, pools, reference):
    import redis

    assert cluster.balancer is not None and cluster.redis is not None
    balancer = cluster.balancer
    began = time.monotonic()
    wall_start = datetime.datetime.now(datetime.timezone.utc)
    victim = cluster.replicas[0]
    traffic = Traffic(cluster, pools[0], reference, seed=1, fresh=pools[1]).start()
    try:
        # 1. Both replicas answer, over both protocols.
        assert wait_for(lambda: traffic.total >= 500 and all(v > 0 for v in served(cluster).values()), 120), (
            f"traffic did not reach both replicas: {served(cluster)}, {traffic.calls}" + diagnostics(cluster)
        )
        # 2. One replica's server is killed mid-run.
        calls_at_kill = traffic.total
        killed_pid = victim.server.pid
        assert killed_pid is not None
        killed_at = time.monotonic()
        os.kill(killed_pid, signal.SIGKILL)
        balancer.wait_until(lambda states: states.get(victim.name, "").startswith("DOWN"), timeout_s=30)
        down_at = time.monotonic()
        calls_at_down = traffic.total
        assert wait_for(lambda: traffic.total >= calls_at_down + 100, 60), "calls stopped after the kill"
        # 3. The cluster starts it again; the balancer takes it back; it answers again.
        balancer.wait_until(lambda states: states.get(victim.name) == "UP", timeout_s=300)
        up_at = time.monotonic()
        calls_while_out = traffic.total - calls_at_kill
        before = served(cluster)
        assert wait_for(
            lambda: all(
                served(cluster)[(b, victim.name)] >= before[(b, victim.name)] + 20 for b in (HTTP_BACKEND, GRPC_BACKEND)
            ),
            60,
        ), "the restarted replica got no traffic" + diagnostics(cluster)
    finally:
        traffic.stop()
    stats_phase1 = {(row["pxname"], row["svname"]): row for row in balancer.stats()}
    assert traffic.failures == [], f"{len(traffic.failures)} calls failed: {traffic.failures[:5]}" + diagnostics(
        cluster
    )
    assert traffic.wrong == [], traffic.wrong[:5]
    assert victim.server.pid not in (None, killed_pid) and victim.restarts == 1
    restarted = replica_counters(victim)

    # 4. A further replica: its first request, of rows the others answered, comes from Redis.
    store = redis.Redis.from_url(cluster.redis.url, password=cluster.redis_password)
    try:
        # Every row answered is in Redis once the replicas' background writers have caught up.
        assert wait_for(lambda: store.dbsize() >= len(traffic.first_answer), 30), (
            f"Redis holds {store.dbsize()} rows of {len(traffic.first_answer)}"
        )
        keys_in_redis = int(store.dbsize())
    finally:
        store.close()
    seen = sorted(set(pools[0]) & set(traffic.first_answer))
    assert len(seen) >= LATE_ROWS
    late_rows = random.Random(7).sample(seen, LATE_ROWS)
    added_at = time.monotonic()
    late = cluster.add_replica()
    late_start_s = time.monotonic() - added_at
    assert replica_counters(late)["coalesce_rows_total"] == 0  # nothing reached it yet
    with EmbeddingClient(late.grpc_url, model=MODEL, retry=RetryPolicy(max_attempts=1)) as client:
        vectors = client.embed(late_rows)
    hits = settled_metric(late, "coalesce_shared_cache_hits_total", MODEL, lambda v: v >= LATE_ROWS)
    late_counts = replica_counters(late)
    assert hits == LATE_ROWS and late_counts["coalesce_shared_cache_misses_total"] == 0, late_counts
    cosine = (vectors * np.stack([traffic.first_answer[t] for t in late_rows])).sum(axis=1)
    assert cosine.min() >= MIN_COSINE_AGREE

    # 5. Through the balancer, the late replica takes its share too.
    after = Traffic(cluster, pools[0], reference, seed=2).start()
    try:
        assert wait_for(
            lambda: (
                all(served(cluster).get((b, late.name), 0) > 0 for b in (HTTP_BACKEND, GRPC_BACKEND))
                and after.total >= 200
            ),
            60,
        ), "the late replica got no traffic" + diagnostics(cluster)
    finally:
        after.stop()
    assert after.failures == [] and after.wrong == [], (after.failures[:5], after.wrong[:5])
    late_after = replica_counters(late)

    report = os.environ.get("CLUSTER_REPORT")
    if report:
        durations = sorted(end - start for _, start, end in traffic.timings)
        overlapping = [end - start for _, start, end in traffic.timings if start <= up_at and end >= killed_at]
        write_report(
            Path(report),
            {
                "wall_start": wall_start,
                "wall_end": datetime.datetime.now(datetime.timezone.utc),
                "cluster": cluster,
                "traffic": traffic,
                "after": after,
                "stats": stats_phase1,
                "start_s": cluster.start_s,
                "test_s": time.monotonic() - began,  # type: ignore[attr-defined]
                "down_s": down_at - killed_at,
                "up_s": up_at - killed_at,
                "calls_while_out": calls_while_out,
                "p50_ms": 1000 * statistics.median(durations),
                "p99_ms": 1000 * durations[int(0.99 * len(durations))],
                "max_overlap_ms": 1000 * max(overlapping),
                "overlapping": len(overlapping),
                "restarted": restarted,
                "late_start_s": late_start_s,
                "late_hits": hits,
                "late_counts": late_counts,
                "late_after": late_after,
                "keys_in_redis": keys_in_redis,
                "late_cosine": float(cosine.min()),
            },
        )


def _version(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.splitlines()[0].strip()
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "unknown"


def _calls_row(label: str, traffic: Traffic, protocol: str) -> str:
    failed = sum(1 for f in traffic.failures if f.startswith(protocol))
    retried = len(traffic.retries[protocol].granted)
    return f"| {label} | {traffic.calls[protocol] + failed} | {traffic.calls[protocol]} | {failed} | {retried} |"


def write_report(path: Path, r: dict) -> None:
    """The run in Markdown: what ran, calls made/succeeded/retried, time to recover, the late replica's Redis hits."""
    traffic, after, stats = r["traffic"], r["after"], r["stats"]
    kinds: dict[str, int] = {}
    for policy in [*traffic.retries.values(), *after.retries.values()]:
        for entry in policy.granted:
            kinds[entry.split(":")[0]] = kinds.get(entry.split(":")[0], 0) + 1

    def stat(backend: str, server: str, field: str) -> str:
        return stats.get((backend, server), {}).get(field) or "0"

    restarted, late, late_after = r["restarted"], r["late_counts"], r["late_after"]
    lines = [
        f"# Cluster {r['wall_start']:%Y%m%d} ({r['wall_start']:%H:%M}-{r['wall_end']:%H:%M} UTC)",
        "",
        f"- machine: {os.cpu_count()} cores, {platform.machine()}, no GPU; {_version(['haproxy', '-v'])}; "
        f"{_version(['redis-server', '--version'])}",
        "- command: `make cluster-test` (`pytest -m slow -s tests/integration/test_cluster.py`), "
        f"{r['test_s']:.0f} s after a cluster start of {r['start_s']:.1f} s",
        f"- cluster (`coalesce_tools.cluster.Cluster`, as `make cluster` runs it, on free ports): 2 replicas of "
        f"`{MODEL}` (its shipped config with `precision: fp32`: 64 MiB row cache in process, plus the shared tier "
        "in the cluster's redis-server, which wants a password); haproxy in front: HTTP/1.1 and gRPC (h2c), a "
        "health check of each replica's supervisor `/ready` every 500 ms (fall 2, rise 2), `retry-on conn-failure "
        "empty-response junk-response 503`, `retries 3`, `option redispatch 1`",
        f"- traffic: {len(THREADS)} threads of `coalesce_client.EmbeddingClient` ({THREADS.count('grpc')} gRPC, "
        f"{THREADS.count('http')} HTTP) through the balancer, each with "
        f"`RetryPolicy({', '.join(f'{k}={v}' for k, v in RETRY.items())})` and {PAUSE_S * 1000:.0f} ms between "
        f"calls; a call is 1-4 texts of a pool of {REPEATED}, plus one never sent before (of {FRESH}) in every "
        "third call; every vector is checked against sentence-transformers' (cosine >= "
        f"{MIN_COSINE_REFERENCE}) and against the first answer for its text (>= {MIN_COSINE_AGREE})",
        "- the run: both replicas answer; r0's tritonserver is SIGKILLed; the cluster starts it again and the "
        "balancer takes it back; traffic stops once r0 has answered 20 more requests per protocol; a third "
        "replica, r2, joins (haproxy reloaded); its first request goes to it directly; a second round of traffic "
        "through the balancer",
        "",
        "| calls through the balancer | made | succeeded | failed | retried by the client |",
        "| --- | --- | --- | --- | --- |",
        _calls_row("gRPC, across the kill and the restart", traffic, "grpc"),
        _calls_row("HTTP, across the kill and the restart", traffic, "http"),
        _calls_row("gRPC, after r2 joined", after, "grpc"),
        _calls_row("HTTP, after r2 joined", after, "http"),
        "",
        "Client retries by error: "
        + (
            ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
            or "none: the balancer sent every request the killed replica refused or dropped "
            "to the other replica itself (wredis below)"
        )
        + ".",
        f"Vectors: lowest cosine with sentence-transformers "
        f"{min(traffic.min_cosine_reference, after.min_cosine_reference):.7f}, lowest between two answers for one "
        f"text {min(traffic.min_cosine_agree, after.min_cosine_agree):.7f}.",
        "",
        "| haproxy, across the kill and the restart | HTTP backend | gRPC backend |",
        "| --- | --- | --- |",
        *(
            f"| requests answered 2xx by {name} | {stat(HTTP_BACKEND, name, 'hrsp_2xx')} | "
            f"{stat(GRPC_BACKEND, name, 'hrsp_2xx')} |"
            for name in ("r0", "r1")
        ),
        f"| requests sent again (wretr) | {stat(HTTP_BACKEND, 'BACKEND', 'wretr')} | "
        f"{stat(GRPC_BACKEND, 'BACKEND', 'wretr')} |",
        f"| ... to another replica (wredis) | {stat(HTTP_BACKEND, 'BACKEND', 'wredis')} | "
        f"{stat(GRPC_BACKEND, 'BACKEND', 'wredis')} |",
        f"| 5xx answered to clients | {stat(HTTP_BACKEND, 'BACKEND', 'hrsp_5xx')} | "
        f"{stat(GRPC_BACKEND, 'BACKEND', 'hrsp_5xx')} |",
        "",
        "Recovery:",
        "",
        f"- the balancer took r0 out {r['down_s']:.2f} s after the kill;",
        f"- the cluster had r0 serving again and the balancer took it back {r['up_s']:.1f} s after the kill; "
        f"{r['calls_while_out']} calls were answered in between;",
        f"- the {r['overlapping']} calls made in that window (or under way at its start) took at most "
        f"{r['max_overlap_ms']:.0f} ms; all calls of the first round: p50 {r['p50_ms']:.1f} ms, p99 "
        f"{r['p99_ms']:.1f} ms;",
        f"- the restarted r0 (empty in-process cache) answered {restarted['coalesce_shared_cache_hits_total']:.0f} "
        f"rows from Redis and missed {restarted['coalesce_shared_cache_misses_total']:.0f} there.",
        "",
        "The late replica r2:",
        "",
        f"- started and taken in by the balancer {r['late_start_s']:.1f} s after it was asked for; Redis held "
        f"{r['keys_in_redis']} rows;",
        f"- its first request, {LATE_ROWS} rows r0 and r1 had answered, sent to it directly over gRPC: "
        f"{r['late_hits']:.0f} answered from Redis (`coalesce_shared_cache_hits_total`), "
        f"{late['coalesce_shared_cache_misses_total']:.0f} missed; lowest cosine with the first answers "
        f"{r['late_cosine']:.7f};",
        f"- then through the balancer it answered {late_after['coalesce_rows_total'] - late['coalesce_rows_total']:.0f}"
        f" rows, {late_after['coalesce_shared_cache_hits_total'] - late['coalesce_shared_cache_hits_total']:.0f} of "
        f"them from Redis and "
        f"{late_after['coalesce_cache_hits_total'] - late['coalesce_cache_hits_total']:.0f} from its own cache.",
        "",
        "The cluster's own log:",
        "",
        "```",
        *(line.split(" (password in ")[0] if "password in" in line else line for line in r["cluster"].lines),
        "```",
    ]
    path.write_text("\n".join(lines) + "\n")
