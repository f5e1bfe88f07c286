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
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Final

from coalesce_tools.config import ConfigReadError, parameter, read_model_config

CONTAINER_ROOT: Final = Path("/opt/tritonserver")
#: Folder holding ``model.py`` (the adapter) and the ``coalesce`` package.
BACKEND_SOURCE: Final = Path(__file__).resolve().parent.parent / "coalesce"
LOG_TAIL_LINES: Final = 40
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
class ServerOptions:
    """How to start the server."""

    model_repository: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "0.0.0.0"
    model_control: str = "none"
    load_models: tuple[str, ...] = ()
    log_verbose: int = 0
    #: Bytes of Triton's own response cache (``--cache-config=local,size=...``); 0 leaves it off.
    #: Models opt in with ``response_cache { enable: true }``.
    response_cache_bytes: int = 0
    #: Triton's rate limiter (``--rate-limit``): ``off``, or ``execution_count`` to honour the ``rate_limiter``
    #: resources and priorities of the models' instance groups.
    rate_limit: str = "off"
    extra_args: tuple[str, ...] = ()
    ready_timeout_s: float = 180.0


def library_path(*extra: Path | str) -> str:
    """``LD_LIBRARY_PATH`` for a Triton server: this interpreter's libpython first, then ``extra``, then the current.

    The Python-backend stub links libpython3.X: this interpreter's own must win over a system
    copy of another patch release, whose ``_thread`` would not match the stdlib it loads.
    """
    parts = [sysconfig.get_config_var("LIBDIR") or "", *map(str, extra), os.environ.get("LD_LIBRARY_PATH", "")]
    return ":".join(p for p in parts if p)


def _set_parent_death_signal() -> None:
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

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP endpoint."""
        return f"127.0.0.1:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC endpoint."""
        return f"127.0.0.1:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """URL of the Prometheus metrics."""
        return f"http://127.0.0.1:{self.options.metrics_port}/metrics"

    def command(self) -> list[str]:
        """The ``tritonserver`` command line."""
        o = self.options
        args = [
            str(self.install.server),
            f"--model-repository={o.model_repository.resolve()}",
            f"--backend-directory={self._workdir / 'backends'}",
            f"--http-address={o.host}", f"--grpc-address={o.host}", f"--metrics-address={o.host}",
            f"--http-port={o.http_port}", f"--grpc-port={o.grpc_port}", f"--metrics-port={o.metrics_port}",
            f"--model-control-mode={o.model_control}",
            f"--log-verbose={o.log_verbose}",
            "--exit-timeout-secs=15",
        ]
        if self.install.cache_dir is not None:
            args.append(f"--cache-directory={self.install.cache_dir}")
        if o.response_cache_bytes > 0:
            args.append(f"--cache-config=local,size={o.response_cache_bytes}")
        if o.rate_limit != "off":
            args.append(f"--rate-limit={o.rate_limit}")
        args += [f"--load-model={name}" for name in o.load_models]
        return args + list(o.extra_args)

    def environment(self) -> dict[str, str]:
        """Environment of the server: our Python first on PATH, its libpython first on the library path."""
        env = dict(os.environ)
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
        assemble_backend_dir(self.install, self._workdir / "backends")
        self._process = subprocess.Popen(
            self.command(), env=self.environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace", bufsize=1, start_new_session=True,
            preexec_fn=_set_parent_death_signal)
        self._reader = threading.Thread(target=self._read_output, name="tritonserver-log", daemon=True)
        self._reader.start()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

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

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Stop with SIGINT (Triton's graceful shutdown), then SIGKILL after ``timeout_s``."""
        process = self._process
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            if self._reader is not None:
                self._reader.join(timeout=5)
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


