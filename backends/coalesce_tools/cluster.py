"""A local cluster: N ``tritonserver`` replicas of one repository, one shared Redis, haproxy in front.

``coalesce cluster --replicas 2`` (``make cluster REPLICAS=2``) starts, on this machine:

1. a ``redis-server`` (Debian's package) that wants a password, for the shared row-cache
   tier; the password and the tier's MAC secret are random per run (or taken from the
   environment, as ``coalesce serve`` does) and reach the servers as files named in their
   environment, never on a command line nor in a config;
2. a copy of the model repository in which every ``coalesce`` model of a row task
   (embedding, classify, tensor) has ``redis_url`` pointed at that Redis (other files linked);
3. N replicas: ``tritonserver`` through the launcher (``TritonServer``), each with its own
   ports and the launcher's supervisor, whose ``/ready`` (Triton ready and no model's stub
   dead) is what the balancer checks; a replica whose server exits is started again;
4. ``haproxy`` (Debian's package) in front: HTTP/1.1 and gRPC (HTTP/2 cleartext, balanced
   per call) on their own ports, health checks every ``check_interval_ms``, and a request
   that a replica refused or dropped without an answer sent again to another replica
   (``retry-on`` + ``option redispatch``); statistics and Prometheus metrics on a third port.

Replicas added later (``Cluster.add_replica``) join the balancer by a reload of its
configuration (haproxy's master re-reads it on SIGUSR2; connections in flight finish on
the old worker) and start warm: the rows any replica computed are in Redis.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import dataclasses
import io
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Final

from coalesce.settings import CacheOptions
from coalesce_tools.config import coalesce_models, model_config_text, parameter, read_model_config, with_parameters
from coalesce_tools.launcher import (
    LaunchError,
    RedisServer,
    ServerOptions,
    TritonServer,
    connect_host,
    free_port,
    set_parent_death_signal,
)
from coalesce_tools.supervisor import SupervisorOptions

#: Ports of the balancer unless told otherwise: the same as ``coalesce serve``'s, so clients need no change.
DEFAULT_HTTP_PORT: Final = 8000
DEFAULT_GRPC_PORT: Final = 8001
DEFAULT_STATS_PORT: Final = 8404
#: Replica ``i`` listens on ``base + PORT_STRIDE * i`` (HTTP), +1 (gRPC), +2 (metrics), +3 (health).
DEFAULT_REPLICA_PORT_BASE: Final = 8100
PORT_STRIDE: Final = 10
#: haproxy's names for the two backends (its statistics and logs use them).
HTTP_BACKEND: Final = "http_replicas"
GRPC_BACKEND: Final = "grpc_replicas"
#: The path the balancer's health check asks each replica's supervisor.
HEALTH_PATH: Final = "/ready"
LOG_TAIL_LINES: Final = 40


class ClusterError(LaunchError):
    """A part of the cluster could not be found, configured, started or made ready."""


@dataclasses.dataclass(frozen=True)
class ReplicaPorts:
    """The four ports of one replica: Triton's HTTP, gRPC and metrics, and its supervisor's health endpoint."""

    http: int
    grpc: int
    metrics: int
    health: int

    @classmethod
    def numbered(cls, index: int, base: int) -> ReplicaPorts:
        """Replica ``index``'s ports from ``base`` (``base + PORT_STRIDE * index`` and the next three)."""
        first = base + PORT_STRIDE * index
        if first < 1 or first + 3 > 65535:
            raise ClusterError(f"replica {index} would listen on ports {first}..{first + 3}: outside 1..65535 "
                               "(lower the port base or the replica count)")
        return cls(http=first, grpc=first + 1, metrics=first + 2, health=first + 3)

    @classmethod
    def free(cls) -> ReplicaPorts:
        """Four ports free on loopback right now."""
        return cls(http=free_port(), grpc=free_port(), metrics=free_port(), health=free_port())


