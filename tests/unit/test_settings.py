"""Settings: one options object per component, parsed from config.pbtxt parameters, every bad key or value refused
with the model, the key and the value named."""

import dataclasses
import subprocess
import sys

import pytest

from coalesce.core.errors import ConfigError
from coalesce.settings import (
    COMPONENTS,
    ModelSettings,
    SettingsError,
    config_parameters,
    parameter_fields,
    parse_cost_model,
    parse_tenant_map,
)

GOOD_CONFIG = {
    "name": "minilm",
    "max_batch_size": 64,
    "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": ["1"]}],
    "output": [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": ["384"]}],
    "parameters": {"max_batch_rows": {"string_value": "32"}, "normalize": {"string_value": "false"}},
}


def parse(**parameters):
    return ModelSettings.from_parameters({k: str(v) for k, v in parameters.items()}, model_name="m")


def test_defaults_and_parse_from_model_config():
    settings = ModelSettings.from_model_config(GOOD_CONFIG)
    assert settings.model_name == "minilm" and settings.max_batch_size == 64
    assert settings.planner.max_batch_rows == 32
    assert settings.embedding.normalize is False and settings.embedding.pooling == "mean"
    assert settings.task.task == "embedding" and settings.task.max_sequence_length == 256
    assert settings.runtime.runtime == "auto" and settings.cache.cache_bytes == 0
    assert settings.scheduler.scheduling == "triton" and settings.metrics.metrics_interval_ms == 100.0
    assert settings.tensor.pad_values == {}


def test_config_parameters_unwrap_tritons_string_values():
    assert config_parameters(GOOD_CONFIG) == {"max_batch_rows": "32", "normalize": "false"}
    assert config_parameters({"parameters": {"a": "plain"}}) == {"a": "plain"}
    assert config_parameters({}) == {}


def test_settings_are_frozen():
    settings = parse()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.planner.max_batch_rows = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.planner = None  # type: ignore[misc]


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("YES", True), (" on ", True), ("1", True),
                                                 ("false", False), ("No", False), ("off", False), ("0", False)])
def test_booleans(value, expected):
    assert parse(normalize=value).embedding.normalize is expected


@pytest.mark.parametrize(("key", "value", "message"), [
    ("max_batch_rows", "many", "parameter 'max_batch_rows' has bad value 'many': expected an integer"),
    ("max_batch_rows", "0", "parameter 'max_batch_rows' has bad value '0': must be >= 1"),
    ("max_batch_rows", "2.5", "parameter 'max_batch_rows' has bad value '2.5': expected an integer"),
    ("max_padding_ratio", "0.5", "parameter 'max_padding_ratio' has bad value '0.5': must be >= 1"),
    ("max_padding_ratio", "wide", "parameter 'max_padding_ratio' has bad value 'wide': expected a number"),
    ("max_padding_ratio", "inf", "parameter 'max_padding_ratio' has bad value 'inf': expected a finite number"),
    ("normalize", "maybe", "parameter 'normalize' has bad value 'maybe': expected true or false"),
    ("runtime", "tensorflow",
     "parameter 'runtime' has bad value 'tensorflow': expected one of auto, tensorrt, onnxruntime, torch, bls"),
    ("task", "chat", "parameter 'task' has bad value 'chat': expected one of embedding, classify, similarity, "
                     "tensor, generate"),
    ("pooling", "max", "parameter 'pooling' has bad value 'max': expected one of mean, cls"),
    ("max_sequence_length", "0", "parameter 'max_sequence_length' has bad value '0': must be >= 1"),
    ("max_text_bytes", "2000000000", "parameter 'max_text_bytes' has bad value '2000000000': must be <= 1.07374e+09"),
    ("onnx_file", "", "parameter 'onnx_file' has bad value '': must not be empty"),
    ("planner", "magic", "parameter 'planner' has bad value 'magic': expected one of dp, greedy"),
    ("cost_model", "1,2",
     "parameter 'cost_model' has bad value '1,2': expected 'auto' or three non-negative numbers 'a,b,c' (seconds)"),
    ("cost_model", "1,-2,3", "parameter 'cost_model' has bad value '1,-2,3': expected 'auto' or three"),
    ("redis_url", "http://cache:6379",
     "parameter 'redis_url' has bad value 'http://cache:6379': expected a URL starting with redis://, rediss://, "
     "unix://"),
    ("redis_timeout_ms", "0", "parameter 'redis_timeout_ms' has bad value '0': must be >= 1"),
    ("redis_key_prefix", "", "parameter 'redis_key_prefix' has bad value '': must not be empty"),
    ("tenant_weights", "a:1,b", "parameter 'tenant_weights' has bad value 'a:1,b': tenant_weights entry 'b' is not "
                                "'tenant:positive number'"),
    ("tenant_max_rows_per_s", "a:0",
     "parameter 'tenant_max_rows_per_s' has bad value 'a:0': tenant_max_rows_per_s entry 'a:0' is not"),
])
def test_bad_values_name_model_key_and_value(key, value, message):
    with pytest.raises(SettingsError) as info:
        ModelSettings.from_parameters({key: value}, model_name="minilm")
    assert str(info.value).startswith(f"model 'minilm': {message}")


