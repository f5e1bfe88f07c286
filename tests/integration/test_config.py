"""Broken configs fail to load with a message naming model, key and value; a good one still loads."""

from __future__ import annotations

import pytest
from tritonclient.utils import InferenceServerException


@pytest.mark.parametrize(("name", "replace", "fragments"), [
    ("broken_unknown_key",
     {r'\{ key: "runtime"': '{ key: "max_batch_rowz", value: { string_value: "8" } },\n  { key: "runtime"'},
     ["model 'broken_unknown_key'", "unknown parameter 'max_batch_rowz'", "value '8'"]),
    ("broken_bad_value",
     {r'"max_batch_rows", value: \{ string_value: "64" \}': '"max_batch_rows", value: { string_value: "lots" }'},
     ["model 'broken_bad_value'", "parameter 'max_batch_rows' has bad value 'lots'", "expected an integer"]),
    ("broken_output_dims",
     {r"dims: \[ 384 \]": "dims: [ 768 ]"},
     ["model 'broken_output_dims'", "output EMBEDDING has dims [768]", "produces width 384"]),
    ("broken_input_type",
     {r"data_type: TYPE_STRING": "data_type: TYPE_INT32"},
     ["model 'broken_input_type'", "input 'TEXT' has data_type 'TYPE_INT32'"]),
])
def test_broken_config_fails_to_load_clearly(scratch_model, http_client, name, replace, fragments):
    scratch_model(name, replace=replace)
    with pytest.raises(InferenceServerException) as info:
        http_client.load_model(name)
    message = info.value.message()
    for fragment in fragments:
        assert fragment in message, message
    assert not http_client.is_model_ready(name)
    # The server and the good model are unaffected.
    assert http_client.is_model_ready("minilm")


def test_missing_onnx_file_is_named(scratch_model, http_client):
    scratch_model("broken_missing_file",
                  replace={r'\{ key: "runtime"': '{ key: "onnx_file", value: { string_value: "nope.onnx" } },\n'
                                                 '  { key: "runtime"'})
    with pytest.raises(InferenceServerException, match=r"ONNX model not found: .*nope\.onnx"):
        http_client.load_model("broken_missing_file")


def test_reload_with_config_override(scratch_model, http_client, grpc_client):
    """The repository API retunes a model without a restart (what `coalesce tune` builds on)."""
    scratch_model("retuned")
    http_client.load_model("retuned")
    config = http_client.get_model_config("retuned")
    config["dynamic_batching"]["max_queue_delay_microseconds"] = 500
    config["parameters"]["max_batch_rows"] = {"string_value": "16"}
    import json

    http_client.load_model("retuned", config=json.dumps(config))
    after = http_client.get_model_config("retuned")
    assert int(after["dynamic_batching"]["max_queue_delay_microseconds"]) == 500
    assert after["parameters"]["max_batch_rows"]["string_value"] == "16"
    assert grpc_client.is_model_ready("retuned")
    # Regression: with custom metrics, Triton 2.51 corrupted its heap when the old instance of a
    # reloaded model deleted its metric families (server issue #8663). Serve after the reload.
    import numpy as np
    import tritonclient.grpc as grpcclient

    for _ in range(3):
        texts = np.array([[b"after reload"], [b"still serving"]], dtype=object)
        item = grpcclient.InferInput("TEXT", [2, 1], "BYTES")
        item.set_data_from_numpy(texts)
        assert grpc_client.infer("retuned", [item]).as_numpy("EMBEDDING").shape == (2, 384)
        http_client.load_model("retuned", config=json.dumps(config))
    assert grpc_client.is_server_live() and grpc_client.is_model_ready("minilm")
