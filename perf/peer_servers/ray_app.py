"""Peer ``rayserve``: the embedding deployment a Ray Serve user commonly writes.

One replica holding an ONNX Runtime session over the shipped ``model.onnx`` and the
``tokenizers`` tokenizer of ``tokenizer.json``; requests are grouped by ``@serve.batch``
(up to 32, waiting at most ``--batch-wait-timeout-s``), tokenised together, padded to
the longest in arrival order, one forward pass, mean pooling over the attention mask
and L2 normalisation (= sentence-transformers ``encode``), truncated at 256 tokens.
HTTP JSON in and out: ``POST /embed`` with ``{"text": "..."}`` answers
``{"embedding": [...]}``.

Runs in the Ray venv (``.bench/venv-ray``, made by ``scripts/setup_peers.sh``), not the
project's: it imports nothing of this repository.

Run: ``.bench/venv-ray/bin/python perf/peer_servers/ray_app.py --version-dir model_repository/minilm/1``
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

#: Rows per forward pass at most, as an Infinity user sets ``--batch-size 32``.
MAX_BATCH_SIZE = 32
MAX_SEQUENCE_LENGTH = 256
#: The route the deployment answers on.
ROUTE = "/embed"


def build_app(version_dir: Path, *, batch_wait_timeout_s: float, intra_op_threads: int, replica_cpus: float) -> Any:
    """The Serve application: one replica of the batched embedder, bound to ``version_dir``'s files."""
    import onnxruntime as ort
    from ray import serve
    from starlette.requests import Request
    from tokenizers import Tokenizer

    # Serve's own advice for @serve.batch: let a replica hold at least a batch of requests (its
    # default of 5 in flight would cap every batch at 5); twice the batch so the next one gathers
    # while the current one runs.
    @serve.deployment(num_replicas=1, max_ongoing_requests=2 * MAX_BATCH_SIZE,
                      ray_actor_options={"num_cpus": replica_cpus})
    class Embedder:
        def __init__(self, version_dir: str) -> None:
            self.tokenizer = Tokenizer.from_file(str(Path(version_dir) / "tokenizer.json"))
            self.tokenizer.enable_truncation(max_length=MAX_SEQUENCE_LENGTH)
            self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
            options = ort.SessionOptions()
            options.intra_op_num_threads = intra_op_threads
            self.session = ort.InferenceSession(str(Path(version_dir) / "model.onnx"), options,
                                                providers=["CPUExecutionProvider"])

        @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=batch_wait_timeout_s)
        async def embed(self, texts: list[str]) -> list[list[float]]:
            encodings = self.tokenizer.encode_batch(texts)
            ids = np.array([e.ids for e in encodings], dtype=np.int64)
            mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
            hidden = self.session.run(None, {"input_ids": ids, "attention_mask": mask,
                                             "token_type_ids": np.zeros_like(ids)})[0]
            weights = mask[:, :, None].astype(np.float32)
            pooled = (hidden * weights).sum(1) / np.clip(weights.sum(1), 1e-9, None)
            pooled /= np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
            return [row.tolist() for row in pooled.astype(np.float32)]

        async def __call__(self, request: Request) -> dict[str, list[float]]:
            body = await request.json()
            return {"embedding": await self.embed(body["text"])}

    # ``serve.deployment`` turns the class into a Deployment (typed only where Ray is installed).
    deployment: Any = Embedder
    return deployment.bind(str(version_dir.resolve()))


def main(argv: list[str] | None = None) -> int:
    """Start Ray and the application, serve until SIGTERM or SIGINT, then shut both down."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version-dir", type=Path, default=Path("model_repository/minilm/1"))
    parser.add_argument("--port", type=int, default=8020)
    parser.add_argument("--batch-wait-timeout-s", type=float, default=0.002,
                        help="as coalesce's 2 ms max_queue_delay (Serve's default is 0.01)")
    parser.add_argument("--intra-op-threads", type=int, default=0, help="ONNX Runtime threads (0: every core)")
    parser.add_argument("--temp-dir", default=None, help="Ray's session folder (logs, sockets)")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    cores = os.cpu_count() or 1
    # The replica asks for every core: ONNX Runtime uses them all, as in every other system here.
    ray.init(num_cpus=cores, include_dashboard=False, _temp_dir=args.temp_dir, log_to_driver=False)
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(args.version_dir, batch_wait_timeout_s=args.batch_wait_timeout_s,
                            intra_op_threads=args.intra_op_threads, replica_cpus=float(cores)),
                  name="embed", route_prefix=ROUTE)
        sys.stdout.write(f"ray_app: serving on http://127.0.0.1:{args.port}{ROUTE}\n")
        sys.stdout.flush()
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
