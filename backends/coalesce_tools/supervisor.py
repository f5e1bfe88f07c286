"""Bring a model back after its Python-backend stub dies, and say when the server cannot serve.

When a stub process dies (SIGKILL, a segfault, the OOM killer), Triton 2.51 keeps the
model READY and answers every request with ``Stub process '<instance>' is not healthy.``
until an operator reloads it. The supervisor runs beside the server (in ``coalesce
serve`` and in the container) and does that reload itself:

1. every ``interval_s`` it lists the server's stub processes (``/proc``: children of the
   server whose program is ``triton_python_backend_stub``; the model is the folder of the
   ``model.py`` they run, the instance their eighth argument);
2. a stub seen alive that is now a zombie (exited, not reaped: Triton reaps the stubs it
   stops at once) on ``confirm_scans`` scans in a row marks its READY model dead;
3. each dead model is recovered on its own thread: it unloads the model through the
   repository API (from then on ``/v2/models/<m>/ready`` is false and new requests get
   Triton's "unavailable" error rather than a dead stub's), then loads it again from the
   repository until a load succeeds, pausing between failed loads for ``retry_first_s``,
   doubled after each failure up to ``retry_max_s``. It never gives up: an operator may
   fix the repository (a missing file, a broken config) and the next load serves the model.

Recovery is per model: while one model keeps failing to load, the scan goes on, so the
death of another model's stub is still detected and that model recovered at once.

The repository API needs explicit model control; the supervisor sends the admin key
header when the API is restricted. Its own HTTP endpoint (``health_port``) answers
``/ready`` with 200 only when Triton is ready and no model is dead or being recovered,
which is what a Kubernetes readiness probe needs: Triton's ``/v2/health/ready`` is 200
again as soon as a model is unloaded. ``/live`` is 200 while the server process runs.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

from coalesce_tools.processes import stub_processes


@dataclasses.dataclass(frozen=True)
class SupervisorOptions:
    """How often to look, how sure to be, how long a load may take, where to answer health probes."""

    #: Seconds between two scans of the stubs.
    interval_s: float = 1.0
    #: Scans in a row on which a stub must be dead before its model is reloaded (a stub that
    #: exits during a normal unload is reaped at once, so it is never seen twice).
    confirm_scans: int = 2
    #: Seconds one load through the repository API may take.
    load_timeout_s: float = 300.0
    #: First and largest pause between two failed loads of one model (doubling in between; retried until it loads).
    retry_first_s: float = 1.0
    retry_max_s: float = 30.0
    #: Port of the supervisor's own ``/ready`` and ``/live``; 0: none.
    health_port: int = 0
    health_host: str = "127.0.0.1"


class Supervisor:
    """Watches one server's stubs and reloads a model whose stub died; a context manager (a daemon thread)."""

    def __init__(self, server_pid: Callable[[], int | None], http_url: str, *,
                 headers: Mapping[str, str] | None = None, options: SupervisorOptions | None = None,
                 log: Callable[[str], None] = lambda line: None) -> None:
        """Prepare (not start) supervision of the server whose pid ``server_pid()`` gives, at ``http_url``."""
        self.options = options or SupervisorOptions()
        self._server_pid = server_pid
        self._base = f"http://{http_url}"
        self._headers = dict(headers or {})
        self._log = log
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._health: http.server.ThreadingHTTPServer | None = None
        self._lock = threading.Lock()
        #: Models being recovered (guarded by ``_lock``), each by its own thread in ``_workers``.
        self._recovering: set[str] = set()
        self._workers: dict[str, threading.Thread] = {}
        # Only the scan thread touches _known, _suspect and _handled (ready() reads _suspect).
        #: Every stub seen alive: pid → (model, instance). A zombie's own entry no longer names them.
        self._known: dict[int, tuple[str, str]] = {}
        #: Zombie stub pids → scans in a row they have been seen dead.
        self._suspect: dict[int, int] = {}
        #: Zombies whose model is being or was reloaded (Triton reaps them when the old instance goes).
        self._handled: set[int] = set()
        #: Models reloaded since start, in order (for logs and tests).
        self.recoveries: list[tuple[str, float]] = []

    # --- the repository API ------------------------------------------------------------------------------------

    def _call(self, method: str, path: str, body: bytes | None = None, timeout_s: float = 5.0) -> tuple[int, bytes]:
        request = urllib.request.Request(self._base + path, data=body, method=method, headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def model_states(self) -> dict[str, str]:
        """Each model of the repository index and its state (``READY``, ``UNAVAILABLE``, ``LOADING``...)."""
        status, body = self._call("POST", "/v2/repository/index", b"{}")
        if status != 200:
            raise RuntimeError(f"repository index answered {status}: {body[:200]!r}")
        states: dict[str, str] = {}
        for entry in json.loads(body):
            # Several versions: READY if any version is.
            if states.get(entry["name"]) != "READY":
                states[entry["name"]] = entry.get("state", "")
        return states

    def unload(self, model: str) -> None:
        """Ask Triton to unload ``model`` (the model is UNLOADING until its requests finish)."""
        try:
            status, body = self._call("POST", f"/v2/repository/models/{model}/unload",
                                      json.dumps({"parameters": {"unload_dependents": False}}).encode(),
                                      timeout_s=30.0)
        except (OSError, http.client.HTTPException) as exc:
            # A busy server may answer late or cut the answer short; the load that follows waits for it anyway.
            status, body = 0, repr(exc).encode()
        if status != 200:
            self._log(f"coalesce supervisor: unloading '{model}' answered {status}: {body[:200]!r}")

    # --- detection -------------------------------------------------------------------------------------------------

    def dead_models(self) -> set[str]:
        """One scan: the READY models with a stub that has been a zombie on ``confirm_scans`` scans in a row.

        A stub that exits in a normal unload or reload is reaped by Triton at once (it waits
        for it), so only a stub that died on its own stays a zombie. Stubs that come and go
        (the one Triton starts to auto-complete a config, the instances of a reload) are
        never suspects.
        """
        pid = self._server_pid()
        if pid is None:
            return set()
        stubs = stub_processes(pid)
        present = {stub.pid for stub in stubs}
        for stub in stubs:
            if not stub.dead:
                self._known[stub.pid] = (stub.model, stub.instance)
        self._known = {p: v for p, v in self._known.items() if p in present}
        self._handled &= present
        if not any(s.dead and s.pid in self._known and s.pid not in self._handled for s in stubs):
            self._suspect = {}
            return set()  # the common case costs one read of /proc, no call to the server
        with self._lock:
            recovering = set(self._recovering)
        states = self.model_states()
        suspects: dict[int, int] = {}
        dead: set[str] = set()
        for stub in stubs:
            if not stub.dead or stub.pid not in self._known or stub.pid in self._handled:
                continue
            model = self._known[stub.pid][0]
            if states.get(model) != "READY" or model in recovering:
                continue
            suspects[stub.pid] = self._suspect.get(stub.pid, 0) + 1
            if suspects[stub.pid] >= self.options.confirm_scans:
                dead.add(model)
        self._suspect = suspects
        return dead

    # --- recovery --------------------------------------------------------------------------------------------------

    def recover(self, model: str) -> None:
        """Unload ``model`` (readiness false at once), then load it again until a load succeeds or we stop.

        Blocks for as long as the model fails to load, so the scan loop runs it on the model's
        own thread (``_start_recovery``). Between failed loads it waits ``retry_first_s``,
        doubled after each failure up to ``retry_max_s``; ``stop()`` ends the wait at once.
        """
        started = time.monotonic()
        self._log(f"coalesce supervisor: a stub of model '{model}' died; unloading and loading it again")
        self.unload(model)
        pause_s = self.options.retry_first_s
        failures = 0
        while not self._stop.is_set():
            try:
                status, body = self._call("POST", f"/v2/repository/models/{model}/load", b"{}",
                                          timeout_s=self.options.load_timeout_s)
            except (OSError, http.client.HTTPException) as exc:  # no answer, or half of one: a failed load
                status, body = 0, repr(exc).encode()
            if status == 200:
                elapsed_s = time.monotonic() - started
                with self._lock:
                    self.recoveries.append((model, elapsed_s))
                self._log(f"coalesce supervisor: model '{model}' is serving again ({elapsed_s:.1f} s after "
                          "its stub was found dead)")
                return
            failures += 1
            if self._stop.is_set():
                return  # a load that was in flight when we were stopped: no retry to announce
            self._log(f"coalesce supervisor: loading '{model}' failed ({status}: {body[:300]!r}; failure "
                      f"{failures}); trying again in {pause_s:.1f} s")
            if self._stop.wait(pause_s):
                return
            pause_s = min(pause_s * 2, self.options.retry_max_s)

    def _start_recovery(self, model: str) -> None:
        """Recover ``model`` on a thread of its own (scan thread only), unless it is already being recovered."""
        with self._lock:
            # Under the lock, so that stop() either sees this thread to join or stops us before it starts; the
            # thread's own clean-up waits for the lock too, so it cannot run before the model is recorded.
            if self._stop.is_set() or model in self._recovering:
                return
            worker = threading.Thread(target=self._recover_on_own_thread, args=(model,),
                                      name=f"coalesce-recover-{model}", daemon=True)
            worker.start()
            self._recovering.add(model)
            self._workers[model] = worker
        # The model's old stubs are done with: their zombies must not mark the reloaded model dead again. Only
        # the pids known now: the stubs a reload starts get new pids, and their death is a new one.
        self._handled |= {p for p, (m, _) in self._known.items() if m == model}
        self._suspect = {p: n for p, n in self._suspect.items() if p not in self._handled}

    def _recover_on_own_thread(self, model: str) -> None:
        try:
            self.recover(model)
        except Exception as exc:  # the supervisor must outlive any one failure: it is the operator
            self._log(f"coalesce supervisor: reloading '{model}' failed: {exc!r}")
        finally:
            with self._lock:
                self._recovering.discard(model)
                self._workers.pop(model, None)

    def recovering(self) -> set[str]:
        """The models being recovered now (unloaded, or loading again)."""
        with self._lock:
            return set(self._recovering)

    def _run(self) -> None:
        while not self._stop.wait(self.options.interval_s):
            try:
                dead = self.dead_models()
            except Exception as exc:
                # The server is starting, stopping or busy: look again next interval.
                self._log_once(f"coalesce supervisor: scan failed: {exc!r}")
                continue
            for model in sorted(dead):
                try:
                    self._start_recovery(model)
                except Exception as exc:  # no thread to be had: the next scan finds the model dead again
                    self._log(f"coalesce supervisor: cannot start reloading '{model}': {exc!r}")

    _last_logged: str = ""

    def _log_once(self, line: str) -> None:
        if line != self._last_logged:
            self._last_logged = line
            self._log(line)

    # --- health ----------------------------------------------------------------------------------------------------

    def ready(self) -> bool:
        """Whether the server can serve every model: Triton ready, no model dead or being reloaded."""
        with self._lock:
            if self._recovering:
                return False
        if self._server_pid() is None or any(count for count in self._suspect.values()):
            return False
        try:
            return self._call("GET", "/v2/health/ready", timeout_s=2.0)[0] == 200
        except (OSError, urllib.error.URLError):
            return False

    def _serve_health(self) -> None:
        supervisor = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/ready"):
                    ok = supervisor.ready()
                elif self.path.startswith("/live"):
                    ok = supervisor._server_pid() is not None
                else:
                    self.send_error(404, "try /ready or /live")
                    return
                self.send_response(200 if ok else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                return  # probes every few seconds would flood the log

        self._health = http.server.ThreadingHTTPServer((self.options.health_host, self.options.health_port),
                                                       Handler)
        self._health.daemon_threads = True
        threading.Thread(target=self._health.serve_forever, name="coalesce-health", daemon=True).start()

    def start(self) -> Supervisor:
        """Start scanning (and answering health probes, when ``health_port`` is set)."""
        if self.options.health_port:
            self._serve_health()
        self._thread = threading.Thread(target=self._run, name="coalesce-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop scanning, recovering and answering probes.

        A recovery waiting between two loads ends at once. One whose load call is in flight
        is waited for a few seconds at most; its (daemon) thread ends when that call
        returns, without trying again.
        """
        self._stop.set()
        if self._health is not None:
            self._health.shutdown()
            self._health.server_close()
        deadline = time.monotonic() + self.options.interval_s + 5
        if self._thread is not None:
            self._thread.join(timeout=self.options.interval_s + 5)  # a scan may be reading the index
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> Supervisor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