def _answers_ping(port: int, timeout_s: float = 0.5) -> bool:
    """Whether a Redis on loopback ``port`` answers PING (plain RESP over a socket, no client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisServer:
    """A local ``redis-server`` (Debian's package) for the shared cache tier; a context manager.

    Runs without persistence, bounded by ``maxmemory`` with LRU eviction: it is a cache,
    and losing it only costs recomputation.
    """

    def __init__(self, port: int | None = None, *, maxmemory: str = "1gb") -> None:
        """Prepare (not start) a server on loopback ``port`` (a free one if None).

        Raises:
            LaunchError: If ``redis-server`` is not installed.
        """
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).is_file():
            raise LaunchError("redis-server is not installed: `make setup` installs it (Debian: apt-get install "
                              "redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self._process: subprocess.Popen[bytes] | None = None
        self._log = Path(tempfile.mkstemp(prefix="coalesce-redis-", suffix=".log")[1])

    @property
    def url(self) -> str:
        """``redis://`` URL of the server."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> RedisServer:
        """Start it and wait until it answers PING.

        Raises:
            LaunchError: If it exits or does not answer in time; the message has its log.
        """
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--daemonize", "no"]
        with self._log.open("ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                             preexec_fn=_set_parent_death_signal)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise LaunchError(f"redis-server exited with code {self._process.returncode}: "
                                  f"{self._log.read_text(errors='replace')[-2000:]}")
            if _answers_ping(self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise LaunchError(f"redis-server on port {self.port} did not answer within {timeout_s:.0f} s")

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

    Remote URLs and Redis servers already running are left alone. The caller stops the
    returned servers.

    Raises:
        LaunchError: If a needed server cannot be started.
    """
    started: list[RedisServer] = []
    try:
        for url in redis_urls(model_repository):
            port = local_redis_port(url)
            if port is not None and not _answers_ping(port):
                started.append(RedisServer(port).start())
    except BaseException:
        for server in started:
            server.stop()
        raise
    return started


def options_from_env(model_repository: Path, *, explicit: bool | None = None,
                     load_models: Sequence[str] = ()) -> ServerOptions:
    """Options from the environment: ports, model control, Triton's response cache and rate limiter.

    ``HTTP_PORT``, ``GRPC_PORT``, ``METRICS_PORT``, ``MODEL_CONTROL``, ``RESPONSE_CACHE_BYTES``, ``RATE_LIMIT``.

    ``RATE_LIMIT`` (``off`` or ``execution_count``) defaults to ``execution_count`` when a
    model of the repository declares ``rate_limiter`` resources or priorities, which
    Triton ignores otherwise.

    Raises:
        LaunchError: On a port or mode that is not valid.
    """
    def port(name: str, default: int) -> int:
        raw = os.environ.get(name, str(default))
        try:
            value = int(raw)
        except ValueError:
            raise LaunchError(f"{name}={raw!r} is not a port number") from None
        if not 0 < value < 65536:
            raise LaunchError(f"{name}={raw!r} is outside 1..65535")
        return value

    mode = os.environ.get("MODEL_CONTROL", "none")
    if explicit is not None:
        mode = "explicit" if explicit else "none"
    if mode not in ("none", "explicit", "poll"):
        raise LaunchError(f"MODEL_CONTROL={mode!r}: expected none, explicit or poll")
    loads = tuple(load_models)
    if mode == "explicit" and not loads:
        loads = ("*",)  # explicit control still serves the whole repository at start
    raw_cache = os.environ.get("RESPONSE_CACHE_BYTES", "0")
    if not raw_cache.isdigit():
        raise LaunchError(f"RESPONSE_CACHE_BYTES={raw_cache!r}: expected a number of bytes (0 leaves it off)")
    rate_limit = os.environ.get("RATE_LIMIT") or ("execution_count" if uses_rate_limiter(model_repository) else "off")
    if rate_limit not in ("off", "execution_count"):
        raise LaunchError(f"RATE_LIMIT={rate_limit!r}: expected off or execution_count")
    return ServerOptions(model_repository=model_repository, http_port=port("HTTP_PORT", 8000),
                         grpc_port=port("GRPC_PORT", 8001), metrics_port=port("METRICS_PORT", 8002),
                         model_control=mode, load_models=loads, response_cache_bytes=int(raw_cache),
                         rate_limit=rate_limit)
