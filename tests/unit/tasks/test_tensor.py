"""The tensor task: reading rows, the mask the backend fills, padding per input, checking outputs, config and graph
checks, and completing a config from a graph."""

import copy

import numpy as np
import pytest

from coalesce.core.errors import ConfigError, InvalidInputError, RuntimeFailure
from coalesce.core.task import Pass
from coalesce.core.tensors import GraphIO, GraphTensor
from coalesce.settings import ModelSettings
from coalesce.tasks import create_task
from coalesce.tasks.tensor.task import TensorTask
from tests.conftest import model_config
from tests.unit.fakes import RAGGED_CONFIG, RaggedRuntime, ragged_request


def task_of(config=RAGGED_CONFIG, **parameters):
    config = copy.deepcopy(config)
    config["parameters"] = {**config.get("parameters", {}),
                            **{k: {"string_value": str(v)} for k, v in parameters.items()}}
    return create_task(ModelSettings.from_model_config(config), config, None)


@pytest.fixture()
def task():
    return task_of()


# -- reading --------------------------------------------------------------------------------------------------


def test_rows_are_split_on_dim_0_and_the_absent_mask_is_ones(task):
    request = ragged_request(3, 4, 0)
    rows = task.read(request)
    assert len(rows) == 3 and [row.length for row in rows] == [4, 4, 4]
    x, mask, scale = rows[1].values
    np.testing.assert_array_equal(x, request["x"][1])
    np.testing.assert_array_equal(scale, request["scale"][1])
    assert mask.dtype == np.int64 and mask.tolist() == [1, 1, 1, 1]
    sent = ragged_request(1, 2, 0)
    sent["mask"] = np.array([[1, 0]], dtype=np.int64)
    assert task.read(sent)[0].values[1].tolist() == [1, 0]  # a sent mask is taken as it is


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r.pop("x"), "request has no input 'x'"),
    (lambda r: r.update(x=r["x"].astype(np.float64)), "input 'x' has dtype float64, expected float32 (TYPE_FP32)"),
    (lambda r: r.update(x=r["x"][:, :, 0]), "input 'x' has shape [2, 4], expected [N, -1, 3]"),
    (lambda r: r.update(x=np.zeros((2, 4, 5), dtype=np.float32)), "input 'x' has shape [2, 4, 5], expected [N, -1, 3]"),
    (lambda r: r.update(scale=r["scale"][:1]), "input 'scale' has 1 rows, but the request's other inputs have 2"),
    (lambda r: r.update(mask=np.ones((2, 5), dtype=np.int64)),
     "input 'mask' has length 5 on dim 1, but 'x' has 4: every variable dim of a row has the same length"),
    (lambda r: r.update(x=np.zeros((2, 33, 3), dtype=np.float32), mask=np.ones((2, 33), dtype=np.int64)),
     "input 'x' has rows of length 33; the model takes 1 to 32 (parameter 'max_sequence_length')"),
    (lambda r: r.update(x=np.zeros((2, 0, 3), dtype=np.float32)),
     "input 'x' has rows of length 0; the model takes 1 to 32 (parameter 'max_sequence_length')"),
    (lambda r: r.update(x=np.zeros((0, 4, 3), dtype=np.float32), scale=np.zeros((0, 2), dtype=np.float32)),
     "the request has no rows: send at least one (dim 0 of 'x')"),
], ids=["missing", "dtype", "rank", "fixed_dim", "row_count", "lengths_disagree", "too_long", "empty_row", "no_rows"])
def test_a_request_that_does_not_fit_is_refused_naming_the_tensor(task, change, message):
    request = ragged_request(2, 4, 0)
    change(request)
    with pytest.raises(InvalidInputError) as info:
        task.read(request)
    assert str(info.value) == message


