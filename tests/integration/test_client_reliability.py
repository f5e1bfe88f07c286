"""The client against servers that go away and come back, and against a secured server (mutual TLS, headers).

Each test here starts its own tritonserver serving ``minilm`` alone (a fixed cost model, so it
loads without calibrating): the restart test stops and starts one, and the secured server
takes TLS and restriction flags through ``ServerOptions.extra_args``.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from coalesce_client import (
    AccessDeniedError,
    AsyncEmbeddingClient,
    ClientError,
    EmbeddingClient,
    RequestTimeoutError,
    RetryPolicy,
    ServerUnavailableError,
    TlsOptions,
)
from coalesce_tools.launcher import ServerOptions, TritonServer
from tests.conftest import ROOT
from tests.integration.conftest import FIXED_COST, add_model, start_server

MODEL = "minilm"
TEXTS = ["the server restarts", "calls carry on", "vectors stay the same", "x"]
#: The restriction's header on the secured server: Triton expects it as the HTTP header ``authorization``
#: and, for gRPC, as the metadata ``triton-grpc-protocol-authorization``.
AUTH_HEADER = "authorization"
AUTH_VALUE = "Bearer s3cret"
GRPC_AUTH_HEADER = f"triton-grpc-protocol-{AUTH_HEADER}"


def auth(protocol: str, value: str = AUTH_VALUE) -> dict[str, str]:
    return {GRPC_AUTH_HEADER if protocol == "grpc" else AUTH_HEADER: value}


@pytest.fixture(scope="module")
def minilm_repository(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("minilm_alone")
    add_model(repo, MODEL, parameters={"cost_model": FIXED_COST})
    return repo


def reap_stubs(repository: Path) -> None:
    """Kill Python-backend stubs still serving ``repository`` after their servers stopped, and say so.

    Seen once on 2.51: a server stopped under load left its model's stub running, orphaned.
    That is the server's business, not the client's; the test only cleans up after it.
    """
    import os
    import signal
    import warnings

    time.sleep(1)  # stubs exiting with their server
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if command and command[0].endswith(b"triton_python_backend_stub") and \
                any(str(repository).encode() in part for part in command):
            warnings.warn(pytest.PytestWarning(f"a stub outlived its server: pid {entry.name}, killed"),
                          stacklevel=1)
            os.kill(int(entry.name), signal.SIGKILL)


# --- restart under load -------------------------------------------------------------------------------------


class Calls:
    """What every call of every worker did: (started, ended, vectors or error), on one clock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[tuple[str, float, float, np.ndarray | BaseException]] = []

    def add(self, who: str, started: float, outcome: np.ndarray | BaseException) -> None:
        with self.lock:
            self.records.append((who, started, time.monotonic(), outcome))


def sync_worker(client: EmbeddingClient, who: str, calls: Calls, stop: threading.Event) -> None:
    while not stop.is_set():
        started = time.monotonic()
        try:
            calls.add(who, started, client.embed(TEXTS))
        except BaseException as exc:  # recorded and judged by the test
            calls.add(who, started, exc)


def async_worker(protocol: str, url: str, timeout_s: float, retry: RetryPolicy, who: str, calls: Calls,
                 stop: threading.Event) -> None:
    async def loop(client: AsyncEmbeddingClient, name: str) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                calls.add(name, started, await client.embed(TEXTS))
            except BaseException as exc:  # recorded and judged by the test
                calls.add(name, started, exc)

    async def main() -> None:
        async with AsyncEmbeddingClient(url, protocol=protocol, timeout_s=timeout_s, retry=retry) as client:
            await asyncio.gather(loop(client, f"{who}-a"), loop(client, f"{who}-b"))

    asyncio.run(main())


