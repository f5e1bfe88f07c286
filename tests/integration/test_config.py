"""Broken configs fail to load with a message naming model, key and value; a good one still loads."""

from __future__ import annotations

import shutil
import time

import pytest
from tritonclient.utils import InferenceServerException

from coalesce_tools.processes import stub_processes
from tests.conftest import REPOSITORY, model_dir


@pytest.mark.parametrize(("name", "replace", "fragments"), [
    ("broken_unknown_key",
     {r'\{ key: "runtime"': '{ key: "max_batch_rowz", value: { string_value: "8" } },\n  { key: "runtime"'},
     ["model 'broken_unknown_key'", "unknown parameter 'max_batch_rowz'", "value '8'"]),
    ("broken_bad_value",
     {r'"max_batch_rows", value: \{ string_value: "64" \}': '"max_batch_rows", value: { string_value: "lots" }'},
     ["model 'broken_bad_value'", "parameter 'max_batch_rows' has bad value 'lots'", "expected an integer"]),
    ("broken_output_dims",
     {r"dims: \[ 384 \]": "dims: [ 768 ]"},
     ["model 'broken_output_dims'", "output EMBEDDING has dims [768]", "the graph produces width 384"]),
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


def test_missing_onnx_file_is_named(server, scratch_model, http_client):
    scratch_model("broken_missing_file",
                  replace={r'\{ key: "runtime"': '{ key: "onnx_file", value: { string_value: "nope.onnx" } },\n'
                                                 '  { key: "runtime"'})
    with pytest.raises(InferenceServerException, match=r"ONNX model not found: .*nope\.onnx"):
        http_client.load_model("broken_missing_file")
    # The failed instance's stub exits (a thread it left running once kept the model alive past the server's stop).
    deadline = time.monotonic() + 20
    while any(s.model == "broken_missing_file" and not s.dead for s in stub_processes(server.pid)):
        assert time.monotonic() < deadline, "the stub of a model that failed to load still runs after 20 s"
        time.sleep(0.2)


def test_reload_with_config_override(scratch_model, http_client, grpc_client):
    """The repository API retunes a model without a restart (what `coalesce tune` builds on)."""
    scratch_model("retuned")
    http_client.load_model("retuned")
    config = http_client.get_model_config("retuned")
    config["dynamic_batching"]["max_queue_delay_microseconds"] = 1500
    config["parameters"]["max_batch_rows"] = {"string_value": "16"}
    import json

    http_client.load_model("retuned", config=json.dumps(config))
    after = http_client.get_model_config("retuned")
    assert int(after["dynamic_batching"]["max_queue_delay_microseconds"]) == 1500
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


MINIMAL = 'backend: "coalesce"\n'


def _minimal_model(repository, name: str, source: str, files: tuple[str, ...], config: str) -> None:
    """A user's model: a few lines of config and the graph (and tokenizer) in version folder 1."""
    target = repository / name / "1"
    target.mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(config)
    for item in files:
        (target / item).symlink_to((model_dir(source) / "1" / item).resolve())


@pytest.mark.parametrize(("name", "source", "files", "extra", "inputs", "outputs"), [
    ("user_embedder", "minilm", ("model.onnx", "tokenizer.json"), "",
     [("TEXT", "TYPE_STRING", [1])], [("EMBEDDING", "TYPE_FP32", [384])]),
    ("user_reranker", "minilm_cross_encoder", ("model.onnx", "tokenizer.json"),
     'parameters [ { key: "task", value: { string_value: "classify" } } ]\n',
     [("TEXT", "TYPE_STRING", [1]), ("TEXT_PAIR", "TYPE_STRING", [1])], [("SCORES", "TYPE_FP32", [1])]),
    # A fixed cost model: calibrating passes of 2 x 64 sequences on every core, beside the tests' other models,
    # can take longer than the client's 60 s for a load (completion is what is tested here).
    ("user_scorer", "minilm", ("model.onnx", "tokenizer.json"),
     'parameters [ { key: "task", value: { string_value: "similarity" } },\n'
     '  { key: "cost_model", value: { string_value: "0.003,0.0001,0" } } ]\n',
     [("TEXT", "TYPE_STRING", [1]), ("TEXT_PAIR", "TYPE_STRING", [1])], [("SCORES", "TYPE_FP32", [1])]),
    ("user_graph", "minilm_tokens", ("model.onnx",),
     'parameters [ { key: "task", value: { string_value: "tensor" } },\n'
     '  { key: "mask_input", value: { string_value: "attention_mask" } } ]\n',
     [("input_ids", "TYPE_INT64", [-1]), ("attention_mask", "TYPE_INT64", [-1]),
      ("token_type_ids", "TYPE_INT64", [-1])], [("last_hidden_state", "TYPE_FP32", [-1, 384])]),
])
def test_a_minimal_config_is_completed_from_the_task_and_graph(repository, http_client, grpc_client, name, source,
                                                               files, extra, inputs, outputs):
    """``backend``, the task and the files are enough: inputs, outputs and a row limit are filled in at load."""
    _minimal_model(repository, name, source, files, MINIMAL + extra)
    try:
        http_client.load_model(name)
        config = grpc_client.get_model_config(name, as_json=True)["config"]
        assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config["input"]] == inputs
        assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config["output"]] == outputs
        assert int(config["max_batch_size"]) == 64 and "dynamic_batching" in config
        if name == "user_graph":
            assert [bool(t.get("optional")) for t in config["input"]] == [False, True, False]
            assert all(t.get("allow_ragged_batch") for t in config["input"]), config["input"]
    finally:
        http_client.unload_model(name)
        shutil.rmtree(repository / name, ignore_errors=True)


def test_a_graph_a_text_task_cannot_feed_is_refused_with_what_to_do(repository, http_client):
    _minimal_model(repository, "wrong_task", "digits", ("model.onnx", ), MINIMAL)
    (repository / "wrong_task" / "1" / "tokenizer.json").symlink_to((REPOSITORY / "minilm" / "1" /
                                                                     "tokenizer.json").resolve())
    try:
        with pytest.raises(InferenceServerException) as info:
            http_client.load_model("wrong_task")
        assert "the graph takes inputs ['image']" in info.value.message()
        assert "Serve other graphs with task 'tensor'" in info.value.message()
    finally:
        shutil.rmtree(repository / "wrong_task", ignore_errors=True)


def test_a_parameter_of_another_task_is_refused(scratch_model, http_client):
    scratch_model("pooled_digits", source="digits", parameters={"pooling": "cls"})
    with pytest.raises(InferenceServerException) as info:
        http_client.load_model("pooled_digits")
    assert ("parameter 'pooling' (value 'cls') applies to tasks embedding and similarity, but this model's task is "
            "'tensor'") in info.value.message()
