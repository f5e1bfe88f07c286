"""``coalesce_tools.config.with_parameters``: one way to set parameters, on a config's JSON form or its text."""

import pytest

from coalesce_tools.config import ConfigReadError, parameter, parse_model_config, read_model_config, with_parameters
from tests.conftest import MODEL_DIR

SHIPPED = (MODEL_DIR / "config.pbtxt").read_text()


def test_text_keeps_comments_and_layout_and_sets_each_value():
    text = with_parameters(SHIPPED, {"precision": "fp32", "brand_new": "7"})
    assert [line for line in text.splitlines() if line.lstrip().startswith("#")] == [
        line for line in SHIPPED.splitlines() if line.lstrip().startswith("#")
    ]
    config = parse_model_config(text)
    assert (parameter(config, "precision"), parameter(config, "brand_new")) == ("fp32", "7")
    shipped = read_model_config(MODEL_DIR / "config.pbtxt")["parameters"]
    assert {k: v for k, v in config["parameters"].items() if k not in ("precision", "brand_new")} == {
        k: v for k, v in shipped.items() if k != "precision"
    }


def test_text_and_json_forms_agree():
    parameters = {"precision": "fp32", "cache_bytes": "0", "brand_new": "x"}
    from_text = parse_model_config(with_parameters(SHIPPED, parameters))
    from_json = with_parameters(read_model_config(MODEL_DIR / "config.pbtxt"), parameters)
    assert from_text["parameters"] == from_json["parameters"]


def test_text_without_parameters_gets_a_list_and_empty_changes_nothing():
    text = 'name: "m"\nbackend: "coalesce"\nmax_batch_size: 4\n'
    assert with_parameters(text, {}) == text
    assert parameter(parse_model_config(with_parameters(text, {"task": "tensor"})), "task") == "tensor"


def test_text_with_block_syntax_parameters_is_set_too():
    text = 'name: "m"\nparameters { key: "precision" value { string_value: "int8" } }\n'
    assert parameter(parse_model_config(with_parameters(text, {"precision": "fp32"})), "precision") == "fp32"


def test_an_edit_that_did_not_take_is_an_error_naming_the_parameter():
    # The entry the edit finds is a comment: the value Triton reads would stay int8.
    text = (
        'name: "m"\n# was { key: "precision", value: { string_value: "fp16" } }\n'
        'parameters [\n  { key: "precision", value: { string_value: "int8" } }\n]\n'
    )
    with pytest.raises(ConfigReadError, match="precision"):
        with_parameters(text, {"precision": "fp32"})
