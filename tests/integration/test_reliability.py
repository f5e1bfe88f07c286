"""A model whose stub dies serves again by itself; the admin API is locked; gRPC speaks TLS.

One server of its own (it kills stubs): ``minilm`` and ``digits`` as shipped, explicit model control
with an admin key, gRPC with a certificate made for the test, the supervisor's health port.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from coalesce_tools.launcher import GrpcTls, ServerOptions, TritonServer, free_port
from coalesce_tools.processes import stub_processes
from coalesce_tools.supervisor import SupervisorOptions
from tests.certs import make_certificates
from tests.conftest import REPOSITORY, built
from tests.integration.conftest import add_model, start_server

pytestmark = pytest.mark.integration

ADMIN_KEY = "test-admin-key-0123456789"
TEXTS = ["the stub died", "and came back", "vectors must match", "ünïcödé too"]
#: Each call's own timeout; the test asserts none runs past it (+ 1 s of slack for the client).
CALL_TIMEOUT_S = 10.0
RECOVERY_LIMIT_S = 60.0


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, certificates):
    repo = tmp_path_factory.mktemp("guarded_repository")
    for name in ("minilm", "digits"):
        built(name)
        add_model(repo, name, source=REPOSITORY / name)
    options = ServerOptions.on_free_ports(
        repo,
        model_control="explicit",
        admin_key=ADMIN_KEY,
        grpc_tls=GrpcTls(cert=certificates.server_cert, key=certificates.server_key),
        supervisor=SupervisorOptions(health_port=free_port()),
    )
    triton = start_server(options)
    yield triton
    triton.stop()


def _get(
    url: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    timeout_s: float = 5.0,
) -> tuple[int, bytes]:
    request = urllib.request.Request(url, method=method, headers=headers or {}, data=body)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return 0, repr(exc).encode()


def _embed(url: str, texts: list[str]) -> np.ndarray:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url, connection_timeout=CALL_TIMEOUT_S, network_timeout=CALL_TIMEOUT_S)
    try:
        item = httpclient.InferInput("TEXT", [len(texts), 1], "BYTES")
        item.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=np.object_))
        return client.infer("minilm", [item], timeout=int(CALL_TIMEOUT_S * 1e6)).as_numpy("EMBEDDING")
    finally:
        client.close()


def _agree(got: np.ndarray, want: np.ndarray) -> bool:
    """Whether each vector is the one wanted: minilm serves INT8, whose vector for a text may differ in the third
    decimal with the rows beside it in a pass (and the row cache is empty after a reload)."""
    return got.shape == want.shape and float((got * want).sum(axis=1).min()) >= 0.99


def _model_ready(server: TritonServer, model: str) -> bool:
    return _get(f"http://{server.http_url}/v2/models/{model}/ready")[0] == 200


def test_a_killed_stub_is_replaced_and_serves_again(guarded):
    """SIGKILL the stub under 8 client threads: every call ends in time, the model is back and correct in 60 s."""
    from tritonclient.utils import InferenceServerException

    reference = _embed(guarded.http_url, TEXTS)
    health = f"http://127.0.0.1:{guarded.options.supervisor.health_port}"
    assert _get(f"{health}/ready")[0] == 200 and _get(f"{health}/live")[0] == 200

    stop = threading.Event()
    numbers = itertools.count()
    calls: list[tuple[float, float, str]] = []  # (start, seconds, outcome)
    lock = threading.Lock()

    def client_loop() -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                # The fixed texts come from the row cache until the kill; the new one is computed each time.
                got = _embed(guarded.http_url, [*TEXTS, f"a text of its own, {next(numbers)}"])
                outcome = "ok" if _agree(got[: len(TEXTS)], reference) else "WRONG VECTORS"
            except InferenceServerException as exc:
                outcome = f"error: {exc.message()}"
            except Exception as exc:  # a timeout or a dropped connection is a typed failure too, if in time
                outcome = f"{type(exc).__name__}: {exc}"
            with lock:
                calls.append((start, time.monotonic() - start, outcome))

    readiness: list[tuple[float, bool, bool]] = []  # (time, model ready, supervisor ready)

    def watch() -> None:
        while not stop.is_set():
            readiness.append((time.monotonic(), _model_ready(guarded, "minilm"), _get(f"{health}/ready")[0] == 200))
            time.sleep(0.1)

    threads = [threading.Thread(target=client_loop) for _ in range(8)] + [threading.Thread(target=watch)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(3)
        stubs = [s for s in stub_processes(guarded.pid) if s.model == "minilm"]
        assert stubs, "no stub of minilm found"
        killed_at = time.monotonic()
        for stub in stubs:
            os.kill(stub.pid, signal.SIGKILL)
        back_at = None
        while time.monotonic() - killed_at < RECOVERY_LIMIT_S + 5:
            recent = [c for c in list(calls) if c[0] > killed_at + 1 and c[2] == "ok"]
            if guarded.supervisor.recoveries and recent and _model_ready(guarded, "minilm"):
                back_at = min(c[0] + c[1] for c in recent)
                break
            time.sleep(0.25)
        time.sleep(2)  # a few calls after the recovery too
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=CALL_TIMEOUT_S + 5)
    assert back_at is not None, f"minilm did not serve again within {RECOVERY_LIMIT_S + 5:.0f} s:\n" + guarded.log_tail(
        60
    )
    assert back_at - killed_at <= RECOVERY_LIMIT_S, f"back after {back_at - killed_at:.1f} s"
    assert _agree(_embed(guarded.http_url, TEXTS), reference)
    # While it could not serve, readiness said so: Triton's for the model, the supervisor's for the server.
    during = [r for r in readiness if killed_at < r[0] < back_at]
    assert any(not model for _, model, _ in during), "the model was never reported not ready"
    assert any(not server for _, _, server in during), "the supervisor's /ready never said 503"
    assert readiness[-1][1] and readiness[-1][2], "ready again at the end"
    # No call ran past its timeout; every one got the reference's vectors, or an error.
    slow = [c for c in calls if c[1] > CALL_TIMEOUT_S + 1]
    assert not slow, slow[:5]
    wrong = [c for c in calls if c[2] == "WRONG VECTORS"]
    assert not wrong, wrong[:5]
    outcomes = sorted({c[2][:80] for c in calls})
    assert any(c[2] == "ok" and c[0] > back_at for c in calls), outcomes
    print(f"{len(calls)} calls; back {back_at - killed_at:.1f} s after the kill; outcomes: {outcomes}")


def test_admin_api_needs_the_key(guarded, certificates):
    """Unload without the key is refused (the model stays READY); with it, accepted; inference stays open."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    base = f"http://{guarded.http_url}/v2/repository"
    for path in ("/models/digits/unload", "/models/digits/load", "/index"):
        status, body = _get(base + path, method="POST", body=b"{}")
        assert status == 403, (path, status, body)
        assert b"admin-key" in body, body
    for path in ("/v2/models/stats", "/v2/logging", "/v2/trace/setting"):
        assert _get(f"http://{guarded.http_url}{path}")[0] == 403, path
    assert _model_ready(guarded, "digits")
    client = grpcclient.InferenceServerClient(guarded.grpc_url, ssl=True, root_certificates=str(certificates.ca))
    try:
        with pytest.raises(InferenceServerException, match="admin-key"):
            client.unload_model("digits")
        assert client.is_model_ready("digits")  # health and metadata stay open
        # gRPC names the header with a prefix: triton-grpc-protocol-<key>.
        client.unload_model("digits", headers={"triton-grpc-protocol-admin-key": ADMIN_KEY})
        deadline = time.monotonic() + 30
        while _model_ready(guarded, "digits") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _model_ready(guarded, "digits")
        status, body = _get(
            f"{base}/models/digits/load", method="POST", body=b"{}", headers={"admin-key": ADMIN_KEY}, timeout_s=120
        )
        assert status == 200, body
        assert _model_ready(guarded, "digits")
        assert not guarded.supervisor.recoveries or all(m != "digits" for m, _ in guarded.supervisor.recoveries)
    finally:
        client.close()


