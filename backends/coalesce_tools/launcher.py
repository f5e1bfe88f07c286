"""Start a real ``tritonserver`` on a model repository with the ``coalesce`` backend.

Finds the server (a container's ``/opt/tritonserver``, else the binary inside the
``nvidia-pytriton`` wheel), assembles a backend directory (the Python backend, the
stub matching the running Python, and our backend), sets the library paths, starts
the server, waits for readiness while checking it is alive, and stops it cleanly.
Used by ``coalesce serve`` and by the integration tests alike.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final

from coalesce_tools.config import ConfigReadError, parameter, read_model_config
from coalesce_tools.processes import programs_under, stub_processes
from coalesce_tools.supervisor import Supervisor, SupervisorOptions

CONTAINER_ROOT: Final = Path("/opt/tritonserver")
#: Folder holding ``model.py`` (the adapter) and the ``coalesce`` package.
BACKEND_SOURCE: Final = Path(__file__).resolve().parent.parent / "coalesce"
LOG_TAIL_LINES: Final = 40
#: The header Triton checks on restricted APIs, and the APIs restricted whenever a key is set: everything
#: but inference, health, metadata and model config (loading a model with a config override runs code).
ADMIN_HEADER: Final = "admin-key"
ADMIN_APIS: Final = ("model-repository", "logging", "trace", "shared-memory", "statistics")
ADMIN_KEY_ENV: Final = "COALESCE_ADMIN_KEY"
ADMIN_KEY_FILE_ENV: Final = "COALESCE_ADMIN_KEY_FILE"
#: Triton's glog-style error lines: ``E1202 11:42:31.582634 2676 model_lifecycle.cc:642] ...``.
_ERROR_LINE: Final = re.compile(r"^E\d{4} |^error: ")


class LaunchError(RuntimeError):
    """The server could not be found, started or made ready; the message carries its last log lines."""


@dataclasses.dataclass(frozen=True)
class TritonInstall:
    """Where the pieces of a Triton installation are."""

    server: Path
    python_backend: Path
    stub: Path
    lib_dirs: tuple[Path, ...]
    cache_dir: Path | None
    origin: str


def _python_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def find_triton() -> TritonInstall:
    """Locate a ``tritonserver``: ``$TRITONSERVER_ROOT``, then ``/opt/tritonserver``, then the pytriton wheel.

    Raises:
        LaunchError: If none is found, saying what to install.
    """
    roots = []
    if os.environ.get("TRITONSERVER_ROOT"):
        roots.append(Path(os.environ["TRITONSERVER_ROOT"]))
    roots.append(CONTAINER_ROOT)
    for root in roots:
        server = root / "bin" / "tritonserver"
        if server.is_file():
            backend = root / "backends" / "python"
            stub = root / "python_backend_stubs" / _python_tag() / "triton_python_backend_stub"
            if not stub.is_file():
                stub = backend / "triton_python_backend_stub"
            caches = root / "caches"
            return TritonInstall(server=server, python_backend=backend, stub=stub,
                                 lib_dirs=(root / "lib",), cache_dir=caches if caches.is_dir() else None,
                                 origin=str(root))
    try:
        import pytriton
    except ImportError:
        raise LaunchError(
            "no tritonserver found: not in $TRITONSERVER_ROOT or /opt/tritonserver, and the nvidia-pytriton "
            "wheel is not installed (pip install 'coalesce[serve]', or run `make setup`)") from None
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    stub = root / "python_backend_stubs" / _python_tag() / "triton_python_backend_stub"
    if not stub.is_file():
        raise LaunchError(f"the nvidia-pytriton wheel has no Python backend stub for Python {_python_tag()} "
                          f"(looked for {stub})")
    libs = root.parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(server=root / "bin" / "tritonserver", python_backend=root / "backends" / "python",
                         stub=stub, lib_dirs=(libs,), cache_dir=root / "caches",
                         origin=f"nvidia-pytriton wheel ({root})")


def assemble_backend_dir(install: TritonInstall, dest: Path) -> Path:
    """Lay out ``dest`` as a ``--backend-directory``: ``python/`` with the stub, and ``coalesce/``.

    Triton puts ``<backend-dir>/coalesce`` on the stub's ``sys.path``, so the
    ``coalesce`` package is linked in beside ``model.py``.
    """
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(install.python_backend / name, python_dir / name)
    shutil.copy2(install.stub, python_dir / "triton_python_backend_stub")
    ours = dest / "coalesce"
    ours.mkdir(exist_ok=True)
    shutil.copy2(BACKEND_SOURCE / "model.py", ours / "model.py")
    link = ours / "coalesce"
    if not link.exists():
        link.symlink_to(BACKEND_SOURCE / "coalesce", target_is_directory=True)
    return dest


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class GrpcTls:
    """TLS on the gRPC endpoint: the server's certificate and key; with ``ca``, clients must present one it signed."""

    cert: Path
    key: Path
    ca: Path | None = None

    def args(self) -> list[str]:
        """Triton's flags for it."""
        args = ["--grpc-use-ssl=true", f"--grpc-server-cert={self.cert}", f"--grpc-server-key={self.key}"]
        if self.ca is not None:
            args += ["--grpc-use-ssl-mutual=true", f"--grpc-root-cert={self.ca}"]
        return args


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address to bind) is reachable from this machine only."""
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


def connect_host(host: str) -> str:
    """The address a client on this machine uses to reach a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") or is_loopback(host) else host


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """How to start the server.

    Model control: ``none`` serves the repository as it is at start (users cannot load or
    unload); ``explicit`` lets holders of ``admin_key`` load and unload (without a key only
    on a loopback address); ``poll`` follows the repository's files. Under ``none`` and
    ``explicit`` Triton runs with explicit control so that the supervisor can reload a model
    whose stub died; the admin APIs (``ADMIN_APIS``) are restricted to ``admin_key``, or under
    ``none`` without one to a random key only the supervisor knows.
    """

    model_repository: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "127.0.0.1"
    model_control: str = "none"
    #: The value of the ``admin-key`` header the admin APIs require; None: see the class docstring.
    admin_key: str | None = dataclasses.field(default=None, repr=False)
    grpc_tls: GrpcTls | None = None
    #: Reload a model whose stub died (not under ``poll``: Triton refuses repository loads then).
    supervise: bool = True
    supervisor: SupervisorOptions = dataclasses.field(default_factory=SupervisorOptions)
    load_models: tuple[str, ...] = ()
    log_verbose: int = 0
    #: Bytes of Triton's own response cache (``--cache-config=local,size=...``); 0 leaves it off.
    #: Models opt in with ``response_cache { enable: true }``.
    response_cache_bytes: int = 0
    #: Triton's rate limiter (``--rate-limit``): ``off``, or ``execution_count`` to honour the ``rate_limiter``
    #: resources and priorities of the models' instance groups.
    rate_limit: str = "off"
    extra_args: tuple[str, ...] = ()
    #: Variables set in the server's environment over this process's own (the stubs inherit them): how a
    #: launcher hands each server the shared tier's secrets without changing its own environment.
    environment: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False, hash=False)
    ready_timeout_s: float = 180.0
    #: Seconds Triton waits for in-flight requests when asked to stop (``--exit-timeout-secs``).
    exit_timeout_s: int = 15

    @classmethod
    def on_free_ports(cls, model_repository: Path, **fields: Any) -> ServerOptions:
        """Options for a server on loopback whose HTTP, gRPC and metrics ports are free now.

        For tests and benches that start servers side by side; ``fields`` set any other option.
        """
        return cls(model_repository=model_repository, host="127.0.0.1", http_port=free_port(),
                   grpc_port=free_port(), metrics_port=free_port(), **fields)

    def __post_init__(self) -> None:
        """Refuse an admin API open to the network.

        Raises:
            LaunchError: If model control is explicit on a non-loopback address without an admin key.
        """
        if self.model_control not in ("none", "explicit", "poll"):
            raise LaunchError(f"model control {self.model_control!r}: expected none, explicit or poll")
        if self.model_control == "explicit" and not self.admin_key and not is_loopback(self.host):
            raise LaunchError(
                f"explicit model control on {self.host} without an admin key would let anyone who reaches port "
                f"{self.http_port} load models (which runs their code): set {ADMIN_KEY_ENV} (or "
                f"{ADMIN_KEY_FILE_ENV}), or bind a loopback address (HOST=127.0.0.1)")