def test_row_bytes_tell_values_dtypes_and_shapes_apart(task):
    (a,) = task.read(ragged_request(1, 2, 0))
    (b,) = task.read(ragged_request(1, 2, 0))
    (c,) = task.read(ragged_request(1, 2, 1))
    assert task.row_bytes(a) == task.row_bytes(b) != task.row_bytes(c)
    flat = TensorTask.row_bytes(task, type(a)(values=(np.zeros(6, dtype=np.float32),), length=1))
    shaped = TensorTask.row_bytes(task, type(a)(values=(np.zeros((2, 3), dtype=np.float32),), length=1))
    typed = TensorTask.row_bytes(task, type(a)(values=(np.zeros(6, dtype=np.int32),), length=1))
    assert len({flat, shaped, typed}) == 3


# -- passes ---------------------------------------------------------------------------------------------------


def test_assemble_pads_each_input_with_its_pad_value_and_the_mask_with_zero(task):
    rows = task.read(ragged_request(1, 2, 0)) + task.read(ragged_request(1, 5, 1, mask=True))
    prepared = task.prepare(rows)
    assert prepared.lengths.tolist() == [2, 5]
    feeds = task.assemble(prepared, np.array([0, 1]), 5)
    assert feeds["x"].shape == (2, 5, 3) and feeds["x"].dtype == np.float32
    np.testing.assert_array_equal(feeds["x"][0, :2], rows[0].values[0])
    assert (feeds["x"][0, 2:] == -7).all()
    np.testing.assert_array_equal(feeds["x"][1], rows[1].values[0])
    np.testing.assert_array_equal(feeds["mask"], [[1, 1, 0, 0, 0], [1] * 5])
    np.testing.assert_array_equal(feeds["scale"], np.stack([rows[0].values[2], rows[1].values[2]]))
    # A pass whose rows all have its length is stacked as it is.
    same = task.assemble(prepared, np.array([1]), 5)
    np.testing.assert_array_equal(same["x"][0], rows[1].values[0])


def test_pad_values_default_to_zero():
    config = copy.deepcopy(RAGGED_CONFIG)
    del config["parameters"]["pad_value:x"]
    task = task_of(config)
    rows = task.read(ragged_request(1, 1, 0)) + task.read(ragged_request(1, 3, 1))
    assert (task.assemble(task.prepare(rows), np.array([0, 1]), 3)["x"][0, 1:] == 0).all()


def test_split_checks_shapes_and_cuts_nothing(task):
    rows = task.read(ragged_request(2, 3, 0))
    prepared = task.prepare(rows)
    batch = Pass(prepared, np.array([0, 1]), 3, task.assemble(prepared, np.array([0, 1]), 3))
    outputs = RaggedRuntime().run(batch.feeds, task.graph_outputs)
    split = task.split(batch, outputs)
    assert split["y"].shape == (2, 3, 3) and split["total"].shape == (2, 2)
    assert split["y"].tobytes() == outputs["y"].tobytes()
    # A graph that answers in a neighbouring dtype is cast to the config's.
    assert task.split(batch, {**outputs, "total": outputs["total"].astype(np.float32)})["total"].dtype == np.float64
    with pytest.raises(RuntimeFailure) as info:
        task.split(batch, {**outputs, "y": outputs["y"][:, :2]})
    assert str(info.value) == ("graph output 'y' has shape [2, 2, 3] for a pass of 2 rows of length 3; the config's "
                               "dims [-1, 3] say [2, 3, 3]")
    with pytest.raises(RuntimeFailure, match=r"^graph output 'total' has shape \[1, 2\] for a pass of 2 rows"):
        task.split(batch, {**outputs, "total": outputs["total"][:1]})


def test_synthetic_feeds_fill_the_mask_with_ones_and_the_rest_with_pad_values(task):
    feeds = task.synthetic_feeds(4, 6)
    assert feeds["x"].shape == (4, 6, 3) and (feeds["x"] == -7).all()
    assert feeds["mask"].shape == (4, 6) and (feeds["mask"] == 1).all()
    assert feeds["scale"].shape == (4, 2)