@dataclasses.dataclass(frozen=True)
class BalancerOptions:
    """haproxy's listening address and ports, and how it checks replicas and retries requests.

    Attributes:
        host: Address the balancer binds (the replicas stay on loopback).
        http_port: HTTP/1.1 (Triton's KServe v2 REST API).
        grpc_port: gRPC, HTTP/2 cleartext.
        stats_port: haproxy's statistics page (``/stats``, ``/stats;csv``) and Prometheus metrics (``/metrics``).
        check_interval_ms: Milliseconds between two health checks of a replica.
        fall: Failed checks in a row that take a replica out.
        rise: Passed checks in a row that bring it back.
        retries: Times one request is sent again after a failure where the replica answered nothing.
        connect_timeout_ms: Most milliseconds a connection to a replica may take.
        server_timeout_s: Most seconds a replica may stay silent on a request (an inference under load).
        client_timeout_s: Most seconds a client connection may stay idle.
    """

    host: str = "127.0.0.1"
    http_port: int = DEFAULT_HTTP_PORT
    grpc_port: int = DEFAULT_GRPC_PORT
    stats_port: int = DEFAULT_STATS_PORT
    check_interval_ms: int = 500
    fall: int = 2
    rise: int = 2
    retries: int = 3
    connect_timeout_ms: int = 1000
    server_timeout_s: int = 120
    client_timeout_s: int = 300

    def __post_init__(self) -> None:
        """Reject values haproxy would refuse or that cannot work, naming them.

        Raises:
            ClusterError: On a port outside 1..65535, two equal ports, or a non-positive count or time.
        """
        ports = {"http_port": self.http_port, "grpc_port": self.grpc_port, "stats_port": self.stats_port}
        for name, port in ports.items():
            if not 1 <= port < 65536:
                raise ClusterError(f"balancer {name}={port}: outside 1..65535")
        if len(set(ports.values())) != len(ports):
            raise ClusterError(f"balancer ports must differ: {ports}")
        for name in ("check_interval_ms", "fall", "rise", "connect_timeout_ms", "server_timeout_s",
                     "client_timeout_s"):
            if getattr(self, name) < 1:
                raise ClusterError(f"balancer {name}={getattr(self, name)}: must be at least 1")
        if self.retries < 0:
            raise ClusterError(f"balancer retries={self.retries}: must be at least 0")


def haproxy_config(replicas: Mapping[str, ReplicaPorts], options: BalancerOptions) -> str:
    """The haproxy configuration for ``replicas`` (name to ports, in order) behind ``options``.

    One health check per replica: the HTTP backend's server asks the supervisor's
    ``/ready`` over HTTP/1.1, and the gRPC backend's server of the same replica tracks it, so
    both protocols take a replica out and bring it back together.
    """
    if not replicas:
        raise ClusterError("a balancer needs at least one replica")
    o = options
    lines = [
        "# Written by `coalesce cluster` (backends/coalesce_tools/cluster.py); regenerated on every start.",
        "global",
        # Logs (a replica going down or up among them) go to haproxy's standard output, which the cluster reads.
        "    log stdout format raw local0 info",
        "    maxconn 4096",
        # A reload's old worker keeps the connections it had; this bounds how long (gRPC channels stay open).
        "    hard-stop-after 30s",
        "",
        "defaults",
        "    mode http",
        "    log global",
        # Log what went wrong (a retry, a replica that dropped a request), not every request.
        "    option dontlognull",
        "    option httplog",
        "    option dontlog-normal",
        f"    timeout connect {o.connect_timeout_ms}ms",
        f"    timeout client {o.client_timeout_s}s",
        f"    timeout server {o.server_timeout_s}s",
        f"    timeout check {o.connect_timeout_ms}ms",
        # Inference is idempotent: a request that a replica refused (connection refused or reset), or dropped
        # without an answer (killed mid-request), or answered 503 (unavailable), goes to another replica.
        f"    retries {o.retries}",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response junk-response 503",
        "",
        "frontend http_in",
        f"    bind {o.host}:{o.http_port}",
        f"    default_backend {HTTP_BACKEND}",
        "",
        "frontend grpc_in",
        # gRPC is HTTP/2 in the clear (h2c with prior knowledge); each call is balanced on its own.
        f"    bind {o.host}:{o.grpc_port} proto h2",
        f"    default_backend {GRPC_BACKEND}",
        "",
        "frontend stats",
        f"    bind {o.host}:{o.stats_port}",
        "    stats enable",
        "    stats uri /stats",
        "    stats refresh 2s",
        "    http-request use-service prometheus-exporter if { path /metrics }",
        "",
        f"backend {HTTP_BACKEND}",
        "    balance roundrobin",
        "    option httpchk",
        f"    http-check send meth GET uri {HEALTH_PATH}",
        "    http-check expect status 200",
        f"    default-server inter {o.check_interval_ms}ms fall {o.fall} rise {o.rise}",
    ]
    lines += [f"    server {name} 127.0.0.1:{ports.http} check port {ports.health}" for name, ports in replicas.items()]
    lines += ["", f"backend {GRPC_BACKEND}", "    balance roundrobin"]
    lines += [f"    server {name} 127.0.0.1:{ports.grpc} proto h2 track {HTTP_BACKEND}/{name}"
              for name, ports in replicas.items()]
    return "\n".join(lines) + "\n"