def test_an_unknown_key_is_named_with_its_value_and_the_known_keys():
    with pytest.raises(SettingsError) as info:
        ModelSettings.from_parameters({"max_batch_rowz": "8"}, model_name="minilm")
    message = str(info.value)
    assert message.startswith("model 'minilm': unknown parameter 'max_batch_rowz' (value '8'); known parameters: ")
    assert "max_batch_rows" in message and message.endswith(", pad_value:<input>")
    with pytest.raises(SettingsError, match=r"^model 'm': unknown parameter 'pad_value:' \(value '1'\)"):
        parse(**{"pad_value:": "1"})


@pytest.mark.parametrize(("task", "key", "value", "applies"), [
    ("classify", "pooling", "cls", "tasks embedding and similarity"),
    ("classify", "normalize", "false", "tasks embedding and similarity"),
    ("embedding", "activation", "sigmoid", "task classify"),
    ("similarity", "activation", "sigmoid", "task classify"),
    ("tensor", "tokenizer_file", "t.json", "tasks embedding, classify and similarity"),
    ("tensor", "max_text_bytes", "10", "tasks embedding, classify and similarity"),
    ("embedding", "mask_input", "attention_mask", "task tensor"),
    ("classify", "pad_value:input_ids", "0", "task tensor"),
])
def test_a_key_of_another_tasks_options_is_refused_naming_the_task(task, key, value, applies):
    with pytest.raises(SettingsError) as info:
        ModelSettings.from_parameters({"task": task, key: value}, model_name="m")
    assert str(info.value) == (f"model 'm': parameter '{key}' (value '{value}') applies to {applies}, but this "
                               f"model's task is '{task}'")


def test_the_default_task_is_embedding_for_the_task_check():
    with pytest.raises(SettingsError, match="applies to task classify, but this model's task is 'embedding'"):
        parse(activation="softmax")


def test_pad_values_are_read_per_input():
    settings = ModelSettings.from_parameters(
        {"task": "tensor", "pad_value:input_ids": "3", "pad_value:pixels": " -1.5 ", "mask_input": "attention_mask"},
        model_name="m")
    assert settings.tensor.pad_values == {"input_ids": 3.0, "pixels": -1.5}
    assert settings.tensor.mask_input == "attention_mask"
    for bad in ("nan", "zero", "inf"):
        with pytest.raises(SettingsError) as info:
            ModelSettings.from_parameters({"task": "tensor", "pad_value:x": bad}, model_name="m")
        assert str(info.value) == f"model 'm': parameter 'pad_value:x' has bad value '{bad}': expected a number"


def test_changed_lists_only_what_differs_from_the_defaults():
    assert parse().changed() == {}
    assert parse(max_batch_rows="64", planner="dp").changed() == {}  # set, but to the default
    settings = ModelSettings.from_parameters({"task": "tensor", "max_batch_rows": "16", "thread_spinning": "off",
                                              "pad_value:x": "2", "cache_bytes": "1024"}, model_name="m")
    assert settings.changed() == {"task": "tensor", "max_batch_rows": 16, "thread_spinning": False,
                                  "pad_values": {"x": 2.0}, "cache_bytes": 1024}


def test_settings_errors_are_value_errors_not_config_errors():
    with pytest.raises(SettingsError) as info:
        parse(max_batch_rows="0")
    assert isinstance(info.value, ValueError) and not isinstance(info.value, ConfigError)