def test_a_model_of_fixed_shape_has_rows_of_length_one():
    config = copy.deepcopy(RAGGED_CONFIG)
    config["input"] = [config["input"][2]]
    config["output"] = [config["output"][1]]
    config["parameters"] = {"task": {"string_value": "tensor"}}
    task = task_of(config)
    assert task.max_length == 1
    assert task.lengths(task.read({"scale": np.zeros((3, 2), dtype=np.float32)})).tolist() == [1, 1, 1]


# -- config and graph -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("parameters", "change", "message"), [
    ({"pad_value:y": "1"}, None, "model 'ragged': parameter 'pad_value:y' names no input (inputs: ['mask', 'scale', "
                                 "'x'])"),
    ({"pad_value:scale": "1"}, None, "model 'ragged': parameter 'pad_value:scale': input 'scale' has no variable dim "
                                     "to pad"),
    ({"pad_value:mask": "1"}, None, "model 'ragged': parameter 'pad_value:mask': the mask input is always padded "
                                    "with 0"),
    ({"mask_input": "scale"}, None, "model 'ragged': parameter 'mask_input' names 'scale', which is not an input with "
                                    "a variable dim (inputs with one: ['mask', 'x'])"),
    ({"mask_input": "attention_mask"}, None, "model 'ragged': parameter 'mask_input' names 'attention_mask', which is "
                                             "not an input with a variable dim"),
    ({}, lambda c: c["input"][2].update(optional=True),
     "model 'ragged': input 'scale' is optional, but only the input named by 'mask_input' may be left out of a "
     "request (the backend fills it)"),
    ({}, lambda c: c["output"][0].update(data_type="TYPE_STRING"),
     "model 'ragged': tensor 'y' is TYPE_STRING; task 'tensor' takes numeric tensors (texts: tasks 'embedding', "
     "'classify' and 'similarity')"),
    ({}, lambda c: c.pop("output"), "model 'ragged': task 'tensor' needs the config to declare its inputs and outputs"),
], ids=["pad_unknown", "pad_fixed", "pad_mask", "mask_fixed", "mask_unknown", "optional", "string", "undeclared"])
def test_config_errors_name_the_model_the_parameter_and_the_tensor(parameters, change, message):
    config = copy.deepcopy(RAGGED_CONFIG)
    if change is not None:
        change(config)
    with pytest.raises(ConfigError) as info:
        task_of(config, **parameters)
    assert str(info.value).startswith(message)


def test_without_a_mask_input_an_optional_input_is_refused():
    config = copy.deepcopy(RAGGED_CONFIG)
    del config["parameters"]["mask_input"]
    with pytest.raises(ConfigError, match="input 'mask' is optional, but only the input named by 'mask_input'"):
        task_of(config)


def graph(**changes):
    tensors = {t.name: t for t in (*RaggedRuntime.graph.inputs, *RaggedRuntime.graph.outputs)}
    for name, tensor in changes.items():
        tensors[name] = tensor
    inputs = tuple(t for n, t in tensors.items() if n in ("x", "mask", "scale", "extra") and t is not None)
    outputs = tuple(t for n, t in tensors.items() if n in ("y", "total") and t is not None)
    return GraphIO(inputs=inputs, outputs=outputs)


@pytest.mark.parametrize(("changed", "message"), [
    (graph(extra=GraphTensor("extra", "TYPE_FP32", (None, 2))),
     "model 'ragged': the graph takes inputs ['extra'] the config does not declare"),
    (graph(total=None), "model 'ragged': output 'total' is not in the graph (its outputs: ['y'])"),
    (graph(x=GraphTensor("x", "TYPE_FP16", (None, None, 3))),
     "model 'ragged': input 'x' is TYPE_FP32 in the config but TYPE_FP16 in the graph"),
    (graph(x=GraphTensor("x", "TYPE_FP32", (None, None, 4))),
     "model 'ragged': input 'x' has graph shape [None, None, 4], which does not fit the config's dims [-1, 3]"),
    (graph(y=GraphTensor("y", "TYPE_FP32", (None, 3))),
     "model 'ragged': output 'y' has graph shape [None, 3]; the config's dims [-1, 3] need [batch, -1, 3] with a "
     "dynamic batch dim"),
    (graph(scale=GraphTensor("scale", "TYPE_FP32", (8, 2))),
     "model 'ragged': input 'scale' has graph shape [8, 2]; the config's dims [2] need [batch, 2] with a dynamic "
     "batch dim"),
], ids=["undeclared_input", "missing_output", "dtype", "dims", "rank", "fixed_batch"])
def test_the_graph_must_take_and_give_the_declared_tensors(task, changed, message):
    with pytest.raises(ConfigError) as info:
        task.bind(changed)
    assert str(info.value) == message