def find_haproxy() -> str:
    """The ``haproxy`` binary.

    Raises:
        ClusterError: If it is not installed, saying how to install it.
    """
    binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not Path(binary).is_file():
        raise ClusterError("haproxy is not installed: `make setup` installs it (Debian: apt-get install haproxy)")
    return binary


def check_haproxy_config(path: Path, binary: str | None = None) -> None:
    """Have haproxy validate the configuration file at ``path`` (``haproxy -c``).

    Raises:
        ClusterError: With haproxy's own message if it refuses the file.
    """
    done = subprocess.run([binary or find_haproxy(), "-c", "-f", str(path)], capture_output=True, text=True,
                          timeout=30)
    if done.returncode != 0:
        raise ClusterError(f"haproxy refuses {path}: {(done.stdout + done.stderr).strip()[-2000:]}")


def parse_stats_csv(text: str) -> list[dict[str, str]]:
    """The ``/stats;csv`` page of haproxy as one dict per row (``pxname``, ``svname``, ``status``, ``hrsp_2xx``...)."""
    return list(csv.DictReader(io.StringIO(text.lstrip("# "))))


def server_states(rows: Sequence[Mapping[str, str]], backend: str = HTTP_BACKEND) -> dict[str, str]:
    """Each server of ``backend`` and its state (``UP``, ``DOWN``, ``UP 1/2``...: haproxy's words)."""
    return {row["svname"]: row["status"] for row in rows
            if row.get("pxname") == backend and row.get("svname") not in ("FRONTEND", "BACKEND")}


def prepare_repository(source: Path, dest: Path, *, redis_url: str, parameters: Mapping[str, str] | None = None,
                       models: Sequence[str] = ()) -> list[str]:
    """Lay out ``dest`` as ``source`` with the shared tier of every row-task ``coalesce`` model at ``redis_url``.

    Configs are written anew (``parameters`` set too, on the same models); version folders
    are made and their files linked, as is every other file of a model folder: nothing
    large is copied. ``models`` limits the copy to those models. A ``redis_url`` the
    source sets is replaced: the cluster's replicas share the cluster's Redis.

    Returns:
        The models given the shared tier, in order.

    Raises:
        ClusterError: If ``source`` holds none of ``models`` (or no model at all), or a config cannot be read.
    """
    from coalesce_tools.config import ConfigReadError

    folders = sorted(p.parent for p in source.glob("*/config.pbtxt"))
    if models:
        missing = sorted(set(models) - {f.name for f in folders})
        if missing:
            raise ClusterError(f"{source} has no model {', '.join(missing)}")
        folders = [f for f in folders if f.name in models]
    if not folders:
        raise ClusterError(f"{source} holds no model (no */config.pbtxt)")
    try:
        # The models that read redis_url: the shared tier goes to these.
        reads_redis = CacheOptions.APPLIES_TO
        shared = {folder.name for folder, config in coalesce_models(source)
                  if reads_redis is None or parameter(config, "task", "embedding") in reads_redis}
    except ConfigReadError as exc:
        raise ClusterError(str(exc)) from None
    given: list[str] = []
    dest.mkdir(parents=True, exist_ok=True)
    for folder in folders:
        target = dest / folder.name
        target.mkdir()
        for item in sorted(folder.iterdir()):
            if item.name == "config.pbtxt":
                continue
            if item.is_dir() and item.name.isdigit():
                (target / item.name).mkdir()
                for file in sorted(item.iterdir()):
                    (target / item.name / file.name).symlink_to(file.resolve())
            else:
                (target / item.name).symlink_to(item.resolve())
        if folder.name not in shared:
            shutil.copy2(folder / "config.pbtxt", target / "config.pbtxt")
            continue
        config = with_parameters(read_model_config(folder / "config.pbtxt"), {**(parameters or {}),
                                                                             "redis_url": redis_url})
        (target / "config.pbtxt").write_text(
            f"# Written by `coalesce cluster` from {folder / 'config.pbtxt'}: the shared tier at the cluster's "
            "Redis.\n" + model_config_text(config))
        given.append(folder.name)
    return given


