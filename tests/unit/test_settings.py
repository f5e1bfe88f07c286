import copy

import pytest

from coalesce.errors import ConfigError
from coalesce.settings import Settings

GOOD_CONFIG = {
    "name": "minilm",
    "max_batch_size": 64,
    "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": ["1"]}],
    "output": [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": ["384"]}],
    "parameters": {"max_batch_rows": {"string_value": "32"}, "normalize": {"string_value": "true"}},
}


def test_defaults_and_parse_from_model_config():
    settings = Settings.from_model_config(GOOD_CONFIG)
    assert settings.max_batch_rows == 32
    assert settings.normalize is True
    assert settings.max_sequence_length == 256
    assert settings.model_name == "minilm"
    assert settings.max_batch_size == 64
    assert settings.embedding_dim == 384


def test_settings_are_frozen():
    settings = Settings.from_parameters({})
    with pytest.raises(AttributeError):
        settings.max_batch_rows = 3  # type: ignore[misc]


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("max_batch_rowz", "8", "unknown parameter 'max_batch_rowz' (value '8')"),
    ("max_batch_rows", "many", "parameter 'max_batch_rows' has bad value 'many': expected an integer"),
    ("max_batch_rows", "0", "parameter 'max_batch_rows' has bad value '0': must be >= 1"),
    ("max_padding_ratio", "0.5", "parameter 'max_padding_ratio' has bad value '0.5': must be >= 1"),
    ("max_padding_ratio", "wide", "expected a number"),
    ("normalize", "maybe", "parameter 'normalize' has bad value 'maybe': expected true or false"),
    ("runtime", "tensorflow",
     "parameter 'runtime' has bad value 'tensorflow': expected one of auto, tensorrt, onnxruntime, torch, bls"),
    ("max_sequence_length", "4096", "must be <= 512"),
    ("onnx_file", "", "must not be empty"),
    ("planner", "magic", "expected one of dp, greedy"),
    ("cost_model", "1,2", "parameter 'cost_model' has bad value '1,2': expected 'auto' or three non-negative"),
    ("cost_model", "1,-2,3", "has bad value '1,-2,3'"),
    ("redis_url", "http://cache:6379", "parameter 'redis_url' has bad value 'http://cache:6379': expected a URL"),
    ("redis_timeout_ms", "0", "parameter 'redis_timeout_ms' has bad value '0': must be >= 1"),
    ("redis_key_prefix", "", "must not be empty"),
])
def test_bad_parameters_name_model_key_and_value(key, value, fragment):
    with pytest.raises(ConfigError) as info:
        Settings.from_parameters({key: value}, model_name="minilm")
    assert "model 'minilm'" in str(info.value)
    assert fragment in str(info.value)


def test_token_budget_must_fit_one_full_length_row():
    with pytest.raises(ConfigError, match=r"'max_batch_tokens' .*below 'max_sequence_length'"):
        Settings.from_parameters({"max_batch_tokens": "100", "max_sequence_length": "256"}, model_name="m")


@pytest.mark.parametrize(("mutate", "fragment"), [
    (lambda c: c["input"][0].update(name="TEXTS"), "expected exactly one input 'TEXT'"),
    (lambda c: c["input"][0].update(data_type="TYPE_FP32"), "data_type 'TYPE_FP32', expected 'TYPE_STRING'"),
    (lambda c: c["input"][0].update(dims=["2"]), "input 'TEXT' has dims"),
    (lambda c: c["output"][0].update(data_type="TYPE_FP16"), "output 'EMBEDDING' has data_type 'TYPE_FP16'"),
    (lambda c: c["output"][0].update(dims=["384", "2"]), "output 'EMBEDDING' has dims [384, 2]"),
    (lambda c: c.update(max_batch_size=0), "max_batch_size is 0"),
])
def test_io_contract_checked(mutate, fragment):
    config = copy.deepcopy(GOOD_CONFIG)
    mutate(config)
    with pytest.raises(ConfigError) as info:
        Settings.from_model_config(config)
    assert fragment in str(info.value)
    assert "model 'minilm'" in str(info.value)


def test_every_parameter_documented():
    for field in Settings.parameter_fields():
        assert field.metadata["doc"], field.name


def test_an_empty_redis_url_means_no_shared_tier():
    settings = Settings.from_parameters({"redis_url": ""}, model_name="m")
    assert settings.redis_url == "" and not settings.caches_rows
    assert Settings.from_parameters({"redis_url": "redis://127.0.0.1:6379/0"}, model_name="m").caches_rows
