"""The GPU checks behind ``scripts/gpu_check.sh``: each part runs when its pieces are installed, else says why."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VERSION_DIR = ROOT / "model_repository" / "minilm" / "1"
#: Test-only models (tests/models/, built by `make setup-dev`): the seeded cross-encoder and the untrained tinylm.
TEST_MODELS = ("minilm_cross_encoder", "tinylm")
OUT = Path(os.environ.get("OUT", ROOT / "perf" / "results"))
TEXTS = ["Coalesce turns dynamic batches into few forward passes.", "short", "日本語の文章を埋め込みます。",
         "a longer document " * 40, "emoji only: 🤖🎉", "The quick brown fox jumps over the lazy dog."] * 8


def model_dir(model: str) -> Path:
    """Model ``model``'s folder: an example model's in model_repository/, a test model's in tests/models/."""
    return ROOT / ("tests/models" if model in TEST_MODELS else "model_repository") / model


def run_task(model: str, runtime: Any, tensors: dict[str, np.ndarray], output: str) -> tuple[np.ndarray, float]:
    """One request through model ``model``'s task and pipeline over ``runtime``: (output, seconds warm)."""
    from coalesce.batching.costmodel import CostModel
    from coalesce.batching.pipeline import Pipeline
    from coalesce.observability.metrics import InMemoryMetricFactory, PipelineMetrics
    from coalesce.settings import ModelSettings
    from coalesce.tasks import create_task
    from coalesce_tools.config import read_model_config

    version_dir = model_dir(model) / "1"
    config = read_model_config(version_dir.parent / "config.pbtxt")
    settings = ModelSettings.from_model_config(config)
    task = create_task(settings, config, version_dir)
    task.bind(runtime.graph)
    pipeline = Pipeline(task, runtime, settings.planner,
                        PipelineMetrics(InMemoryMetricFactory(), model="gpu-check", version="1"),
                        cost_model=CostModel(0.002, 0.0001, 0.0), model_name="gpu-check")
    request = pipeline.read(tensors)
    pipeline.run([request])
    start = time.perf_counter()
    (result,) = pipeline.run([request])
    assert not isinstance(result, Exception), result
    return result[output], time.perf_counter() - start


def embed_with(runtime: Any) -> tuple[np.ndarray, float]:
    """Embed TEXTS through the minilm task's pipeline over ``runtime``; (vectors, seconds of the second, warm run)."""
    return run_task("minilm", runtime, {"TEXT": np.array([[t.encode()] for t in TEXTS], dtype=object)}, "EMBEDDING")


def rerank_with(runtime: Any) -> tuple[np.ndarray, float]:
    """Score (query, text) pairs of TEXTS through the minilm_cross_encoder classify task over ``runtime``."""
    texts = np.array([[t.encode()] for t in TEXTS], dtype=object)
    queries = np.array([[b"what does coalescing do"]] * len(TEXTS), dtype=object)
    return run_task("minilm_cross_encoder", runtime, {"TEXT": queries, "TEXT_PAIR": texts}, "SCORES")


def cosine_min(a: np.ndarray, b: np.ndarray) -> float:
    """Smallest row-wise cosine of two L2-normalised matrices."""
    return float((a * b).sum(axis=1).min())