class _Prefixed(io.TextIOBase):
    """A text stream that writes each line to ``out`` after ``prefix`` (the replica's name in a merged log)."""

    def __init__(self, out: IO[str], prefix: str, lock: threading.Lock) -> None:
        self._out, self._prefix, self._lock = out, prefix, lock
        self._partial = ""

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        with self._lock:
            for line in lines:
                self._out.write(f"{self._prefix}{line}\n")
            self._out.flush()
        return len(text)


class Balancer:
    """A running haproxy (master-worker, in the foreground) on a configuration file; a context manager."""

    def __init__(self, config_path: Path, options: BalancerOptions, *, echo: IO[str] | None = None) -> None:
        """Prepare (not start) haproxy on ``config_path``, whose content the caller writes (``haproxy_config``)."""
        self.config_path = config_path
        self.options = options
        self.binary = find_haproxy()
        self._echo = echo
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()
        self._lines: list[str] = []
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)

    @property
    def _connect_host(self) -> str:
        return connect_host(self.options.host)

    @property
    def http_url(self) -> str:
        """``host:port`` of the balanced HTTP endpoint."""
        return f"{self._connect_host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the balanced gRPC endpoint."""
        return f"{self._connect_host}:{self.options.grpc_port}"

    @property
    def stats_url(self) -> str:
        """URL of haproxy's statistics page (``;csv`` appended gives them as CSV)."""
        return f"http://{self._connect_host}:{self.options.stats_port}/stats"

    @property
    def pid(self) -> int | None:
        """The master's process id while it runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def start(self, timeout_s: float = 15.0) -> Balancer:
        """Validate the configuration, start haproxy, and wait until its statistics page answers.

        Raises:
            ClusterError: If haproxy refuses the configuration, exits, or does not answer in time.
        """
        check_haproxy_config(self.config_path, self.binary)
        self._process = subprocess.Popen(
            [self.binary, "-W", "-db", "-f", str(self.config_path)], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1, start_new_session=True,
            preexec_fn=set_parent_death_signal)
        self._reader = threading.Thread(target=self._read_output, name="haproxy-log", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._reader.join(timeout=5)
                raise ClusterError(f"haproxy exited with code {self._process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                self.stats()
                return self
            time.sleep(0.05)
        self.stop()
        raise ClusterError(f"haproxy did not answer on {self.stats_url} within {timeout_s:.0f} s:\n{self.log_tail()}")

    def _read_output(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            with self._lock:
                self._lines.append(line)
                self._tail.append(line.rstrip("\n"))
            if self._echo is not None:
                self._echo.write(line)
                self._echo.flush()

    def stats(self, timeout_s: float = 2.0) -> list[dict[str, str]]:
        """The statistics of haproxy now, one dict per frontend, backend and server (``parse_stats_csv``).

        Raises:
            OSError: If haproxy does not answer (``urllib.error.URLError`` is one).
        """
        with urllib.request.urlopen(self.stats_url + ";csv", timeout=timeout_s) as response:
            return parse_stats_csv(response.read().decode())

    def states(self) -> dict[str, str]:
        """Each replica and its state as the health checks see it (``UP``, ``DOWN``...); empty if haproxy is silent."""
        try:
            return server_states(self.stats())
        except OSError:
            return {}

    def wait_until(self, condition: Callable[[dict[str, str]], bool], timeout_s: float) -> dict[str, str]:
        """Poll ``states()`` until ``condition`` holds for them.

        Raises:
            ClusterError: If it does not within ``timeout_s``, or haproxy exits; with the last states and log.
        """
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            if self.pid is None:
                raise ClusterError(f"haproxy exited with code {self.returncode}:\n{self.log_tail()}")
            states = self.states()
            if condition(states):
                return states
            time.sleep(0.1)
        raise ClusterError(f"the balancer's replicas stayed {states} for {timeout_s:.0f} s:\n{self.log_tail()}")

    def reload(self) -> None:
        """Make haproxy read its configuration file again (SIGUSR2 to the master); in-flight requests finish.

        Raises:
            ClusterError: If haproxy refuses the new configuration (it keeps the old one then).
        """
        check_haproxy_config(self.config_path, self.binary)
        if self._process is None or self._process.poll() is not None:
            raise ClusterError(f"haproxy is not running:\n{self.log_tail()}")
        self._process.send_signal(signal.SIGUSR2)

    @property
    def returncode(self) -> int | None:
        """Exit code once it has exited, else None."""
        return None if self._process is None else self._process.poll()

    def log_tail(self) -> str:
        """The last log lines of haproxy."""
        with self._lock:
            return "\n".join(self._tail)

    def log_text(self) -> str:
        """Everything haproxy logged so far."""
        with self._lock:
            return "".join(self._lines)

    def kill(self) -> None:
        """SIGKILL the master and its workers (their process group)."""
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self._process.pid, signal.SIGKILL)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """Stop listening and let requests in flight finish (soft stop, SIGUSR1), then SIGTERM, then SIGKILL."""
        process = self._process
        if process is None:
            return None
        for signum, wait_s in ((signal.SIGUSR1, timeout_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if process.poll() is not None:
                break
            with contextlib.suppress(OSError):
                if signum == signal.SIGKILL:
                    os.killpg(process.pid, signum)  # the workers too
                else:
                    process.send_signal(signum)  # the master tells its workers
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=wait_s)
        if self._reader is not None:
            self._reader.join(timeout=5)
        return process.returncode

    def __enter__(self) -> Balancer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclasses.dataclass
class Replica:
    """One replica: its name (haproxy's), ports, server options, and the server now running them."""

    name: str
    ports: ReplicaPorts
    options: ServerOptions
    server: TritonServer
    #: Times its server exited and was started again.
    restarts: int = 0

    @property
    def http_url(self) -> str:
        """``host:port`` of its own HTTP endpoint (not balanced)."""
        return self.server.http_url

    @property
    def grpc_url(self) -> str:
        """``host:port`` of its own gRPC endpoint (not balanced)."""
        return self.server.grpc_url

    @property
    def metrics_url(self) -> str:
        """URL of its Prometheus metrics (Triton's and the coalesce backend's)."""
        return self.server.metrics_url


@dataclasses.dataclass(frozen=True)
class ClusterOptions:
    """What the cluster serves, how many replicas, and where everything listens.

    Attributes:
        model_repository: The repository every replica serves (a prepared copy of it).
        replicas: Replicas started at once.
        balancer: haproxy's address, ports, checks and retries.
        replica_port_base: Replica ``i`` listens from ``base + 10 * i`` (``ReplicaPorts.numbered``); 0: free ports.
        redis_port: Port of the cluster's redis-server on loopback; 0: a free one.
        redis_maxmemory: Its memory bound (LRU eviction beyond it: a cache).
        load_models: Models to serve (default: every model of the repository).
        parameters: ``config.pbtxt`` parameters set on every row-task coalesce model, besides ``redis_url``.
        restart: Start a replica again when its server exits (the balancer takes it out meanwhile).
        ready_timeout_s: Most seconds a replica may take to be ready.
    """

    model_repository: Path
    replicas: int = 2
    balancer: BalancerOptions = dataclasses.field(default_factory=BalancerOptions)
    replica_port_base: int = DEFAULT_REPLICA_PORT_BASE
    redis_port: int = 0
    redis_maxmemory: str = "1gb"
    load_models: tuple[str, ...] = ()
    parameters: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False)
    restart: bool = True
    ready_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        """Reject a replica count or port layout that cannot work.

        Raises:
            ClusterError: Naming the value.
        """
        if self.replicas < 1:
            raise ClusterError(f"replicas={self.replicas}: at least one")
        if self.replica_port_base:
            ReplicaPorts.numbered(self.replicas - 1, self.replica_port_base)  # the last one fits
            first, last = self.replica_port_base, self.replica_port_base + PORT_STRIDE * self.replicas - 1
            clash = [p for p in (self.balancer.http_port, self.balancer.grpc_port, self.balancer.stats_port,
                                 self.redis_port) if first <= p <= last]
            if clash:
                raise ClusterError(f"ports {clash} fall among the replicas' ({first}..{last}): choose another "
                                   "replica port base")