def library_path(*extra: Path | str) -> str:
    """``LD_LIBRARY_PATH`` for a Triton server: this interpreter's libpython first, then ``extra``, then the current.

    The Python-backend stub links libpython3.X: this interpreter's own must win over a system
    copy of another patch release, whose ``_thread`` would not match the stdlib it loads.
    """
    parts = [sysconfig.get_config_var("LIBDIR") or "", *map(str, extra), os.environ.get("LD_LIBRARY_PATH", "")]
    return ":".join(p for p in parts if p)


def set_parent_death_signal() -> None:
    """Ask Linux to send this (child) process SIGTERM when its parent dies (``preexec_fn`` of a child)."""
    # Linux: the server gets SIGTERM if its launcher dies, so a killed test run leaves no server behind.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class TritonServer:
    """A running ``tritonserver`` process; a context manager that always stops it."""

    def __init__(self, options: ServerOptions, *, echo: IO[str] | None = None,
                 install: TritonInstall | None = None) -> None:
        """Prepare (not start) a server; ``echo`` receives its log lines as they come."""
        self.options = options
        self.install = install or find_triton()
        self._echo = echo
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._log_lines: list[str] = []
        self._lock = threading.Lock()
        self._workdir = Path(tempfile.mkdtemp(prefix="coalesce-triton-"))
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._supervisor: Supervisor | None = None
        o = options
        # Under ``none`` the admin APIs are closed to everyone but the supervisor: a key nobody else knows.
        self._admin_key = o.admin_key or (secrets.token_urlsafe(32) if o.model_control != "explicit" else None)

    @property
    def backend_directory(self) -> Path:
        """``--backend-directory``: assembled from this checkout, else the installation's (a container's).

        In a container the Dockerfile copies ``model.py`` and the ``coalesce`` package to
        ``/opt/tritonserver/backends/coalesce``, and the installed tools have no source tree beside them.

        Raises:
            LaunchError: If neither has the backend.
        """
        if (BACKEND_SOURCE / "model.py").is_file():
            return self._workdir / "backends"
        installed = self.install.python_backend.parent
        if (installed / "coalesce" / "model.py").is_file():
            return installed
        raise LaunchError(f"no coalesce backend found: neither {BACKEND_SOURCE / 'model.py'} (a checkout) nor "
                          f"{installed / 'coalesce' / 'model.py'} (an installation, see the Dockerfile)")

    @property
    def _connect_host(self) -> str:
        return connect_host(self.options.host)

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP endpoint."""
        return f"{self._connect_host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC endpoint."""
        return f"{self._connect_host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """URL of the Prometheus metrics."""
        return f"http://{self._connect_host}:{self.options.metrics_port}/metrics"

    @property
    def admin_headers(self) -> dict[str, str]:
        """Headers that open the restricted admin APIs (empty when they are not restricted)."""
        return {ADMIN_HEADER: self._admin_key} if self._admin_key else {}

    @property
    def grpc_admin_headers(self) -> dict[str, str]:
        """The same over gRPC, where Triton expects the header as ``triton-grpc-protocol-<name>``."""
        return {f"triton-grpc-protocol-{k}": v for k, v in self.admin_headers.items()}

    @property
    def supervisor(self) -> Supervisor | None:
        """The supervisor reloading models whose stub died, once the server is ready (None if unsupervised)."""
        return self._supervisor

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def command(self) -> list[str]:
        """The ``tritonserver`` command line."""
        o = self.options
        args = [
            str(self.install.server),
            f"--model-repository={o.model_repository.resolve()}",
            f"--backend-directory={self.backend_directory}",
            f"--http-address={o.host}", f"--grpc-address={o.host}", f"--metrics-address={o.host}",
            f"--http-port={o.http_port}", f"--grpc-port={o.grpc_port}", f"--metrics-port={o.metrics_port}",
            # Explicit control under ``none`` too (with the admin APIs closed): the supervisor reloads through it.
            f"--model-control-mode={'poll' if o.model_control == 'poll' else 'explicit'}",
            f"--log-verbose={o.log_verbose}",
            f"--exit-timeout-secs={o.exit_timeout_s}",
            # Per-model latency quantiles (nv_inference_*_summary_us): the dashboard's p50/p99
            # (scripts/deploy/grafana); Triton's other latency metrics are totals only.
            "--metrics-config=summary_latencies=true",
        ]
        if self._admin_key:
            restricted = ",".join(ADMIN_APIS) + f":{ADMIN_HEADER}={self._admin_key}"
            args += [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]
        if o.grpc_tls is not None:
            args += o.grpc_tls.args()
        if self.install.cache_dir is not None:
            args.append(f"--cache-directory={self.install.cache_dir}")
        if o.response_cache_bytes > 0:
            args.append(f"--cache-config=local,size={o.response_cache_bytes}")
        if o.rate_limit != "off":
            args.append(f"--rate-limit={o.rate_limit}")
        if o.model_control != "poll":
            args += [f"--load-model={name}" for name in (o.load_models or ("*",))]
        return args + list(o.extra_args)

    def environment(self) -> dict[str, str]:
        """Environment of the server: our Python first on PATH, its libpython first on the library path."""
        env = {**os.environ, **self.options.environment}
        env["LD_LIBRARY_PATH"] = library_path(*self.install.lib_dirs)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        # Models load their weights from the repository, never from a hub.
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "true")
        return env

    def start(self) -> TritonServer:
        """Start the process and wait until it is ready.

        Raises:
            LaunchError: If it exits or is not ready in time; the message has its last log lines.
        """
        if self.backend_directory == self._workdir / "backends":
            assemble_backend_dir(self.install, self.backend_directory)
        self._process = subprocess.Popen(
            self.command(), env=self.environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace", bufsize=1, start_new_session=True,
            preexec_fn=set_parent_death_signal)
        self._reader = threading.Thread(target=self._read_output, name="tritonserver-log", daemon=True)
        self._reader.start()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        if self.options.supervise and self.options.model_control != "poll":
            try:
                self._supervisor = Supervisor(lambda: self.pid, self.http_url, headers=self.admin_headers,
                                              options=self.options.supervisor, log=self._supervisor_log).start()
            except OSError as exc:
                self.stop()
                raise LaunchError(f"the health endpoint cannot listen on port {self.options.supervisor.health_port} "
                                  f"({exc.strerror}): set HEALTH_PORT to a free port, or 0 for none") from None
        return self

    def _supervisor_log(self, line: str) -> None:
        with self._lock:
            self._tail.append(line)
            self._log_lines.append(line + "\n")
        if self._echo is not None:
            self._echo.write(line + "\n")
            self._echo.flush()

    def stop_supervising(self) -> None:
        """Stop the supervisor (before a shutdown, so it never reloads a model the server is unloading)."""
        if self._supervisor is not None:
            self._supervisor.stop()

    def _read_output(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            with self._lock:
                self._tail.append(line.rstrip("\n"))
                self._log_lines.append(line)
            if self._echo is not None:
                self._echo.write(line)
                self._echo.flush()

    def _wait_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.options.ready_timeout_s
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            code = self._process.poll()
            if code is not None:
                if self._reader is not None:
                    self._reader.join(timeout=5)
                raise LaunchError(f"tritonserver exited with code {code} before it was ready; "
                                  f"last log lines:\n{self.log_tail()}")
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError, OSError), \
                    urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
            time.sleep(0.25)
        raise LaunchError(f"tritonserver was not ready within {self.options.ready_timeout_s:.0f} s; "
                          f"last log lines:\n{self.log_tail()}")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The server's error lines (Triton's ``E...`` lines), then its last log lines."""
        with self._lock:
            errors = [line.rstrip("\n") for line in self._log_lines if _ERROR_LINE.match(line)]
            tail = list(self._tail)[-lines:]
        head = ["errors logged:", *errors[-10:], "", "last lines:"] if errors else []
        return "\n".join(head + tail)

    def log_text(self) -> str:
        """Everything the server logged so far."""
        with self._lock:
            return "".join(self._log_lines)

    @property
    def returncode(self) -> int | None:
        """Exit code once it has exited, else None."""
        return None if self._process is None else self._process.poll()

    def wait(self) -> int:
        """Block until the server exits; return its exit code."""
        assert self._process is not None
        return self._process.wait()

    def send_signal(self, signum: int) -> None:
        """Forward a signal to the server."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signum)

    def _repository_client(self) -> Supervisor:
        """A supervisor used only for its repository calls (model states, unload) on this server."""
        return Supervisor(lambda: self.pid, self.http_url, headers=self.admin_headers)

    def drain(self, timeout_s: float) -> bool:
        """Unload every model, so new requests are refused with Triton's "unavailable" while accepted ones finish.

        Triton's own shutdown (SIGINT) keeps accepting requests until its exit timeout and
        then exits with requests still in flight; unloading first makes the server refuse
        new work cleanly and wait for what it accepted. Returns whether every model was
        unloaded within ``timeout_s`` (False under ``poll`` control, where Triton refuses
        repository calls).
        """
        if self.options.model_control == "poll" or self.pid is None:
            return False
        supervisor = self._repository_client()
        deadline = time.monotonic() + timeout_s
        try:
            loaded = [m for m, state in supervisor.model_states().items() if state in ("READY", "LOADING")]
            for model in loaded:
                supervisor.unload(model)
            while time.monotonic() < deadline:
                if not any(state in ("READY", "LOADING", "UNLOADING")
                           for state in supervisor.model_states().values()):
                    return True
                time.sleep(0.1)
        except (OSError, RuntimeError, ValueError):
            return False  # the server is already going: its own shutdown takes over
        return False

    def _dump_stubs(self) -> None:
        """Log the models a drain left loaded, and have each stub still running print its threads' stacks.

        The stacks (the stub's SIGUSR1) say what holds the unload; each is headed by a
        ``launcher:`` line naming the stub's model.
        """
        states: dict[str, str] = {}
        with contextlib.suppress(OSError, RuntimeError, ValueError):
            states = self._repository_client().model_states()
        left = {model: state for model, state in states.items() if state in ("READY", "LOADING", "UNLOADING")}
        self._supervisor_log(f"launcher: the drain left {left or 'no model'} loaded; stacks of running stubs follow")
        with contextlib.suppress(OSError, ValueError), \
                urllib.request.urlopen(self.metrics_url, timeout=5) as page:
            for line in page.read().decode().splitlines():
                if line.startswith(("coalesce_generate_open_responses", "coalesce_generate_active",
                                    "coalesce_generate_waiting")) and any(f'"{m}"' in line for m in left):
                    self._supervisor_log(f"launcher: {line}")
        for stub in stub_processes(self.pid) if self.pid is not None else []:
            if stub.dead:
                continue
            self._supervisor_log(f"launcher: stacks of stub {stub.pid}, model {stub.model!r} ({stub.instance}):")
            with contextlib.suppress(OSError):
                os.kill(stub.pid, signal.SIGUSR1)
            time.sleep(0.5)  # one stub's stacks reach the log before the next stub's

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Drain (unload every model), then stop with SIGINT (Triton's shutdown), then SIGKILL after ``timeout_s``."""
        self.stop_supervising()
        process = self._process
        if process is not None:
            if process.poll() is None:
                drained = self.drain(min(timeout_s, self.options.exit_timeout_s))
                if not drained and self.options.model_control != "poll":
                    self._dump_stubs()
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            if self._reader is not None:
                self._reader.join(timeout=5)
            # A server that hit its exit timeout (or was killed) leaves its stubs running, orphaned, for
            # good: they run programs from our backend folder, so they are found and ended here.
            for pid in programs_under(self._workdir):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self._workdir, ignore_errors=True)
        return None if process is None else process.returncode

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


