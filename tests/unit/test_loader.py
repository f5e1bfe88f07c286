"""Loading a model without Triton: config auto-completion from the real graphs, the cost model (calibrated, fixed or
BLS's default), the row cache's wiring, and each example model end to end."""

import copy
import types

import numpy as np
import pytest

from coalesce import loader
from coalesce.batching import costmodel
from coalesce.batching.costmodel import CALIBRATION_REPEATS, CALIBRATION_SHAPES, CostModel
from coalesce.cache.keys import file_digest
from coalesce.core.errors import ConfigError
from coalesce.loader import (
    BLS_DEFAULT_COST,
    DEFAULT_MAX_BATCH_SIZE,
    complete_config,
    load_pipeline,
    read_settings,
    triton_prefetch_blockers,
)
from coalesce.observability.log import Logger
from coalesce.runtimes import RuntimeChoice
from tests.conftest import EXAMPLE_MODELS, REPOSITORY, built, model_config
from tests.unit.fakes import EncoderRuntime, answers, texts

FIXED_COST = "0.001,0.0001,0"


def specs(tensors):
    return [t.as_config() for t in tensors]


def completed(config, version_dir):
    """``config`` with what auto-completion adds, as Triton would hand it to ``initialize``."""
    out = copy.deepcopy(config)
    completion = complete_config(config, version_dir)
    out.setdefault("input", []).extend(specs(completion.inputs))
    out.setdefault("output", []).extend(specs(completion.outputs))
    if completion.max_batch_size:
        out["max_batch_size"] = completion.max_batch_size
    return out


# -- settings -------------------------------------------------------------------------------------------------


def test_a_settings_error_fails_the_load_as_a_config_error_with_its_message():
    with pytest.raises(ConfigError) as info:
        read_settings(model_config("minilm", max_batch_rows="0"))
    assert str(info.value) == "model 'minilm': parameter 'max_batch_rows' has bad value '0': must be >= 1"
    assert info.value.__cause__ is None and info.value.__suppress_context__  # one message, not two tracebacks


def test_a_model_without_batching_is_refused():
    config = {**model_config("minilm"), "max_batch_size": 0}
    with pytest.raises(ConfigError) as info:
        load_pipeline(config, built("minilm"))
    assert str(info.value) == ("model 'minilm': max_batch_size is 0; the coalesce backend needs batching "
                               "(max_batch_size >= 1): rows are dim 0 of every tensor")


# -- auto-completion ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["minilm", "minilm_rerank", "minilm_tokens", "minilm_cross_encoder"])
def test_a_config_that_declares_everything_gets_nothing_added(name):
    completion = complete_config(model_config(name), built(name))
    assert (completion.inputs, completion.outputs, completion.max_batch_size, completion.notes) == ([], [], None, [])


def test_the_digits_config_is_completed_from_its_graph():
    completion = complete_config(model_config("digits"), built("digits"))
    assert specs(completion.inputs) == [{"name": "image", "data_type": "TYPE_FP32", "dims": [8, 8]}]
    assert specs(completion.outputs) == [{"name": "logits", "data_type": "TYPE_FP32", "dims": [10]}]
    assert completion.max_batch_size is None  # the config says 256
    assert completion.notes == ["auto-completed input image TYPE_FP32 [8, 8], output logits TYPE_FP32 [10]"]


def test_settings_that_turn_off_tritons_prefetching_are_named():
    def blockers(batching):
        return triton_prefetch_blockers({"dynamic_batching": batching})

    assert blockers({"default_queue_policy": {"max_queue_size": "256"}}) == ["max_queue_size 256"]
    assert blockers({"default_queue_policy": {"timeout_action": "REJECT", "default_timeout_microseconds": "50000",
                                              "allow_timeout_override": True},
                     "priority_levels": "2"}) == ["default_timeout_microseconds 50000",
                                                  "allow_timeout_override true", "priority_levels 2"]
    assert blockers({"default_queue_policy": {"max_queue_size": "0", "default_timeout_microseconds": 0}}) == []
    assert blockers({"preferred_batch_size": [16]}) == []
    assert triton_prefetch_blockers({}) == triton_prefetch_blockers({"sequence_batching": {}}) == []
    for name in ("minilm", "minilm_rerank", "minilm_tokens", "digits"):
        assert triton_prefetch_blockers(model_config(name)) == [], name


def test_a_minimal_config_gets_a_row_limit():
    minimal = {"name": "tiny", "backend": "coalesce", "parameters": {"task": {"string_value": "tensor"}}}
    completion = complete_config(minimal, built("digits"))
    assert completion.max_batch_size == DEFAULT_MAX_BATCH_SIZE == 64
    assert completion.notes == ["auto-completed input image TYPE_FP32 [8, 8], output logits TYPE_FP32 [10], "
                                "max_batch_size 64"]
    assert complete_config(minimal, None).notes == ["auto-completed max_batch_size 64"]


