"""The client library, its CLI, and `coalesce serve`, against a real server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from coalesce_client import (
    AsyncEmbeddingClient,
    EmbeddingClient,
    InvalidInputError,
    ModelNotFoundError,
    RequestTimeoutError,
    ServerUnavailableError,
)
from coalesce_client.load import sample_texts
from coalesce_tools.launcher import free_port
from tests.conftest import TRICKY_TEXTS
from tests.integration.conftest import add_model

PROTOCOLS = ("http", "grpc")


def url_of(server, protocol):
    return server.http_url if protocol == "http" else server.grpc_url


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_embed(server, protocol, reference_model):
    with EmbeddingClient(url_of(server, protocol), protocol=protocol) as client:
        assert client.is_ready()
        vectors = client.embed(TRICKY_TEXTS)
    want = reference_model.encode(TRICKY_TEXTS, normalize_embeddings=True)
    assert vectors.dtype == np.float32 and vectors.shape == want.shape
    cosine = (vectors * want).sum(axis=1)  # the shipped minilm runs INT8: its guard's bounds
    assert cosine.mean() >= 0.99 and cosine.min() >= 0.98


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_long_lists_are_split_and_kept_in_order(server, protocol):
    texts = sample_texts(150, seed=7)  # over max_batch_size 64: three requests
    with EmbeddingClient(url_of(server, protocol), protocol=protocol) as client:
        whole = client.embed(texts)
        parts = client.embed_many([texts[:10], texts[10:11], texts[11:]], max_in_flight=3)
    assert whole.shape == (150, 384)
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-5)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_async_client(server, protocol):
    async def main():
        async with AsyncEmbeddingClient(url_of(server, protocol), protocol=protocol) as client:
            one = await client.embed(["async hello"])
            many = await client.embed_many([[t] for t in sample_texts(20)], max_in_flight=8)
            with pytest.raises(InvalidInputError, match="not valid UTF-8"):
                await client.embed([b"\xff"])
            return one, many

    one, many = asyncio.run(main())
    assert one.shape == (1, 384) and len(many) == 20


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_client_errors_say_what_went_wrong(server, protocol):
    with EmbeddingClient(url_of(server, protocol), protocol=protocol) as client:
        with pytest.raises(InvalidInputError, match="row 0 is not valid UTF-8"):
            client.embed([b"\xfe"])
        with pytest.raises(InvalidInputError, match="texts is empty"):
            client.embed([])
    with EmbeddingClient(url_of(server, protocol), protocol=protocol, model="no_such_model") as client, \
            pytest.raises(ModelNotFoundError, match="no_such_model"):
        client.embed(["x"])
    with EmbeddingClient(f"127.0.0.1:{free_port()}", protocol=protocol, timeout_s=2) as client:
        assert not client.is_ready()
        with pytest.raises(ServerUnavailableError):
            client.embed(["x"])


def test_timeout(server):
    with EmbeddingClient(server.grpc_url, protocol="grpc", timeout_s=0.001) as client, \
            pytest.raises(RequestTimeoutError, match=r"no answer within 0\.001 s"):
        client.embed(["word " * 200] * 64)


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "coalesce_client.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=120)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cli_embed_prints_json(server, protocol):
    done = run_cli("--url", url_of(server, protocol), "--protocol", protocol, "embed", "some text", "more text")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["model"] == "minilm" and answer["dim"] == 384
    assert np.asarray(answer["embeddings"]).shape == (2, 384)


def test_cli_stdin_health_and_errors(server):
    done = run_cli("--url", server.grpc_url, "embed", "--stdin", stdin="line one\nline two\n")
    assert done.returncode == 0 and len(json.loads(done.stdout)["embeddings"]) == 2
    done = run_cli("--url", server.grpc_url, "health")
    assert done.returncode == 0 and json.loads(done.stdout)["ready"] is True
    done = run_cli("--url", server.grpc_url, "--model", "nope", "embed", "x")
    assert done.returncode == 1 and "ModelNotFoundError" in done.stderr
    done = run_cli("--url", f"127.0.0.1:{free_port()}", "--timeout-s", "2", "embed", "x")
    assert done.returncode == 1 and "ServerUnavailableError" in done.stderr


def serve_env(**ports):
    env = dict(os.environ)
    env.update({k: str(v) for k, v in ports.items()})
    return env


def test_serve_fails_fast_with_the_server_log(tmp_path):
    repo = tmp_path / "repo"
    add_model(repo, "broken", replace={r'\{ key: "runtime"': '{ key: "bogus", value: { string_value: "1" } },\n'
                                                             '  { key: "runtime"'})
    done = subprocess.run(
        [sys.executable, "-m", "coalesce_tools.cli", "serve", "--model-repository", str(repo), "--quiet"],
        capture_output=True, text=True, timeout=180,
        env=serve_env(HTTP_PORT=free_port(), GRPC_PORT=free_port(), METRICS_PORT=free_port()))
    assert done.returncode != 0
    assert "exited with code" in done.stderr
    assert "unknown parameter 'bogus'" in done.stderr


def test_serve_prints_endpoints_and_stops_on_sigterm(tmp_path):
    repo = tmp_path / "repo"
    add_model(repo, "minilm")
    http, grpc, metrics = free_port(), free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "coalesce_tools.cli", "serve", "--model-repository", str(repo), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=serve_env(HTTP_PORT=http, GRPC_PORT=grpc, METRICS_PORT=metrics, MODEL_CONTROL="explicit"))
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C stops the server" in line:
                break
        text = "".join(lines)
        assert f"http://127.0.0.1:{http}" in text and f"127.0.0.1:{grpc}" in text, text
        assert "curl -s -X POST" in text
        with EmbeddingClient(f"127.0.0.1:{grpc}") as client:
            assert client.embed(["served"]).shape == (1, 384)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_readme_snippet_runs_as_written(server):
    from tests.conftest import ROOT

    readme = (ROOT / "client" / "README.md").read_text()
    (snippet,) = re.findall(r"```python\n(from coalesce_client import EmbeddingClient, AsyncEmbeddingClient.*?)```",
                            readme, re.S)
    scope: dict[str, object] = {}
    exec(snippet.replace("localhost:8001", server.grpc_url), scope)  # the README's own code, as a user runs it
    assert scope["vectors"].shape == (2, 384)
    assert [m.shape for m in scope["many"]] == [(1, 384), (2, 384)]
    assert scope["patient"].embed(["patient"]).shape == (1, 384)
    scope["patient"].close()
