"""Runtime selection, TensorRT profiles and engine checks, the torch runtime on CPU: everything a CPU can check."""

import json

import numpy as np
import pytest

from coalesce.errors import ConfigError, RuntimeFailure
from coalesce.profiles import Profile, derive_profiles, match_profile, plan_limits, read_config_limits
from coalesce.runtime.select import Capabilities, choose
from coalesce.runtime.tensorrt import check_version
from tests.conftest import MODEL_DIR

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


def test_profiles_from_the_shipped_config_cover_every_pass_the_planner_can_cut():
    limits = read_config_limits((MODEL_DIR / "config.pbtxt").read_text())
    assert limits == {"max_batch_size": 64, "preferred_batch_sizes": [16, 32, 64], "max_batch_rows": 64,
                      "max_sequence_length": 256}
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


def test_build_engine_prints_profiles_without_tensorrt(capsys):
    from coalesce.engine import main

    assert main(["--model-repository", str(MODEL_DIR.parent), "--print-profiles"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [p["max_length"] for p in printed] == [32, 128, 256]


def test_build_engine_without_tensorrt_says_how_to_get_it():
    pytest.importorskip("onnx")  # the export toolchain is there; TensorRT is not on a CPU machine
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here: the build itself runs in scripts/gpu_check.sh")
    from coalesce.engine import main

    with pytest.raises(SystemExit, match="the 'tensorrt' module is not installed"):
        main(["--model-repository", str(MODEL_DIR.parent)])


def test_the_bls_runtime_checks_what_its_target_returns():
    from coalesce.runtime.bls import BlsRuntime

    def good(model, version, inputs):
        rows, tokens = inputs["input_ids"].shape
        return {"last_hidden_state": np.ones((rows, tokens, 384), dtype=np.float32)}

    ids = np.ones((2, 5), dtype=np.int64)
    assert BlsRuntime(good, "encoder", hidden_size=384).run(ids, ids, ids).shape == (2, 5, 384)
    with pytest.raises(RuntimeFailure, match=r"returns shape \[2, 5, 384\], expected \[rows, tokens, 768\]"):
        BlsRuntime(good, "encoder", hidden_size=768).run(ids, ids, ids)

    def failing(model, version, inputs):
        raise RuntimeError("model 'encoder' is not loaded")

    with pytest.raises(RuntimeFailure, match="BLS request to 'encoder' failed: model 'encoder' is not loaded"):
        BlsRuntime(failing, "encoder", hidden_size=384).run(ids, ids, ids)


def test_torch_runtime_on_cpu_matches_onnxruntime(version_dir):
    from coalesce.runtime.onnx import OnnxRuntime
    from coalesce.runtime.torch_runtime import TorchRuntime

    if not (version_dir / "hf" / "config.json").is_file():
        pytest.fail(f"{version_dir / 'hf'} is missing: run `make setup` (coalesce export writes it)")
    torch_rt = TorchRuntime(version_dir / "hf", device="cpu")
    onnx_rt = OnnxRuntime(version_dir / "model.onnx", intra_op_threads=0, inter_op_threads=1)
    ids = np.array([[101, 7592, 2088, 102, 0], [101, 2023, 2003, 1037, 102]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    types = np.zeros_like(ids)
    assert torch_rt.hidden_size == onnx_rt.hidden_size == 384
    np.testing.assert_allclose(torch_rt.run(ids, mask, types)[mask == 1], onnx_rt.run(ids, mask, types)[mask == 1],
                               atol=1e-4)
    with pytest.raises(ConfigError, match="fp16 and CUDA graphs need a CUDA device"):
        TorchRuntime(version_dir / "hf", device="cpu", precision="fp16")


def test_an_explicit_torch_runtime_serves_the_same_embeddings(version_dir):
    from coalesce.pipeline import EmbeddingPipeline
    from coalesce.settings import Settings

    def pipeline(runtime):
        settings = Settings.from_parameters({"runtime": runtime, "cost_model": "0.001,0.0001,0"}, model_name="m",
                                            max_batch_size=64, embedding_dim=384)
        return EmbeddingPipeline.from_version_dir(settings, version_dir)

    texts = [b"torch and onnx agree", b"a second, longer sentence about dynamic batching"]
    torch_pipe, onnx_pipe = pipeline("torch"), pipeline("onnxruntime")
    assert torch_pipe.runtime.name == "torch"
    np.testing.assert_allclose(torch_pipe.embed([texts])[0], onnx_pipe.embed([texts])[0], atol=1e-5)
