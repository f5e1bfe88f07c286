"""Bounds on a request's memory and work, and on what a model's parameters may reach, in a real server."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from coalesce.loader import triton_prefetch_blockers
from tests.integration.conftest import WIDE_BATCH, WIDE_MODEL, in_one_execute, infer

MIB = 1 << 20


def as_tensor(rows: list[bytes]) -> np.ndarray:
    array = np.empty((len(rows), 1), dtype=np.object_)
    array[:, 0] = rows
    return array


def test_an_oversized_request_is_refused_naming_the_limit_and_its_neighbour_is_answered(server):
    """Six requests reach one execute() (the wide model waits for exactly six rows); one is 5 MiB."""
    requests = [[b"a neighbour %d" % i] for i in range(WIDE_BATCH)]
    requests[3] = [b"x" * (5 * MIB)]  # one row (the six requests are six rows), over max_request_bytes (4 MiB)
    results = in_one_execute(server, WIDE_MODEL, [[("TEXT", as_tensor(r), "BYTES")] for r in requests],
                             ["EMBEDDING"])
    refused = results[3]
    assert isinstance(refused, InferenceServerException), refused
    assert refused.message().endswith(
        f"request is {5 * MIB} bytes, over the model's limit of {4 * MIB} bytes per request (parameter "
        "'max_request_bytes'); send fewer or shorter rows per request"), refused.message()
    assert str(refused.status()) == "StatusCode.INVALID_ARGUMENT"
    for i in set(range(WIDE_BATCH)) - {3}:
        assert isinstance(results[i], dict) and results[i]["EMBEDDING"].shape == (1, 384), results[i]


def test_a_long_text_gives_the_embedding_of_what_truncation_keeps(server):
    words = b" ".join(b"word%d of ordinary prose" % i for i in range(60_000))[:MIB]
    long = infer(server, "grpc", "minilm", [("TEXT", as_tensor([words]), "BYTES")], ["EMBEDDING"])["EMBEDDING"]
    head = infer(server, "grpc", "minilm", [("TEXT", as_tensor([words[:4096]]), "BYTES")],
                 ["EMBEDDING"])["EMBEDDING"]
    assert float(long[0] @ head[0]) >= 0.9999  # 256 tokens are all within the first 4 KiB


@pytest.mark.parametrize(("value", "why"), [
    ("../../minilm/1/model.onnx", "must stay inside the version folder ('..' is refused)"),
    ("/etc/hostname", "must be relative to the version folder, not an absolute path"),
])
def test_a_file_parameter_outside_the_version_folder_fails_the_load(server, scratch_model, http_client, value, why):
    name = "broken_escape_abs" if value.startswith("/") else "broken_escape_dots"
    scratch_model(name, replace={r'\{ key: "runtime"': f'{{ key: "onnx_file", value: {{ string_value: "{value}" }} }}'
                                                       ',\n  { key: "runtime"'})
    with pytest.raises(InferenceServerException) as info:
        http_client.load_model(name)
    message = f"model '{name}': parameter 'onnx_file' has bad value '{value}': {why}"
    assert message in info.value.message()
    assert message in server.log_text()
    assert not http_client.is_model_ready(name)


def test_served_configs_keep_tritons_prefetching_and_a_queue_policy_is_warned_of(server, scratch_model, http_client):
    for model in ("minilm", "minilm_rerank", "minilm_tokens", "digits"):  # digits: completed by the backend
        assert triton_prefetch_blockers(http_client.get_model_config(model)) == [], model
    name = "queue_policy_warned"
    scratch_model(name, replace={r"max_queue_delay_microseconds: (\d+)": r"max_queue_delay_microseconds: \1\n"
                                 "  default_queue_policy { max_queue_size: 8 }"})
    http_client.load_model(name)
    try:
        policy = http_client.get_model_config(name)["dynamic_batching"]["default_queue_policy"]
        assert int(policy["max_queue_size"]) == 8
        assert (f"coalesce[{name}] dynamic_batching sets max_queue_size 8: that turns off Triton's prefetching"
                in server.log_text())
    finally:
        http_client.unload_model(name)
