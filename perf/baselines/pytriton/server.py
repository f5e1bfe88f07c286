"""Baseline ``pytriton``: the same function bound with PyTriton's ``@batch``.

This is what a user who picks PyTriton writes: one inference function, decorated with
``@batch`` so PyTriton concatenates the requests Triton's dynamic batcher hands it into
one array, tokenised together and padded to the longest row in arrival order, then one
forward pass. Same ONNX file, tokenizer, truncation, pooling and dynamic-batching
settings as ``minilm``. PyTriton runs its own tritonserver (from the same wheel) on the
ports given, so perf_analyzer and the statistics API reach it as they reach ours.

Run: ``python -m perf.baselines.pytriton.server --version-dir model_repository/minilm/1``
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig
from tokenizers import Tokenizer

from coalesce_tools.launcher import library_path

MODEL_NAME = "pytriton"


class Embedder:
    """Tokenise all rows together, pad to the longest, one pass, mean-pool, normalise."""

    def __init__(self, version_dir: Path, threads: int) -> None:
        """Load the tokenizer and the ONNX session from ``version_dir``."""
        self.tokenizer = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length=256)
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(version_dir / "model.onnx"), options,
                                            providers=["CPUExecutionProvider"])

    @batch
    def __call__(self, TEXT: np.ndarray) -> dict[str, np.ndarray]:
        """Embed one batch; ``TEXT`` is [rows, 1] bytes."""
        encodings = self.tokenizer.encode_batch([t.decode("utf-8") for t in TEXT[:, 0]])
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        hidden = self.session.run(None, {"input_ids": ids, "attention_mask": mask,
                                         "token_type_ids": np.zeros_like(ids)})[0]
        weights = mask[:, :, None].astype(np.float32)
        pooled = (hidden * weights).sum(1) / np.clip(weights.sum(1), 1e-9, None)
        pooled /= np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
        return {"EMBEDDING": pooled.astype(np.float32)}


class BaselineServer:
    """This baseline in its own process (PyTriton starts its own tritonserver); a context manager."""

    def __init__(self, version_dir: Path, *, http_port: int, grpc_port: int, metrics_port: int,
                 log_path: Path, ready_timeout_s: float = 180.0) -> None:
        """Prepare (not start) the baseline on the given ports; its log goes to ``log_path``."""
        self.version_dir = version_dir
        self.http_url = f"127.0.0.1:{http_port}"
        self.grpc_url = f"127.0.0.1:{grpc_port}"
        self._ports = (http_port, grpc_port, metrics_port)
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> BaselineServer:
        root = Path(__file__).resolve().parents[3]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
        http, grpc, metrics = self._ports
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "perf.baselines.pytriton.server", "--version-dir", str(self.version_dir),
                 "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
                cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.ready_timeout_s
        url = f"http://{self.http_url}/v2/models/{MODEL_NAME}/ready"
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                break
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return self
            time.sleep(0.5)
        self.__exit__()
        tail = self.log_path.read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError("the pytriton baseline did not become ready; last log lines:\n" + "\n".join(tail))

    def __exit__(self, *exc: object) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)  # PyTriton stops its tritonserver on SIGINT
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main(argv: list[str] | None = None) -> int:
    """Serve the baseline until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version-dir", type=Path, default=Path("model_repository/minilm/1"))
    parser.add_argument("--http-port", type=int, default=8010)
    parser.add_argument("--grpc-port", type=int, default=8011)
    parser.add_argument("--metrics-port", type=int, default=8012)
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: all cores)")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-queue-delay-us", type=int, default=2000)
    parser.add_argument("--preferred-batch-sizes", default="16,32,64")
    args = parser.parse_args(argv)
    # PyTriton starts tritonserver with this process's environment; its stub links libpython too.
    os.environ["LD_LIBRARY_PATH"] = library_path()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pytriton-baseline %(levelname)s %(message)s")
    config = TritonConfig(http_address="127.0.0.1", http_port=args.http_port, grpc_address="127.0.0.1",
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port)
    batcher = DynamicBatcher(max_queue_delay_microseconds=args.max_queue_delay_us,
                             preferred_batch_size=[int(s) for s in args.preferred_batch_sizes.split(",")])
    # The bench reads the statistics API, which PyTriton puts behind a generated token by
    # default; this server listens on 127.0.0.1 only, so no endpoint is restricted.
    with Triton(config=config, security_config=TritonSecurityConfig(restricted_endpoints=[])) as triton:
        triton.bind(model_name=MODEL_NAME, infer_func=Embedder(args.version_dir, args.threads),
                    inputs=[Tensor(name="TEXT", dtype=bytes, shape=(1,))],
                    outputs=[Tensor(name="EMBEDDING", dtype=np.float32, shape=(384,))],
                    config=ModelConfig(max_batch_size=args.max_batch_size, batcher=batcher), strict=True)
        triton.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
