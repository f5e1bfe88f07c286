"""GPU paths against a real server: skipped with the reason on a machine without an NVIDIA GPU."""

import json
import shutil

import numpy as np
import pytest

from coalesce.launcher import ServerOptions, TritonServer, free_port
from coalesce.runtime.select import probe
from coalesce.settings import Settings
from tests.conftest import MODEL_DIR, ROOT, TRICKY_TEXTS

GPU_CONFIGS = ROOT / "scripts" / "gpu" / "model_repository"


def pbtxt_to_settings(path):
    """The KIND_GPU configs hold what the CPU one holds, besides instance kind and runtime."""
    from coalesce.profiles import read_config_limits

    text = path.read_text()
    limits = read_config_limits(text)
    return limits, "KIND_GPU" in text


@pytest.mark.parametrize("name", ["minilm_gpu", "minilm_trt"])
def test_gpu_configs_keep_the_contract_and_the_cpu_configs_limits(name):
    limits, on_gpu = pbtxt_to_settings(GPU_CONFIGS / name / "config.pbtxt")
    assert on_gpu
    assert limits == pbtxt_to_settings(MODEL_DIR / "config.pbtxt")[0]
    config = {"name": name, "max_batch_size": 64, "input": [{"name": "TEXT", "data_type": "TYPE_STRING",
                                                             "dims": ["1"]}],
              "output": [{"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": ["384"]}],
              "parameters": {"runtime": {"string_value": "tensorrt" if name == "minilm_trt" else "auto"}}}
    assert Settings.from_model_config(json.loads(json.dumps(config))).model_name == name


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
