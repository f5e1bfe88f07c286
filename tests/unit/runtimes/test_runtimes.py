"""Runtime selection, TensorRT profiles and engine checks, ONNX Runtime, BLS and the torch runtime on CPU: everything
a CPU can check. Runtimes take and return named tensors."""

import json

import numpy as np
import pytest

from coalesce.core.errors import CoalesceError, ConfigError, InvalidInputError, RuntimeFailure
from coalesce.core.tensors import GraphTensor
from coalesce.runtimes import create_runtime
from coalesce.runtimes.onnx import OnnxRuntime, read_graph_io
from coalesce.runtimes.profiles import Profile, derive_profiles, match_profile, plan_limits
from coalesce.runtimes.select import Capabilities, choose
from coalesce.runtimes.tensorrt import _variable_axes, check_version
from coalesce.settings import ModelSettings
from coalesce.tasks import create_task
from tests.conftest import built, model_config
from tests.unit.fakes import answers, texts

CPU_ONLY = Capabilities(gpu=False, gpu_reason="no NVIDIA driver library and no CUDA device", tensorrt_version=None,
                        ort_providers=("CPUExecutionProvider",), torch_cuda=False, torch=True)
FULL_GPU = Capabilities(gpu=True, gpu_reason="torch sees a CUDA device", tensorrt_version="10.5.0",
                        ort_providers=("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
                        torch_cuda=True, torch=True)


@pytest.fixture()
def files(tmp_path):
    plan = tmp_path / "model.plan"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    return {"engine_path": plan, "torch_model_dir": hf}


def test_auto_on_a_cpu_machine_is_onnxruntime_and_says_why(files):
    choice = choose("auto", CPU_ONLY, **files)
    assert (choice.runtime, choice.device) == ("onnxruntime", "cpu")
    assert "TensorRT: no engine at" in choice.reason and "ONNX Runtime GPU: no GPU" in choice.reason
    assert "torch CUDA: torch sees no usable CUDA device" in choice.reason


def test_auto_prefers_tensorrt_then_ort_gpu_then_torch_cuda(files):
    files["engine_path"].write_bytes(b"plan")
    assert choose("auto", FULL_GPU, instance_kind="GPU", **files).runtime == "tensorrt"
    files["engine_path"].unlink()
    ort_gpu = choose("auto", FULL_GPU, instance_kind="GPU", **files)
    assert (ort_gpu.runtime, ort_gpu.device) == ("onnxruntime", "cuda")
    assert ort_gpu.providers[0] == "TensorrtExecutionProvider" and ort_gpu.providers[-1] == "CPUExecutionProvider"
    no_ort_gpu = Capabilities(**{**FULL_GPU.__dict__, "ort_providers": ("CPUExecutionProvider",)})
    torch_cuda = choose("auto", no_ort_gpu, instance_kind="GPU", **files)
    assert (torch_cuda.runtime, torch_cuda.device) == ("torch", "cuda")
    assert "onnxruntime-gpu is not installed" in torch_cuda.reason


def test_a_kind_cpu_instance_never_gets_a_gpu_runtime_from_auto(files):
    files["engine_path"].write_bytes(b"plan")
    choice = choose("auto", FULL_GPU, instance_kind="CPU", **files)
    assert (choice.runtime, choice.device) == ("onnxruntime", "cpu")
    assert "the instance is KIND_CPU" in choice.reason


@pytest.mark.parametrize(("runtime", "caps", "fragment"), [
    ("tensorrt", CPU_ONLY, "runtime 'tensorrt' is not available: no engine at"),
    ("torch", Capabilities(**{**CPU_ONLY.__dict__, "torch": False}), "torch and transformers are not installed"),
    ("bls", CPU_ONLY, "runtime 'bls' needs parameter 'bls_model'"),
    ("tensorflow", CPU_ONLY, "runtime 'tensorflow' is unknown"),
])
def test_an_explicit_runtime_that_cannot_run_fails_the_load_saying_what_is_missing(files, runtime, caps, fragment):
    with pytest.raises(ConfigError, match=fragment):
        choose(runtime, caps, model_name="m", **files)


def test_tensorrt_needs_the_module_and_a_gpu(files):
    files["engine_path"].write_bytes(b"plan")
    with pytest.raises(ConfigError, match="the 'tensorrt' module is not installed"):
        choose("tensorrt", CPU_ONLY, **files)
    with pytest.raises(ConfigError, match="no GPU"):
        choose("tensorrt", Capabilities(**{**CPU_ONLY.__dict__, "tensorrt_version": "10.5.0"}), **files)


def test_torch_explicit_runs_on_cpu_without_a_gpu(files):
    choice = choose("torch", CPU_ONLY, **files)
    assert (choice.runtime, choice.device) == ("torch", "cpu")


def test_profiles_cover_every_pass_the_planner_can_cut():
    profiles = derive_profiles(max_rows=64, max_length=256, preferred_rows=[16, 32, 64])
    assert [(p.min_length, p.max_length) for p in profiles] == [(1, 32), (33, 128), (129, 256)]
    assert all(p.opt_rows == 64 and p.max_rows == 64 for p in profiles)
    assert plan_limits(profiles) == (64, 256)
    for rows in (1, 7, 64):
        for length in (1, 32, 33, 200, 256):
            index = match_profile(profiles, rows, length)
            assert index is not None and profiles[index].holds(rows, length)
            assert profiles[index].max_length == min(p.max_length for p in profiles if p.holds(rows, length))
    assert match_profile(profiles, 65, 10) is None and match_profile(profiles, 1, 257) is None
    # A model of fixed shape (every row one position) gets one profile.
    assert [(p.min_length, p.max_length) for p in derive_profiles(max_rows=8, max_length=1)] == [(1, 1)]


def test_a_pass_length_is_read_from_the_graphs_variable_dims():
    assert _variable_axes(GraphTensor("input_ids", "TYPE_INT64", (None, None))) == (1,)
    assert _variable_axes(GraphTensor("x", "TYPE_FP32", (None, None, 3, None))) == (1, 3)
    assert _variable_axes(GraphTensor("image", "TYPE_FP32", (None, 8, 8))) == ()
    assert _variable_axes(None) == ()


def test_profiles_round_trip_and_reject_bad_limits():
    profile = Profile(1, 16, 32, 1, 64, 64)
    assert Profile.from_dict(json.loads(json.dumps(profile.__dict__))) == profile
    assert profile.shapes() == ((1, 1), (16, 64), (32, 64))
    with pytest.raises(ValueError):
        derive_profiles(max_rows=0, max_length=10)


def test_an_engine_from_another_tensorrt_fails_the_load_with_what_to_do(tmp_path):
    plan = tmp_path / "model.plan"
    with pytest.raises(ConfigError, match=r"built with TensorRT 10.3.0, but TensorRT 10.5.0 is installed; rebuild"):
        check_version({"tensorrt_version": "10.3.0"}, "10.5.0", plan)
    with pytest.raises(ConfigError, match="has no metadata"):
        check_version({}, "10.5.0", plan)
    check_version({"tensorrt_version": "10.5.0"}, "10.5.0", plan)


def test_the_bls_runtime_sends_named_tensors_and_checks_what_comes_back():
    from coalesce.runtimes.bls import BlsRuntime

    calls = []

    def good(model, version, inputs, output_names):
        calls.append((model, version, sorted(inputs), list(output_names)))
        rows, tokens = inputs["input_ids"].shape
        return {"last_hidden_state": np.ones((rows, tokens, 384), dtype=np.float32), "extra": np.zeros(1)}

    feeds = {"input_ids": np.ones((2, 5), dtype=np.int64), "attention_mask": np.ones((2, 5), dtype=np.int64)}
    runtime = BlsRuntime(good, "encoder", version="3")
    assert runtime.graph is None and runtime.name == "bls"
    out = runtime.run(feeds, ["last_hidden_state"])
    assert list(out) == ["last_hidden_state"] and out["last_hidden_state"].shape == (2, 5, 384)
    assert calls == [("encoder", "3", ["attention_mask", "input_ids"], ["last_hidden_state"])]
    with pytest.raises(RuntimeFailure) as info:
        runtime.run(feeds, ["logits"])
    assert str(info.value) == "BLS target 'encoder' returned no 'logits' (got ['extra', 'last_hidden_state'])"

    def wrong_rows(model, version, inputs, output_names):
        return {"logits": np.zeros((3, 1), dtype=np.float32)}

    with pytest.raises(RuntimeFailure) as info:
        BlsRuntime(wrong_rows, "encoder").run(feeds, ["logits"])
    assert str(info.value) == "BLS target 'encoder' returned 'logits' of shape [3, 1] for a pass of 2 rows"

    def failing(model, version, inputs, output_names):
        raise RuntimeError("model 'encoder' is not loaded")

    with pytest.raises(RuntimeFailure) as info:
        BlsRuntime(failing, "encoder").run(feeds, ["logits"])
    assert str(info.value) == "BLS request to 'encoder' failed: model 'encoder' is not loaded"

    def refusing(model, version, inputs, output_names):
        raise InvalidInputError("the target says no")

    with pytest.raises(InvalidInputError, match=r"^the target says no$"):  # the core's own errors pass as they are
        BlsRuntime(refusing, "encoder").run(feeds, ["logits"])


def test_onnx_runtime_reports_its_graph_and_fails_a_pass_naming_the_shapes():
    runtime = OnnxRuntime(built("minilm") / "model.onnx", intra_op_threads=1)
    graph = runtime.graph
    assert [(t.name, t.data_type, t.shape) for t in graph.inputs] == [
        ("input_ids", "TYPE_INT64", (None, None)), ("attention_mask", "TYPE_INT64", (None, None)),
        ("token_type_ids", "TYPE_INT64", (None, None))]
    assert [(t.name, t.data_type, t.shape) for t in graph.outputs] == [
        ("last_hidden_state", "TYPE_FP32", (None, None, 384))]
    assert read_graph_io(built("minilm") / "model.onnx") == graph
    ids = np.array([[101, 7592, 102]], dtype=np.int64)
    out = runtime.run({"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)},
                      ["last_hidden_state"])
    assert out["last_hidden_state"].shape == (1, 3, 384)
    with pytest.raises(RuntimeFailure) as info:
        runtime.run({"input_ids": ids.astype(np.int32), "attention_mask": np.ones_like(ids),
                     "token_type_ids": np.zeros_like(ids)}, ["last_hidden_state"])
    assert str(info.value).startswith("ONNX Runtime failed on a pass with inputs {'input_ids': [1, 3], "
                                      "'attention_mask': [1, 3], 'token_type_ids': [1, 3]}: ")
    digits = read_graph_io(built("digits") / "model.onnx")
    assert [(t.name, t.shape) for t in (*digits.inputs, *digits.outputs)] == [("image", (None, 8, 8)),
                                                                              ("logits", (None, 10))]


def test_a_missing_or_broken_onnx_graph_fails_the_load(tmp_path):
    with pytest.raises(ConfigError, match=r"^ONNX model not found: .*missing.onnx \(run `make setup`"):
        OnnxRuntime(tmp_path / "missing.onnx")
    (tmp_path / "broken.onnx").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=r"^cannot load ONNX model .*broken.onnx: "):
        OnnxRuntime(tmp_path / "broken.onnx")
    with pytest.raises(ConfigError, match=r"^cannot load ONNX model .*broken.onnx: "):
        read_graph_io(tmp_path / "broken.onnx")


def task_of(name, **parameters):
    config = model_config(name, **parameters)
    settings = ModelSettings.from_model_config(config)
    return settings, create_task(settings, config, built(name))


def test_create_runtime_on_a_cpu_machine():
    settings, task = task_of("minilm", runtime="auto", intra_op_threads="1", precision="fp32")
    choice = create_runtime(settings, task, built("minilm"), caps=CPU_ONLY)
    assert choice.runtime.name == "onnxruntime"
    assert choice.reason.startswith("runtime 'auto': ONNX Runtime on CPU (passed over TensorRT: no engine at ")
    assert choice.reason.endswith("; providers ['CPUExecutionProvider']")
    settings, task = task_of("minilm_tokens", runtime="torch")
    with pytest.raises(ConfigError) as info:
        create_runtime(settings, task, built("minilm_tokens"), caps=CPU_ONLY)
    assert str(info.value) == ("model 'minilm_tokens': runtime 'torch' is not available: it does not apply to task "
                               "'tensor' (it loads Hugging Face text models)")
    settings, task = task_of("minilm", runtime="bls", bls_model="encoder", precision="fp32")
    with pytest.raises(ConfigError, match=r"^model 'minilm': runtime 'bls' only runs inside Triton$"):
        create_runtime(settings, task, built("minilm"), caps=CPU_ONLY)
    settings, task = task_of("minilm", runtime="torch", cuda_graphs="true", precision="fp32")
    with pytest.raises(ConfigError, match=r"^model 'minilm': cuda_graphs needs torch on CUDA; runtime 'torch'"):
        create_runtime(settings, task, built("minilm"), caps=CPU_ONLY)
    settings, task = task_of("minilm", precision="int8")  # forced (the shipped auto is resolved by the loader)
    choice = create_runtime(settings, task, built("minilm"), caps=CPU_ONLY)
    assert choice.reason == "precision int8: ONNX Runtime on the CPU runs model.int8.onnx; providers " \
        "['CPUExecutionProvider']"
    assert choice.runtime.path == built("minilm") / "model.int8.onnx"


def test_auto_passes_torch_over_for_a_task_it_does_not_apply_to(files):
    choice = choose("auto", FULL_GPU, instance_kind="GPU", torch_applies=False, task="tensor", **files)
    # ONNX Runtime on the GPU wins before torch is considered; without it, torch is passed over for the task.
    assert choice.runtime == "onnxruntime"
    no_ort_gpu = Capabilities(**{**FULL_GPU.__dict__, "ort_providers": ("CPUExecutionProvider",)})
    choice = choose("auto", no_ort_gpu, instance_kind="GPU", torch_applies=False, task="tensor", **files)
    assert (choice.runtime, choice.device) == ("onnxruntime", "cpu")
    assert "torch CUDA: it does not apply to task 'tensor'" in choice.reason


def test_torch_runtime_on_cpu_matches_onnxruntime(version_dir):
    from coalesce.runtimes.torch_runtime import TorchRuntime

    if not (version_dir / "hf" / "config.json").is_file():
        pytest.fail(f"{version_dir / 'hf'} is missing: run `make setup` (coalesce export writes it)")
    torch_rt = TorchRuntime(version_dir / "hf", device="cpu")
    onnx_rt = OnnxRuntime(version_dir / "model.onnx", intra_op_threads=0, inter_op_threads=1)
    ids = np.array([[101, 7592, 2088, 102, 0], [101, 2023, 2003, 1037, 102]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    assert torch_rt.graph.output("last_hidden_state").shape == (None, None, 384)
    assert [t.name for t in torch_rt.graph.inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    got = torch_rt.run(feeds, ["last_hidden_state"])["last_hidden_state"]
    want = onnx_rt.run(feeds, ["last_hidden_state"])["last_hidden_state"]
    np.testing.assert_allclose(got[mask == 1], want[mask == 1], atol=1e-4)
    with pytest.raises(RuntimeFailure, match=r"^torch runtime gives only 'last_hidden_state', not \['logits'\]$"):
        torch_rt.run(feeds, ["logits"])
    with pytest.raises(ConfigError, match=r"^torch runtime: fp16 and CUDA graphs need a CUDA device$"):
        TorchRuntime(version_dir / "hf", device="cpu", precision="fp16")
    with pytest.raises(ConfigError,
                       match=r"^torch runtime: unknown head 'pooler', expected one of base, sequence-classification$"):
        TorchRuntime(version_dir / "hf", head="pooler")


def test_torch_sequence_classification_head_matches_the_exported_logits():
    from coalesce.runtimes.torch_runtime import TorchRuntime

    version = built("minilm_cross_encoder")
    torch_rt = TorchRuntime(version / "hf", head="sequence-classification", device="cpu")
    onnx_rt = OnnxRuntime(version / "model.onnx")
    assert torch_rt.graph.output("logits").shape == (None, 1)
    ids = np.array([[101, 2054, 2003, 102, 7592, 102, 0], [101, 2054, 102, 2023, 2003, 1037, 102]], dtype=np.int64)
    types = np.array([[0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": (ids != 0).astype(np.int64), "token_type_ids": types}
    np.testing.assert_allclose(torch_rt.run(feeds, ["logits"])["logits"], onnx_rt.run(feeds, ["logits"])["logits"],
                               atol=1e-4)


@pytest.mark.parametrize("name", ["minilm", "minilm_cross_encoder", "minilm_rerank"])
def test_an_explicit_torch_runtime_serves_the_same_outputs(name):
    from coalesce.loader import load_pipeline

    def pipeline(runtime):
        return load_pipeline(model_config(name, runtime=runtime, cost_model="0.001,0.0001,0", precision="fp32"),
                             built(name))

    request = {"TEXT": texts("torch and onnx agree", "a second, longer sentence about dynamic batching")}
    if name != "minilm":
        request["TEXT_PAIR"] = texts("a document", "another document")
    torch_pipe, onnx_pipe = pipeline("torch"), pipeline("onnxruntime")
    assert torch_pipe.runtime.name == "torch" and onnx_pipe.runtime.name == "onnxruntime"
    (got,), (want,) = answers(torch_pipe, request), answers(onnx_pipe, request)
    assert not isinstance(got, CoalesceError)
    for output in want:
        np.testing.assert_allclose(got[output], want[output], atol=1e-5)


def test_the_torch_runtime_loads_only_safetensors(tmp_path):
    from coalesce.runtimes.torch_runtime import check_safetensors

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"a pickle")
    (tmp_path / "extra.pt").write_bytes(b"another")
    with pytest.raises(ConfigError) as info:
        check_safetensors(tmp_path)
    assert str(info.value) == (
        f"torch runtime: weights in {tmp_path} must be safetensors (model.safetensors); it holds pickled weights "
        "['extra.pt', 'pytorch_model.bin'], which are never loaded. Convert them (`coalesce export` writes "
        "safetensors)")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="it holds none"):
        check_safetensors(empty)
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_safetensors(tmp_path)  # safetensors present: the pickles beside them are never read


def test_a_torch_runtime_over_pickled_weights_fails_before_loading_them(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from coalesce.runtimes.torch_runtime import TorchRuntime

    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(ConfigError, match="must be safetensors"):
        TorchRuntime(tmp_path)
