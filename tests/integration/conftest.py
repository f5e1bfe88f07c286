"""A real tritonserver for the integration tests, on free ports, with explicit model control.

The repository is a temporary copy of every example model of ``model_repository/``
(one per task; build outputs linked, not copied), the test-only models of ``tests/models/``
and test-only variants; broken-config
tests add models to it and load them through the repository API. Every model is served
together by one server, as a user's repository would be. The server is always stopped,
and its log is shown when a test fails.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from coalesce_tools.launcher import LaunchError, ServerOptions, TritonServer
from perf.repository import with_parameters
from tests.conftest import EXAMPLE_MODELS, GENERATE_MODELS, MODEL_DIR, REPOSITORY, TEST_MODELS, built, model_dir

#: Test-only variant: waits up to 2 s for exactly 6 requests, so a test can put 6 requests in one execute().
WIDE_MODEL = "minilm_wide"
WIDE_BATCH = 6


#: Test-only variant of tinylm (tests/models/) with a KV cache of 16 blocks of 16 tokens (256 tokens) and 300 ms of
#: waiting for it.
TIGHT_MODEL = "tinylm_tight"
TIGHT_PARAMETERS = {"kv_cache_bytes": str(4096 * 16 * 16), "max_queue_wait_ms": "300", "max_sequence_length": "256"}

#: A fixed cost model for test-only variants: they load without calibrating (seconds each on 2 cores).
FIXED_COST = "0.003,0.0001,0"

#: Parameters of a minilm variant that serves the FP32 graph, bit for bit as exported, with no row cache: for a
#: test that compares exact vectors or counts every row the model computes. Every other copy of an example model
#: is served as shipped (minilm: INT8 and a 64 MiB row cache), unless a test sets parameters and says why.
FP32_NO_CACHE = {"precision": "fp32", "cache_bytes": "0"}
#: Test-only variant: minilm in FP32 without a row cache (FP32_NO_CACHE), the exact reference for vector tests.
EXACT_MODEL = "minilm_fp32"
#: Test-only variant: minilm forced to precision int8 (the shipped `auto` serves INT8 only where it pays on the
#: CPU), so the INT8 graph's accuracy contract is checked on every machine.
INT8_MODEL = "minilm_int8"


def add_model(
    repo: Path,
    name: str,
    *,
    replace: dict[str, str] | None = None,
    source: Path = MODEL_DIR,
    parameters: dict[str, str] | None = None,
    wide: int = 0,
    version_dir: Path | None = None,
) -> Path:
    """Copy ``source``'s config, as shipped, into ``repo/name`` with text replacements; link its version files.

    ``replace`` patterns apply to the shipped text first (regular expressions, each must match).

    ``parameters`` are set in the config's (added, or replacing a shipped value); ``wide`` > 0
    makes Triton wait up to 2 s for exactly that many requests, so a test can put them in one
    ``execute``. ``version_dir`` holds the files linked into version 1 (default: ``source``'s own).
    """
    text = (source / "config.pbtxt").read_text()
    text = text.replace(f'name: "{source.name}"', f'name: "{name}"')
    for pattern, new in (replace or {}).items():
        text, count = re.subn(pattern, new, text, flags=re.S)
        assert count, f"pattern {pattern!r} not found in config"
    if wide:
        batching = (
            f"dynamic_batching {{\n  preferred_batch_size: [ {wide} ]\n  max_queue_delay_microseconds: 2000000\n}}"
        )
        text, count = re.subn(r"dynamic_batching \{.*?\n\}", batching, text, flags=re.S)
        if not count:
            text += "\n" + batching + "\n"
    text = with_parameters(text, parameters or {})  # last: protobuf rewrites the text (the patterns match the shipped)
    target = repo / name
    (target / "1").mkdir(parents=True)
    (target / "config.pbtxt").write_text(text)
    for item in (version_dir or source / "1").iterdir():
        (target / "1" / item.name).symlink_to(item.resolve())
    return target


@pytest.fixture(scope="session")
def repository(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("model_repository")
    for name in EXAMPLE_MODELS:
        built(name)
        add_model(repo, name, source=REPOSITORY / name)
    # The wide variant compares each neighbour's vector with sentence-transformers': FP32, every row computed.
    add_model(repo, WIDE_MODEL, wide=WIDE_BATCH, parameters={**FP32_NO_CACHE, "cost_model": FIXED_COST})
    add_model(repo, EXACT_MODEL, parameters=FP32_NO_CACHE)
    add_model(repo, INT8_MODEL, parameters={"precision": "int8", "cache_bytes": "0", "cost_model": FIXED_COST})
    for name in (*GENERATE_MODELS, *TEST_MODELS):
        built(name)
        add_model(repo, name, source=model_dir(name))
    add_model(repo, TIGHT_MODEL, source=model_dir("tinylm"), parameters=TIGHT_PARAMETERS)
    return repo


def start_server(options: ServerOptions) -> TritonServer:
    """A tritonserver started with ``options``; the test fails, with Triton's log tail, if it does not start."""
    triton = TritonServer(options)
    try:
        return triton.start()
    except LaunchError as exc:
        pytest.fail(f"tritonserver did not start: {exc}")


@pytest.fixture(scope="session")
def server(repository, request):
    options = ServerOptions.on_free_ports(
        repository, model_control="explicit",
        load_models=(*EXAMPLE_MODELS, WIDE_MODEL, EXACT_MODEL, INT8_MODEL, *GENERATE_MODELS, *TEST_MODELS,
                     TIGHT_MODEL),
    )
    triton = start_server(options)
    request.session.triton_server = triton
    yield triton
    code = triton.stop()
    log = triton.log_text()
    dump = log[log.find("launcher: the drain left"):] if "launcher: the drain left" in log else ""
    assert code in (0, -2), f"tritonserver stopped with code {code}:\n{triton.log_tail()}\n{dump[:20000]}"


def _stub_crashes() -> list[str] | str:
    """The kernel's segfault reports for Python backend stubs, or why the kernel log cannot be read here."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"dmesg could not run ({exc})"
    if log.returncode != 0:
        return f"dmesg exited with {log.returncode}: {log.stderr.strip()[:200]}"
    return [line for line in log.stdout.splitlines() if "triton_python_b" in line and "segfault" in line]


@pytest.fixture(scope="session", autouse=True)
def no_stub_crashes():
    """Fail the session if a model's stub process crashed, even where Triton and every test carried on.

    A stub that crashes at shutdown leaves no trace in the server's log nor its exit code;
    only the kernel sees it. Where ``dmesg`` is not readable the check cannot run: the
    session says so in its warnings summary rather than passing it silently.
    """
    before = _stub_crashes()
    if isinstance(before, str):
        warnings.warn(pytest.PytestWarning(f"the stub-crash check is off: {before}"), stacklevel=1)
    yield
    if isinstance(before, str):
        return
    time.sleep(1)  # a stub still exiting after its server
    after = _stub_crashes()
    after = after if isinstance(after, list) else []
    new = [line for line in after if line not in before]  # each line carries its own timestamp and pid
    assert not new, "Python backend stub process(es) crashed during the tests:\n" + "\n".join(new)


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    triton = getattr(item.session, "triton_server", None)
    if report.when == "call" and report.failed and triton is not None:
        report.sections.append(("tritonserver log (tail)", triton.log_tail(80)))


def infer(
    server, protocol: str, model: str, inputs: list[tuple[str, np.ndarray, str]], outputs: list[str]
) -> dict[str, np.ndarray]:
    """Send exactly ``inputs`` ([(name, array, Triton datatype)]) to ``model``; return the ``outputs`` by name."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    tc = httpclient if protocol == "http" else grpcclient
    client = tc.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
    try:
        items = []
        for name, array, datatype in inputs:
            item = tc.InferInput(name, list(array.shape), datatype)
            item.set_data_from_numpy(array)
            items.append(item)
        result = client.infer(model, items, outputs=[tc.InferRequestedOutput(name) for name in outputs])
        return {name: result.as_numpy(name) for name in outputs}
    finally:
        client.close()


def infer_concurrently(
    server,
    protocol: str,
    model: str,
    requests: list[list[tuple[str, np.ndarray, str]]],
    outputs: list[str],
    concurrency: int = 16,
) -> list[dict[str, np.ndarray] | Exception]:
    """Send every request at once (``concurrency`` in flight), so Triton batches them; results in order.

    gRPC: one thread-safe client over a thread pool. HTTP: one gevent-based client's
    ``async_infer`` (it is not thread-safe).
    """
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    def items(tc, request):
        out = []
        for name, array, datatype in request:
            item = tc.InferInput(name, list(array.shape), datatype)
            item.set_data_from_numpy(array)
            out.append(item)
        return out

    def unpack(result):
        return {name: result.as_numpy(name) for name in outputs}

    if protocol == "http":
        client = httpclient.InferenceServerClient(server.http_url, concurrency=concurrency)
        try:
            pending = [
                client.async_infer(
                    model, items(httpclient, r), outputs=[httpclient.InferRequestedOutput(n) for n in outputs]
                )
                for r in requests
            ]
            answers: list[dict[str, np.ndarray] | Exception] = []
            for handle in pending:
                try:
                    answers.append(unpack(handle.get_result()))
                except InferenceServerException as exc:
                    answers.append(exc)
            return answers
        finally:
            client.close()
    client = grpcclient.InferenceServerClient(server.grpc_url)

    def one(request):
        try:
            return unpack(
                client.infer(
                    model, items(grpcclient, request), outputs=[grpcclient.InferRequestedOutput(n) for n in outputs]
                )
            )
        except InferenceServerException as exc:
            return exc

    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(one, requests))
    finally:
        client.close()