def main() -> int:
    """Run every part that can run; write the report; exit 1 when a part that ran failed its check."""
    from coalesce.runtimes.onnx import OnnxRuntime

    results: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "parts": {}}
    parts = results["parts"]
    reference, cpu_s = embed_with(OnnxRuntime(VERSION_DIR / "model.onnx", intra_op_threads=0, inter_op_threads=1))
    parts["onnxruntime-cpu"] = {"ran": True, "seconds": cpu_s, "texts": len(TEXTS)}

    import torch

    gpu = torch.cuda.is_available()
    results["gpu"] = torch.cuda.get_device_name(0) if gpu else None
    if not gpu:
        parts["torch-cuda"] = {"ran": False, "why": "torch.cuda.is_available() is False"}
    else:
        from coalesce.runtimes.torch_runtime import TorchRuntime, buckets_from

        for label, kwargs in (("torch-cuda-fp32", {}), ("torch-cuda-fp16", {"precision": "fp16"}),
                              ("torch-cuda-fp16-graphs", {"precision": "fp16", "cuda_graph_buckets":
                                                          buckets_from((8, 32, 64), (32, 128, 256))})):
            try:
                vectors, seconds = embed_with(TorchRuntime(VERSION_DIR / "hf", device="cuda:0", **kwargs))
                cos = cosine_min(vectors, reference)
                parts[label] = {"ran": True, "seconds": seconds, "cosine_min": cos, "ok": cos >= 0.999,
                                "speedup_over_cpu": cpu_s / seconds}
            except Exception as exc:
                parts[label] = {"ran": True, "ok": False, "error": repr(exc), "trace": traceback.format_exc()[-2000:]}

    rerank_dir = model_dir("minilm_cross_encoder") / "1"
    if not gpu:
        parts["classify-torch-cuda"] = {"ran": False, "why": "torch.cuda.is_available() is False"}
    else:
        from coalesce.runtimes.torch_runtime import TorchRuntime

        try:
            want, cpu_rerank_s = rerank_with(OnnxRuntime(rerank_dir / "model.onnx"))
            got, seconds = rerank_with(TorchRuntime(rerank_dir / "hf", head="sequence-classification",
                                                    device="cuda:0"))
            error = float(np.abs(got - want).max())
            parts["classify-torch-cuda"] = {"ran": True, "seconds": seconds, "cpu_seconds": cpu_rerank_s,
                                            "max_abs_error": error, "ok": error <= 1e-3}
        except Exception as exc:
            parts["classify-torch-cuda"] = {"ran": True, "ok": False, "error": repr(exc),
                                            "trace": traceback.format_exc()[-2000:]}

    import onnxruntime

    providers = [p for p in ("TensorrtExecutionProvider", "CUDAExecutionProvider")
                 if p in onnxruntime.get_available_providers()]
    if not (gpu and providers):
        parts["onnxruntime-gpu"] = {"ran": False, "why": "onnxruntime-gpu is not installed" if gpu else "no GPU"}
    else:
        vectors, seconds = embed_with(OnnxRuntime(VERSION_DIR / "model.onnx", intra_op_threads=0, inter_op_threads=1,
                                                  providers=(*providers, "CPUExecutionProvider")))
        cos = cosine_min(vectors, reference)
        parts["onnxruntime-gpu"] = {"ran": True, "providers": providers, "seconds": seconds, "cosine_min": cos,
                                    "ok": cos >= 0.999}

    if importlib.util.find_spec("tensorrt") is None or not gpu:
        parts["tensorrt"] = {"ran": False, "why": "the 'tensorrt' module is not installed" if gpu else "no GPU"}
    else:
        from coalesce.runtimes.tensorrt import TensorRTRuntime
        from coalesce_tools.engine import build, profiles_for

        plan = Path(os.environ.get("TMPDIR", "/tmp")) / "gpu-check.plan"
        profiles = profiles_for(ROOT / "model_repository" / "minilm")
        start = time.perf_counter()
        metadata = build(VERSION_DIR / "model.onnx", plan, profiles, fp16=True)
        built_s = time.perf_counter() - start
        vectors, seconds = embed_with(TensorRTRuntime(plan))
        cos = cosine_min(vectors, reference)
        parts["tensorrt"] = {"ran": True, "build_s": built_s, "metadata": metadata, "seconds": seconds,
                             "cosine_min": cos, "ok": cos >= 0.999}

    for precision in ("fp32", "fp16"):
        parts[f"generate-torch-cuda-{precision}"] = generate_part(precision) if gpu else {
            "ran": False, "why": "torch.cuda.is_available() is False"}
    parts["triton-kind-gpu"] = triton_part(reference) if gpu else {"ran": False, "why": "no GPU"}
    OUT.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    (OUT / f"gpu-check-{stamp}.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    for name, part in parts.items():
        summary = {k: v for k, v in part.items() if k not in ("trace", "metadata")}
        sys.stdout.write(f"gpu-check {name}: {json.dumps(summary, default=str)}\n")
    failed = [n for n, p in parts.items() if p.get("ran") and p.get("ok") is False]
    sys.stdout.write(f"gpu-check: wrote {OUT / f'gpu-check-{stamp}.json'}; failed: {failed or 'none'}\n")
    return 1 if failed else 0


def generate_part(precision: str, device: str = "cuda:0") -> dict[str, Any]:
    """The tinylm engine on CUDA: 16 greedy requests batched against transformers' generate alone, and tokens/s."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        from coalesce.generation.loader import load_engine
        from coalesce.generation.request import read_request
        from coalesce.settings import ModelSettings
        from coalesce_tools.config import read_model_config, with_parameters

        folder = model_dir("tinylm")
        config = with_parameters(read_model_config(folder / "config.pbtxt"), {"precision": precision})
        settings = ModelSettings.from_model_config(config)
        engine = load_engine(config, folder / "1", settings=settings, instance_kind="GPU", start=False)
        texts: dict[int, str] = {}
        prompts = [" ".join(TEXTS[i % len(TEXTS)].split()[: 3 + i * 5]) for i in range(16)]
        for i, prompt in enumerate(prompts):
            request = read_request({"text_input": np.array([prompt.encode()], dtype=object)},
                                   {"max_tokens": 64, "temperature": 0, "ignore_eos": True}, engine.options)
            engine.submit(request, lambda event, i=i: texts.__setitem__(i, texts.get(i, "") + event.text))
        start = time.perf_counter()
        steps = 0
        while engine.step():
            steps += 1
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        dtype = torch.float16 if precision == "fp16" else torch.float32
        # transformers types .to() through a decorator that mypy reads as taking the model itself.
        model = AutoModelForCausalLM.from_pretrained(str(folder / "1" / "hf"), dtype=dtype).to(device).eval()  # type: ignore[arg-type]
        equal = 0
        for i, prompt in enumerate(prompts):
            ids = engine.tokenizer.encode(prompt).ids
            with torch.no_grad():
                out = model.generate(torch.tensor([ids], device=device), max_new_tokens=64, do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device))
            equal += texts.get(i) == prompt + engine.tokenizer.decode(out[0, len(ids):].tolist())
        # fp32 must match token for token; fp16 rounding may flip a near-tie, so it reports how many match.
        return {"ran": True, "seconds": seconds, "steps": steps, "tokens_per_s": 16 * 64 / seconds,
                "equal_to_generate": f"{equal}/16", "ok": equal == 16 if precision == "fp32" else equal >= 12}
    except Exception as exc:
        return {"ran": True, "ok": False, "error": repr(exc), "trace": traceback.format_exc()[-2000:]}


def triton_part(reference: np.ndarray) -> dict[str, Any]:
    """Serve the KIND_GPU and CPU configs in one tritonserver; compare embeddings; perf_analyzer both."""
    try:
        from coalesce_client import EmbeddingClient
        from coalesce_tools.launcher import LaunchError, ServerOptions, TritonServer, find_triton, free_port

        find_triton()
    except Exception as exc:
        return {"ran": False, "why": f"no tritonserver or serve extra here: {exc}"}
    import shutil
    import tempfile

    repo = Path(tempfile.mkdtemp(prefix="gpu-check-repo-"))
    for name, source in (("minilm", ROOT / "model_repository" / "minilm"),
                         ("minilm_gpu", ROOT / "scripts" / "gpu" / "model_repository" / "minilm_gpu")):
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(source / "config.pbtxt", repo / name / "config.pbtxt")
        for item in VERSION_DIR.iterdir():
            (repo / name / "1" / item.name).symlink_to(item.resolve())
    options = ServerOptions(model_repository=repo, host="127.0.0.1", http_port=free_port(), grpc_port=free_port(),
                            metrics_port=free_port(), model_control="explicit", load_models=("minilm", "minilm_gpu"))
    out: dict[str, Any] = {"ran": True}
    try:
        with TritonServer(options) as server:
            with EmbeddingClient(server.grpc_url, model="minilm_gpu") as client:
                vectors = client.embed(TEXTS[:6])
            out["cosine_min"] = cosine_min(vectors, reference[:6])
            out["ok"] = out["cosine_min"] >= 0.999
            out["runtime_log"] = [line for line in server.log_text().splitlines() if "runtime '" in line][-2:]
            try:
                from coalesce_tools import perfanalyzer
                from perf import workloads

                data = repo / "queries.json"
                data.write_text(json.dumps(workloads.to_input_data(workloads.generate("queries", 2000, 0))))
                for model in ("minilm_gpu", "minilm"):
                    point = perfanalyzer.measure(model=model, protocol="grpc", url=server.grpc_url,
                                                 grpc_url=server.grpc_url, input_data=data, concurrency=64,
                                                 request_count=500, workdir=repo)
                    out[f"perf_{model}"] = {k: point[k] for k in ("throughput_per_s", "p50_ms", "p99_ms", "avg_batch")}
            except Exception as exc:
                out["perf_analyzer"] = f"not run: {exc!r}"
    except LaunchError as exc:
        out.update(ok=False, error=str(exc)[-3000:])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
