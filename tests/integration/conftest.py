"""A real tritonserver for the integration tests, on free ports, with explicit model control.

The repository is a temporary copy of ``model_repository/minilm`` (weights linked,
not copied) plus test-only variants; broken-config tests add models to it and load
them through the repository API. The server is always stopped, and its log is
shown when a test fails.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from coalesce.launcher import LaunchError, ServerOptions, TritonServer, free_port
from tests.conftest import MODEL_DIR

#: Test-only variant: waits up to 2 s for exactly 6 requests, so a test can put 6 requests in one execute().
WIDE_MODEL = "minilm_wide"
WIDE_BATCH = 6


def add_model(repo: Path, name: str, *, replace: dict[str, str] | None = None,
              source: Path = MODEL_DIR) -> Path:
    """Copy ``source``'s config into ``repo/name`` with text replacements; link its version files."""
    text = (source / "config.pbtxt").read_text()
    text = text.replace('name: "minilm"', f'name: "{name}"')
    for pattern, new in (replace or {}).items():
        text, count = re.subn(pattern, new, text, flags=re.S)
        assert count, f"pattern {pattern!r} not found in config"
    target = repo / name
    (target / "1").mkdir(parents=True)
    (target / "config.pbtxt").write_text(text)
    for item in (source / "1").iterdir():
        (target / "1" / item.name).symlink_to(item.resolve())
    return target


@pytest.fixture(scope="session")
def repository(tmp_path_factory, version_dir) -> Path:
    repo = tmp_path_factory.mktemp("model_repository")
    add_model(repo, "minilm")
    add_model(repo, WIDE_MODEL, replace={
        r"dynamic_batching \{.*?\n\}": f"dynamic_batching {{\n  preferred_batch_size: [ {WIDE_BATCH} ]\n"
                                       "  max_queue_delay_microseconds: 2000000\n}"})
    return repo


@pytest.fixture(scope="session")
def server(repository, request):
    options = ServerOptions(model_repository=repository, host="127.0.0.1", http_port=free_port(),
                            grpc_port=free_port(), metrics_port=free_port(), model_control="explicit",
                            load_models=("minilm", WIDE_MODEL))
    triton = TritonServer(options)
    try:
        triton.start()
    except LaunchError as exc:
        pytest.fail(f"tritonserver did not start: {exc}")
    request.session.triton_server = triton
    yield triton
    code = triton.stop()
    assert code in (0, -2), f"tritonserver stopped with code {code}:\n{triton.log_tail()}"


def _stub_crashes() -> list[str] | None:
    """The kernel's segfault reports for Python backend stubs, or None where the kernel log is closed to us."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if log.returncode != 0:
        return None
    return [line for line in log.stdout.splitlines() if "triton_python_b" in line and "segfault" in line]


@pytest.fixture(scope="session", autouse=True)
def no_stub_crashes():
    """Fail the session if a model's stub process crashed, even where Triton and every test carried on.

    A stub that crashes at shutdown leaves no trace in the server's log nor its exit code;
    only the kernel sees it. Skipped silently where ``dmesg`` is not readable.
    """
    before = _stub_crashes()
    yield
    if before is None:
        return
    time.sleep(1)  # a stub still exiting after its server
    after = _stub_crashes() or []
    new = [line for line in after if line not in before]  # each line carries its own timestamp and pid
    assert not new, "Python backend stub process(es) crashed during the tests:\n" + "\n".join(new)


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    triton = getattr(item.session, "triton_server", None)
    if report.when == "call" and report.failed and triton is not None:
        report.sections.append(("tritonserver log (tail)", triton.log_tail(80)))


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
        return add_model(repository, name, **kwargs)

    yield make
    for name in names:
        with contextlib.suppress(Exception):
            http_client.unload_model(name)
        shutil.rmtree(repository / name, ignore_errors=True)
