from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from coalesce.launcher import LaunchError, TritonServer, assemble_backend_dir, find_triton, options_from_env
from coalesce_client import (
    InvalidInputError,
    ModelNotFoundError,
    RequestRejectedError,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
)
from coalesce_client.client import encode_texts, translate_error


def test_options_from_env(monkeypatch):
    monkeypatch.setenv("HTTP_PORT", "9000")
    monkeypatch.setenv("GRPC_PORT", "9001")
    monkeypatch.setenv("METRICS_PORT", "9002")
    monkeypatch.setenv("MODEL_CONTROL", "explicit")
    options = options_from_env(Path("repo"))
    assert (options.http_port, options.grpc_port, options.metrics_port) == (9000, 9001, 9002)
    assert options.model_control == "explicit"
    assert options.load_models == ("*",)
    monkeypatch.setenv("RESPONSE_CACHE_BYTES", "1048576")
    options = options_from_env(Path("repo"))
    assert options.response_cache_bytes == 1048576
    assert "--cache-config=local,size=1048576" in TritonServer(options, install=find_triton()).command()


def test_options_defaults(monkeypatch):
    for name in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "MODEL_CONTROL", "RESPONSE_CACHE_BYTES"):
        monkeypatch.delenv(name, raising=False)
    options = options_from_env(Path("repo"))
    assert (options.http_port, options.grpc_port, options.metrics_port) == (8000, 8001, 8002)
    assert options.model_control == "none"
    assert options.response_cache_bytes == 0
    assert not any(a.startswith("--cache-config") for a in TritonServer(options, install=find_triton()).command())


@pytest.mark.parametrize(("name", "value", "fragment"), [
    ("HTTP_PORT", "http", "HTTP_PORT='http' is not a port number"),
    ("GRPC_PORT", "70000", "outside 1..65535"),
    ("MODEL_CONTROL", "sometimes", "expected none, explicit or poll"),
    ("RESPONSE_CACHE_BYTES", "1GB", "expected a number of bytes"),
])
def test_bad_env_is_named(monkeypatch, name, value, fragment):
    monkeypatch.setenv(name, value)
    with pytest.raises(LaunchError, match=fragment):
        options_from_env(Path("repo"))


def test_backend_dir_layout(tmp_path):
    install = find_triton()
    root = assemble_backend_dir(install, tmp_path / "backends")
    for rel in ("python/libtriton_python.so", "python/triton_python_backend_utils.py",
                "python/triton_python_backend_stub", "coalesce/model.py", "coalesce/coalesce/pipeline.py"):
        assert (root / rel).exists(), rel


def test_encode_texts():
    array = encode_texts(["héllo", b"\xff"])
    assert array.shape == (2, 1) and array.dtype == np.object_
    assert array[0, 0] == "héllo".encode() and array[1, 0] == b"\xff"
    with pytest.raises(TypeError, match="not a single string"):
        encode_texts("hello")


@pytest.mark.parametrize(("status", "message", "kind"), [
    ("StatusCode.INVALID_ARGUMENT", "input 'TEXT' row 0 is not valid UTF-8", InvalidInputError),
    ("400", "input 'TEXT' row 0 is not valid UTF-8", InvalidInputError),
    ("400", "Request for unknown model: 'x' is not found", ModelNotFoundError),
    ("StatusCode.UNAVAILABLE", "failed to connect to all addresses", ServerUnavailableError),
    ("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", RequestTimeoutError),
    ("StatusCode.INTERNAL", "boom", ServerError),
    # Refusals under load: the adaptive scheduler's, and Triton's queue policy's, over both protocols.
    ("StatusCode.UNAVAILABLE", "request refused: the queue is full", RequestRejectedError),
    ("503", "request refused: the queue is full", RequestRejectedError),
    ("StatusCode.UNAVAILABLE", "Request timeout expired", RequestRejectedError),
    ("503", "Request timeout expired", RequestRejectedError),
    ("503", "model is unloading", ServerUnavailableError),
])
def test_error_translation(status, message, kind):
    error = translate_error(InferenceServerException(msg=message, status=status), model="m", url="u", timeout_s=1)
    assert isinstance(error, kind)
    assert "model 'm' at u" in str(error)


def test_transport_errors():
    assert isinstance(translate_error(ConnectionRefusedError("refused"), model="m", url="u", timeout_s=1),
                      ServerUnavailableError)
    assert isinstance(translate_error(TimeoutError(), model="m", url="u", timeout_s=1), RequestTimeoutError)