def in_one_execute(
    server, model: str, requests: list[list[tuple[str, np.ndarray, str]]], outputs: list[str]
) -> list[dict[str, np.ndarray] | Exception]:
    """Send ``requests`` at once to a ``wide`` model (it waits for exactly that many); their answers, in order.

    Asserts that Triton handed them to one ``execute``, so a test can show what one bad
    request does to its neighbours in the same batch.
    """
    from tritonclient.utils import InferenceServerException

    from coalesce_client.load import model_counts

    before = model_counts(server.grpc_url, model)
    results: list[dict[str, np.ndarray] | Exception | None] = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def send(i: int) -> None:
        barrier.wait()
        try:
            results[i] = infer(server, "grpc", model, requests[i], outputs)
        except InferenceServerException as exc:
            results[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    deadline = time.monotonic() + 5
    while (after := model_counts(server.grpc_url, model))[0] < before[0] + len(
        requests
    ) and time.monotonic() < deadline:
        time.sleep(0.05)  # statistics land just after the responses
    assert after[1] - before[1] == 1, f"the {len(requests)} requests should have shared one execute()"
    return results  # type: ignore[return-value]


@pytest.fixture()
def grpc_client(server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


@pytest.fixture()
def http_client(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    yield client
    client.close()


@pytest.fixture()
def scratch_model(repository, http_client):
    """Adds a model to the live repository for one test and removes it afterwards."""
    names: list[str] = []

    def make(name: str, **kwargs) -> Path:
        names.append(name)
        if isinstance(kwargs.get("source"), str):
            kwargs["source"] = model_dir(kwargs["source"])
        return add_model(repository, name, **kwargs)

    yield make
    for name in names:
        with contextlib.suppress(Exception):
            http_client.unload_model(name)
        shutil.rmtree(repository / name, ignore_errors=True)


def start_gateway(server: TritonServer, repository: Path, **fields):
    """``coalesce gateway`` in front of ``server`` (a child process on a free port), started and ready."""
    from coalesce_tools.gateway.options import GatewayOptions
    from coalesce_tools.gateway.server import GatewayProcess
    from coalesce_tools.launcher import ADMIN_HEADER, free_port

    options = GatewayOptions(model_repository=repository, triton_grpc_url=server.grpc_url, port=free_port(),
                             triton_admin_key=server.admin_headers.get(ADMIN_HEADER), **fields)
    try:
        return GatewayProcess(options).start()
    except RuntimeError as exc:
        pytest.fail(f"the gateway did not start: {exc}")


@pytest.fixture(scope="session")
def gateway(server, repository):
    """The gateway in front of the shared server, as ``coalesce serve`` starts it (no keys)."""
    process = start_gateway(server, repository)
    yield process
    process.stop()
