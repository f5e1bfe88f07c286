"""Tensor specs as a model config declares them, and the check of a config's declared tensors."""

import numpy as np
import pytest

from coalesce.core.errors import ConfigError, InvalidInputError, as_result
from coalesce.core.tensors import (
    ONNX_TO_TRITON,
    TRITON_TO_NUMPY,
    VARIABLE,
    GraphIO,
    GraphTensor,
    TensorSpec,
    check_declared,
    config_tensors,
)


def test_from_config_reads_the_json_form_triton_hands_over():
    # Triton's JSON form (protobuf MessageToDict) writes int64 dims as strings.
    spec = TensorSpec.from_config({"name": "x", "data_type": "TYPE_FP16", "dims": ["-1", "3"], "optional": True},
                                  model_name="m")
    assert spec == TensorSpec("x", "TYPE_FP16", (VARIABLE, 3), optional=True)
    assert spec.dtype == np.float16 and spec.variable_axes == (0,)
    assert TensorSpec.from_config({"name": "s", "data_type": "TYPE_STRING", "dims": [1]}, model_name="m").dtype \
        == np.object_
    assert TensorSpec.from_config({"name": "scalar", "data_type": "TYPE_INT32"}, model_name="m").dims == ()


def test_from_config_refuses_a_type_triton_does_not_know():
    with pytest.raises(ConfigError) as info:
        TensorSpec.from_config({"name": "x", "data_type": "TYPE_FLOAT", "dims": [2]}, model_name="m")
    assert str(info.value) == ("model 'm': tensor 'x' has data_type 'TYPE_FLOAT', expected one of "
                               + ", ".join(TRITON_TO_NUMPY))


def test_row_shape_puts_the_rows_length_in_every_variable_dim():
    spec = TensorSpec("x", "TYPE_FP32", (VARIABLE, 3, VARIABLE))
    assert spec.variable_axes == (0, 2)
    assert spec.row_shape(7) == (7, 3, 7)
    assert TensorSpec("y", "TYPE_FP32", (10,)).row_shape(7) == (10,)


def test_as_config_round_trips():
    for spec in (TensorSpec("x", "TYPE_INT64", (VARIABLE,), optional=True), TensorSpec("y", "TYPE_FP32", (384,))):
        assert TensorSpec.from_config(spec.as_config(), model_name="m") == spec
    assert "optional" not in TensorSpec("y", "TYPE_FP32", (1,)).as_config()


def test_config_tensors_in_order_and_none_when_undeclared():
    config = {"input": [{"name": "b", "data_type": "TYPE_FP32", "dims": [1]},
                        {"name": "a", "data_type": "TYPE_FP32", "dims": [2]}], "output": None}
    assert [t.name for t in config_tensors(config, "input", model_name="m")] == ["b", "a"]
    assert config_tensors(config, "output", model_name="m") == []
    assert config_tensors({}, "input", model_name="m") == []


EXPECTED = [TensorSpec("EMBEDDING", "TYPE_FP32", (384,))]


@pytest.mark.parametrize(("declared", "message"), [
    ([], "model 'm': expected outputs ['EMBEDDING'], found []"),
    ([TensorSpec("VECTOR", "TYPE_FP32", (384,))], "model 'm': expected outputs ['EMBEDDING'], found ['VECTOR']"),
    ([*EXPECTED, TensorSpec("EXTRA", "TYPE_FP32", (1,))],
     "model 'm': expected outputs ['EMBEDDING'], found ['EMBEDDING', 'EXTRA']"),
    ([TensorSpec("EMBEDDING", "TYPE_FP16", (384,))],
     "model 'm': output 'EMBEDDING' has data_type 'TYPE_FP16', expected 'TYPE_FP32'"),
    ([TensorSpec("EMBEDDING", "TYPE_FP32", (768,))], "model 'm': output 'EMBEDDING' has dims [768], expected [384]"),
])
def test_check_declared_names_the_model_the_tensor_and_what_differs(declared, message):
    with pytest.raises(ConfigError) as info:
        check_declared("m", "output", declared, EXPECTED)
    assert str(info.value) == message


def test_check_declared_accepts_the_expected_tensors_in_any_order():
    two = [TensorSpec("a", "TYPE_FP32", (1,)), TensorSpec("b", "TYPE_INT64", (VARIABLE,))]
    check_declared("m", "input", list(reversed(two)), two)


def test_graph_io_looks_tensors_up_by_name():
    graph = GraphIO(inputs=(GraphTensor("x", "TYPE_FP32", (None, 3)),),
                    outputs=(GraphTensor("y", None, (None,)),))
    assert graph.input("x").shape == (None, 3) and graph.input("y") is None
    assert graph.output("y").data_type is None and graph.output("x") is None


def test_every_onnx_type_maps_to_a_triton_type_numpy_knows():
    assert set(ONNX_TO_TRITON.values()) <= set(TRITON_TO_NUMPY)


def test_an_error_made_a_result_drops_its_traceback_and_context():
    try:
        try:
            raise KeyError("inner")
        except KeyError:
            raise InvalidInputError("outer") from None
    except InvalidInputError as exc:
        error = exc
    assert error.__traceback__ is not None
    result = as_result(error)
    assert result is error and result.code == "INVALID_ARG"
    assert result.__traceback__ is None and result.__context__ is None and result.__cause__ is None