def test_calls_during_a_restart_answer_right_or_fail_typed_within_their_deadline(minilm_repository):
    # Under load Triton's graceful stop waits out its exit timeout (clients keep connections open): keep it short.
    options = ServerOptions.on_free_ports(minilm_repository, extra_args=("--exit-timeout-secs=3",))
    first = start_server(options)
    second: TritonServer | None = None
    calls, stop = Calls(), threading.Event()
    # Two kinds of caller: a short deadline with the default policy (it fails while the server is away),
    # and a long one with many quick retries (it rides the restart out).
    short = (3.0, RetryPolicy())
    patient = (90.0, RetryPolicy(max_attempts=1000, base_delay_s=0.05, max_delay_s=0.5))
    clients: list[EmbeddingClient] = []
    threads: list[threading.Thread] = []
    try:
        with EmbeddingClient(first.grpc_url) as client:
            want = client.embed(TEXTS)
        for protocol in ("grpc", "http"):
            url = first.grpc_url if protocol == "grpc" else first.http_url
            for kind, (timeout_s, retry) in (("short", short), ("patient", patient)):
                client = EmbeddingClient(url, protocol=protocol, timeout_s=timeout_s, retry=retry)
                clients.append(client)
                for i in range(2):  # two threads share one client
                    threads.append(threading.Thread(target=sync_worker, name=f"sync-{protocol}-{kind}-{i}",
                                                    args=(client, f"sync-{protocol}-{kind}", calls, stop)))
                threads.append(threading.Thread(target=async_worker, name=f"async-{protocol}-{kind}",
                                                args=(protocol, url, timeout_s, retry, f"async-{protocol}-{kind}",
                                                      calls, stop)))
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        stopped_at = time.monotonic()
        first.stop()  # SIGINT; its exit code is Triton's business (past the exit timeout it may end by a signal)
        time.sleep(1.0)
        second = start_server(options)  # the same ports
        back_at = time.monotonic()
        time.sleep(3.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=patient[0] + 5)
        for client in clients:
            client.close()
        alive = [t.name for t in threads if t.is_alive()]
        if second is not None:
            second.stop()
        first.stop()
        reap_stubs(minilm_repository)
    assert not alive, f"calls hung: {alive}"

    limits = {"short": short[0], "patient": patient[0]}
    errors: Counter[str] = Counter()
    for who, started, ended, outcome in calls.records:
        limit = limits[who.split("-")[2]]
        assert ended - started <= limit + 1.0, f"{who}: a call took {ended - started:.1f} s (deadline {limit} s)"
        if isinstance(outcome, BaseException):
            assert isinstance(outcome, ClientError), f"{who}: untyped {type(outcome).__name__}: {outcome}"
            errors[f"{who.split('-')[2]} {type(outcome).__name__}: {re.sub(r'[0-9.:]+', '#', str(outcome))[:120]}"] += 1
        else:
            np.testing.assert_allclose(outcome, want, atol=1e-4, err_msg=who)
    print("errors seen during the restart:", dict(errors))
    for who in {who for who, *_ in calls.records}:
        mine = [r for r in calls.records if r[0] == who]
        assert any(not isinstance(o, BaseException) and s >= back_at for _, s, _, o in mine), \
            f"{who}: no right answer after the restart"
    # The patient callers' retries bridged the outage: calls begun while the server was away were answered.
    bridged = [who for who, started, _, outcome in calls.records
               if "patient" in who and stopped_at < started < back_at and not isinstance(outcome, BaseException)]
    assert bridged, "no patient call begun during the outage was answered"
    # Their retries never gave up early: no patient call ended unanswered with time and attempts to spare.
    gave_up = [f"{who}: {o!r}" for who, _, _, o in calls.records
               if "patient" in who and isinstance(o, ServerUnavailableError | RequestTimeoutError)]
    assert not gave_up, gave_up[:5]