def test_grpc_tls_round_trip(guarded, certificates):
    """A gRPC call over TLS with the test's CA works; a plaintext one does not get through."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    image = np.random.default_rng(0).random((2, 8, 8), dtype=np.float32) * 16
    client = grpcclient.InferenceServerClient(guarded.grpc_url, ssl=True, root_certificates=str(certificates.ca))
    try:
        item = grpcclient.InferInput("image", [2, 8, 8], "FP32")
        item.set_data_from_numpy(image)
        logits = client.infer("digits", [item]).as_numpy("logits")
        assert logits.shape == (2, 10) and np.isfinite(logits).all()
    finally:
        client.close()
    plain = grpcclient.InferenceServerClient(guarded.grpc_url)
    try:
        with pytest.raises(InferenceServerException):
            plain.is_server_live(client_timeout=5)
    finally:
        plain.close()


def test_sigusr1_prints_a_stubs_stacks_to_the_server_log(server, http_client):
    """A stub sent SIGUSR1 prints its threads' Python stacks to the log (what a stuck unload is debugged with),
    and keeps serving."""
    stub = next(s for s in stub_processes(server.pid) if s.model == "minilm" and not s.dead)
    os.kill(stub.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while "most recent call first" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log_text()
    assert "most recent call first" in log and "model.py" in log, log[-2000:]
    assert http_client.is_model_ready("minilm")
    assert _embed(server.http_url, ["still serving"]).shape == (1, 384)