def test_a_graph_that_fits_binds_and_an_unknown_one_is_not_checked(task):
    task.bind(RaggedRuntime.graph)
    task.bind(None)  # BLS: the target answers pass by pass
    # A graph that cannot say its types (None) is checked on shapes only.
    task.bind(graph(total=GraphTensor("total", None, (None, 2))))


def test_complete_reads_the_graph_dropping_the_batch_dim():
    onnx_like = GraphIO(
        inputs=(GraphTensor("input_ids", "TYPE_INT64", (None, None)),
                GraphTensor("attention_mask", "TYPE_INT64", (None, None)),
                GraphTensor("pixels", "TYPE_FP32", (None, 3, None, 8))),
        outputs=(GraphTensor("last_hidden_state", "TYPE_FP32", (None, None, 384)),))
    config = {"name": "t", "parameters": {"task": {"string_value": "tensor"},
                                          "mask_input": {"string_value": "attention_mask"}}}
    inputs, outputs = TensorTask.complete(config, onnx_like)
    assert [t.as_config() for t in inputs] == [
        {"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]},
        {"name": "attention_mask", "data_type": "TYPE_INT64", "dims": [-1], "optional": True},
        {"name": "pixels", "data_type": "TYPE_FP32", "dims": [3, -1, 8]}]
    assert [t.as_config() for t in outputs] == [{"name": "last_hidden_state", "data_type": "TYPE_FP32",
                                                 "dims": [-1, 384]}]
    # Without mask_input nothing is optional; what the config declares is kept as it is.
    plain, _ = TensorTask.complete({"name": "t"}, onnx_like)
    assert not any(t.optional for t in plain)
    declared = {**config, "input": [{"name": "input_ids"}], "output": [{"name": "last_hidden_state"}]}
    assert TensorTask.complete(declared, onnx_like) == ([], [])
    assert TensorTask.complete(config, None) == ([], [])


def test_complete_leaves_to_the_config_what_the_graph_cannot_say():
    fixed_batch = GraphIO(inputs=(GraphTensor("x", "TYPE_FP32", (4, 8)),),
                          outputs=(GraphTensor("y", "TYPE_FP32", (None, 2)),))
    inputs, outputs = TensorTask.complete({"name": "t"}, fixed_batch)
    assert inputs == [] and [t.as_config() for t in outputs] == [{"name": "y", "data_type": "TYPE_FP32", "dims": [2]}]
    untyped = GraphIO(inputs=(GraphTensor("x", None, (None, 8)),), outputs=(GraphTensor("y", "TYPE_FP32", (None,)),))
    inputs, outputs = TensorTask.complete({"name": "t"}, untyped)
    assert inputs == [] and [t.dims for t in outputs] == [()]


def test_the_example_tokens_model_fills_its_mask():
    task = task_of(model_config("minilm_tokens"))
    assert task.mask_input == "attention_mask" and task.max_length == 512
    assert task.pad_values == {"input_ids": 0.0, "attention_mask": 0.0, "token_type_ids": 0.0}
    ids = np.array([[101, 7592, 102]], dtype=np.int64)
    (row,) = task.read({"input_ids": ids, "token_type_ids": np.zeros_like(ids)})
    assert row.values[1].tolist() == [1, 1, 1]