_LOOPBACK_HOSTS: Final = frozenset({"127.0.0.1", "localhost", "::1"})


def redis_urls(model_repository: Path) -> list[str]:
    """The ``redis_url`` parameters of the repository's coalesce models, in model order, without repeats."""
    urls: list[str] = []
    for config_path in sorted(model_repository.glob("*/config.pbtxt")):
        with contextlib.suppress(ConfigReadError):  # Triton reports a broken config itself
            url = parameter(read_model_config(config_path), "redis_url")
            if url and url not in urls:
                urls.append(url)
    return urls


def uses_rate_limiter(model_repository: Path) -> bool:
    """Whether any model of the repository gives its instances ``rate_limiter`` resources or priorities."""
    for config_path in sorted(model_repository.glob("*/config.pbtxt")):
        with contextlib.suppress(ConfigReadError):
            if any("rate_limiter" in group for group in read_model_config(config_path).get("instance_group", [])):
                return True
    return False


def local_redis_port(url: str) -> int | None:
    """The port of a ``redis://`` URL on this machine's loopback, else None (a remote or socket URL)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "redis" or parts.hostname not in _LOOPBACK_HOSTS:
        return None
    return parts.port or 6379


def _answers_ping(port: int, timeout_s: float = 0.5, *, tls_ca_file: Path | None = None) -> bool:
    """Whether a Redis on loopback ``port`` answers PING (plain RESP over a socket, no client library).

    With ``tls_ca_file`` it speaks TLS and verifies the server against that CA. A Redis
    that wants a password (``-NOAUTH``) answers too.
    """
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as raw:
            sock = raw
            if tls_ca_file is not None:
                sock = ssl.create_default_context(cafile=str(tls_ca_file)).wrap_socket(raw, server_hostname="127.0.0.1")
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:  # ssl.SSLError is one
        return False


@dataclasses.dataclass(frozen=True)
class RedisTls:
    """A TLS-only ``redis-server``'s files (PEM): its certificate and key, and the CA clients verify it with."""

    cert_file: Path
    key_file: Path
    ca_file: Path


