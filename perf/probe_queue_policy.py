"""``python -m perf.probe_queue_policy``: does a ``default_queue_policy`` make Triton 2.51's batcher stall?

One tritonserver serves the shipped minilm twice (every core, no row cache): as shipped,
with ``dynamic_batching.default_queue_policy { max_queue_size: 256 }``, and without the
policy. The same closed-loop HTTP generator as ``perf.peers`` drives each at concurrency 1
and 16 in turn; a stalled request shows as a latency near 500 ms, the dynamic batcher's
idle wait. Prints one line per point; writes nothing.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from coalesce_tools.launcher import ServerOptions, TritonServer, free_port
from perf import closed_loop, repository, workloads

#: A request at least this slow waited out the batcher's 500 ms idle wait.
STALL_MS = 450.0


def variants() -> dict[str, str]:
    """The shipped config (every core, no row cache) with and without its queue policy."""
    base = repository.with_parameters(repository.single_model_config(), {"cache_bytes": "0"})
    without, count = re.subn(r"default_queue_policy \{[^}]*\}", "", base)
    if count != 1:
        raise ValueError("the shipped config has no default_queue_policy to remove")
    return {"policy": base, "nopolicy": without}


def main(argv: list[str] | None = None) -> int:
    """Serve both variants and print texts/s, p50, p99 and stalled requests per point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="coalesce-policy-"))
    for name, config in variants().items():
        repository.add_model(folder, name, repository.renamed(config, name))
    bodies = closed_loop.encode_bodies(
        workloads.generate("queries", 2000, 3),
        lambda text: {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]})
    options = ServerOptions(model_repository=folder, host="127.0.0.1", http_port=free_port(), grpc_port=free_port(),
                            metrics_port=free_port(), model_control="explicit", load_models=tuple(variants()))
    with TritonServer(options) as server:
        for round_index in range(args.rounds):
            for concurrency in (1, 16):
                for name in variants():
                    result = closed_loop.closed_loop(f"http://{server.http_url}/v2/models/{name}/infer", bodies,
                                                     concurrency, duration_s=args.duration_s, warmup_s=1.0)
                    stalled = sum(1 for s in result.samples if s.ok and s.latency_s * 1e3 >= STALL_MS)
                    sys.stdout.write(f"round {round_index} {name:8s} c={concurrency:2d}: "
                                     f"{result.throughput_per_s:6.1f} texts/s, p50 {result.latency_ms(0.5) or 0:6.1f} "
                                     f"ms, p99 {result.latency_ms(0.99) or 0:6.1f} ms, {stalled} of {result.successes} "
                                     f"requests >= {STALL_MS:.0f} ms, {result.errors} errors\n")
                    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
