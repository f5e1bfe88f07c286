"""A model that cannot be reloaded holds no other hostage: the supervisor recovers each model on its own.

One server of its own (it kills stubs and breaks a config): two copies of ``digits``, the
cheapest model to load. ``digits_a``'s stub is killed while its config is broken, so every
reload fails; ``digits_b``'s stub is killed meanwhile and must serve again before ``digits_a``
is fixed. Then the config is restored and ``digits_a`` serves again too.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from coalesce_tools.launcher import ServerOptions, TritonServer, free_port
from coalesce_tools.processes import stub_processes
from coalesce_tools.supervisor import SupervisorOptions
from tests.conftest import REPOSITORY, built
from tests.integration.conftest import add_model, start_server

pytestmark = pytest.mark.integration

BROKEN, HEALTHY = "digits_a", "digits_b"
#: Scans every 250 ms (a death confirmed in 0.5 s); failed loads retried after 0.5, 1, 2, 2... s.
OPTIONS = SupervisorOptions(interval_s=0.25, confirm_scans=2, retry_first_s=0.5, retry_max_s=2.0)
#: How long one model's recovery may take here (a digits load is seconds on 2 busy cores).
RECOVERY_LIMIT_S = 30.0


@pytest.fixture()
def pair(tmp_path):
    built("digits")
    repo = tmp_path / "repository"
    for name in (BROKEN, HEALTHY):
        add_model(repo, name, source=REPOSITORY / "digits")
    supervisor = SupervisorOptions(**{**OPTIONS.__dict__, "health_port": free_port()})
    options = ServerOptions.on_free_ports(repo, model_control="explicit", supervisor=supervisor)
    triton = start_server(options)
    yield triton
    triton.stop()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _classify(server: TritonServer, model: str) -> np.ndarray:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url, network_timeout=10.0)
    try:
        image = httpclient.InferInput("image", [2, 8, 8], "FP32")
        image.set_data_from_numpy(np.random.default_rng(0).random((2, 8, 8), dtype=np.float32) * 16)
        return client.infer(model, [image]).as_numpy("logits")
    finally:
        client.close()


def _kill_stubs(server: TritonServer, model: str) -> None:
    assert server.pid is not None
    stubs = [s for s in stub_processes(server.pid) if s.model == model and not s.dead]
    assert stubs, f"no stub of {model} found"
    for stub in stubs:
        os.kill(stub.pid, signal.SIGKILL)


def _until(condition, timeout_s: float, what: str, server: TritonServer) -> float:
    """Wait for ``condition()``; the seconds it took. Fails with the server's log when it does not come."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s\n{server.log_tail(60)}")
        time.sleep(0.1)
    return time.monotonic() - started


def test_a_model_that_cannot_reload_holds_no_other_hostage(pair):
    """digits_a fails to reload (its config broken); digits_b dies meanwhile and serves again; then digits_a does."""
    supervisor = pair.supervisor
    assert supervisor is not None
    health = f"http://127.0.0.1:{supervisor.options.health_port}/ready"
    reference = {model: _classify(pair, model) for model in (BROKEN, HEALTHY)}
    assert _status(health) == 200
    # Only a stub the supervisor saw alive can be found dead: wait for its first scans.
    _until(lambda: {m for m, _ in supervisor._known.values()} >= {BROKEN, HEALTHY}, 10, "stubs seen alive", pair)

    def failures() -> int:
        return pair.log_text().count(f"loading '{BROKEN}' failed")

    def recovered(model: str) -> bool:
        return any(m == model for m, _ in supervisor.recoveries)

    config = pair.options.model_repository / BROKEN / "config.pbtxt"
    shipped = config.read_text()
    started = time.monotonic()
    config.write_text(shipped + "\nthis line is not protobuf text {\n")  # every reload of digits_a fails
    _kill_stubs(pair, BROKEN)
    _until(lambda: failures() >= 1, RECOVERY_LIMIT_S, f"{BROKEN}'s first failed reload", pair)

    _kill_stubs(pair, HEALTHY)
    took_s = _until(lambda: recovered(HEALTHY), RECOVERY_LIMIT_S,
                    f"{HEALTHY}'s recovery while {BROKEN} fails to reload", pair)
    assert np.allclose(_classify(pair, HEALTHY), reference[HEALTHY])
    assert not recovered(BROKEN) and BROKEN in supervisor.recovering()
    assert _status(f"http://{pair.http_url}/v2/models/{BROKEN}/ready") != 200
    assert _status(health) == 503, f"{BROKEN} is still being recovered: the server is not ready"

    # Retried, with pauses: at least two failures, far fewer than a tight loop would make.
    _until(lambda: failures() >= 2, RECOVERY_LIMIT_S, f"{BROKEN}'s reload tried again", pair)
    config.write_text(shipped)  # an operator fixes the repository
    _until(lambda: recovered(BROKEN), RECOVERY_LIMIT_S, f"{BROKEN}'s recovery once its config is fixed", pair)
    assert np.allclose(_classify(pair, BROKEN), reference[BROKEN])
    assert _status(health) == 200
    elapsed_s = time.monotonic() - started
    assert failures() <= 2 + elapsed_s / OPTIONS.retry_first_s, "back-off: no tight retry loop"
    print(f"{HEALTHY} back {took_s:.1f} s after its kill; {BROKEN} back after {failures()} failed reloads, "
          f"{elapsed_s:.1f} s after its kill")