class RedisServer:
    """A local ``redis-server`` (Debian's package) for the shared cache tier; a context manager.

    Runs without persistence, bounded by ``maxmemory`` with LRU eviction: it is a cache,
    and losing it only costs recomputation. With ``password`` it wants ``AUTH``
    (``requirepass``); with ``tls`` it speaks only TLS (``rediss://``) on ``port``. The
    password goes in a config file only its owner can read, removed once the server has
    read it, never on the command line (``ps`` shows that to every user).
    """

    def __init__(self, port: int | None = None, *, maxmemory: str = "1gb", password: str | None = None,
                 tls: RedisTls | None = None) -> None:
        """Prepare (not start) a server on loopback ``port`` (a free one if None).

        Raises:
            LaunchError: If ``redis-server`` is not installed, or the password holds a space, quote,
                backslash or line break (it goes in a config file).
        """
        if password is not None and (not password or any(c in password for c in "\r\n\"'\\ ")):
            raise LaunchError("the Redis password must be non-empty, without spaces, quotes, backslashes or line "
                              "breaks")
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).is_file():
            raise LaunchError("redis-server is not installed: `make setup` installs it (Debian: apt-get install "
                              "redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.tls = tls
        self._password = password
        self._process: subprocess.Popen[bytes] | None = None
        self._log = Path(tempfile.mkstemp(prefix="coalesce-redis-", suffix=".log")[1])

    @property
    def url(self) -> str:
        """``redis://`` (``rediss://`` with TLS) URL of the server; never with the password."""
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> RedisServer:
        """Start it and wait until it answers PING.

        Raises:
            LaunchError: If it exits or does not answer in time; the message has its log.
        """
        config = None
        if self._password is not None:
            handle, name = tempfile.mkstemp(prefix="coalesce-redis-", suffix=".conf")  # mode 0600
            with os.fdopen(handle, "w") as out:
                out.write(f"requirepass {self._password}\n")
            config = Path(name)
        try:
            self._start(config, timeout_s)
        finally:
            if config is not None:
                config.unlink(missing_ok=True)  # read at start-up; the password stays nowhere on disk
        return self

    def _start(self, config: Path | None, timeout_s: float) -> None:
        command = [self.binary, *([str(config)] if config else []),
                   "--port", "0" if self.tls else str(self.port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
                   "--daemonize", "no"]
        if self.tls is not None:
            command += ["--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert_file),
                        "--tls-key-file", str(self.tls.key_file), "--tls-ca-cert-file", str(self.tls.ca_file),
                        "--tls-auth-clients", "no"]
        with self._log.open("ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                             preexec_fn=set_parent_death_signal)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise LaunchError(f"redis-server exited with code {self._process.returncode}: "
                                  f"{self._log.read_text(errors='replace')[-2000:]}")
            if _answers_ping(self.port, tls_ca_file=self.tls.ca_file if self.tls else None):
                return
            time.sleep(0.05)
        self.stop()
        raise LaunchError(f"redis-server on port {self.port} did not answer within {timeout_s:.0f} s")

    @property
    def pid(self) -> int | None:
        """Its process id while it runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def kill(self) -> None:
        """SIGKILL it (a crash, for tests); ``start`` brings it back on the same port, empty."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop it with SIGTERM, then SIGKILL after ``timeout_s``."""
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.unlink(missing_ok=True)


def start_local_redis(model_repository: Path) -> list[RedisServer]:
    """Start a ``redis-server`` for each loopback ``redis_url`` of the repository that nothing answers on.

    Remote URLs and Redis servers already running are left alone. A server started here
    wants the password the models will send (``COALESCE_REDIS_PASSWORD`` or the file
    ``COALESCE_REDIS_PASSWORD_FILE`` names), where one is set. The caller stops the
    returned servers.

    Raises:
        LaunchError: If a needed server cannot be started, or the password file cannot be read.
    """
    from coalesce.cache.secrets import read_secrets
    from coalesce.core.errors import ConfigError

    started: list[RedisServer] = []
    try:
        for url in redis_urls(model_repository):
            port = local_redis_port(url)
            if port is not None and not _answers_ping(port):
                try:
                    password = read_secrets(b"", os.environ).password
                except ConfigError as exc:
                    raise LaunchError(str(exc)) from None
                started.append(RedisServer(port, password=password).start())
    except BaseException:
        for server in started:
            server.stop()
        raise
    return started


def options_from_env(model_repository: Path, *, explicit: bool | None = None,
                     load_models: Sequence[str] = ()) -> ServerOptions:
    """Options from the environment: address, ports, model control, admin key, TLS, response cache, rate limiter.

    ``HOST`` (default 127.0.0.1), ``HTTP_PORT``, ``GRPC_PORT``, ``METRICS_PORT``, ``HEALTH_PORT`` (the
    supervisor's ``/ready`` and ``/live``; 0: none), ``MODEL_CONTROL``, ``COALESCE_ADMIN_KEY`` or
    ``COALESCE_ADMIN_KEY_FILE``, ``GRPC_TLS_CERT`` + ``GRPC_TLS_KEY`` (+ ``GRPC_TLS_CA`` for mutual TLS),
    ``RESPONSE_CACHE_BYTES``, ``RATE_LIMIT``.

    ``RATE_LIMIT`` (``off`` or ``execution_count``) defaults to ``execution_count`` when a
    model of the repository declares ``rate_limiter`` resources or priorities, which
    Triton ignores otherwise.

    Raises:
        LaunchError: On a port, mode or file that is not valid, or an admin API that would be open to the network.
    """
    def port(name: str, default: int, *, off: bool = False) -> int:
        raw = os.environ.get(name, str(default))
        try:
            value = int(raw)
        except ValueError:
            raise LaunchError(f"{name}={raw!r} is not a port number") from None
        if not (0 if off else 1) <= value < 65536:
            raise LaunchError(f"{name}={raw!r} is outside {0 if off else 1}..65535")
        return value

    mode = os.environ.get("MODEL_CONTROL", "none")
    if explicit is not None:
        mode = "explicit" if explicit else "none"
    if mode not in ("none", "explicit", "poll"):
        raise LaunchError(f"MODEL_CONTROL={mode!r}: expected none, explicit or poll")
    raw_cache = os.environ.get("RESPONSE_CACHE_BYTES", "0")
    if not raw_cache.isdigit():
        raise LaunchError(f"RESPONSE_CACHE_BYTES={raw_cache!r}: expected a number of bytes (0 leaves it off)")
    rate_limit = os.environ.get("RATE_LIMIT") or ("execution_count" if uses_rate_limiter(model_repository) else "off")
    if rate_limit not in ("off", "execution_count"):
        raise LaunchError(f"RATE_LIMIT={rate_limit!r}: expected off or execution_count")
    tls = None
    if os.environ.get("GRPC_TLS_CERT") or os.environ.get("GRPC_TLS_KEY"):
        files = {name: os.environ.get(name, "") for name in ("GRPC_TLS_CERT", "GRPC_TLS_KEY")}
        missing = [f"{name}={value!r}" for name, value in files.items() if not value or not Path(value).is_file()]
        ca = os.environ.get("GRPC_TLS_CA") or None
        if ca is not None and not Path(ca).is_file():
            missing.append(f"GRPC_TLS_CA={ca!r}")
        if missing:
            raise LaunchError(f"gRPC TLS needs readable PEM files: {', '.join(missing)} not found")
        tls = GrpcTls(cert=Path(files["GRPC_TLS_CERT"]), key=Path(files["GRPC_TLS_KEY"]),
                      ca=Path(ca) if ca else None)
    health_port = port("HEALTH_PORT", 8003, off=True)
    return ServerOptions(model_repository=model_repository, http_port=port("HTTP_PORT", 8000),
                         grpc_port=port("GRPC_PORT", 8001), metrics_port=port("METRICS_PORT", 8002),
                         host=os.environ.get("HOST", "127.0.0.1"), model_control=mode,
                         load_models=tuple(load_models), response_cache_bytes=int(raw_cache),
                         rate_limit=rate_limit, admin_key=admin_key_from_env(), grpc_tls=tls,
                         supervisor=SupervisorOptions(health_port=health_port,
                                                      health_host=os.environ.get("HOST", "127.0.0.1")))


def admin_key_from_env() -> str | None:
    """The admin key: ``$COALESCE_ADMIN_KEY``, else the first line of ``$COALESCE_ADMIN_KEY_FILE``, else None.

    Raises:
        LaunchError: If the file cannot be read or holds no key.
    """
    key = os.environ.get(ADMIN_KEY_ENV, "").strip()
    if key:
        return key
    path = os.environ.get(ADMIN_KEY_FILE_ENV, "")
    if not path:
        return None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise LaunchError(f"{ADMIN_KEY_FILE_ENV}={path!r}: cannot read it ({exc.strerror})") from None
    if not lines or not lines[0].strip():
        raise LaunchError(f"{ADMIN_KEY_FILE_ENV}={path!r}: the file holds no key")
    return lines[0].strip()

