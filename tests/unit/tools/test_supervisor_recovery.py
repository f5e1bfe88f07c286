"""The supervisor recovers each dead model on its own: one that never loads holds no other hostage.

Detection reads a ``/proc`` laid out as Linux lays it out (stubs turn into zombies when the
test "kills" them); the repository API is a small HTTP server in the test that answers as
Triton's does, and fails the loads of a model until the test says it is fixed.
"""

from __future__ import annotations

import http.server
import itertools
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import coalesce_tools.supervisor as supervisor_module
from coalesce_tools.launcher import free_port
from coalesce_tools.processes import stub_processes
from coalesce_tools.supervisor import Supervisor, SupervisorOptions
from tests.unit.tools.test_supervisor import SERVER_PID, _process, _stub_argv

#: Fast settings: a scan every 20 ms, pauses of 0.1, 0.2, then 0.4 s at most between failed loads.
FAST = SupervisorOptions(interval_s=0.02, confirm_scans=2, load_timeout_s=5.0, retry_first_s=0.1, retry_max_s=0.4)


class Repository:
    """Triton's repository and health API for a few models; a model named in ``broken`` fails to load."""

    def __init__(self, models: list[str]) -> None:
        self.states = dict.fromkeys(models, "READY")
        #: Models whose next loads fail, each with how many more times (-1: until the test removes it).
        self.broken: dict[str, int] = {}
        #: Every load: (model, monotonic seconds when it arrived, status answered).
        self.loads: list[tuple[str, float, int]] = []
        self.lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None

    def attempts(self, model: str) -> list[tuple[float, int]]:
        """``model``'s loads so far: (arrival, status)."""
        with self.lock:
            return [(at, status) for m, at, status in self.loads if m == model]

    def failures(self, model: str) -> int:
        return sum(status != 200 for _, status in self.attempts(model))

    def _answer(self, method: str, path: str) -> tuple[int, object]:
        if method == "GET" and path == "/v2/health/ready":
            return 200, {}
        if method == "POST" and path == "/v2/repository/index":
            with self.lock:
                return 200, [{"name": m, "version": "1", "state": s} for m, s in self.states.items()]
        action = re.fullmatch(r"/v2/repository/models/([^/]+)/(load|unload)", path)
        if method != "POST" or action is None:
            return 404, {"error": f"no {method} {path}"}
        model, verb = action.groups()
        with self.lock:
            if verb == "unload":
                self.states[model] = "UNAVAILABLE"
                return 200, {}
            left = self.broken.get(model, 0)
            if left:
                self.broken[model] = left - 1 if left > 0 else left
            status = 400 if left else 200
            self.states[model] = "UNAVAILABLE" if left else "READY"
            self.loads.append((model, time.monotonic(), status))
        return status, ({"error": f"failed to load '{model}': the test broke it"} if left else {})

    def start(self) -> str:
        """Serve on a free loopback port; the ``host:port`` a supervisor is given."""
        repository = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _reply(self, method: str) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, answer = repository._answer(method, self.path)
                body = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._reply("GET")

            def do_POST(self) -> None:
                self._reply("POST")

            def log_message(self, format: str, *args: object) -> None:
                return

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return f"127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class Proc:
    """A fake ``/proc`` holding the server's stubs; each change is one atomic file replace, as a scan may read it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "self").mkdir(parents=True)

    def start_stub(self, pid: int, model: str) -> None:
        _process(self.root, pid, SERVER_PID, "S", _stub_argv(model, f"{model}_0"), "triton_python_b")

    def kill(self, pid: int) -> None:
        """The stub exits and stays a zombie (not reaped), as a SIGKILLed stub under Triton 2.51 does."""
        stat = self.root / str(pid) / "stat"
        temporary = stat.with_name("stat.new")
        temporary.write_text(f"{pid} (triton_python_b) Z {SERVER_PID} 1 1 0 -1 4194564 90 0 0 0\n")
        os.replace(temporary, stat)


@pytest.fixture()
def repository() -> Iterator[Repository]:
    repo = Repository(["a", "b"])
    yield repo
    repo.stop()


@pytest.fixture()
def proc(tmp_path, monkeypatch) -> Proc:
    fake = Proc(tmp_path / "proc")
    monkeypatch.setattr(supervisor_module, "stub_processes", lambda pid: stub_processes(pid, fake.root))
    return fake


def _until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s} s")
        time.sleep(0.01)


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _recovered(supervisor: Supervisor, model: str) -> int:
    return sum(m == model for m, _ in supervisor.recoveries)


def test_a_model_that_keeps_failing_to_load_delays_no_other_model(repository, proc):
    """While a's loads fail, b dies twice and is back each time, and a's old zombie is never taken for a new death."""
    repository.broken["a"] = -1
    proc.start_stub(10, "a")
    proc.start_stub(20, "b")
    port = free_port()
    options = SupervisorOptions(**{**FAST.__dict__, "health_port": port})
    lines: list[str] = []
    with Supervisor(lambda: SERVER_PID, repository.start(), options=options, log=lines.append) as supervisor:
        _until(lambda: 10 in supervisor._known and 20 in supervisor._known, 5, "both stubs seen alive")
        assert _health(port) == 200
        proc.kill(10)
        _until(lambda: repository.failures("a") >= 1, 5, "a's first load (which fails)")
        assert _health(port) == 503

        for round_, pid in enumerate((20, 21), start=1):
            proc.kill(pid)
            _until(lambda r=round_: _recovered(supervisor, "b") == r, 5,
                   f"b's recovery #{round_} while a keeps failing to load")
            assert _recovered(supervisor, "a") == 0 and supervisor.recovering() == {"a"}
            assert _health(port) == 503, "a is still being recovered: not ready"
            proc.start_stub(pid + 1, "b")  # the instance b's reload started
            _until(lambda p=pid + 1: p in supervisor._known, 5, "b's new stub seen alive")

        _until(lambda: repository.failures("a") >= 3, 5, "a's loads are tried again")
        del repository.broken["a"]  # an operator fixed the repository
        _until(lambda: _recovered(supervisor, "a") == 1, 5, "a's recovery once it loads")
        assert supervisor.recovering() == set()
        assert _health(port) == 200
        # a's first stub is still a zombie (Triton has not reaped it): it was dealt with, it is no new death.
        time.sleep(0.2)
        assert _recovered(supervisor, "a") == 1 and repository.states["a"] == "READY"
        # The stub a's reload started is a new one: its death is a new one, recovered at once.
        proc.start_stub(11, "a")
        _until(lambda: 11 in supervisor._known, 5, "a's new stub seen alive")
        proc.kill(11)
        _until(lambda: _recovered(supervisor, "a") == 2, 5, "a's second recovery")
    assert _recovered(supervisor, "b") == 2
    assert any("loading 'a' failed" in line for line in lines), lines


def test_failed_loads_are_retried_with_doubling_pauses_up_to_the_cap(repository, proc):
    """Five failed loads, then one that works: pauses 0.1, 0.2, 0.4, 0.4, 0.4 s; the model is back, once."""
    repository.broken["a"] = 5
    proc.start_stub(10, "a")
    with Supervisor(lambda: SERVER_PID, repository.start(), options=FAST) as supervisor:
        _until(lambda: 10 in supervisor._known, 5, "a's stub seen alive")
        proc.kill(10)
        _until(lambda: _recovered(supervisor, "a") == 1, 10, "a's recovery after 5 failed loads")
    attempts = repository.attempts("a")
    assert [status for _, status in attempts] == [400] * 5 + [200]
    pauses_s = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(attempts)]
    expected_s = [0.1, 0.2, 0.4, 0.4, 0.4]
    # Never shorter than the back-off (a wait does not end early); longer only by a loaded machine's slack.
    assert all(e * 0.95 <= p <= e + 0.3 for p, e in zip(pauses_s, expected_s, strict=True)), pauses_s


def test_stop_ends_a_recovery_waiting_between_loads_at_once(repository, proc):
    """A model that never loads, in a 30 s pause: stop() returns at once, and no supervisor thread is left."""
    repository.broken["a"] = -1
    proc.start_stub(10, "a")
    lines: list[str] = []
    options = SupervisorOptions(**{**FAST.__dict__, "retry_first_s": 30.0, "retry_max_s": 60.0})
    supervisor = Supervisor(lambda: SERVER_PID, repository.start(), options=options, log=lines.append).start()
    try:
        _until(lambda: 10 in supervisor._known, 5, "a's stub seen alive")
        proc.kill(10)
        _until(lambda: any("loading 'a' failed" in line for line in lines), 5, "a's first failed load")
        time.sleep(0.1)  # into the 30 s pause that follows
    finally:
        started = time.monotonic()
        supervisor.stop()
        stopped_s = time.monotonic() - started
    assert stopped_s < 1.0, f"stop() took {stopped_s:.1f} s"
    assert supervisor._thread is not None and not supervisor._thread.is_alive()
    assert not [t.name for t in threading.enumerate() if t.name == "coalesce-recover-a"]
    time.sleep(0.2)
    assert repository.failures("a") == 1  # nothing tried again after stop()