# --- a secured server: mutual TLS on gRPC, inference restricted to a header --------------------------------


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(folder: Path) -> Path:
    """A CA, and a server (for 127.0.0.1 / localhost) and client pair signed by it, as PEM files in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=coalesce test CA",
            "-keyout", "ca.key", "-out", "ca.pem", cwd=folder)
    (folder / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (folder / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                "-out", f"{name}.csr", cwd=folder)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=folder)
    return folder


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Path:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def secured(minilm_repository, certificates) -> Iterator[TritonServer]:
    c = certificates
    restriction = f"inference:{AUTH_HEADER}={AUTH_VALUE}"
    options = ServerOptions.on_free_ports(
        minilm_repository, model_control="explicit",  # on loopback: statistics open, for `load`
        extra_args=("--grpc-use-ssl=true", "--grpc-use-ssl-mutual=true", f"--grpc-server-cert={c / 'server.pem'}",
                    f"--grpc-server-key={c / 'server.key'}", f"--grpc-root-cert={c / 'ca.pem'}",
                    f"--grpc-restricted-protocol={restriction}", f"--http-restricted-api={restriction}"))
    triton = start_server(options)
    yield triton
    triton.stop()


def mutual(c: Path) -> TlsOptions:
    return TlsOptions(ca_cert=c / "ca.pem", client_cert=c / "client.pem", client_key=c / "client.key")


ONCE = RetryPolicy(max_attempts=1)


def test_grpc_mutual_tls_round_trip_with_the_header(secured, certificates):
    with EmbeddingClient(secured.grpc_url, tls=mutual(certificates), headers=auth("grpc")) as client:
        vectors = client.embed(TEXTS)
    with EmbeddingClient(secured.http_url, protocol="http", headers=auth("http")) as client:
        over_http = client.embed(TEXTS)
    assert vectors.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(vectors, over_http, atol=1e-4)


def test_async_client_over_mutual_tls_with_the_header(secured, certificates):
    async def main() -> np.ndarray:
        async with AsyncEmbeddingClient(secured.grpc_url, tls=mutual(certificates), headers=auth("grpc")) as client:
            return await client.embed(TEXTS)

    assert asyncio.run(main()).shape == (len(TEXTS), 384)


@pytest.mark.parametrize("tls", ["none", "server-only", "wrong-ca"])
def test_grpc_without_the_clients_certificate_is_refused(secured, certificates, tmp_path, tls):
    options = {"none": None, "server-only": TlsOptions(ca_cert=certificates / "ca.pem"),
               "wrong-ca": TlsOptions(ca_cert=make_certificates(tmp_path / "other") / "ca.pem")}[tls]
    with EmbeddingClient(secured.grpc_url, tls=options, headers=auth("grpc"), timeout_s=5,
                         retry=ONCE) as client, pytest.raises(ServerUnavailableError):
        client.embed(TEXTS)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_header_reaches_the_server(secured, certificates, protocol):
    url = secured.grpc_url if protocol == "grpc" else secured.http_url
    tls = mutual(certificates) if protocol == "grpc" else None
    with EmbeddingClient(url, protocol=protocol, tls=tls, timeout_s=10) as client, \
            pytest.raises(AccessDeniedError, match="is restricted, expecting header"):
        client.embed(TEXTS)  # not retried: the default policy would retry an unavailable server
    with EmbeddingClient(url, protocol=protocol, tls=tls, headers=auth(protocol, "Bearer wrong"), timeout_s=10) \
            as client, pytest.raises(AccessDeniedError):
        client.embed(TEXTS)
    name, value = next(iter(auth(protocol).items()))
    with EmbeddingClient(url, protocol=protocol, tls=tls, headers={name.upper(): value}) as client:
        assert client.embed(TEXTS).shape == (len(TEXTS), 384)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "coalesce_client.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_cli_over_mutual_tls_with_the_header_from_the_environment(secured, certificates):
    c = certificates
    tls = ["--ca-cert", str(c / "ca.pem"), "--client-cert", str(c / "client.pem"),
           "--client-key", str(c / "client.key")]
    done = run_cli("--url", secured.grpc_url, *tls, "--header-env", f"{GRPC_AUTH_HEADER}=TRITON_AUTH", "embed", "hello",
                   env={"TRITON_AUTH": AUTH_VALUE})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dim"] == 384
    done = run_cli("--url", secured.grpc_url, *tls, "--header-env", f"{GRPC_AUTH_HEADER}=TRITON_AUTH", "load",
                   "--requests", "4", "--concurrency", "2", env={"TRITON_AUTH": AUTH_VALUE})
    assert done.returncode == 0, done.stderr  # its statistics are read over TLS too
    assert json.loads(done.stdout)["inference_count"] == 4
    done = run_cli("--url", secured.grpc_url, *tls, "--max-attempts", "1", "embed", "hello")
    assert done.returncode == 1 and "AccessDeniedError" in done.stderr, done.stderr


def test_the_readme_tls_snippet_runs_as_written(secured, certificates):
    readme = (ROOT / "client" / "README.md").read_text()
    (snippet,) = re.findall(r"```python\n(from coalesce_client import EmbeddingClient, TlsOptions\n.*?)```",
                            readme, re.S)
    code = (snippet.replace("triton.internal:8001", secured.grpc_url).replace("certs/", f"{certificates}/")
            .replace("Bearer <token>", AUTH_VALUE))
    scope: dict[str, object] = {}
    exec(code, scope)  # the README's own code, as a user runs it
    assert scope["vectors"].shape == (1, 384)