def test_token_budget_must_fit_one_full_length_row_of_text():
    with pytest.raises(SettingsError) as info:
        parse(max_batch_tokens="100", max_sequence_length="256")
    assert str(info.value) == ("model 'm': parameter 'max_batch_tokens' (value '100') is below 'max_sequence_length' "
                               "(256): a single long text could never be scheduled")
    # The tensor task refuses longer rows at reading instead.
    assert parse(task="tensor", max_batch_tokens="100").planner.max_batch_tokens == 100


def test_every_parameter_is_documented_and_declared_once():
    names = [f.name for _, options in COMPONENTS for f in parameter_fields(options)]
    assert len(names) == len(set(names))
    for _, options in COMPONENTS:
        for field in parameter_fields(options):
            assert field.metadata["doc"], field.name


def test_cost_model_and_tenant_maps_are_parsed():
    assert parse().planner.cost_coefficients is None
    assert parse(cost_model="0.001, 2e-4 ,0").planner.cost_coefficients == (0.001, 0.0002, 0.0)
    assert parse_cost_model("1,2,3") == (1.0, 2.0, 3.0)
    settings = parse(tenant_weights="gold:3, free:0.5", tenant_max_rows_per_s="free:100")
    assert settings.scheduler.weights == {"gold": 3.0, "free": 0.5}
    assert settings.scheduler.rate_limits == {"free": 100.0}
    assert parse_tenant_map("", what="w") == {}
    assert parse_tenant_map("a:b:2", what="w") == {"a:b": 2.0}  # the last colon separates the value


def test_an_empty_redis_url_means_no_shared_tier():
    settings = parse(redis_url="")
    assert settings.cache.redis_url == "" and not settings.cache.enabled
    assert parse(redis_url="redis://127.0.0.1:6379/0").cache.enabled
    assert parse(cache_bytes="1").cache.enabled


def test_the_settings_module_imports_nothing_of_ours():
    code = ("import sys, coalesce.settings; "
            "print(sorted(m for m in sys.modules if m.startswith('coalesce') and m != 'coalesce.settings'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['coalesce']"


@pytest.mark.parametrize("key", ["tokenizer_file", "onnx_file", "engine_file", "torch_model_dir"])
@pytest.mark.parametrize(("value", "why"), [
    ("../other/model.onnx", "must stay inside the version folder ('..' is refused)"),
    ("sub/../../x", "must stay inside the version folder ('..' is refused)"),
    ("..\\x", "must stay inside the version folder ('..' is refused)"),
    ("/etc/passwd", "must be relative to the version folder, not an absolute path"),
    ("\\\\host\\share\\m.onnx", "must be relative to the version folder, not an absolute path"),
    ("C:\\models\\m.onnx", "must be relative to the version folder, not an absolute path"),
])
def test_file_parameters_stay_inside_the_version_folder(key, value, why):
    config = {"name": "m", "max_batch_size": 8, "parameters": {key: {"string_value": value}}}
    with pytest.raises(SettingsError) as info:
        ModelSettings.from_model_config(config)
    assert str(info.value) == f"model 'm': parameter '{key}' has bad value '{value}': {why}"


@pytest.mark.parametrize("value", ["model.onnx", "sub/model.onnx", "..hidden.onnx", "a..b/model.onnx"])
def test_relative_file_names_inside_the_version_folder_are_accepted(value):
    assert ModelSettings.from_parameters({"onnx_file": value}).runtime.onnx_file == value


def test_limits_parse_with_their_defaults():
    settings = ModelSettings.from_parameters({})
    assert settings.task.max_request_bytes == 4 << 20
    assert settings.text.text_bytes_per_token == 64
    assert settings.scheduler.max_queue_bytes == 64 << 20
    changed = ModelSettings.from_parameters({"max_request_bytes": "1024", "text_bytes_per_token": "0",
                                             "max_queue_bytes": "4096"})
    assert (changed.task.max_request_bytes, changed.text.text_bytes_per_token,
            changed.scheduler.max_queue_bytes) == (1024, 0, 4096)
    with pytest.raises(SettingsError, match="parameter 'max_request_bytes' has bad value '0': must be >= 1"):
        ModelSettings.from_parameters({"max_request_bytes": "0"})
