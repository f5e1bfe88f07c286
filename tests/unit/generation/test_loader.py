"""Loading a generate model: the contract, settings that apply, auto-completion, models that cannot run."""

from __future__ import annotations

import pytest

from coalesce.core.errors import ConfigError
from coalesce.generation.contract import INPUT_NAMES, check_contract
from coalesce.loader import complete_config
from coalesce.settings import ModelSettings, SettingsError
from tests.unit.generation.conftest import generate_config, make_engine


def test_the_config_must_be_decoupled_with_the_vllm_tensors():
    assert check_contract("lm", generate_config(outputs=False)) == frozenset(), "only text_output: no other output"
    config = generate_config()
    assert len(check_contract("lm", config)) == 5
    with pytest.raises(ConfigError, match="decoupled: true"):
        check_contract("lm", {**config, "model_transaction_policy": {}})
    with pytest.raises(ConfigError, match="text_input"):
        check_contract("lm", {**config, "input": []})
    wrong = {**config, "input": [{"name": "text_input", "data_type": "TYPE_FP32", "dims": [1]}]}
    with pytest.raises(ConfigError, match="TYPE_STRING"):
        check_contract("lm", wrong)
    extra = {**config, "input": [*config["input"], {"name": "prompt", "data_type": "TYPE_STRING", "dims": [1]}]}
    with pytest.raises(ConfigError, match="prompt"):
        check_contract("lm", extra)


def test_auto_completion_adds_the_contract_and_decoupling():
    completion = complete_config({"name": "lm", "parameters": {"task": {"string_value": "generate"}}}, None)
    assert completion.decoupled and completion.max_batch_size is None
    assert tuple(t.name for t in completion.inputs) == INPUT_NAMES
    assert [t.name for t in completion.inputs][:4] == ["text_input", "stream", "sampling_parameters",
                                                       "exclude_input_in_output"]
    assert [t.name for t in completion.outputs] == ["text_output", "finish_reason", "cumulative_logprob", "logprobs",
                                                    "num_input_tokens", "num_output_tokens"]
    minimal = {**generate_config(outputs=False), "parameters": {"task": {"string_value": "generate"}}}
    partial = complete_config(minimal, None)
    assert "text_input" not in [t.name for t in partial.inputs], "declared tensors are not added again"
    assert next(t.name for t in partial.outputs) == "finish_reason"


@pytest.mark.parametrize(("key", "value", "match"), [
    ("cache_bytes", "1000", "applies to task"), ("max_batch_rows", "8", "applies to task"),
    ("runtime", "onnxruntime", "torch runtime"), ("kv_cache_bytes", "0", "must be >= 1"),
    ("generation_batching", "static", "continuous, request"),
])
def test_settings_of_other_tasks_and_bad_values_fail_the_load(key, value, match):
    with pytest.raises(SettingsError, match=match):
        ModelSettings.from_model_config(generate_config(**{key: value}))


def test_missing_files_and_a_pool_without_a_block_fail_the_load(llama_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"tokenizer\.json is missing"):
        make_engine(tmp_path)
    with pytest.raises(ConfigError, match="holds no block"):
        make_engine(llama_dir, kv_cache_bytes="100")


def test_the_context_is_capped_by_the_model_and_the_pool(llama_dir):
    engine, _ = make_engine(llama_dir, max_sequence_length="100000")
    assert engine.context_length == 512, "the model's max_position_embeddings"
