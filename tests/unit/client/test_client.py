"""The client library's pieces that need no server: encoding texts and mapping errors to its own hierarchy."""

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from coalesce_client import (
    AccessDeniedError,
    ClientError,
    EmbeddingClient,
    InvalidInputError,
    ModelNotFoundError,
    RequestRejectedError,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
)
from coalesce_client.client import encode_texts, translate_error


def test_encode_texts():
    array = encode_texts(["héllo", b"\xff"])
    assert array.shape == (2, 1) and array.dtype == np.object_
    assert array[0, 0] == "héllo".encode() and array[1, 0] == b"\xff"
    with pytest.raises(TypeError, match=r"^texts must be a sequence of strings, not a single string$"):
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
    # Triton's restricted APIs without their header: an access error, never retried (gRPC says UNAVAILABLE).
    ("StatusCode.UNAVAILABLE", "This protocol is restricted, expecting header 'triton-grpc-protocol-key'",
     AccessDeniedError),
    ("403", "This API is restricted, expecting header 'key'", AccessDeniedError),
    ("401", "Unauthorized", AccessDeniedError),
    # A known model with no version loaded (unloading at shutdown, reloading) is unavailable for now, not unknown.
    ("400", "Request for unknown model: 'minilm' has no available versions", ServerUnavailableError),
    ("StatusCode.UNAVAILABLE", "Request for unknown model: 'minilm' has no available versions", ServerUnavailableError),
])
def test_error_translation(status, message, kind):
    error = translate_error(InferenceServerException(msg=message, status=status), model="m", url="u", timeout_s=1)
    assert isinstance(error, kind)
    assert "model 'm' at u" in str(error)


def test_transport_errors():
    assert isinstance(translate_error(ConnectionRefusedError("refused"), model="m", url="u", timeout_s=1),
                      ServerUnavailableError)
    assert isinstance(translate_error(TimeoutError(), model="m", url="u", timeout_s=1), RequestTimeoutError)


def test_every_error_is_a_client_error_naming_model_and_url():
    for exc in (InferenceServerException(msg="boom", status="StatusCode.INTERNAL"), ValueError("odd")):
        error = translate_error(exc, model="m", url="host:1", timeout_s=1)
        assert isinstance(error, ClientError) and str(error).startswith("model 'm' at host:1: ")
    assert str(translate_error(ValueError("odd"), model="m", url="u", timeout_s=1)) == "model 'm' at u: ValueError: odd"


def test_a_client_is_made_without_a_server_and_checks_its_protocol():
    assert EmbeddingClient(protocol="http").url == "localhost:8000"
    assert EmbeddingClient().url == "localhost:8001"
    with pytest.raises(ValueError, match=r"^protocol must be 'grpc' or 'http', got 'tcp'$"):
        EmbeddingClient(protocol="tcp")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_an_unreachable_server_is_not_ready_and_a_call_says_so(protocol, unused_port):
    with EmbeddingClient(f"127.0.0.1:{unused_port}", protocol=protocol, timeout_s=5, max_rows_per_request=8) as client:
        assert client.is_ready() is False
        with pytest.raises(ServerUnavailableError) as info:
            client.embed(["hello"])
    assert f"127.0.0.1:{unused_port}" in str(info.value)


@pytest.fixture()
def unused_port():
    from coalesce_tools.launcher import free_port

    return free_port()