def test_symbolic_dims_of_a_tensor_graph_become_variable_and_the_mask_optional():
    config = {"name": "raw", "max_batch_size": 8,
              "parameters": {"task": {"string_value": "tensor"}, "mask_input": {"string_value": "attention_mask"}}}
    completion = complete_config(config, built("minilm_tokens"))
    assert specs(completion.inputs) == [
        {"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]},
        {"name": "attention_mask", "data_type": "TYPE_INT64", "dims": [-1], "optional": True},
        {"name": "token_type_ids", "data_type": "TYPE_INT64", "dims": [-1]}]
    assert specs(completion.outputs) == [{"name": "last_hidden_state", "data_type": "TYPE_FP32", "dims": [-1, 384]}]


@pytest.mark.parametrize(("name", "task", "inputs", "outputs"), [
    ("minilm", "embedding", [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}],
     [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": [384]}]),
    ("minilm_cross_encoder", "classify", [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]},
                                          {"name": "TEXT_PAIR", "data_type": "TYPE_STRING", "dims": [1],
                                           "optional": True}],
     [{"name": "SCORES", "data_type": "TYPE_FP32", "dims": [1]}]),
    # Pairs are every row of a similarity model: TEXT_PAIR is required; one score a row, whatever the graph's width.
    ("minilm_rerank", "similarity", [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]},
                                     {"name": "TEXT_PAIR", "data_type": "TYPE_STRING", "dims": [1]}],
     [{"name": "SCORES", "data_type": "TYPE_FP32", "dims": [1]}]),
])
def test_a_text_model_is_completed_from_its_graph(name, task, inputs, outputs):
    config = {"name": name, "max_batch_size": 8, "parameters": {"task": {"string_value": task}}}
    completion = complete_config(config, built(name))
    assert specs(completion.inputs) == inputs and specs(completion.outputs) == outputs


def test_a_text_task_over_a_graph_it_cannot_feed_fails_at_once():
    config = {"name": "wrong", "max_batch_size": 8}
    with pytest.raises(ConfigError) as info:
        complete_config(config, built("digits"))
    assert str(info.value) == ("model 'wrong': the graph takes inputs ['image']; task 'embedding' fills "
                               "['input_ids', 'attention_mask', 'token_type_ids'] (input_ids required). Serve other "
                               "graphs with task 'tensor'")


def test_an_unreadable_graph_is_noted_and_the_load_says_the_rest(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"not an onnx graph")
    config = {"name": "broken", "max_batch_size": 8, "parameters": {"task": {"string_value": "tensor"}}}
    completion = complete_config(config, tmp_path)
    assert (completion.inputs, completion.outputs) == ([], [])
    assert len(completion.notes) == 1
    assert completion.notes[0].startswith(f"could not read the graph to complete the config: cannot load ONNX model "
                                          f"{tmp_path / 'model.onnx'}: ")
    with pytest.raises(ConfigError, match=r"^model 'broken': task 'tensor' needs the config to declare its inputs"):
        load_pipeline(config, tmp_path)


def test_onnx_file_names_the_graph_to_complete_from(tmp_path):
    (tmp_path / "other.onnx").symlink_to(built("digits") / "model.onnx")
    config = {"name": "d", "max_batch_size": 8,
              "parameters": {"task": {"string_value": "tensor"}, "onnx_file": {"string_value": "other.onnx"}}}
    assert [t.name for t in complete_config(config, tmp_path).inputs] == ["image"]


# -- the cost model -------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class TimedEncoder(EncoderRuntime):
    """An encoder whose passes take exactly ``true.predict_s(rows, length)`` seconds of a fake clock."""

    def __init__(self, clock, true, name="fake"):
        super().__init__()
        self.clock, self.true, self.name = clock, true, name

    def compute(self, feeds):
        rows, length = feeds["input_ids"].shape
        self.clock.now += float(self.true.predict_s(rows, length))
        return super().compute(feeds)