def _secret_from_env(value_env: str, file_env: str) -> str | None:
    """A secret the user set for ``coalesce serve`` too: the file ``file_env`` names wins over ``value_env``."""
    path = os.environ.get(file_env, "")
    if path:
        try:
            text = Path(path).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ClusterError(f"{file_env}={path!r}: cannot read it ({exc.strerror})") from None
        if not text:
            raise ClusterError(f"{file_env}={path!r}: the file is empty")
        return text
    return os.environ.get(value_env) or None


class Cluster:
    """Redis, N replicas and haproxy, started together and always stopped together; a context manager.

    Each replica has a keeper thread that starts its server, watches it, and starts it again
    when it exits: the launcher ties each server to the thread that started it (the kernel's
    parent-death signal follows a thread, not the process), so that thread lives as long as
    the cluster. For the same reason a cluster is started from a thread that outlives it
    (haproxy and Redis are tied to that one).
    """

    def __init__(self, options: ClusterOptions, *, echo: IO[str] | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        """Prepare (not start) the cluster.

        Args:
            options: What to serve, how many replicas, where.
            echo: Receives the replicas' and haproxy's log lines, each prefixed with its source.
            log: Receives the cluster's own lines (replicas started, exited, started again).
        """
        self.options = options
        self._echo = echo
        self._echo_lock = threading.Lock()
        self._log = log or (lambda line: None)
        self._workdir = Path(tempfile.mkdtemp(prefix="coalesce-cluster-"))
        self._lock = threading.Lock()
        self.replicas: list[Replica] = []
        self.redis: RedisServer | None = None
        self.balancer: Balancer | None = None
        #: The prepared copy of the repository every replica serves.
        self.repository: Path = self._workdir / "repository"
        self._password = ""
        self._environment: dict[str, str] = {}
        self._stopping = threading.Event()
        #: Set once every server is stopped: only then may the keepers (their servers' parent threads) end.
        self._released = threading.Event()
        self._keepers: list[threading.Thread] = []
        #: Replica restarts: (name, seconds from its exit being seen to its being ready again).
        self.recoveries: list[tuple[str, float]] = []

    # --- start -----------------------------------------------------------------------------------------------------

    def _echo_for(self, prefix: str) -> IO[str] | None:
        if self._echo is None:
            return None
        return _Prefixed(self._echo, f"[{prefix}] ", self._echo_lock)  # type: ignore[return-value]

    def _secrets(self) -> dict[str, str]:
        """Environment of every replica: files holding the Redis password and the tier's MAC secret.

        Taken from this process's environment where set (as ``coalesce serve`` takes them), else
        random for this run: the Redis lives as long as the cluster, so nobody else needs them.
        """
        from coalesce.cache.secrets import CACHE_KEY_ENV, CACHE_KEY_FILE_ENV, PASSWORD_ENV, PASSWORD_FILE_ENV

        password = _secret_from_env(PASSWORD_ENV, PASSWORD_FILE_ENV) or secrets.token_urlsafe(24)
        cache_key = _secret_from_env(CACHE_KEY_ENV, CACHE_KEY_FILE_ENV) or secrets.token_urlsafe(32)
        files = {}
        for name, value in (("redis-password", password), ("cache-key", cache_key)):
            path = self._workdir / name
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(handle, "w") as out:
                out.write(value + "\n")
            files[name] = str(path)
        self._password = password
        # Files named in the servers' environment win over values this process's environment may hold.
        return {PASSWORD_FILE_ENV: files["redis-password"], CACHE_KEY_FILE_ENV: files["cache-key"]}

    @property
    def redis_password(self) -> str:
        """The password of the cluster's Redis (for a client of it: ``redis-cli -a``, a test)."""
        return self._password

    @property
    def redis_password_file(self) -> Path:
        """The file (mode 0600) holding that password, while the cluster runs."""
        return self._workdir / "redis-password"

    def _new_replica(self) -> Replica:
        with self._lock:
            index = len(self.replicas)
            base = self.options.replica_port_base
            ports = ReplicaPorts.numbered(index, base) if base else ReplicaPorts.free()
            options = ServerOptions(
                model_repository=self.repository, http_port=ports.http, grpc_port=ports.grpc,
                metrics_port=ports.metrics, host="127.0.0.1", model_control="none",
                load_models=self.options.load_models, environment=self._environment,
                ready_timeout_s=self.options.ready_timeout_s,
                supervisor=SupervisorOptions(health_port=ports.health, health_host="127.0.0.1"))
            name = f"r{index}"
            replica = Replica(name=name, ports=ports, options=options,
                              server=TritonServer(options, echo=self._echo_for(name)))
            self.replicas.append(replica)
            return replica

    def _write_config(self) -> Path:
        path = self._workdir / "haproxy.cfg"
        with self._lock:
            replicas = {r.name: r.ports for r in self.replicas}
        path.write_text(haproxy_config(replicas, self.options.balancer))
        return path

    def start(self) -> Cluster:
        """Start Redis, the replicas (together), then haproxy; return once the balancer sees every replica up.

        Raises:
            LaunchError: If a part does not start (``ClusterError`` for the cluster's own parts); everything
                started is stopped first.
        """
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        o = self.options
        self._environment = self._secrets()
        self.redis = RedisServer(o.redis_port or None, maxmemory=o.redis_maxmemory, password=self._password).start()
        shared = prepare_repository(o.model_repository, self.repository, redis_url=self.redis.url,
                                    parameters=o.parameters, models=o.load_models)
        self._log(f"coalesce cluster: redis-server on {self.redis.url} (password in {self.redis_password_file}); "
                  f"shared row-cache tier for {', '.join(shared) or 'no model'}")
        # Together: a replica's start is mostly waiting (loading, calibrating), and N in a row would take N times.
        keepers = [self._keep(self._new_replica()) for _ in range(o.replicas)]
        failures = [problem for started, failure in keepers if started.wait() for problem in failure]
        if failures:
            raise ClusterError("replica(s) did not start:\n" + "\n\n".join(failures))
        self.balancer = Balancer(self._write_config(), o.balancer, echo=self._echo_for("haproxy")).start()
        names = {r.name for r in self.replicas}
        self.balancer.wait_until(lambda states: names <= {n for n, s in states.items() if s == "UP"}, timeout_s=30)

    def _keep(self, replica: Replica) -> tuple[threading.Event, list[str]]:
        """Start ``replica``'s keeper thread; its event is set once the first start ended (the list: its failure)."""
        started = threading.Event()
        failure: list[str] = []

        def keep() -> None:
            try:
                problem = self._start_replica(replica)
            except BaseException as exc:  # told to the starter, which stops the cluster
                problem = f"{replica.name}: {exc!r}"
            if problem is not None:
                failure.append(problem)
            started.set()
            if problem is None:
                self._watch(replica)
            self._released.wait()

        thread = threading.Thread(target=keep, name=f"coalesce-cluster-{replica.name}", daemon=True)
        with self._lock:
            self._keepers.append(thread)
        thread.start()
        return started, failure

    def _start_replica(self, replica: Replica) -> str | None:
        """Start ``replica``'s server; None, or what went wrong (with its log)."""
        try:
            replica.server.start()
        except LaunchError as exc:
            return f"{replica.name}: {exc}"
        self._log(f"coalesce cluster: replica {replica.name} ready (HTTP {replica.http_url}, gRPC {replica.grpc_url}, "
                  f"metrics {replica.metrics_url})")
        return None

    def add_replica(self, timeout_s: float = 60.0) -> Replica:
        """Start one more replica and add it to the balancer; return once the balancer sees it up.

        Raises:
            ClusterError: If it does not start, or the balancer does not see it up within ``timeout_s``.
        """
        if self.balancer is None or self._stopping.is_set():
            raise ClusterError("the cluster is not running")
        replica = self._new_replica()
        started, failure = self._keep(replica)
        started.wait()
        if failure:
            raise ClusterError(failure[0])
        self._write_config()
        self.balancer.reload()
        self.balancer.wait_until(lambda states: states.get(replica.name) == "UP", timeout_s=timeout_s)
        return replica

    # --- supervision -----------------------------------------------------------------------------------------------

    def _watch(self, replica: Replica, interval_s: float = 0.2) -> None:
        """Until the cluster stops: start ``replica`` again whenever its server exits (when ``restart``)."""
        while not self._stopping.wait(interval_s):
            code = replica.server.returncode
            if code is None:
                continue
            self._log(f"coalesce cluster: replica {replica.name} exited with code {code}"
                      + ("; starting it again" if self.options.restart else "; not started again (restart off)"))
            seen = time.monotonic()
            replica.server.stop()  # ends the stubs it left behind, frees its health port
            if not self.options.restart:
                return
            while not self._stopping.is_set():
                replica.server = TritonServer(replica.options, echo=self._echo_for(replica.name))
                problem = self._start_replica(replica)
                if problem is None:
                    replica.restarts += 1
                    elapsed_s = time.monotonic() - seen
                    self.recoveries.append((replica.name, elapsed_s))
                    self._log(f"coalesce cluster: replica {replica.name} is serving again, {elapsed_s:.1f} s after "
                              "it exited")
                    break
                if self._stopping.is_set():
                    break  # the cluster stopped it while it started: not a failure to report
                self._log(f"coalesce cluster: replica {replica.name} did not start again: {problem}")
                self._stopping.wait(5.0)

    @property
    def alive(self) -> bool:
        """Whether the balancer runs (replicas come and go behind it)."""
        return self.balancer is not None and self.balancer.pid is not None

    # --- stop ------------------------------------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL haproxy, every server and Redis at once (a second Ctrl-C); ``stop`` still cleans up after."""
        self._stopping.set()
        if self.balancer is not None:
            self.balancer.kill()
        with self._lock:
            replicas = list(self.replicas)
        for replica in replicas:
            replica.server.send_signal(signal.SIGKILL)
        if self.redis is not None:
            self.redis.kill()

    def _stop_servers(self) -> None:
        with self._lock:
            replicas = list(self.replicas)
        if replicas:
            with ThreadPoolExecutor(max_workers=len(replicas)) as pool:
                list(pool.map(lambda r: r.server.stop(), replicas))

    def stop(self) -> None:
        """Stop taking requests (haproxy's soft stop), drain and stop every replica, then Redis; remove the files."""
        self._stopping.set()
        if self.balancer is not None:
            self.balancer.stop()
        self._stop_servers()  # a replica being started again fails its start now, and its keeper gives up
        self._released.set()
        with self._lock:
            keepers = list(self._keepers)
        for keeper in keepers:
            keeper.join(timeout=30)
        self._stop_servers()  # one that a keeper started just before it saw the stop
        if self.redis is not None:
            self.redis.__exit__(None, None, None)  # stops it and removes its log file, as its context manager does
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
