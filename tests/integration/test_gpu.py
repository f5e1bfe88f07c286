"""GPU paths against a real server: skipped with the reason on a machine without an NVIDIA GPU."""

import numpy as np
import pytest

from coalesce.loader import read_settings
from coalesce.runtimes.select import probe
from coalesce.tasks import create_task
from coalesce_tools.config import read_model_config
from coalesce_tools.engine import profiles_for
from coalesce_tools.launcher import ServerOptions, TritonServer
from tests.conftest import MODEL_DIR, ROOT, TRICKY_TEXTS
from tests.integration.conftest import EXACT_MODEL, FP32_NO_CACHE, add_model

GPU_CONFIGS = ROOT / "scripts" / "gpu" / "model_repository"


@pytest.mark.parametrize("name", ["minilm_gpu", "minilm_trt"])
def test_gpu_configs_serve_the_cpu_models_contract_on_gpu_instances(name, version_dir):
    """Clients of ``minilm`` work unchanged against the GPU models, and every pass the planner cuts has a profile."""
    gpu_config = read_model_config(GPU_CONFIGS / name / "config.pbtxt")
    cpu_config = read_model_config(MODEL_DIR / "config.pbtxt")
    assert gpu_config["name"] == name
    assert {group["kind"] for group in gpu_config["instance_group"]} == {"KIND_GPU"}
    gpu_settings, cpu_settings = read_settings(gpu_config), read_settings(cpu_config)
    gpu_task = create_task(gpu_settings, gpu_config, version_dir)
    cpu_task = create_task(cpu_settings, cpu_config, version_dir)
    assert (gpu_task.name, gpu_task.inputs, gpu_task.outputs) == (cpu_task.name, cpu_task.inputs, cpu_task.outputs)
    assert gpu_settings.runtime.runtime == ("tensorrt" if name == "minilm_trt" else "auto")
    profiles = profiles_for(GPU_CONFIGS / name)
    longest = gpu_settings.task.max_sequence_length
    for rows in (1, gpu_settings.planner.max_batch_rows):
        for length in (1, longest // 2, longest):
            assert any(p.holds(rows, length) for p in profiles), (rows, length, profiles)


def _serve_beside_cpu(tmp_path, version_dir, kind: str) -> dict[str, np.ndarray]:
    """Serve ``minilm_gpu`` (its instances of ``kind``) beside the shipped ``minilm`` and an FP32 copy of it.

    Returns each model's vectors of TRICKY_TEXTS. ``minilm_fp32`` is the shipped config with
    FP32_NO_CACHE: the exact CPU reference for a GPU model that runs the FP32 graph.
    """
    add_model(tmp_path, "minilm", version_dir=version_dir)
    add_model(tmp_path, "minilm_gpu", source=GPU_CONFIGS / "minilm_gpu", replace={"KIND_GPU": kind},
              version_dir=version_dir)
    add_model(tmp_path, EXACT_MODEL, parameters=FP32_NO_CACHE, version_dir=version_dir)
    configs = ("minilm", "minilm_gpu", EXACT_MODEL)
    options = ServerOptions.on_free_ports(tmp_path, model_control="explicit", load_models=configs)
    from coalesce_client import EmbeddingClient

    with TritonServer(options) as server:
        vectors = {}
        for name in configs:
            with EmbeddingClient(server.grpc_url, model=name) as client:
                vectors[name] = client.embed(TRICKY_TEXTS)
    return vectors


def _assert_gpu_model_agrees(vectors: dict[str, np.ndarray], reference: np.ndarray) -> None:
    """What a GPU run can show: FP32 on the GPU matches FP32 on the CPU and sentence-transformers to 0.999;
    the shipped INT8 minilm is held to its own guard's bounds against the GPU's vectors, not to 0.999."""
    gpu = vectors["minilm_gpu"]
    assert np.isfinite(gpu).all()
    for name, other in ((EXACT_MODEL, vectors[EXACT_MODEL]), ("sentence-transformers", reference)):
        cosine = (gpu * other).sum(axis=1)
        assert cosine.min() >= 0.999, (name, dict(zip(TRICKY_TEXTS, cosine.tolist(), strict=True)))
    settings = read_settings(read_model_config(MODEL_DIR / "config.pbtxt"))
    cosine = (gpu * vectors["minilm"]).sum(axis=1)
    assert cosine.mean() >= settings.runtime.int8_min_mean_cosine and cosine.min() >= settings.runtime.int8_min_cosine


def test_the_gpu_config_on_cpu_instances_agrees_with_the_cpu_models(tmp_path, version_dir, reference_model):
    """The GPU test's serving and checks, run in CI: minilm_gpu's config with its instances on the CPU."""
    vectors = _serve_beside_cpu(tmp_path, version_dir, "KIND_CPU")
    _assert_gpu_model_agrees(vectors, reference_model.encode(TRICKY_TEXTS, normalize_embeddings=True))


@pytest.mark.gpu
def test_kind_gpu_model_matches_the_cpu_model(tmp_path, version_dir, reference_model):
    caps = probe()
    if not caps.torch_cuda:
        pytest.skip(f"no usable NVIDIA GPU here ({caps.gpu_reason}); scripts/gpu_check.sh runs this on one")
    vectors = _serve_beside_cpu(tmp_path, version_dir, "KIND_GPU")
    _assert_gpu_model_agrees(vectors, reference_model.encode(TRICKY_TEXTS, normalize_embeddings=True))
