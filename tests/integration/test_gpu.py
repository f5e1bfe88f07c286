"""GPU paths against a real server: skipped with the reason on a machine without an NVIDIA GPU."""

import shutil

import numpy as np
import pytest

from coalesce.loader import read_settings
from coalesce.runtimes.select import probe
from coalesce.tasks import create_task
from coalesce_tools.config import read_model_config
from coalesce_tools.engine import profiles_for
from coalesce_tools.launcher import ServerOptions, TritonServer, free_port
from tests.conftest import MODEL_DIR, ROOT, TRICKY_TEXTS

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


@pytest.mark.gpu
def test_kind_gpu_model_matches_the_cpu_model(tmp_path, version_dir):
    caps = probe()
    if not caps.torch_cuda:
        pytest.skip(f"no usable NVIDIA GPU here ({caps.gpu_reason}); scripts/gpu_check.sh runs this on one")
    for name, source in (("minilm", MODEL_DIR), ("minilm_gpu", GPU_CONFIGS / "minilm_gpu")):
        (tmp_path / name / "1").mkdir(parents=True)
        shutil.copy(source / "config.pbtxt", tmp_path / name / "config.pbtxt")
        for item in version_dir.iterdir():
            (tmp_path / name / "1" / item.name).symlink_to(item.resolve())
    options = ServerOptions(model_repository=tmp_path, host="127.0.0.1", http_port=free_port(), grpc_port=free_port(),
                            metrics_port=free_port(), model_control="explicit", load_models=("minilm", "minilm_gpu"))
    from coalesce_client import EmbeddingClient

    with TritonServer(options) as server, EmbeddingClient(server.grpc_url, model="minilm_gpu") as gpu, \
                EmbeddingClient(server.grpc_url, model="minilm") as cpu:
        a, b = gpu.embed(TRICKY_TEXTS), cpu.embed(TRICKY_TEXTS)
    assert float((a * b).sum(axis=1).min()) >= 0.999
    assert np.isfinite(a).all()
