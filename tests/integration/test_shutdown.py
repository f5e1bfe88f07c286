"""``coalesce serve`` stopped with SIGTERM under load: every accepted request is answered, then it exits in time."""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from coalesce_tools.launcher import free_port
from tests.conftest import REPOSITORY, ROOT, built
from tests.integration.conftest import add_model

pytestmark = pytest.mark.integration

IN_FLIGHT = 32
#: Triton's --exit-timeout-secs as the launcher sets it, plus the launcher's own stop.
EXIT_LIMIT_S = 15 + 15


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


#: A call counts as accepted when it was sent at least this long before SIGTERM: on loopback Triton reads a
#: request within milliseconds, and the margin covers a client thread descheduled between the clock and the send.
ACCEPT_MARGIN_S = 0.25
#: Rows per call: enough that a call of the 32 in flight lasts far longer than ACCEPT_MARGIN_S (about 1.5 s here),
#: so most calls were sent before the margin and are in flight at the signal however fast the server.
ROWS = 32


@dataclasses.dataclass
class Call:
    """One request of the test: when it was sent and answered, its texts, and what came back."""

    sent_at: float
    texts: list[str]
    outcome: str = ""
    answered_at: float = 0.0
    vectors: np.ndarray | None = None


def test_sigterm_answers_what_was_accepted_and_exits_in_time(tmp_path, reference_model):
    """SIGTERM under load: every request sent before it is answered with the right vectors; it exits in time.

    minilm is served as shipped (INT8, row cache); every text is new, so each request is computed.
    """
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    built("minilm")
    repo = tmp_path / "repository"
    add_model(repo, "minilm", source=REPOSITORY / "minilm")
    http_port = free_port()
    openai_port = free_port()
    env = dict(
        os.environ,
        OPENAI_PORT=str(openai_port),
        HTTP_PORT=str(http_port),
        GRPC_PORT=str(free_port()),
        METRICS_PORT=str(free_port()),
        HEALTH_PORT="0",
        PYTHONUNBUFFERED="1",
    )
    log = (tmp_path / "serve.log").open("w")
    serve = subprocess.Popen(
        [str(Path(sys.executable).parent / "coalesce"), "serve", "--quiet", "--model-repository", str(repo)],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"127.0.0.1:{http_port}"
    calls: list[Call] = []
    lock = threading.Lock()
    try:
        deadline = time.monotonic() + 180
        while not _ready(url):
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready in 180 s"
            time.sleep(0.25)
        # The gateway comes up beside Triton, and is gone with it (the process check at the end).
        gateway = f"http://127.0.0.1:{openai_port}"
        while True:
            try:
                with urllib.request.urlopen(gateway + "/health", timeout=5) as reply:
                    assert reply.status == 200
                    break
            except OSError:
                assert serve.poll() is None and time.monotonic() < deadline, "the gateway did not come up"
                time.sleep(0.25)
        started = threading.Barrier(IN_FLIGHT + 1)

        def call(worker: int) -> None:
            client = httpclient.InferenceServerClient(url, network_timeout=60, connection_timeout=60)
            started.wait()
            for number in itertools.count():
                texts = [
                    f"worker {worker} call {number} row {row}: a sentence to keep the model busy."
                    for row in range(ROWS)
                ]
                item = httpclient.InferInput("TEXT", [ROWS, 1], "BYTES")
                item.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=np.object_))
                record = Call(sent_at=time.monotonic(), texts=texts)
                try:
                    record.vectors = client.infer("minilm", [item]).as_numpy("EMBEDDING")
                    record.outcome = "ok"
                except InferenceServerException as exc:
                    record.outcome = f"refused: {exc.message()}"
                except ConnectionRefusedError:
                    record.outcome = "not accepted: connection refused"
                except Exception as exc:  # a reset or a hang: a failure unless the request came after the signal
                    record.outcome = f"no answer: {type(exc).__name__}: {exc}"
                record.answered_at = time.monotonic()
                with lock:
                    calls.append(record)
                if record.outcome != "ok":
                    break
            client.close()

        threads = [threading.Thread(target=call, args=(i,)) for i in range(IN_FLIGHT)]
        for thread in threads:
            thread.start()
        started.wait()
        time.sleep(3)  # every client has had calls answered and has one in flight
        signal_at = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=EXIT_LIMIT_S + 30)
        exit_s = time.monotonic() - signal_at
        for thread in threads:
            thread.join(timeout=70)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        log.close()
    accepted = [c for c in calls if c.sent_at < signal_at - ACCEPT_MARGIN_S]
    at_signal = [c for c in accepted if c.answered_at > signal_at]
    later = [c for c in calls if c.sent_at >= signal_at - ACCEPT_MARGIN_S]
    summary = sorted({c.outcome[:100] for c in calls})
    # Every request accepted before the signal was answered, and correctly; in flight at it, so was each.
    print(
        f"{len(calls)} calls, {len(accepted)} accepted ({len(at_signal)} in flight at the signal), "
        f"{len(later)} sent after; exit {code} after {exit_s:.1f} s; outcomes: {summary}"
    )
    failed = [(round(c.sent_at - signal_at, 3), c.outcome[:200]) for c in accepted if c.outcome != "ok"]
    assert not failed, failed
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert exit_s <= EXIT_LIMIT_S, f"exited {exit_s:.1f} s after SIGTERM"
    assert len(at_signal) >= IN_FLIGHT // 2, f"only {len(at_signal)} accepted calls were in flight at the signal"
    for c in accepted:
        assert c.vectors is not None and c.vectors.shape == (ROWS, 384)
        np.testing.assert_allclose(np.linalg.norm(c.vectors, axis=1), 1.0, atol=1e-3)
    texts = [t for c in at_signal for t in c.texts]
    cosine = (
        np.concatenate([c.vectors for c in at_signal])  # type: ignore[misc]
        * reference_model.encode(texts, normalize_embeddings=True, batch_size=64)
    ).sum(axis=1)
    assert cosine.mean() >= 0.99 and cosine.min() >= 0.98, (cosine.mean(), cosine.min())  # the INT8 guard's bounds
    # A request sent after the signal is answered, or refused with a reason: never left without an answer.
    assert all(c.outcome == "ok" or c.outcome.startswith(("refused", "not accepted")) for c in later), summary
    left = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _runs_from(p, repo)]
    assert not left, f"processes of the stopped server still run: {left}"


def _runs_from(entry: Path, repo: Path) -> bool:
    """Whether process ``entry`` (a /proc folder) names a file of ``repo`` on its command line (a model's stub)."""
    try:
        return str(repo).encode() in (entry / "cmdline").read_bytes()
    except OSError:
        return False