@pytest.fixture()
def fake_runtime(monkeypatch):
    """Every load in the test gets ``holder[0]`` as its runtime, and calibration the clock that runtime drives."""
    clock = FakeClock()
    holder = []
    monkeypatch.setattr(costmodel, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(loader, "create_runtime",
                        lambda *args, **kwargs: RuntimeChoice(runtime=holder[0], reason="test runtime"))

    def install(true=None, name="fake"):
        holder[:] = [TimedEncoder(clock, true or CostModel(0.003, 0.00002, 1e-8), name)]
        return holder[0]

    return install


def test_cost_model_auto_is_fitted_to_what_calibration_timed(fake_runtime):
    true = CostModel(0.003, 0.00002, 1e-8)
    runtime = fake_runtime(true)
    pipeline = load_pipeline(model_config("minilm", cost_model="auto", precision="fp32"), built("minilm"))
    assert len(runtime.feeds) == len(CALIBRATION_SHAPES) * (1 + CALIBRATION_REPEATS)
    assert [(rows, length) for rows, length, _ in pipeline.cost_samples] == list(CALIBRATION_SHAPES)
    for rows, length, seconds in pipeline.cost_samples:
        assert seconds == pytest.approx(true.predict_s(rows, length), rel=1e-9)
    fitted = pipeline.cost_model
    assert (fitted.a_s, fitted.b_s) == (pytest.approx(true.a_s, rel=1e-6), pytest.approx(true.b_s, rel=1e-6))
    assert fitted.c_s == pytest.approx(true.c_s, rel=1e-4)


def test_a_fixed_cost_model_skips_calibration_entirely(fake_runtime):
    runtime = fake_runtime()
    pipeline = load_pipeline(model_config("minilm", cost_model="0.002,0.0003,0.000001", precision="fp32"),
                             built("minilm"))
    assert runtime.feeds == []  # not one pass at load
    assert pipeline.cost_model == CostModel(0.002, 0.0003, 0.000001)
    assert pipeline.cost_samples == []


def test_a_bls_target_is_not_timed_at_load_and_gets_a_gpu_like_default(fake_runtime):
    runtime = fake_runtime(name="bls")
    lines = []
    sink = types.SimpleNamespace(log_info=lines.append, log_warn=lines.append, log_error=lines.append,
                                 log_verbose=lines.append)
    pipeline = load_pipeline(model_config("minilm", precision="fp32"), built("minilm"), logger=Logger("minilm", sink))
    assert runtime.feeds == []
    assert pipeline.cost_model == CostModel.parse(BLS_DEFAULT_COST)
    assert any("runtime 'bls' cannot be timed at load" in line for line in lines)


def test_the_real_runtime_is_calibrated_at_load(version_dir):
    pipeline = load_pipeline(model_config("minilm", cost_model="auto", max_batch_rows="16", max_batch_tokens="1024"),
                             version_dir)
    shapes = [(rows, length) for rows, length, _ in pipeline.cost_samples]
    assert shapes == [(1, 8), (1, 64), (1, 256), (4, 16), (4, 128), (16, 16), (16, 64), (4, 256), (16, 32), (16, 16)]
    assert all(seconds > 0 for *_, seconds in pipeline.cost_samples)
    assert pipeline.cost_model == CostModel.fit(pipeline.cost_samples)


# -- the row cache --------------------------------------------------------------------------------------------


def test_the_row_cache_is_wired_only_when_asked_for(version_dir):
    plain = load_pipeline(model_config("minilm", cost_model=FIXED_COST, cache_bytes="0"), version_dir)
    assert plain.cache is None and plain.shared is None and plain.fingerprint == b""
    cached = load_pipeline(model_config("minilm", cost_model=FIXED_COST, cache_bytes="4096", cache_ttl_s="5"),
                           version_dir)
    assert cached.cache.max_bytes == 4096 and cached.cache.ttl_s == 5.0
    assert cached.shared is None and len(cached.fingerprint) == 32


def test_the_fingerprint_follows_the_graphs_content(tmp_path):
    for name in ("model.onnx", "tokenizer.json"):
        (tmp_path / name).symlink_to(built("minilm") / name)
    config = model_config("minilm", cost_model=FIXED_COST, cache_bytes="4096", precision="fp32")
    fingerprint = load_pipeline(config, tmp_path).fingerprint
    assert fingerprint == load_pipeline(config, built("minilm")).fingerprint
    fields = loader.runtime_fingerprint(read_settings(config), load_pipeline(config, tmp_path).runtime, tmp_path)
    assert fields == {"runtime": "onnxruntime", "precision": "fp32",
                      "onnx_sha256": file_digest(built("minilm") / "model.onnx")}


# -- every example model, loaded -------------------------------------------------------------------------------


def example_requests(name):
    rng = np.random.default_rng(0)
    if name == "minilm":
        return [{"TEXT": texts("first text", "second")}, {"TEXT": texts("a third, longer text about batching")}]
    if name == "minilm_rerank":
        return [{"TEXT": texts("q", "q"), "TEXT_PAIR": texts("a document", "another")},
                {"TEXT": texts("a query of its own"), "TEXT_PAIR": texts("q")}]
    if name == "minilm_tokens":
        ids = [np.array([[101, 7592, 2088, 102]]), np.array([[101, 2023, 102], [101, 2003, 102]])]
        return [{"input_ids": i, "token_type_ids": np.zeros_like(i)} for i in ids]
    return [{"image": rng.uniform(0, 16, size=(rows, 8, 8)).astype(np.float32)} for rows in (3, 1)]


@pytest.mark.parametrize("name", EXAMPLE_MODELS)
def test_every_example_model_loads_and_coalesces_like_each_request_alone(name):
    assert (REPOSITORY / name / "config.pbtxt").is_file()
    # minilm and minilm_rerank in FP32: INT8 vectors may differ slightly with a pass's other rows
    # (tests/unit/runtimes/test_int8.py)
    exact = {"precision": "fp32"} if name in ("minilm", "minilm_rerank") else {}
    config = completed(model_config(name, cost_model=FIXED_COST, **exact), built(name))
    pipeline = load_pipeline(config, built(name))
    assert pipeline.runtime.name == "onnxruntime"
    requests = example_requests(name)
    together = answers(pipeline, *requests)
    for request, got in zip(requests, together, strict=True):
        (alone,) = answers(pipeline, request)
        assert sorted(got) == sorted(alone) == [t.name for t in pipeline.task.outputs]
        for output in got:
            np.testing.assert_allclose(got[output], alone[output], rtol=1e-4, atol=1e-5)
